"""An OTLP endpoint that refuses connections or hangs: the controller does not notice, the metrics do.

The span sink builds its own provider from the standard ``OTEL_*`` environment
(``tracer_provider=None``) and points it at a loopback port where nothing listens,
or at a loopback HTTP server that never answers within the exporter's timeout.
A real serving workload runs meanwhile; it must take about as long as without the
sink, keep its data intact, and every span that could not be exported must show up
in ``hicache_events_dropped_total{sink="otel"}`` and every failed export in
``hicache_exporter_errors_total{sink="otel"}``, scraped from the metrics server.
Closing the log stays within the sink's flush budget plus one export timeout.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache_obs.core import HybridCacheController, ModelSpec
from hicache_obs.events import TransferSubmitted
from hicache_obs.events._state import fold
from hicache_obs.exporters import metric_names as m
from hicache_obs.exporters._otel import OtelSpanSink
from hicache_obs.exporters._prometheus import PrometheusSink, start_metrics_server
from hicache_obs.lab.workload import controller_options, run_workload

STEPS = 200  # ~150 merged operations, so ~150 spans
EXPORT_TIMEOUT_S = 1  # OTEL_EXPORTER_OTLP_TIMEOUT, seconds
FLUSH_TIMEOUT_S = 1.0  # the sink's flush/close budget
HANG_S = 8.0  # how long the hanging endpoint sits on a request: far past the export timeout


# ------------------------------------------------------------------ endpoints
def _refusing_url() -> str:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connect() is refused
    return f"http://127.0.0.1:{port}/v1/traces"


class _Hang(BaseHTTPRequestHandler):
    server: _HangingServer

    def do_POST(self) -> None:
        with self.server.lock:
            self.server.requests += 1
        self.server.release.wait(HANG_S)
        try:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        except OSError:  # the client gave up long ago
            pass

    def log_message(self, format: str, *args: object) -> None:
        pass


class _HangingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Hang)
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.requests = 0


@pytest.fixture(params=["refusing", "hanging"])
def endpoint(request: pytest.FixtureRequest) -> Iterator[tuple[str, _HangingServer | None]]:
    if request.param == "refusing":
        yield _refusing_url(), None
        return
    server = _HangingServer()
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch, endpoint: tuple[str, _HangingServer | None]) -> str:
    url = endpoint[0]
    for var in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        "OTEL_SDK_DISABLED",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", str(EXPORT_TIMEOUT_S))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export while the workload runs
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "32")  # several batches: several failures
    return url


# ------------------------------------------------------------------- helpers
def _controller() -> HybridCacheController:
    spec = ModelSpec.tiny_hybrid()
    return HybridCacheController(spec, runtime="sim", **controller_options(spec))


def _scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _otel(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> float:
    return samples[(name, frozenset({("sink", "otel")}))]


# --------------------------------------------------------------------- tests
def test_unreachable_otlp_endpoint_costs_the_controller_nothing_and_is_counted(
    otel_env: str, endpoint: tuple[str, _HangingServer | None]
) -> None:
    # the same workload without any sink: the time to compare with
    base = _controller()
    t0 = time.perf_counter()
    base_stats = run_workload(base, seed=3, steps=STEPS)
    base_s = time.perf_counter() - t0
    base.close()
    assert base_stats.data_intact

    c = _controller()
    log = c.log
    prom = PrometheusSink(log=log)
    log.add_sink(prom)
    sink = OtelSpanSink(flush_timeout_s=FLUSH_TIMEOUT_S)  # provider and exporter from OTEL_* above
    runner = log.add_sink(sink)
    server, port = start_metrics_server(prom.registry)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        t0 = time.perf_counter()
        stats = run_workload(c, seed=3, steps=STEPS)
        work_s = time.perf_counter() - t0
        # the controller's work is not held up by the endpoint (a generous bound, not a benchmark)
        assert work_s < 10, f"workload took {work_s:.2f}s with the sink, {base_s:.2f}s without"
        assert stats.data_intact and stats.corruptions == 0
        assert stats.writes["failed"] == 0 and stats.loads["failed"] == 0
        assert stats.to_dict() == base_stats.to_dict()  # the same run, deterministic for the seed
        assert fold(log.events()).snapshot() == c.state.snapshot()

        # while the process runs, the failures are already visible to a scraper
        deadline = time.monotonic() + 15
        live = _scrape(url)
        while _otel(live, m.EXPORTER_ERRORS_TOTAL) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            live = _scrape(url)
        assert _otel(live, m.EXPORTER_ERRORS_TOTAL) >= 1
        assert _otel(live, m.EVENTS_DROPPED_TOTAL) >= 1

        c.synchronize()
        c.poll_writes()
        c.poll_loads()
        t0 = time.perf_counter()
        log.close()  # flushes every sink: bounded by the sink's budget, not by the endpoint
        close_s = time.perf_counter() - t0
        # flush() and close() each: budget + at most one export already on the wire
        assert close_s < 2 * (FLUSH_TIMEOUT_S + EXPORT_TIMEOUT_S) + 2, f"log.close() took {close_s:.2f}s"

        final = _scrape(url)
    finally:
        server.stop()
    c.close()

    submitted = sum(isinstance(e, TransferSubmitted) for e in log.events())
    assert submitted > 100
    assert sink.spans_started == sink.spans_ended == submitted
    # nothing reached the endpoint, and every span is accounted for as dropped
    assert sink.spans_exported == 0
    assert sink.spans_dropped == submitted
    assert sink.export_errors >= 1
    # the sink itself kept up with the log: the drops are the exporter's, not the runner's
    assert runner.dropped == 0 and runner.errors == 0
    assert _otel(final, m.EVENTS_DROPPED_TOTAL) == sink.spans_dropped
    assert _otel(final, m.EXPORTER_ERRORS_TOTAL) == sink.export_errors
    # the healthy sink on the same log lost nothing
    assert final[(m.EVENTS_DROPPED_TOTAL, frozenset({("sink", "prometheus")}))] == 0
    hang = endpoint[1]
    if hang is not None:
        assert hang.requests >= 1  # the exporter really talked to the hanging server
    print(
        f"\n[otlp {'hanging' if hang else 'refusing'}] workload {work_s:.2f}s (no sink {base_s:.2f}s), "
        f"log.close {close_s:.2f}s, spans {submitted}, dropped {sink.spans_dropped}, "
        f"export errors {sink.export_errors}"
    )
