"""Pure-torch stand-ins for the KV-transfer kernels of SGLang's HiCache host pools.

SGLang's host pools (``MHATokenToKVPoolHost``, ``MambaPoolHost`` and the MLA
pools) copy KV and Mamba state with sgl-kernel's ``sgl_kernel.kvcacheio`` ops
and, from 0.5.23, with ``sglang.kernels.ops.mamba.transfer_mamba``; neither
runs without CUDA. The functions here keep the names, keywords and defaults,
apply the launchers' argument checks with their messages, and copy the same
bytes with torch indexing:

* ``kernel`` ops copy ``item_size`` bytes per index pair. A layer-first side
  addresses ``base + index * item_size`` from its per-layer base (a tensor's
  ``data_ptr()`` or one entry of a uint64 pointer table); a page-first side
  addresses ``base + index * layout_dim + layer_id * item_size`` in the whole
  buffer. Pointer-table entries are looked up in :data:`MEMORY`: register the
  buffers they point into with :func:`register_buffers`.
* ``direct`` ops copy tensor slices page by page, reading the indices back to
  the host first, as sgl-kernel's ``transfer_kv_direct`` family does.

:func:`install` makes the ops importable under SGLang's module names;
:func:`bind` fills in the op names a SGLang module skipped importing on a CPU.
Index tensors count as CUDA tensors when their ``is_cuda`` says so.
"""

from __future__ import annotations

import ast
import bisect
import dis
import importlib
import importlib.machinery
import importlib.util
import inspect
import operator
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ....errors import HiCacheError

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

KVCACHEIO_MODULE = "sgl_kernel.kvcacheio"
TRANSFER_MAMBA_MODULE = "sglang.kernels.ops.mamba.transfer_mamba"

_WARP_SIZE = 32
_MAX_THREADS_PER_BLOCK = 1024
_NUM_WARPS_PER_BLOCK = 32  # sgl-kernel's CUDA default (16 on ROCm)
_BLOCK_QUOTA = 2
_U64 = (1 << 64) - 1


class KernelCheckError(HiCacheError, RuntimeError):
    """A kernel launcher refused its arguments; the message is the launcher's own where it has one."""


class UnmappedAddressError(HiCacheError, RuntimeError):
    """A copy would touch bytes outside every registered buffer (or outside the tensor it was given)."""


# --------------------------------------------------------------------------- memory


class _Range:
    """One registered storage: its address span and a (weak, where torch allows) reference to it."""

    __slots__ = ("start", "nbytes", "_ref", "_strong")

    def __init__(self, storage: torch.UntypedStorage, preserved: bool) -> None:
        self.start = storage.data_ptr()
        self.nbytes = storage.nbytes()
        self._strong: torch.UntypedStorage | None = None
        self._ref: weakref.ReferenceType[torch.UntypedStorage] | None = None
        if preserved:
            try:
                self._ref = weakref.ref(storage)
            except TypeError:
                self._strong = storage
        else:
            self._strong = storage

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    def storage(self) -> torch.UntypedStorage | None:
        return self._strong if self._ref is None else self._ref()


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage: writes to it land in the storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Memory:
    """Byte ranges of registered tensor storages, for resolving raw addresses from pointer tables.

    A registration lasts as long as its storage: a freed buffer drops out, so a
    recycled address never resolves to a dead tensor.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: list[_Range] = []  # sorted by start
        self._starts: list[int] = []

    def register(self, tensor: torch.Tensor) -> None:
        """Register the whole untyped storage behind ``tensor`` (a view registers its base storage)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Memory.register takes a torch.Tensor, got {type(tensor).__name__}")
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        preserved = tensor.untyped_storage() is storage
        with self._lock:
            self._prune()
            for existing in self._ranges:
                if existing.storage() is storage:
                    return
            entry = _Range(storage, preserved)
            at = bisect.bisect_right(self._starts, entry.start)
            self._ranges.insert(at, entry)
            self._starts.insert(at, entry.start)

    def unregister(self, tensor: torch.Tensor) -> bool:
        """Forget the storage behind ``tensor``; False when it was not registered."""
        storage = tensor.untyped_storage()
        with self._lock:
            for i, existing in enumerate(self._ranges):
                if existing.storage() is storage:
                    del self._ranges[i]
                    del self._starts[i]
                    return True
        return False

    def clear(self) -> None:
        """Forget every registration."""
        with self._lock:
            self._ranges.clear()
            self._starts.clear()

    def ranges(self) -> list[tuple[int, int]]:
        """(start address, nbytes) of every live registration, by address."""
        with self._lock:
            self._prune()
            return [(r.start, r.nbytes) for r in self._ranges]

    def _prune(self) -> None:
        live = [r for r in self._ranges if r.storage() is not None]
        if len(live) != len(self._ranges):
            self._ranges = live
            self._starts = [r.start for r in live]

    def locate(self, address: int, nbytes: int, *, what: str = "address") -> tuple[torch.Tensor, int]:
        """The uint8 bytes of the registered storage holding ``[address, address + nbytes)``, and ``address``'s offset in them."""
        address, nbytes = operator.index(address), operator.index(nbytes)
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            nearest: _Range | None = None
            while i >= 0:
                entry = self._ranges[i]
                storage = entry.storage()
                if storage is not None and entry.start <= address < entry.end:
                    if address + nbytes <= entry.end:
                        return _storage_bytes(storage), address - entry.start
                    nearest = nearest or entry
                i -= 1
            count = sum(1 for r in self._ranges if r.storage() is not None)
        if nearest is not None:
            raise UnmappedAddressError(
                f"{what} {address:#x} (+{nbytes} bytes) runs {address + nbytes - nearest.end} bytes past the end of the "
                f"registered buffer [{nearest.start:#x}, {nearest.end:#x})"
            )
        raise UnmappedAddressError(
            f"{what} {address:#x} (+{nbytes} bytes) is in no registered buffer ({count} registered); "
            f"register the tensor that owns it with register_buffers()"
        )

    def view(self, address: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``nbytes`` registered bytes at ``address``; writes go through."""
        buf, at = self.locate(address, nbytes)
        return buf[at : at + nbytes]

    def gather(self, address: int, offsets: torch.Tensor, item_size: int) -> torch.Tensor:
        """A ``[len(offsets), item_size]`` uint8 copy of the items at ``address + offsets[i]``."""
        offsets = _as_offsets(offsets)
        buf, at = self._span(address, offsets, item_size, "address")
        return _gather(buf, at, offsets, item_size)

    def scatter(self, address: int, offsets: torch.Tensor, data: torch.Tensor) -> None:
        """Write row ``i`` of the uint8 ``[n, item_size]`` ``data`` to ``address + offsets[i]``."""
        offsets = _as_offsets(offsets)
        data = _as_rows(data, offsets.numel())
        buf, at = self._span(address, offsets, data.shape[1], "address")
        _scatter(buf, at, offsets, data)

    def _span(self, address: int, offsets: torch.Tensor, width: int, what: str) -> tuple[torch.Tensor, int]:
        if offsets.numel() == 0:
            return torch.empty(0, dtype=torch.uint8), 0
        lo, hi = int(offsets.min()), int(offsets.max()) + width
        buf, at = self.locate(address + lo, hi - lo, what=what)
        return buf, at - lo


MEMORY = Memory()
"""The registry the ops resolve pointer-table entries in."""


def _flatten(items: Iterable[Any]) -> Iterator[torch.Tensor]:
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            yield from _flatten(item)
        elif item is not None:
            raise TypeError(f"register_buffers takes tensors or sequences of tensors, got {type(item).__name__}")


def register_buffers(*tensors: torch.Tensor | Iterable[Any], memory: Memory | None = None) -> None:
    """Register every tensor (sequences of tensors are walked, None is skipped) in ``memory`` (default :data:`MEMORY`)."""
    target = MEMORY if memory is None else memory
    for tensor in _flatten(tensors):
        target.register(tensor)


# --------------------------------------------------------------------------- byte copies


def _as_offsets(offsets: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if not isinstance(offsets, torch.Tensor):
        offsets = torch.tensor(list(offsets), dtype=torch.int64)
    return _plain(offsets).to(torch.int64)


def _as_rows(data: torch.Tensor, count: int) -> torch.Tensor:
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[0] != count:
        raise ValueError(f"data must be a uint8 [{count}, item_size] tensor, got {data.dtype} {tuple(data.shape)}")
    return data


def _element_index(buf: torch.Tensor, at: int, offsets: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat view of ``buf`` and the index of each item's elements: 8-byte words when everything is aligned."""
    if width % 8 == 0 and at % 8 == 0 and bool((offsets % 8 == 0).all()):
        words = buf[: buf.numel() // 8 * 8].view(torch.int64)
        starts = torch.div(offsets + at, 8, rounding_mode="floor")
        return words, starts[:, None] + torch.arange(width // 8, device=buf.device)
    return buf, (offsets + at)[:, None] + torch.arange(width, device=buf.device)


def _gather(buf: torch.Tensor, at: int, offsets: torch.Tensor, width: int) -> torch.Tensor:
    if offsets.numel() == 0 or width <= 0:
        return torch.empty((offsets.numel(), max(width, 0)), dtype=torch.uint8)
    flat, index = _element_index(buf, at, offsets.to(buf.device), width)
    return flat[index].view(torch.uint8).reshape(offsets.numel(), width)


def _scatter(buf: torch.Tensor, at: int, offsets: torch.Tensor, data: torch.Tensor) -> None:
    width = data.shape[1]
    if offsets.numel() == 0 or width <= 0:
        return
    flat, index = _element_index(buf, at, offsets.to(buf.device), width)
    rows = data.to(buf.device).contiguous()
    flat[index] = rows.view(flat.dtype).reshape(index.shape)


class _Side(NamedTuple):
    """Where one side's items live: ``address`` plus per-item byte offsets; ``owner`` holds them, or None for a table pointer."""

    name: str
    address: int
    owner: torch.Tensor | None


def _tensor_side(name: str, tensor: torch.Tensor) -> _Side:
    return _Side(name, tensor.data_ptr(), tensor)


def _resolve(side: _Side, offsets: torch.Tensor, width: int, memory: Memory) -> tuple[torch.Tensor, int]:
    """The bytes holding ``side``'s items and the offset of ``side.address`` in them."""
    lo, hi = int(offsets.min()), int(offsets.max()) + width
    if side.owner is None:
        buf, at = memory.locate(side.address + lo, hi - lo, what=f"{side.name} address")
        return buf, at - lo
    storage = side.owner.untyped_storage()
    start = storage.data_ptr()
    first, last = side.address + lo, side.address + hi
    if first < start or last > start + storage.nbytes():
        raise UnmappedAddressError(
            f"{side.name}: the copy would touch [{first:#x}, {last:#x}), outside the {storage.nbytes()}-byte storage "
            f"[{start:#x}, {start + storage.nbytes():#x}) of the tensor passed as {side.name}"
        )
    return _storage_bytes(storage), side.address - start


def _copy(
    src: _Side, src_offsets: torch.Tensor, dst: _Side, dst_offsets: torch.Tensor, width: int, memory: Memory
) -> None:
    """Copy ``width`` bytes from ``src.address + src_offsets[i]`` to ``dst.address + dst_offsets[i]`` for every i."""
    if width <= 0 or src_offsets.numel() == 0:
        return
    sbuf, sat = _resolve(src, src_offsets, width, memory)
    dbuf, dat = _resolve(dst, dst_offsets, width, memory)
    _scatter(dbuf, dat, dst_offsets, _gather(sbuf, sat, src_offsets, width))


# --------------------------------------------------------------------------- index and table reading

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


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values on the CPU as a flat plain tensor (also for a subclass whose ``is_cuda`` is True)."""
    host = t.detach().cpu()
    if type(host) is not torch.Tensor:
        host = host.as_subclass(torch.Tensor)
    return host.reshape(-1)


def _require_dtype(t: torch.Tensor, dtype: torch.dtype) -> None:
    """Mirror ``Tensor::data_ptr<T>()``'s dtype check."""
    if t.dtype != dtype:
        raise KernelCheckError(f"expected scalar type {_scalar_name(dtype)} but found {_scalar_name(t.dtype)}")


def _no_negatives(values: torch.Tensor, name: str) -> None:
    negative = (values < 0).nonzero()
    if negative.numel():
        at = int(negative[0, 0])
        raise KernelCheckError(
            f"{name} holds {int(values[at])} at position {at}: sgl-kernel builds disagree on negative indices "
            f"(some skip the item, others copy out of bounds), so the CPU stand-in refuses them"
        )


def _pointers(table: torch.Tensor, name: str, count: int) -> list[int]:
    """The first ``count`` addresses of a uint64 pointer table."""
    _require_dtype(table, torch.uint64)
    values = _plain(table).view(torch.int64).tolist()
    if len(values) < count:
        raise KernelCheckError(f"{name} holds {len(values)} layer pointers but the kernel reads {count}")
    return [v & _U64 for v in values[:count]]


def _index(value: Any, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


# --------------------------------------------------------------------------- sgl-kernel launcher


def _check_layers(num_layers: int, table: torch.Tensor, message: str) -> None:
    if num_layers != table.size(0):
        raise KernelCheckError(message)


def _launch(
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int,
    num_warps_per_block: int,
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``transfer_kv_launcher``'s checks: the host copies of the indices and ``item_size``, or None when nothing is copied."""
    item_size = _index(item_size, "item_size")
    if not src_indices.is_cuda:
        raise KernelCheckError("Source indices must be a CUDA tensor")
    if not dst_indices.is_cuda:
        raise KernelCheckError("Destination indices must be a CUDA tensor")
    if src_indices.dtype != torch.int64:
        raise KernelCheckError("Source indices must be of type long")
    if dst_indices.dtype != torch.int64:
        raise KernelCheckError("Destination indices must be of type long")
    if src_indices.numel() != dst_indices.numel():
        raise KernelCheckError("Source and destination indices must have the same length")
    if item_size % 8 != 0:
        raise KernelCheckError("Item byte size must be divisible by 8")
    block_quota = _index(block_quota, "block_quota")
    num_warps_per_block = _index(num_warps_per_block, "num_warps_per_block")
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
    src, dst = _plain(src_indices), _plain(dst_indices)
    _no_negatives(src, "src_indices")
    _no_negatives(dst, "dst_indices")
    if item_size <= 0:
        return None
    return src, dst, item_size


def _mla_block_quota(block_quota: int | None) -> int:
    """Newer sgl-kernel builds default the MLA per-layer quota to ``SGLANG_HICACHE_BLOCK_QUOTA`` or 2."""
    if block_quota is not None:
        return block_quota
    try:
        return int(os.environ.get("SGLANG_HICACHE_BLOCK_QUOTA", _BLOCK_QUOTA))
    except ValueError:
        return _BLOCK_QUOTA


def _lf(side: _Side, pages: torch.Tensor, item_size: int) -> tuple[_Side, torch.Tensor]:
    """Layer-first rows: ``base + page * item_size``."""
    return side, pages * item_size


def _pf(side: _Side, pages: torch.Tensor, layer_id: int, layout_dim: int, item_size: int) -> tuple[_Side, torch.Tensor]:
    """Page-first rows: ``base + page * layout_dim + layer_id * item_size``."""
    return side, pages * layout_dim + layer_id * item_size


def transfer_kv_per_layer(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int = _BLOCK_QUOTA,
    num_warps_per_block: int = _NUM_WARPS_PER_BLOCK,
) -> None:
    """One layer, layer-first to layer-first: item ``p`` of K and of V at ``data_ptr() + p * item_size``."""
    pages = _launch(src_indices, dst_indices, item_size, block_quota, num_warps_per_block)
    if pages is None:
        return
    src, dst, item_size = pages
    for s, d in ((("src_k", src_k), ("dst_k", dst_k)), (("src_v", src_v), ("dst_v", dst_v))):
        _copy(*_lf(_tensor_side(*s), src, item_size), *_lf(_tensor_side(*d), dst, item_size), item_size, MEMORY)


def transfer_kv_per_layer_pf_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int = _BLOCK_QUOTA,
    num_warps_per_block: int = _NUM_WARPS_PER_BLOCK,
) -> None:
    """Layer ``layer_id`` of a page-first K/V buffer (``src_layout_dim`` bytes per page) into one layer-first layer."""
    pages = _launch(src_indices, dst_indices, item_size, block_quota, num_warps_per_block)
    if pages is None:
        return
    src, dst, item_size = pages
    layer_id, layout = _index(layer_id, "layer_id"), _index(src_layout_dim, "src_layout_dim")
    for s, d in ((("src_k", src_k), ("dst_k", dst_k)), (("src_v", src_v), ("dst_v", dst_v))):
        _copy(
            *_pf(_tensor_side(*s), src, layer_id, layout, item_size),
            *_lf(_tensor_side(*d), dst, item_size),
            item_size,
            MEMORY,
        )


def transfer_kv_all_layer(
    src_k_layers: torch.Tensor,
    dst_k_layers: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = _BLOCK_QUOTA,
    num_warps_per_block: int = _NUM_WARPS_PER_BLOCK,
) -> None:
    """Every layer, layer-first to layer-first, through uint64 tables of per-layer base addresses."""
    num_layers = _index(num_layers, "num_layers")
    _check_layers(num_layers, src_k_layers, "Number of layers in source k tensor does not match num_layers")
    pages = _launch(src_indices, dst_indices, item_size, block_quota, num_warps_per_block)
    if pages is None:
        return
    src, dst, item_size = pages
    tables = [
        (name, _pointers(t, name, num_layers))
        for name, t in (
            ("src_k_layers", src_k_layers),
            ("dst_k_layers", dst_k_layers),
            ("src_v_layers", src_v_layers),
            ("dst_v_layers", dst_v_layers),
        )
    ]
    for layer in range(num_layers):
        for (sname, sptr), (dname, dptr) in ((tables[0], tables[1]), (tables[2], tables[3])):
            s = _Side(f"{sname}[{layer}]", sptr[layer], None)
            d = _Side(f"{dname}[{layer}]", dptr[layer], None)
            _copy(*_lf(s, src, item_size), *_lf(d, dst, item_size), item_size, MEMORY)


def transfer_kv_all_layer_lf_pf(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = _BLOCK_QUOTA,
    num_warps_per_block: int = _NUM_WARPS_PER_BLOCK,
) -> None:
    """Every layer, from per-layer bases in uint64 tables into a page-first K/V buffer (``dst_layout_dim`` bytes per page)."""
    num_layers = _index(num_layers, "num_layers")
    _check_layers(num_layers, src_k_layers, "Number of layers in source k tensor does not match num_layers")
    pages = _launch(src_indices, dst_indices, item_size, block_quota, num_warps_per_block)
    if pages is None:
        return
    src, dst, item_size = pages
    layout = _index(dst_layout_dim, "dst_layout_dim")
    k_ptr = _pointers(src_k_layers, "src_k_layers", num_layers)
    v_ptr = _pointers(src_v_layers, "src_v_layers", num_layers)
    for layer in range(num_layers):
        for sname, sptr, dname, dbuf in (
            ("src_k_layers", k_ptr, "dst_k", dst_k),
            ("src_v_layers", v_ptr, "dst_v", dst_v),
        ):
            s = _Side(f"{sname}[{layer}]", sptr[layer], None)
            _copy(
                *_lf(s, src, item_size),
                *_pf(_tensor_side(dname, dbuf), dst, layer, layout, item_size),
                item_size,
                MEMORY,
            )


def transfer_kv_per_layer_mla(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int | None = None,
    num_warps_per_block: int = _NUM_WARPS_PER_BLOCK,
) -> None:
    """One buffer, one layer, layer-first to layer-first (SGLang also moves Mamba state with it)."""
    pages = _launch(src_indices, dst_indices, item_size, _mla_block_quota(block_quota), num_warps_per_block)
    if pages is None:
        return
    s, d, item_size = pages
    _copy(*_lf(_tensor_side("src", src), s, item_size), *_lf(_tensor_side("dst", dst), d, item_size), item_size, MEMORY)


def transfer_kv_per_layer_mla_pf_lf(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int | None = None,
    num_warps_per_block: int = _NUM_WARPS_PER_BLOCK,
) -> None:
    """Layer ``layer_id`` of one page-first buffer into one layer-first layer."""
    pages = _launch(src_indices, dst_indices, item_size, _mla_block_quota(block_quota), num_warps_per_block)
    if pages is None:
        return
    s, d, item_size = pages
    layer_id, layout = _index(layer_id, "layer_id"), _index(src_layout_dim, "src_layout_dim")
    _copy(
        *_pf(_tensor_side("src", src), s, layer_id, layout, item_size),
        *_lf(_tensor_side("dst", dst), d, item_size),
        item_size,
        MEMORY,
    )


def transfer_kv_all_layer_mla(
    src_layers: torch.Tensor,
    dst_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = _BLOCK_QUOTA,
    num_warps_per_block: int = _NUM_WARPS_PER_BLOCK,
) -> None:
    """Every layer of one buffer, layer-first to layer-first, through uint64 pointer tables."""
    num_layers = _index(num_layers, "num_layers")
    _check_layers(num_layers, src_layers, "Number of layers in source tensor does not match num_layers")
    pages = _launch(src_indices, dst_indices, item_size, block_quota, num_warps_per_block)
    if pages is None:
        return
    s, d, item_size = pages
    sptr = _pointers(src_layers, "src_layers", num_layers)
    dptr = _pointers(dst_layers, "dst_layers", num_layers)
    for layer in range(num_layers):
        src = _Side(f"src_layers[{layer}]", sptr[layer], None)
        dst = _Side(f"dst_layers[{layer}]", dptr[layer], None)
        _copy(*_lf(src, s, item_size), *_lf(dst, d, item_size), item_size, MEMORY)


def transfer_kv_all_layer_mla_lf_pf(
    src_layers: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = _BLOCK_QUOTA,
    num_warps_per_block: int = _NUM_WARPS_PER_BLOCK,
) -> None:
    """Every layer, from per-layer bases in a uint64 table into one page-first buffer."""
    num_layers = _index(num_layers, "num_layers")
    _check_layers(num_layers, src_layers, "Number of layers in source tensor does not match num_layers")
    pages = _launch(src_indices, dst_indices, item_size, block_quota, num_warps_per_block)
    if pages is None:
        return
    s, d, item_size = pages
    layout = _index(dst_layout_dim, "dst_layout_dim")
    sptr = _pointers(src_layers, "src_layers", num_layers)
    for layer in range(num_layers):
        src = _Side(f"src_layers[{layer}]", sptr[layer], None)
        _copy(*_lf(src, s, item_size), *_pf(_tensor_side("dst", dst), d, layer, layout, item_size), item_size, MEMORY)


# page_head: ``[page_num, head_num, page_size, layer_num, head_dim]`` (imported unguarded by 0.5.10).


def _ph_offsets(
    pages: torch.Tensor, heads: torch.Tensor, layer: int, page_dim: int, item_size: int, head_num: int, page_size: int
) -> torch.Tensor:
    p, h = pages[:, None], heads[None, :]
    return (
        torch.div(p, page_size, rounding_mode="floor") * page_size * page_dim
        + (page_dim // head_num) * h * page_size
        + torch.div((p % page_size) * page_dim, head_num, rounding_mode="floor")
        + layer * item_size // head_num
    ).reshape(-1)


def _per_head_lf_offsets(pages: torch.Tensor, heads: torch.Tensor, item_size: int, head_num: int) -> torch.Tensor:
    return (pages[:, None] * item_size + (item_size // head_num) * heads[None, :]).reshape(-1)


def _check_heads(page_size: int, head_num: int) -> tuple[int, int]:
    page_size, head_num = _index(page_size, "page_size"), _index(head_num, "head_num")
    if page_size <= 0 or head_num <= 0:
        raise KernelCheckError(
            f"page_size={page_size} and head_num={head_num} must be positive: the page_head kernel divides by both"
        )
    return page_size, head_num


def transfer_kv_per_layer_ph_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    page_size: int,
    head_num: int,
    block_quota: int = _BLOCK_QUOTA,
    num_warps_per_block: int = _NUM_WARPS_PER_BLOCK,
) -> None:
    """Layer ``layer_id`` of a page_head K/V buffer into one layer-first layer, head by head."""
    pages = _launch(src_indices, dst_indices, item_size, block_quota, num_warps_per_block)
    if pages is None:
        return
    s, d, item_size = pages
    page_size, head_num = _check_heads(page_size, head_num)
    layer_id, layout = _index(layer_id, "layer_id"), _index(src_layout_dim, "src_layout_dim")
    heads = torch.arange(head_num)
    width = item_size // head_num // 8 * 8  # the warp copies whole 8-byte words
    so = _ph_offsets(s, heads, layer_id, layout, item_size, head_num, page_size)
    do = _per_head_lf_offsets(d, heads, item_size, head_num)
    for sname, sbuf, dname, dbuf in (("src_k", src_k, "dst_k", dst_k), ("src_v", src_v, "dst_v", dst_v)):
        _copy(_tensor_side(sname, sbuf), so, _tensor_side(dname, dbuf), do, width, MEMORY)


def transfer_kv_all_layer_lf_ph(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    page_size: int,
    head_num: int,
    block_quota: int = _BLOCK_QUOTA,
    num_warps_per_block: int = _NUM_WARPS_PER_BLOCK,
) -> None:
    """Every layer, from per-layer bases in uint64 tables into a page_head K/V buffer, head by head."""
    num_layers = _index(num_layers, "num_layers")
    _check_layers(num_layers, src_k_layers, "Number of layers in source k tensor does not match num_layers")
    pages = _launch(src_indices, dst_indices, item_size, block_quota, num_warps_per_block)
    if pages is None:
        return
    s, d, item_size = pages
    page_size, head_num = _check_heads(page_size, head_num)
    layout = _index(dst_layout_dim, "dst_layout_dim")
    heads = torch.arange(head_num)
    width = item_size // head_num // 8 * 8
    so = _per_head_lf_offsets(s, heads, item_size, head_num)
    k_ptr = _pointers(src_k_layers, "src_k_layers", num_layers)
    v_ptr = _pointers(src_v_layers, "src_v_layers", num_layers)
    for layer in range(num_layers):
        do = _ph_offsets(d, heads, layer, layout, item_size, head_num, page_size)
        for sname, sptr, dname, dbuf in (
            ("src_k_layers", k_ptr, "dst_k", dst_k),
            ("src_v_layers", v_ptr, "dst_v", dst_v),
        ):
            _copy(_Side(f"{sname}[{layer}]", sptr[layer], None), so, _tensor_side(dname, dbuf), do, width, MEMORY)


# --------------------------------------------------------------------------- direct (tensor slice) ops


def _check_direct(src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> int:
    page_size = _index(page_size, "page_size")
    if src_indices.numel() != dst_indices.numel():
        raise KernelCheckError("Source and destination indices must have the same length")
    if page_size <= 0:
        raise KernelCheckError("Page size must be positive")
    if src_indices.numel() % page_size != 0:
        raise KernelCheckError("Source indices size must be divisible by page size")
    return page_size


def _copy_page(src: torch.Tensor, dst: torch.Tensor, src_index: int, dst_index: int, count: int) -> None:
    """``dst[dst_index : dst_index + count] = src[src_index : src_index + count]`` with slice clamping, as at::slice does."""
    dst[dst_index : dst_index + count].copy_(src[src_index : src_index + count])


def _as_int64(values: torch.Tensor) -> torch.Tensor:
    """What ``Tensor::item<int64_t>()`` reads from each element."""
    if values.dtype.is_floating_point:
        return values.trunc().to(torch.int64)
    return values.to(torch.int64)


def _trunc_div(values: torch.Tensor, divisor: int) -> torch.Tensor:
    return torch.div(values, divisor, rounding_mode="trunc")


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Copy token rows ``src_layers[j][src] -> dst_layers[j][dst]``, merging runs that step by 1 on both sides."""
    if len(src_layers) != len(dst_layers):
        raise KernelCheckError("Source and destination layers must have the same number of layers")
    _check_direct(src_indices, dst_indices, page_size)
    src, dst = _plain(src_indices), _plain(dst_indices)
    _require_dtype(src, torch.int64)
    _require_dtype(dst, torch.int64)
    n = src.numel()
    if n == 0:
        return
    breaks = ((src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)).nonzero().reshape(-1) + 1
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], n]
    src_list, dst_list = src.tolist(), dst.tolist()
    for start, end in zip(starts, ends):
        for s_layer, d_layer in zip(src_layers, dst_layers):
            _copy_page(s_layer, d_layer, src_list[start], dst_list[start], end - start)


def _pages(src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> tuple[list[int], list[int]]:
    src = _as_int64(_plain(src_indices))[::page_size]
    dst = _as_int64(_plain(dst_indices))[::page_size]
    return src.tolist(), dst.tolist()


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Page by page from page_first_direct buffers ``[page, layer, page_size, ...]`` (K, or K and V) into per-layer tensors."""
    page_size = _check_direct(src_indices, dst_indices, page_size)
    layer_id = _index(layer_id, "layer_id")
    src, dst = _pages(src_indices, dst_indices, page_size)
    is_mla = len(src_ptrs) == 1
    num_layers = len(dst_ptrs) if is_mla else len(dst_ptrs) // 2
    for s_index, d_index in zip(_trunc_div(torch.tensor(src, dtype=torch.int64), page_size).tolist(), dst):
        for j in range(num_layers):
            _copy_page(src_ptrs[0].select(0, s_index).select(0, layer_id + j), dst_ptrs[j], 0, d_index, page_size)
            if not is_mla:
                _copy_page(
                    src_ptrs[1].select(0, s_index).select(0, layer_id + j),
                    dst_ptrs[j + num_layers],
                    0,
                    d_index,
                    page_size,
                )


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Page by page from per-layer tensors (K layers, then V layers) into page_first_direct buffers."""
    page_size = _check_direct(src_indices, dst_indices, page_size)
    src, dst = _pages(src_indices, dst_indices, page_size)
    is_mla = len(dst_ptrs) == 1
    num_layers = len(src_ptrs) if is_mla else len(src_ptrs) // 2
    for s_index, d_index in zip(src, _trunc_div(torch.tensor(dst, dtype=torch.int64), page_size).tolist()):
        for j in range(num_layers):
            _copy_page(src_ptrs[j], dst_ptrs[0].select(0, d_index).select(0, j), s_index, 0, page_size)
            if not is_mla:
                _copy_page(src_ptrs[j + num_layers], dst_ptrs[1].select(0, d_index).select(0, j), s_index, 0, page_size)


# --------------------------------------------------------------------------- sglang 0.5.23 transfer_mamba (JIT kernel)


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
        if not t.is_cuda:
            cause = (
                f"Device value [{_dl_device(t)}] not in the allowed options: [cuda]"
                if position == 0
                else f"Device mismatch: expected cuda but got {_dl_device(t)}"
            )
            raise _match_failed(t, name, cause)
    assert length is not None
    return length


def _check_mamba_item(item_size: int) -> int:
    item_size = _index(item_size, "item_size")
    if item_size <= 0:
        raise KernelCheckError("transfer_mamba: item_size must be positive")
    if item_size % 16 != 0:
        raise KernelCheckError("transfer_mamba: item_size must be 16-byte aligned (uint4)")
    return item_size


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
    s, d = _plain(src_indices), _plain(dst_indices)
    _no_negatives(s, "src_indices")
    _no_negatives(d, "dst_indices")
    layer_id, layout = _index(layer_id, "layer_id"), _index(src_layout_dim, "src_layout_dim")
    _copy(
        *_pf(_tensor_side("src", src), s, layer_id, layout, item_size),
        *_lf(_tensor_side("dst", dst), d, item_size),
        item_size,
        MEMORY,
    )


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
    num_layers = _index(num_layers, "num_layers")
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
    item_size = _check_mamba_item(item_size)
    if num_layers <= 0:
        raise KernelCheckError("transfer_mamba: num_layers must be positive")
    if count == 0:
        return
    s, d = _plain(src_indices), _plain(dst_indices)
    _no_negatives(s, "src_indices")
    _no_negatives(d, "dst_indices")
    layout = _index(dst_layout_dim, "dst_layout_dim")
    pointers = _pointers(src_ptrs, "src_ptrs", num_layers)
    for layer in range(num_layers):
        src = _Side(f"src_ptrs[{layer}]", pointers[layer], None)
        _copy(*_lf(src, s, item_size), *_pf(_tensor_side("dst", dst), d, layer, layout, item_size), item_size, MEMORY)


# --------------------------------------------------------------------------- install / bind

KVCACHEIO_OPS: dict[str, Callable[..., None]] = {
    "transfer_kv_per_layer": transfer_kv_per_layer,
    "transfer_kv_per_layer_pf_lf": transfer_kv_per_layer_pf_lf,
    "transfer_kv_per_layer_ph_lf": transfer_kv_per_layer_ph_lf,
    "transfer_kv_all_layer": transfer_kv_all_layer,
    "transfer_kv_all_layer_lf_pf": transfer_kv_all_layer_lf_pf,
    "transfer_kv_all_layer_lf_ph": transfer_kv_all_layer_lf_ph,
    "transfer_kv_per_layer_mla": transfer_kv_per_layer_mla,
    "transfer_kv_per_layer_mla_pf_lf": transfer_kv_per_layer_mla_pf_lf,
    "transfer_kv_all_layer_mla": transfer_kv_all_layer_mla,
    "transfer_kv_all_layer_mla_lf_pf": transfer_kv_all_layer_mla_lf_pf,
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
}
"""The ``sgl_kernel.kvcacheio`` ops SGLang's host pools import (0.5.10 imports all of them unguarded)."""

TRANSFER_MAMBA_OPS: dict[str, Callable[..., None]] = {
    "transfer_kv_mamba_pf_lf": transfer_kv_mamba_pf_lf,
    "transfer_kv_mamba_lf_pf": transfer_kv_mamba_lf_pf,
}
"""The ``sglang.kernels.ops.mamba.transfer_mamba`` ops 0.5.23's ``MambaPoolHost`` imports."""

OPS: dict[str, Callable[..., None]] = {**KVCACHEIO_OPS, **TRANSFER_MAMBA_OPS}

_STAND_IN_FLAG = "__hicache_obs_stand_in__"


@dataclass
class Installation:
    """What one :func:`install` did; :func:`uninstall` takes it to undo just that."""

    stand_ins: dict[str, types.ModuleType] = field(default_factory=dict)
    """``sys.modules`` name -> the stand-in put there."""
    bound: dict[str, list[str]] = field(default_factory=dict)
    """Module name -> the op names :func:`bind` set on it."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Module name -> why no stand-in was put there."""
    _parent_attrs: list[tuple[types.ModuleType, str, types.ModuleType]] = field(default_factory=list, repr=False)
    _modules: list[weakref.ReferenceType[types.ModuleType]] = field(default_factory=list, repr=False)

    def remember_attr(self, parent: types.ModuleType, attr: str, module: types.ModuleType) -> None:
        """Record that ``parent.attr`` was set to the stand-in ``module``, for :meth:`undo`."""
        self._parent_attrs.append((parent, attr, module))

    def remember_module(self, module: types.ModuleType) -> None:
        """Record that ``module``'s op names were bound (the names are in :attr:`bound`), for
        :meth:`undo`. Held weakly: a module that is gone has nothing left to unbind."""
        self._modules.append(weakref.ref(module))

    def undo(self) -> None:
        """Take out what this installation put in, where it is still what it put there: its
        stand-ins from ``sys.modules``, the attributes it set on their parents, the op names it
        bound on modules. Whatever replaced one of them since is left alone."""
        for name, module in self.stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
        for parent, attr, module in self._parent_attrs:
            if vars(parent).get(attr) is module:
                delattr(parent, attr)
        for ref in self._modules:
            target = ref()
            if target is not None:
                _unbind_names(target, self.bound.get(target.__name__, ()))


_lock = threading.RLock()
_installations: list[Installation] = []
_bound: dict[str, tuple[weakref.ReferenceType[types.ModuleType], list[str]]] = {}


def _stand_in(
    name: str, doc: str, *, package: bool = False, ops: dict[str, Callable[..., None]] | None = None
) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    setattr(module, _STAND_IN_FLAG, True)
    for op_name, op in (ops or {}).items():
        setattr(module, op_name, op)
    if ops:
        vars(module)["__all__"] = list(ops)
    return module


def _put(name: str, module: types.ModuleType, installation: Installation) -> None:
    sys.modules[name] = module
    installation.stand_ins[name] = module
    parent_name, _, attr = name.rpartition(".")
    parent = sys.modules.get(parent_name) if parent_name else None
    if parent is not None and not hasattr(parent, attr):
        setattr(parent, attr, module)
        installation.remember_attr(parent, attr, module)


def _install_kvcacheio(installation: Installation) -> None:
    if getattr(sys.modules.get(KVCACHEIO_MODULE), _STAND_IN_FLAG, False):
        installation.skipped[KVCACHEIO_MODULE] = "the stand-in is already installed"
        return
    try:
        importlib.import_module(KVCACHEIO_MODULE)
        installation.skipped[KVCACHEIO_MODULE] = "imports: left as it is"
        return
    except Exception as exc:  # a CUDA wheel on a CPU host fails with OSError as often as ImportError
        reason = f"{type(exc).__name__}: {exc}"
    if "sgl_kernel" not in sys.modules:
        _put(
            "sgl_kernel",
            _stand_in("sgl_kernel", f"hicache-obs CPU stand-in for sgl-kernel ({reason})", package=True),
            installation,
        )
    _put(
        KVCACHEIO_MODULE,
        _stand_in(
            KVCACHEIO_MODULE, f"hicache-obs CPU stand-ins for sgl_kernel.kvcacheio ({reason})", ops=KVCACHEIO_OPS
        ),
        installation,
    )


def _install_transfer_mamba(installation: Installation) -> None:
    if TRANSFER_MAMBA_MODULE in sys.modules:
        installation.skipped[TRANSFER_MAMBA_MODULE] = "already imported: bind() the pool module instead"
        return
    try:
        if importlib.util.find_spec("sglang.kernels") is None:
            installation.skipped[TRANSFER_MAMBA_MODULE] = (
                "this sglang has no sglang.kernels (0.5.10 and 0.5.11 have none)"
            )
            return
    except (ImportError, ValueError) as exc:
        installation.skipped[TRANSFER_MAMBA_MODULE] = f"sglang is not importable ({type(exc).__name__}: {exc})"
        return
    try:
        importlib.import_module(TRANSFER_MAMBA_MODULE)
        installation.skipped[TRANSFER_MAMBA_MODULE] = "imports (its JIT ops need CUDA): bind() the pool module instead"
        return
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
    try:
        importlib.import_module(TRANSFER_MAMBA_MODULE.rpartition(".")[0])
    except Exception as exc:
        installation.skipped[TRANSFER_MAMBA_MODULE] = (
            f"its package does not import either ({type(exc).__name__}: {exc})"
        )
        return
    _put(
        TRANSFER_MAMBA_MODULE,
        _stand_in(
            TRANSFER_MAMBA_MODULE, f"hicache-obs CPU stand-ins for transfer_mamba ({reason})", ops=TRANSFER_MAMBA_OPS
        ),
        installation,
    )


def install(modules: Iterable[types.ModuleType | str] = ()) -> Installation:
    """Make the ops importable where SGLang looks for them, then :func:`bind` each of ``modules``.

    ``sgl_kernel`` / ``sgl_kernel.kvcacheio`` stand-ins go into ``sys.modules``
    when ``import sgl_kernel.kvcacheio`` fails; a ``transfer_mamba`` stand-in
    when that module fails to import while its package does. Nothing that
    imports is replaced. Names in ``modules`` are imported after the stand-ins
    are in place.
    """
    installation = Installation()
    with _lock:
        _install_kvcacheio(installation)
        _install_transfer_mamba(installation)
        _installations.append(installation)
    for module in modules:
        target = importlib.import_module(module) if isinstance(module, str) else module
        installation.bound[target.__name__] = bind(target)
        installation.remember_module(target)
    return installation


def uninstall(installation: Installation | None = None) -> None:
    """Undo ``installation`` (default: every install and every :func:`bind`), leaving whatever was replaced since."""
    with _lock:
        targets = list(_installations) if installation is None else [installation]
        for inst in targets:
            inst.undo()
            if inst in _installations:
                _installations.remove(inst)
        if installation is None:
            for ref, names in list(_bound.values()):
                target = ref()
                if target is not None:
                    _unbind_names(target, names)
            _bound.clear()


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


def _code_names(code: types.CodeType, out: set[str]) -> None:
    """Global names ``code`` (and the code nested in it) loads; attribute names do not count."""
    out.update(i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_LOADS and isinstance(i.argval, str))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_names(const, out)


def _function_names(fn: Any, module: types.ModuleType, out: set[str], seen: set[int]) -> None:
    """Names loaded by ``fn`` when it is one of ``module``'s functions, following ``functools.wraps`` chains."""
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if isinstance(fn, types.FunctionType) and fn.__globals__ is module.__dict__:
            _code_names(fn.__code__, out)
        try:  # no getattr: a module-level object's __getattr__ may import or raise
            namespace = object.__getattribute__(fn, "__dict__")
        except AttributeError:
            return
        fn = namespace.get("__wrapped__") if isinstance(namespace, dict) else None


def _class_names(cls: type, module: types.ModuleType, out: set[str], seen: set[int]) -> None:
    if id(cls) in seen:
        return
    seen.add(id(cls))
    for value in vars(cls).values():
        if isinstance(value, (staticmethod, classmethod)):
            _function_names(value.__func__, module, out, seen)
        elif isinstance(value, property):
            for accessor in (value.fget, value.fset, value.fdel):
                _function_names(accessor, module, out, seen)
        elif isinstance(value, type) and value.__module__ == module.__name__:
            _class_names(value, module, out, seen)
        else:
            _function_names(value, module, out, seen)


def _referenced_names(module: types.ModuleType) -> set[str]:
    """Global names the module's functions and methods load, plus names its source loads."""
    out: set[str] = set()
    seen: set[int] = set()
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            _class_names(value, module, out, seen)
        else:
            _function_names(value, module, out, seen)
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError, ValueError):
        return out
    out.update(node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load))
    return out


def bind(module: types.ModuleType) -> list[str]:
    """Set each op name ``module``'s code uses but never got (a CUDA-guarded import skipped on a CPU); returns those names.

    A name the module already has, whatever its value, is left alone.
    """
    names = sorted(n for n in _referenced_names(module) & OPS.keys() if n not in vars(module))
    with _lock:
        for name in names:
            setattr(module, name, OPS[name])
        if names:
            _, previous = _bound.get(module.__name__, (None, []))
            _bound[module.__name__] = (weakref.ref(module), sorted({*previous, *names}))
    return names


def _unbind_names(module: types.ModuleType, names: Iterable[str]) -> None:
    for name in names:
        if vars(module).get(name) is OPS.get(name):
            delattr(module, name)


def unbind(module: types.ModuleType) -> None:
    """Remove the names :func:`bind` set on ``module`` that still hold our ops."""
    with _lock:
        entry = _bound.pop(module.__name__, None)
        if entry is not None:
            _unbind_names(module, entry[1])
