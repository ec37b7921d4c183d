"""Grafana JSON (schemaVersion 39) from the tables of :mod:`panels`.

:func:`dashboard` turns a :class:`~panels.Board` into the dashboard dict: the
template variables (data source, ``job``, ``instance``), and every panel numbered
and placed on the 24-column grid from the row order: a row's panels left to right
from x = 0, each row below the tallest panel of the one above.
"""

from __future__ import annotations

from typing import Any

from panels import Board, Panel

from hicache_obs.exporters import metric_names as m

__all__ = ["SCHEMA_VERSION", "DATASOURCE", "TAG", "GRID_COLUMNS", "HEIGHTS", "dashboard", "panel", "layout"]

SCHEMA_VERSION = 39
#: Every panel, target and query variable reads from the dashboard's ``datasource`` variable.
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
TAG = "hicache"
GRID_COLUMNS = 24
#: Grid rows a panel of each kind is tall.
HEIGHTS = {"timeseries": 8, "stat": 5}


def dashboard(board: Board) -> dict[str, Any]:
    """The Grafana dashboard dict of ``board``."""
    return {
        "uid": board.uid,
        "title": board.title,
        "description": board.description,
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
        "panels": layout(board),
    }


def layout(board: Board) -> list[dict[str, Any]]:
    """Every panel of ``board`` as Grafana JSON, with its ``id`` (from 1) and ``gridPos``."""
    out: list[dict[str, Any]] = []
    y = 0
    for r, row in enumerate(board.rows):
        widths = [p.width for p in row]
        if not row or sum(widths) > GRID_COLUMNS or min(widths) < 1:
            raise ValueError(
                f"{board.file}: row {r} must hold panels 1 to {GRID_COLUMNS} columns wide in all, got widths {widths}"
            )
        x = 0
        for p in row:
            built = panel(p)
            built["id"] = len(out) + 1
            built["gridPos"] = {"h": HEIGHTS[p.kind], "w": p.width, "x": x, "y": y}
            out.append(built)
            x += p.width
        y += max(HEIGHTS[p.kind] for p in row)
    return out


def panel(p: Panel) -> dict[str, Any]:
    """The Grafana JSON of one panel (without ``id`` and ``gridPos``)."""
    if p.kind == "timeseries":
        return _timeseries(p)
    if p.kind == "stat":
        return _stat(p)
    raise ValueError(f"panel {p.title!r}: kind must be one of {sorted(HEIGHTS)}, got {p.kind!r}")


def _targets(queries: tuple[tuple[str, str], ...]) -> list[dict[str, Any]]:
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


def _timeseries(p: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": p.unit,
        "min": 0,
        "color": {"mode": "palette-classic"},
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"group": "A", "mode": "normal" if p.stack else "none"},
        },
    }
    if p.max_value is not None:
        defaults["max"] = p.max_value
    return {
        "type": "timeseries",
        "title": p.title,
        "description": p.description,
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
        "targets": _targets(p.queries),
    }


def _stat(p: Panel) -> dict[str, Any]:
    if len(p.queries) != 1:
        raise ValueError(f"stat panel {p.title!r} needs exactly one query, got {len(p.queries)}")
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if p.red_from is not None:
        steps.append({"color": "red", "value": p.red_from})
    return {
        "type": "stat",
        "title": p.title,
        "description": p.description,
        "datasource": dict(DATASOURCE),
        "fieldConfig": {
            "defaults": {
                "unit": p.unit,
                "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        },
        "options": {
            "colorMode": "background" if p.red_from is not None else "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "auto",
        },
        "targets": _targets(p.queries),
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
