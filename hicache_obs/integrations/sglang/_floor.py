"""The adapter's floor, for the bench: its boundaries and its events, with nothing read.

:class:`FloorInstrumentation` wraps exactly what :class:`~.adapter.Instrumentation`
wraps on a controller (the queues, the acks, every allocation and free, each pool's
copies, the op-level move, the submissions, the process-wide ``record_stream``
observer) and emits the event types the adapter emits, about as many, at the same hooks.
It reads no index tensor and describes none: every event carries constant contents
(one ``TensorRef``, one run of slots, op id 0). Its cost is what any instrumentation
pays that reports these steps from Python hooks, one event each, whatever it reads; the
adapter's cost above it is the evidence it reads (slots, devices, tensor descriptions,
the conversion watch, which record matches which use). Its log is for counting and
timing only: its events describe nothing that happened, and the audit would make no
sense of them.

How many it emits against the adapter, by type: one ``SlotsAllocated`` / ``SlotsFreed``
per allocation and free, one ``OperationQueued`` per append, one ``OperationsMerged``,
``TransferSubmitted`` and op-level ``IndicesMoved`` per submission, one more
``IndicesMoved`` for the first copy of each pool but the anchor in a submission on the
kernel backend (where the adapter reports the Mamba pool converting its host indices),
one ``StreamRecorded`` per ``record_stream`` call made during a submission, one
``TransferCompleted`` per ack taken. The adapter reports fewer where a tensor is empty
or a record matches no use, so the two counts agree within a few events a run (the
bench reports both).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from ...core.spec import ANCHOR
from ...errors import IntegrationError
from ...events.log import EventLog
from ...events.schema import (
    IndicesMoved,
    OperationQueued,
    OperationsMerged,
    SlotsAllocated,
    SlotsFreed,
    StreamRecorded,
    TensorRef,
    TransferCompleted,
    TransferSubmitted,
)
from .adapter import Instrumentation, _detect, _Pending, _registry, _registry_lock, _Submission
from .record_stream import current

__all__ = ["FloorInstrumentation", "instrument_floor"]

_REF = TensorRef(pool=ANCHOR, role="device", device="cpu", numel=1, dtype="int64", ptr=0)
_RUNS = ((0, 1),)
_SLOTS = ((ANCHOR, 1),)


class FloorInstrumentation(Instrumentation):
    """The adapter's hooks on the same boundaries, emitting constant events (see the module)."""

    def _queued(self, direction: str, op: Any) -> None:
        try:
            self.log.emit(OperationQueued, op=0, direction=direction, node_id=0, priority=0, slots_by_pool=_SLOTS)
        except Exception:
            self._failed("record an OperationQueued event")

    def _ack_taken(self, direction: str, ack: Any) -> None:
        p = self._pending.pop(id(ack), None)
        if p is None:
            return
        try:
            self.log.emit(TransferCompleted, op=0, direction=direction, duration_ns=0)
        except Exception:
            self._failed("record a TransferCompleted event")

    def _alloc_wrapper(self, pool: str, tier: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        log, failed = self.log, self._failed

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def alloc(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                try:
                    log.emit(SlotsAllocated, pool=pool, tier=tier, indices=_RUNS)
                except Exception:
                    failed("record an allocation")
                return out

            return alloc

        return make

    def _free_wrapper(self, pool: str, tier: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        log, failed = self.log, self._failed

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def free(indices: Any, *args: Any, **kwargs: Any) -> Any:
                out = original(indices, *args, **kwargs)
                try:
                    log.emit(SlotsFreed, pool=pool, tier=tier, indices=_RUNS)
                except Exception:
                    failed("record a SlotsFreed event")
                return out

            return free

        return make

    def _copy_wrapper(self, pool: str, host_pool: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        converts = pool != ANCHOR and self._shape.io_backend == "kernel"

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def copy(device_pool: Any, host_indices: Any, device_indices: Any, *args: Any, **kwargs: Any) -> Any:
                sub = getattr(current, "sub", None)
                if converts and sub is not None and all(m[0] != pool for m in sub.side_moves):
                    sub.side_moves.append((pool, "host", "cpu", "cpu", _REF))
                return original(device_pool, host_indices, device_indices, *args, **kwargs)

            return copy

        return make

    def _move_wrapper(self, takes_op: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def move(op: Any, *args: Any, **kwargs: Any) -> Any:
                sub = getattr(current, "sub", None)
                if sub is None or sub.op is not None:
                    return original(op, *args, **kwargs)
                sub.op = op
                result = original(op, *args, **kwargs)
                try:
                    self.log.emit(
                        IndicesMoved, op=0, pool=ANCHOR, role="host", src_device="cpu", dst_device="cpu", tensor=_REF
                    )
                except Exception:
                    self._failed("record an IndicesMoved event")
                return result

            return move

        return make

    def _finish(self, sub: _Submission, result: Any, error: BaseException | None) -> None:
        if sub.op is None and error is None:
            return
        try:
            log = self.log
            log.emit(OperationsMerged, op=0, merged_ops=sub.queued, direction=sub.direction, node_ids=())
            for pool, role, src, dst, ref in sub.side_moves:
                log.emit(IndicesMoved, op=0, pool=pool, role=role, src_device=src, dst_device=dst, tensor=ref, stream="floor")
            log.emit(
                TransferSubmitted,
                op=0,
                direction=sub.direction,
                stream="floor",
                io_backend=self._shape.io_backend,
                layout=self._shape.layout,
                tensors=(_REF,) * 4,
                slots_by_pool=_SLOTS,
                bytes_by_pool=_SLOTS,
                device="cpu",
            )
            for _ in sub.records:
                log.emit(StreamRecorded, op=0, pool=ANCHOR, role="device", stream="floor", tensor=_REF)
            for ack in sub.acks:
                self._pending[id(ack)] = _Pending(0, sub.direction)
        except Exception:
            self._failed("describe a submission")


def instrument_floor(controller: Any, *, log: EventLog) -> FloorInstrumentation:
    """Attach :class:`FloorInstrumentation` to ``controller`` (refused as :func:`~.adapter.instrument`
    refuses: an unknown shape, or one instrumented already); ``detach()`` restores it."""
    with _registry_lock:
        if controller in _registry:
            raise IntegrationError(f"this {type(controller).__name__} is already instrumented; detach() it first")
        inst = FloorInstrumentation.attach_to(controller, log, _detect(controller))
        _registry[controller] = weakref.ref(inst)
    inst.hold_record_stream_observer()
    return inst
