"""Index normalisation: an op's index tensors made ready for the io backend's copies.

``kernel``: host indices are copied to the device (non-blocking). ``direct`` +
``layer_first``: device indices to the CPU; host indices sorted and device indices
permuted alike (pairs stay together). ``direct`` + ``page_first``/``page_first_direct``:
device indices to the CPU.

:class:`IndexNormaliser` normalises one pool's pair; :func:`move_op_indices` every pair of
an op (the anchor's and each pool transfer's), through the controller's ``move_indices``.
Nothing here emits: the normaliser says which copy it is making (``expected``) and the
runtime reports the copy it made to the controller's observer
(:class:`~hicache_obs.core._reports.RuntimeReports`), which then emits ``IndicesMoved``
(an event only because a copy really received the moved tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._native import runs_of
from ..errors import LengthMismatchError, UnknownBackendError, UnknownLayoutError, UnresolvedTransferError
from ._operations import CacheOperation, PoolTransfer
from ._runtime import Runtime
from ._spec import ANCHOR

__all__ = ["Expected", "IndexNormaliser", "move_op_indices"]

#: ``move(host, device, op=, pool=) -> (host, device)``: a controller's ``move_indices``
MovePair = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class Expected:
    """The runtime call the controller is making for one of its index tensors: the record
    or move the runtime then reports is this op's (``known``: the values' runs, read before)."""

    op: int
    pool: str
    role: str
    tensor: torch.Tensor
    known: Any = None


class IndexNormaliser:
    """Normalises index pairs for one controller's io backend and host layout.

    ``read_runs``: read the runs of host indices before they move to the device (for the
    ``IndicesMoved`` report; off when the controller reports no index moves); ``values(op)``:
    whether that op's reports carry slot values (its profile), when ``read_runs``.
    ``expected`` is the move in progress, for the runtime's report of it; None between moves.
    """

    __slots__ = ("runtime", "io_backend", "layout", "read_runs", "values", "expected")

    def __init__(
        self,
        runtime: Runtime,
        io_backend: str,
        layout: str,
        *,
        read_runs: bool,
        values: Callable[[int], bool] | None = None,
    ) -> None:
        self.runtime = runtime
        self.io_backend = io_backend
        self.layout = layout
        self.read_runs = read_runs
        self.values = values
        self.expected: Expected | None = None

    def normalise(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, op: int, pool: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pair ready for the copies (new tensors where anything moved or was sorted)."""
        rt = self.runtime
        if host_indices.numel() != device_indices.numel():
            raise LengthMismatchError(
                f"pool {pool!r}: host indices have {host_indices.numel()} entries, "
                f"device indices {device_indices.numel()}"
            )
        if self.io_backend == "kernel":
            if rt.has_device and not rt.is_device(host_indices):
                read = self.read_runs and (self.values is None or self.values(op))
                known = runs_of(host_indices.numpy()) if read else None
                host_indices = self._move(host_indices, op, pool, "host", known, to_device=True)
            return host_indices, device_indices
        if self.io_backend == "direct":
            if rt.is_device(device_indices):
                device_indices = self._move(device_indices, op, pool, "device", None, to_device=False)
            if self.layout == "layer_first":
                order = torch.argsort(host_indices, stable=True)
                host_indices = host_indices[order]
                device_indices = device_indices[order]
            elif self.layout not in ("page_first", "page_first_direct"):
                raise UnknownLayoutError(f"io backend 'direct' does not support host layout {self.layout!r}")
            return host_indices, device_indices
        raise UnknownBackendError(f"unknown io backend {self.io_backend!r}")

    def _move(self, t: torch.Tensor, op: int, pool: str, role: str, known: Any, *, to_device: bool) -> torch.Tensor:
        """Copy an index tensor to the device (non-blocking) or to the host; the runtime
        reports the copy. ``known``: the values' runs, read before."""
        rt = self.runtime
        self.expected = Expected(op, pool, role, t, known)
        try:
            return rt.to_device(t, non_blocking=True) if to_device else rt.to_host(t)
        finally:
            self.expected = None


def _reuses_unresolved(t: PoolTransfer) -> bool:
    """A transfer that reuses another pool's indices and has none of its own yet."""
    return t.indices_from_pool is not None and t.host_indices is None and t.device_indices is None


def move_op_indices(op: CacheOperation, move: MovePair) -> CacheOperation:
    """Move the anchor's and every pool transfer's indices with ``move``; a new op with new
    transfers (a transfer that reuses another pool's indices gets that pool's moved ones).

    Every transfer is checked before anything moves: a half-moved op would leave
    ``IndicesMoved`` events and moved copies behind for an op that never runs."""
    transfers = op.pool_transfers or ()
    owners = {ANCHOR} | {t.pool for t in transfers if t.indices_from_pool is None}
    for t in transfers:
        if _reuses_unresolved(t):
            if t.indices_from_pool not in owners:
                raise UnresolvedTransferError(
                    f"pool transfer {t.pool!r} of op {op.id} reuses pool {t.indices_from_pool!r}, which the op lacks"
                )
            continue
        if t.host_indices is None or t.device_indices is None:
            raise UnresolvedTransferError(
                f"pool transfer {t.pool!r} of op {op.id}: "
                f"{'host' if t.host_indices is None else 'device'}_indices is None at move time"
            )
        if t.host_indices.numel() != t.device_indices.numel():
            raise LengthMismatchError(
                f"pool {t.pool!r}: host indices have {t.host_indices.numel()} entries, "
                f"device indices {t.device_indices.numel()}"
            )
    host, device = move(op.host_indices, op.device_indices, op=op.id)
    if op.pool_transfers is None:
        return op.replace(host_indices=host, device_indices=device)
    moved: dict[str, tuple[torch.Tensor, torch.Tensor]] = {ANCHOR: (host, device)}
    out: list[PoolTransfer] = []
    deferred: list[PoolTransfer] = []
    for t in transfers:
        if _reuses_unresolved(t):
            deferred.append(t)
            continue
        assert t.host_indices is not None and t.device_indices is not None  # checked above
        h, d = move(t.host_indices, t.device_indices, op=op.id, pool=t.pool)
        moved[t.pool] = (h, d)
        out.append(t.with_indices(h, d))
    for t in deferred:
        out.append(t.with_indices(*moved[t.indices_from_pool]))  # type: ignore[index]
    return op.replace(host_indices=host, device_indices=device, pool_transfers=tuple(out))
