"""The pure-Python slot tables the compiled ``hicache_obs._slots.SlotMap`` replaced,
kept as the oracle its differential tests compare against: verbatim but for two fixes
(marked "fix 1" and "fix 2") of pages taken out of order and freed, which the tests and
a review found in both implementations."""

from __future__ import annotations

from typing import Any

from hicache_obs.events._schema import Runs, runs_from_list


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
            # fix 2: a freed page at or above `fresh` taken again was left looking never-used
            if p == self.fresh:
                self.fresh += 1
                while self.holes and self.fresh in self.holes:
                    self.holes.remove(self.fresh)
                    self.fresh += 1
            elif p > self.fresh:
                self.holes.add(p)
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
            if p not in holes and p not in self.freed:  # fix 1: a page taken above `fresh`
                out.append(p)  # and freed again was listed twice (here and in `freed`)
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
