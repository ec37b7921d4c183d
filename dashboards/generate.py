"""Generate the Grafana dashboards and the Prometheus alert rules of ``dashboards/``.

Every metric name comes from :mod:`hicache_obs.exporters.metric_names`, so a query
cannot name a metric the exporter does not define (``tests/dashboards`` checks the
committed files against this output and runs every query against a real Prometheus).

- :func:`build_dashboards`: ``{file name: dashboard dict}`` (Grafana, schemaVersion 39)
- :func:`build_alert_rules`: the rule groups of ``alerts.yml``
- :func:`render_files`: ``{file name: text}`` for everything this script writes

Run ``python dashboards/generate.py`` to rewrite the files, ``--check`` to only
compare (exit 1 and name the stale files when they differ).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from hicache_obs.exporters import metric_names as m

__all__ = [
    "DATASOURCE",
    "SCHEMA_VERSION",
    "ALERTS_FILE",
    "build_dashboards",
    "build_alert_rules",
    "render_files",
    "write_files",
    "main",
]

HERE = Path(__file__).resolve().parent
SCHEMA_VERSION = 39
#: Every panel, target and query variable reads from the dashboard's ``datasource`` variable.
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ALERTS_FILE = "alerts.yml"
TAG = "hicache"
#: The label filter of every panel query: the dashboard's ``job`` and ``instance`` variables.
_FILTER = 'job=~"$job",instance=~"$instance"'


# ------------------------------------------------------------------ PromQL
def sel(metric: str, extra: str = "") -> str:
    """``metric{job=~"$job",instance=~"$instance"[,extra]}``."""
    return f"{metric}{{{_FILTER}{',' + extra if extra else ''}}}"


def rate(metric: str, extra: str = "", fn: str = "rate") -> str:
    """``rate(metric{filter}[$__rate_interval])`` (or ``increase``)."""
    return f"{fn}({sel(metric, extra)}[$__rate_interval])"


def sum_by(labels: str, inner: str) -> str:
    return f"sum by ({labels}) ({inner})"


def ratio(num: str, den: str, matching: str = "") -> str:
    """``num / den`` with the denominator kept off zero (a ratio of nothing reads 0, not NaN).

    ``matching``: vector matching for the division, e.g. ``on (direction) group_left``.
    """
    op = f"/ {matching}" if matching else "/"
    return f"{num}\n{op}\nclamp_min({den}, 1e-9)"


def quantile(q: float, histogram: str, by: str = "direction") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({rate(histogram + '_bucket')}))"


# ------------------------------------------------------------------ panels
class _Board:
    """Lays panels out left to right on Grafana's 24-column grid and numbers them."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self._x = 0
        self._y = 0
        self._row_h = 0

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self._x + w > 24:
            self._x, self._y, self._row_h = 0, self._y + self._row_h, 0
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"h": h, "w": w, "x": self._x, "y": self._y}
        self._x += w
        self._row_h = max(self._row_h, h)
        self.panels.append(panel)

    def newline(self) -> None:
        if self._x:
            self._x, self._y, self._row_h = 0, self._y + self._row_h, 0


def _targets(queries: list[tuple[str, str]]) -> list[dict[str, Any]]:
    return [
        {
            "datasource": dict(DATASOURCE),
            "editorMode": "code",
            "expr": expr,
            "legendFormat": legend,
            "range": True,
            "refId": chr(ord("A") + i),
        }
        for i, (expr, legend) in enumerate(queries)
    ]


def timeseries(
    title: str,
    description: str,
    unit: str,
    queries: list[tuple[str, str]],
    *,
    stack: bool = False,
    max_value: float | None = None,
) -> dict[str, Any]:
    """A time series panel: ``queries`` are ``(expr, legendFormat)`` pairs."""
    defaults: dict[str, Any] = {
        "unit": unit,
        "min": 0,
        "color": {"mode": "palette-classic"},
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"group": "A", "mode": "normal" if stack else "none"},
        },
    }
    if max_value is not None:
        defaults["max"] = max_value
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": dict(DATASOURCE),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {
                "calcs": ["lastNotNull", "max"],
                "displayMode": "table",
                "placement": "bottom",
                "showLegend": True,
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": _targets(queries),
    }


def stat(title: str, description: str, unit: str, expr: str, *, red_from: float | None = 1) -> dict[str, Any]:
    """A single-value panel; turns red at ``red_from`` (None: always neutral)."""
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if red_from is not None:
        steps.append({"color": "red", "value": red_from})
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": dict(DATASOURCE),
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        },
        "options": {
            "colorMode": "background" if red_from is not None else "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "auto",
        },
        "targets": _targets([(expr, "")]),
    }


# --------------------------------------------------------------- templating
def _query_variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": dict(DATASOURCE),
        "definition": query,
        # the plain string form: every Grafana version since 7 reads it (and migrates it in the editor)
        "query": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {},
        "options": [],
        "regex": "",
        "sort": 1,
        "hide": 0,
    }


def _templating() -> dict[str, Any]:
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "options": [],
                "refresh": 1,
                "regex": "",
                "hide": 0,
            },
            _query_variable("job", "Job", f"label_values({m.OPERATIONS_TOTAL}, job)"),
            _query_variable("instance", "Instance", f'label_values({m.OPERATIONS_TOTAL}{{job=~"$job"}}, instance)'),
        ]
    }


def _dashboard(uid: str, title: str, description: str, panels: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": [TAG],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "liveNow": False,
        "refresh": "10s",
        "time": {"from": "now-15m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "weekStart": "",
        "annotations": {"list": []},
        "links": [
            {
                "type": "dashboards",
                "title": "HiCache dashboards",
                "tags": [TAG],
                "asDropdown": False,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "templating": _templating(),
        "panels": panels,
    }


# --------------------------------------------------------------- dashboards
def _overview() -> dict[str, Any]:
    b = _Board()
    ops_by = sum_by("direction, status", rate(m.OPERATIONS_TOTAL))
    b.add(
        timeseries(
            "Operations by direction and status",
            "Merged cache operations per second: d2h = write (device to host backup), h2d = load. "
            "submitted counts at TransferSubmitted, completed/failed at the end of the transfer.",
            "ops",
            [(ops_by, "{{direction}} {{status}}")],
        ),
        w=12,
        h=8,
    )
    b.add(
        timeseries(
            "Transfers in flight by direction",
            "Operations submitted on a side stream and not yet completed or failed. "
            "A level that stays above 0 while nothing completes is a stuck transfer (alert HiCacheTransfersStuck).",
            "short",
            [(sum_by("direction", sel(m.TRANSFERS_IN_FLIGHT)), "{{direction}}")],
        ),
        w=6,
        h=8,
    )
    b.add(
        timeseries(
            "Failed operations ratio",
            "Failed / submitted operations per direction (0 when nothing was submitted).",
            "percentunit",
            [
                (
                    ratio(
                        sum_by("direction", rate(m.OPERATIONS_TOTAL, 'status="failed"')),
                        sum_by("direction", rate(m.OPERATIONS_TOTAL, 'status="submitted"')),
                    ),
                    "{{direction}}",
                )
            ],
            max_value=1,
        ),
        w=6,
        h=8,
    )
    b.add(
        timeseries(
            "Slots moved per pool and direction",
            "Slots moved by completed operations per second (KV: one per token; Mamba: one per state checkpoint; "
            "SWA: the trailing window).",
            "cps",
            [(sum_by("pool, direction", rate(m.TRANSFER_SLOTS_TOTAL)), "{{pool}} {{direction}}")],
        ),
        w=12,
        h=8,
    )
    b.add(
        timeseries(
            "Bytes moved per pool and direction",
            "Bytes moved by completed operations per second.",
            "Bps",
            [(sum_by("pool, direction", rate(m.TRANSFER_BYTES_TOTAL)), "{{pool}} {{direction}}")],
        ),
        w=12,
        h=8,
    )
    dur = m.TRANSFER_DURATION_SECONDS
    wait = m.QUEUE_WAIT_SECONDS
    b.add(
        timeseries(
            "Transfer duration p50 / p99",
            "Transfer time of completed operations (device-event timing when the runtime has it).",
            "s",
            [(quantile(0.5, dur), "p50 {{direction}}"), (quantile(0.99, dur), "p99 {{direction}}")],
        ),
        w=8,
        h=8,
    )
    b.add(
        timeseries(
            "Queue wait p50 / p99",
            "Time from queueing (earliest of the merged operations) to submission on the transfer stream.",
            "s",
            [(quantile(0.5, wait), "p50 {{direction}}"), (quantile(0.99, wait), "p99 {{direction}}")],
        ),
        w=8,
        h=8,
    )
    b.add(
        timeseries(
            "Mean transfer duration and queue wait",
            "Sum / count of the two histograms per direction (0 when nothing completed).",
            "s",
            [
                (
                    ratio(sum_by("direction", rate(dur + "_sum")), sum_by("direction", rate(dur + "_count"))),
                    "transfer {{direction}}",
                ),
                (
                    ratio(sum_by("direction", rate(wait + "_sum")), sum_by("direction", rate(wait + "_count"))),
                    "queue wait {{direction}}",
                ),
            ],
        ),
        w=8,
        h=8,
    )
    b.add(
        timeseries(
            "Pool occupancy per pool and tier",
            "Allocated / capacity slots per pool (kv, mamba, swa) and tier (device, host). "
            "Pools the model does not have read 0.",
            "percentunit",
            [
                (
                    ratio(
                        sum_by("pool, tier", sel(m.POOL_USED_SLOTS)), sum_by("pool, tier", sel(m.POOL_CAPACITY_SLOTS))
                    ),
                    "{{pool}} {{tier}}",
                )
            ],
            max_value=1,
        ),
        w=12,
        h=8,
    )
    b.add(
        timeseries(
            "Used and capacity slots per pool and tier",
            "Allocated slots and capacity in slots.",
            "short",
            [
                (sum_by("pool, tier", sel(m.POOL_USED_SLOTS)), "used {{pool}} {{tier}}"),
                (sum_by("pool, tier", sel(m.POOL_CAPACITY_SLOTS)), "capacity {{pool}} {{tier}}"),
            ],
        ),
        w=12,
        h=8,
    )
    b.add(
        timeseries(
            "Allocation failures per pool and tier",
            "Allocations refused because a pool was short of free slots (the allocator returned None), per second.",
            "cps",
            [(sum_by("pool, tier", rate(m.ALLOCATION_FAILURES_TOTAL)), "{{pool}} {{tier}}")],
        ),
        w=8,
        h=8,
    )
    b.add(
        timeseries(
            "Evictions per pool and tier",
            "Eviction calls per second (device: a node leaves the device; host: its backup is dropped).",
            "cps",
            [(sum_by("pool, tier", rate(m.EVICTIONS_TOTAL)), "{{pool}} {{tier}}")],
        ),
        w=8,
        h=8,
    )
    b.add(
        timeseries(
            "Evicted slots per pool and tier",
            "Slots freed by eviction per second.",
            "cps",
            [(sum_by("pool, tier", rate(m.EVICTED_SLOTS_TOTAL)), "{{pool}} {{tier}}")],
        ),
        w=8,
        h=8,
    )
    b.add(
        stat(
            "Unrecorded index tensors (since start)",
            "Index tensors used on a side stream without record_stream on it, since the process started. "
            "Anything above 0 is the bug of SGLang PR #22940: see the HiCache stream safety dashboard.",
            "short",
            f"sum({sel(m.UNRECORDED_INDICES_TOTAL)})",
        ),
        w=8,
        h=5,
    )
    b.add(
        stat(
            "Audit violations (since start)",
            "Every audit finding (all rules), since the process started.",
            "short",
            f"sum({sel(m.AUDIT_VIOLATIONS_TOTAL)})",
        ),
        w=8,
        h=5,
    )
    b.add(
        stat(
            "Events per second",
            "Events the Prometheus exporter handled per second.",
            "cps",
            f"sum({rate(m.EVENTS_TOTAL)})",
            red_from=None,
        ),
        w=8,
        h=5,
    )
    return _dashboard(
        "hicache-overview",
        "HiCache overview",
        "Hierarchical KV cache: operations, transfers, pool occupancy, allocation failures and evictions.",
        b.panels,
    )


def _stream_safety() -> dict[str, Any]:
    b = _Board()
    b.add(
        stat(
            "Unrecorded index tensors (since start)",
            "Index tensors used on a side stream without record_stream on it (audit rule unrecorded_index), "
            "since the process started. Should be 0.",
            "short",
            f"sum({sel(m.UNRECORDED_INDICES_TOTAL)})",
        ),
        w=6,
        h=5,
    )
    b.add(
        stat(
            "Audit violations (since start)",
            "Audit findings of every rule since the process started. Should be 0.",
            "short",
            f"sum({sel(m.AUDIT_VIOLATIONS_TOTAL)})",
        ),
        w=6,
        h=5,
    )
    b.add(
        stat(
            "Events dropped (since start)",
            "Events a sink lost (queue full, or a batch the sink raised on), all sinks.",
            "short",
            f"sum({sel(m.EVENTS_DROPPED_TOTAL)})",
        ),
        w=6,
        h=5,
    )
    b.add(
        stat(
            "Exporter errors (since start)",
            "Exceptions raised by a sink (handle, flush or close), all sinks.",
            "short",
            f"sum({sel(m.EXPORTER_ERRORS_TOTAL)})",
        ),
        w=6,
        h=5,
    )
    b.add(
        timeseries(
            "Unrecorded index tensors by pool and role",
            "Index tensors a transfer used on its side stream without record_stream on that stream, per scrape "
            "interval. The caching allocator may reuse their memory while the copy still runs (illegal memory "
            "access or silent corruption). Before SGLang PR #22940 the Mamba/SWA pools' indices were never recorded.",
            "short",
            [(sum_by("pool, role", rate(m.UNRECORDED_INDICES_TOTAL, fn="increase")), "{{pool}} {{role}}")],
            stack=True,
        ),
        w=12,
        h=8,
    )
    b.add(
        timeseries(
            "Audit violations by rule and pool",
            "Audit findings per rule (unrecorded_index, index_not_on_device, length_mismatch, "
            "slot_not_allocated, double_free, incomplete_operation) and pool, per scrape interval.",
            "short",
            [(sum_by("rule, pool", rate(m.AUDIT_VIOLATIONS_TOTAL, fn="increase")), "{{rule}} {{pool}}")],
            stack=True,
        ),
        w=12,
        h=8,
    )
    b.add(
        timeseries(
            "Stream records vs index moves per pool",
            "record_stream calls on a transfer stream and index tensors moved before a transfer, per pool and "
            "second. A pool whose indices move but are never recorded is the pre-#22940 pattern.",
            "cps",
            [
                (sum_by("pool", rate(m.STREAM_RECORDS_TOTAL)), "records {{pool}}"),
                (sum_by("pool", rate(m.INDEX_MOVES_TOTAL)), "moves {{pool}}"),
            ],
        ),
        w=12,
        h=8,
    )
    b.add(
        timeseries(
            "Stream records and index moves by pool and role",
            "The same counters split by role (host or device index tensor).",
            "cps",
            [
                (sum_by("pool, role", rate(m.STREAM_RECORDS_TOTAL)), "records {{pool}} {{role}}"),
                (sum_by("pool, role", rate(m.INDEX_MOVES_TOTAL)), "moves {{pool}} {{role}}"),
            ],
        ),
        w=12,
        h=8,
    )
    b.add(
        timeseries(
            "Unrecorded index tensors per completed operation",
            "Unrecorded index tensors per completed operation, per pool and direction (0 when nothing completed).",
            "short",
            [
                (
                    ratio(
                        sum_by("pool, direction", rate(m.UNRECORDED_INDICES_TOTAL)),
                        sum_by("direction", rate(m.OPERATIONS_TOTAL, 'status="completed"')),
                        "on (direction) group_left",
                    ),
                    "{{pool}} {{direction}}",
                )
            ],
        ),
        w=12,
        h=8,
    )
    b.add(
        timeseries(
            "Exporter errors and dropped events by sink",
            "Per second: exceptions a sink raised, and events it lost. Telemetry never raises into the "
            "controller; this is where its failures show.",
            "cps",
            [
                (sum_by("sink", rate(m.EXPORTER_ERRORS_TOTAL)), "errors {{sink}}"),
                (sum_by("sink", rate(m.EVENTS_DROPPED_TOTAL)), "dropped {{sink}}"),
            ],
        ),
        w=12,
        h=8,
    )
    b.add(
        timeseries(
            "Events by type",
            "Events the Prometheus exporter handled per second, per event type.",
            "cps",
            [(sum_by("type", rate(m.EVENTS_TOTAL)), "{{type}}")],
            stack=True,
        ),
        w=24,
        h=8,
    )
    return _dashboard(
        "hicache-stream-safety",
        "HiCache stream safety",
        "Index tensors used on a transfer stream without record_stream (the SGLang #22940 bug class), audit "
        "violations, stream records vs index moves, and the exporters' own errors and drops.",
        b.panels,
    )


def build_dashboards() -> dict[str, dict[str, Any]]:
    """``{file name: Grafana dashboard}`` for every dashboard in ``dashboards/``."""
    return {"hicache-overview.json": _overview(), "hicache-stream-safety.json": _stream_safety()}


# -------------------------------------------------------------------- alerts
def build_alert_rules() -> dict[str, Any]:
    """The Prometheus rule file (``alerts.yml``) as a dict."""
    completed = f'{m.OPERATIONS_TOTAL}{{status=~"completed|failed"}}'
    where = "{{ $labels.job }}/{{ $labels.instance }}"
    rules = [
        {
            "alert": "HiCacheUnrecordedIndices",
            "expr": f"increase({m.UNRECORDED_INDICES_TOTAL}[5m]) > 0",
            "for": "0m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "Unrecorded {{ $labels.pool }} {{ $labels.role }} index tensors ({{ $labels.direction }})",
                "description": "{{ $value | humanize }} {{ $labels.pool }} {{ $labels.role }} index tensor(s) of "
                "{{ $labels.direction }} transfers on " + where + " were used on a transfer stream without "
                "record_stream on it in the last 5 minutes: the caching allocator can reuse their memory while "
                "the copy runs (the bug fixed by SGLang PR #22940).",
            },
        },
        {
            "alert": "HiCacheAuditViolation",
            "expr": f"increase({m.AUDIT_VIOLATIONS_TOTAL}[5m]) > 0",
            "for": "0m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "Audit violation {{ $labels.rule }} in pool {{ $labels.pool }}",
                "description": "The event-log auditor on " + where + " reported {{ $value | humanize }} "
                "{{ $labels.rule }} violation(s) in pool {{ $labels.pool }} in the last 5 minutes. "
                "Run `hicache-obs audit` on the event log for the operations involved.",
            },
        },
        {
            "alert": "HiCacheEventsDropped",
            "expr": f"increase({m.EVENTS_DROPPED_TOTAL}[5m]) > 0",
            "for": "0m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "Sink {{ $labels.sink }} dropped events",
                "description": "Sink {{ $labels.sink }} on " + where + " lost {{ $value | humanize }} event(s) "
                "in the last 5 minutes (queue full or the sink raised): its metrics, spans or logs are incomplete.",
            },
        },
        {
            "alert": "HiCacheExporterErrors",
            "expr": f"increase({m.EXPORTER_ERRORS_TOTAL}[5m]) > 0",
            "for": "0m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "Sink {{ $labels.sink }} raised errors",
                "description": "Sink {{ $labels.sink }} on " + where + " raised {{ $value | humanize }} "
                "exception(s) in the last 5 minutes; the controller carried on, see the process log.",
            },
        },
        {
            "alert": "HiCacheTransfersStuck",
            "expr": f"min_over_time({m.TRANSFERS_IN_FLIGHT}[5m]) > 0\n"
            "and on (job, instance, direction)\n"
            f"sum by (job, instance, direction) (increase({completed}[5m])) == 0",
            "for": "1m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "{{ $labels.direction }} transfers stuck in flight",
                "description": "{{ $value | humanize }} {{ $labels.direction }} transfer(s) on " + where + " have "
                "been in flight for 5 minutes while no {{ $labels.direction }} operation completed or failed.",
            },
        },
    ]
    return {"groups": [{"name": "hicache", "rules": rules}]}


# ------------------------------------------------------------------- output
_PLAIN = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_DURATION = re.compile(r"[0-9]+[smhdwy]\Z")
_YAML_WORDS = {"true", "false", "null", "yes", "no", "on", "off", "y", "n"}


def _yaml_scalar(value: Any, indent: str) -> str:
    if isinstance(value, str) and "\n" in value:
        body = "\n".join(f"{indent}  {line}" if line else "" for line in value.split("\n"))
        return f"|-\n{body}"
    if isinstance(value, str) and (_PLAIN.match(value) or _DURATION.match(value)) and value.lower() not in _YAML_WORDS:
        return value
    return json.dumps(value)  # a JSON string is a valid YAML double-quoted scalar


def _yaml(value: Any, indent: str = "") -> list[str]:
    """A small block-style YAML writer for the plain dicts/lists/strings of the rule file."""
    lines: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{indent}{k}:")
                lines.extend(_yaml(v, indent + "  "))
            else:
                lines.append(f"{indent}{k}: {_yaml_scalar(v, indent)}")
    elif isinstance(value, list):
        for item in value:
            sub = _yaml(item, indent + "  ")
            lines.append(f"{indent}- {sub[0].lstrip()}")
            lines.extend(sub[1:])
    else:
        lines.append(f"{indent}{_yaml_scalar(value, indent)}")
    return lines


def render_files() -> dict[str, str]:
    """``{file name relative to dashboards/: text}`` of every generated file."""
    out = {name: json.dumps(board, indent=2) + "\n" for name, board in build_dashboards().items()}
    header = [
        "# Prometheus alert rules for hicache-obs.",
        "# Generated by dashboards/generate.py from hicache_obs.exporters.metric_names: edit that, then",
        "# run `python dashboards/generate.py`. Unit tests: `promtool test rules dashboards/alerts_test.yml`.",
    ]
    out[ALERTS_FILE] = "\n".join([*header, *_yaml(build_alert_rules())]) + "\n"
    return out


def write_files(folder: Path = HERE) -> list[str]:
    """Write every generated file into ``folder``; returns the names that changed."""
    changed = []
    for name, text in render_files().items():
        path = folder / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(name)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a file is stale")
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write (default: dashboards/)")
    args = parser.parse_args(argv)
    if args.check:
        stale = [n for n, t in render_files().items() if not (args.out / n).exists() or (args.out / n).read_text() != t]
        for name in stale:
            print(f"stale: {args.out / name} (run python dashboards/generate.py)", file=sys.stderr)
        return 1 if stale else 0
    for name in write_files(args.out):
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
