"""The stream-safety auditor: a projection of the event log that applies the rules.

Rules (each finding names op, pool, role, stream and what was wrong):

- ``unrecorded_index``: a device index tensor used by a transfer on a side stream
  had no ``record_stream`` on that stream before the op completed (SGLang #22940);
- ``index_not_on_device``: the ``kernel`` io backend was handed an index tensor that
  is not on the device (unless the pool's copy moved it to the device itself, on the
  transfer's stream: an ``IndicesMoved`` with that ``stream``; or it is the host indices
  of a pool the transfer names in ``host_indices_on_cpu``, a staged write-back);
- ``length_mismatch``: a pool's host and device index tensors differ in length;
- ``slot_not_allocated``: a transfer names a slot that is not allocated, or slots are
  freed while a submitted transfer still uses them (use after free, out of range; at
  any size of free; one finding per op and pool tier, at the first free that takes
  its slots). Where the op's slot values are not in the log (device indices, never
  read: no sync), an ``IndicesFreed`` is the evidence: the tensor freed holds the
  indices the op received;
- ``double_free``: slots freed that were already free;
- ``incomplete_operation``: an op submitted but never completed or failed, at log end;
- ``pool_omitted``: an op moved a pool but not a pool the controller registers to move
  with that pool's slots (``TransferSubmitted.sidecar_pools``: a draft model's KV), so that
  pool's data is never backed up, or stale after the load (SGLang #27953);
- ``misplaced_indices``: a pool's free or allocation was handed an index tensor on a device
  other than the one the pool's indices live on (``IndicesMisplaced``: a transfer's moved
  device indices given to a host pool's free, SGLang #23427). No op: the finding has op -1.

A free the engine refused (``FreeRefused``: it raised and changed nothing) of slots that were
already free is a ``double_free``, with what it raised.

Live: ``Auditor().attach(log)`` is a stage of the log (``EventLog.add_stage``): it sees
each event before it is stored, and each finding becomes an ``AuditViolation`` stored
right before the event that revealed it; the end-of-log findings are logged at
:meth:`Auditor.finish` (or the log's ``close()``). Offline: feed events with
:meth:`Auditor.feed`, then :meth:`Auditor.finish`. Both produce the same findings for
the same log, with the seq of the revealing event as the log holds it.
:func:`audited` gives a log with the verdicts in place: each ``AuditViolation``
right before the event that revealed it, whatever the log held (violations logged
after that event, before it, or none); :func:`audit_batch` is its step over one list.
What the rules know of an op in flight (the index tensors still to be recorded on its
stream, the slots it uses) is the ``evidence`` of its record in the op lifecycle
(:class:`~hicache_obs.events._lifecycle.OpLifecycles`): with ``fold_state=True`` the
bookkeeping's own, so one fold serves replay and audit; else the auditor's, fed the
submissions and ends. The per-event cost is one dict lookup for events no rule looks at. No event costs
more than O(log n) besides the slots it names: the slots of the ops in flight are
indexed (:class:`_InUse`) once there are more than a few of them, so a free is checked
against all of them without a scan.

An auditor of a log read back (``Auditor(limits=PoolLimits())``, what :func:`audit` and
``replay(..., audit=True)`` use) holds the log's pools to
:class:`~hicache_obs.events._state.PoolLimits`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from heapq import heapify, heappop, heappush
from itertools import accumulate
from itertools import islice as _islice
from operator import attrgetter
from typing import Any

from .._native import runs_of as _runs_of
from ._lifecycle import OpLifecycles, OpRecord
from ._schema import (
    EVENT_TYPES,
    AuditViolation,
    Event,
    FreeRefused,
    IndicesFreed,
    IndicesMisplaced,
    IndicesMoved,
    OperationsMerged,
    OpsSubmitted,
    PoolCreated,
    Runs,
    SlotsAllocated,
    SlotsFreed,
    StreamRecorded,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
    expand,
)
from ._state import (
    ALLOC,
    CHECK,
    FAST_CALL_SLOTS,
    FREE,
    HANDLERS,
    AllocMap,
    CacheState,
    PoolLimits,
    bad_runs,
    first_slots,
    new_map,
)

_NO_PLAN = (None, None)
_FOLD_END = {cls: HANDLERS[cls] for cls in (TransferCompleted, TransferFailed)}  # CacheState's fold of an op's end
_FOLD_MERGED = HANDLERS[OperationsMerged]
_op_of = attrgetter("op")
_rank_of = attrgetter("rank")
_fold_slots_freed = HANDLERS[SlotsFreed]  # CacheState's fold of a free: returns the slots not allocated

__all__ = ["RULES", "Finding", "Auditor", "AuditStage", "audit", "audited", "audit_batch", "audit_end"]

RULES = (
    "unrecorded_index",
    "index_not_on_device",
    "length_mismatch",
    "slot_not_allocated",
    "double_free",
    "incomplete_operation",
    "pool_omitted",
    "misplaced_indices",
)


@dataclass(frozen=True)
class Finding:
    """One rule violation."""

    rule: str
    pool: str
    role: str
    op: int
    rank: int
    detail: str
    stream: str = ""
    direction: str = ""
    seq: int = -1  # seq of the event that revealed it (-1: end of log)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def key(self) -> tuple[Any, ...]:
        """Identity for comparing live and offline audits."""
        return (self.rule, self.pool, self.role, self.op, self.rank, self.stream, self.direction)

    def violation_fields(self) -> dict[str, Any]:
        """The fields of its ``AuditViolation`` besides the header (seq, ts_ns, rank)."""
        return {
            "op": self.op,
            "rule": self.rule,
            "pool": self.pool,
            "role": self.role,
            "detail": self.detail,
            "stream": self.stream,
            "direction": self.direction,
        }

    def to_event(self, *, seq: int, ts_ns: int) -> AuditViolation:
        """Its ``AuditViolation`` with the header given (the rank is the finding's): the one
        place a violation event is built from a finding, where no log stamps it."""
        return AuditViolation(seq=seq, ts_ns=ts_ns, rank=self.rank, **self.violation_fields())


@dataclass(slots=True)
class _Evidence:
    """What the rules keep about an op in flight, in its record's ``evidence`` slot (its
    direction, stream and submission are the record's ``submit``)."""

    # (pool, role) -> device of the index tensor that still needs a record on the op's stream
    needs_record: dict[tuple[str, str], str]
    # (pool, tier) -> the slots the transfer reads or writes, where their values are known,
    # as :data:`Spans`; a pool tier leaves once a free took them
    spans: dict[tuple[str, str], Spans] = field(default_factory=dict)
    # (pool, tier) whose use after free was reported from an ``IndicesFreed`` (once each)
    freed: set[tuple[str, str]] = field(default_factory=set)


#: Runs as two lists: their starts in order, and the running maximum of their ends.
Spans = tuple[list[int], list[int]]


def _spans(runs: Runs) -> Spans:
    """The slots of ``runs`` as their starts in order and the running maximum of their ends
    (empty runs dropped): enough to tell by bisection whether a run meets them."""
    if len(runs) == 1:  # the usual index tensor: one contiguous run
        s, n = runs[0]
        return ([s], [s + n]) if n > 0 else ([], [])
    ordered = sorted(r for r in runs if r[1] > 0)
    return [s for s, _ in ordered], list(accumulate((s + n for s, n in ordered), max))


def _disjoint(spans: Spans) -> Spans:
    """``spans`` as disjoint intervals ``[start, end)`` in order (overlapping runs joined)."""
    starts: list[int] = []
    ends: list[int] = []
    for s, e in zip(*spans):
        if ends and s <= ends[-1]:
            ends[-1] = max(ends[-1], e)  # running maxima: e >= ends[-1] already
        else:
            starts.append(s)
            ends.append(e)
    return starts, ends


def _overlaps(spans: Spans, runs: Runs) -> bool:
    """Whether any slot of ``runs`` lies in ``spans``."""
    starts, ends = spans
    for start, length in runs:
        if length > 0:
            i = bisect_right(starts, start + length - 1) - 1
            if i >= 0 and ends[i] > start:
                return True
    return False


def _common(a: Spans, b: Spans, k: int = 8) -> list[int]:
    """The first ``k`` slots in both ``a`` and ``b``, in order (a sweep: no slot is expanded
    beyond those ``k``)."""
    (sa, ea), (sb, eb) = _disjoint(a), _disjoint(b)
    out: list[int] = []
    i = j = 0
    while i < len(sa) and j < len(sb) and len(out) < k:
        lo, hi = max(sa[i], sb[j]), min(ea[i], eb[j])
        if lo < hi:
            out.extend(range(lo, min(hi, lo + k - len(out))))
        if ea[i] <= eb[j]:
            i += 1
        else:
            j += 1
    return out


class _InUse:
    """The ops in flight that use slots of one pool tier, and which of them a free takes.

    Up to ``SCAN`` ops are checked one by one (bisection in each op's runs: the usual case,
    a handful in flight). Beyond that their runs are also kept in a tree over slot numbers
    (a max-end segment tree keyed by run start, sparse, in dicts, as deep as the pool's
    slot numbers need: 15 levels for 2**15 slots, 28 at most for a log's): a free finds
    the ops it overlaps in O((k + 1) log C), k the ops found, which leave it (one finding
    each). Ops whose runs start at the same slot share a leaf, whose largest end a heap
    keeps (entries of ops that left are dropped when they reach its top): an op leaves in
    O(log n + log C) however many share its starts. The tree is dropped again below
    ``SCAN // 4`` ops.
    """

    SCAN = 32

    __slots__ = ("ops", "_bits", "_mx", "_at", "_ends")

    def __init__(self, capacity: int = 1) -> None:
        self.ops: dict[int, Spans] = {}  # in submission order
        self._bits = max(capacity - 1, 1).bit_length()  # the tree covers starts 0 .. 2**_bits - 1
        self._mx: dict[int, int] | None = None  # node -> the largest end of a run starting below it
        self._at: dict[int, dict[int, int]] = {}  # start -> {op: end}
        self._ends: dict[int, list[tuple[int, int]]] = {}  # start -> heap of (-end, op), some stale

    def add(self, op: int, spans: Spans) -> None:
        self.ops[op] = spans
        if self._mx is not None:
            self._insert(op, spans)
        elif len(self.ops) > self.SCAN:
            self._build()

    def _build(self) -> None:
        self._mx, self._at, self._ends = {}, {}, {}
        for o, sp in self.ops.items():
            self._insert(o, sp)

    def remove(self, op: int) -> None:
        spans = self.ops.pop(op, None)
        if spans is None or self._mx is None:
            return
        if len(self.ops) < self.SCAN // 4:
            self._mx, self._at, self._ends = None, {}, {}
        else:
            self._delete(op, spans)

    def hits(self, freeing: Runs) -> list[int]:
        """The ops whose slots ``freeing`` overlaps, in submission order."""
        if self._mx is None:
            return [op for op, sp in self.ops.items() if _overlaps(sp, freeing)]
        found: set[int] = set()
        for start, length in freeing:
            if length > 0:
                self._query(start, start + length, found)
        if len(found) > 1:
            return [op for op in self.ops if op in found]
        return list(found)

    # the tree: leaf 2**_bits + start; node v covers the starts of the leaves below it
    def _insert(self, op: int, spans: Spans) -> None:
        if spans[0] and spans[0][-1] >> self._bits:  # a start beyond the tree: a deeper one
            self._bits = spans[0][-1].bit_length()
            self._build()
            return
        mx, at, ends, top = self._mx, self._at, self._ends, 1 << self._bits
        assert mx is not None
        for s, e in zip(*spans):
            cell = at.get(s)
            if cell is None:
                cell = at[s] = {}
                ends[s] = []
            if cell.get(op, -1) >= e:
                continue
            cell[op] = e
            heappush(ends[s], (-e, op))
            v = top + s
            while v and mx.get(v, -1) < e:
                mx[v] = e
                v >>= 1

    def _delete(self, op: int, spans: Spans) -> None:
        mx, at, ends, top = self._mx, self._at, self._ends, 1 << self._bits
        assert mx is not None
        for s in spans[0]:
            cell = at.get(s)
            if cell is None or cell.pop(op, None) is None:
                continue
            v = top + s
            if cell:
                heap = ends[s]
                if len(heap) > 2 * len(cell) + 8:  # mostly ops that left: rebuilt (amortised O(1))
                    heap = ends[s] = [(-end, o) for o, end in cell.items()]
                    heapify(heap)
                while cell.get(heap[0][1]) != -heap[0][0]:  # the top left (or moved on): drop it
                    heappop(heap)
                mx[v] = -heap[0][0]
            else:
                del at[s], ends[s]
                del mx[v]
            v >>= 1
            while v:
                new = max(mx.get(2 * v, -1), mx.get(2 * v + 1, -1))
                if mx.get(v, -1) == new:
                    break
                if new < 0:
                    del mx[v]
                else:
                    mx[v] = new
                v >>= 1

    def _query(self, a: int, b: int, found: set[int]) -> None:
        """Add the ops with a run of start < ``b`` and end > ``a``."""
        mx, top = self._mx, 1 << self._bits
        assert mx is not None
        get = mx.get
        stack = [(1, 0, top)]  # node, the starts it covers: [lo, hi)
        while stack:
            v, lo, hi = stack.pop()
            if lo >= b or get(v, -1) <= a:
                continue
            if v >= top:
                for op, e in self._at[lo].items():
                    if e > a:
                        found.add(op)
                continue
            mid = (lo + hi) >> 1
            stack.append((2 * v + 1, mid, hi))
            stack.append((2 * v, lo, mid))


class _RankAudit:
    __slots__ = ("in_use", "lifecycles", "moved", "orphans", "side_moves", "state", "tables")

    def __init__(self, fold_state: bool, limits: PoolLimits | None = None) -> None:
        # with a full CacheState the auditor's fold is also the replay's bookkeeping
        self.state = CacheState(limits=limits) if fold_state else None
        self.tables: dict[tuple[str, str], Any] = self.state.tables if self.state is not None else {}
        # the ops: the bookkeeping's lifecycle in fold mode; else the auditor's own, fed the
        # submissions and ends only; the evidence of an op in flight is its record's
        self.lifecycles: OpLifecycles = (
            self.state.lifecycles if self.state is not None else OpLifecycles(keep=False, detail=False)
        )
        # fold mode: ops in flight whose record the lifecycle forgot, merged into another op
        # (a log no controller writes): their transfers still run, so the rules keep them
        self.orphans: dict[int, OpRecord] = {}
        # (pool, tier) -> the in-flight ops that use its slots
        self.in_use: dict[tuple[str, str], _InUse] = {}
        # values of index tensors moved from the CPU, by (op, pool, role), until submission
        self.moved: dict[tuple[int, str, str], Runs] = {}
        # op -> (pool, role) -> stream on which a pool's copy moved those indices to the device itself
        self.side_moves: dict[int, dict[tuple[str, str], str]] = {}

    def record(self, rank: int, op: int) -> OpRecord | None:
        """The record of ``op`` that holds its evidence, if it is in flight (else any record of it)."""
        rec = self.lifecycles.records.get((rank, op))
        if (rec is None or rec.evidence is None) and self.orphans:
            rec = self.orphans.get(op, rec)
        return rec


class Auditor:
    """Applies the audit rules to a stream of events (one or several ranks)."""

    def __init__(
        self,
        emit: Callable[..., Any] | None = None,
        *,
        fold_state: bool = False,
        limits: PoolLimits | None = None,
    ) -> None:
        self._fold = fold_state
        self._limits = limits
        self.findings: list[Finding] = []
        self._ranks: dict[int, _RankAudit] = {}
        self._emit = emit
        self._log: Any = None  # the log this auditor is a stage of (attach)
        self._finished = False
        self._handlers: dict[type, Callable[[Any, _RankAudit], None]] = {
            PoolCreated: self._pool_created,
            IndicesMoved: self._moved,
            TransferSubmitted: self._submitted,
            StreamRecorded: self._recorded,
            TransferCompleted: self._completed,
            TransferFailed: self._failed,
            IndicesFreed: self._indices_freed,
            IndicesMisplaced: self._misplaced,
            FreeRefused: self._free_refused,
        }
        # fold mode: per event type, the CacheState handler and the rule handler (either
        # may be None); one lookup per event, no CacheState.apply in between
        self._plan: dict[type, tuple[Any, Any]] = {}
        for cls in EVENT_TYPES.values():
            fold = HANDLERS.get(cls)
            rule = None if cls in (PoolCreated, SlotsAllocated) else self._handlers.get(cls)
            self._plan[cls] = (fold, rule)
        self._plan[SlotsFreed] = (None, self._fold_freed)
        # an op's end: its rule reads the evidence, then folds the end (which forgets the record)
        self._plan[TransferCompleted] = (None, self._completed)
        self._plan[TransferFailed] = (None, self._failed)
        self._plan[OperationsMerged] = (None, self._fold_merged)

    # ---------------------------------------------------------------- wiring
    def attach(self, log: Any) -> Auditor:
        """Audit ``log`` live, as a stage of it (:class:`AuditStage`): each finding is stored
        as an ``AuditViolation`` right before the event that revealed it.

        Events the log already holds (a controller's ``PoolCreated``) are audited first
        (what they reveal is logged after them: they are out already). An auditor audits
        one log, once.
        """
        from ..errors import ConfigError

        if self._log is not None or self._emit is not None:
            raise ConfigError("Auditor.attach: this auditor already reports into a log; make one auditor per log")
        self._log = log
        log.add_stage(AuditStage(self), backfill=True)
        return self

    def feed(self, events: Iterable[Event]) -> Auditor:
        if not self._fold:
            handle = self.handle
            for ev in events:
                handle(ev)
            return self
        ranks, plan = self._ranks, self._plan
        for ev in events:  # handle() in fold mode, inlined: most of a replay's time
            if type(ev) is OpsSubmitted:  # one submission's events (metrics and sampling profiles)
                self.feed(expand(ev))  # type: ignore[arg-type]
                continue
            r = ranks.get(ev.rank)
            if r is None:
                r = ranks[ev.rank] = _RankAudit(True, self._limits)
            state = r.state
            state.last_seq = ev.seq  # type: ignore[union-attr]
            fold, rule = plan.get(type(ev), _NO_PLAN)
            if fold is not None:
                fold(state, ev)
            if rule is not None:
                rule(ev, r)
        return self

    def handle(self, ev: Event) -> None:
        cls = type(ev)
        if (cls is SlotsAllocated or cls is SlotsFreed) and not self._fold:
            # most of a live log: one allocation-map update each, without a handler call
            r = self._ranks.get(ev.rank)
            t = r.tables.get((ev.pool, ev.tier)) if r is not None else None  # type: ignore[attr-defined]
            if t is None:
                return
            ind = ev.indices  # type: ignore[attr-defined]
            if cls is SlotsAllocated:
                if len(ind) == 1 and ind[0][1] <= FAST_CALL_SLOTS:
                    t.apply_alloc(ind)
                else:
                    bad_runs(t, ALLOC, ind)
                return
            if r.in_use:  # type: ignore[union-attr]
                self._check_in_flight_free(ev, r)  # type: ignore[arg-type]
            if len(ind) == 1 and ind[0][1] <= FAST_CALL_SLOTS:
                bad = t.apply_free(ind)
                if bad:
                    self._report_free(ev, _runs_of(bad), t)  # type: ignore[arg-type]
            else:
                self._report_free(ev, bad_runs(t, FREE, ind), t)  # type: ignore[arg-type]
            return
        r = self._ranks.get(ev.rank)
        if self._fold:
            self.feed((ev,))
            return
        h = self._handlers.get(cls)
        if h is None:
            if cls is OpsSubmitted:  # one submission's events (metrics and sampling profiles)
                for part in expand(ev):  # type: ignore[arg-type]
                    self.handle(part)
            return
        if r is None:
            r = self._ranks[ev.rank] = _RankAudit(False)
        h(ev, r)

    @property
    def finished(self) -> bool:
        """:meth:`finish` ran."""
        return self._finished

    @property
    def states(self) -> dict[int, CacheState]:
        """Each rank's bookkeeping (only with ``fold_state=True``)."""
        return {rank: r.state for rank, r in self._ranks.items() if r.state is not None}

    def finish(self) -> list[Finding]:
        """End of log: report ``incomplete_operation`` for ops still in flight. Idempotent.

        An attached auditor logs these now (after every event: nothing reveals them)."""
        if not self._finished:
            n = len(self.findings)
            for rank, r in sorted(self._ranks.items()):
                for rec in sorted([*r.lifecycles.in_flight(rank), *r.orphans.values()], key=_op_of):
                    sub = rec.submit
                    assert sub is not None  # in flight: submitted
                    self._report(
                        "incomplete_operation",
                        "*",
                        "*",
                        rec.op,
                        rank,
                        f"op {rec.op} ({sub.direction}) was submitted on stream {sub.stream!r} at seq {sub.seq} "
                        "and never completed or failed",
                        stream=sub.stream,
                        direction=sub.direction,
                        seq=-1,
                    )
            self._finished = True  # after the reports: a live auditor logs these too
            if self._log is not None:
                for f in self.findings[n:]:
                    self._log.emit(AuditViolation, **f.violation_fields())
        return list(self.findings)

    # ------------------------------------------------------------- reporting
    def _report(
        self,
        rule: str,
        pool: str,
        role: str,
        op: int,
        rank: int,
        detail: str,
        *,
        stream: str = "",
        direction: str = "",
        seq: int = -1,
    ) -> None:
        f = Finding(rule, pool, role, op, rank, detail, stream, direction, seq)
        self.findings.append(f)
        if self._emit is not None and not self._finished:
            self._emit(AuditViolation, **f.violation_fields())

    def counts(self) -> dict[str, dict[str, int]]:
        """``{rule: {pool: count}}`` of the findings so far."""
        out: dict[str, dict[str, int]] = {}
        for f in self.findings:
            d = out.setdefault(f.rule, {})
            d[f.pool] = d.get(f.pool, 0) + 1
        return out

    # -------------------------------------------------------------- handlers
    def _pool_created(self, ev: PoolCreated, r: _RankAudit) -> None:
        if self._limits is not None:
            self._limits.admit(ev)
        key = (ev.pool, ev.tier)
        r.tables.pop(key, None)  # the old map's memory goes before the new one's is asked for
        r.tables[key] = new_map(AllocMap, ev, ev.capacity)

    def _fold_freed(self, ev: SlotsFreed, r: _RankAudit) -> None:
        if r.in_use:
            self._check_in_flight_free(ev, r)
        bad = _fold_slots_freed(r.state, ev)  # type: ignore[arg-type]  # fold mode; last_seq set by feed
        if bad:
            self._report_free(ev, bad, r.tables[(ev.pool, ev.tier)])

    def _check_in_flight_free(self, ev: SlotsFreed, r: _RankAudit) -> None:
        """Slots freed while a submitted transfer still uses them: a use after free, at any
        size of free (intervals against intervals, no slot expanded but the 8 shown)."""
        key = (ev.pool, ev.tier)
        use = r.in_use.get(key)
        if use is None:
            return
        hits = use.hits(ev.indices)
        if not hits:
            return  # the usual case
        freed = _spans(ev.indices)
        for op in hits:
            rec = r.record(ev.rank, op)
            assert rec is not None and rec.submit is not None  # in use: in flight, with its record
            sub = rec.submit
            hit = _common(freed, rec.evidence.spans.pop(key))
            use.remove(op)
            self._report(
                "slot_not_allocated",
                ev.pool,
                "host" if ev.tier == "host" else "device",
                op,
                ev.rank,
                f"{ev.tier} slots {hit} of pool {ev.pool!r} were freed ({ev.reason}) while "
                f"{sub.direction} op {op} on stream {sub.stream!r} still uses them (use after free)",
                stream=sub.stream,
                direction=sub.direction,
                seq=ev.seq,
            )
        if not use.ops:
            del r.in_use[key]

    def _indices_freed(self, ev: IndicesFreed, r: _RankAudit) -> None:
        """An index tensor that in-flight ops received, handed to a free: a use after free
        for each of them still in flight, where their slot values were not in the log (else
        the ``SlotsFreed`` check reports it, with the slots)."""
        key = (ev.pool, ev.tier)
        for op in ev.ops:
            rec = r.record(ev.rank, op)
            f = rec.evidence if rec is not None else None
            sub = rec.submit if rec is not None else None
            if f is None or sub is None or (key in f.spans and key in r.tables) or key in f.freed:
                continue  # not in flight, or its slots are tracked (SlotsFreed says it), or reported already
            f.freed.add(key)
            t = ev.tensor
            self._report(
                "slot_not_allocated",
                ev.pool,
                "host" if ev.tier == "host" else "device",
                op,
                ev.rank,
                f"{ev.tier} indices of pool {ev.pool!r} ({t.numel} on {t.device}) were freed while "
                f"{sub.direction} op {op} on stream {sub.stream!r} still uses them: the tensor freed "
                "holds the indices the op received (use after free)",
                stream=sub.stream,
                direction=sub.direction,
                seq=ev.seq,
            )

    def _misplaced(self, ev: IndicesMisplaced, r: _RankAudit) -> None:
        t = ev.tensor
        self._report(
            "misplaced_indices",
            ev.pool,
            ev.tier,
            -1,
            ev.rank,
            f"{ev.tier} pool {ev.pool!r}: {ev.call}() was handed {t.numel} indices on {t.device}, "
            f"where the pool's indices live on {ev.expected}",
            seq=ev.seq,
        )

    def _free_refused(self, ev: FreeRefused, r: _RankAudit) -> None:
        """A free the engine refused: a ``double_free`` for the slots handed that were free."""
        values = ev.tensor.indices
        table = r.tables.get((ev.pool, ev.tier))
        if values is None or table is None:
            return
        bad = first_slots(bad_runs(table, CHECK, values, 8))
        if bad:
            self._report(
                "double_free",
                ev.pool,
                ev.tier,
                -1,
                ev.rank,
                f"{ev.tier} pool {ev.pool!r}: {ev.call}() was handed slots {bad}, already free, "
                f"and refused them ({ev.error})",
                seq=ev.seq,
            )

    def _leaves(self, op: int, f: _Evidence, r: _RankAudit) -> None:
        """``op`` is no longer in flight: its slots leave the index."""
        for key in f.spans:
            use = r.in_use.get(key)
            if use is not None:
                use.remove(op)
                if not use.ops:
                    del r.in_use[key]

    def _report_free(self, ev: SlotsFreed, bad: Runs, t: AllocMap) -> None:
        if bad:
            cap = t.capacity
            outside = []  # the parts of the reported runs below 0 or at or above the capacity
            for s, n in bad:
                if s < 0:
                    outside.append((s, min(n, -s)))
                if s + n > cap:
                    outside.append((max(s, cap), s + n - max(s, cap)))
            out = first_slots(tuple(outside))
            if out:
                rule_detail = f"slots {out} freed out of range 0..{cap - 1}"
            else:
                rule_detail = f"slots {tuple(_merged_runs(bad, 8))} freed while already free ({ev.reason})"
            self._report(
                "double_free",
                ev.pool,
                ev.tier,
                ev.op,
                ev.rank,
                f"{ev.tier} pool {ev.pool!r}: {rule_detail}",
                seq=ev.seq,
            )

    def _moved(self, ev: IndicesMoved, r: _RankAudit) -> None:
        if ev.stream:
            r.side_moves.setdefault(ev.op, {})[(ev.pool, ev.role)] = ev.stream
        if ev.tensor.indices is not None:
            r.moved[(ev.op, ev.pool, ev.role)] = ev.tensor.indices

    def _submitted(self, ev: TransferSubmitted, r: _RankAudit) -> None:
        device = ev.device or next((t.device for t in ev.tensors if t.device != "cpu"), "cpu")
        kernel_on_device = ev.io_backend == "kernel" and device != "cpu"
        side = r.side_moves.pop(ev.op, {}) if r.side_moves else {}
        needs: dict[tuple[str, str], str] = {}
        used: dict[tuple[str, str], Runs] = {}
        by_pool: dict[str, dict[str, int]] = {}
        for t in ev.tensors:
            roles = by_pool.get(t.pool)
            if roles is None:
                by_pool[t.pool] = {t.role: t.numel}
            else:
                roles[t.role] = t.numel
            if (
                kernel_on_device
                and t.device != device
                and side.get((t.pool, t.role)) != ev.stream
                and not (t.role == "host" and t.pool in ev.host_indices_on_cpu)
            ):
                self._report(
                    "index_not_on_device",
                    t.pool,
                    t.role,
                    ev.op,
                    ev.rank,
                    f"io backend 'kernel' got pool {t.pool!r} {t.role} indices on {t.device}, not on {device}",
                    stream=ev.stream,
                    direction=ev.direction,
                    seq=ev.seq,
                )
            if t.device != "cpu" and t.numel:
                needs[(t.pool, t.role)] = t.device
            values = t.indices if t.indices is not None else r.moved.pop((ev.op, t.pool, t.role), None)
            if values is not None:
                tier = "host" if t.role == "host" else "device"
                used[(t.pool, tier)] = values
                table = r.tables.get((t.pool, tier))
                if table is not None:
                    bad = first_slots(bad_runs(table, CHECK, values, 8))
                    if bad:
                        self._report(
                            "slot_not_allocated",
                            t.pool,
                            t.role,
                            ev.op,
                            ev.rank,
                            f"{ev.direction} op {ev.op} uses {tier} slots {bad} of pool {t.pool!r} "
                            "that are not allocated",
                            stream=ev.stream,
                            direction=ev.direction,
                            seq=ev.seq,
                        )
        for pool, shares in ev.sidecar_pools:
            if shares in by_pool and pool not in by_pool:
                self._report(
                    "pool_omitted",
                    pool,
                    "*",
                    ev.op,
                    ev.rank,
                    f"{ev.direction} op {ev.op} moved pool {shares!r} but not pool {pool!r}, which the "
                    f"controller registers to move with pool {shares!r} (it shares its slots): its data is "
                    + ("never backed up" if ev.direction == "d2h" else "stale after this load"),
                    stream=ev.stream,
                    direction=ev.direction,
                    seq=ev.seq,
                )
        for pool, roles in by_pool.items():
            h, d = roles.get("host"), roles.get("device")
            if h is not None and d is not None and h != d:
                self._report(
                    "length_mismatch",
                    pool,
                    "*",
                    ev.op,
                    ev.rank,
                    f"pool {pool!r}: {h} host indices vs {d} device indices",
                    stream=ev.stream,
                    direction=ev.direction,
                    seq=ev.seq,
                )
        if r.state is None:  # the auditor's own lifecycle (in fold mode the bookkeeping folded it)
            rec = r.lifecycles.apply(ev)[1]  # type: ignore[index]  # a submission's step
        else:
            rec = r.lifecycles.records.get((ev.rank, ev.op))
        assert rec is not None  # a submission always leaves a record
        old = rec.evidence
        if old is None and r.orphans and ev.op in r.orphans:
            old = r.orphans.pop(ev.op).evidence
        if old is not None:  # the same op submitted again while in flight: the new one counts
            self._leaves(ev.op, old, r)
        spans = {k: sp for k, sp in ((k, _spans(v)) for k, v in used.items()) if sp[0]}
        rec.evidence = _Evidence(needs, spans)
        for k, sp in spans.items():
            use = r.in_use.get(k)
            if use is None:
                table = r.tables.get(k)
                use = r.in_use[k] = _InUse(table.capacity if table is not None else 1)
            use.add(ev.op, sp)

    def _recorded(self, ev: StreamRecorded, r: _RankAudit) -> None:
        rec = r.lifecycles.records.get((ev.rank, ev.op))  # r.record(), inlined: one per stream record
        if (rec is None or rec.evidence is None) and r.orphans:
            rec = r.orphans.get(ev.op, rec)
        if rec is not None and rec.evidence is not None and ev.stream == rec.submit.stream:  # type: ignore[union-attr]
            rec.evidence.needs_record.pop((ev.pool, ev.role), None)

    def _ended(self, ev: TransferCompleted | TransferFailed, r: _RankAudit) -> tuple[_Evidence | None, Any]:
        """Fold the end of an op; returns its evidence and its ``TransferSubmitted`` (None, None:
        it was not in flight)."""
        rec = r.lifecycles.records.get((ev.rank, ev.op))  # before the fold forgets it
        if (rec is None or rec.evidence is None) and r.orphans:
            rec = r.orphans.pop(ev.op, rec)
        f = rec.evidence if rec is not None else None
        sub = rec.submit if f is not None else None  # type: ignore[union-attr]
        if r.state is not None:
            _FOLD_END[type(ev)](r.state, ev)
        else:
            r.lifecycles.apply(ev)
        return f, sub

    def _fold_merged(self, ev: OperationsMerged, r: _RankAudit) -> None:
        """Fold mode: the bookkeeping's fold of a merge, keeping the sources in flight it forgets."""
        lifecycles = r.lifecycles
        for o in ev.merged_ops:
            if o != ev.op:
                rec = lifecycles.get(ev.rank, o)
                if rec is not None and rec.evidence is not None:
                    r.orphans[o] = rec
        _FOLD_MERGED(r.state, ev)

    def _completed(self, ev: TransferCompleted, r: _RankAudit) -> None:
        f, sub = self._ended(ev, r)
        if f is None:
            return
        if f.spans:
            self._leaves(ev.op, f, r)
        for (pool, role), device in f.needs_record.items():
            self._report(
                "unrecorded_index",
                pool,
                role,
                ev.op,
                ev.rank,
                f"{role} index tensor of pool {pool!r} on {device} was used on stream {sub.stream!r} "
                f"without record_stream on that stream before op {ev.op} completed; the caching allocator "
                "may hand its memory to another tensor while the copy still reads it",
                stream=sub.stream,
                direction=sub.direction,
                seq=ev.seq,
            )

    def _failed(self, ev: TransferFailed, r: _RankAudit) -> None:
        # the rule that explains the failure was reported at submission
        f, _ = self._ended(ev, r)
        if f is not None and f.spans:
            self._leaves(ev.op, f, r)


class AuditStage:
    """An :class:`Auditor` as a stage of a live log (``EventLog.add_stage``; what
    :meth:`Auditor.attach` adds): ``stage(event)`` audits the event and returns the new
    findings, which the log stores right before it; :meth:`placed` gives them the seq the
    revealing event was stored with; :meth:`finish` (the log's ``close()``) logs the
    end-of-log findings. After :meth:`Auditor.finish` nothing more is placed."""

    __slots__ = ("auditor", "_made")

    def __init__(self, auditor: Auditor) -> None:
        self.auditor = auditor
        self._made = (0, 0, -1)  # (first, end) of the findings last returned, and the seq they name

    def __call__(self, ev: Event) -> list[Finding] | None:
        a = self.auditor
        found = a.findings
        n = len(found)
        a.handle(ev)
        if len(found) == n or a.finished:
            return None
        self._made = (n, len(found), ev.seq)
        return found[n:]

    def placed(self, ev: Event) -> None:
        """``ev`` was stored after the findings last returned, with a later seq: they name it."""
        first, end, built = self._made
        found = self.auditor.findings
        for i in range(first, min(end, len(found))):
            if found[i].seq == built:
                found[i] = replace(found[i], seq=ev.seq)

    def finish(self) -> None:
        self.auditor.finish()


def _merged_runs(runs: Runs, k: int) -> list[tuple[int, int]]:
    """The first ``k`` runs of the slots ``runs`` names, sorted, adjacent runs joined."""
    starts, ends = _disjoint(_spans(runs))
    return [(s, e - s) for s, e in zip(starts[:k], ends[:k])]


def audit(events: Iterable[Event]) -> list[Finding]:
    """Audit a finished log offline; returns the findings, end-of-log rules included. The
    log's pools are held to :class:`~hicache_obs.events._state.PoolLimits`."""
    a = Auditor(limits=PoolLimits())
    a.feed(events)
    return a.finish()


def audit_batch(batch: Sequence[Event], auditor: Auditor) -> list[Event]:
    """``batch`` audited by ``auditor``: the ``AuditViolation`` events it holds dropped, and
    one for each new finding placed right before the event that revealed it, with that
    event's ``seq`` and ``ts_ns``.

    Feed a log's batches in order to one auditor that no log emits through; findings it
    made before this call count as placed already. The end-of-log findings come from
    :meth:`Auditor.finish` (:func:`audited` places them).
    """
    out: list[Event] = []
    append = out.append
    handle = auditor.handle
    found = auditor.findings
    seen = len(found)
    for ev in batch:  # one handle() per event: no generator frame, no call besides it
        if type(ev) is AuditViolation:
            continue  # a verdict of the log's own auditor: this one's replace it
        handle(ev)
        if len(found) > seen:
            seq, ts_ns = ev.seq, ev.ts_ns
            for f in found[seen:]:
                append(f.to_event(seq=seq, ts_ns=ts_ns))
            seen = len(found)
        append(ev)
    return out


#: Events :func:`audited` takes from its input at a time.
AUDITED_CHUNK = 4096


def audited(events: Iterable[Event], *, auditor: Auditor | None = None) -> Iterator[Event]:
    """A readable log with the verdicts in place: its own ``AuditViolation`` events dropped,
    the auditor's placed right before the event that revealed each (with that event's
    ``seq`` and ``ts_ns``), and the end-of-log findings (``incomplete_operation``) last,
    each with the ``seq`` and ``ts_ns`` of the last event of its rank.

    So a log whose violations were logged after the events that revealed them, one whose
    violations come before them and one without any give the same stream. ``auditor``
    (default: a fresh ``Auditor(limits=PoolLimits())``, as :func:`audit` uses) must be
    new and emit into no log; after the stream is read, its ``findings`` are the log's.
    """
    a = Auditor(limits=PoolLimits()) if auditor is None else auditor
    it = iter(events)
    last: dict[int, Event] = {}  # rank -> its last event
    while True:
        chunk = list(_islice(it, AUDITED_CHUNK))
        if not chunk:
            break
        out = audit_batch(chunk, a)
        # a rank's last event here is never a violation (each comes before its event's)
        last.update(zip(map(_rank_of, out), out))  # at C speed: no Python frame per event
        yield from out
    yield from audit_end(a, last)


def audit_end(auditor: Auditor, last: Mapping[int, Event]) -> list[Event]:
    """The end-of-log violations (:meth:`Auditor.finish`'s new findings), each with the ``seq``
    and ``ts_ns`` of ``last[rank]``, its rank's last event (a finding's rank has had one)."""
    n = len(auditor.findings)
    auditor.finish()
    out: list[Event] = []
    for f in auditor.findings[n:]:
        end = last[f.rank]
        out.append(f.to_event(seq=end.seq, ts_ns=end.ts_ns))
    return out
