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

from .schema import (
    D2H,
    H2D,
    AllocationFailed,
    Event,
    OperationQueued,
    OperationsMerged,
    PoolCreated,
    Runs,
    SlotsAllocated,
    SlotsFreed,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
    runs_from_list,
)

__all__ = ["AllocMap", "SlotTable", "OpState", "CacheState", "fold"]


def _invalid_sample(start: int, length: int) -> list[int]:
    """A few slots of a run that lies (partly) outside the table, never the whole run."""
    return [start + i for i in range(max(1, min(length, 8)))]


class _FreeList:
    """FIFO free list of pages that costs nothing for pages never used.

    The order is: the never-allocated pages from ``fresh`` upwards (minus ``holes``,
    fresh pages taken out of order), then the freed pages in the order they were freed.
    """

    __slots__ = ("fresh", "npages", "holes", "freed", "n", "freed_high")

    def __init__(self, npages: int) -> None:
        self.fresh = 0
        self.npages = npages
        self.holes: set[int] = set()
        self.freed: dict[int, None] = {}
        self.n = npages
        self.freed_high = False  # a page at or above `fresh` was freed (out-of-order use)

    def take(self, p: int) -> None:
        """Page ``p`` was allocated: it leaves the free list (no-op if it was not on it)."""
        freed = self.freed
        if p in freed:
            del freed[p]
            self.n -= 1
        elif p == self.fresh:
            self.n -= 1
            self.fresh += 1
            holes = self.holes
            while holes and self.fresh in holes:
                holes.remove(self.fresh)
                self.fresh += 1
        elif self.fresh < p < self.npages and p not in self.holes:
            self.holes.add(p)
            self.n -= 1

    def take_range(self, p0: int, p1: int) -> None:
        """Pages ``p0..p1-1`` were allocated (they were all free)."""
        if p0 == self.fresh and not self.holes and not self.freed_high:
            self.fresh = p1
            self.n -= p1 - p0
            return
        for p in range(p0, p1):
            self.take(p)

    def push_range(self, p0: int, p1: int) -> None:
        """Pages ``p0..p1-1`` became free (they were all allocated)."""
        if self.holes or p1 > self.fresh:
            for p in range(p0, p1):
                self.push(p)
            return
        self.freed.update(dict.fromkeys(range(p0, p1)))
        self.n += p1 - p0

    def push(self, p: int) -> None:
        """Page ``p`` became free: it joins the back of the list."""
        if p in self.freed or (p >= self.fresh and p not in self.holes):
            return  # already free
        if p >= self.fresh:
            self.freed_high = True
        self.holes.discard(p)
        self.freed[p] = None
        self.n += 1

    def first(self, k: int) -> list[int]:
        out: list[int] = []
        p = self.fresh
        holes = self.holes
        while len(out) < k and p < self.npages:
            if p not in holes:
                out.append(p)
            p += 1
        if len(out) < k:
            for q in self.freed:
                out.append(q)
                if len(out) == k:
                    break
        return out


class AllocMap:
    """Which slots of a pool are allocated, one byte each: what the auditor needs when
    it keeps no replay bookkeeping (no free-page order, no counts)."""

    __slots__ = ("capacity", "_alloc")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._alloc = bytearray(capacity)

    def unallocated(self, runs: Runs) -> list[int]:
        """Slots among ``runs`` that are out of range or not allocated."""
        bad: list[int] = []
        a = self._alloc
        cap = self.capacity
        for start, length in runs:
            if start < 0 or length <= 0 or start + length > cap:
                bad.extend(_invalid_sample(start, length))
            elif a.find(0, start, start + length) != -1:
                bad.extend(s for s in range(start, start + length) if not a[s])
        return bad

    def apply_alloc(self, runs: Runs) -> list[int]:
        """Mark slots allocated; returns those that already were (or are out of range)."""
        return self._set(runs, 1)

    def apply_free(self, runs: Runs) -> list[int]:
        """Mark slots free; returns those that were not allocated (or are out of range)."""
        return self._set(runs, 0)

    def _set(self, runs: Runs, to: int) -> list[int]:
        bad: list[int] = []
        a = self._alloc
        cap = self.capacity
        fill = b"\x01" if to else b"\x00"
        for start, length in runs:
            end = start + length
            if start < 0 or end > cap or length <= 0:
                bad.extend(_invalid_sample(start, length))
            elif a.find(to, start, end) == -1:  # the normal case: no slot is already `to`
                a[start:end] = fill * length
            else:
                for s in range(start, end):
                    if a[s] == to:
                        bad.append(s)
                    a[s] = to
        return bad


class SlotTable(AllocMap):
    """Allocation state of one pool on one tier, page-granular FIFO free list."""

    __slots__ = ("pool", "tier", "page_size", "used", "_free_pages", "_page_used")

    def __init__(self, pool: str, tier: str, capacity: int, page_size: int) -> None:
        super().__init__(capacity)
        self.pool = pool
        self.tier = tier
        self.page_size = page_size
        self.used = 0
        npages = capacity // page_size
        self._free_pages = _FreeList(npages)
        self._page_used = bytearray(npages) if page_size > 1 else None

    @property
    def available(self) -> int:
        return self._free_pages.n * self.page_size

    def peek(self, n_pages: int) -> list[int]:
        """The pages the next allocation of ``n_pages`` would take (FIFO order)."""
        if n_pages > self._free_pages.n:
            raise ValueError(f"peek of {n_pages} pages with {self._free_pages.n} free")
        return self._free_pages.first(n_pages)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.capacity and self._alloc[slot] == 1

    def apply_alloc(self, runs: Runs) -> list[int]:
        """Mark slots allocated; returns slots that were already allocated (anomalies)."""
        bad: list[int] = []
        a = self._alloc
        ps = self.page_size
        fp = self._free_pages
        pu = self._page_used
        cap = self.capacity
        added = 0
        for start, length in runs:
            end = start + length
            if start < 0 or end > cap or length <= 0:
                bad.extend(_invalid_sample(start, length))
                continue
            if a.find(1, start, end) == -1:  # the normal case: every slot was free
                a[start:end] = b"\x01" * length
                added += length
                if pu is None:
                    fp.take_range(start, end)
                elif start % ps == 0 and length % ps == 0:  # whole pages
                    p0, p1 = start // ps, end // ps
                    pu[p0:p1] = bytes((ps,)) * (p1 - p0)
                    fp.take_range(p0, p1)
                else:
                    for s in range(start, end):
                        p = s // ps
                        pu[p] += 1
                        fp.take(p)
                continue
            for s in range(start, end):  # some slots already allocated: slot by slot
                if a[s]:
                    bad.append(s)
                    continue
                a[s] = 1
                added += 1
                if pu is None:
                    fp.take(s)
                else:
                    p = s // ps
                    pu[p] += 1
                    fp.take(p)
        self.used += added
        return bad

    def apply_free(self, runs: Runs) -> list[int]:
        """Mark slots free; pages whose slots are all free rejoin the back of the free list.

        Returns slots that were not allocated (double frees / out of range).
        """
        bad: list[int] = []
        a = self._alloc
        ps = self.page_size
        fp = self._free_pages
        pu = self._page_used
        cap = self.capacity
        freed = 0
        for start, length in runs:
            end = start + length
            if 0 <= start and end <= cap and length > 0 and a.find(0, start, end) == -1:
                # the normal case: every slot was allocated
                a[start:end] = bytes(length)
                freed += length
                if pu is None:
                    fp.push_range(start, end)
                    continue
                if start % ps == 0 and length % ps == 0:  # whole pages
                    p0, p1 = start // ps, end // ps
                    pu[p0:p1] = bytes(p1 - p0)
                    fp.push_range(p0, p1)
                    continue
                for s in range(start, end):
                    p = s // ps
                    pu[p] -= 1
                    if pu[p] == 0:
                        fp.push(p)
                continue
            if start < 0 or end > cap or length <= 0:
                bad.extend(_invalid_sample(start, length))
                continue
            for s in range(start, end):
                if not a[s]:
                    bad.append(s)
                    continue
                a[s] = 0
                freed += 1
                if pu is None:
                    fp.push(s)
                else:
                    p = s // ps
                    pu[p] -= 1
                    if pu[p] == 0:
                        fp.push(p)
        self.used -= freed
        return bad

    def snapshot(self) -> dict[str, Any]:
        allocated = [i for i, v in enumerate(self._alloc) if v]
        return {
            "capacity": self.capacity,
            "page_size": self.page_size,
            "used": self.used,
            "allocated": runs_from_list(allocated),
            "free_order": tuple(self._free_pages.first(self._free_pages.n)),
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

