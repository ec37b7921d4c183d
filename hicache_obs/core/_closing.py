"""Closing a controller: every op it still holds is ended, none is left open in the log.

:func:`end_every_op` runs after the runtime's ``synchronize()``. Ops in flight are reaped
(completed, or failed); ops still queued, never started, are cancelled: each gets its
``OperationsMerged`` of itself, its ``TransferSubmitted`` without tensors and a
``TransferFailed`` whose error starts with ``ControllerClosedError``. So are ops merged
and never submitted, and ops submitted whose ack was never queued (an exception that
escaped a submission, a ``KeyboardInterrupt``). Every op that ends failed here has the
slots allocated for it freed (``reason="failed"``): no one can free them after close.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ControllerClosedError
from ..events._schema import OperationsMerged, TransferFailed
from ..events._state import CacheState
from ._acks import Ack, InFlightCopy, reap
from ._allocation import PoolAllocations
from ._operations import CacheOperation

__all__ = ["end_every_op"]


def end_every_op(
    state: CacheState,
    ops: dict[int, CacheOperation],
    acks: Mapping[str, deque[InFlightCopy]],
    streams: Mapping[str, Any],
    allocations: PoolAllocations,
    emit: Callable[..., Any],
    end_unlaunched: Callable[..., InFlightCopy],
) -> list[Ack]:
    """End every op of a closing controller, direction by direction in ``streams`` order
    (direction -> its side stream). ``state``: the controller's bookkeeping; ``ops``: its
    queued ops by id (each cancelled one is taken out); ``acks``: its copies in flight per direction; ``emit`` appends and
    folds an event; ``end_unlaunched``: :meth:`~.submission.Submissions.end_unlaunched`.
    Returns the acks of the ops it reaped."""

    def end_unstarted(op_id: int, stream: Any, why: str) -> None:
        s = state.ops[op_id]
        given = allocations.pop(op_id)
        ack = end_unlaunched(
            op_id, s.direction, s.node_ids, s.slots_by_pool, stream, -1, ControllerClosedError(why), given
        )
        acks[s.direction].append(ack)

    free_failed = allocations.free_failed
    out: list[Ack] = []
    for direction in streams:
        out += reap(acks[direction], emit, closing=True, free_failed=free_failed)
    for direction, stream in streams.items():
        for op_id in list(state.queues[direction]):
            op = ops.pop(op_id, None)
            emit(
                OperationsMerged,
                op=op_id,
                merged_ops=(op_id,),
                direction=direction,
                node_ids=tuple(op.node_ids) if op is not None else state.ops[op_id].node_ids,
            )
            end_unstarted(op_id, stream, "cancelled: the controller was closed before this op started")
        # merged and never submitted (an exception that escaped a submission)
        for op_id in [o for o, s in state.ops.items() if s.direction == direction and s.status == "merged"]:
            end_unstarted(op_id, stream, "the op was merged and never submitted; ended at close")
        out += reap(acks[direction], emit, closing=True, free_failed=free_failed)
        # submitted with no ack (an exception escaped between its TransferSubmitted and
        # its ack): whatever it launched ran before synchronize() returned
        for op_id in [o for o, s in state.ops.items() if s.direction == direction and s.status == "submitted"]:
            error = "ControllerClosedError: the op was submitted and its ack never queued; ended at close"
            emit(TransferFailed, op=op_id, direction=direction, error=error)
            free_failed(op_id, allocations.pop(op_id))
    return out
