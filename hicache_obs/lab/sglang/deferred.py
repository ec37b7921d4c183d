"""CUDA's stream semantics for the CPU harness's copies: side-stream work runs when its stream runs.

On a GPU a copy SGLang queues on a side stream (``with device_module.stream(write_stream):``)
runs later, in stream order, and reads the slots as they are then: a device slot freed and
reused before the copy runs is read with its new contents. The CPU harness's copies run at
the call, so that window is closed. :func:`cuda_semantics` opens it: while it is active, a
copy op (the stand-ins of :mod:`.kernels`) called inside a ``torch.cpu.stream(...)`` block is
queued on that stream instead of run, and runs when something waits for an event recorded on
the stream after it (``Event.synchronize``, ``query``, ``wait``, a stream's ``wait_event``)
or for the stream or the device (``wait_stream``, ``torch.cpu.synchronize``), in the order it
was queued. That is the latest a GPU may run it:
a program that is correct under CUDA's rules is correct under it, and one that reads or reuses
memory a queued copy still uses sees the result. Copies outside a stream block, on the CPU's
current stream, run at once, as on the default stream.

With ``worker=True`` the same copies run at the same points, on a thread of their own: a
wait (or a query) hands the copies before its mark to the worker and sleeps until they have
run. The thread that queued them spends no time copying, and the copies never hold the GIL
while it works: a GPU's kernels take nothing from the thread that launched them, and copies
run beside it would, on a CPU, slow it by taking the GIL in turns. That is what the bench's
``sglang`` section measures the controller's thread with.

Test support: it patches ``torch.cpu.Event``, ``torch.cpu.synchronize``, ``torch.cpu.Stream``'s
waits and the copy ops SGLang's modules hold for the length of the block, process-wide; one
block at a time. Build the controller inside the block: events made before it do not mark.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from hicache_obs.errors import ConfigError

__all__ = ["cuda_semantics", "pending"]

_lock = threading.RLock()
_ran = threading.Condition(_lock)  # copies were asked for, or ran up to a mark asked for (worker mode)
_queues: dict[int, _Queue] = {}  # id(stream) -> its queue, while active
_active = False
_worker: _Worker | None = None
#: how long a wait sleeps before it looks for a failed copy (seconds); a wait also wakes when
#: its copies ran. A counted run under valgrind (tens of times slower) raises it, so that
#: the controller's thread wakes once a wait, as it does at full speed
WAKE_S = 0.1


class _Queue:
    """One stream's work: queued calls, how many were queued and how many ran, and how many
    a wait has asked the worker to run (``wanted``)."""

    __slots__ = ("calls", "queued", "ran", "stream", "wanted")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.calls: list[Callable[[], Any]] = []
        self.queued = 0
        self.ran = 0
        self.wanted = 0

    def run_until(self, mark: int) -> None:
        if _worker is not None:  # the worker runs them while this thread waits
            with _ran:
                if mark > self.wanted:
                    self.wanted = mark
                    _ran.notify_all()
                while self.ran < mark:
                    _worker.raise_error()
                    _ran.wait(WAKE_S)
                _worker.raise_error()
            return
        while self.ran < mark and self.calls:
            call = self.calls.pop(0)
            self.ran += 1
            call()


class _Worker(threading.Thread):
    """Runs the queued copies a wait asked for, oldest first on each stream."""

    def __init__(self) -> None:
        super().__init__(name="hicache-copy-worker", daemon=True)
        self.stop = False
        self.error: BaseException | None = None

    def raise_error(self) -> None:
        """A copy that failed, raised into the first thread that waits after it, once."""
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"a queued copy failed on the copy worker: {error}") from error

    def run(self) -> None:
        from hicache_obs.lab.sglang.harness import _CudaMode

        mode = _CudaMode()  # the stand-ins' device routing, on this thread too
        mode.__enter__()
        try:
            while True:
                with _ran:
                    q = _asked()
                    while q is None:
                        if self.stop:
                            return
                        _ran.wait(WAKE_S)
                        q = _asked()
                    call = q.calls.pop(0)
                try:
                    call()
                except BaseException as exc:  # surfaced to the thread waiting for it
                    self.error = exc
                with _ran:
                    q.ran += 1
                    if q.ran >= q.wanted:  # what was asked for ran: the waiters' marks are at most that
                        _ran.notify_all()
        finally:
            mode.__exit__(None, None, None)


def _asked() -> _Queue | None:
    """A queue with copies a wait asked for and not run yet (``_lock`` held)."""
    return next((q for q in _queues.values() if q.calls and q.ran < q.wanted), None)


def _current_block_stream() -> Any:
    from hicache_obs.lab.sglang.harness import _blocks

    stack = getattr(_blocks, "streams", None)
    return stack[-1] if stack else None


def _queue(stream: Any) -> _Queue:
    q = _queues.get(id(stream))
    if q is None:
        q = _queues[id(stream)] = _Queue(stream)
    return q


def _deferring(op: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        stream = _current_block_stream() if _active else None
        if stream is None:
            return op(*args, **kwargs)
        with _lock:
            q = _queue(stream)
            q.calls.append(partial(op, *args, **kwargs))
            q.queued += 1
        return None

    call.__wrapped__ = op  # type: ignore[attr-defined]
    call.__name__ = getattr(op, "__name__", "op")
    return call


class _Event(torch.cpu.Event):
    """``torch.cpu.Event`` whose ``record`` marks its stream's queue and whose waits run it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mark: tuple[_Queue, int] | None = None

    def record(self, stream: Any = None) -> None:
        stream = stream if stream is not None else _current_block_stream()
        if _active and stream is not None:
            with _lock:
                q = _queue(stream)
                self._mark = (q, q.queued)
        else:
            self._mark = None
        super().record()

    def run_queued(self) -> None:
        mark = self._mark
        if mark is not None:
            with _lock:
                mark[0].run_until(mark[1])

    def query(self) -> bool:
        self.run_queued()
        return bool(super().query())

    def synchronize(self) -> None:
        self.run_queued()
        super().synchronize()

    def wait(self, stream: Any = None) -> None:
        self.run_queued()
        super().wait(stream)


def pending() -> int:
    """Copies queued and not run yet, on every stream."""
    with _lock:
        return sum(len(q.calls) for q in _queues.values())


def _run_all() -> None:
    with _lock:
        for q in list(_queues.values()):
            q.run_until(q.queued)


@contextmanager
def cuda_semantics(worker: bool = False) -> Iterator[None]:
    """Side-stream copies run when their stream is waited for, or (``worker``) on a thread of
    their own as soon as they are queued (see the module). The harness must be prepared for
    the CPU; on leaving, every queued copy runs."""
    global _active, _worker
    from hicache_obs.lab.sglang import kernels
    from hicache_obs.lab.sglang.harness import _POOL_MODULES, _state

    if not _state.get("current_stream"):
        raise ConfigError("cuda_semantics needs the CPU harness (prepare('cpu') without CUDA)")
    with _lock:
        if _active:
            raise ConfigError("cuda_semantics is active already: one block at a time")
        _active = True
    undo: list[Callable[[], None]] = []

    def put(holder: Any, name: str, value: Any) -> None:
        old = getattr(holder, name)
        setattr(holder, name, value)
        undo.append(lambda: setattr(holder, name, old))

    try:
        wrapped = {name: _deferring(op) for name, op in kernels.OPS.items()}
        modules = [sys.modules.get(n) for n in (*_POOL_MODULES, kernels.KVCACHEIO_MODULE, kernels.TRANSFER_MAMBA_MODULE)]
        for module in modules:
            if module is None:
                continue
            for name, op in kernels.OPS.items():
                if getattr(module, name, None) is op:
                    put(module, name, wrapped[name])
        synchronize = torch.cpu.synchronize

        def synchronize_all(device: Any = None) -> None:
            _run_all()
            synchronize(device)

        def wait_event(self: Any, event: Any) -> None:  # the forward pass waits on a layer's load
            if isinstance(event, _Event):
                event.run_queued()

        def wait_stream(self: Any, stream: Any) -> None:
            with _lock:
                q = _queues.get(id(stream))
                if q is not None:
                    q.run_until(q.queued)

        put(torch.cpu, "Event", _Event)
        put(torch.cpu, "synchronize", synchronize_all)
        put(torch.cpu.Stream, "wait_event", wait_event)
        put(torch.cpu.Stream, "wait_stream", wait_stream)
        if worker:
            _worker = _Worker()
            _worker.start()
        yield
    finally:
        try:
            _run_all()
        finally:
            if _worker is not None:
                with _ran:
                    _worker.stop = True
                    _ran.notify_all()
                _worker.join()
                _worker = None
            for step in reversed(undo):
                step()
            with _lock:
                _queues.clear()
                _active = False
