"""The runtime's reports of a controller's own calls, as events: ``StreamRecorded`` and
``IndicesMoved``.

A runtime tells its observers (``runtime.observers``) of every ``record_stream`` it
really made and every index tensor it copied. Several controllers may share a runtime,
so :class:`RuntimeReports` says beforehand which call is this controller's: the stream
record in progress (``expected``, set by :meth:`RuntimeReports.record_pair`) and the
index move in progress (the normaliser's ``expected``). A report of any other call is
not this controller's and emits nothing. A stream record reuses the description the
submission in progress made of the same tensor (``refs``), else describes it anew.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..events._log import EventLog
from ..events._schema import IndicesMoved, StreamRecorded, TensorRef
from ._describe import describe
from ._index_moves import Expected, IndexNormaliser
from ._runtime import Runtime

__all__ = ["RuntimeReports"]


class RuntimeReports:
    """One controller's stream records and index moves, from the runtime's reports.

    ``recorded`` and ``moved`` are the observer callbacks (``observers.add(record=, move=)``).
    ``refs``: (id(tensor), pool, role) -> the ``TensorRef`` the submission in progress
    described; valid only during that submission (keyed by ``id()``). ``values(op)``: whether
    that op's descriptions carry slot values (the controller's profile; default: always)."""

    __slots__ = ("runtime", "log", "moves", "values", "expected", "refs")

    def __init__(
        self, runtime: Runtime, log: EventLog, moves: IndexNormaliser, values: Callable[[int], bool] | None = None
    ) -> None:
        self.runtime = runtime
        self.log = log
        self.moves = moves
        self.values = values
        self.expected: Expected | None = None  # the stream record the runtime reports next
        self.refs: dict[tuple[int, str, str], TensorRef] = {}

    def record_pair(self, stream: Any, pool: str, host: torch.Tensor, device: torch.Tensor, op: int) -> None:
        """Record the pair's device tensors on ``stream`` (a CPU tensor needs no record)."""
        rt = self.runtime
        for role, t in (("host", host), ("device", device)):
            if rt.is_device(t):
                self.expected = Expected(op, pool, role, t)
                try:
                    rt.record_stream(t, stream)  # the runtime reports the record it made
                finally:
                    self.expected = None

    def recorded(self, tensor: torch.Tensor, stream: Any) -> None:
        """The runtime recorded ``tensor`` on ``stream``: a ``StreamRecorded`` if it is ours."""
        exp = self.expected
        if exp is None or exp.tensor is not tensor:
            return  # another controller's record, on a shared runtime
        op, pool, role, t = exp.op, exp.pool, exp.role, exp.tensor
        # the submission just described this tensor (the same pool and role)
        ref = self.refs.get((id(t), pool, role)) or describe(self.runtime, t, pool, role, self._runs(op))
        self.log.emit(
            StreamRecorded, op=op, pool=pool, role=role, stream=getattr(stream, "name", str(stream)), tensor=ref
        )

    def moved(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The runtime copied index tensor ``src`` to ``dst``: an ``IndicesMoved`` if it is ours
        (the one place index moves are emitted)."""
        exp = self.moves.expected
        if exp is None or exp.tensor is not src:
            return
        op, pool, role, known = exp.op, exp.pool, exp.role, exp.known
        self.log.emit(  # not folded by the bookkeeping: no need of the controller's immediate fold
            IndicesMoved,
            op=op,
            pool=pool,
            role=role,
            src_device=self.runtime.tensor_device(src),
            dst_device=self.runtime.tensor_device(dst),
            tensor=describe(self.runtime, dst, pool, role, known if known is not None else self._runs(op)),
        )

    def _runs(self, op: int) -> Any:
        """``describe``'s ``runs`` for ``op``: None (read them) where its reports carry values, else
        ``()`` (none)."""
        return None if self.values is None or self.values(op) else ()
