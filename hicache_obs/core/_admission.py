"""Admission: a write or load request checked, the other side's slots taken, its op made.

:meth:`Admission.admit` checks a request (its priority and node id, its pool transfers,
each index tensor it hands over), takes the slots of the other side in the anchor's pool
and in every transfer's at once (:class:`~hicache_obs.core._allocation.PoolAllocations`:
none taken when one pool is short) and makes the op to queue, with the new slots in new
pool transfers (the caller's are never changed). A failure once the slots are taken
gives them back (``reason="rollback"``) and raises: nothing is queued. The controller
calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import InvalidIndicesError
from ..events._schema import D2H
from ._allocation import PoolAllocations, resolve_aliases, resolve_allocated
from ._operations import CacheOperation, PoolTransfer
from ._runtime import Runtime
from ._spec import ANCHOR, ModelSpec
from ._validation import check_request, check_transfers

__all__ = ["Admission"]


class Admission:
    """Admits one controller's writes and loads. ``validate(t, arg=, pool=, tier=,
    allow_empty=)`` is the controller's index-tensor check, ``pool(name, tier)`` its pool
    lookup (an ``UnknownPoolError`` for a pool the model lacks), ``new_id()`` its op ids."""

    __slots__ = ("spec", "runtime", "allocations", "validate", "pool", "new_id")

    def __init__(
        self,
        spec: ModelSpec,
        runtime: Runtime,
        allocations: PoolAllocations,
        validate: Callable[..., object],
        pool: Callable[[str, str], Any],
        new_id: Callable[[], int],
    ) -> None:
        self.spec = spec
        self.runtime = runtime
        self.allocations = allocations
        self.validate = validate
        self.pool = pool
        self.new_id = new_id

    def admit(
        self,
        direction: str,
        given: torch.Tensor,
        priority: int | None,
        node_id: int,
        pool_transfers: Sequence[PoolTransfer] | None,
    ) -> CacheOperation | None:
        """The op of a write (``given``: its device indices) or a load (``given``: its host
        indices), the other side allocated in every pool; None when a pool is short."""
        have, need = ("device", "host") if direction == D2H else ("host", "device")
        arg, other = f"{have}_indices", f"{need}_indices"
        check_request(priority, node_id)
        transfers = check_transfers(pool_transfers, direction, self.spec, self.pool)
        validate = self.validate
        validate(given, arg=arg, pool=ANCHOR, tier=have, allow_empty=bool(transfers))
        reqs = [(ANCHOR, need, given.numel())]
        for t in transfers or ():
            if t.indices_from_pool is not None:
                continue
            mine = getattr(t, arg)
            validate(mine, arg=arg, pool=t.pool, tier=have)
            if getattr(t, other) is not None:
                raise InvalidIndicesError(
                    f"pool transfer {t.pool!r}: {other} must be None for a "
                    f"{'write' if direction == D2H else 'load'} (the controller allocates them)"
                )
            reqs.append((t.pool, need, mine.numel()))
        op_id = self.new_id()
        allocated = self.allocations.take(reqs, op_id)
        if allocated is None:
            return None
        try:
            if direction == D2H:
                host, device = allocated[0], given
                resolved = resolve_aliases(host, device, resolve_allocated(transfers, allocated[1:], "host"))
            else:  # a runtime that fails to move the new slots' indices: nothing stays allocated
                to_dev = self.runtime.to_device
                host, device = given, to_dev(allocated[0])
                moved = [to_dev(t) for t in allocated[1:]]
                resolved = resolve_aliases(host, device, resolve_allocated(transfers, moved, "device"))
            return CacheOperation(
                host_indices=host,
                device_indices=device,
                node_ids=(node_id,),
                priority=priority,
                id=op_id,
                pool_transfers=resolved,
            )
        except BaseException:
            self.allocations.roll_back(op_id)
            raise
