"""Multi-pool allocation: the slots a controller takes for an op, in every pool at once.

:class:`PoolAllocations` takes the other side of a write (host slots) or a load (device
slots) in the anchor and every pool transfer's pool, all or nothing: a pool that is short
rolls back what the others gave (``SlotsFreed(reason="rollback")``). It keeps what each op
was given until the op's ack holds it, so that an op that fails, or that ``close()`` ends,
has its slots handed back (``reason="failed"``). :func:`resolve_allocated` puts the new
slots into the caller's transfers (as new transfers), :func:`resolve_aliases` gives a
transfer that reuses another pool's indices those indices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..events._schema import runs_from_list
from ._acks import Given
from ._operations import PoolTransfer
from ._pools import SlotAllocator
from ._spec import ANCHOR

__all__ = ["PoolAllocations", "Request", "resolve_aliases", "resolve_allocated"]

#: (pool, tier, slots wanted)
Request = tuple[str, str, int]


class PoolAllocations:
    """Allocation across pools for one controller; ``allocator(pool, tier)`` is a pool's
    slot allocator. Callers hold the controller's lock."""

    __slots__ = ("_allocator", "_given")

    def __init__(self, allocator: Callable[[str, str], SlotAllocator]) -> None:
        self._allocator = allocator
        #: op id -> the slots allocated for it, until its ack holds them (or close frees them)
        self._given: dict[int, Given] = {}

    def take(self, requests: Sequence[Request], op: int) -> list[torch.Tensor] | None:
        """Allocate every request for ``op``, in order; on any shortage roll back what was
        taken and return None. The slots are kept as ``op``'s until :meth:`pop`."""
        got: list[tuple[SlotAllocator, torch.Tensor]] = []
        for pool, tier, n in requests:
            a = self._allocator(pool, tier)
            t = a.alloc(n, op=op)
            if t is None:
                for a2, t2 in reversed(got):
                    a2.free(t2.tolist(), reason="rollback", op=op)
                return None
            got.append((a, t))
        self._given[op] = tuple((pool, tier, t) for (pool, tier, _), (_, t) in zip(requests, got))
        return [t for _, t in got]

    def roll_back(self, op: int) -> None:
        """Give back what :meth:`take` allocated for an op that was never queued."""
        for pool, tier, t in self._given.pop(op, ()):
            if t.numel():
                self._allocator(pool, tier).free(t.tolist(), reason="rollback", op=op)

    def given(self, op: int) -> Given:
        """What ``op`` was given (``()`` once an ack holds it, or for none)."""
        return self._given.get(op, ())

    def pop(self, op: int) -> Given:
        """Stop keeping ``op``'s slots (its ack holds them now, or they are freed); what it had."""
        return self._given.pop(op, ())

    def merge(self, merged: int, ops: Sequence[int]) -> None:
        """``ops`` were merged into ``merged``: their slots are its slots."""
        self._given[merged] = tuple(g for i in ops for g in self._given.pop(i, ()))

    def free_failed(self, op: int, given: Given) -> None:
        """Free the slots allocated for a failed op (``reason="failed"``), those still allocated."""
        for pool, tier, t in given:
            values = t.tolist()
            if not values:
                continue
            a = self._allocator(pool, tier)
            gone = set(a.table.unallocated(runs_from_list(values)))
            keep = [v for v in values if v not in gone] if gone else values
            if keep:
                a.free(keep, reason="failed", op=op)

    def clear(self) -> None:
        """Forget every op's slots (the controller is closed)."""
        self._given.clear()


def resolve_allocated(
    transfers: tuple[PoolTransfer, ...] | None, allocated: Sequence[torch.Tensor], side: str
) -> tuple[PoolTransfer, ...] | None:
    """New transfers with the slots just ``allocated`` (one per transfer with indices of its
    own, in order) as their ``side`` (``"host"`` or ``"device"``) indices."""
    if transfers is None:
        return None
    it = iter(allocated)
    out = []
    for t in transfers:
        if t.indices_from_pool is not None:
            out.append(t)
        elif side == "host":
            out.append(t.with_indices(next(it), t.device_indices))
        else:
            out.append(t.with_indices(t.host_indices, next(it)))
    return tuple(out)


def resolve_aliases(
    host: torch.Tensor, device: torch.Tensor, transfers: tuple[PoolTransfer, ...] | None
) -> tuple[PoolTransfer, ...] | None:
    """Give each transfer that reuses another pool's indices those indices now, per op:
    merged ops then concatenate exactly what each op asked for (an alias resolved only
    after merging would also move the pool for ops that never asked for it)."""
    if not transfers or all(t.indices_from_pool is None for t in transfers):
        return transfers
    sides = {ANCHOR: (host, device)}
    sides.update({t.pool: (t.host_indices, t.device_indices) for t in transfers if t.indices_from_pool is None})  # type: ignore[misc]
    return tuple(
        t if t.indices_from_pool is None else t.with_indices(*sides[t.indices_from_pool])  # type: ignore[arg-type]
        for t in transfers
    )
