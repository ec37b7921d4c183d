"""Per-operation folding shared by the span, log and trace exporters.

:class:`OpTable` folds events into one :class:`OpRecord` per merged operation
(keyed by ``(rank, op)``): when it was queued (earliest of the merged ops), merged,
submitted and completed or failed, its index moves, stream records and audit
violations.

The live auditor appends an ``AuditViolation`` right *after* the
``TransferCompleted`` that revealed it, so a completed op is *settled* (nothing
more will be said about it) only when the next event of the same rank arrives
that is not a violation of that op, or at :meth:`OpTable.settle_all`
(flush/close). A sink batch may end between a completion and its violations;
settling by the next event makes the result independent of batch boundaries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache_obs.events.schema import (
    AllocationFailed,
    AuditViolation,
    Event,
    IndicesMoved,
    OperationQueued,
    OperationsMerged,
    PoolCreated,
    SlotsAllocated,
    SlotsFreed,
    StreamRecorded,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
)
from hicache_obs.events.state import dispatch_registrar

__all__ = ["OpKey", "OpRecord", "OpTable", "UNRECORDED_RULE", "fold_ops"]

OpKey = tuple[int, int]  # (rank, op)

UNRECORDED_RULE = "unrecorded_index"


@dataclass
class OpRecord:
    """Everything the log says about one merged operation."""

    rank: int
    op: int
    direction: str = ""
    merged_ops: tuple[int, ...] = ()
    node_ids: tuple[int, ...] = ()
    queued_ns: int | None = None
    merged_ns: int | None = None
    submit: TransferSubmitted | None = None
    done: TransferCompleted | TransferFailed | None = None
    moves: list[IndicesMoved] = field(default_factory=list)
    records: list[StreamRecorded] = field(default_factory=list)
    violations: list[AuditViolation] = field(default_factory=list)

    @property
    def key(self) -> OpKey:
        return (self.rank, self.op)

    @property
    def name(self) -> str:
        """``hicache.write`` for d2h, ``hicache.load`` for h2d."""
        return "hicache.write" if self.direction == "d2h" else "hicache.load"

    @property
    def stream(self) -> str:
        return self.submit.stream if self.submit is not None else ""

    @property
    def slots_by_pool(self) -> dict[str, int]:
        return dict(self.submit.slots_by_pool) if self.submit is not None else {}

    @property
    def bytes_by_pool(self) -> dict[str, int]:
        return dict(self.submit.bytes_by_pool) if self.submit is not None else {}

    @property
    def pools(self) -> list[str]:
        return [p for p, _ in self.submit.slots_by_pool] if self.submit is not None else []

    @property
    def slots(self) -> int:
        return sum(n for _, n in self.submit.slots_by_pool) if self.submit is not None else 0

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.submit.bytes_by_pool) if self.submit is not None else 0

    @property
    def node_count(self) -> int:
        return len(self.node_ids) if self.node_ids else max(1, len(self.merged_ops))

    @property
    def unrecorded_indices(self) -> int:
        """Index tensors the auditor found used without ``record_stream`` (one per pool and role)."""
        return sum(1 for v in self.violations if v.rule == UNRECORDED_RULE)

    @property
    def unrecorded_pools(self) -> list[str]:
        return sorted({v.pool for v in self.violations if v.rule == UNRECORDED_RULE})

    @property
    def completed(self) -> bool:
        return isinstance(self.done, TransferCompleted)

    @property
    def failed(self) -> bool:
        return isinstance(self.done, TransferFailed)

    @property
    def error(self) -> str | None:
        return self.done.error if isinstance(self.done, TransferFailed) else None

    @property
    def status(self) -> str:
        """``completed``, ``failed``, ``in_flight`` (submitted) or ``queued``."""
        if self.completed:
            return "completed"
        if self.failed:
            return "failed"
        return "in_flight" if self.submit is not None else "queued"

    @property
    def start_ns(self) -> int | None:
        """Submission time (the start of the span/slice)."""
        if self.submit is not None:
            return self.submit.ts_ns
        return self.merged_ns

    def end_ns(self, default: int | None = None) -> int | None:
        """Completion time: submit + device-timed duration when the runtime timed it
        (never after the observed completion), else when completion was observed."""
        done = self.done
        if done is None:
            return default
        start = self.start_ns
        if isinstance(done, TransferCompleted) and start is not None and done.duration_ns > 0:
            return min(done.ts_ns, start + done.duration_ns)
        return done.ts_ns

    @property
    def duration_ns(self) -> int | None:
        """Transfer time: the device-timed duration, else completion minus submission."""
        done = self.done
        if not isinstance(done, TransferCompleted):
            return None
        if done.duration_ns > 0:
            return done.duration_ns
        start = self.start_ns
        return max(0, done.ts_ns - start) if start is not None else None

    @property
    def queue_wait_ns(self) -> int | None:
        if self.submit is None or self.queued_ns is None:
            return None
        return max(0, self.submit.ts_ns - self.queued_ns)

    def error_description(self) -> str | None:
        """What went wrong (failure and/or audit findings), or None for a clean op."""
        parts: list[str] = []
        if isinstance(self.done, TransferFailed):
            parts.append(f"transfer failed: {self.done.error}")
        seen: set[tuple[str, str, str]] = set()
        for v in self.violations:
            k = (v.rule, v.pool, v.role)
            if k not in seen:
                seen.add(k)
                parts.append(f"{v.rule}: pool {v.pool} {v.role} indices")
        return "; ".join(parts) if parts else None


#: How :meth:`OpTable.apply` folds each event type (types not listed touch no record),
#: filled by :func:`_folds` on the table's methods.
_FOLD: dict[type, Callable[..., Any]] = {}
_folds = dispatch_registrar(_FOLD)


class OpTable:
    """Folds events into :class:`OpRecord`s (see module docstring).

    ``live=True`` forgets a record once it is settled (bounded memory for sinks);
    ``live=False`` keeps every record in :attr:`ops` (offline export).
    """

    def __init__(self, *, live: bool = True) -> None:
        self.live = live
        self.ops: dict[OpKey, OpRecord] = {}
        self._queued: dict[OpKey, int] = {}
        self._pending: dict[int, dict[OpKey, OpRecord]] = {}  # rank -> completed, not yet settled
        self.late_violations = 0

    @property
    def pending(self) -> Mapping[int, Mapping[OpKey, OpRecord]]:
        """Per rank, the completed ops not settled yet (the table's own dict: read, never change it).

        While it is empty an event that touches no op (an allocation) settles nothing either,
        so a sink may skip such an event without calling :meth:`apply`.
        """
        return self._pending

    def get(self, key: OpKey) -> OpRecord | None:
        return self.ops.get(key)

    def _record(self, rank: int, op: int, direction: str = "") -> OpRecord:
        key = (rank, op)
        rec = self.ops.get(key)
        if rec is None:
            rec = self.ops[key] = OpRecord(rank, op, direction)
        elif direction and not rec.direction:
            rec.direction = direction
        return rec

    def apply(self, ev: Event) -> tuple[OpRecord | None, list[OpRecord]]:
        """Fold one event; returns (the record it touched, the records it settled)."""
        settled: list[OpRecord] = []
        pending = self._pending.get(ev.rank)
        if pending and not (isinstance(ev, AuditViolation) and (ev.rank, ev.op) in pending):
            settled = self._settle(ev.rank)
        fold = _FOLD.get(type(ev))
        return (fold(self, ev) if fold is not None else None), settled

    # one fold per event type (a dict lookup, not a chain of isinstance checks); each
    # returns the record the event touched
    @_folds(OperationQueued)
    def _fold_queued(self, ev: OperationQueued) -> None:
        self._queued[(ev.rank, ev.op)] = ev.ts_ns

    @_folds(OperationsMerged)
    def _fold_merged(self, ev: OperationsMerged) -> OpRecord:
        rec = self._record(ev.rank, ev.op, ev.direction)
        rec.merged_ops = ev.merged_ops
        rec.node_ids = ev.node_ids
        rec.merged_ns = ev.ts_ns
        times = [t for t in (self._queued.pop((ev.rank, o), None) for o in ev.merged_ops) if t is not None]
        if times:
            rec.queued_ns = min(times)
        return rec

    @_folds(IndicesMoved)
    def _fold_moved(self, ev: IndicesMoved) -> OpRecord:
        rec = self._record(ev.rank, ev.op)
        rec.moves.append(ev)
        return rec

    @_folds(StreamRecorded)
    def _fold_recorded(self, ev: StreamRecorded) -> OpRecord:
        rec = self._record(ev.rank, ev.op)
        rec.records.append(ev)
        return rec

    @_folds(TransferSubmitted)
    def _fold_submitted(self, ev: TransferSubmitted) -> OpRecord:
        rec = self._record(ev.rank, ev.op, ev.direction)
        rec.submit = ev
        return rec

    @_folds(TransferCompleted, TransferFailed)
    def _fold_done(self, ev: TransferCompleted | TransferFailed) -> OpRecord:
        rec = self._record(ev.rank, ev.op, ev.direction)
        rec.done = ev
        if self.live:
            self._pending.setdefault(ev.rank, {})[rec.key] = rec
        return rec

    @_folds(AuditViolation)
    def _fold_violation(self, ev: AuditViolation) -> OpRecord | None:
        rec = self.ops.get((ev.rank, ev.op)) if ev.op >= 0 else None
        if rec is not None:
            rec.violations.append(ev)
        elif ev.op >= 0:
            self.late_violations += 1
        return rec

    def _settle(self, rank: int) -> list[OpRecord]:
        pending = self._pending.pop(rank, None)
        if not pending:
            return []
        out = list(pending.values())
        for rec in out:
            self.ops.pop(rec.key, None)
        return out

    def settle_all(self) -> list[OpRecord]:
        """Settle every completed op (flush/close: no violation can be on its way)."""
        out: list[OpRecord] = []
        for rank in list(self._pending):
            out.extend(self._settle(rank))
        return out

    def unfinished(self) -> list[OpRecord]:
        """Ops merged or submitted that never completed or failed."""
        return [r for r in self.ops.values() if r.done is None]


#: Event types that never touch an operation record.
_NOT_OP_EVENTS = frozenset({PoolCreated, SlotsAllocated, SlotsFreed, AllocationFailed})


def fold_ops(events: Iterable[Event]) -> tuple[list[OpRecord], list[AuditViolation]]:
    """Offline: every op of a log in submission order, and the violations not tied to an op."""
    table = OpTable(live=False)
    loose: list[AuditViolation] = []
    for ev in events:
        rec, _ = table.apply(ev)
        if isinstance(ev, AuditViolation) and rec is None:
            loose.append(ev)
    ops = sorted(table.ops.values(), key=lambda r: (r.start_ns if r.start_ns is not None else 0, r.rank, r.op))
    return ops, loose
