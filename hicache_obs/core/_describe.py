"""What an index tensor of the controller is, as the ``TensorRef`` its events carry.

:func:`describe` reads one tensor's device, size, dtype, address and (where its values sit
on the CPU, or were read before) the runs of its values; :func:`submission_refs` describes
every index tensor of a submission, host then device per pool, with the runs its pairs
already hold. A pool that reuses another pool's indices is described without runs: it does
not own those slots.
"""

from __future__ import annotations

from typing import Any

import torch

from .._native import runs_of, side_runs
from ..events._schema import TensorRef
from ._operations import CacheOperation
from ._runtime import Runtime
from ._torch_compat import plain_tensor_calls

__all__ = ["describe", "dtype_name", "submission_refs"]

_DTYPE_NAMES = {torch.int64: "int64", torch.int32: "int32"}


def dtype_name(dtype: torch.dtype) -> str:
    """``int64``, ``int32``, or torch's name of ``dtype`` without its ``torch.`` prefix."""
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def describe(runtime: Runtime, t: torch.Tensor, pool: str, role: str, runs: Any = None) -> TensorRef:
    """Describe ``t``, ``pool``'s ``role`` (``"host"`` or ``"device"``) tensor; ``runs`` are its
    values when known (``()``: none to report), else they are read when ``t`` is on the CPU
    (in place, through a numpy view)."""
    dev = runtime.tensor_device(t)
    if runs is None and dev == "cpu":
        runs = runs_of(t.numpy())  # int64 (validated): never requires grad
    if type(t) is torch.Tensor:  # no __torch_function__ to skip
        numel = t.numel()
        dtype = t.dtype
        ptr = t.data_ptr() if numel else 0
    else:  # metadata only: skip a subclass's __torch_function__ (the sim runtime's is slow)
        with plain_tensor_calls():
            numel = t.numel()
            dtype = t.dtype
            ptr = t.data_ptr() if numel else 0
    return TensorRef(
        pool=pool,
        role=role,  # type: ignore[arg-type]  # "host" | "device", checked by callers
        device=dev,
        numel=numel,
        dtype=dtype_name(dtype),
        ptr=ptr,
        indices=runs or None,
    )


def submission_refs(runtime: Runtime, op: CacheOperation, pairs: Any, *, values: bool = True) -> list[TensorRef]:
    """The tensors of a submission (``pairs``: its ``IndexPair`` list), host then device per
    pool; run lists taken from the pairs' runs when known; ``values=False``: metadata only."""
    aliased = {t.pool for t in op.pool_transfers or () if t.indices_from_pool is not None}
    refs = []
    for p in pairs:
        pool, h, d, pr = p.pool, p.host, p.device, p.runs
        if pool in aliased or not values:  # a pool that reuses another pool's indices does not own those slots
            refs.append(describe(runtime, h, pool, "host", ()))
            refs.append(describe(runtime, d, pool, "device", ()))
        elif pr is not None:
            refs.append(describe(runtime, h, pool, "host", side_runs(pr, 0)))
            refs.append(describe(runtime, d, pool, "device", side_runs(pr, 1)))
        else:
            refs.append(describe(runtime, h, pool, "host"))
            refs.append(describe(runtime, d, pool, "device"))
    return refs
