"""How the exporters show an op record (:class:`~hicache_obs.events._lifecycle.OpRecord`).

The record's own ``status`` is its phase (``queued``, ``merged``, ``submitted``,
``completed``, ``failed``); what the exporters write (the ``status`` of a log line or a
trace slice) is :func:`export_status`.
"""

from __future__ import annotations

from hicache_obs.events._lifecycle import OpRecord

__all__ = ["export_status"]


def export_status(rec: OpRecord) -> str:
    """``completed``, ``failed``, ``in_flight`` (submitted, not finished) or ``queued`` (not submitted)."""
    if rec.completed:
        return "completed"
    if rec.failed:
        return "failed"
    return "in_flight" if rec.submit is not None else "queued"
