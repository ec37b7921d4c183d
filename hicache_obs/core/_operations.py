"""Cache operations: :class:`CacheOperation`, :class:`PoolTransfer` and :func:`merge_ops`.

Both classes are frozen. Moving or resolving indices returns new objects and
never mutates the caller's (SGLang #23429: a transfer mutated in place through the
alias that ``merge_ops`` returns for a single op crashed the radix tree).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError

__all__ = ["PoolTransfer", "CacheOperation", "merge_ops", "HIT_POLICIES"]

HIT_POLICIES = ("all_pages", "trailing_pages")
_class_ids = itertools.count()


@dataclass(frozen=True, eq=False)
class PoolTransfer:
    """The part of an operation that moves one sidecar pool (``mamba``, ``swa``, ...).

    ``host_indices``/``device_indices`` may be None before allocation resolves them;
    ``indices_from_pool`` names a pool whose indices this one reuses (then both
    sides stay None and are taken from that pool when the op is moved).
    """

    pool: str
    host_indices: torch.Tensor | None = None
    device_indices: torch.Tensor | None = None
    indices_from_pool: str | None = None
    hit_policy: str = "all_pages"
    keys: tuple[object, ...] | None = None

    def __post_init__(self) -> None:
        if self.hit_policy not in HIT_POLICIES:
            raise ConfigError(
                f"PoolTransfer for pool {self.pool!r}: hit_policy {self.hit_policy!r} is not one of {HIT_POLICIES}"
            )

    def with_indices(self, host: torch.Tensor | None, device: torch.Tensor | None) -> PoolTransfer:
        """A new transfer with these indices; this one is unchanged."""
        return dataclasses.replace(self, host_indices=host, device_indices=device)

    @property
    def name(self) -> str:  # SGLang calls it `name`
        return self.pool


@dataclass(frozen=True, eq=False)
class CacheOperation:
    """One queued write or load: anchor (KV) indices plus optional pool transfers."""

    host_indices: torch.Tensor
    device_indices: torch.Tensor
    node_ids: tuple[int, ...] = (-1,)
    priority: int | None = None
    id: int = dataclasses.field(default_factory=lambda: next(_class_ids))
    pool_transfers: tuple[PoolTransfer, ...] | None = None

    def __post_init__(self) -> None:
        if self.priority is None:
            object.__setattr__(self, "priority", self.id)
        if self.pool_transfers is not None and not isinstance(self.pool_transfers, tuple):
            object.__setattr__(self, "pool_transfers", tuple(self.pool_transfers))

    def replace(self, **changes: object) -> CacheOperation:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def merge_ops(ops: Sequence[CacheOperation], new_id: int | None = None) -> CacheOperation:
    """Merge queued ops into one.

    One op -> that same object (an alias). Several -> indices concatenated in queue
    order, node ids concatenated, priority the minimum, a new id, and pool transfers
    grouped by ``(pool, indices_from_pool)`` in first-seen order with their non-None
    indices concatenated.
    """
    if not ops:
        raise ConfigError("merge_ops needs at least one operation, got none")
    if len(ops) == 1:
        return ops[0]
    host = _cat([op.host_indices for op in ops])
    device = _cat([op.device_indices for op in ops])
    node_ids = tuple(n for op in ops for n in op.node_ids)
    priority = min(op.priority for op in ops if op.priority is not None)
    transfers: tuple[PoolTransfer, ...] | None = None
    if any(op.pool_transfers for op in ops):
        groups: dict[tuple[str, str | None], list[PoolTransfer]] = {}
        for op in ops:
            for t in op.pool_transfers or ():
                groups.setdefault((t.pool, t.indices_from_pool), []).append(t)
        merged: list[PoolTransfer] = []
        for ts in groups.values():
            hosts = [t.host_indices for t in ts if t.host_indices is not None]
            devs = [t.device_indices for t in ts if t.device_indices is not None]
            merged.append(
                ts[0].with_indices(_cat(hosts) if hosts else None, _cat(devs) if devs else None)
            )
        transfers = tuple(merged)
    kwargs: dict[str, object] = {}
    if new_id is not None:
        kwargs["id"] = new_id
    return CacheOperation(
        host_indices=host,
        device_indices=device,
        node_ids=node_ids,
        priority=priority,
        pool_transfers=transfers,
        **kwargs,  # type: ignore[arg-type]
    )
