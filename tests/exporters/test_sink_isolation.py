"""A sink that raises or stalls never breaks or slows the controller; the metrics say what happened."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from exporters_kit import parse_exposition, run_workload, scrape_text, value

from hicache_obs.exporters import metric_names as m
from hicache_obs.exporters._prometheus import PrometheusSink, start_metrics_server


class RaisingSink:
    """Raises on every event, on flush and on close."""

    name = "raising"

    def __init__(self) -> None:
        self.calls = 0

    def handle(self, event):
        self.calls += 1
        raise RuntimeError(f"boom on {type(event).__name__}")

    def flush(self):
        raise RuntimeError("boom on flush")

    def close(self):
        raise RuntimeError("boom on close")


class SleepingSink:
    """Takes 20 ms per event: far slower than the controller."""

    name = "sleepy"

    def __init__(self) -> None:
        self.handled = 0
        self.release = threading.Event()

    def handle(self, event):
        self.release.wait(0.02)
        self.handled += 1

    def flush(self):
        pass

    def close(self):
        pass


def test_raising_and_sleeping_sinks_are_isolated_and_counted(controller):
    c = controller("tiny_hybrid")
    prom = PrometheusSink(log=c.log)
    c.log.add_sink(prom)
    raising, sleepy = RaisingSink(), SleepingSink()
    r_runner = c.log.add_sink(raising)
    s_runner = c.log.add_sink(sleepy, max_queue=16)
    server, port = start_metrics_server(prom.registry)
    try:
        t0 = time.perf_counter()
        exp = run_workload(c, rounds=3)
        elapsed = time.perf_counter() - t0
        n = len(c.log)
        # inline, the sleeping sink alone would have taken n * 20 ms
        assert elapsed < n * 0.02 / 2, f"workload took {elapsed:.2f}s for {n} events"
        assert exp.intact, "the loaded data must equal the written data"
        assert exp.ops == {"d2h": 6, "h2d": 3}

        c.log.flush(timeout=30)
        s = parse_exposition(scrape_text(f"http://127.0.0.1:{port}/metrics"))
        assert value(s, m.EXPORTER_ERRORS_TOTAL, sink="raising") == r_runner.errors > 0
        assert value(s, m.EVENTS_DROPPED_TOTAL, sink="raising") == r_runner.dropped == n
        assert value(s, m.EVENTS_DROPPED_TOTAL, sink="sleepy") == s_runner.dropped > 0
        assert s_runner.dropped + sleepy.handled == n
        assert value(s, m.EXPORTER_ERRORS_TOTAL, sink="sleepy") == 0
        assert value(s, m.EVENTS_DROPPED_TOTAL, sink="prometheus") == 0
        assert value(s, m.EXPORTER_ERRORS_TOTAL, sink="prometheus") == 0
        # the healthy sink still saw everything
        assert sum(v for (name, _), v in s.items() if name == m.EVENTS_TOTAL) == n
        for d in ("d2h", "h2d"):
            assert value(s, m.OPERATIONS_TOTAL, direction=d, status="completed") == exp.ops[d]
            for pool in ("kv", "mamba"):
                assert value(s, m.TRANSFER_SLOTS_TOTAL, pool=pool, direction=d) == exp.slots[(pool, d)]
    finally:
        sleepy.release.set()
        server.stop()
    c.close()
    assert r_runner.errors >= 3  # batches, then flush and close raised too


def test_importing_the_exporters_package_pulls_in_no_telemetry_library():
    code = (
        "import sys, hicache_obs.exporters, hicache_obs.exporters.metric_names\n"
        "heavy = [m for m in ('prometheus_client', 'opentelemetry', 'structlog') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from hicache_obs.exporters import PrometheusSink\n"
        "assert 'prometheus_client' in sys.modules\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
