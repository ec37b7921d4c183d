"""The controller's bookkeeping as a fold of its events.

:class:`CacheState` changes only in :meth:`CacheState.apply`. The live
controller applies each event as it emits it; :func:`fold` rebuilds the same
state from a log, so ``fold(log.events()).snapshot() == controller.state.snapshot()``
after any workload.

What it holds: per (pool, tier) a :class:`SlotTable` (which slots are allocated,
and the FIFO order of free pages the allocator hands out next); per direction the
queue of ops waiting to start and the FIFO of acks (submitted, not yet reaped);
the ops not yet finished with their lifecycle status. Anomalies that a correct
controller never produces (a free of a free slot, a completion out of FIFO order)
are recorded in ``anomalies`` instead of raising, so a faulty log still folds.

A reader of a log bounds what the log can make it hold (:class:`PoolLimits`: at most
``MAX_POOLS`` slot tables and ``MAX_TOTAL_CAPACITY`` slots, a :class:`LogLimitError`
beyond), hands the compiled maps at most ``MAP_CALL_SLOTS`` slots per call (what a map
reports comes back one int per slot; here it is turned into runs at once), and keeps
queues in :class:`OpQueue`, where an op leaves in O(1) from any position: no event
costs more than O(1) amortized besides the slots it names.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import islice
from operator import itemgetter
from types import MappingProxyType
from typing import Any, TypeVar

from .._native import SlotMap  # compiled or its pure twin (hicache_obs._native)
from .._native import runs_of as _runs_of
from ..errors import LogLimitError
from ._lifecycle import OpLifecycles, OpRecord
from ._schema import (
    D2H,
    H2D,
    AllocationFailed,
    Event,
    OperationQueued,
    OperationsMerged,
    OpsSubmitted,
    PoolCreated,
    SlotsAllocated,
    SlotsFreed,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
    expand,
)

__all__ = [
    "AllocMap",
    "SlotTable",
    "OpState",
    "OpQueue",
    "CacheState",
    "PoolLimits",
    "fold",
    "HANDLERS",
    "dispatch_registrar",
    "bad_runs",
    "ALLOC",
    "FREE",
    "CHECK",
    "first_slots",
    "MAX_POOLS",
    "MAX_TOTAL_CAPACITY",
    "MAP_CALL_SLOTS",
]

#: Slot tables (pool, tier, rank) a reader of one log holds at most (a table re-created
#: under the same name replaces the old one and counts once).
MAX_POOLS = 1024
#: Slots (the capacities summed over those tables) a reader of one log holds at most.
#: A table costs 1 byte per slot it ever touched for the auditor (10 for a replay's
#: bookkeeping with one-slot pages): untouched slots cost no memory.
MAX_TOTAL_CAPACITY = 1 << 31
#: Slots handed to a compiled map per call on the long path of :func:`bad_runs`. A map
#: reports the slots that were already in the state asked for one Python int each, so a
#: longer request is cut into parts of this size and each part's report is turned into
#: runs before the next: a free of 2**28 free slots never holds 2**28 ints.
MAP_CALL_SLOTS = 1 << 12

#: What one call of a compiled map may report at most, on the usual path of :func:`bad_runs`.
FAST_CALL_SLOTS = 1 << 16

Runs = tuple[tuple[int, int], ...]
ALLOC, FREE, CHECK = "alloc", "free", "check"
_length = itemgetter(1)


def bad_runs(table: Any, kind: str, runs: Any, limit: int = 0) -> Runs:
    """``table.apply_alloc`` / ``apply_free`` / ``unallocated`` (``kind``: ``"alloc"``,
    ``"free"``, ``"check"``) of ``runs``, with what it reports as runs, in the order found:
    the same state and report as one call of the compiled map.

    A request of more than ``MAP_CALL_SLOTS`` slots goes part by part. A part whose first
    slot is already in the state asked for (a free of free slots, say) is first tried the
    other way round on an untracked map (the table itself if it is an :class:`AllocMap`,
    else its ``probe`` copy): a part wholly in that state is then told in the time of a
    ``memchr``, without an int per slot; a part that is mixed costs an int per slot of the
    smaller kind, and a free or an allocation leaves it uniform. With ``limit`` (checks
    only) the parts stop once that many slots are known to be bad.
    """
    if len(runs) == 1:  # the usual: one run
        one = abs(runs[0][1]) + 8 <= FAST_CALL_SLOTS
    else:
        one = sum(map(abs, map(_length, runs))) + 8 * len(runs) <= FAST_CALL_SLOTS
    if one:  # the usual: one call
        if kind == FREE:
            bad = table.apply_free(runs)
            if table.probe is not None:
                table.probe.apply_free(runs)
        elif kind == ALLOC:
            bad = table.apply_alloc(runs)
            if table.probe is not None:
                table.probe.apply_alloc(runs)
        else:
            bad = table.unallocated(runs)
        return _runs_of(bad) if bad else ()
    call = table.apply_free if kind == FREE else table.apply_alloc if kind == ALLOC else table.unallocated
    probe = table if isinstance(table, AllocMap) else table.probe
    mirror = table.probe
    out: list[tuple[int, int]] = []
    capacity = table.capacity
    found = 0
    for run in runs:
        start, n = run
        if n <= 0 or start < 0 or n > capacity - start:  # out of range: changes nothing, reports <= 8 slots
            bad = call((run,))
            out.extend(_runs_of(bad))
            found += len(bad)
        else:
            end = start + n
            while start < end:
                part = (start, min(MAP_CALL_SLOTS, end - start))
                got = _part(table, probe, mirror, kind, part)
                for r in got:
                    if out and out[-1][0] + out[-1][1] == r[0]:  # parts of one run: joined again
                        out[-1] = (out[-1][0], out[-1][1] + r[1])
                    else:
                        out.append(r)
                    found += r[1]
                start += part[1]
                if limit and found >= limit:
                    return tuple(out)
        if limit and found >= limit:
            break
    return tuple(out)


def _part(table: Any, probe: Any, mirror: Any, kind: str, part: tuple[int, int]) -> Runs:
    one = (part,)
    if kind == CHECK:
        if probe is None or table.is_allocated(part[0]):
            return _runs_of(table.unallocated(one))
        # the first slot is free: find the allocated ones instead (probe all allocated, then undo)
        free = _minus(part, _runs_of(probe.apply_alloc(one)))
        if free:
            probe.apply_free(free)
        return free
    freeing = kind == FREE
    apply = table.apply_free if freeing else table.apply_alloc
    if probe is None or table.is_allocated(part[0]) == freeing:  # the usual case
        bad = apply(one)
        if mirror is not None:
            (mirror.apply_free if freeing else mirror.apply_alloc)(one)
        return _runs_of(bad) if bad else ()
    # the first slot is already as asked: turn the probe the other way round, which lists
    # the slots that were not (an int each), leaving the whole part in the other state
    other = _runs_of((probe.apply_alloc if freeing else probe.apply_free)(one))
    if not other:  # all already as asked: nothing changes, all reported
        (probe.apply_free if freeing else probe.apply_alloc)(one)
        return one
    if mirror is not None:  # the tracked table has to be told slot by slot
        bad = apply(one)
        (mirror.apply_free if freeing else mirror.apply_alloc)(one)
        return _runs_of(bad) if bad else ()
    apply(one)  # the table is the probe: the whole part is now the other way, a memset
    return _minus(part, other)


def _minus(part: tuple[int, int], runs: Runs) -> Runs:
    """The slots of ``part`` not in ``runs`` (ascending, disjoint, inside ``part``)."""
    out = []
    pos, end = part[0], part[0] + part[1]
    for s, n in runs:
        if s > pos:
            out.append((pos, s - pos))
        pos = max(pos, s + n)
    if pos < end:
        out.append((pos, end - pos))
    return tuple(out)


def first_slots(runs: Runs, k: int = 8) -> list[int]:
    """The first ``k`` slots that ``runs`` names, in order."""
    return list(islice((s for start, n in runs for s in range(start, start + n)), k))


class PoolLimits:
    """What the slot tables of one log may hold: ``MAX_POOLS`` tables, ``MAX_TOTAL_CAPACITY``
    slots. Shared by the ranks of a log; :meth:`admit` raises :class:`LogLimitError`."""

    __slots__ = ("capacities", "total")

    def __init__(self) -> None:
        self.capacities: dict[tuple[int, str, str], int] = {}
        self.total = 0

    def admit(self, ev: PoolCreated) -> None:
        key = (ev.rank, ev.pool, ev.tier)
        old = self.capacities.get(key)
        if old is None and len(self.capacities) >= MAX_POOLS:
            raise LogLimitError(
                f"seq {ev.seq} rank {ev.rank}: PoolCreated {ev.pool!r}/{ev.tier} would be slot table "
                f"{len(self.capacities) + 1}; a log may hold at most {MAX_POOLS} (MAX_POOLS)"
            )
        total = self.total - (old or 0) + ev.capacity
        if total > MAX_TOTAL_CAPACITY:
            raise LogLimitError(
                f"seq {ev.seq} rank {ev.rank}: PoolCreated {ev.pool!r}/{ev.tier} capacity {ev.capacity} brings "
                f"the log's pools to {total} slots; at most {MAX_TOTAL_CAPACITY} (MAX_TOTAL_CAPACITY)"
            )
        self.capacities[key] = ev.capacity
        self.total = total


def new_map(factory: Callable[..., Any], ev: PoolCreated, *args: Any) -> Any:
    """``factory(*args)``, a slot map for ``ev``'s pool; out of memory is a :class:`LogLimitError`."""
    try:
        return factory(*args)
    except MemoryError:
        raise LogLimitError(
            f"seq {ev.seq} rank {ev.rank}: no memory for the slot table of pool {ev.pool!r}/{ev.tier} "
            f"(capacity {ev.capacity})"
        ) from None


class OpQueue:
    """A FIFO of op ids from which any op leaves in O(1): the queue of ops waiting to
    start, and the acks. Reads like the list it replaces: iteration in order, ``len``,
    ``in``, ``==`` a list or tuple of the same ops.

    An op leaves by :meth:`popleft` (the head), :meth:`remove_first` (its oldest entry) or
    :meth:`discard` (all its entries). Either way the entries that left are the oldest of
    that op, so they are told apart by a count per op, and dropped (lazily) when they
    reach the head, or when they outnumber the live ones.
    """

    __slots__ = ("_order", "_count", "_dead", "_len")

    def __init__(self, ops: Iterable[int] = ()) -> None:
        self._order: deque[int] = deque()
        self._count: dict[int, int] = {}  # live entries per op
        self._dead: dict[int, int] = {}  # entries of an op that left and are still in _order
        self._len = 0
        for op in ops:
            self.append(op)

    def append(self, op: int) -> None:
        self._order.append(op)
        self._count[op] = self._count.get(op, 0) + 1
        self._len += 1

    def __len__(self) -> int:
        return self._len

    def __contains__(self, op: object) -> bool:
        return op in self._count

    def __iter__(self) -> Iterator[int]:
        if not self._dead:
            return iter(tuple(self._order))
        skip = dict(self._dead)
        out = []
        for op in self._order:
            n = skip.get(op)
            if n:
                skip[op] = n - 1
                continue
            out.append(op)
        return iter(out)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (OpQueue, list, tuple, deque)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"OpQueue({list(self)!r})"

    def _trim(self) -> None:
        order, dead = self._order, self._dead
        while order and dead:
            n = dead.get(order[0])
            if not n:
                return
            if n == 1:
                del dead[order[0]]
            else:
                dead[order[0]] = n - 1
            order.popleft()

    def first(self) -> int | None:
        """The op at the head, or None."""
        self._trim()
        return self._order[0] if self._order else None

    def popleft(self) -> int:
        self._trim()
        op = self._order.popleft()
        self._left(op, 1)
        return op

    def _left(self, op: int, n: int) -> None:
        c = self._count[op] - n
        if c:
            self._count[op] = c
        else:
            del self._count[op]
        self._len -= n

    def remove_first(self, op: int) -> bool:
        """Drop the oldest entry of ``op``; False if it has none."""
        if op not in self._count:
            return False
        self._left(op, 1)
        self._dead[op] = self._dead.get(op, 0) + 1
        self._compact()
        return True

    def discard(self, op: int) -> None:
        """Drop every entry of ``op`` (none: nothing happens)."""
        n = self._count.get(op)
        if n:
            self._left(op, n)
            self._dead[op] = self._dead.get(op, 0) + n
            self._compact()

    def _compact(self) -> None:
        if len(self._order) > 2 * self._len + 32:
            self._order = deque(self)
            self._dead = {}


class AllocMap(SlotMap):
    """Which slots of a pool are allocated, one byte each: what the auditor needs when
    it keeps no replay bookkeeping (no free-page order).

    ``apply_alloc(runs)`` / ``apply_free(runs)`` return the slots that already were in
    the state asked for, or are out of range; ``unallocated(runs)`` those not allocated.
    The map is compiled (``hicache_obs/_slots.c``).
    """

    __slots__ = ()
    probe = None  # it is its own probe (bad_runs); only a SlotTable keeps a copy

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, 1, False)


class SlotTable(SlotMap):
    """Allocation state of one pool on one tier, with the page-granular FIFO free list
    the allocator takes pages from: never-used pages in order, then freed pages in the
    order their last slot was freed. A page rejoins the list only when all its slots are
    free. Compiled (``hicache_obs/_slots.c``): every allocation and free passes here."""

    __slots__ = ("pool", "probe", "tier")

    def __init__(self, pool: str, tier: str, capacity: int, page_size: int) -> None:
        super().__init__(capacity, page_size, True)
        self.pool = pool
        self.tier = tier
        #: a reader's untracked copy of the allocation bytes (:func:`bad_runs`), or None
        self.probe: AllocMap | None = None

    def snapshot(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "page_size": self.page_size,
            "used": self.used,
            "allocated": self.allocated_runs(),
            "free_order": tuple(self.free_order()),
        }


#: An op's record in :attr:`CacheState.ops`: the op lifecycle's record (the name of old).
OpState = OpRecord


class _OpsView(Mapping[int, OpRecord]):
    """The ops of one rank not finished yet, by op id: a read-only view of the records of
    a live :class:`~hicache_obs.events._lifecycle.OpLifecycles`."""

    __slots__ = ("_records",)

    def __init__(self, records: dict[tuple[int, int], OpRecord]) -> None:
        self._records = records

    def _rank(self) -> int:
        records = self._records
        return next(iter(records))[0] if records else 0  # one log, one rank: the first record's

    def __getitem__(self, op: int) -> OpRecord:
        return self._records[(self._rank(), op)]

    def __contains__(self, op: object) -> bool:
        return (self._rank(), op) in self._records

    def __iter__(self) -> Iterator[int]:
        return (rank_op[1] for rank_op in self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return f"{{{', '.join(f'{op}: {rec.snapshot()!r}' for (_, op), rec in self._records.items())}}}"


F = TypeVar("F", bound=Callable[..., Any])

#: the CacheState method that folds each event type (filled by :func:`_folds` below)
_HANDLERS: dict[type, Callable[..., Any]] = {}
#: Per event type, the :class:`CacheState` method that folds it, called as
#: ``handler(state, event)``: what :meth:`CacheState.apply` dispatches to, for a reader that
#: runs its own loop over events (the auditor's fold mode). Types not listed change nothing.
HANDLERS: Mapping[type, Callable[..., Any]] = MappingProxyType(_HANDLERS)


def dispatch_registrar(table: dict[type, Callable[..., Any]]) -> Callable[..., Callable[[F], F]]:
    """``@folds(*types)`` for a class body: files the decorated method in ``table`` as the
    handler of each of ``types`` (a dispatch table built next to the methods it names)."""

    def folds(*types: type) -> Callable[[F], F]:
        def register(fn: F) -> F:
            for t in types:
                table[t] = fn
            return fn

        return register

    return folds


_folds = dispatch_registrar(_HANDLERS)  # the fold of each event type, in HANDLERS


@dataclass
class CacheState:
    """Bookkeeping of one controller (one rank); see the module docstring."""

    tables: dict[tuple[str, str], SlotTable] = field(default_factory=dict)
    queues: dict[str, OpQueue] = field(default_factory=lambda: {D2H: OpQueue(), H2D: OpQueue()})
    acks: dict[str, OpQueue] = field(default_factory=lambda: {D2H: OpQueue(), H2D: OpQueue()})
    completed: dict[str, int] = field(default_factory=lambda: {D2H: 0, H2D: 0})
    failed: dict[str, int] = field(default_factory=lambda: {D2H: 0, H2D: 0})
    allocation_failures: int = 0
    anomalies: list[tuple[int, str, str]] = field(default_factory=list)
    last_seq: int = -1
    #: set by a reader of a log (replay, the offline audit): what its pools may hold
    limits: PoolLimits | None = field(default=None, repr=False, compare=False)
    #: the ops not finished yet: the live op lifecycle of the log, without moves and records
    #: (its merge anomalies go to :attr:`anomalies`, in log order with the others)
    lifecycles: OpLifecycles = field(
        default_factory=lambda: OpLifecycles(keep=False, detail=False), repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.lifecycles.anomalies = self.anomalies

    @property
    def ops(self) -> Mapping[int, OpRecord]:
        """``{op: record}`` of the ops queued, merged or submitted and not finished (read only)."""
        return _OpsView(self.lifecycles.records)

    def table(self, pool: str, tier: str) -> SlotTable:
        return self.tables[(pool, tier)]

    def in_flight(self, direction: str) -> int:
        return len(self.acks[direction])

    def apply(self, ev: Event) -> None:
        """Fold one event into the state (the only way the state changes)."""
        self.last_seq = ev.seq
        handler = _HANDLERS.get(type(ev))
        if handler is not None:
            handler(self, ev)

    # ---------------------------------------------------------------- handlers
    @_folds(OpsSubmitted)
    def _ops_submitted(self, ev: OpsSubmitted) -> None:
        for part in expand(ev):
            handler = _HANDLERS.get(type(part))
            if handler is not None:
                handler(self, part)

    @_folds(PoolCreated)
    def _pool_created(self, ev: PoolCreated) -> None:
        if self.limits is not None:
            self.limits.admit(ev)
        key = (ev.pool, ev.tier)
        self.tables.pop(key, None)  # the old table's memory goes before the new one's is asked for
        t = self.tables[key] = new_map(SlotTable, ev, ev.pool, ev.tier, ev.capacity, ev.page_size)
        if self.limits is not None:  # a reader of a log: bounded time for any free (bad_runs)
            t.probe = new_map(AllocMap, ev, ev.capacity)

    @_folds(SlotsAllocated)
    def _slots_allocated(self, ev: SlotsAllocated) -> None:
        t = self.tables.get((ev.pool, ev.tier))
        if t is None:
            self.anomalies.append((ev.seq, "unknown_pool", f"{ev.pool}/{ev.tier}"))
            return
        ind = ev.indices
        if len(ind) == 1 and ind[0][1] <= FAST_CALL_SLOTS:  # the usual: bad_runs, inlined
            slots = t.apply_alloc(ind)
            if t.probe is not None:
                t.probe.apply_alloc(ind)
            if not slots:
                return
            bad = _runs_of(slots)
        else:
            bad = bad_runs(t, ALLOC, ind)
        if bad:
            self.anomalies.append((ev.seq, "double_alloc", f"{ev.pool}/{ev.tier} slots {first_slots(bad)}"))

    @_folds(SlotsFreed)
    def _slots_freed(self, ev: SlotsFreed) -> Runs:
        """Returns the slots that were not allocated, as runs (the auditor reports them)."""
        t = self.tables.get((ev.pool, ev.tier))
        if t is None:
            self.anomalies.append((ev.seq, "unknown_pool", f"{ev.pool}/{ev.tier}"))
            return ()
        ind = ev.indices
        if len(ind) == 1 and ind[0][1] <= FAST_CALL_SLOTS:  # the usual: bad_runs, inlined
            slots = t.apply_free(ind)
            if t.probe is not None:
                t.probe.apply_free(ind)
            if not slots:
                return ()
            bad = _runs_of(slots)
        else:
            bad = bad_runs(t, FREE, ind)
        if bad:
            self.anomalies.append((ev.seq, "double_free", f"{ev.pool}/{ev.tier} slots {first_slots(bad)}"))
        return bad

    def apply_freed(self, ev: SlotsFreed) -> Runs:
        """:meth:`apply` for a ``SlotsFreed``, returning the slots that were not allocated (runs)."""
        self.last_seq = ev.seq
        return self._slots_freed(ev)

    @_folds(AllocationFailed)
    def _allocation_failed(self, ev: AllocationFailed) -> None:
        self.allocation_failures += 1

    # the op events: the queues and acks (FIFO orders of op ids) here, the records in the lifecycles
    @_folds(OperationQueued)
    def _queued(self, ev: OperationQueued) -> None:
        self.queues[ev.direction].append(ev.op)
        self.lifecycles.apply(ev)

    @_folds(OperationsMerged)
    def _merged(self, ev: OperationsMerged) -> None:
        q = self.queues[ev.direction]
        for o in ev.merged_ops:
            q.discard(o)
        self.lifecycles.apply(ev)

    @_folds(TransferSubmitted)
    def _submitted(self, ev: TransferSubmitted) -> None:
        self.lifecycles.apply(ev)
        self.acks[ev.direction].append(ev.op)

    def _finished(self, ev: TransferCompleted | TransferFailed, ok: bool) -> None:
        acks = self.acks[ev.direction]
        if acks.first() == ev.op:
            acks.popleft()
        elif acks.remove_first(ev.op):
            self.anomalies.append((ev.seq, "ack_out_of_order", str(ev.op)))
        else:
            self.anomalies.append((ev.seq, "ack_unknown_op", str(ev.op)))
        self.lifecycles.apply(ev)
        if ok:
            self.completed[ev.direction] += 1
        else:
            self.failed[ev.direction] += 1

    @_folds(TransferCompleted)
    def _completed(self, ev: TransferCompleted) -> None:
        self._finished(ev, True)

    @_folds(TransferFailed)
    def _failed(self, ev: TransferFailed) -> None:
        self._finished(ev, False)

    # ---------------------------------------------------------------- views
    def snapshot(self) -> dict[str, Any]:
        """A plain, comparable picture of the whole bookkeeping."""
        return {
            "tables": {f"{p}/{t}": tab.snapshot() for (p, t), tab in sorted(self.tables.items())},
            "queues": {d: tuple(q) for d, q in self.queues.items()},
            "acks": {d: tuple(a) for d, a in self.acks.items()},
            "ops": {op: rec.snapshot() for (_, op), rec in sorted(self.lifecycles.records.items())},
            "completed": dict(self.completed),
            "failed": dict(self.failed),
            "allocation_failures": self.allocation_failures,
        }


def fold(events: Iterable[Event], limits: PoolLimits | None = None) -> CacheState:
    """Rebuild the bookkeeping from events (one rank, in ``seq`` order); with ``limits``
    its pools are held to them (:class:`PoolLimits`)."""
    state = CacheState(limits=limits)
    for ev in events:
        state.apply(ev)
    return state
