"""The stream-safety auditor: a projection of the event log that applies the rules.

Rules (each finding names op, pool, role, stream and what was wrong):

- ``unrecorded_index``: a device index tensor used by a transfer on a side stream
  had no ``record_stream`` on that stream before the op completed (SGLang #22940);
- ``index_not_on_device``: the ``kernel`` io backend was handed an index tensor that
  is not on the device (unless the pool's copy moved it to the device itself, on the
  transfer's stream: an ``IndicesMoved`` with that ``stream``);
- ``length_mismatch``: a pool's host and device index tensors differ in length;
- ``slot_not_allocated``: a transfer names a slot that is not allocated, or slots are
  freed while a submitted transfer still uses them (use after free, out of range);
- ``double_free``: slots freed that were already free;
- ``incomplete_operation``: an op submitted but never completed or failed, at log end.

Live: ``Auditor().attach(log)`` subscribes and appends an ``AuditViolation``
event per finding. Offline: feed events with :meth:`Auditor.feed`, then
:meth:`Auditor.finish`. Both produce the same findings for the same log.
The per-event cost is one dict lookup for events no rule looks at.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from typing import Any

from .schema import (
    EVENT_TYPES,
    AuditViolation,
    Event,
    IndicesMoved,
    PoolCreated,
    Runs,
    SlotsAllocated,
    SlotsFreed,
    StreamRecorded,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
    expand_runs,
    runs_from_list,
    runs_len,
)
from .state import _HANDLERS as _STATE_HANDLERS
from .state import AllocMap, CacheState

_NO_PLAN = (None, None)
_fold_slots_freed = CacheState._slots_freed

__all__ = ["RULES", "Finding", "Auditor", "audit"]

RULES = (
    "unrecorded_index",
    "index_not_on_device",
    "length_mismatch",
    "slot_not_allocated",
    "double_free",
    "incomplete_operation",
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


@dataclass(slots=True)
class _InFlight:
    direction: str
    stream: str
    submit_seq: int
    # (pool, role) -> device of the index tensor that still needs a record on `stream`
    needs_record: dict[tuple[str, str], str]
    # (pool, tier) -> slots the transfer reads or writes, where their values are known
    slots: dict[tuple[str, str], Runs] = field(default_factory=dict)
    # the same slots as sorted run starts and the running maximum of their ends
    spans: dict[tuple[str, str], tuple[list[int], list[int]]] = field(default_factory=dict)


def _spans(runs: Runs) -> tuple[list[int], list[int]]:
    if len(runs) == 1:  # the usual index tensor: one contiguous run
        s, n = runs[0]
        return ([s], [s + n]) if n > 0 else ([], [])
    ordered = sorted(r for r in runs if r[1] > 0)
    return [s for s, _ in ordered], list(accumulate((s + n for s, n in ordered), max))


def _overlaps(spans: tuple[list[int], list[int]], runs: Runs) -> bool:
    """Whether any slot of ``runs`` lies in the runs that ``spans`` describes."""
    starts, ends = spans
    for start, length in runs:
        if length > 0:
            i = bisect_right(starts, start + length - 1) - 1
            if i >= 0 and ends[i] > start:
                return True
    return False


class _RankAudit:
    __slots__ = ("inflight", "moved", "side_moves", "state", "tables")

    def __init__(self, fold_state: bool) -> None:
        # with a full CacheState the auditor's fold is also the replay's bookkeeping
        self.state = CacheState() if fold_state else None
        self.tables: dict[tuple[str, str], Any] = self.state.tables if self.state is not None else {}
        self.inflight: dict[int, _InFlight] = {}
        # values of index tensors moved from the CPU, by (op, pool, role), until submission
        self.moved: dict[tuple[int, str, str], Runs] = {}
        # op -> (pool, role) -> stream on which a pool's copy moved those indices to the device itself
        self.side_moves: dict[int, dict[tuple[str, str], str]] = {}


class Auditor:
    """Applies the audit rules to a stream of events (one or several ranks)."""

    def __init__(self, emit: Callable[..., Any] | None = None, *, fold_state: bool = False) -> None:
        self._fold = fold_state
        self.findings: list[Finding] = []
        self._ranks: dict[int, _RankAudit] = {}
        self._emit = emit
        self._finished = False
        self._handlers: dict[type, Callable[[Any, _RankAudit], None]] = {
            PoolCreated: self._pool_created,
            IndicesMoved: self._moved,
            TransferSubmitted: self._submitted,
            StreamRecorded: self._recorded,
            TransferCompleted: self._completed,
            TransferFailed: self._failed,
        }
        # fold mode: per event type, the CacheState handler and the rule handler (either
        # may be None); one lookup per event, no CacheState.apply in between
        self._plan: dict[type, tuple[Any, Any]] = {}
        for cls in EVENT_TYPES.values():
            fold = _STATE_HANDLERS.get(cls)
            rule = None if cls in (PoolCreated, SlotsAllocated) else self._handlers.get(cls)
            self._plan[cls] = (fold, rule)
        self._plan[SlotsFreed] = (None, self._fold_freed)

    # ---------------------------------------------------------------- wiring
    def attach(self, log: Any) -> Auditor:
        """Audit ``log`` live: subscribe, and append an ``AuditViolation`` per finding.

        Events the log already holds (a controller's ``PoolCreated``) are audited first.
        """
        self._emit = log.emit
        with log._lock:
            for ev in log.events():
                self.handle(ev)
            log.subscribe(self.handle)
        return self

    def feed(self, events: Iterable[Event]) -> Auditor:
        if not self._fold:
            handle = self.handle
            for ev in events:
                handle(ev)
            return self
        ranks, plan = self._ranks, self._plan
        for ev in events:  # handle() in fold mode, inlined: most of a replay's time
            r = ranks.get(ev.rank)
            if r is None:
                r = ranks[ev.rank] = _RankAudit(True)
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
            if cls is SlotsAllocated:
                t.apply_alloc(ev.indices)  # type: ignore[attr-defined]
                return
            if r.inflight:  # type: ignore[union-attr]
                self._check_in_flight_free(ev, r)  # type: ignore[arg-type]
            self._report_free(ev, t.apply_free(ev.indices), t)  # type: ignore[arg-type, attr-defined]
            return
        r = self._ranks.get(ev.rank)
        if self._fold:
            self.feed((ev,))
            return
        h = self._handlers.get(cls)
        if h is None:
            return
        if r is None:
            r = self._ranks[ev.rank] = _RankAudit(False)
        h(ev, r)

    @property
    def states(self) -> dict[int, CacheState]:
        """Each rank's bookkeeping (only with ``fold_state=True``)."""
        return {rank: r.state for rank, r in self._ranks.items() if r.state is not None}

    def finish(self) -> list[Finding]:
        """End of log: report ``incomplete_operation`` for ops still in flight. Idempotent."""
        if not self._finished:
            for rank, r in sorted(self._ranks.items()):
                for op, f in sorted(r.inflight.items()):
                    self._report(
                        "incomplete_operation",
                        "*",
                        "*",
                        op,
                        rank,
                        f"op {op} ({f.direction}) was submitted on stream {f.stream!r} at seq {f.submit_seq} "
                        "and never completed or failed",
                        stream=f.stream,
                        direction=f.direction,
                        seq=-1,
                    )
            self._finished = True  # after the reports: a live auditor logs these too
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
            self._emit(
                AuditViolation,
                op=op,
                rule=rule,
                pool=pool,
                role=role,
                detail=detail,
                stream=stream,
                direction=direction,
            )

    def counts(self) -> dict[str, dict[str, int]]:
        """``{rule: {pool: count}}`` of the findings so far."""
        out: dict[str, dict[str, int]] = {}
        for f in self.findings:
            d = out.setdefault(f.rule, {})
            d[f.pool] = d.get(f.pool, 0) + 1
        return out

    # -------------------------------------------------------------- handlers
    def _pool_created(self, ev: PoolCreated, r: _RankAudit) -> None:
        r.tables[(ev.pool, ev.tier)] = AllocMap(ev.capacity)

    def _fold_freed(self, ev: SlotsFreed, r: _RankAudit) -> None:
        if r.inflight:
            self._check_in_flight_free(ev, r)
        bad = _fold_slots_freed(r.state, ev)  # type: ignore[arg-type]  # fold mode; last_seq set by feed
        if bad:
            self._report_free(ev, bad, r.tables[(ev.pool, ev.tier)])

    def _check_in_flight_free(self, ev: SlotsFreed, r: _RankAudit) -> None:
        """Slots freed while a submitted transfer still uses them: a use after free."""
        key = (ev.pool, ev.tier)
        freeing = ev.indices
        for f in r.inflight.values():
            spans = f.spans.get(key)
            if spans is not None and _overlaps(spans, freeing):
                break
        else:
            return  # the usual case, told by bisection; the exact check below names the slots
        freed: set[int] | None = None
        for op, f in r.inflight.items():
            runs = f.slots.get(key)
            if runs is None:
                continue
            if freed is None:
                freed = set(expand_runs(ev.indices)) if runs_len(ev.indices) <= 1 << 20 else set()
            hit = sorted(freed.intersection(expand_runs(runs)))
            if hit:
                self._report(
                    "slot_not_allocated",
                    ev.pool,
                    "host" if ev.tier == "host" else "device",
                    op,
                    ev.rank,
                    f"{ev.tier} slots {hit[:8]} of pool {ev.pool!r} were freed ({ev.reason}) while "
                    f"{f.direction} op {op} on stream {f.stream!r} still uses them (use after free)",
                    stream=f.stream,
                    direction=f.direction,
                    seq=ev.seq,
                )

    def _report_free(self, ev: SlotsFreed, bad: list[int], t: AllocMap) -> None:
        if bad:
            out = [b for b in bad if not 0 <= b < t.capacity]
            rule_detail = (
                f"slots {out[:8]} freed out of range 0..{t.capacity - 1}"
                if out
                else f"slots {runs_from_list(sorted(bad))[:8]} freed while already free ({ev.reason})"
            )
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
            if kernel_on_device and t.device != device and side.get((t.pool, t.role)) != ev.stream:
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
                    bad = table.unallocated(values)
                    if bad:
                        self._report(
                            "slot_not_allocated",
                            t.pool,
                            t.role,
                            ev.op,
                            ev.rank,
                            f"{ev.direction} op {ev.op} uses {tier} slots {bad[:8]} of pool {t.pool!r} "
                            "that are not allocated",
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
        r.inflight[ev.op] = _InFlight(
            ev.direction, ev.stream, ev.seq, needs, used, {k: _spans(v) for k, v in used.items()}
        )

    def _recorded(self, ev: StreamRecorded, r: _RankAudit) -> None:
        f = r.inflight.get(ev.op)
        if f is not None and ev.stream == f.stream:
            f.needs_record.pop((ev.pool, ev.role), None)

    def _completed(self, ev: TransferCompleted, r: _RankAudit) -> None:
        f = r.inflight.pop(ev.op, None)
        if f is None:
            return
        for (pool, role), device in f.needs_record.items():
            self._report(
                "unrecorded_index",
                pool,
                role,
                ev.op,
                ev.rank,
                f"{role} index tensor of pool {pool!r} on {device} was used on stream {f.stream!r} "
                f"without record_stream on that stream before op {ev.op} completed; the caching allocator "
                "may hand its memory to another tensor while the copy still reads it",
                stream=f.stream,
                direction=f.direction,
                seq=ev.seq,
            )

    def _failed(self, ev: TransferFailed, r: _RankAudit) -> None:
        # the rule that explains the failure was reported at submission
        r.inflight.pop(ev.op, None)



def audit(events: Iterable[Event]) -> list[Finding]:
    """Audit a finished log offline; returns the findings, end-of-log rules included."""
    a = Auditor()
    a.feed(events)
    return a.finish()
