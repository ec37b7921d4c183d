"""The Grafana dashboards: generated from code, current schema, no drift from the exporter's metric names."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dashboard_checks import (
    DASHBOARDS,
    all_panels,
    calls,
    committed_dashboards,
    load_generator,
    metric_names_in,
    panel_targets,
)

from hicache_obs.exporters import metric_names as m

gen = load_generator()
BOARDS = committed_dashboards()
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
EXPECTED_FILES = {"hicache-overview.json", "hicache-stream-safety.json"}


def exprs(board: dict) -> list[str]:
    return [t["expr"] for _, t in panel_targets(board)]


def variable_queries(board: dict) -> list[str]:
    return [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]


# ------------------------------------------------------------------ generated
def test_committed_files_equal_generated_output() -> None:
    rendered = gen.render_files()
    assert set(rendered) >= EXPECTED_FILES | {"alerts.yml"}
    stale = [name for name, text in rendered.items() if (DASHBOARDS / name).read_text() != text]
    assert not stale, f"stale generated files {stale}: run `python dashboards/generate.py`"
    assert set(BOARDS) == set(gen.build_dashboards()), "a JSON file in dashboards/ that generate.py does not make"


def test_generate_script_check_mode_and_out_folder(tmp_path: Path) -> None:
    script = str(DASHBOARDS / "generate.py")
    ok = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    stale = subprocess.run([sys.executable, script, "--check", "--out", str(tmp_path)], capture_output=True, text=True)
    assert stale.returncode == 1 and "stale" in stale.stderr
    wrote = subprocess.run([sys.executable, script, "--out", str(tmp_path)], capture_output=True, text=True)
    assert wrote.returncode == 0, wrote.stderr
    for name, text in gen.render_files().items():
        assert (tmp_path / name).read_text() == text


def test_build_dashboards_returns_plain_json_dicts() -> None:
    boards = gen.build_dashboards()
    assert set(boards) == EXPECTED_FILES
    for board in boards.values():
        assert json.loads(json.dumps(board)) == board


# ------------------------------------------------------------------ structure
@pytest.mark.parametrize("name", sorted(EXPECTED_FILES))
def test_dashboard_schema(name: str) -> None:
    board = BOARDS[name]
    assert board["schemaVersion"] >= 39
    assert board["uid"] and board["title"] and "hicache" in board["tags"]
    assert "id" not in board or board["id"] is None, "a provisioned dashboard must not pin a database id"
    assert board["panels"], "empty dashboard"


@pytest.mark.parametrize("name", sorted(EXPECTED_FILES))
def test_unique_panel_ids_and_grid_without_overlap(name: str) -> None:
    panels = all_panels(BOARDS[name])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids {ids}"
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, f"{p['title']!r} leaves the 24-column grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


@pytest.mark.parametrize("name", sorted(EXPECTED_FILES))
def test_template_variables(name: str) -> None:
    variables = {v["name"]: v for v in BOARDS[name]["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for var in ("job", "instance"):
        v = variables[var]
        assert v["type"] == "query" and v["datasource"] == DATASOURCE
        assert v["definition"].startswith("label_values(") and v["definition"].endswith(f", {var})")
        assert v["query"] == v["definition"]
        assert v["includeAll"] and v["multi"] and v["allValue"] == ".*"
    assert "$job" in variables["instance"]["definition"], "instance choices should follow the chosen job"


@pytest.mark.parametrize("name", sorted(EXPECTED_FILES))
def test_every_panel_and_target_uses_the_datasource_variable(name: str) -> None:
    board = BOARDS[name]
    for p in all_panels(board):
        assert p.get("datasource") == DATASOURCE, f"panel {p['title']!r}: {p.get('datasource')!r}"
        assert p.get("targets"), f"panel {p['title']!r} has no query"
        for t in p["targets"]:
            assert t.get("datasource") == DATASOURCE, f"panel {p['title']!r} target {t['refId']}"

    def walk(node: object, where: str) -> None:  # no data source pinned anywhere else either
        if isinstance(node, dict):
            if "datasource" in node:
                assert node["datasource"] == DATASOURCE, f"{where}: {node['datasource']!r}"
            for k, v in node.items():
                walk(v, f"{where}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}[{i}]")

    walk(board, name)
    assert '"uid": "${datasource}"' in json.dumps(board)
    assert "__inputs" not in board, "import-time datasource inputs would pin a uid"


@pytest.mark.parametrize("name", sorted(EXPECTED_FILES))
def test_every_panel_has_a_unit(name: str) -> None:
    for p in all_panels(BOARDS[name]):
        unit = p["fieldConfig"]["defaults"].get("unit")
        assert isinstance(unit, str) and unit, f"panel {p['title']!r} has no unit"


@pytest.mark.parametrize("name", sorted(EXPECTED_FILES))
def test_rates_use_rate_interval(name: str) -> None:
    found = 0
    for expr in exprs(BOARDS[name]):
        for fn, arg in calls(expr, ("rate", "irate", "increase", "delta", "idelta", "deriv")):
            found += 1
            assert arg.rstrip().endswith("[$__rate_interval]"), f"{fn}(...) without [$__rate_interval]: {expr}"
        ranges = re.findall(r"\[([^\]]*)\]", expr)
        assert all(r == "$__rate_interval" for r in ranges), f"hard-coded range in {expr}"
    assert found


@pytest.mark.parametrize("name", sorted(EXPECTED_FILES))
def test_divisions_are_guarded(name: str) -> None:
    guard = re.compile(r"/\s*(on\s*\([^)]*\)\s*(group_left|group_right)?\s*(\([^)]*\))?\s*)?clamp_min\(")
    for expr in exprs(BOARDS[name]):
        for match in re.finditer(r"/", expr):
            assert guard.match(expr, match.start()), f"unguarded division in {expr}"


@pytest.mark.parametrize("name", sorted(EXPECTED_FILES))
def test_every_selector_filters_job_and_instance(name: str) -> None:
    for expr in exprs(BOARDS[name]):
        for token in re.finditer(r"hicache_[a-z_]+", expr):
            rest = expr[token.end() :]
            assert rest.startswith("{"), f"{token.group()} without a label filter in {expr}"
            labels = rest[: rest.index("}")]
            assert 'job=~"$job"' in labels and 'instance=~"$instance"' in labels, expr


# ------------------------------------------------------------------ metric names
def test_metric_name_parser_flags_unknown_names() -> None:
    defined, undefined = metric_names_in(
        "rate(hicache_transfer_duration_seconds_bucket[1m]) + hicache_operations_total"
        " + hicache_operations_total_bucket + hicache_made_up_total",
        m.ALL_METRICS,
    )
    assert defined == {m.TRANSFER_DURATION_SECONDS, m.OPERATIONS_TOTAL}
    assert undefined == {"hicache_operations_total_bucket", "hicache_made_up_total"}


@pytest.mark.parametrize("name", sorted(EXPECTED_FILES))
def test_queries_name_only_defined_metrics(name: str) -> None:
    board = BOARDS[name]
    for expr in [*exprs(board), *variable_queries(board)]:
        defined, undefined = metric_names_in(expr, m.ALL_METRICS)
        assert defined, f"query names no hicache metric: {expr}"
        assert not undefined, f"undefined metrics {sorted(undefined)} in {expr}"


def test_every_defined_metric_is_on_a_panel() -> None:
    used: set[str] = set()
    for board in BOARDS.values():
        for expr in exprs(board):
            used |= metric_names_in(expr, m.ALL_METRICS)[0]
    missing = sorted(set(m.ALL_METRICS) - used)
    assert not missing, f"metrics on no panel: {missing}"


def _board_metrics(name: str) -> set[str]:
    used: set[str] = set()
    for expr in exprs(BOARDS[name]):
        used |= metric_names_in(expr, m.ALL_METRICS)[0]
    return used


def test_overview_content() -> None:
    used = _board_metrics("hicache-overview.json")
    assert {
        m.OPERATIONS_TOTAL,
        m.TRANSFERS_IN_FLIGHT,
        m.TRANSFER_SLOTS_TOTAL,
        m.TRANSFER_BYTES_TOTAL,
        m.TRANSFER_DURATION_SECONDS,
        m.QUEUE_WAIT_SECONDS,
        m.POOL_USED_SLOTS,
        m.POOL_CAPACITY_SLOTS,
        m.ALLOCATION_FAILURES_TOTAL,
        m.EVICTIONS_TOTAL,
    } <= used
    text = "\n".join(exprs(BOARDS["hicache-overview.json"]))
    for hist in (m.TRANSFER_DURATION_SECONDS, m.QUEUE_WAIT_SECONDS):
        for q in ("0.5", "0.99"):
            assert f"histogram_quantile({q}, sum by (le, direction) (rate({hist}_bucket{{" in text
    assert re.search(
        rf"sum by \(pool, tier\) \({m.POOL_USED_SLOTS}\{{[^}}]*\}}\)\s*/\s*clamp_min\(sum by \(pool, tier\) \({m.POOL_CAPACITY_SLOTS}",
        text,
    ), "occupancy = used / capacity per pool and tier, guarded"


def test_stream_safety_content() -> None:
    used = _board_metrics("hicache-stream-safety.json")
    assert {
        m.UNRECORDED_INDICES_TOTAL,
        m.AUDIT_VIOLATIONS_TOTAL,
        m.STREAM_RECORDS_TOTAL,
        m.INDEX_MOVES_TOTAL,
        m.EXPORTER_ERRORS_TOTAL,
        m.EVENTS_DROPPED_TOTAL,
    } <= used
    text = "\n".join(exprs(BOARDS["hicache-stream-safety.json"]))
    assert f"sum by (pool, role) (increase({m.UNRECORDED_INDICES_TOTAL}{{" in text
    assert f"sum by (rule, pool) (increase({m.AUDIT_VIOLATIONS_TOTAL}{{" in text
