"""The ``sim`` runtime: CUDA stream and caching-allocator semantics on a CPU.

What it models, and why each part matters for the bug class this project audits:

- **Device memory** is an arena of byte segments. Every tensor that an op on a
  device tensor produces (:class:`SimTensor`) is copied into a block of the arena;
  views share their base's block. ``is_device`` is true for them.
- **The caching allocator.** A block whose last tensor is garbage-collected goes
  back to a LIFO free list of its size class at once, so the next allocation of
  that size reuses the most recently freed block, unless ``record_stream`` named a
  stream that still has queued work: then the block returns only after that work
  ran. That is exactly what makes a missing record dangerous.
- **Side streams.** Work launched on a side stream is queued, not run. It runs on
  ``synchronize()``, ``event.query()`` / ``event.synchronize()``, a wait of the
  main stream on one of its events, or ``drain()``. Queued work captures arena
  offsets, never Python tensors: if the block was freed and reused meanwhile, the
  work reads whatever the new owner wrote there, as a CUDA kernel would.
- The main stream is synchronous.

``paused()`` holds side-stream work back (queries report "not done") so tests can
observe in-flight states.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._runtime import CallObservers
from ._torch_compat import plain_tensor_calls

__all__ = [
    "SimRuntime",
    "SimTensor",
    "SimStream",
    "SimEvent",
    "SimArena",
    "SimScheduler",
    "SimTensorInfo",
    "sim_info",
    "set_sim_info",
]

_MIN_BLOCK = 512
_SEGMENT_BYTES = 8 << 20


def _size_class(nbytes: int) -> int:
    n = max(_MIN_BLOCK, nbytes)
    return 1 << (n - 1).bit_length()


class _Block:
    """One allocation in the arena; freed when the last tensor on it dies. ``ptr`` is the
    address of its first byte."""

    __slots__ = ("arena", "seg", "offset", "size", "ptr", "streams", "__weakref__")

    def __init__(self, arena: SimArena, seg: int, offset: int, size: int, ptr: int) -> None:
        self.arena = arena
        self.seg = seg
        self.offset = offset
        self.size = size
        self.ptr = ptr
        self.streams: set[SimStream] | None = None

    def __del__(self) -> None:
        arena = self.arena
        if arena is not None and not arena.closed:
            arena.release(self.seg, self.offset, self.size, self.streams)


class SimTensorInfo:
    """What the sim runtime knows of one of its device tensors: the arena ``block`` it
    lives on (None for a persistent buffer, a pool's storage) and the ``runtime`` whose
    arena that is. A view shares its base's."""

    __slots__ = ("block", "runtime")

    def __init__(self, block: _Block | None, runtime: SimRuntime) -> None:
        self.block = block
        self.runtime = runtime

    def __repr__(self) -> str:
        where = "a persistent buffer" if self.block is None else f"block {self.block.seg}:{self.block.offset}"
        return f"<SimTensorInfo {where} of runtime {id(self.runtime):#x}>"


class SimTensor(torch.Tensor):
    """A tensor that lives in the sim runtime's device arena (or a pool buffer).

    ``hicache_sim`` is its :class:`SimTensorInfo` (read it with :func:`sim_info`)."""

    hicache_sim: SimTensorInfo

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def,override]
        if kwargs is None:
            kwargs = {}
        rt: SimRuntime | None = None
        sims: list[SimTensor] = []
        for a in itertools.chain(args, kwargs.values()):
            if isinstance(a, SimTensor):
                sims.append(a)
            elif isinstance(a, (list, tuple)):
                sims.extend(x for x in a if isinstance(x, SimTensor))
        if sims:
            rt = sims[0].hicache_sim.runtime
        with plain_tensor_calls():
            if func in _TO_HOST or (func is torch.Tensor.to and _targets_cpu(args, kwargs)):
                src = args[0]
                return torch.Tensor.clone(src.as_subclass(torch.Tensor))
            ret = func(*args, **kwargs)
        if rt is None:
            return ret
        return _wrap_result(rt, ret, sims)

    def __reduce_ex__(self, proto):  # type: ignore[no-untyped-def,override]
        raise TypeError("sim device tensors cannot be pickled; move them to the host first")


def sim_info(t: torch.Tensor) -> SimTensorInfo | None:
    """The sim runtime's record of ``t`` (its block and runtime), or None when ``t`` is no
    sim device tensor."""
    return getattr(t, "hicache_sim", None) if isinstance(t, SimTensor) else None


def set_sim_info(t: SimTensor, info: SimTensorInfo) -> None:
    """Make ``t`` a device tensor on ``info``'s block of ``info``'s runtime."""
    t.hicache_sim = info


_TO_HOST = {torch.Tensor.cpu, torch.Tensor.numpy}


def _targets_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    dev = kwargs.get("device")
    if dev is None:
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                dev = a
                break
    return dev is not None and torch.device(dev).type == "cpu"


def _wrap_result(rt: SimRuntime, ret: Any, sims: list[SimTensor]) -> Any:
    if isinstance(ret, torch.Tensor):
        return _wrap_tensor(rt, ret, sims)
    if isinstance(ret, (tuple, list)) and any(isinstance(r, torch.Tensor) for r in ret):
        wrapped = [_wrap_tensor(rt, r, sims) if isinstance(r, torch.Tensor) else r for r in ret]
        if isinstance(ret, list) or type(ret) is tuple:
            return type(ret)(wrapped)
        if hasattr(ret, "_fields"):  # a namedtuple
            return type(ret)(*wrapped)
        return type(ret)(wrapped)  # torch.return_types (sort, max, ...) keep their field names
    return ret


def _wrap_tensor(rt: SimRuntime, t: torch.Tensor, sims: list[SimTensor]) -> SimTensor:
    for s in sims:
        if t is s:
            return s
    with plain_tensor_calls():
        return _wrap_plain(rt, t, sims)


def _wrap_plain(rt: SimRuntime, t: torch.Tensor, sims: list[SimTensor]) -> SimTensor:
    if t.numel() > 0:
        ptr = t.data_ptr()
        for s in sims:
            if s.numel() == 0:
                continue
            sp = s.untyped_storage().data_ptr()
            if t.untyped_storage().data_ptr() != sp:
                continue
            # a view of ``s``'s memory: it is on the same block of the same runtime
            info = s.hicache_sim
            blk = info.block
            if blk is None or blk.ptr <= ptr < blk.ptr + blk.size:  # None: a view of a persistent pool buffer
                out = t.as_subclass(SimTensor)
                out.hicache_sim = info
                return out
    return rt.arena.alloc_copy(t)


class SimArena:
    """The caching-allocator model of one :class:`SimRuntime` (see the module doc).

    Byte segments are carved into blocks of power-of-two size classes. A freed block goes
    back to its class's LIFO free list at once, unless a stream that ``record_stream``
    named still has work queued: then :meth:`release` defers it, and :meth:`retire` returns
    it once that work ran. Every method takes ``lock``, the runtime's one lock, shared with
    the stream queues: tensors die, and streams run, on whatever thread drops or polls them.
    ``closed`` (set by the runtime's ``close()``) turns frees into no-ops."""

    def __init__(self, runtime: SimRuntime, lock: threading.RLock, segment_bytes: int = _SEGMENT_BYTES) -> None:
        self.runtime = runtime
        self.lock = lock
        self.closed = False
        self.blocks_allocated = 0
        self.blocks_reused = 0
        self._segment_bytes = segment_bytes
        self._segs: list[torch.Tensor] = []
        self._seg_ptrs: list[int] = []
        self._seg_used: list[int] = []
        self._free: dict[int, list[tuple[int, int]]] = {}
        self._deferred: list[tuple[int, int, int, list[tuple[SimStream, int]]]] = []
        # the persistent buffers' side data: they all name this runtime and no block
        self.buffer_info = SimTensorInfo(None, runtime)

    def alloc(self, nbytes: int) -> _Block:
        """A block of at least ``nbytes``: the most recently freed one of its size class, or a new one."""
        with self.lock:
            size = _size_class(nbytes)
            free = self._free.get(size)
            if free:
                seg, off = free.pop()  # LIFO: the most recently freed block first
                self.blocks_reused += 1
            else:
                seg, off = self._bump(size)
            self.blocks_allocated += 1
            return _Block(self, seg, off, size, self._seg_ptrs[seg] + off)

    def _bump(self, size: int) -> tuple[int, int]:
        if self._segs:
            i = len(self._segs) - 1
            if self._seg_used[i] + size <= self._segs[i].numel():
                off = self._seg_used[i]
                self._seg_used[i] += size
                return i, off
        seg = torch.zeros(max(self._segment_bytes, size), dtype=torch.uint8)
        self._segs.append(seg)
        self._seg_ptrs.append(seg.data_ptr())
        self._seg_used.append(size)
        return len(self._segs) - 1, 0

    def release(self, seg: int, off: int, size: int, streams: set[SimStream] | None) -> None:
        """Free the block at ``seg``/``off``: at once, or, when one of ``streams`` still has
        queued work, after that work ran (see :meth:`retire`)."""
        with self.lock:
            if streams:
                pending = [(s, s.submitted) for s in streams if s.submitted > s.completed]
                if pending:
                    self._deferred.append((seg, off, size, pending))
                    return
            self._free.setdefault(size, []).append((seg, off))

    def retire(self) -> None:
        """Return the deferred blocks whose streams ran the work they waited for."""
        with self.lock:
            keep = []
            for item in self._deferred:
                seg, off, size, pending = item
                if all(s.completed >= t for s, t in pending):
                    self._free.setdefault(size, []).append((seg, off))
                else:
                    keep.append(item)
            self._deferred = keep

    @property
    def has_deferred_frees(self) -> bool:
        """Whether a freed block waits for a stream's work."""
        return bool(self._deferred)

    def new(self, shape: tuple[int, ...], dtype: torch.dtype) -> SimTensor:
        """A device tensor of ``shape`` and ``dtype`` on a block of its own (values unset)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = 1
        for d in shape:
            n *= d
        blk = self.alloc(n * itemsize)
        raw = self._segs[blk.seg][blk.offset : blk.offset + n * itemsize]
        out = raw.view(dtype).view(shape).as_subclass(SimTensor)
        out.hicache_sim = SimTensorInfo(blk, self.runtime)
        return out

    def alloc_copy(self, t: torch.Tensor) -> SimTensor:
        """A device tensor on a block of its own holding ``t``'s values."""
        out = self.new(tuple(t.shape), t.dtype)
        with plain_tensor_calls():
            out.copy_(t)
        return out

    def strided(
        self, seg: int, byte_off: int, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A plain tensor over segment ``seg``'s bytes from ``byte_off``, with ``shape`` and ``stride``
        (what queued work rebuilds from the offsets it captured)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self._segs[seg].view(dtype).as_strided(shape, stride, byte_off // itemsize)

    @property
    def free_blocks(self) -> int:
        """Blocks on the free lists."""
        return sum(len(v) for v in self._free.values())

    @property
    def deferred_blocks(self) -> int:
        """Freed blocks held back until a stream ran its work."""
        return len(self._deferred)


class SimStream:
    """A side stream: a FIFO of deferred work items, each with a ticket."""

    __slots__ = ("name", "rt", "queue", "submitted", "completed", "is_main", "__weakref__")

    def __init__(self, rt: SimRuntime, name: str, is_main: bool = False) -> None:
        self.rt = rt
        self.name = name
        self.queue: deque[tuple[int, Callable[[], None]]] = deque()
        self.submitted = 0
        self.completed = 0
        self.is_main = is_main

    def submit(self, work: Callable[[], None]) -> int:
        with self.rt.scheduler.lock:
            self.submitted += 1
            self.queue.append((self.submitted, work))
            return self.submitted

    def run_until(self, ticket: int) -> None:
        with self.rt.scheduler.lock:
            self._run_until(ticket)

    def _run_until(self, ticket: int) -> None:
        ran = False
        while self.queue and self.queue[0][0] <= ticket:
            t, work = self.queue.popleft()
            work()
            self.completed = t
            ran = True
        if self.completed < ticket:
            self.completed = ticket
        arena = self.rt.arena
        if ran or arena.has_deferred_frees:
            arena.retire()

    def pending(self) -> bool:
        return bool(self.queue)

    def __repr__(self) -> str:
        return f"<sim stream {self.name} submitted={self.submitted} completed={self.completed}>"


class SimScheduler:
    """The stream state of one :class:`SimRuntime`.

    ``lock``: the one lock of the stream queues and the arena. ``main``: the synchronous
    main stream. ``streams``: the side streams made so far. ``paused``: side-stream work is
    held back (queries answer "not done"). ``current``: the calling thread's current stream,
    ``main`` unless set (the runtime's ``use()``): it is per thread, as in CUDA."""

    __slots__ = ("lock", "main", "streams", "paused", "_tls")

    def __init__(self, main: SimStream) -> None:
        self.lock = threading.RLock()
        self.main = main
        self.streams: list[SimStream] = []
        self.paused = False
        self._tls = threading.local()

    @property
    def current(self) -> SimStream:
        return getattr(self._tls, "stream", self.main)

    @current.setter
    def current(self, stream: SimStream) -> None:
        self._tls.stream = stream


class SimEvent:
    """A CUDA-like event: records a point in a stream's queue."""

    __slots__ = ("rt", "stream", "ticket", "t_ns", "timing")

    def __init__(self, rt: SimRuntime, enable_timing: bool) -> None:
        self.rt = rt
        self.stream: SimStream | None = None
        self.ticket = 0
        self.t_ns: int | None = None
        self.timing = enable_timing

    def record(self, stream: Any = None) -> None:
        s: SimStream = stream if stream is not None else self.rt.scheduler.current
        self.t_ns = None
        if s.is_main:
            self.stream = None
            self.ticket = 0
            self.t_ns = time.perf_counter_ns()
            return
        self.stream = s
        self.ticket = s.submit(self._stamp)

    def _stamp(self) -> None:
        self.t_ns = time.perf_counter_ns()

    def query(self) -> bool:
        s = self.stream
        if s is None or s.completed >= self.ticket:
            return True
        if self.rt.scheduler.paused:
            return False
        s.run_until(self.ticket)
        return True

    def synchronize(self) -> None:
        s = self.stream
        if s is not None and s.completed < self.ticket:
            if self.rt.scheduler.paused:
                raise RuntimeError("SimEvent.synchronize() inside SimRuntime.paused() would deadlock")
            s.run_until(self.ticket)

    def wait(self, stream: Any = None) -> None:
        sched = self.rt.scheduler
        waiter: SimStream = stream if stream is not None else sched.current
        src, ticket = self.stream, self.ticket
        if src is None or src is waiter:
            return
        if waiter.is_main:
            # the synchronous main stream blocks until the event's work ran
            if src.completed < ticket:
                if sched.paused:
                    raise RuntimeError("main stream waited on a paused side stream")
                src.run_until(ticket)
            return
        waiter.submit(lambda: src.run_until(ticket))

    def elapsed_ns(self, end: Any) -> int | None:
        t1 = getattr(end, "t_ns", None)
        if self.t_ns is None or t1 is None:
            return None
        return max(0, t1 - self.t_ns)


class SimRuntime:
    """CPU model of CUDA streams, events and the caching allocator (see module doc).

    ``scheduler`` (:class:`SimScheduler`) holds the streams and their lock, ``arena``
    (:class:`SimArena`) the device memory."""

    name = "sim"
    device = "sim:0"
    has_device = True
    #: the type of this runtime's device tensors (an index tensor of any other subclass is refused)
    tensor_type = SimTensor

    def __init__(self, segment_bytes: int = _SEGMENT_BYTES) -> None:
        self.scheduler = SimScheduler(SimStream(self, "main", is_main=True))
        self.arena = SimArena(self, self.scheduler.lock, segment_bytes)
        self.observers = CallObservers()

    # ----------------------------------------------------------- allocator model
    @property
    def blocks_allocated(self) -> int:
        return self.arena.blocks_allocated

    @property
    def blocks_reused(self) -> int:
        return self.arena.blocks_reused

    @property
    def free_blocks(self) -> int:
        return self.arena.free_blocks

    @property
    def deferred_blocks(self) -> int:
        return self.arena.deferred_blocks

    # ------------------------------------------------------------ runtime API
    def stream(self, name: str) -> SimStream:
        s = SimStream(self, name)
        self.scheduler.streams.append(s)
        return s

    def current_stream(self) -> SimStream:
        return self.scheduler.current

    @contextlib.contextmanager
    def use(self, stream: SimStream) -> Iterator[SimStream]:
        sched = self.scheduler
        prev = sched.current
        sched.current = stream
        try:
            yield stream
        finally:
            sched.current = prev

    def event(self, enable_timing: bool = False) -> SimEvent:
        return SimEvent(self, enable_timing)

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        if not isinstance(tensor, SimTensor):
            return
        blk = tensor.hicache_sim.block
        if blk is None or stream.is_main:
            return
        if blk.streams is None:
            blk.streams = set()
        blk.streams.add(stream)
        self.observers.recorded(tensor, stream)

    def is_device(self, tensor: torch.Tensor) -> bool:
        """A tensor in this runtime's arena (another ``SimRuntime``'s tensors are not: their
        offsets name another arena)."""
        return isinstance(tensor, SimTensor) and tensor.hicache_sim.runtime is self

    def to_device(self, tensor: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if self.is_device(tensor):
            return tensor
        return self.observers.moved(tensor, self.arena.alloc_copy(tensor))

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, SimTensor):
            with plain_tensor_calls():
                return self.observers.moved(tensor, torch.Tensor.clone(tensor.as_subclass(torch.Tensor)))
        return tensor

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A persistent device buffer (pool storage); never returned to the arena."""
        out = torch.zeros(shape, dtype=dtype).as_subclass(SimTensor)
        out.hicache_sim = self.arena.buffer_info
        return out

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def launch(self, fn: Callable[..., None], *tensors: Any) -> None:
        s = self.scheduler.current
        if s.is_main:
            with plain_tensor_calls():
                fn(*[self._plain(t) for t in tensors])
            return
        captured = [self._capture(t) for t in tensors]
        # a guarded copy (the controller's: ``fn.fail``) takes the failure of rebuilding its
        # tensors too, so it is that op's failure, never raised from whichever call ran the stream
        fail = getattr(fn, "fail", None)

        def work() -> None:
            with plain_tensor_calls():
                try:
                    args = [self._materialise(c) for c in captured]
                except Exception as exc:
                    if fail is None:
                        raise
                    fail(exc)
                    return
                fn(*args)

        s.submit(work)

    @staticmethod
    def _plain(t: Any) -> Any:
        if isinstance(t, SimTensor):
            return t.as_subclass(torch.Tensor)
        return t

    def _capture(self, t: Any) -> Any:
        if not isinstance(t, SimTensor):
            return ("value", t)
        info = t.hicache_sim
        if info.runtime is not self:
            raise ValueError("a sim device tensor of another SimRuntime cannot be used on this one's streams")
        with plain_tensor_calls():
            if t.is_neg() or t.is_conj():
                # the capture keeps offset, shape and strides, not the view's bits
                raise ValueError(
                    f"a sim device tensor with its {'negative' if t.is_neg() else 'conjugate'} bit set cannot be "
                    "captured for a side stream: the work would read the raw storage"
                )
        blk = info.block
        if blk is None:  # persistent buffer: long-lived, like a pool's storage
            return ("value", t.as_subclass(torch.Tensor))
        with plain_tensor_calls():
            byte_off = t.data_ptr() - blk.ptr + blk.offset  # from the start of the block's segment
            return ("arena", blk.seg, byte_off, tuple(t.shape), tuple(t.stride()), t.dtype)

    def _materialise(self, c: Any) -> Any:
        if c[0] == "value":
            return c[1]
        _, seg, byte_off, shape, stride, dtype = c
        return self.arena.strided(seg, byte_off, shape, stride, dtype)

    def synchronize(self) -> None:
        sched = self.scheduler
        if sched.paused:
            raise RuntimeError("SimRuntime.synchronize() inside paused() would deadlock")
        for s in sched.streams:
            s.run_until(s.submitted)
        self.arena.retire()

    def drain(self) -> None:
        self.synchronize()

    def values_readable(self, tensor: torch.Tensor) -> bool:
        return True

    def tensor_device(self, tensor: torch.Tensor) -> str:
        if isinstance(tensor, SimTensor):
            return self.device if tensor.hicache_sim.runtime is self else f"{self.device} of another SimRuntime"
        return "cpu"

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold all side-stream work back: queries answer False until the block ends."""
        sched = self.scheduler
        prev, sched.paused = sched.paused, True
        try:
            yield
        finally:
            sched.paused = prev

    def pending_work(self) -> int:
        return sum(len(s.queue) for s in self.scheduler.streams)

    def close(self) -> None:
        self.arena.closed = True
