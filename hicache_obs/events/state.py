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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .._compiled import SlotMap  # a ConfigError here if it is not built
from .schema import (
    D2H,
    H2D,
    AllocationFailed,
    Event,
    OperationQueued,
    OperationsMerged,
    PoolCreated,
    SlotsAllocated,
    SlotsFreed,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
)

__all__ = ["AllocMap", "SlotTable", "OpState", "CacheState", "fold"]


class AllocMap(SlotMap):
    """Which slots of a pool are allocated, one byte each: what the auditor needs when
    it keeps no replay bookkeeping (no free-page order).

    ``apply_alloc(runs)`` / ``apply_free(runs)`` return the slots that already were in
    the state asked for, or are out of range; ``unallocated(runs)`` those not allocated.
    The map is compiled (``hicache_obs/_slots.c``).
    """

    __slots__ = ()

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, 1, False)


class SlotTable(SlotMap):
    """Allocation state of one pool on one tier, with the page-granular FIFO free list
    the allocator takes pages from: never-used pages in order, then freed pages in the
    order their last slot was freed. A page rejoins the list only when all its slots are
    free. Compiled (``hicache_obs/_slots.c``): every allocation and free passes here."""

    __slots__ = ("pool", "tier")

    def __init__(self, pool: str, tier: str, capacity: int, page_size: int) -> None:
        super().__init__(capacity, page_size, True)
        self.pool = pool
        self.tier = tier

    def snapshot(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "page_size": self.page_size,
            "used": self.used,
            "allocated": self.allocated_runs(),
            "free_order": tuple(self.free_order()),
        }


@dataclass
class OpState:
    op: int
    direction: str
    node_ids: tuple[int, ...]
    priority: int
    slots_by_pool: tuple[tuple[str, int], ...]
    status: str = "queued"  # queued -> merged -> submitted -> completed | failed
    queued_ns: int = 0
    submitted_ns: int = 0
    producer_id: int = -1

    def snapshot(self) -> tuple[Any, ...]:
        return (self.op, self.direction, self.node_ids, self.priority, self.slots_by_pool, self.status, self.producer_id)


@dataclass
class CacheState:
    """Bookkeeping of one controller (one rank); see the module docstring."""

    tables: dict[tuple[str, str], SlotTable] = field(default_factory=dict)
    queues: dict[str, list[int]] = field(default_factory=lambda: {D2H: [], H2D: []})
    acks: dict[str, deque[int]] = field(default_factory=lambda: {D2H: deque(), H2D: deque()})
    ops: dict[int, OpState] = field(default_factory=dict)
    completed: dict[str, int] = field(default_factory=lambda: {D2H: 0, H2D: 0})
    failed: dict[str, int] = field(default_factory=lambda: {D2H: 0, H2D: 0})
    allocation_failures: int = 0
    anomalies: list[tuple[int, str, str]] = field(default_factory=list)
    last_seq: int = -1

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
    def _pool_created(self, ev: PoolCreated) -> None:
        self.tables[(ev.pool, ev.tier)] = SlotTable(ev.pool, ev.tier, ev.capacity, ev.page_size)

    def _slots_allocated(self, ev: SlotsAllocated) -> None:
        t = self.tables.get((ev.pool, ev.tier))
        if t is None:
            self.anomalies.append((ev.seq, "unknown_pool", f"{ev.pool}/{ev.tier}"))
            return
        bad = t.apply_alloc(ev.indices)
        if bad:
            self.anomalies.append((ev.seq, "double_alloc", f"{ev.pool}/{ev.tier} slots {bad[:8]}"))

    def _slots_freed(self, ev: SlotsFreed) -> list[int]:
        """Returns the slots that were not allocated (the auditor reports them)."""
        t = self.tables.get((ev.pool, ev.tier))
        if t is None:
            self.anomalies.append((ev.seq, "unknown_pool", f"{ev.pool}/{ev.tier}"))
            return []
        bad = t.apply_free(ev.indices)
        if bad:
            self.anomalies.append((ev.seq, "double_free", f"{ev.pool}/{ev.tier} slots {bad[:8]}"))
        return bad

    def apply_freed(self, ev: SlotsFreed) -> list[int]:
        """:meth:`apply` for a ``SlotsFreed``, returning the slots that were not allocated."""
        self.last_seq = ev.seq
        return self._slots_freed(ev)

    def _allocation_failed(self, ev: AllocationFailed) -> None:
        self.allocation_failures += 1

    def _queued(self, ev: OperationQueued) -> None:
        self.queues[ev.direction].append(ev.op)
        self.ops[ev.op] = OpState(ev.op, ev.direction, (ev.node_id,), ev.priority, ev.slots_by_pool, queued_ns=ev.ts_ns)

    def _merged(self, ev: OperationsMerged) -> None:
        q = self.queues[ev.direction]
        merged = set(ev.merged_ops)
        self.queues[ev.direction] = [o for o in q if o not in merged]
        sources = [self.ops.get(o) for o in ev.merged_ops]
        if len(ev.merged_ops) == 1 and ev.merged_ops[0] == ev.op and sources[0] is not None:
            sources[0].status = "merged"
            return
        slots: dict[str, int] = {}
        node_ids: list[int] = []
        prio = None
        queued_ns = 0
        for o in ev.merged_ops:
            s = self.ops.pop(o, None)
            if s is None:
                self.anomalies.append((ev.seq, "merge_unknown_op", str(o)))
                continue
            node_ids.extend(s.node_ids)
            for pool, n in s.slots_by_pool:
                slots[pool] = slots.get(pool, 0) + n
            prio = s.priority if prio is None else min(prio, s.priority)
            queued_ns = s.queued_ns if not queued_ns else min(queued_ns, s.queued_ns)
        self.ops[ev.op] = OpState(
            ev.op,
            ev.direction,
            tuple(ev.node_ids) if ev.node_ids else tuple(node_ids),
            prio if prio is not None else ev.op,
            tuple(slots.items()),
            status="merged",
            queued_ns=queued_ns,
        )

    def _submitted(self, ev: TransferSubmitted) -> None:
        s = self.ops.get(ev.op)
        if s is None:
            s = self.ops[ev.op] = OpState(ev.op, ev.direction, (), ev.op, ev.slots_by_pool)
        s.status = "submitted"
        s.submitted_ns = ev.ts_ns
        s.producer_id = ev.producer_id
        self.acks[ev.direction].append(ev.op)

    def _finished(self, ev: TransferCompleted | TransferFailed, ok: bool) -> None:
        acks = self.acks[ev.direction]
        if acks and acks[0] == ev.op:
            acks.popleft()
        elif ev.op in acks:
            self.anomalies.append((ev.seq, "ack_out_of_order", str(ev.op)))
            acks.remove(ev.op)
        else:
            self.anomalies.append((ev.seq, "ack_unknown_op", str(ev.op)))
        self.ops.pop(ev.op, None)
        if ok:
            self.completed[ev.direction] += 1
        else:
            self.failed[ev.direction] += 1

    def _completed(self, ev: TransferCompleted) -> None:
        self._finished(ev, True)

    def _failed(self, ev: TransferFailed) -> None:
        self._finished(ev, False)

    # ---------------------------------------------------------------- views
    def snapshot(self) -> dict[str, Any]:
        """A plain, comparable picture of the whole bookkeeping."""
        return {
            "tables": {f"{p}/{t}": tab.snapshot() for (p, t), tab in sorted(self.tables.items())},
            "queues": {d: tuple(q) for d, q in self.queues.items()},
            "acks": {d: tuple(a) for d, a in self.acks.items()},
            "ops": {o: s.snapshot() for o, s in sorted(self.ops.items())},
            "completed": dict(self.completed),
            "failed": dict(self.failed),
            "allocation_failures": self.allocation_failures,
        }


_HANDLERS: dict[type, Any] = {
    PoolCreated: CacheState._pool_created,
    SlotsAllocated: CacheState._slots_allocated,
    SlotsFreed: CacheState._slots_freed,
    AllocationFailed: CacheState._allocation_failed,
    OperationQueued: CacheState._queued,
    OperationsMerged: CacheState._merged,
    TransferSubmitted: CacheState._submitted,
    TransferCompleted: CacheState._completed,
    TransferFailed: CacheState._failed,
}


def fold(events: Iterable[Event]) -> CacheState:
    """Rebuild the bookkeeping from events (one rank, in ``seq`` order)."""
    state = CacheState()
    for ev in events:
        state.apply(ev)
    return state

