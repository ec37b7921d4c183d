"""Every dashboard query, evaluated by a real Prometheus scraping a real workload.

A hybrid (KV + Mamba) controller with the pre-#22940 fault (``unrecorded-pool-indices``)
runs the synthetic serving workload on a thread, with a live auditor, the
PrometheusSink and a sink that keeps failing (so that the drop and error counters
move), and serves ``/metrics`` on a loopback port. Debian's ``prometheus`` scrapes it
every second with ``dashboards/alerts.yml`` loaded. Each panel query, with Grafana's
variables substituted, must return data; the fault must show on the stream-safety
panels; and the alerts must fire (or not) as the workload warrants.

Skipped where ``prometheus`` is not installed, unless ``HICACHE_REQUIRE_PROMETHEUS=1``.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from dashboard_checks import (
    committed_dashboards,
    panel_targets,
    require_binary,
    start_prometheus,
    stop_process,
)

from hicache_obs.core._spec import ModelSpec
from hicache_obs.events._audit import Auditor
from hicache_obs.exporters import metric_names as m
from hicache_obs.exporters._prometheus import PrometheusSink, start_metrics_server
from hicache_obs.lab.workload import Workload, controller_options
from hicache_obs.testing import make_controller

FAULT = "unrecorded-pool-indices"
JOB = "hicache"  # the job name of dashboards/prometheus.yml
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval stands for here: spans every scrape of the test
MIN_SCRAPES = 3
TARGETS = [
    (name, panel["title"], target["refId"], target["expr"])
    for name, board in committed_dashboards().items()
    for panel, target in panel_targets(board)
]
VARIABLES = [
    (name, v["name"], v["definition"])
    for name, board in committed_dashboards().items()
    for v in board["templating"]["list"]
    if v["type"] == "query"
]


class FailingSink:
    """A sink that raises on a batch at most every 0.2 s (and takes the others): errors and drops keep rising."""

    name = "failing"

    def __init__(self) -> None:
        self._last = 0.0

    def handle_batch(self, events: list[Any]) -> None:
        now = time.monotonic()
        if now - self._last >= 0.2:
            self._last = now
            raise RuntimeError("deliberately failing sink")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Live:
    url: str
    instance: str
    scrapes: int = 0
    log_file: Path | None = None
    stats: dict[str, int] = field(default_factory=dict)

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def substitute(self, expr: str) -> str:
        return (
            expr.replace("$__rate_interval", RATE_INTERVAL)
            .replace("$instance", self.instance.replace(".", "\\\\."))
            .replace("$job", JOB)
        )


def _workload(c: Any, stop: threading.Event, stats: dict[str, int]) -> None:
    wl = Workload(c, seed=0, fault=FAULT)
    while not stop.is_set():
        wl.step()
        stats["steps"] = stats.get("steps", 0) + 1
        if stats["steps"] % 10 == 0:  # fill the KV device pool until the allocator says no, then give back
            held = []
            while (t := c.alloc_device(c.spec.page_size * 4)) is not None:
                held.append(t)
            for t in held:
                c.free_device(t)
            stats["exhausted"] = stats.get("exhausted", 0) + 1
        time.sleep(0.005)
    wl.finish()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    exe = require_binary("prometheus", "HICACHE_REQUIRE_PROMETHEUS")
    spec = ModelSpec.tiny_hybrid()
    c = make_controller(spec, fault=FAULT, **controller_options(spec))
    Auditor().attach(c.log)
    sink = PrometheusSink(log=c.log)
    c.log.add_sink(sink)
    c.log.add_sink(FailingSink())
    server, port = start_metrics_server(sink.registry)
    stop = threading.Event()
    stats: dict[str, int] = {}
    worker = threading.Thread(target=_workload, args=(c, stop, stats), name="dashboards-workload", daemon=True)
    worker.start()
    proc = None
    try:
        proc, url, log_file = start_prometheus(exe, tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{port}", JOB)
        lv = Live(url=url, instance=f"127.0.0.1:{port}", log_file=log_file, stats=stats)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # enough scrapes for every rate() to have two samples and more
            res = lv.query(f'count_over_time(up{{job="{JOB}"}}[1m]) and up{{job="{JOB}"}} == 1')
            lv.scrapes = int(float(res[0]["value"][1])) if res else 0
            if lv.scrapes >= MIN_SCRAPES:
                break
            time.sleep(0.25)
        else:
            pytest.fail(f"only {lv.scrapes} successful scrapes in 30 s:\n{log_file.read_text()[-4000:]}")
        assert worker.is_alive(), "the workload thread died"
        yield lv
    finally:
        stop.set()
        worker.join(30)
        if proc is not None:
            stop_process(proc)
        server.stop()
        c.log.close()


# ------------------------------------------------------------------ panels
@pytest.mark.parametrize(("board", "panel", "ref", "expr"), TARGETS, ids=[f"{b}:{p}:{r}" for b, p, r, _ in TARGETS])
def test_panel_query_returns_data(live: Live, board: str, panel: str, ref: str, expr: str) -> None:
    result = live.query(live.substitute(expr))
    assert result, f"{board} / {panel} / {ref}: no data for\n{live.substitute(expr)}"
    values = [float(s["value"][1]) for s in result]
    assert any(math.isfinite(v) for v in values), f"{board} / {panel} / {ref}: only NaN/Inf {values}"


@pytest.mark.parametrize(("board", "var", "definition"), VARIABLES, ids=[f"{b}:{v}" for b, v, _ in VARIABLES])
def test_template_variable_lists_the_target(live: Live, board: str, var: str, definition: str) -> None:
    selector, label = definition[len("label_values(") : -1].rsplit(", ", 1)
    values = live.get(f"/api/v1/label/{label}/values", **{"match[]": live.substitute(selector)})
    assert {"job": JOB, "instance": live.instance}[label] in values


def test_no_metric_missing_from_the_scrape(live: Live) -> None:
    names = set(live.get("/api/v1/label/__name__/values", **{"match[]": f'{{job="{JOB}"}}'}))
    expected = {s for name in m.ALL_METRICS for s in m.series_names(name)}
    assert expected <= names, f"not scraped: {sorted(expected - names)}"


def test_workload_exercised_every_metric(live: Live) -> None:
    """Counters that only move with the right traffic did move (the panels above show real data)."""
    for name in (
        m.OPERATIONS_TOTAL,
        m.TRANSFER_SLOTS_TOTAL,
        m.TRANSFER_BYTES_TOTAL,
        m.INDEX_MOVES_TOTAL,
        m.STREAM_RECORDS_TOTAL,
        m.UNRECORDED_INDICES_TOTAL,
        m.AUDIT_VIOLATIONS_TOTAL,
        m.ALLOCATION_FAILURES_TOTAL,
        m.EVENTS_TOTAL,
        m.EVENTS_DROPPED_TOTAL,
        m.EXPORTER_ERRORS_TOTAL,
        m.EVICTIONS_TOTAL,
        m.EVICTED_SLOTS_TOTAL,
    ):
        res = live.query(f'sum(increase({name}{{job="{JOB}"}}[{RATE_INTERVAL}]))')
        assert res and float(res[0]["value"][1]) > 0, f"{name} did not increase during the scrapes"
    for hist in (m.TRANSFER_DURATION_SECONDS, m.QUEUE_WAIT_SECONDS):
        res = live.query(f'sum(increase({hist}_count{{job="{JOB}"}}[{RATE_INTERVAL}]))')
        assert res and float(res[0]["value"][1]) > 0, hist
    res = live.query(f'sum({m.POOL_USED_SLOTS}{{job="{JOB}"}}) > 0')
    assert res, "no slot was in use at the last scrape"


def test_fault_shows_on_stream_safety_panels(live: Live) -> None:
    """The pre-#22940 pattern: Mamba indices move, are used unrecorded, and are never recorded; KV is fine."""
    by_pool = {
        s["metric"]["pool"]: float(s["value"][1])
        for s in live.query(f'sum by (pool) ({m.UNRECORDED_INDICES_TOTAL}{{job="{JOB}"}})')
    }
    assert by_pool["mamba"] > 0 and by_pool["kv"] == 0, by_pool
    records = {
        s["metric"]["pool"]: float(s["value"][1])
        for s in live.query(f'sum by (pool) ({m.STREAM_RECORDS_TOTAL}{{job="{JOB}"}})')
    }
    moves = {
        s["metric"]["pool"]: float(s["value"][1])
        for s in live.query(f'sum by (pool) ({m.INDEX_MOVES_TOTAL}{{job="{JOB}"}})')
    }
    assert records["kv"] > 0 and records["mamba"] == 0 and moves["mamba"] > 0, (records, moves)
    rules = {s["metric"]["rule"] for s in live.query(f'{m.AUDIT_VIOLATIONS_TOTAL}{{job="{JOB}"}} > 0')}
    assert "unrecorded_index" in rules


# ------------------------------------------------------------------ alerts
def test_alerts_fire_on_the_faulty_workload(live: Live) -> None:
    expected = {"HiCacheUnrecordedIndices", "HiCacheAuditViolation", "HiCacheEventsDropped", "HiCacheExporterErrors"}
    firing: set[str] = set()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        alerts = live.get("/api/v1/alerts")["alerts"]
        firing = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
        if expected <= firing:
            break
        time.sleep(0.5)
    assert expected <= firing, f"firing: {sorted(firing)}"
    assert "HiCacheTransfersStuck" not in firing, "transfers complete: nothing is stuck"
    groups = live.get("/api/v1/rules")["groups"]
    assert all(r["health"] == "ok" for g in groups for r in g["rules"]), groups
    mamba = [
        a
        for a in live.get("/api/v1/alerts")["alerts"]
        if a["labels"]["alertname"] == "HiCacheUnrecordedIndices" and a["state"] == "firing"
    ]
    assert mamba and {a["labels"]["pool"] for a in mamba} == {"mamba"}
    assert all(a["labels"]["severity"] == "critical" for a in mamba)
