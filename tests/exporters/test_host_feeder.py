"""HostFeeder: a sink host fed from the producer's thread, through a pipe that never blocks it.

Every event is accounted for (``offered == handled + dropped + queued``), a stalled or
dead child costs counted drops and never the controller, and an idle producer's
events still reach the child (its watcher) without a flush.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import msgspec
import pytest
from exporters_kit import parse_exposition, scrape_text, value

from hicache_obs.errors import ConfigError
from hicache_obs.events import AllocationFailed, EventLog
from hicache_obs.exporters import metric_names as m
from hicache_obs.exporters.sinkhost import SinkHost, SinkHostError, add_sink_host
from hicache_obs.exporters.sinkhost._feeder import HostFeeder


def _emit_n(log: EventLog, n: int) -> None:
    for i in range(n):
        log.emit(AllocationFailed, pool="kv", tier="host", requested=i, available=0)


def _balanced(st: dict[str, int]) -> bool:
    return st["offered"] == st["handled"] + st["dropped"] + st["queued"]


def _wait_until(cond: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def test_an_idle_producers_events_reach_the_host_without_a_flush() -> None:
    log = EventLog()
    feeder = add_sink_host(log, [{"sink": "prometheus"}], interval=0.02)
    try:
        _emit_n(log, 3)  # far below a batch: the producer hands nothing over itself
        url = f"http://127.0.0.1:{feeder.sink.metrics_port}/metrics"

        def arrived() -> bool:
            s = parse_exposition(scrape_text(url))
            return value(s, m.EVENTS_TOTAL, type="AllocationFailed") == 3

        assert _wait_until(arrived), "the watcher did not hand the idle producer's events over"
        st = feeder.stats()
        assert st == {"offered": 3, "handled": 3, "dropped": 0, "errors": 0, "queued": 0}
    finally:
        log.close()
    assert not feeder._thread.is_alive() or _wait_until(lambda: not feeder._thread.is_alive())
    assert feeder.sink.wait(10) == 0


def test_batches_go_from_the_producers_thread_and_a_flush_settles_the_rest() -> None:
    log = EventLog()
    feeder = add_sink_host(log, [{"sink": "prometheus"}], batch=100, interval=3600)
    _emit_n(log, 250)
    assert feeder.handled == 200 and feeder.stats()["queued"] == 50  # two batches written, 50 wait
    assert feeder.flush()
    assert feeder.sink.stats["events"] == 250 == feeder.handled
    assert feeder.sink.stats["cpu_s"] > 0  # the host's own CPU time since it was ready
    log.close()
    assert feeder.stats() == {"offered": 250, "handled": 250, "dropped": 0, "errors": 0, "queued": 0}
    assert feeder.sink.stats["events"] == 250
    log.close()  # idempotent
    feeder.close()


def test_a_stalled_host_costs_counted_drops_and_the_producer_goes_on() -> None:
    log = EventLog()
    host = SinkHost([{"sink": "prometheus"}])
    feeder = HostFeeder(host, log, max_queue=2000, batch=256)
    os.kill(host.pid, signal.SIGSTOP)
    try:
        _emit_n(log, 235 * 256)  # far more than the pipe (1 MiB) and the queue hold; whole batches
        st = feeder.stats()
        assert st["dropped"] > 0 and st["errors"] == 0 and _balanced(st)
        assert host.queued_events <= 2000  # the bound held
        assert st["handled"] > 0  # what the pipe took before it filled
        # the producer handed everything over: all that lags waits in the queue (read while
        # the child is stopped and the pipe full, so nothing drains between the two reads)
        assert feeder.lag() == host.queued_events > 0
    finally:
        os.kill(host.pid, signal.SIGCONT)
    # the producer is idle: the watcher alone writes the queued frames as the child drains the pipe
    assert _wait_until(lambda: host.queued_events == 0)
    assert feeder.flush()  # the child takes the rest and answers
    st = feeder.stats()
    assert st["queued"] == 0 and _balanced(st) and st["offered"] == 235 * 256
    assert host.stats["events"] == st["handled"]  # the child got exactly what was written
    _emit_n(log, 10)  # and carries on
    log.close()
    assert feeder.stats()["handled"] == st["handled"] + 10 == host.stats["events"]


def test_a_blocking_feeder_makes_the_producer_wait_then_drops() -> None:
    log = EventLog()
    host = SinkHost([{"sink": "prometheus"}])
    feeder = HostFeeder(host, log, policy="block", max_queue=500, block_timeout=0.05, batch=256)
    os.kill(host.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        _emit_n(log, 40_000)
        waited = time.monotonic() - t0
        st = feeder.stats()
        assert st["dropped"] > 0 and _balanced(st)
        assert waited >= 0.05  # it waited for the pipe at least once before dropping
    finally:
        os.kill(host.pid, signal.SIGCONT)
    log.close()
    st = feeder.stats()
    assert st["queued"] == 0 and _balanced(st) and host.stats["events"] == st["handled"]


def test_a_host_that_cannot_close_in_time_is_killed_and_what_it_had_queued_counted(caplog: Any) -> None:
    log = EventLog()
    host = SinkHost([{"sink": "prometheus"}])
    feeder = HostFeeder(host, log, batch=256)
    os.kill(host.pid, signal.SIGSTOP)  # never continued: close() has to give up on it
    _emit_n(log, 100 * 256)  # more than the pipe holds: frames wait in the queue
    assert host.queued_events > 0
    feeder.close(timeout=0.2)
    st = feeder.stats()
    assert st["errors"] == 1 and st["queued"] == 0 and _balanced(st) and st["dropped"] > 0
    assert host.wait(10) == -signal.SIGKILL
    assert "did not close cleanly" in caplog.text


def test_a_dead_host_turns_batches_into_counted_errors(caplog: Any) -> None:
    log = EventLog()
    feeder = add_sink_host(log, [{"sink": "prometheus"}], batch=64)
    _emit_n(log, 100)
    assert feeder.flush()
    os.kill(feeder.sink.pid, signal.SIGKILL)
    assert feeder.sink.wait(10) == -signal.SIGKILL
    _emit_n(log, 1000)  # the producer never sees the dead child
    st = feeder.stats()
    assert st["errors"] >= 1 and st["handled"] == 100 and _balanced(st)
    assert not feeder.flush()
    log.close()
    st = feeder.stats()
    assert st["offered"] == 1100 and st["handled"] + st["dropped"] == 1100 and st["queued"] == 0
    assert f"sink sinkhost closed: 1100 offered, 100 handled, 1000 dropped, {st['errors']} errors" in caplog.text


class Odd(msgspec.Struct, frozen=True, tag=True):
    seq: int
    ts_ns: int
    rank: int
    payload: Any


def test_a_batch_the_wire_cannot_carry_is_counted_lost_and_the_next_goes(caplog: Any) -> None:
    log = EventLog()
    feeder = add_sink_host(log, [{"sink": "prometheus"}], batch=10, interval=3600)
    _emit_n(log, 5)
    log.emit(Odd, payload=object())  # msgpack cannot encode it: its batch (10 events) is lost
    _emit_n(log, 14)
    log.close()
    st = feeder.stats()
    assert st == {"offered": 20, "handled": 10, "dropped": 10, "errors": 1, "queued": 0}
    assert feeder.sink.stats["events"] == 10
    assert "sink host sinkhost: encode of 10 events failed" in caplog.text


def test_two_hosts_on_one_log_each_get_every_event() -> None:
    log = EventLog()
    a = add_sink_host(log, [{"sink": "prometheus"}], batch=50)
    _emit_n(log, 120)
    b = add_sink_host(log, [{"sink": "prometheus"}], batch=200)  # backfilled from the ring
    _emit_n(log, 130)
    log.close()
    assert a.sink.stats["events"] == b.sink.stats["events"] == 250
    assert a.stats()["handled"] == b.stats()["handled"] == 250


def test_a_closed_host_takes_nothing_more() -> None:
    host = SinkHost([{"sink": "prometheus"}])
    host.close()
    frame = host.encode([])
    with pytest.raises(SinkHostError, match="is closed"):
        host.push(frame, 0, 100, None)
    with pytest.raises(SinkHostError, match="is closed"):
        host.flush()
    host.close()  # idempotent
    assert host.wait(10) == 0


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"policy": "wait"}, "sink queue policy 'wait' is not 'drop' or 'block'"),
        ({"max_queue": 0}, "max_queue must be at least 1 event, got 0"),
        ({"block_timeout": -1}, "block_timeout must be >= 0 seconds, got -1"),
        ({"batch": 0}, "feeder batch must be between 1"),
    ],
)
def test_bad_feeder_options_are_config_errors(kw: dict[str, Any], message: str) -> None:
    log = EventLog()
    host = SinkHost([{"sink": "prometheus"}])
    try:
        with pytest.raises(ConfigError, match=message):
            HostFeeder(host, log, **kw)
        assert log.sinks == []
    finally:
        host.close()
