"""The adapter's floor, for the bench: its boundaries and its events, with nothing read.

:class:`FloorInstrumentation` wraps exactly what :class:`~.adapter.Instrumentation`
wraps on a controller (the queues, the acks, every allocation and free, each pool's
copies, the op-level move, the submissions, the process-wide ``record_stream``
observer), through the adapter's own wiring, and each of its hooks emits the events the
adapter's would, of the same types, at the same steps. It reads no index tensor and
describes none: what a hook emits has constant contents (op id 0, one run of one slot,
one ``TensorRef``), except ``OperationsMerged.merged_ops``, the queued ops' ids the
shared submission wrapper reads. Attaching reads what the adapter's attaching reads
(``PoolCreated`` and the slots already in use). Its cost is what reporting these steps
from Python hooks costs, one event each, whatever is read; the adapter's cost above it
is its evidence (slots, devices, tensor descriptions, the conversion watch, which record
is of which use). The log is for counting and timing only: its events describe nothing
that happened.

The counts, by type, against the adapter's: one ``SlotsAllocated`` / ``SlotsFreed`` per
allocation that returned a tensor and per free; one ``OperationQueued`` per append; per
submission one ``OperationsMerged``, one op-level ``IndicesMoved``, one more
``IndicesMoved`` for the first copy of each pool but the anchor on the kernel backend
(where the adapter reports the Mamba pool converting its host indices), one
``TransferSubmitted``, one ``StreamRecorded`` per ``record_stream`` call, and a
``TransferFailed`` where it raised; one ``TransferCompleted`` per ack taken. The adapter
reports fewer where a tensor is empty, did not move, or a record matches no use: on the
CPU harness's workloads with the kernel backend the counts are equal (the tests hold them
to it). With the direct backend the adapter reports one op-level ``IndicesMoved`` per pool
the move converted (from 0.5.11 the Mamba pool's too), the floor one per submission.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from hicache_obs.core._spec import ANCHOR
from hicache_obs.errors import IntegrationError
from hicache_obs.events._log import EventLog
from hicache_obs.events._schema import (
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
from hicache_obs.integrations.sglang._adapter import Instrumentation
from hicache_obs.integrations.sglang._record_stream import current

__all__ = ["PARTS", "FloorInstrumentation", "floor_with", "instrument_floor"]

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
                if out is not None:  # a failed allocation (None) is no event, as in the adapter
                    try:
                        log.emit(SlotsAllocated, pool=pool, tier=tier, indices=_RUNS)
                    except Exception:
                        failed("record an allocation")
                return out

            alloc.__wrapped__ = original  # type: ignore[attr-defined]
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

            free.__wrapped__ = original  # type: ignore[attr-defined]
            return free

        return make

    def _slots_wrapper(self, pool: str, tier: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A call that resets a free list (``clear``, ``restore_state``, a merge): one constant
        ``SlotsFreed``, nothing read."""
        log, failed = self.log, self._failed

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def reset(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                try:
                    log.emit(SlotsFreed, pool=pool, tier=tier, indices=_RUNS)
                except Exception:
                    failed("record a SlotsFreed event")
                return out

            reset.__wrapped__ = original  # type: ignore[attr-defined]
            return reset

        return make

    def _copy_wrapper(self, pool: str, host_pool: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        converts = pool != ANCHOR and self._shape.io_backend == "kernel"

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def copy(device_pool: Any, host_indices: Any, device_indices: Any, *args: Any, **kwargs: Any) -> Any:
                sub = getattr(current, "sub", None)
                if converts and sub is not None and all(m[0] != pool for m in sub.side_moves):
                    sub.side_moves.append((pool, "host", "cpu", "cpu", _REF))
                return original(device_pool, host_indices, device_indices, *args, **kwargs)

            copy.__wrapped__ = original  # type: ignore[attr-defined]
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

            move.__wrapped__ = original  # type: ignore[attr-defined]
            return move

        return make

    _compiled_end = False  # every submission ends in _finish below

    def _finish(self, sub: Any, result: Any, error: BaseException | None) -> None:
        if sub.op is None and error is None and not sub.acks:  # an ack: copies ran with no move
            return
        try:
            log = self.log
            log.emit(OperationsMerged, op=0, merged_ops=sub.queued, direction=sub.direction, node_ids=())
            for pool, role, src, dst, ref in sub.side_moves:
                log.emit(
                    IndicesMoved,
                    op=0,
                    pool=pool,
                    role=role,
                    src_device=src,
                    dst_device=dst,
                    tensor=ref,
                    stream="floor",
                )
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
        except Exception:
            self._failed("describe a submission")
        self._settle_acks(sub, 0, error)


def instrument_floor(controller: Any, *, log: EventLog) -> FloorInstrumentation:
    """Attach :class:`FloorInstrumentation` to ``controller``, as
    :func:`~hicache_obs.integrations.sglang.instrument` attaches the adapter (refused the
    same way: one instrumented already, an unknown shape); ``detach()`` restores it."""
    if not isinstance(log, EventLog):
        raise IntegrationError(f"log must be an EventLog, got {type(log).__name__}")
    return FloorInstrumentation.attach(controller, log=log)


#: The adapter's evidence, part by part: the hooks of :class:`~.adapter.Instrumentation`
#: that read it (the rest of each step is the floor's too). ``submission`` is what a
#: submission's end describes of what its copies received (with ``copy``, which notes
#: them and watches the conversions).
PARTS: dict[str, tuple[str, ...]] = {
    "slots": ("_alloc_wrapper", "_free_wrapper", "_slots_wrapper"),
    "queue": ("_queued",),
    "acks": ("_ack_taken",),
    "move": ("_move_wrapper",),
    "copy": ("_copy_wrapper",),
    "submission": ("_finish",),
}


def floor_with(parts: Iterable[str]) -> type[FloorInstrumentation]:
    """The floor with the adapter's own hooks for ``parts`` (names of :data:`PARTS`): what
    those parts of the evidence cost is its cost above the floor's, measured side by side
    (``benchmarks/sglang_parts.py``)."""
    parts = tuple(parts)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown parts {unknown}: choose from {sorted(PARTS)}")
    adapter_hooks = vars(Instrumentation)
    hooks = {name: adapter_hooks[name] for part in parts for name in PARTS[part]}
    return type(f"FloorWith_{'_'.join(parts) or 'nothing'}", (FloorInstrumentation,), hooks)
