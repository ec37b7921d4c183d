"""sgl-kernel's launcher checks, with the launchers' own messages.

Every ``kernel`` op of ``sgl_kernel.kvcacheio`` goes through
``transfer_kv_launcher``; :data:`LAUNCHER_CHECKS` says which further checks each
op's wrapper makes around it (the layer count of an all-layer op, the heads of a
page_head op, the MLA per-layer quota default), and :func:`check_launch` applies
them in the wrappers' order. The ``direct`` ops check with :func:`check_direct`;
pointer tables are read with :func:`pointers`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from hicache_obs.errors import HiCacheError
from hicache_obs.lab.sglang.kernels.arguments import as_int, plain

__all__ = ["KernelCheckError", "LauncherChecks", "LAUNCHER_CHECKS", "Launch", "check_launch"]

BLOCK_QUOTA = 2
"""sgl-kernel's default ``block_quota``."""
NUM_WARPS_PER_BLOCK = 32
"""sgl-kernel's CUDA default ``num_warps_per_block`` (16 on ROCm)."""
_WARP_SIZE = 32
_MAX_THREADS_PER_BLOCK = 1024
_U64 = (1 << 64) - 1

DEVICE_INDEX_TYPES: frozenset[str] = frozenset({"cuda"})
"""Device types the kernels accept index tensors on: sgl-kernel's are CUDA only. The CPU
server stand-ins add ``cpu``, where the device pools themselves live on the CPU."""


def on_device(t: torch.Tensor) -> bool:
    """Whether a kernel accepts ``t`` as device-side indices (``is_cuda``, or a type of :data:`DEVICE_INDEX_TYPES`)."""
    return bool(t.is_cuda) or t.device.type in DEVICE_INDEX_TYPES


class KernelCheckError(HiCacheError, RuntimeError):
    """A kernel launcher refused its arguments; the message is the launcher's own where it has one."""


_SCALAR_NAMES = {
    torch.uint8: "Byte",
    torch.int8: "Char",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.float16: "Half",
    torch.float32: "Float",
    torch.float64: "Double",
    torch.bfloat16: "BFloat16",
    torch.bool: "Bool",
    torch.uint64: "UInt64",
}


def _scalar_name(dtype: torch.dtype) -> str:
    """ATen's name for a dtype, as its ``expected scalar type`` errors print it."""
    return _SCALAR_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def require_dtype(t: torch.Tensor, dtype: torch.dtype) -> None:
    """Mirror ``Tensor::data_ptr<T>()``'s dtype check."""
    if t.dtype != dtype:
        raise KernelCheckError(f"expected scalar type {_scalar_name(dtype)} but found {_scalar_name(t.dtype)}")


def no_negatives(values: torch.Tensor, name: str) -> None:
    """Refuse a negative index: sgl-kernel builds disagree on what one does."""
    negative = (values < 0).nonzero()
    if negative.numel():
        at = int(negative[0, 0])
        raise KernelCheckError(
            f"{name} holds {int(values[at])} at position {at}: sgl-kernel builds disagree on negative indices "
            f"(some skip the item, others copy out of bounds), so the CPU stand-in refuses them"
        )


def pointers(table: torch.Tensor, name: str, count: int) -> list[int]:
    """The first ``count`` addresses of a uint64 pointer table."""
    require_dtype(table, torch.uint64)
    values = plain(table).view(torch.int64).tolist()
    if len(values) < count:
        raise KernelCheckError(f"{name} holds {len(values)} layer pointers but the kernel reads {count}")
    return [v & _U64 for v in values[:count]]


# --------------------------------------------------------------------------- kernel ops

_SOURCE_K_LAYERS = "Number of layers in source k tensor does not match num_layers"
_SOURCE_LAYERS = "Number of layers in source tensor does not match num_layers"


@dataclass(frozen=True)
class LauncherChecks:
    """The checks one op's wrapper makes around ``transfer_kv_launcher``'s."""

    layers: str | None = None
    """An all-layer op: its message when ``num_layers`` is not its first pointer table's ``size(0)`` (checked first)."""
    heads: bool = False
    """A page_head op: ``page_size`` and ``head_num`` must be positive (checked after the launcher's)."""
    quota_from_env: bool = False
    """An MLA per-layer op: ``block_quota=None`` reads ``SGLANG_HICACHE_BLOCK_QUOTA`` (default 2)."""


LAUNCHER_CHECKS: dict[str, LauncherChecks] = {
    "transfer_kv_per_layer": LauncherChecks(),
    "transfer_kv_per_layer_pf_lf": LauncherChecks(),
    "transfer_kv_per_layer_ph_lf": LauncherChecks(heads=True),
    "transfer_kv_all_layer": LauncherChecks(layers=_SOURCE_K_LAYERS),
    "transfer_kv_all_layer_lf_pf": LauncherChecks(layers=_SOURCE_K_LAYERS),
    "transfer_kv_all_layer_lf_ph": LauncherChecks(layers=_SOURCE_K_LAYERS, heads=True),
    "transfer_kv_per_layer_mla": LauncherChecks(quota_from_env=True),
    "transfer_kv_per_layer_mla_pf_lf": LauncherChecks(quota_from_env=True),
    "transfer_kv_all_layer_mla": LauncherChecks(layers=_SOURCE_LAYERS),
    "transfer_kv_all_layer_mla_lf_pf": LauncherChecks(layers=_SOURCE_LAYERS),
}
"""The ``kernel`` ops of ``sgl_kernel.kvcacheio`` and the checks each makes besides the launcher's."""


class Launch(NamedTuple):
    """What the checks let through: the host copies of the indices and the integer arguments."""

    src: torch.Tensor
    dst: torch.Tensor
    item_size: int
    num_layers: int = 0
    """All-layer ops only."""
    page_size: int = 0
    """page_head ops only."""
    head_num: int = 0
    """page_head ops only."""


def check_launch(
    op: str,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: Any,
    block_quota: Any,
    num_warps_per_block: Any,
    *,
    num_layers: Any = None,
    first_table: torch.Tensor | None = None,
    page_size: Any = None,
    head_num: Any = None,
) -> Launch | None:
    """``op``'s checks (:data:`LAUNCHER_CHECKS`) in its wrapper's order; None when nothing is copied.

    ``num_layers`` and ``first_table`` are an all-layer op's, ``page_size`` and
    ``head_num`` a page_head op's.
    """
    checks = LAUNCHER_CHECKS[op]
    layers = 0
    if checks.layers is not None:
        if first_table is None:
            raise TypeError(f"{op}: its layer-count check needs first_table")
        layers = as_int(num_layers, "num_layers")
        if layers != first_table.size(0):
            raise KernelCheckError(checks.layers)
    if checks.quota_from_env:
        block_quota = _quota_from_env(block_quota)
    launched = _launch(src_indices, dst_indices, item_size, block_quota, num_warps_per_block)
    if launched is None:
        return None
    src, dst, size = launched
    if not checks.heads:
        return Launch(src, dst, size, layers)
    return Launch(src, dst, size, layers, *_check_heads(page_size, head_num))


def _launch(
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int,
    num_warps_per_block: int,
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``transfer_kv_launcher``'s checks: the host copies of the indices and ``item_size``, or None when nothing is copied."""
    item_size = as_int(item_size, "item_size")
    if not on_device(src_indices):
        raise KernelCheckError("Source indices must be a CUDA tensor")
    if not on_device(dst_indices):
        raise KernelCheckError("Destination indices must be a CUDA tensor")
    if src_indices.dtype != torch.int64:
        raise KernelCheckError("Source indices must be of type long")
    if dst_indices.dtype != torch.int64:
        raise KernelCheckError("Destination indices must be of type long")
    if src_indices.numel() != dst_indices.numel():
        raise KernelCheckError("Source and destination indices must have the same length")
    if item_size % 8 != 0:
        raise KernelCheckError("Item byte size must be divisible by 8")
    block_quota = as_int(block_quota, "block_quota")
    num_warps_per_block = as_int(num_warps_per_block, "num_warps_per_block")
    if block_quota <= 0 or num_warps_per_block <= 0:
        raise KernelCheckError(
            f"block_quota={block_quota} and num_warps_per_block={num_warps_per_block} must be positive: "
            f"the launcher divides by their product"
        )
    if src_indices.numel() == 0:
        raise KernelCheckError(
            "a transfer of 0 items: sgl-kernel's launcher computes items_per_warp = 0 and then divides by it "
            "(the process dies of SIGFPE); callers must skip empty transfers"
        )
    if num_warps_per_block * _WARP_SIZE > _MAX_THREADS_PER_BLOCK:
        raise KernelCheckError(
            f"CUDA error: invalid configuration argument ({num_warps_per_block} warps per block is "
            f"{num_warps_per_block * _WARP_SIZE} threads, over {_MAX_THREADS_PER_BLOCK})"
        )
    src, dst = plain(src_indices), plain(dst_indices)
    no_negatives(src, "src_indices")
    no_negatives(dst, "dst_indices")
    if item_size <= 0:
        return None
    return src, dst, item_size


def _quota_from_env(block_quota: Any) -> Any:
    """Newer sgl-kernel builds default the MLA per-layer quota to ``SGLANG_HICACHE_BLOCK_QUOTA`` or 2."""
    if block_quota is not None:
        return block_quota
    try:
        return int(os.environ.get("SGLANG_HICACHE_BLOCK_QUOTA", BLOCK_QUOTA))
    except ValueError:
        return BLOCK_QUOTA


def _check_heads(page_size: Any, head_num: Any) -> tuple[int, int]:
    page_size, head_num = as_int(page_size, "page_size"), as_int(head_num, "head_num")
    if page_size <= 0 or head_num <= 0:
        raise KernelCheckError(
            f"page_size={page_size} and head_num={head_num} must be positive: the page_head kernel divides by both"
        )
    return page_size, head_num


# --------------------------------------------------------------------------- direct ops


def check_direct(src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: Any) -> int:
    """The ``direct`` ops' checks on the indices and ``page_size``; returns ``page_size`` as an int."""
    page_size = as_int(page_size, "page_size")
    if src_indices.numel() != dst_indices.numel():
        raise KernelCheckError("Source and destination indices must have the same length")
    if page_size <= 0:
        raise KernelCheckError("Page size must be positive")
    if src_indices.numel() % page_size != 0:
        raise KernelCheckError("Source indices size must be divisible by page size")
    return page_size

