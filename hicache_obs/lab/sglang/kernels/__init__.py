"""Pure-torch stand-ins for the KV-transfer kernels of SGLang's HiCache host pools.

SGLang's host pools (``MHATokenToKVPoolHost``, ``MambaPoolHost`` and the MLA
pools) copy KV and Mamba state with sgl-kernel's ``sgl_kernel.kvcacheio`` ops
and, from 0.5.23, with ``sglang.kernels.ops.mamba.transfer_mamba``; neither
runs without CUDA. The stand-ins keep the names, keywords and defaults, apply
the launchers' argument checks with their messages, and copy the same bytes
with torch indexing. Index tensors count as CUDA tensors when their
``is_cuda`` says so. One concept per module:

* :mod:`.memory`: registered buffers (:class:`Memory`, :data:`MEMORY`,
  :func:`register_buffers`) that pointer-table entries resolve in, and the
  byte copies;
* :mod:`.arguments`: index tensors read back to the host, integer arguments;
* :mod:`.checks`: sgl-kernel's launcher checks, one table of what each op
  checks (:data:`~.checks.LAUNCHER_CHECKS`);
* :mod:`.kvcacheio`: the ``sgl_kernel.kvcacheio`` ops, ``kernel`` and ``direct``;
* :mod:`.mamba`: the 0.5.23 ``transfer_mamba`` ops;
* :mod:`.installation`: :func:`install` makes the ops importable under SGLang's
  module names, :func:`bind` fills in the op names a SGLang module skipped
  importing on a CPU.
"""

from __future__ import annotations

from hicache_obs.lab.sglang.kernels.arguments import plain as _plain  # noqa: F401  (tests read indices back as the ops do)
from hicache_obs.lab.sglang.kernels.checks import KernelCheckError
from hicache_obs.lab.sglang.kernels.installation import OPS, Installation, bind, install, unbind, uninstall
from hicache_obs.lab.sglang.kernels.kvcacheio import (
    KVCACHEIO_MODULE,
    KVCACHEIO_OPS,
    transfer_kv_all_layer,
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_all_layer_lf_pf,
    transfer_kv_all_layer_lf_ph,
    transfer_kv_all_layer_mla,
    transfer_kv_all_layer_mla_lf_pf,
    transfer_kv_direct,
    transfer_kv_per_layer,
    transfer_kv_per_layer_direct_pf_lf,
    transfer_kv_per_layer_mla,
    transfer_kv_per_layer_mla_pf_lf,
    transfer_kv_per_layer_pf_lf,
    transfer_kv_per_layer_ph_lf,
)
from hicache_obs.lab.sglang.kernels.mamba import (
    TRANSFER_MAMBA_MODULE,
    TRANSFER_MAMBA_OPS,
    transfer_kv_mamba_lf_pf,
    transfer_kv_mamba_pf_lf,
)
from hicache_obs.lab.sglang.kernels.memory import MEMORY, Memory, UnmappedAddressError, register_buffers
from hicache_obs.lab.sglang.kernels.memory import flatten as _flatten  # noqa: F401  (tests walk buffers as register_buffers does)

__all__ = [
    "KernelCheckError",
    "UnmappedAddressError",
    "Memory",
    "MEMORY",
    "register_buffers",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_mamba_pf_lf",
    "transfer_kv_mamba_lf_pf",
    "KVCACHEIO_OPS",
    "TRANSFER_MAMBA_OPS",
    "OPS",
    "KVCACHEIO_MODULE",
    "TRANSFER_MAMBA_MODULE",
    "Installation",
    "install",
    "uninstall",
    "bind",
    "unbind",
]
