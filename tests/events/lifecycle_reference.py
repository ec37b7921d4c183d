"""Frozen copies of the two op folds that came before :mod:`hicache_obs.events._lifecycle`:
``projections.lifecycles`` (inspect's) and the exporters' ``OpTable``/``fold_ops``, as they were
when the one lifecycle replaced them. ``test_lifecycle.py`` checks the new fold against
them on random workloads, so what the old readers showed stays what the new one shows.

Kept as they were (renamed only: ``RefLifecycle``, ``RefOpRecord``); do not "fix" them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hicache_obs.events._schema import (
    AuditViolation,
    Event,
    IndicesMoved,
    OperationQueued,
    OperationsMerged,
    StreamRecorded,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
)

OpKey = tuple[int, int]
UNRECORDED_RULE = "unrecorded_index"


@dataclass
class RefLifecycle:
    rank: int
    op: int
    direction: str
    node_ids: tuple[int, ...] = ()
    merged_from: tuple[int, ...] = ()
    merged_into: int | None = None
    queued_ns: int | None = None
    merged_ns: int | None = None
    moved_ns: int | None = None
    submitted_ns: int | None = None
    recorded_ns: int | None = None
    finished_ns: int | None = None
    status: str = "queued"
    stream: str = ""
    duration_ns: int | None = None
    layer_durations_ns: tuple[int, ...] | None = None
    slots_by_pool: tuple[tuple[str, int], ...] = ()
    bytes_by_pool: tuple[tuple[str, int], ...] = ()
    error: str | None = None
    moves: list[IndicesMoved] = field(default_factory=list)
    records: list[StreamRecorded] = field(default_factory=list)

    @property
    def queue_wait_ns(self) -> int | None:
        if self.queued_ns is None or self.submitted_ns is None:
            return None
        return self.submitted_ns - self.queued_ns

    @property
    def total_ns(self) -> int | None:
        if self.submitted_ns is None or self.finished_ns is None:
            return None
        return self.finished_ns - self.submitted_ns


def ref_lifecycles(events: Iterable[Event]) -> dict[tuple[int, int], RefLifecycle]:
    """Every op's stages (see module doc). Merged source ops point at their merged op."""
    ops: dict[tuple[int, int], RefLifecycle] = {}

    def get(rank: int, op: int, direction: str = "") -> RefLifecycle:
        lc = ops.get((rank, op))
        if lc is None:
            lc = ops[(rank, op)] = RefLifecycle(rank, op, direction)
        elif direction and not lc.direction:
            lc.direction = direction
        return lc

    for ev in events:
        if isinstance(ev, OperationQueued):
            lc = get(ev.rank, ev.op, ev.direction)
            lc.queued_ns = ev.ts_ns
            lc.node_ids = (ev.node_id,)
            lc.slots_by_pool = ev.slots_by_pool
        elif isinstance(ev, OperationsMerged):
            lc = get(ev.rank, ev.op, ev.direction)
            lc.merged_ns = ev.ts_ns
            lc.merged_from = ev.merged_ops
            lc.node_ids = ev.node_ids or lc.node_ids
            lc.status = "merged"
            if len(ev.merged_ops) > 1 or ev.merged_ops != (ev.op,):
                queued = [ops[(ev.rank, o)].queued_ns for o in ev.merged_ops if (ev.rank, o) in ops]
                lc.queued_ns = min((q for q in queued if q is not None), default=None)
                for o in ev.merged_ops:
                    src = get(ev.rank, o, ev.direction)
                    src.merged_into = ev.op
                    src.status = "merged"
        elif isinstance(ev, IndicesMoved):
            lc = get(ev.rank, ev.op)
            lc.moved_ns = ev.ts_ns if lc.moved_ns is None else lc.moved_ns
            lc.moves.append(ev)
        elif isinstance(ev, TransferSubmitted):
            lc = get(ev.rank, ev.op, ev.direction)
            lc.submitted_ns = ev.ts_ns
            lc.stream = ev.stream
            lc.status = "submitted"
            lc.slots_by_pool = ev.slots_by_pool
            lc.bytes_by_pool = ev.bytes_by_pool
        elif isinstance(ev, StreamRecorded):
            lc = get(ev.rank, ev.op)
            lc.recorded_ns = ev.ts_ns if lc.recorded_ns is None else lc.recorded_ns
            lc.records.append(ev)
        elif isinstance(ev, TransferCompleted):
            lc = get(ev.rank, ev.op, ev.direction)
            lc.finished_ns = ev.ts_ns
            lc.status = "completed"
            lc.duration_ns = ev.duration_ns
            lc.layer_durations_ns = ev.layer_durations_ns
        elif isinstance(ev, TransferFailed):
            lc = get(ev.rank, ev.op, ev.direction)
            lc.finished_ns = ev.ts_ns
            lc.status = "failed"
            lc.error = ev.error
    return ops


@dataclass
class RefOpRecord:
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


class RefOpTable:
    """Folds events into :class:`RefOpRecord`s (see module docstring).

    ``live=True`` forgets a record once it is settled (bounded memory for sinks);
    ``live=False`` keeps every record in :attr:`ops` (offline export).
    """

    def __init__(self, *, live: bool = True) -> None:
        self.live = live
        self.ops: dict[OpKey, RefOpRecord] = {}
        self._queued: dict[OpKey, int] = {}
        self._pending: dict[int, dict[OpKey, RefOpRecord]] = {}  # rank -> completed, not yet settled
        self.late_violations = 0

    @property
    def pending(self) -> Mapping[int, Mapping[OpKey, RefOpRecord]]:
        """Per rank, the completed ops not settled yet (the table's own dict: read, never change it).

        While it is empty an event that touches no op (an allocation) settles nothing either,
        so a sink may skip such an event without calling :meth:`apply`.
        """
        return self._pending

    def get(self, key: OpKey) -> RefOpRecord | None:
        return self.ops.get(key)

    def _record(self, rank: int, op: int, direction: str = "") -> RefOpRecord:
        key = (rank, op)
        rec = self.ops.get(key)
        if rec is None:
            rec = self.ops[key] = RefOpRecord(rank, op, direction)
        elif direction and not rec.direction:
            rec.direction = direction
        return rec

    def apply(self, ev: Event) -> tuple[RefOpRecord | None, list[RefOpRecord]]:
        """Fold one event; returns (the record it touched, the records it settled)."""
        settled: list[RefOpRecord] = []
        pending = self._pending.get(ev.rank)
        if pending and not (isinstance(ev, AuditViolation) and (ev.rank, ev.op) in pending):
            settled = self._settle(ev.rank)
        fold = _REF_FOLD.get(type(ev))
        return (fold(self, ev) if fold is not None else None), settled

    # one fold per event type (a dict lookup, not a chain of isinstance checks); each
    # returns the record the event touched
    def _fold_queued(self, ev: OperationQueued) -> None:
        self._queued[(ev.rank, ev.op)] = ev.ts_ns

    def _fold_merged(self, ev: OperationsMerged) -> RefOpRecord:
        rec = self._record(ev.rank, ev.op, ev.direction)
        rec.merged_ops = ev.merged_ops
        rec.node_ids = ev.node_ids
        rec.merged_ns = ev.ts_ns
        times = [t for t in (self._queued.pop((ev.rank, o), None) for o in ev.merged_ops) if t is not None]
        if times:
            rec.queued_ns = min(times)
        return rec

    def _fold_moved(self, ev: IndicesMoved) -> RefOpRecord:
        rec = self._record(ev.rank, ev.op)
        rec.moves.append(ev)
        return rec

    def _fold_recorded(self, ev: StreamRecorded) -> RefOpRecord:
        rec = self._record(ev.rank, ev.op)
        rec.records.append(ev)
        return rec

    def _fold_submitted(self, ev: TransferSubmitted) -> RefOpRecord:
        rec = self._record(ev.rank, ev.op, ev.direction)
        rec.submit = ev
        return rec

    def _fold_done(self, ev: TransferCompleted | TransferFailed) -> RefOpRecord:
        rec = self._record(ev.rank, ev.op, ev.direction)
        rec.done = ev
        if self.live:
            self._pending.setdefault(ev.rank, {})[rec.key] = rec
        return rec

    def _fold_violation(self, ev: AuditViolation) -> RefOpRecord | None:
        rec = self.ops.get((ev.rank, ev.op)) if ev.op >= 0 else None
        if rec is not None:
            rec.violations.append(ev)
        elif ev.op >= 0:
            self.late_violations += 1
        return rec

    def _settle(self, rank: int) -> list[RefOpRecord]:
        pending = self._pending.pop(rank, None)
        if not pending:
            return []
        out = list(pending.values())
        for rec in out:
            self.ops.pop(rec.key, None)
        return out

    def settle_all(self) -> list[RefOpRecord]:
        """Settle every completed op (flush/close: no violation can be on its way)."""
        out: list[RefOpRecord] = []
        for rank in list(self._pending):
            out.extend(self._settle(rank))
        return out

    def unfinished(self) -> list[RefOpRecord]:
        """Ops merged or submitted that never completed or failed."""
        return [r for r in self.ops.values() if r.done is None]


_REF_FOLD = {
    OperationQueued: RefOpTable._fold_queued,
    OperationsMerged: RefOpTable._fold_merged,
    IndicesMoved: RefOpTable._fold_moved,
    StreamRecorded: RefOpTable._fold_recorded,
    TransferSubmitted: RefOpTable._fold_submitted,
    TransferCompleted: RefOpTable._fold_done,
    TransferFailed: RefOpTable._fold_done,
    AuditViolation: RefOpTable._fold_violation,
}


def ref_fold_ops(events: Iterable[Event]) -> tuple[list[RefOpRecord], list[AuditViolation]]:
    """Offline: every op of a log in submission order, and the violations not tied to an op."""
    table = RefOpTable(live=False)
    loose: list[AuditViolation] = []
    for ev in events:
        rec, _ = table.apply(ev)
        if isinstance(ev, AuditViolation) and rec is None:
            loose.append(ev)
    ops = sorted(table.ops.values(), key=lambda r: (r.start_ns if r.start_ns is not None else 0, r.rank, r.op))
    return ops, loose
