"""How the exporters show an op record (:class:`~hicache_obs.events.lifecycle.OpRecord`).

The record's own ``status`` is its phase (``queued``, ``merged``, ``submitted``,
``completed``, ``failed``); what the exporters write (the ``status`` of a log line or a
trace slice) is :func:`export_status`.

:class:`Settling` is how the live span and log sinks read the lifecycle while the auditor's
violations of an op arrive after its completion.
"""

from __future__ import annotations

from collections.abc import Mapping

from hicache_obs.events.lifecycle import Applied, OpKey, OpLifecycles, OpRecord, Step
from hicache_obs.events.schema import AuditViolation, Event

__all__ = ["export_status", "Settling"]


def export_status(rec: OpRecord) -> str:
    """``completed``, ``failed``, ``in_flight`` (submitted, not finished) or ``queued`` (not submitted)."""
    if rec.completed:
        return "completed"
    if rec.failed:
        return "failed"
    return "in_flight" if rec.submit is not None else "queued"


class Settling:
    """A sink's live :class:`~hicache_obs.events.lifecycle.OpLifecycles`, holding each finished
    op back until nothing more can be said about it.

    The live auditor appends an op's ``AuditViolation``\\ s right *after* the completion
    that revealed them, so a finished op is *settled* only when the next event of its rank
    arrives that is not a violation of it, or at :meth:`settle_all` (flush/close). A sink
    batch may end between a completion and its violations; settling by the next event makes
    a span or a log line independent of batch boundaries.
    """

    __slots__ = ("ops", "_pending")

    def __init__(self, *, detail: bool = True) -> None:
        self.ops = OpLifecycles(detail=detail)
        self._pending: dict[int, dict[OpKey, OpRecord]] = {}  # rank -> finished, not settled yet

    @property
    def pending(self) -> Mapping[int, Mapping[OpKey, OpRecord]]:
        """Per rank, the finished ops not settled yet (read, never change it).

        While it is empty an event that touches no op (an allocation) settles nothing either,
        so a sink may skip such an event (:data:`~hicache_obs.events.lifecycle.NOT_OP_EVENTS`)
        without calling :meth:`apply`.
        """
        return self._pending

    def apply(self, ev: Event) -> tuple[Applied | None, list[OpRecord]]:
        """Fold one event: (what :meth:`OpLifecycles.apply` says, the records it settled).

        A violation of an op not settled yet goes to that op's record: ``(Step.VIOLATION, rec)``.
        """
        settled: list[OpRecord] = []
        pending = self._pending.get(ev.rank)
        if pending:
            if type(ev) is AuditViolation:
                rec = pending.get((ev.rank, ev.op))
                if rec is not None:
                    rec.violations.append(ev)
                    return (Step.VIOLATION, rec), settled
            settled = list(pending.values())
            del self._pending[ev.rank]
        got = self.ops.apply(ev)
        if got is not None and got[0] is Step.FINISHED:
            rec = got[1]
            assert rec is not None
            self._pending.setdefault(ev.rank, {})[rec.key] = rec
        return got, settled

    def settle_all(self) -> list[OpRecord]:
        """Settle every finished op (flush/close: no violation can be on its way)."""
        out = [rec for pending in self._pending.values() for rec in pending.values()]
        self._pending.clear()
        return out

    def unfinished(self) -> list[OpRecord]:
        """Ops merged or submitted that never completed or failed."""
        return self.ops.unfinished()
