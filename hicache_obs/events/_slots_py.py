"""The slot maps and run-length encoding in pure Python (numpy for buffers): the
specification ``hicache_obs/_slots.c`` is tested against, and what runs where it is
not built or ``HICACHE_OBS_NO_EXTENSIONS`` names ``slots`` (see ``hicache_obs._native``).

Everything the C module exports, with the same results, state and errors, hostile
input included (``tests/native/test_differential_slots.py`` compares the two):

- ``SlotMap(capacity, page_size=1, track_pages=True)``: one byte per slot, 1 allocated,
  in an anonymous ``mmap`` (pages never touched cost no memory, as the C ``calloc``);
  per page the allocated slots (a dict of the pages in use); the free list the
  allocator takes pages from: the never-used pages from ``fresh`` upwards, less the
  ``holes`` (pages above ``fresh`` taken out of order, and those freed again, which are
  listed below), then the freed pages in the order they were freed (an insertion-ordered
  dict: O(1) removal). Without ``track_pages`` only the bytes exist (what the auditor
  needs).
- Runs are ``((start, length), ...)``. A run that lies (partly) out of range, or has a
  length <= 0, changes nothing and reports a few of its slots; slots that already were
  in the state asked for are reported and skipped, the others applied.
- ``runs_of`` / ``pair_runs_of`` / ``side_runs``: the runs of index values (lists, or
  1-D integer buffers such as numpy views of index tensors).
- ``dlpack_facts``: size, address and value runs of the tensor a DLPack ``"dltensor"``
  capsule holds (read through ``ctypes``).
- ``use_refs`` / ``recorded``: the SGLang adapter's description of one submission, its
  tensors' ``TensorRef`` and the records made on them (the C module describes most
  tensors itself; here ``slow`` describes every one).
- ``op_tensors`` / ``device_changes``: an op's index tensors by ``(pool, role)``, and those
  an op-level move put on another device (the SGLang adapter's move hook); ``received``:
  the index tensors a copy received (its copy hook); ``slots_by_pool``: the slots an op
  moves per pool; ``meta_ref`` / ``value_ref`` / ``device_of``: one tensor's description
  without or with its values, or its device name (``slow``'s here, as in ``use_refs``).
- ``copy_hook`` / ``conversion_observer``: what the SGLang adapter puts as a host pool's
  copy method, and as ``.to`` / ``.cuda`` of the index tensors a copy received (functions
  here; types in C), put on and taken off by ``place_observers`` / ``remove_observers``;
  ``slot_guard``: what it puts as an allocator call that can change the free lists (the
  outermost call, one at a time).
- ``record_observer``: what the SGLang adapter puts as ``torch.Tensor.record_stream``
  (a function here; a method descriptor in C).
- ``read_free_lists``: one read of an allocator's free lists, by reference (the SGLang
  adapter's ``_FreeList``, around each call that can change them).

Its one difference: memory. A freed page costs a dict entry here (about 100 bytes) where
the C lists cost 10 bytes a page, so a replay of pools of tens of millions of slots, all
freed, wants gigabytes; the allocation bytes themselves cost one byte a slot in both.

It imports nothing of ``hicache_obs.events`` (``hicache_obs._native`` loads it while
that package is being imported).
"""

from __future__ import annotations

import ctypes
import mmap
import operator
import threading
from typing import Any

import numpy as np

__all__ = ["SlotMap", "dlpack_facts", "pair_runs_of", "runs_of", "side_runs"]

_MIN = -(1 << 63)
_MAX = (1 << 63) - 1
_CAP_MAX = 1 << 31
_ONE = b"\x01"
_ZERO = b"\x00"
_index = operator.index


def _ll(v: Any) -> int:
    """``v`` as a C long long, as the C argument parsing takes it (``__index__``, then a range check)."""
    x = v if type(v) is int else _index(v)
    if not _MIN <= x <= _MAX:
        raise OverflowError("int too big to convert")
    return x


def _run_error(item: Any) -> TypeError:
    return TypeError(f"a run is a (start, length) pair, got {item!r}")


class SlotMap:
    """Which slots of a pool are allocated, and the FIFO order of its free pages."""

    __slots__ = ("_cap", "_ps", "_npages", "_used", "_fresh", "_n", "_track", "_a", "_page_used", "_holes", "_freed")
    _a: Any  # an mmap, or None before __init__
    _page_used: dict[int, int]
    _holes: set[int]
    _freed: dict[int, None]

    def __new__(cls, *args: Any, **kwargs: Any) -> SlotMap:
        self = super().__new__(cls)
        self._a = None  # set by __init__: every method refuses a map it has not set up
        self._cap = self._ps = self._npages = self._used = self._fresh = self._n = 0
        self._track = False
        self._page_used = {}
        self._holes = set()
        self._freed = {}
        return self

    def __init__(self, capacity: int, page_size: int = 1, track_pages: bool = True) -> None:
        capacity = _ll(capacity)
        page_size = _ll(page_size)
        track = bool(track_pages)
        if capacity < 0 or capacity > _CAP_MAX:
            raise ValueError(f"capacity must be in 0..{_CAP_MAX}, got {capacity}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._cap = capacity
        self._ps = page_size
        self._npages = capacity // page_size if track else 0
        self._track = track
        self._used = self._fresh = 0
        self._n = self._npages  # pages on the free list
        self._a = mmap.mmap(-1, capacity + 1)  # zero pages, backed only once written
        self._page_used = {}  # page -> allocated slots (page_size > 1), 0 left out
        self._holes = set()
        self._freed = {}  # the freed pages, in the order freed

    # ------------------------------------------------------------ counters
    @property
    def capacity(self) -> int:
        """slots in the pool"""
        return self._cap

    @property
    def page_size(self) -> int:
        """slots per page"""
        return self._ps

    @property
    def used(self) -> int:
        """allocated slots"""
        return self._used

    @property
    def free_pages(self) -> int:
        """pages on the free list"""
        return self._n

    @property
    def available(self) -> int:
        """free pages times the page size"""
        return self._n * self._ps

    def _ready(self) -> Any:
        a = self._a
        if a is None:
            raise RuntimeError("SlotMap.__init__ did not run")
        return a

    # ------------------------------------------------------------ free list
    def _take(self, p: int) -> None:
        """Page ``p`` was allocated: it leaves the free list (nothing if it was not on it)."""
        if p < 0 or p >= self._npages:
            return
        freed, holes = self._freed, self._holes
        if p in freed:
            del freed[p]
            self._n -= 1
            if p == self._fresh:
                self._advance_fresh()
            elif p > self._fresh:  # allocated above the fresh pages again: a hole once more
                holes.add(p)
        elif p == self._fresh:
            self._n -= 1
            self._advance_fresh()
        elif p > self._fresh and p not in holes:
            holes.add(p)
            self._n -= 1

    def _advance_fresh(self) -> None:
        """The page at ``fresh`` was allocated: move past it and past the holes above it."""
        self._fresh += 1
        holes = self._holes
        while holes and self._fresh < self._npages and self._fresh in holes:
            holes.remove(self._fresh)
            self._fresh += 1

    def _push(self, p: int) -> None:
        """Page ``p`` became free: it joins the back of the list (nothing if it was free)."""
        if p < 0 or p >= self._npages:
            return
        freed, holes = self._freed, self._holes
        if p in freed or (p >= self._fresh and p not in holes):
            return
        holes.discard(p)
        freed[p] = None
        self._n += 1

    # ------------------------------------------------------------------ runs
    def _each_run(self, runs: Any, fn: Any) -> list[int]:
        self._ready()
        seq: tuple[Any, ...] | None = runs if type(runs) is tuple else None
        if seq is None:
            if _is_sequence(runs):
                try:
                    seq = tuple(runs)
                except TypeError:
                    seq = None
            if seq is None:
                raise TypeError("runs must be a sequence of (start, length) pairs")
        bad: list[int] = []
        cap = self._cap
        for item in seq:
            try:
                pair = tuple(item)
            except TypeError:
                raise _run_error(item) from None
            if len(pair) != 2:
                raise _run_error(item)
            s, n = pair
            s = s if type(s) is int else _index(s)
            n = n if type(n) is int else _index(n)
            if s < 0 or n <= 0 or s + n > cap:  # (partly) outside: a few of its slots
                bad.extend(s + i for i in range(1 if n < 1 else min(n, 8)))
                continue
            fn(s, n, bad)
        return bad

    def _alloc_run(self, start: int, length: int, bad: list[int]) -> None:
        a = self._a
        end = start + length
        ps, track, pu = self._ps, self._track, self._page_used
        if a.find(_ONE, start, end) < 0:  # the normal case: every slot was free
            a[start:end] = _ONE * length
            self._used += length
            if not track:
                return
            if ps == 1:
                for p in range(start, end):
                    self._take(p)
            elif start % ps == 0 and length % ps == 0:  # whole pages
                for p in range(start // ps, end // ps):
                    pu[p] = ps
                    self._take(p)
            else:
                npages = self._npages
                for s in range(start, end):
                    p = s // ps
                    if p < npages:
                        pu[p] = pu.get(p, 0) + 1
                    self._take(p)
            return
        for s in range(start, end):  # some slots already allocated: slot by slot
            if a[s]:
                bad.append(s)
                continue
            a[s] = 1
            self._used += 1
            if not track:
                continue
            p = s // ps
            if ps > 1 and p < self._npages:
                pu[p] = pu.get(p, 0) + 1
            self._take(p)

    def _free_slot_page(self, s: int) -> None:
        ps = self._ps
        if ps == 1:
            self._push(s)
            return
        p = s // ps
        pu = self._page_used
        k = pu.get(p, 0)
        if p < self._npages and k:
            if k == 1:
                del pu[p]
                self._push(p)
            else:
                pu[p] = k - 1

    def _free_run(self, start: int, length: int, bad: list[int]) -> None:
        a = self._a
        end = start + length
        ps, track = self._ps, self._track
        if a.find(_ZERO, start, end) < 0:  # the normal case: every slot was allocated
            a[start:end] = bytes(length)
            self._used -= length
            if not track:
                return
            if ps > 1 and start % ps == 0 and length % ps == 0:  # whole pages
                pu = self._page_used
                for p in range(start // ps, end // ps):
                    pu.pop(p, None)
                    self._push(p)
                return
            for s in range(start, end):
                self._free_slot_page(s)
            return
        for s in range(start, end):
            if not a[s]:
                bad.append(s)
                continue
            a[s] = 0
            self._used -= 1
            if track:
                self._free_slot_page(s)

    def _check_run(self, start: int, length: int, bad: list[int]) -> None:
        a = self._a
        end = start + length
        if a.find(_ZERO, start, end) < 0:
            return
        bad.extend(s for s in range(start, end) if not a[s])

    def apply_alloc(self, runs: Any, /) -> list[int]:
        """Mark the slots of runs allocated; returns those that already were, or are out of range."""
        return self._each_run(runs, self._alloc_run)

    def apply_free(self, runs: Any, /) -> list[int]:
        """Mark the slots of runs free (a page whose slots are all free rejoins the back of the
        free list); returns those that were not allocated, or are out of range."""
        return self._each_run(runs, self._free_run)

    def unallocated(self, runs: Any, /) -> list[int]:
        """Slots among runs that are out of range or not allocated."""
        return self._each_run(runs, self._check_run)

    def is_allocated(self, slot: int, /) -> bool:
        """Whether one slot is allocated."""
        a = self._ready()
        s = slot if type(slot) is int else _index(slot)
        return 0 <= s < self._cap and a[s] == 1

    def _first_pages(self, k: int) -> list[int]:
        """The first k pages of the free list, in the order the allocator takes them."""
        out: list[int] = []
        holes, freed = self._holes, self._freed
        p, npages = self._fresh, self._npages
        while len(out) < k and p < npages:
            if p not in holes and p not in freed:  # taken out of order, or freed after that: listed below
                out.append(p)
            p += 1
        for q in freed:
            if len(out) >= k:
                break
            out.append(q)
        return out

    def peek(self, n_pages: int, /) -> list[int]:
        """The pages the next allocation of n pages would take (FIFO order)."""
        self._ready()
        if not self._track:
            raise TypeError("peek() needs a SlotMap that tracks pages")
        if not hasattr(type(n_pages), "__index__"):
            raise TypeError(f"peek() takes a number of pages (int), got {type(n_pages).__name__:.100}")
        k = n_pages if type(n_pages) is int else _index(n_pages)
        if k < 0:
            raise ValueError(f"peek of {n_pages!r} pages: the number of pages must be >= 0")
        n = self._n
        if k > n:
            raise ValueError(f"peek of {n_pages!r} pages with {n} free")
        return self._first_pages(k)

    def free_order(self) -> list[int]:
        """Every free page, in the order they are taken."""
        self._ready()
        return self._first_pages(self._n) if self._track else []

    def allocated_runs(self) -> tuple[tuple[int, int], ...]:
        """The allocated slots as (start, length) runs."""
        a = self._ready()
        out: list[tuple[int, int]] = []
        cap, s = self._cap, 0
        while s < cap:
            start = a.find(_ONE, s, cap)
            if start < 0:
                break
            end = a.find(_ZERO, start, cap)
            if end < 0:
                end = cap
            out.append((start, end - start))
            s = end
        return tuple(out)


def _is_sequence(obj: Any) -> bool:
    """``PySequence_Check``: an object whose type has ``__getitem__``, a dict excepted."""
    return not isinstance(obj, dict) and hasattr(type(obj), "__getitem__")


# ------------------------------------------------------- run-length encoding
_SIGNED = frozenset("bhilq")
_UNSIGNED = frozenset("BHILQ")


class _Values:
    """The values of a list/tuple of ints, or of a 1-D integer buffer, read one at a time
    in order (``get``), or all at once as int64 (``array``, for buffers)."""

    __slots__ = ("seq", "live", "arr", "n", "unsigned64")

    def __init__(self, obj: Any, what: str) -> None:
        self.seq: Any = None
        self.live = False  # seq is the caller's own list: a value's __index__ may change it
        self.arr: Any = None
        self.unsigned64 = False
        if not isinstance(obj, (bytes, bytearray)):
            try:
                view = memoryview(obj)
            except TypeError:
                view = None
            if view is not None:
                fmt = view.format or "B"
                f = fmt[1:] if fmt[:1] in ("@", "=") else fmt
                if len(f) != 1 or view.ndim > 1 or f not in _SIGNED | _UNSIGNED:
                    raise TypeError(
                        f"{what}: a 1-D buffer of integers is needed, got format {fmt} with {view.ndim} dimensions"
                    )
                arr = np.asarray(view)
                self.arr = arr.reshape(1) if view.ndim == 0 else arr
                self.unsigned64 = f in _UNSIGNED and view.itemsize == 8
                self.n = len(self.arr)
                return
        if isinstance(obj, (list, tuple)):
            self.seq = obj
            self.live = type(obj) is not tuple
        else:
            try:
                it = iter(obj)
            except TypeError:
                raise TypeError("a sequence of ints or a 1-D integer buffer is needed") from None
            self.seq = list(it)
        self.n = len(self.seq)

    def plain(self, n: int) -> list[int] | None:
        """The first n values as plain ints when reading them can run no code (every one an
        exact int in range), else None."""
        seq = self.seq
        if seq is None:
            return None
        head = seq[:n]
        if all(type(x) is int for x in head) and (not head or (_MIN <= min(head) and max(head) <= _MAX)):
            return head
        return None

    def array(self, n: int) -> Any:
        """The first n values of a buffer as int64."""
        a = self.arr[:n]
        if self.unsigned64 and n and int(a.max()) > _MAX:
            raise OverflowError("an index value does not fit in 64 bits")
        return a.astype(np.int64, copy=False)

    def get(self, i: int) -> int:
        if self.seq is None:
            x = int(self.arr[i])
            if x > _MAX:
                raise OverflowError("an index value does not fit in 64 bits")
            return x
        seq = self.seq
        if self.live and i >= len(seq):  # an __index__ shrank the list
            raise RuntimeError("the values changed size while they were read")
        item = seq[i]
        x = item if type(item) is int else _index(item)
        if not _MIN <= x <= _MAX:
            raise OverflowError("an index value does not fit in 64 bits")
        return x


def _starts(a: Any) -> Any:
    """Where a new run starts in an int64 array: not ``previous + 1`` (no wrap past 2^63 - 1)."""
    brk = np.ones(len(a), dtype=bool)
    if len(a) > 1:
        prev = a[:-1]
        with np.errstate(over="ignore"):
            brk[1:] = (a[1:] != prev + 1) | (prev == _MAX)
    return np.flatnonzero(brk)


def _runs_of_list(vals: list[int]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    if not vals:
        return ()
    start = prev = vals[0]
    for x in vals[1:]:
        if x == prev + 1 and prev != _MAX:
            prev = x
            continue
        out.append((start, prev - start + 1))
        start = prev = x
    out.append((start, prev - start + 1))
    return tuple(out)


def runs_of(values: Any, /) -> tuple[tuple[int, int], ...]:
    """((start, length), ...) of consecutive values, from a sequence of ints or a 1-D integer
    buffer: ``[3, 4, 5, 9]`` -> ``((3, 3), (9, 1))``."""
    v = _Values(values, "runs_of")
    n = v.n
    if v.seq is None:
        a = v.array(n)
        if not n:
            return ()
        st = _starts(a)
        ends = np.append(st[1:], n)
        return tuple(zip(a[st].tolist(), (ends - st).tolist()))
    head = v.plain(n)
    if head is not None:
        return _runs_of_list(head)
    return _runs_of_list([v.get(i) for i in range(n)])


def pair_runs_of(host: Any, device: Any, /) -> tuple[tuple[int, int, int], ...]:
    """((host_start, device_start, length), ...) of index pairs consecutive on both sides;
    as zip(), up to the shorter side (the longer side's extra values are not read)."""
    h = _Values(host, "pair_runs_of host")
    d = _Values(device, "pair_runs_of device")
    n = min(h.n, d.n)
    if h.seq is None and d.seq is None:
        ha, da = h.array(n), d.array(n)
        if not n:
            return ()
        brk = np.zeros(n, dtype=bool)
        brk[0] = True
        if n > 1:
            with np.errstate(over="ignore"):
                brk[1:] = (ha[1:] != ha[:-1] + 1) | (ha[:-1] == _MAX) | (da[1:] != da[:-1] + 1) | (da[:-1] == _MAX)
        st = np.flatnonzero(brk)
        ends = np.append(st[1:], n)
        return tuple(zip(ha[st].tolist(), da[st].tolist(), (ends - st).tolist()))
    hv, dv = h.plain(n), d.plain(n)
    if hv is None or dv is None:  # read in the C order: host[i], then device[i]
        hv, dv = [], []
        for i in range(n):
            hv.append(h.get(i))
            dv.append(d.get(i))
    out: list[tuple[int, int, int]] = []
    if not n:
        return ()
    h0, d0, length = hv[0], dv[0], 1
    for i in range(1, n):
        hx, dx = hv[i], dv[i]
        hl, dl = h0 + length - 1, d0 + length - 1  # the last values of the run
        if hx == hl + 1 and hl != _MAX and dx == dl + 1 and dl != _MAX:
            length += 1
            continue
        out.append((h0, d0, length))
        h0, d0, length = hx, dx, 1
    out.append((h0, d0, length))
    return tuple(out)


def side_runs(pair_runs: Any, side: int, /) -> tuple[tuple[int, int], ...]:
    """((start, length), ...) of one side (0 host, 1 device) of pair_runs_of output,
    consecutive runs joined."""
    side = side if type(side) is int else _index(side)
    if side > 2**31 - 1:
        raise OverflowError("signed integer is greater than maximum")
    if side < -(2**31):
        raise OverflowError("signed integer is less than minimum")
    if side not in (0, 1):
        raise ValueError(f"side_runs: side must be 0 (host) or 1 (device), got {side}")
    seq = tuple(pair_runs)
    out: list[tuple[int, int]] = []
    start = end = 0
    have = False
    for i, item in enumerate(seq):
        run = tuple(item)
        if len(run) != 3:
            raise TypeError(f"side_runs: a pair run is (host, device, length), got {run!r}")
        s = _ll(run[side])
        n = _ll(run[2])
        if n <= 0:
            raise ValueError(f"side_runs: pair run {i} {run!r} has a length <= 0")
        e = s + n
        if e > _MAX:
            raise OverflowError(f"side_runs: pair run {i} {run!r} has an end beyond 64 bits")
        if have and s == end:
            if e - start > _MAX:
                raise OverflowError(f"side_runs: joined run from {start} is longer than 64 bits")
            end = e
            continue
        if have:
            out.append((start, end - start))
        start, end, have = s, e, True
    if have:
        out.append((start, end - start))
    return tuple(out)


# ------------------------------------------------------------------ DLPack
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    """DLPack's legacy tensor (``dlpack.h`` before 1.0), the head of a ``DLManagedTensor``."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_valid.restype = ctypes.c_int
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_pointer.restype = ctypes.c_void_p
_HOST_DEVICES = (1, 3)  # DLPack CPU, CUDA host (pinned)
_INT_TYPES = {(0, 8): "i1", (0, 16): "i2", (0, 32): "i4", (0, 64): "i8", (1, 8): "u1", (1, 16): "u2", (1, 32): "u4", (1, 64): "u8"}


def _flat_stride(ndim: int, shape: list[int], strides: list[int] | None) -> int:
    """The element stride that walks every element in row-major order, or 0 if none does."""
    if ndim == 0 or strides is None:
        return 1
    if ndim == 1:
        return strides[0]
    want = 1
    for d, s in zip(reversed(shape), reversed(strides)):
        if d != 1 and s != want:
            return 0
        want *= d
    return 1


def dlpack_facts(capsule: Any, /) -> tuple[int, int, int, int, int, int, tuple[tuple[int, int], ...] | None]:
    """``(device_type, device_id, numel, dtype_code, dtype_bits, ptr, runs)`` of the tensor an
    unconsumed ``"dltensor"`` capsule holds. ``ptr`` is 0 for an empty tensor. ``runs`` are the
    runs of its values in row-major order, read in place, where they are host memory (DLPack
    CPU or CUDA host) of an integer type and one stride walks them; else None (also where a
    non-empty tensor has a null data pointer: no memory to read)."""
    if not _capsule_valid(capsule, b"dltensor"):
        raise TypeError(
            f'dlpack_facts: an unconsumed "dltensor" capsule is needed, got {type(capsule).__name__}'
        )
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    ndim = t.ndim
    if ndim < 0 or (ndim > 0 and not t.shape):
        raise ValueError(f"dlpack_facts: the capsule's tensor has ndim {ndim} and {'a' if t.shape else 'no'} shape")
    shape = [t.shape[i] for i in range(ndim)]
    numel = 1
    for i, d in enumerate(shape):
        if d < 0 or (d and numel > _MAX // d):
            raise ValueError(f"dlpack_facts: dimension {i} of the capsule's tensor is {d}")
        numel *= d
    ptr = ((t.data or 0) + t.byte_offset) & ((1 << 64) - 1) if numel else 0
    code, bits = t.dtype.code, t.dtype.bits
    kind = _INT_TYPES.get((code, bits)) if t.dtype.lanes == 1 else None
    runs: tuple[tuple[int, int], ...] | None = None
    # no memory behind a non-empty tensor (a wrapper subclass has no storage): nothing to read
    if t.device.device_type in _HOST_DEVICES and kind is not None and (t.data or not numel):
        strides = [t.strides[i] for i in range(ndim)] if t.strides else None
        stride = _flat_stride(ndim, shape, strides)
        if numel <= 1 or stride > 0:
            size = bits // 8
            span = (numel - 1) * max(stride, 1) + 1 if numel else 0
            raw = (ctypes.c_char * (span * size)).from_address(ptr) if numel else b""
            values = np.frombuffer(raw, dtype=np.dtype(kind), count=span)[:: max(stride, 1)]
            runs = runs_of(values.astype(np.int64, copy=False))
    return (t.device.device_type, t.device.device_id, numel, code, bits, ptr, runs)


def use_refs(uses: Any, cache: Any, ref_type: Any, names: Any, slow: Any, /) -> list[Any]:
    """The ``TensorRef`` of each tensor of ``uses`` (``(pool, role) -> tensor``, in order), made
    once per ``(id(tensor), pool, role)`` in ``cache`` by ``slow(tensor, pool, role)``.
    ``ref_type`` and ``names`` (the dtype names, the device names, the ``torch.device``
    class) are what the C module reads the common tensors with; they do not change the
    result."""
    if not isinstance(uses, dict) or not isinstance(cache, dict):
        raise TypeError("use_refs(): uses and cache are dicts")
    if not callable(ref_type) or not callable(slow):
        raise TypeError("use_refs(): ref_type (the TensorRef class) and slow are callables")
    if not (isinstance(names, tuple) and len(names) == 3 and isinstance(names[0], dict) and isinstance(names[1], dict)):
        raise TypeError("use_refs(): names is (dtype names dict, device names dict, device class)")
    out = []
    for key, t in uses.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TypeError(f"use_refs(): a key of uses is (pool, role), got {key!r}")
        pool, role = key
        ck = (id(t), pool, role)
        got = cache.get(ck)
        if got is None:
            got = cache[ck] = slow(t, pool, role)
        out.append(got)
    return out


def recorded(
    tensors: Any, refs: Any, records: Any, stream: Any, stream_name: Any, stream_names: Any, /
) -> list[tuple[int, Any]]:
    """``[(place in tensors, stream name), ...]``: each record ``(tensor, stream)`` made on a
    tensor of ``tensors`` (a used tensor, ``refs`` its ``TensorRef``), in record order. A record
    on another tensor object with the same memory (``data_ptr``, 0 when empty, and ``numel``)
    counts for the used tensors with that memory; a record on other memory for none. The
    stream's name is ``stream_name`` for ``stream``, else ``stream_names[id(stream)]``, else
    ``"stream@<id in hex>"``."""
    if not (isinstance(tensors, list) and isinstance(refs, list) and isinstance(records, list)):
        raise TypeError("recorded(): tensors, refs and records are lists, stream_names a dict")
    if not isinstance(stream_names, dict):
        raise TypeError("recorded(): tensors, refs and records are lists, stream_names a dict")
    if len(refs) != len(tensors):
        raise ValueError(f"recorded(): {len(tensors)} tensors and {len(refs)} refs")
    by_id: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        by_id.setdefault(id(t), []).append(i)
    by_ptr: dict[tuple[Any, Any], list[int]] | None = None  # built if a record needs it
    out: list[tuple[int, Any]] = []
    for rec in records:
        if not (isinstance(rec, tuple) and len(rec) == 2):
            raise TypeError(f"recorded(): a record is (tensor, stream), got {rec!r}")
        tensor, rec_stream = rec
        hits = by_id.get(id(tensor))
        if hits is None:  # the same memory seen through another tensor object
            if by_ptr is None:
                by_ptr = {}
                for group in by_id.values():
                    for i in group:
                        by_ptr.setdefault((refs[i].ptr, refs[i].numel), []).append(i)
            numel = tensor.numel()
            hits = by_ptr.get((tensor.data_ptr() if numel else 0, numel))
        if not hits:
            continue  # a tensor no copy of this op received
        if rec_stream is stream:
            name = stream_name
        else:
            name = stream_names.get(id(rec_stream)) or f"stream@{id(rec_stream):x}"
        out += [(i, name) for i in hits]
    return out


class _Recording(threading.local):
    on: bool = False


_RECORDING = _Recording()


def recording() -> bool:
    """Whether this thread is inside a record a record observer is making."""
    return _RECORDING.on


def record_observer(original: Any, current: Any, /) -> Any:
    """What the SGLang adapter puts as ``torch.Tensor.record_stream``: a call
    ``record_stream(tensor, stream)`` with ``current.sub`` set, on a thread not already inside
    a record (:func:`recording`: torch-function dispatch calls the observer again), makes the
    record (``original(tensor, stream)``) with :func:`recording` set, then appends ``(tensor,
    stream)`` to ``current.sub.records``; any other call is ``original``'s. A record that
    raised was not made: it is not appended."""
    if not callable(original):
        raise TypeError(f"RecordObserver(): original is torch's record_stream, got {original!r}")
    here = _RECORDING

    def record_stream(tensor: Any, stream: Any) -> None:
        sub = current.sub
        if sub is None or here.on:  # no submission; torch-function dispatch calls us again
            return original(tensor, stream)  # type: ignore[no-any-return]
        here.on = True
        try:
            original(tensor, stream)  # a record that fails was not made
        finally:
            here.on = False
        sub.records.append((tensor, stream))
        return None

    record_stream.__doc__ = original.__doc__
    record_stream.__wrapped__ = original  # type: ignore[attr-defined]
    return record_stream


def _transfer_pool(t: Any, pool_names: dict[int, Any], pool_name: Any) -> Any:
    """The text of a transfer's pool (``t.name``): ``pool_names[id(name)] = (name, text)`` where
    that entry holds this name object, else ``pool_name(name)``."""
    name = t.name
    hit = pool_names.get(id(name))
    return hit[1] if type(hit) is tuple and len(hit) == 2 and hit[0] is name else pool_name(name)


def op_tensors(
    host: Any, device: Any, transfers: Any, anchor: Any, tensor_type: Any, pool_names: Any, pool_name: Any, /
) -> dict[tuple[Any, str], Any]:
    """``{(pool, role): tensor}`` of an op: ``(anchor, "host")`` and ``(anchor, "device")``,
    then each transfer's ``host_indices`` and ``device_indices`` (none where ``transfers`` is
    falsy), each only where it is a ``tensor_type``. A transfer's pool is its name's text:
    ``pool_names[id(name)] = (name, text)`` where that entry holds this name object, else
    ``pool_name(name)``."""
    if not isinstance(pool_names, dict):
        raise TypeError("op_tensors(): pool_names is a dict")
    rows = [(anchor, host, device)]
    for t in transfers or ():
        rows.append((_transfer_pool(t, pool_names, pool_name), t.host_indices, t.device_indices))
    out: dict[tuple[Any, str], Any] = {}
    for pool, h, d in rows:
        if isinstance(h, tensor_type):
            out[(pool, "host")] = h
        if isinstance(d, tensor_type):
            out[(pool, "device")] = d
    return out


def device_changes(before: Any, after: Any, names: Any, slow: Any, /) -> list[tuple[Any, Any, Any, Any]]:
    """``[((pool, role), was, now, new tensor), ...]``: the tensors of ``before`` (an op's
    tensors before a move) that ``after`` holds as another object on another device, in
    ``before``'s order, their device names ``slow(tensor)``'s (``device_name``; ``names`` is
    what the C module reads the common tensors with). Run with torch function dispatch off."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        raise TypeError("device_changes(): before and after are dicts")
    if not (isinstance(names, tuple) and len(names) == 3 and isinstance(names[1], dict)):
        raise TypeError("device_changes(): names is (dtype names dict, device names dict, device class)")
    out = []
    for key, src in before.items():
        dst = after.get(key)
        if dst is None or dst is src:
            continue
        was, now = slow(src), slow(dst)
        if now != was:
            out.append((key, was, now, dst))
    return out


def received(uses: Any, pool: Any, host: Any, device: Any, tensor_type: Any, /) -> dict[int, tuple[str, Any]]:
    """A copy's index tensors, now uses of its op: ``uses[(pool, "host")]`` and
    ``uses[(pool, "device")]`` where not there yet, for each that is a ``tensor_type``;
    returns ``{id(tensor): (role, tensor)}`` of those that do not report ``is_cuda`` (an index
    tensor off the device, which the copy could move to it itself). Run with torch function
    dispatch off."""
    if not isinstance(uses, dict):
        raise TypeError("received(): uses is a dict")
    watched: dict[int, tuple[str, Any]] = {}
    for role, t in (("host", host), ("device", device)):
        if isinstance(t, tensor_type):
            uses.setdefault((pool, role), t)
            if not t.is_cuda:
                watched[id(t)] = (role, t)
    return watched


def submission_event(
    emit: Any, cls: Any, sub: Any, op_id: Any, refs: Any, result: Any, now: Any, pools: Any, setup: Any, /
) -> Any:
    """A submission's one event (the SGLang adapter's ``metrics`` and ``sampling`` profiles),
    as ``emit(cls, **fields)`` makes it, from what its hooks noted on ``sub``. ``setup``:
    ``(streams, stream_names, io_backend, layout, device, sidecar_pools, audit_sample,
    slot_bytes, queued_at, anchor, pool_names, pool_name, moved_type, h2d)``: ``streams`` maps
    ``sub.direction`` to ``(owner, attribute)`` of its stream; ``queued_at`` maps ``id(op)`` to
    when it was queued (each queued op's entry taken, ``now`` where none); the rest as
    :func:`slots_by_pool`, :func:`recorded` and the event's fields take them. ``refs``: the
    ``TensorRef`` of each of ``sub.uses``'s tensors, in order. Run with torch function
    dispatch off."""
    if type(setup) is not tuple or len(setup) != 14:
        raise TypeError(f"submission_event(): setup is a tuple of 14, got {setup!r}")
    (streams, stream_names, io_backend, layout, device, sidecar_pools, audit_sample, slot_bytes, queued_at, anchor,
     pool_names, pool_name, moved_type, h2d) = setup  # fmt: skip
    if not (
        all(isinstance(d, dict) for d in (streams, stream_names, slot_bytes, queued_at)) and isinstance(refs, list)
    ):
        raise TypeError(
            "submission_event(): setup's streams, stream_names, slot_bytes and queued_at are dicts, refs a list"
        )
    direction = sub.direction
    if direction not in streams:
        raise KeyError(f"submission_event(): no stream for direction {direction!r}")
    where = streams[direction]
    if not (isinstance(where, tuple) and len(where) == 2):
        raise TypeError(f"submission_event(): streams maps to (owner, attribute), got {where!r}")
    stream = getattr(*where)
    stream_name = stream_names.get(id(stream)) or f"stream@{id(stream):x}"
    tensors = tuple(refs)
    op = sub.op
    if op is None:
        slots: Any = ()
        bytes_by_pool: Any = ()
        node_ids: Any = ()
    else:
        slots = slots_by_pool(op, anchor, pool_names, pool_name)
        rows = []
        for item in slots:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"slots_by_pool gave {item!r}, not (pool, slots)")
            rows.append((item[0], item[1] * slot_bytes.get(item[0], 0)))
        bytes_by_pool = tuple(rows)
        node_ids = tuple([int(n) for n in getattr(op, "node_ids", None) or ()])
    producer_id = int(result) if direction == h2d and isinstance(result, int) else -1
    on_cpu = tuple(sub.host_indices_on_cpu)
    queued = []
    for q in sub.queued_ops:
        op_of_q = int(q.id)
        nodes = getattr(q, "node_ids", None)
        node = int(nodes[0]) if nodes else -1
        priority = q.priority
        queued.append((op_of_q, node, op_of_q if priority is None else int(priority), queued_at.pop(id(q), now)))
    moves = tuple(sub.moves)
    side = []
    for m in sub.side_moves:
        t = tuple(m)
        if len(t) != 5:
            raise ValueError(f"a side move is (pool, role, src, dst, ref), got {t!r}")
        side.append(moved_type(*t, stream_name))
    moves += tuple(side)
    uses = sub.uses
    records = sub.records
    if not isinstance(uses, dict):
        raise TypeError("submission_event(): the submission's uses is a dict")
    marks = tuple(recorded(list(uses.values()), refs, records, stream, stream_name, stream_names))
    return emit(
        cls,
        op=op_id,
        direction=direction,
        stream=stream_name,
        io_backend=io_backend,
        layout=layout,
        tensors=tensors,
        slots_by_pool=slots,
        bytes_by_pool=bytes_by_pool,
        producer_id=producer_id,
        device=device,
        host_indices_on_cpu=on_cpu,
        sidecar_pools=sidecar_pools,
        queued=tuple(queued),
        node_ids=node_ids,
        moves=moves,
        records=marks,
        sampled=sub.sampled,
        pools=pools,
        audit_sample=audit_sample,
    )


def read_free_lists(obj: Any, head: Any, rest: Any, tensor_type: Any, /) -> tuple[Any, tuple[Any, ...], Any]:
    """One read of an allocator's free lists, as the SGLang adapter's ``_FreeList`` keeps them:
    (the first list, the others, how many pages or slots they hold). The first list (attribute
    ``head``) stays a ``tensor_type``, or becomes a tuple of its values (a list of ints changes
    in place). Each ``(name, counter)`` of ``rest``: a list is kept as ``(list, its length)`` and
    counts ``obj.<counter>`` where that is an int, else the ``numel()`` of its parts; a missing
    or None attribute is None; anything else is kept and counts its ``numel()``. References and
    lengths only: no value of a tensor is read."""
    if not isinstance(rest, tuple):
        raise TypeError("read_free_lists(): rest is a tuple of (name, counter)")
    first = getattr(obj, head)
    if isinstance(first, tensor_type):
        n = first.numel()  # the lists are 1-D; numel() is a C call, len() a Python method
    else:
        first = tuple(first or ())
        n = len(first)
    parts: list[Any] = []
    for pair in rest:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError("read_free_lists(): rest is a tuple of (name, counter)")
        name, counter = pair
        v = getattr(obj, name, None)
        if isinstance(v, list):
            held = getattr(obj, counter, None) if counter else None
            n += held if isinstance(held, int) else sum(x.numel() for x in v)
            parts.append((v, len(v)))
        else:
            if v is not None:
                n += v.numel()
            parts.append(v)
    return first, tuple(parts), n


def value_ref(
    t: Any, pool: Any, role: Any, dev: Any, values: Any, ref_type: Any, names: Any, to_dlpack: Any, slow: Any, /
) -> Any:
    """``t``'s ``TensorRef`` with its values, as the SGLang adapter's ``tensor_ref`` makes it:
    ``slow(t, pool, role, dev, values)`` here (``ref_type``, ``names`` and ``to_dlpack`` are
    what the C module reads the common tensors with)."""
    _names_ok("value_ref", names)
    return slow(t, pool, role, dev, values)


def _names_ok(fn: str, names: Any) -> None:
    if not (isinstance(names, tuple) and len(names) == 3 and isinstance(names[0], dict) and isinstance(names[1], dict)):
        raise TypeError(f"{fn}(): names is (dtype names dict, device names dict, device class)")


def meta_ref(t: Any, pool: Any, role: Any, ref_type: Any, names: Any, slow: Any, /) -> Any:
    """``t``'s ``TensorRef`` without its values, as :func:`use_refs` makes it (uncached):
    ``slow(t, pool, role)`` here (``ref_type`` and ``names`` are what the C module reads the
    common tensors with)."""
    _names_ok("meta_ref", names)
    if not callable(ref_type) or not callable(slow):
        raise TypeError("meta_ref(): ref_type (the TensorRef class) and slow are callables")
    return slow(t, pool, role)


def device_of(t: Any, names: Any, slow: Any, /) -> Any:
    """``t``'s device name: ``slow(t)`` here (``device_name``; ``names`` is what the C module
    reads the common tensors with)."""
    _names_ok("device_of", names)
    if not callable(slow):
        raise TypeError("device_of(): slow is a callable")
    return slow(t)


def _count_failure(failed: Any, what: str) -> None:
    """``except Exception: failed(what)`` (the caller is inside the ``except``)."""
    failed(what)


def _check_setup(setup: Any) -> None:
    if setup is None:
        return
    if type(setup) is not tuple or len(setup) != 10:
        raise TypeError(
            "CopyHook(): setup is None or a tuple of 10 (watch, failed, tensor_type, no_torch_function, "
            f"methods, received, kernel, staged, full, d2h), got {setup!r}"
        )
    for v in (setup[0], setup[1], setup[3], setup[5]):
        if not callable(v):
            raise TypeError(
                f"CopyHook(): setup's watch, failed, no_torch_function and received are callables, got {v!r}"
            )
    if not isinstance(setup[4], tuple):
        raise TypeError(f"CopyHook(): setup's methods is a tuple of names, got {setup[4]!r}")


def _watch_copy(setup: Any, sub: Any, pool: Any, watched: Any, placed: list[Any]) -> tuple[Any, set[Any], Any]:
    """The conversion watch of one copy, made and placed (what was placed is taken off again
    where placing fails), with the roles this pool's copies moved already and the list of moves."""
    watch_type, failed, tensor_type, _, methods, _, _, staged, full, d2h = setup
    if staged is not None and sub.direction == d2h and getattr(staged, "can_use_write_back_jit", None) is True:
        on_cpu = sub.host_indices_on_cpu
        if pool not in on_cpu:
            on_cpu.append(pool)
    side_moves = sub.side_moves
    known = {m[1] for m in side_moves if m[0] == pool}
    values = True if full else bool(sub.sampled)
    watch = watch_type(pool, watched, failed, frozenset(known), values)
    try:
        place_observers(watched, methods, tensor_type, watch, placed)
    except BaseException:
        try:
            remove_observers(placed)
        except Exception:  # the placing's error is the one raised
            pass
        raise
    return watch, known, side_moves


def _keep_moves(watch: Any, pool: Any, known: set[Any], side_moves: Any) -> None:
    """The moves the watch saw, of roles not known yet, appended to ``side_moves`` as
    ``(pool, role, src, dst, ref)``; their roles added to ``known``."""
    if not isinstance(side_moves, list):
        raise TypeError("the submission's side_moves is a list")
    for m in watch.moves:
        t = tuple(m)
        if len(t) != 4:
            raise ValueError(f"the conversion watch's moves are (role, src, dst, ref), got {t!r}")
        role, src, dst, ref = t
        if role not in known:
            side_moves.append((pool, role, src, dst, ref))
            known.add(role)


def _copy_first(original: Any, pool: Any, setup: Any, sub: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The first call of a submission's copy with these index tensors (its key noted in
    ``copied``): ``received`` notes them as the op's uses; where one is off the device and the
    io backend is ``kernel``, the copy runs under a conversion watch and the moves it saw of
    roles this pool's copies had not moved yet join ``sub.side_moves``. A step of this
    bookkeeping that raises is counted (``failed``) and the copy runs as it came; an error of
    the copy itself is raised as it came, after the watch is off."""
    failed, tensor_type, no_torch_function, received_fn, kernel = setup[1], setup[2], setup[3], setup[5], setup[6]
    try:
        uses = sub.uses
        with no_torch_function():
            watched = received_fn(uses, pool, args[1], args[2], tensor_type)
        if not isinstance(watched, dict):
            raise TypeError(f"received() gave {type(watched).__name__}, not a dict")
    except Exception:
        _count_failure(failed, "describe the index tensors a copy received")
        return original(*args, **kwargs)
    if not watched or kernel is not True:  # nothing to watch
        return original(*args, **kwargs)
    placed: list[Any] = []
    try:
        watch, known, side_moves = _watch_copy(setup, sub, pool, watched, placed)
    except Exception:
        _count_failure(failed, "watch the index tensors of a copy")
        return original(*args, **kwargs)
    try:
        out = original(*args, **kwargs)
    finally:
        try:
            remove_observers(placed)
        except Exception:
            _count_failure(failed, "take the conversion watch off a copy's index tensors")
    try:
        _keep_moves(watch, pool, known, side_moves)
    except Exception:
        _count_failure(failed, "record the index tensors a copy moved")
    return out


def copy_hook(original: Any, current: Any, pool: Any, first: Any, setup: Any = None, /) -> Any:
    """What the SGLang adapter puts as a host pool's copy method: a call ``(device_pool,
    host_indices, device_indices, ...)`` outside a submission (``current.sub`` None), or one
    whose ``(pool, id(host_indices), id(device_indices))`` is in ``current.sub.copied``
    already, is ``original``'s; a call of another shape is ``first``'s (which binds its
    arguments by name and calls the hook again). Any other call, the first of these tensors
    in the submission, notes its key in ``copied``; with ``setup`` None it is then
    ``first``'s, else the hook describes the copy itself (:func:`_copy_first`). ``setup``:
    ``(watch, failed, tensor_type, no_torch_function, methods, received, kernel, staged,
    full, d2h)``: the conversion watch's class, called ``(pool, watched, failed, known,
    values)``; the failure count, called with what failed; the tensor class; the context
    manager the reads run in; the method names the watch takes over; ``received`` (called as
    :func:`received`); whether the io backend is ``kernel`` (``True``); the host pool whose
    ``can_use_write_back_jit`` makes a write's host indices CPU ones by design, or None; whether
    every moved tensor is described with its values (else where ``sub.sampled``); the
    direction of a write."""
    if not callable(original) or not callable(first):
        raise TypeError(
            f"CopyHook(): original (the pool's copy) and first are callables, got {original!r} and {first!r}"
        )
    _check_setup(setup)

    def copy(*args: Any, **kwargs: Any) -> Any:
        if len(args) < 3:
            return first(*args, **kwargs)
        sub = current.sub
        if sub is None:
            return original(*args, **kwargs)
        copied = sub.copied
        key = (pool, id(args[1]), id(args[2]))
        if key in copied:
            return original(*args, **kwargs)
        if setup is None:
            return first(*args, **kwargs)
        copied.add(key)
        return _copy_first(original, pool, setup, sub, args, kwargs)

    copy.__wrapped__ = original  # type: ignore[attr-defined]
    return copy


def _submission_ref(setup: Any, sub: Any, t: Any, pool: Any, role: Any) -> Any:
    """``t``'s ``TensorRef`` in this submission, made once (``sub.refs``, keyed ``(id(t), pool,
    role)``): ``tensor_ref``'s where ``sub.sampled``, else :func:`meta_ref`'s."""
    refs = sub.refs
    key = (id(t), pool, role)
    try:
        return refs[key]
    except KeyError:
        pass
    if sub.sampled:
        got = setup[14](t, pool, role)
    else:
        got = meta_ref(t, pool, role, setup[12], setup[9], setup[13])
    refs[key] = got
    return got


def _note_moves(setup: Any, sub: Any, before: Any, after: Any) -> None:
    """Each tensor of ``before`` that ``after`` holds as another object on another device: a
    ``Moved`` on ``sub.moves``."""
    with setup[4]():
        moves = sub.moves
        for key, was, now, dst in device_changes(before, after, setup[9], setup[10]):
            if not (isinstance(key, tuple) and len(key) == 2):
                raise TypeError(f"op_tensors gave the key {key!r}, not (pool, role)")
            pool, role = key
            moves.append(setup[11](pool, role, was, now, _submission_ref(setup, sub, dst, pool, role)))


def _move_tensors(setup: Any, host: Any, device: Any, transfers: Any) -> Any:
    return op_tensors(host, device, transfers, setup[5], setup[6], setup[7], setup[8])


def move_hook(original: Any, current: Any, fallback: Any, setup: Any, /) -> Any:
    """What the SGLang adapter puts as the controller's op-level move of a merged op's indices
    (``move(op, ...) -> (host, device[, transfers])``). A call outside a submission
    (``current.sub`` None) or inside one whose op is set (an inner move) is ``original``'s as
    it came; a call without ``op`` by position is ``fallback``'s. Else ``sub.op`` is ``op``, the
    op is noted as merged, and the tensors of ``op`` before the call and of its result after
    it are compared (:func:`op_tensors`, :func:`device_changes`): each that moved to another
    device is ``sub.moves``'s ``Moved(pool, role, was, now, ref)``, ``ref`` made once per
    submission (``sub.refs``; with its values where ``sub.sampled``), or with setup's ``full``
    set, ``report(sub, before, after)``. A step of this that raises is counted (``failed``) and
    the move runs as it came (or its result is returned as it came). ``setup``: ``(full,
    merged, report, failed, no_torch_function, anchor, tensor_type, pool_names, pool_name,
    names, device_name, moved_type, ref_type, tensor_meta, tensor_ref)``."""
    if not callable(original) or not callable(fallback):
        raise TypeError(
            "MoveHook(): original (the controller's move) and fallback are callables, got "
            f"{original!r} and {fallback!r}"
        )
    if type(setup) is not tuple or len(setup) != 15:
        raise TypeError(
            "MoveHook(): setup is a tuple of 15 (full, merged, report, failed, no_torch_function, anchor, "
            "tensor_type, pool_names, pool_name, names, device_name, moved_type, ref_type, tensor_meta, "
            f"tensor_ref), got {setup!r}"
        )
    for i in (1, 2, 3, 4, 8, 10, 11, 12, 13, 14):
        if not callable(setup[i]):
            raise TypeError(f"MoveHook(): setup's item {i} is a callable, got {setup[i]!r}")
    if not isinstance(setup[7], dict):
        raise TypeError("MoveHook(): setup's pool_names is a dict")
    _names_ok("MoveHook", setup[9])
    full, merged, report, failed = bool(setup[0]), setup[1], setup[2], setup[3]

    def move(*args: Any, **kwargs: Any) -> Any:
        if not args:
            return fallback(*args, **kwargs)
        sub = current.sub
        if sub is None or sub.op is not None:
            return original(*args, **kwargs)
        op = args[0]
        sub.op = op
        try:
            if full:
                merged(sub)
            else:
                sub.merged_emitted = True  # the one event carries it
            before = _move_tensors(setup, op.host_indices, op.device_indices, getattr(op, "pool_transfers", None))
        except Exception:
            _count_failure(failed, "describe an index move")
            return original(*args, **kwargs)
        result = original(*args, **kwargs)
        try:
            transfers = result[2] if len(result) > 2 else getattr(op, "pool_transfers", None)
            after = _move_tensors(setup, result[0], result[1], transfers)
            if full:
                report(sub, before, after)
            else:
                _note_moves(setup, sub, before, after)
        except Exception:
            _count_failure(failed, "describe an index move")
        return result

    move.__wrapped__ = original  # type: ignore[attr-defined]
    return move


class Submission:
    """What one ``start_writing`` / ``start_loading`` call did, as the SGLang adapter's hooks
    observe it (the adapter subclasses it): ``inst``, ``direction``, ``queued`` (the merged
    ops' ids), ``queued_ops`` (the ops as queued; a new list where None), ``op`` (None),
    ``merged_emitted`` (False), ``uses`` ({}), ``records`` ([]), ``acks`` ([]), ``side_moves``
    ([]), ``host_indices_on_cpu`` ([]), ``sampled`` (False), ``moves`` ([]), ``copied``
    (``set()``), ``refs`` ({})."""

    __slots__ = (
        "inst", "direction", "queued", "queued_ops", "op", "merged_emitted", "uses", "records", "acks",
        "side_moves", "host_indices_on_cpu", "sampled", "moves", "copied", "refs",
    )  # fmt: skip

    def __init__(self, inst: Any, direction: Any, queued: Any, queued_ops: Any = None) -> None:
        self.inst = inst
        self.direction = direction
        self.queued = queued
        self.queued_ops = [] if queued_ops is None else queued_ops
        self.op: Any = None
        self.merged_emitted: Any = False
        self.uses: Any = {}
        self.records: Any = []
        self.acks: Any = []
        self.side_moves: Any = []
        self.host_indices_on_cpu: Any = []
        self.sampled: Any = False
        self.moves: Any = []
        self.copied: Any = set()
        self.refs: Any = {}


def start_hook(original: Any, current: Any, setup: Any, /) -> Any:
    """What the SGLang adapter puts as the controller's ``start_writing`` / ``start_loading``.
    ``setup``: ``(owner, attribute, sub_type, inst, direction, sampler, finish)``. A call inside
    a submission already (``current.sub`` set: the call re-entered), or one that finds
    ``getattr(owner, attribute)`` (its queue) empty, is ``original``'s as it came. Else ``sub =
    sub_type(inst, direction, (int(op.id), ...), the ops as queued)``, ``sub.sampled =
    sampler.take()`` where ``sampler`` is not None, ``current.sub = sub`` for the length of
    ``original``'s call (None after it, however it ended), and ``finish(sub, result, None)``
    after it, or ``finish(sub, None, error)`` before its error is raised again."""
    if not callable(original):
        raise TypeError(f"StartHook(): original (the controller's start) is a callable, got {original!r}")
    if not (
        type(setup) is tuple
        and len(setup) == 7
        and isinstance(setup[1], str)
        and callable(setup[2])
        and callable(setup[6])
    ):
        raise TypeError(
            "StartHook(): setup is (owner, attribute name, sub_type, inst, direction, sampler or None, finish), "
            f"sub_type and finish callables, got {setup!r}"
        )
    owner, attr, sub_type, inst, direction, sampler, finish = setup

    def start(*args: Any, **kwargs: Any) -> Any:
        if current.sub is not None:  # re-entered: one submission
            return original(*args, **kwargs)
        ops = list(getattr(owner, attr))
        if not ops:
            return original(*args, **kwargs)
        sub = sub_type(inst, direction, tuple([int(op.id) for op in ops]), ops)
        if sampler is not None:
            sub.sampled = sampler.take()
        current.sub = sub
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            current.sub = None
            finish(sub, None, exc)
            raise
        current.sub = None
        finish(sub, result, None)
        return result

    start.__wrapped__ = original  # type: ignore[attr-defined]
    return start


class OpQueue(list):  # type: ignore[type-arg]
    """A list (the SGLang controller's write or load queue, swapped in by the adapter) whose
    ``append(op)`` calls ``on_append(op)`` after appending, and whose ``clear()`` calls
    ``on_cleared(ops)`` with the ops it took, where it took any. Every other list operation is
    the list's own; a callback's error is raised after the list changed."""

    def __init__(self, items: Any, on_append: Any, on_cleared: Any) -> None:
        for cb in (on_append, on_cleared):
            if not callable(cb):
                raise TypeError(f"OpQueue(): the callbacks are callables, got {cb!r}")
        self._on_append = on_append
        self._on_cleared = on_cleared
        super().__init__(items)

    # list's own methods called by name: one lookup, where super() makes an object per call
    def append(self, op: Any) -> None:
        list.append(self, op)
        self._on_append(op)

    def clear(self) -> None:
        taken = list(self)
        list.clear(self)
        if taken:
            self._on_cleared(taken)

    def __reduce__(self) -> Any:
        raise TypeError(f"cannot copy {type(self).__name__}: it observes a live controller's queue")


class AckQueue(list):  # type: ignore[type-arg]
    """A list (an ack queue) whose ``append(ack)`` calls ``on_append(ack)``; ``pop()``,
    ``remove()`` and ``del`` take acks out, each then ``on_taken(ack)`` in queue order;
    ``clear()`` calls ``on_cleared(ack)`` for each ack it took, in queue order."""

    def __init__(self, items: Any, on_append: Any, on_taken: Any, on_cleared: Any) -> None:
        for cb in (on_append, on_taken, on_cleared):
            if not callable(cb):
                raise TypeError(f"AckQueue(): the callbacks are callables, got {cb!r}")
        self._on_append = on_append
        self._on_taken = on_taken
        self._on_cleared = on_cleared
        super().__init__(items)

    def append(self, ack: Any) -> None:
        list.append(self, ack)
        self._on_append(ack)

    def pop(self, *index: Any) -> Any:
        if len(index) > 1:
            raise TypeError(f"pop expected at most 1 argument, got {len(index)}")
        ack = list.pop(self, *index)
        self._on_taken(ack)
        return ack

    def __delitem__(self, key: Any) -> None:
        taken = self[key] if isinstance(key, slice) else [self[key]]
        list.__delitem__(self, key)
        for ack in taken:
            self._on_taken(ack)

    def remove(self, ack: Any) -> None:
        list.remove(self, ack)
        self._on_taken(ack)

    def clear(self) -> None:
        taken = list(self)
        list.clear(self)
        for ack in taken:
            self._on_cleared(ack)

    def __reduce__(self) -> Any:
        raise TypeError(f"cannot copy {type(self).__name__}: it observes a live controller's queue")


class Stamp:
    """``Stamp(times, clock)``: called with ``x``, notes ``times[id(x)] = clock()``."""

    __slots__ = ("clock", "times")

    def __init__(self, times: Any, clock: Any) -> None:
        if not (isinstance(times, dict) and callable(clock)):
            raise TypeError(f"Stamp(): times is a dict and clock a callable, got {times!r} and {clock!r}")
        self.times, self.clock = times, clock

    def __call__(self, x: Any, /) -> None:
        self.times[id(x)] = self.clock()


class AckNote:
    """``AckNote(current, direction, failed)``: the ack queue's ``on_append``: an ack appended
    inside a submission of this direction (``current.sub.direction``) joins
    ``current.sub.acks``. A failure is ``failed("note an ack of a submission")``, never raised
    into the append."""

    __slots__ = ("current", "direction", "failed")

    def __init__(self, current: Any, direction: Any, failed: Any) -> None:
        if not callable(failed):
            raise TypeError(f"AckNote(): failed is a callable, got {failed!r}")
        self.current, self.direction, self.failed = current, direction, failed

    def __call__(self, ack: Any, /) -> None:
        try:
            sub = self.current.sub
            if sub is not None and sub.direction == self.direction:
                sub.acks.append(ack)
        except Exception:
            _count_failure(self.failed, "note an ack of a submission")


class FinishHook:
    """``FinishHook(fallback, setup)``: the end of a submission under the SGLang adapter's
    ``metrics`` and ``sampling`` profiles, called ``(sub, result, error)`` once the controller's
    start returned or raised. A submission that raised, has no op, or is sampled is
    ``fallback``'s. Else, with torch function dispatch off: the ``TensorRef`` of each tensor its
    copies received (:func:`use_refs`, cached in ``sub.refs``), the time, the pools' occupancy
    where ``usage`` is not empty and ``every_ns`` passed since ``state.pools_at`` (then set
    to now), its one event (:func:`submission_event`, with ``state.event_setup``) and its acks
    awaiting completion (``pending[id(ack)] = (op, direction)``). A failed event is counted
    ("record an OpsSubmitted event") and the acks still await; a step before it that fails is
    counted ("describe a submission") and the acks do not. Then ``sync()`` where
    ``state.durable`` is set. ``setup``: ``(state, failed, no_torch_function, ref_type, names,
    tensor_meta, clock, usage, pool_usage, every_ns, pending, sync, emit, cls)``."""

    __slots__ = ("fallback", "setup")

    def __init__(self, fallback: Any, setup: Any) -> None:
        if not (callable(fallback) and type(setup) is tuple and len(setup) == 14):
            raise TypeError(
                "FinishHook(): fallback is a callable and setup a tuple of 14 (state, failed, no_torch_function, "
                "ref_type, names, tensor_meta, clock, usage, pool_usage, every_ns, pending, sync, emit, cls), "
                f"got {fallback!r} and {setup!r}"
            )
        for i in (1, 2, 3, 5, 6, 8, 11, 12):
            if not callable(setup[i]):
                raise TypeError(f"FinishHook(): setup's item {i} is a callable, got {setup[i]!r}")
        _names_ok("FinishHook", setup[4])
        if not isinstance(setup[10], dict):
            raise TypeError(f"FinishHook(): setup's pending is a dict, got {setup[10]!r}")
        self.fallback, self.setup = fallback, setup

    def __call__(self, sub: Any, result: Any, error: Any, /) -> Any:
        (state, failed, no_torch_function, ref_type, names, tensor_meta, clock, usage, pool_usage, every, pending,
         sync, emit, cls) = self.setup  # fmt: skip
        if error is not None:
            return self.fallback(sub, result, error)
        op = sub.op
        if op is None or sub.sampled:
            return self.fallback(sub, result, error)
        try:
            with no_torch_function():
                op_id = int(op.id)
                refs = use_refs(sub.uses, sub.refs, ref_type, names, tensor_meta)
                now = clock()
                pools: Any = ()
                if usage and now - state.pools_at >= every:
                    state.pools_at = now
                    pools = pool_usage()
                ev_setup = state.event_setup
                awaits = (op_id, sub.direction)
                acks = sub.acks
                try:
                    submission_event(emit, cls, sub, op_id, refs, result, now, pools, ev_setup)
                except Exception:
                    _count_failure(failed, "record an OpsSubmitted event")
                for ack in acks:
                    pending[id(ack)] = awaits
        except Exception:
            _count_failure(failed, "describe a submission")
        if state.durable is not None:
            sync()
        return None


class _Callback:
    __slots__ = ("fallback", "setup")
    _NAME = ""
    _N = 0

    def __init__(self, fallback: Any, setup: Any) -> None:
        if not (callable(fallback) and type(setup) is tuple and len(setup) == self._N):
            raise TypeError(
                f"{self._NAME}(): fallback is a callable and setup a tuple of {self._N}, got {fallback!r} and {setup!r}"
            )
        self.fallback, self.setup = fallback, setup


class AckTaken(_Callback):
    """``AckTaken(fallback, setup)``: an ack queue's ``on_taken`` under the SGLang adapter's
    ``metrics`` and ``sampling`` profiles, called with the ack taken out. An ack no op awaits
    (not in ``pending``) is nothing; one whose op holds device tensors (``held`` not empty) or
    that times its copy (``ack.timing_enabled`` true) is ``fallback``'s. Else its op's
    completion: ``pending``'s entry ``(op, direction)`` taken, ``emit(cls, op=op,
    direction=direction, duration_ns=0)`` (a failure counted: "record a TransferCompleted
    event"), then ``sync()`` where ``state.durable`` is set. ``setup``: ``(pending, held,
    state, emit, cls, failed, sync)``."""

    __slots__ = ()
    _NAME = "AckTaken"
    _N = 7

    def __init__(self, fallback: Any, setup: Any) -> None:
        super().__init__(fallback, setup)
        if not (isinstance(setup[0], dict) and callable(setup[3]) and callable(setup[5]) and callable(setup[6])):
            raise TypeError(
                "AckTaken(): setup is (pending dict, held, state, emit, cls, failed, sync), emit, failed and sync "
                f"callables, got {setup!r}"
            )

    def __call__(self, ack: Any, /) -> None:
        pending, held, state, emit, cls, failed, sync = self.setup
        key = id(ack)
        awaits = pending.get(key)
        if awaits is None:
            return None
        if held or getattr(ack, "timing_enabled", None):
            return self.fallback(ack)  # type: ignore[no-any-return]
        del pending[key]
        try:
            if not (isinstance(awaits, tuple) and len(awaits) == 2):
                raise TypeError(f"pending holds (op, direction), got {awaits!r}")
            emit(cls, op=awaits[0], direction=awaits[1], duration_ns=0)
        except Exception:
            _count_failure(failed, "record a TransferCompleted event")
        if state.durable is not None:
            sync()
        return None


class QueueCleared(_Callback):
    """``QueueCleared(fallback, setup)``: a write or load queue's ``on_cleared`` under the SGLang
    adapter's ``metrics`` and ``sampling`` profiles, called with the ops a ``clear()`` took. The
    usual clear (outside a reset, by the submission of this direction that merged exactly
    these ops, ``current.sub.queued_ops``, or with no queue time noted at all) is nothing; any
    other is ``fallback``'s. ``setup``: ``(direction, resetting, queued_at, current)``."""

    __slots__ = ()
    _NAME = "QueueCleared"
    _N = 4

    def __call__(self, ops: Any, /) -> None:
        direction, resetting, queued_at, current = self.setup
        if resetting.depth:
            return self.fallback(ops)  # type: ignore[no-any-return]
        if not queued_at:
            return None
        sub = current.sub
        if sub is not None and sub.direction == direction:
            mine = sub.queued_ops
            if not (isinstance(mine, list) and isinstance(ops, list)):
                raise TypeError("the merged ops and the ops cleared are lists")
            if len(mine) == len(ops) and all(map(operator.is_, mine, ops)):
                return None
        return self.fallback(ops)  # type: ignore[no-any-return]


def place_observers(watched: Any, methods: Any, tensor_type: Any, watch: Any, placed: Any, /) -> None:
    """The SGLang adapter's conversion watch's entry: for each ``(role, tensor)`` of
    ``watched.values()`` that has a ``__dict__``, and each name of ``methods`` not in it
    already, ``tensor.__dict__[name]`` is a :func:`conversion_observer` of
    ``getattr(tensor_type, name)``, and ``(tensor, name)`` is appended to ``placed``."""
    if not (isinstance(watched, dict) and isinstance(methods, tuple) and isinstance(placed, list)):
        raise TypeError("place_observers(): watched is a dict, methods a tuple, placed a list")
    for entry in list(watched.values()):
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise TypeError("place_observers(): watched maps to (role, tensor)")
        role, t = entry
        d = getattr(t, "__dict__", None)
        if d is None:
            continue
        for name in methods:
            if name not in d:  # never over something already there
                d[name] = conversion_observer(getattr(tensor_type, name), t, role, watch, tensor_type)
                placed.append((t, name))


def remove_observers(placed: Any, /) -> None:
    """The conversion watch's exit: ``tensor.__dict__.pop(name, None)`` for each ``(tensor,
    name)`` of ``placed``, then ``placed`` emptied."""
    if not isinstance(placed, list):
        raise TypeError("remove_observers(): placed is a list")
    for pair in placed:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError("remove_observers(): placed holds (tensor, name)")
        pair[0].__dict__.pop(pair[1], None)
    placed.clear()


def slot_guard(original: Any, hook: Any, watch: Any, lock: Any, /) -> Any:
    """What the SGLang adapter puts as an allocator call that can change its free lists: a call
    holds ``lock``; inside another such call (``watch.depth`` true: an allocation's own merge,
    a group's free inside its end) it is ``original``'s as it came, else ``hook``'s, with
    ``watch.depth`` 1 for its length and 0 after."""
    if not callable(original) or not callable(hook):
        raise TypeError(
            f"SlotGuard(): original (the allocator's call) and hook are callables, got {original!r} and {hook!r}"
        )

    def call(*args: Any, **kwargs: Any) -> Any:
        with lock:
            if watch.depth:
                return original(*args, **kwargs)
            watch.depth = 1
            try:
                return hook(*args, **kwargs)
            finally:
                watch.depth = 0

    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


def slots_by_pool(op: Any, anchor: Any, pool_names: Any, pool_name: Any, /) -> tuple[tuple[Any, int], ...]:
    """``((pool, slots), ...)`` an op moves: the anchor's (its host indices' ``numel``), then,
    in the order of ``op.pool_transfers``, each transfer's pool (named as :func:`op_tensors`
    names it) with the ``numel`` of its host indices, else of its device indices, else 0, a
    pool's transfers summed; a transfer whose indices come from another pool
    (``indices_from_pool``) is not counted. Run with torch function dispatch off."""
    if not isinstance(pool_names, dict):
        raise TypeError("slots_by_pool(): pool_names is a dict")
    slots = {anchor: int(op.host_indices.numel())}
    transfers = getattr(op, "pool_transfers", None)
    if transfers:
        for t in transfers:
            if getattr(t, "indices_from_pool", None) is not None:
                continue
            idx = t.host_indices
            if idx is None:
                idx = t.device_indices
            name = _transfer_pool(t, pool_names, pool_name)
            slots[name] = slots.get(name, 0) + (int(idx.numel()) if idx is not None else 0)
    return tuple(slots.items())


def conversion_observer(method: Any, src: Any, role: Any, watch: Any, tensor_type: Any, /) -> Any:
    """What the SGLang adapter's conversion watch puts as ``src.to`` / ``src.cuda`` for the
    length of one copy call: ``method(src, ...)`` as it came; where that returned a
    ``tensor_type`` other than ``src``, on the watch's thread (``watch.thread``), for a role
    not in ``watch.known``, ``watch.describe(src, out, role)`` describes it."""
    if not callable(method):
        raise TypeError(f"ConversionObserver(): method is torch.Tensor's to or cuda, got {method!r}")

    def call(*args: Any, **kwargs: Any) -> Any:
        out = method(src, *args, **kwargs)
        if (
            out is not src
            and isinstance(out, tensor_type)
            and watch.thread == threading.get_ident()
            and role not in watch.known
        ):
            watch.describe(src, out, role)
        return out

    call.__wrapped__ = method  # type: ignore[attr-defined]
    return call
