"""The registered-memory model: raw addresses resolved to tensor bytes, and the byte copies.

A pointer-table entry is a raw address. :class:`Memory` maps it back to the bytes
of a registered tensor storage (:func:`register_buffers`, default registry
:data:`MEMORY`); a tensor argument is its own side (:func:`tensor_side`), bounded
by its storage. :func:`copy_items` moves ``width`` bytes per item between two
sides, each item at ``address + offset``; :func:`layer_first` and
:func:`page_first` give the offsets of the two layouts.
"""

from __future__ import annotations

import bisect
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from hicache_obs.errors import HiCacheError
from hicache_obs.lab.sglang.kernels.arguments import plain

__all__ = ["UnmappedAddressError", "Memory", "MEMORY", "register_buffers"]


class UnmappedAddressError(HiCacheError, RuntimeError):
    """A copy would touch bytes outside every registered buffer (or outside the tensor it was given)."""


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


def flatten(items: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors in ``items``, nested sequences walked and None skipped; a TypeError for anything else."""
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            yield from flatten(item)
        elif item is not None:
            raise TypeError(f"register_buffers takes tensors or sequences of tensors, got {type(item).__name__}")


def register_buffers(*tensors: torch.Tensor | Iterable[Any], memory: Memory | None = None) -> None:
    """Register every tensor (sequences of tensors are walked, None is skipped) in ``memory`` (default :data:`MEMORY`)."""
    target = MEMORY if memory is None else memory
    for tensor in flatten(tensors):
        target.register(tensor)


# --------------------------------------------------------------------------- byte copies


def _as_offsets(offsets: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if not isinstance(offsets, torch.Tensor):
        offsets = torch.tensor(list(offsets), dtype=torch.int64)
    return plain(offsets).to(torch.int64)


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


class Side(NamedTuple):
    """Where one side's items live: ``address`` plus per-item byte offsets; ``owner`` holds them, or None for a table pointer."""

    name: str
    address: int
    owner: torch.Tensor | None


def tensor_side(name: str, tensor: torch.Tensor) -> Side:
    """A tensor argument as a side: its items start at its ``data_ptr()`` and stay in its storage."""
    return Side(name, tensor.data_ptr(), tensor)


def _resolve(side: Side, offsets: torch.Tensor, width: int, memory: Memory) -> tuple[torch.Tensor, int]:
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


copy_gate: Callable[[torch.Tensor], bool] | None = None
"""Asked before each copy with the destination's bytes; False skips the copy. None (the
default) copies everything; a test sets it to inject a transfer that moves nothing."""


def copy_items(
    src: Side, src_offsets: torch.Tensor, dst: Side, dst_offsets: torch.Tensor, width: int, memory: Memory = MEMORY
) -> None:
    """Copy ``width`` bytes from ``src.address + src_offsets[i]`` to ``dst.address + dst_offsets[i]`` for every i."""
    if width <= 0 or src_offsets.numel() == 0:
        return
    sbuf, sat = _resolve(src, src_offsets, width, memory)
    dbuf, dat = _resolve(dst, dst_offsets, width, memory)
    if copy_gate is not None and not copy_gate(dbuf):
        return
    _scatter(dbuf, dat, dst_offsets, _gather(sbuf, sat, src_offsets, width))


def layer_first(pages: torch.Tensor, item_size: int) -> torch.Tensor:
    """Offsets of layer-first rows from a layer's base: ``page * item_size``."""
    return pages * item_size


def page_first(pages: torch.Tensor, layer_id: int, layout_dim: int, item_size: int) -> torch.Tensor:
    """Offsets of page-first rows from the buffer's base: ``page * layout_dim + layer_id * item_size``."""
    return pages * layout_dim + layer_id * item_size
