"""The Prometheus alert rules of ``alerts.yml`` as a table: one :class:`Alert` per rule.

Expressions name metrics from :mod:`hicache_obs.exporters.metric_names`; the
annotations use Prometheus' templating (``{{ $labels.pool }}``, ``{{ $value }}``).
``promtool test rules dashboards/alerts_test.yml`` tests every rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache_obs.exporters import metric_names as m

__all__ = ["Alert", "ALERTS", "GROUP", "build_alert_rules"]

#: The rule group every alert is in.
GROUP = "hicache"


@dataclass(frozen=True)
class Alert:
    """One alerting rule: fires when ``expr`` has held for ``for_``."""

    name: str
    expr: str
    for_: str
    severity: str  # critical or warning
    summary: str
    description: str

    def rule(self) -> dict[str, Any]:
        """The rule as it is written in the rule file."""
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description},
        }


_WHERE = "{{ $labels.job }}/{{ $labels.instance }}"
_ENDED = f'{m.OPERATIONS_TOTAL}{{status=~"completed|failed"}}'

ALERTS = (
    Alert(
        "HiCacheUnrecordedIndices",
        f"increase({m.UNRECORDED_INDICES_TOTAL}[5m]) > 0",
        "0m", "critical",
        "Unrecorded {{ $labels.pool }} {{ $labels.role }} index tensors ({{ $labels.direction }})",
        "{{ $value | humanize }} {{ $labels.pool }} {{ $labels.role }} index tensor(s) of "
        "{{ $labels.direction }} transfers on " + _WHERE + " were used on a transfer stream without "
        "record_stream on it in the last 5 minutes: the caching allocator can reuse their memory while "
        "the copy runs (the bug fixed by SGLang PR #22940).",
    ),
    Alert(
        "HiCacheAuditViolation",
        f"increase({m.AUDIT_VIOLATIONS_TOTAL}[5m]) > 0",
        "0m", "critical",
        "Audit violation {{ $labels.rule }} in pool {{ $labels.pool }}",
        "The event-log auditor on " + _WHERE + " reported {{ $value | humanize }} "
        "{{ $labels.rule }} violation(s) in pool {{ $labels.pool }} in the last 5 minutes. "
        "Run `hicache-obs audit` on the event log for the operations involved.",
    ),
    Alert(
        "HiCacheEventsDropped",
        f"increase({m.EVENTS_DROPPED_TOTAL}[5m]) > 0",
        "0m", "warning",
        "Sink {{ $labels.sink }} dropped events",
        "Sink {{ $labels.sink }} on " + _WHERE + " lost {{ $value | humanize }} event(s) "
        "in the last 5 minutes (queue full or the sink raised): its metrics, spans or logs are incomplete.",
    ),
    Alert(
        "HiCacheExporterErrors",
        f"increase({m.EXPORTER_ERRORS_TOTAL}[5m]) > 0",
        "0m", "warning",
        "Sink {{ $labels.sink }} raised errors",
        "Sink {{ $labels.sink }} on " + _WHERE + " raised {{ $value | humanize }} "
        "exception(s) in the last 5 minutes; the controller carried on, see the process log.",
    ),
    Alert(
        "HiCacheTransfersStuck",
        f"min_over_time({m.TRANSFERS_IN_FLIGHT}[5m]) > 0\n"
        "and on (job, instance, direction)\n"
        f"sum by (job, instance, direction) (increase({_ENDED}[5m])) == 0",
        "1m", "critical",
        "{{ $labels.direction }} transfers stuck in flight",
        "{{ $value | humanize }} {{ $labels.direction }} transfer(s) on " + _WHERE + " have "
        "been in flight for 5 minutes while no {{ $labels.direction }} operation completed or failed.",
    ),
)  # fmt: skip


def build_alert_rules() -> dict[str, Any]:
    """The Prometheus rule file (``alerts.yml``) as a dict."""
    return {"groups": [{"name": GROUP, "rules": [a.rule() for a in ALERTS]}]}
