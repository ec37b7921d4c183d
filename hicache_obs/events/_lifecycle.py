"""The op lifecycle: one fold of a log's op events into one :class:`OpRecord` per operation.

An operation is queued (``OperationQueued``), merged with others into the op that is
submitted (``OperationsMerged``), has its indices moved and recorded on the transfer's
stream (``IndicesMoved``, ``StreamRecorded``), is submitted (``TransferSubmitted``) and
completes or fails (``TransferCompleted``, ``TransferFailed``); the auditor may report
violations of it (``AuditViolation``). :class:`OpLifecycles` folds those events, one at a
time, and :meth:`OpLifecycles.apply` says what each did: ``(Step, record)``, or None for an
event that touches no op (the types in :data:`NOT_OP_EVENTS`, so a reader that only cares
about ops can skip them without a call).

Every reader of operations reads this one fold, so every derived value has one
definition, on the record: :attr:`OpRecord.queue_wait_ns`, :attr:`OpRecord.duration_ns`,
:meth:`OpRecord.end_ns` and the rest.

Two modes:

- live (``keep=False``, the default): a record is forgotten as soon as ``apply`` has
  returned ``(Step.FINISHED, record)`` (the caller may keep it), and the sources of a
  merge of several ops are forgotten at the merge: memory stays bounded by the ops not
  finished yet;
- offline (``keep=True``): every record is kept, finished or not; the sources of a merge
  of several ops stay, with ``merged_into`` set and status ``"merged"``.

``detail=False`` keeps no lists of moves and records (``moves``/``records`` are the empty
tuple ``()``, never appended to), for readers that only count.

The rules, for any log, well-formed or not:

(a) a merge of one op into itself (``merged_ops == (op,)``) keeps the op's record and
    marks it ``"merged"``;
(b) a merge of several ops makes one record for the merged op: slots summed per pool,
    the least priority and the earliest ``queued_ns`` of the sources, the ``node_ids`` of
    the event (when it has none, the sources' in order);
(c) a submission of an op with no record makes one, with the op id as its priority;
(d) a merge source with no record is an anomaly ``merge_unknown_op`` (in :attr:`OpLifecycles.anomalies`);
(e) a completion or failure of an op with no record still finishes a (fresh) record;
(f) a repeated submission replaces :attr:`OpRecord.submit`;
(g) a move or record of an op with no record makes one, unless the op is negative
    (``(Step.MOVED, None)``/``(Step.RECORDED, None)``);
(h) a violation of a negative op, or of an op with no record, is ``(Step.VIOLATION, None)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from ._schema import (
    AllocationFailed,
    AuditViolation,
    Event,
    FreeRefused,
    IndicesMisplaced,
    IndicesMoved,
    OperationQueued,
    OperationsMerged,
    OpsSubmitted,
    PoolCreated,
    PoolsSampled,
    SlotsAllocated,
    SlotsFreed,
    StreamRecorded,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
    expand,
)

__all__ = [
    "PHASES",
    "UNRECORDED_RULE",
    "OMITTED_RULE",
    "NOT_OP_EVENTS",
    "OpKey",
    "OpRecord",
    "Step",
    "Applied",
    "OpLifecycles",
]

#: The values of :attr:`OpRecord.status`, in the order an op goes through them.
PHASES = ("queued", "merged", "submitted", "completed", "failed")

#: The auditor's rule for an index tensor used on a stream without ``record_stream``.
UNRECORDED_RULE = "unrecorded_index"
OMITTED_RULE = "pool_omitted"

#: Event types that never touch an operation: :meth:`OpLifecycles.apply` returns None for them.
NOT_OP_EVENTS = frozenset(
    {PoolCreated, SlotsAllocated, SlotsFreed, AllocationFailed, IndicesMisplaced, FreeRefused, PoolsSampled}
)

OpKey = tuple[int, int]  # (rank, op)


@dataclass(slots=True, eq=False)
class OpRecord:
    """Everything the log says about one operation (see the module docstring)."""

    rank: int
    op: int
    direction: str = ""
    #: one of :data:`PHASES`
    status: str = "queued"
    #: the queued op's priority; the least of the sources' for a merged op; the op id when
    #: it was submitted without being queued
    priority: int = -1
    node_ids: tuple[int, ...] = ()
    #: the ops merged into this one (``OperationsMerged.merged_ops``)
    merged_ops: tuple[int, ...] = ()
    #: the op this one was merged into (offline mode, sources of a merge of several ops)
    merged_into: int | None = None
    #: when it was queued: the earliest ``OperationQueued`` of the ops merged into it
    queued_ns: int | None = None
    merged_ns: int | None = None
    #: the first index move's time, and the first stream record's
    moved_ns: int | None = None
    recorded_ns: int | None = None
    #: slots per pool: as queued, summed over a merge's sources, then as submitted
    slots_by_pool: tuple[tuple[str, int], ...] = ()
    submit: TransferSubmitted | None = None
    done: TransferCompleted | TransferFailed | None = None
    #: the op's ``IndicesMoved`` and ``StreamRecorded`` events, in log order (``()``, the
    #: empty tuple, when the fold keeps no detail)
    moves: list[IndicesMoved] | tuple[()] = ()
    records: list[StreamRecorded] | tuple[()] = ()
    violations: list[AuditViolation] = field(default_factory=list)
    #: what a reader attaches to the record for its own use (the fold never reads it)
    evidence: Any = None

    # ---------------------------------------------------------------- identity
    @property
    def key(self) -> OpKey:
        return (self.rank, self.op)

    @property
    def name(self) -> str:
        """``hicache.write`` for d2h, ``hicache.load`` for h2d."""
        return "hicache.write" if self.direction == "d2h" else "hicache.load"

    @property
    def merged_from(self) -> tuple[int, ...]:
        """The ops merged into this one (the same as :attr:`merged_ops`)."""
        return self.merged_ops

    # ------------------------------------------------------------- submission
    @property
    def submitted_ns(self) -> int | None:
        return self.submit.ts_ns if self.submit is not None else None

    @property
    def stream(self) -> str:
        return self.submit.stream if self.submit is not None else ""

    @property
    def io_backend(self) -> str:
        return self.submit.io_backend if self.submit is not None else ""

    @property
    def layout(self) -> str:
        return self.submit.layout if self.submit is not None else ""

    @property
    def producer_id(self) -> int:
        return self.submit.producer_id if self.submit is not None else -1

    @property
    def bytes_by_pool(self) -> tuple[tuple[str, int], ...]:
        return self.submit.bytes_by_pool if self.submit is not None else ()

    @property
    def pools(self) -> list[str]:
        return [p for p, _ in self.slots_by_pool]

    @property
    def slots(self) -> int:
        return sum(n for _, n in self.slots_by_pool)

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.bytes_by_pool)

    @property
    def node_count(self) -> int:
        """The nodes it moves: its node ids, else one per merged op (at least one)."""
        return len(self.node_ids) if self.node_ids else max(1, len(self.merged_ops))

    # ------------------------------------------------------------------ outcome
    @property
    def finished_ns(self) -> int | None:
        return self.done.ts_ns if self.done is not None else None

    @property
    def finished(self) -> bool:
        return self.done is not None

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
    def layer_durations_ns(self) -> tuple[int, ...] | None:
        return self.done.layer_durations_ns if isinstance(self.done, TransferCompleted) else None

    @property
    def unrecorded_indices(self) -> int:
        """Index tensors the auditor found used without ``record_stream`` (one per pool and role)."""
        return sum(1 for v in self.violations if v.rule == UNRECORDED_RULE)

    @property
    def unrecorded_pools(self) -> list[str]:
        return sorted({v.pool for v in self.violations if v.rule == UNRECORDED_RULE})

    @property
    def omitted_pools(self) -> list[str]:
        """Pools registered to move with this op's slots that it did not move (``pool_omitted``)."""
        return sorted({v.pool for v in self.violations if v.rule == OMITTED_RULE})

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

    # -------------------------------------------------------------------- times
    @property
    def start_ns(self) -> int | None:
        """Submission time (the start of the op's span or slice), else the merge's."""
        if self.submit is not None:
            return self.submit.ts_ns
        return self.merged_ns

    @property
    def queue_wait_ns(self) -> int | None:
        """Submission minus :attr:`queued_ns`, never below 0 (clocks of two threads); None
        unless the op was both queued and submitted."""
        if self.submit is None or self.queued_ns is None:
            return None
        return max(0, self.submit.ts_ns - self.queued_ns)

    @property
    def duration_ns(self) -> int | None:
        """Transfer time of a completed op: the device-timed duration, else completion
        minus :attr:`start_ns` (never below 0); None unless completed."""
        done = self.done
        if not isinstance(done, TransferCompleted):
            return None
        if done.duration_ns > 0:
            return done.duration_ns
        start = self.start_ns
        return max(0, done.ts_ns - start) if start is not None else None

    def end_ns(self, default: int | None = None) -> int | None:
        """Completion time: :attr:`start_ns` + the device-timed duration when the runtime
        timed it (never after the observed completion), else when completion was observed;
        ``default`` for an op not finished."""
        done = self.done
        if done is None:
            return default
        start = self.start_ns
        if isinstance(done, TransferCompleted) and start is not None and done.duration_ns > 0:
            return min(done.ts_ns, start + done.duration_ns)
        return done.ts_ns

    @property
    def total_ns(self) -> int | None:
        """Observed completion minus submission (None unless both happened)."""
        if self.submit is None or self.done is None:
            return None
        return self.done.ts_ns - self.submit.ts_ns

    def snapshot(self) -> tuple[Any, ...]:
        """``(op, direction, node_ids, priority, slots_by_pool, status, producer_id)``."""
        return (
            self.op,
            self.direction,
            self.node_ids,
            self.priority,
            self.slots_by_pool,
            self.status,
            self.producer_id,
        )


class Step(IntEnum):
    """What an event did to its op (the first item of :meth:`OpLifecycles.apply`'s result)."""

    QUEUED = 0
    MERGED = 1
    MOVED = 2
    RECORDED = 3
    SUBMITTED = 4
    VIOLATION = 5
    FINISHED = 6


#: What :meth:`OpLifecycles.apply` returns for an op event: the step and the op's record
#: (None: a move, record or violation of no known op).
Applied = tuple[Step, OpRecord | None]


class OpLifecycles:
    """The op projection of a log (see the module docstring).

    ``keep``: keep every record (offline) instead of forgetting finished ones (live).
    ``detail``: keep each op's moves and stream records.
    """

    __slots__ = ("keep", "detail", "records", "anomalies", "_open", "_flying", "_counts")

    def __init__(self, *, keep: bool = False, detail: bool = True) -> None:
        self.keep = keep
        self.detail = detail
        #: ``{(rank, op): record}`` in the order of each op's first event (read, never change it)
        self.records: dict[OpKey, OpRecord] = {}
        #: ``(seq, kind, detail)`` of what a correct producer never logs (``merge_unknown_op``)
        self.anomalies: list[tuple[int, str, str]] = []
        self._open: dict[OpKey, OpRecord] = {}  # merged or submitted, not finished: first-touched order
        self._flying: dict[OpKey, str] = {}  # submitted, not finished -> the submission's direction
        self._counts: dict[str, int] = {}  # direction -> len of _flying with it

    @classmethod
    def offline(cls, events: Iterable[Event], *, detail: bool = True) -> OpLifecycles:
        """The offline fold (``keep=True``) of a whole log."""
        ops = cls(keep=True, detail=detail)
        fold = cls._FOLD.get
        for ev in events:
            f = fold(type(ev))
            if f is not None:
                f(ops, ev)
        return ops

    # ------------------------------------------------------------------ reading
    def get(self, rank: int, op: int) -> OpRecord | None:
        return self.records.get((rank, op))

    def in_flight(self, rank: int | None = None) -> Iterator[OpRecord]:
        """Ops submitted and not finished (of ``rank``, or all), in the order they were first merged or submitted."""
        for key, rec in list(self._open.items()):
            if key in self._flying and (rank is None or rec.rank == rank):
                yield rec

    def in_flight_count(self, direction: str) -> int:
        """How many ops submitted in ``direction`` have not finished."""
        return self._counts.get(direction, 0)

    def unfinished(self) -> list[OpRecord]:
        """Ops merged or submitted that never completed or failed, in the order they were first merged or submitted."""
        return list(self._open.values())

    def top_level(self) -> list[OpRecord]:
        """Every record not merged into another, by :attr:`OpRecord.start_ns` (then rank, op)."""
        return sorted(
            (r for r in self.records.values() if r.merged_into is None),
            key=lambda r: (r.start_ns if r.start_ns is not None else 0, r.rank, r.op),
        )

    # ----------------------------------------------------------------- folding
    def apply(self, ev: Event) -> Applied | None:
        """Fold one event: ``(what it did, the op's record)``, None for an event that touches no op."""
        fold = self._FOLD.get(type(ev))
        if fold is not None:
            return fold(self, ev)
        if type(ev) is OpsSubmitted:  # the events it stands for, in order: what the submission did last
            got = None
            for part in expand(ev):  # type: ignore[arg-type]
                got = self.apply(part) or got
            return got
        return None

    def _record(self, rank: int, op: int, direction: str = "") -> OpRecord:
        key = (rank, op)
        rec = self.records.get(key)
        if rec is None:
            rec = self.records[key] = OpRecord(rank, op, direction)
            if self.detail:
                rec.moves = []
                rec.records = []
        elif direction and not rec.direction:
            rec.direction = direction
        return rec

    def _unfly(self, key: OpKey) -> None:
        d = self._flying.pop(key, None)
        if d is not None:
            self._counts[d] -= 1

    def _queued(self, ev: OperationQueued) -> Applied:
        key = (ev.rank, ev.op)
        rec = self.records.get(key)
        if rec is None:  # the usual: a new op (_record, inlined)
            rec = self.records[key] = OpRecord(ev.rank, ev.op, ev.direction)
            if self.detail:
                rec.moves = []
                rec.records = []
        elif not rec.direction:
            rec.direction = ev.direction
        rec.queued_ns = ev.ts_ns
        rec.node_ids = (ev.node_id,)
        rec.priority = ev.priority
        rec.slots_by_pool = ev.slots_by_pool
        return Step.QUEUED, rec

    def _merged(self, ev: OperationsMerged) -> Applied:
        rank, op, ops = ev.rank, ev.op, ev.merged_ops
        records = self.records
        if len(ops) == 1 and ops[0] == op and (rank, op) in records:  # (a)
            rec = records[(rank, op)]
            if ev.direction and not rec.direction:
                rec.direction = ev.direction
            if ev.node_ids:
                rec.node_ids = ev.node_ids
        else:  # (b)
            slots: dict[str, int] = {}
            node_ids: list[int] = []
            prio: int | None = None
            queued: int | None = None
            sources: list[OpRecord] = []
            for o in ops:
                src = records.get((rank, o))
                if src is None:
                    self.anomalies.append((ev.seq, "merge_unknown_op", str(o)))  # (d)
                    continue
                sources.append(src)
                node_ids.extend(src.node_ids)
                for pool, n in src.slots_by_pool:
                    slots[pool] = slots.get(pool, 0) + n
                prio = src.priority if prio is None else min(prio, src.priority)
                if src.queued_ns is not None:
                    queued = src.queued_ns if queued is None else min(queued, src.queued_ns)
            for src in sources:
                if src.op == op:
                    continue
                key = (rank, src.op)
                if self.keep:
                    src.merged_into = op
                    src.status = "merged"
                else:
                    del records[key]
                self._open.pop(key, None)
                self._unfly(key)
            rec = self._record(rank, op, ev.direction)
            rec.node_ids = ev.node_ids if ev.node_ids else tuple(node_ids)
            rec.priority = prio if prio is not None else op
            rec.slots_by_pool = tuple(slots.items())
            rec.queued_ns = queued
        rec.status = "merged"
        rec.merged_ops = ops
        rec.merged_ns = ev.ts_ns
        self._open.setdefault((rank, op), rec)
        return Step.MERGED, rec

    def _moved(self, ev: IndicesMoved) -> Applied:
        if ev.op < 0:
            return Step.MOVED, None
        rec = self._record(ev.rank, ev.op)
        if rec.moved_ns is None:
            rec.moved_ns = ev.ts_ns
        moves = rec.moves
        if isinstance(moves, list):
            moves.append(ev)
        return Step.MOVED, rec

    def _stream_recorded(self, ev: StreamRecorded) -> Applied:
        if ev.op < 0:
            return Step.RECORDED, None
        rec = self._record(ev.rank, ev.op)
        if rec.recorded_ns is None:
            rec.recorded_ns = ev.ts_ns
        records = rec.records
        if isinstance(records, list):
            records.append(ev)
        return Step.RECORDED, rec

    def _submitted(self, ev: TransferSubmitted) -> Applied:
        key = (ev.rank, ev.op)
        rec = self.records.get(key)
        if rec is None:  # (c)
            rec = self._record(ev.rank, ev.op, ev.direction)
            rec.priority = ev.op
        elif not rec.direction:
            rec.direction = ev.direction
        rec.submit = ev  # (f)
        rec.status = "submitted"
        rec.slots_by_pool = ev.slots_by_pool
        self._open.setdefault(key, rec)
        old = self._flying.get(key)
        if old != ev.direction:
            if old is not None:
                self._counts[old] -= 1
            self._flying[key] = ev.direction
            self._counts[ev.direction] = self._counts.get(ev.direction, 0) + 1
        return Step.SUBMITTED, rec

    def _finished(self, ev: TransferCompleted | TransferFailed) -> Applied:
        key = (ev.rank, ev.op)
        rec = self.records.get(key)
        if rec is None:  # (e)
            rec = self._record(ev.rank, ev.op, ev.direction)
        elif not rec.direction:
            rec.direction = ev.direction
        rec.done = ev
        rec.status = "completed" if type(ev) is TransferCompleted else "failed"
        if self._open.pop(key, None) is not None:
            d = self._flying.pop(key, None)
            if d is not None:
                self._counts[d] -= 1
        if not self.keep:
            del self.records[key]
        return Step.FINISHED, rec

    def _violation(self, ev: AuditViolation) -> Applied:
        rec = self.records.get((ev.rank, ev.op)) if ev.op >= 0 else None
        if rec is not None:
            rec.violations.append(ev)
        return Step.VIOLATION, rec  # (h) when None

    #: how :meth:`apply` folds each event type
    _FOLD: dict[type, Callable[[OpLifecycles, Any], Applied]] = {
        OperationQueued: _queued,
        OperationsMerged: _merged,
        IndicesMoved: _moved,
        StreamRecorded: _stream_recorded,
        TransferSubmitted: _submitted,
        TransferCompleted: _finished,
        TransferFailed: _finished,
        AuditViolation: _violation,
    }
