"""The controller of hybrid models: :class:`HybridCacheController`.

A hybrid model's requests move the anchor (KV) pool and, with it, its Mamba and/or SWA
pools as :class:`~hicache_obs.core._operations.PoolTransfer` sidecars. Everything but the
signatures of ``write``/``load`` and the op-level index move is the
:class:`~hicache_obs.core._controller.HiCacheController` it extends; it is importable from
``hicache_obs.core._controller`` and ``hicache_obs.core`` as well.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._controller import HiCacheController
from ._index_moves import move_op_indices
from ._operations import CacheOperation, PoolTransfer

__all__ = ["HybridCacheController"]


class HybridCacheController(HiCacheController):
    """Controller for hybrid models: KV (the anchor) plus Mamba and/or SWA pools.

    ``write``/``load`` take ``pool_transfers`` and return ``(indices, transfers)``
    where ``transfers`` are new :class:`PoolTransfer` objects with the allocated
    side filled in (the caller's are never changed). Allocation is atomic across
    pools; a load with empty anchor indices moves the pools only.
    """

    def write(  # type: ignore[override]
        self,
        device_indices: torch.Tensor,
        priority: int | None = None,
        node_id: int = -1,
        pool_transfers: Sequence[PoolTransfer] | None = None,
    ) -> tuple[torch.Tensor, tuple[PoolTransfer, ...] | None] | None:
        return self._write(device_indices, priority, node_id, pool_transfers)

    def load(  # type: ignore[override]
        self,
        host_indices: torch.Tensor,
        priority: int | None = None,
        node_id: int = -1,
        pool_transfers: Sequence[PoolTransfer] | None = None,
    ) -> tuple[torch.Tensor, tuple[PoolTransfer, ...] | None] | None:
        return self._load(host_indices, priority, node_id, pool_transfers)

    def move_hybrid_indices(self, op: CacheOperation) -> CacheOperation:
        """Move the anchor's and every pool transfer's indices; returns a new op with new transfers."""
        with self._lock:
            return move_op_indices(op, self.move_indices)

    def _move_op(self, op: CacheOperation) -> CacheOperation:
        return self.move_hybrid_indices(op)
