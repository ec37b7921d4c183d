"""The 0.5.23 ``transfer_mamba`` JIT-kernel ops (``sglang.kernels.ops.mamba.transfer_mamba``).

0.5.23's ``MambaPoolHost`` loads and backs up Mamba state with them. Their
checks are the JIT kernel's ``TensorMatcher`` ones, with its messages; the bytes
move as the ``kernel`` ops of :mod:`.kvcacheio` move them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hicache_obs.lab.sglang.kernels import checks
from hicache_obs.lab.sglang.kernels.arguments import as_int, plain
from hicache_obs.lab.sglang.kernels.checks import KernelCheckError, no_negatives, pointers
from hicache_obs.lab.sglang.kernels.memory import Side, copy_items, layer_first, page_first, tensor_side

__all__ = ["TRANSFER_MAMBA_MODULE", "TRANSFER_MAMBA_OPS", "transfer_kv_mamba_pf_lf", "transfer_kv_mamba_lf_pf"]

TRANSFER_MAMBA_MODULE = "sglang.kernels.ops.mamba.transfer_mamba"


def _dl_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _dl_device(t: torch.Tensor) -> str:
    return "cuda" if t.is_cuda else t.device.type


def _match_failed(t: torch.Tensor, name: str, cause: str) -> KernelCheckError:
    shape = ", ".join(str(s) for s in t.shape)
    strides = ", ".join(str(s) for s in t.stride())
    return KernelCheckError(
        f"Tensor match failed for Tensor<{shape}>[strides=<{strides}>, dtype={_dl_name(t)}, device={_dl_device(t)}] "
        f"({name})\n- Root cause: {cause}"
    )


def _match_mamba_indices(src_indices: torch.Tensor, dst_indices: torch.Tensor) -> int:
    """``TensorMatcher({L}).with_dtype<int64_t>().with_device<kDLGPU>()`` on both index tensors; returns L."""
    length: int | None = None
    for position, (name, t) in enumerate((("src_indices", src_indices), ("dst_indices", dst_indices))):
        if t.dim() != 1:
            raise _match_failed(t, name, f"Tensor dimension mismatch: expected 1 but got {t.dim()}")
        if length is None:
            length = t.shape[0]
        elif t.shape[0] != length:
            raise _match_failed(
                t, name, f"Size mismatch for shape#0('num_indices'): expected {length} but got {t.shape[0]}"
            )
        if not t.is_contiguous():
            raise _match_failed(t, name, "Tensor is not contiguous as expected")
        if t.dtype != torch.int64:
            cause = (
                f"Dtype value [{_dl_name(t)}] not in the allowed options: [int64]"
                if position == 0
                else f"DType mismatch: expected int64 but got {_dl_name(t)}"
            )
            raise _match_failed(t, name, cause)
        if not checks.on_device(t):
            cause = (
                f"Device value [{_dl_device(t)}] not in the allowed options: [cuda]"
                if position == 0
                else f"Device mismatch: expected cuda but got {_dl_device(t)}"
            )
            raise _match_failed(t, name, cause)
    assert length is not None
    return length


def _check_mamba_item(item_size: int) -> int:
    item_size = as_int(item_size, "item_size")
    if item_size <= 0:
        raise KernelCheckError("transfer_mamba: item_size must be positive")
    if item_size % 16 != 0:
        raise KernelCheckError("transfer_mamba: item_size must be 16-byte aligned (uint4)")
    return item_size


def _match_table(src_ptrs: torch.Tensor, num_layers: int) -> None:
    """``TensorMatcher({num_layers}).with_dtype<uint64_t>()`` on the pointer table."""
    if src_ptrs.dim() != 1:
        raise _match_failed(src_ptrs, "src_ptrs", f"Tensor dimension mismatch: expected 1 but got {src_ptrs.dim()}")
    if src_ptrs.shape[0] != num_layers:
        raise _match_failed(
            src_ptrs, "src_ptrs", f"Size mismatch for shape#0: expected {num_layers} but got {src_ptrs.shape[0]}"
        )
    if not src_ptrs.is_contiguous():
        raise _match_failed(src_ptrs, "src_ptrs", "Tensor is not contiguous as expected")
    if src_ptrs.dtype != torch.uint64:
        raise _match_failed(
            src_ptrs, "src_ptrs", f"Dtype value [{_dl_name(src_ptrs)}] not in the allowed options: [uint64]"
        )


def _host_indices(src_indices: torch.Tensor, dst_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s, d = plain(src_indices), plain(dst_indices)
    no_negatives(s, "src_indices")
    no_negatives(d, "dst_indices")
    return s, d


def transfer_kv_mamba_pf_lf(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    num_warps_per_item: int = 32,
) -> None:
    """Load one layer of Mamba state: page-first host buffer (``src_layout_dim`` bytes per slot) to a layer-first layer."""
    count = _match_mamba_indices(src_indices, dst_indices)
    item_size = _check_mamba_item(item_size)
    if count == 0:
        return
    s, d = _host_indices(src_indices, dst_indices)
    layer_id, layout = as_int(layer_id, "layer_id"), as_int(src_layout_dim, "src_layout_dim")
    so, do = page_first(s, layer_id, layout, item_size), layer_first(d, item_size)
    copy_items(tensor_side("src", src), so, tensor_side("dst", dst), do, item_size)


def transfer_kv_mamba_lf_pf(
    src_ptrs: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    num_warps_per_item: int = 32,
) -> None:
    """Back up every layer of Mamba state: per-layer bases in a uint64 table to a page-first host buffer.

    The real launcher also wants ``src_ptrs`` on the indices' CUDA device; that is
    not checked here, since SGLang builds the table on the state buffers' device,
    which is the CPU in a CPU-only run.
    """
    count = _match_mamba_indices(src_indices, dst_indices)
    num_layers = as_int(num_layers, "num_layers")
    _match_table(src_ptrs, num_layers)
    item_size = _check_mamba_item(item_size)
    if num_layers <= 0:
        raise KernelCheckError("transfer_mamba: num_layers must be positive")
    if count == 0:
        return
    s, d = _host_indices(src_indices, dst_indices)
    layout = as_int(dst_layout_dim, "dst_layout_dim")
    sptr, so = pointers(src_ptrs, "src_ptrs", num_layers), layer_first(s, item_size)
    for layer in range(num_layers):
        do = page_first(d, layer, layout, item_size)
        copy_items(Side(f"src_ptrs[{layer}]", sptr[layer], None), so, tensor_side("dst", dst), do, item_size)


TRANSFER_MAMBA_OPS: dict[str, Callable[..., None]] = {
    "transfer_kv_mamba_pf_lf": transfer_kv_mamba_pf_lf,
    "transfer_kv_mamba_lf_pf": transfer_kv_mamba_lf_pf,
}
"""The ``sglang.kernels.ops.mamba.transfer_mamba`` ops 0.5.23's ``MambaPoolHost`` imports."""
