"""The log's hand-off to feeders (``_logcore.c``): batches from the producer's own thread.

A feeder gets every event exactly once, in order, whatever triggered the hand-off
(a full batch, the interval, ``_handoff_now``, the idle watcher's wait).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from hicache_obs.errors import ConfigError
from hicache_obs.events import AllocationFailed, EventLog


def _emit_n(log: EventLog, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        log.emit(AllocationFailed, pool="kv", tier="host", requested=i, available=0)


class Recorder:
    """A feeder that keeps what it is handed, the way HostFeeder skips what it already took."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (start, how many)
        self.seqs: list[int] = []
        self.next: int | None = None

    def take(self, start: int, events: list[Any]) -> None:
        self.calls.append((start, len(events)))
        assert [e.seq for e in events] == list(range(start, start + len(events)))
        nxt = start if self.next is None else self.next
        self.seqs.extend(e.seq for e in events if e.seq >= nxt)
        self.next = max(nxt, start + len(events))


def test_a_full_batch_is_handed_off_from_the_emitting_thread() -> None:
    log = EventLog()
    threads: list[str] = []
    rec = Recorder()
    take = rec.take

    def on_take(start: int, events: list[Any]) -> None:
        threads.append(threading.current_thread().name)
        take(start, events)

    rec.take = on_take  # type: ignore[method-assign]
    log.attach_feeder(rec, batch=10, interval=3600)
    _emit_n(log, 35)
    assert rec.calls == [(0, 10), (10, 10), (20, 10)]  # the last 5 wait: neither batch nor interval yet
    assert set(threads) == {threading.current_thread().name}
    with log._lock:
        log._handoff_now()
    assert rec.calls[-1] == (30, 5) and rec.seqs == list(range(35))
    with log._lock:
        log._handoff_now()  # nothing waits: no call
    assert len(rec.calls) == 4


def test_the_interval_hands_off_a_slow_producers_events() -> None:
    log = EventLog()
    rec = Recorder()
    log.attach_feeder(rec, batch=1000, interval=0.001)
    _emit_n(log, 1)
    time.sleep(0.005)
    _emit_n(log, 1, start=1)  # the oldest waited past the interval: both go
    assert rec.seqs == [0, 1]


def test_events_emitted_while_handing_off_go_in_the_next_hand_off() -> None:
    log = EventLog()
    rec = Recorder()
    take = rec.take

    def emitting_take(start: int, events: list[Any]) -> None:
        take(start, events)
        if start == 0:
            _emit_n(log, 3, start=100)  # reentrant: no nested hand-off, nothing lost

    rec.take = emitting_take  # type: ignore[method-assign]
    log.attach_feeder(rec, batch=4, interval=3600)
    _emit_n(log, 4)
    assert rec.calls == [(0, 4)] and log.published == 7
    _emit_n(log, 1)
    assert rec.calls == [(0, 4), (4, 4)] and rec.seqs == list(range(8))


def test_a_ring_lapped_before_the_hand_off_starts_where_the_ring_does() -> None:
    log = EventLog(ring_size=4096)
    rec = Recorder()
    log.attach_feeder(rec, batch=2048, interval=3600)
    _emit_n(log, 6001)  # the hand-offs at 2048 and 4096 ran as usual
    log._set_handoff(log._handoff, 0, 2048, 3600.0)  # rewind past what the ring holds
    with log._lock:
        log._handoff_now()
    start, n = rec.calls[-1]
    assert (start, n) == (6001 - 4096, 4096)


def test_a_feeder_attached_later_is_backfilled_and_then_shares_the_cadence() -> None:
    log = EventLog()
    first = Recorder()
    log.attach_feeder(first, batch=8, interval=3600)
    _emit_n(log, 12)  # first got 0..7; 8..11 wait
    second = Recorder()
    assert log.attach_feeder(second, batch=100, interval=3600) == 0  # backfill from the ring
    assert second.seqs == list(range(8))
    _emit_n(log, 4, start=12)  # 8..15: a batch of the smaller cadence, to both
    assert first.seqs == second.seqs == list(range(16))
    third = Recorder()
    assert log.attach_feeder(third, backfill=False) == 16
    _emit_n(log, 8, start=16)
    assert third.seqs == list(range(16, 24)) and first.seqs == list(range(24))
    log.detach_feeder(first)
    _emit_n(log, 8, start=24)
    assert len(first.seqs) == 24 and second.seqs == list(range(32))
    log.detach_feeder(second)
    log.detach_feeder(third)
    _emit_n(log, 8, start=32)
    assert len(third.seqs) == 16  # no feeder, no hand-off
    assert second in log.sinks  # listed, so log.flush/close still reach it


def test_a_feeder_that_raises_is_logged_and_the_others_still_get_their_batch(caplog: Any) -> None:
    log = EventLog()

    class Broken:
        name = "broken"

        def take(self, start: int, events: list[Any]) -> None:
            raise RuntimeError("boom")

    rec = Recorder()
    log.attach_feeder(Broken(), batch=2, interval=3600)
    log.attach_feeder(rec, batch=2, interval=3600)
    _emit_n(log, 4)
    assert rec.seqs == [0, 1, 2, 3] and len(log) == 4
    assert "feeder broken failed on events 0..1" in caplog.text


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"batch": 0}, "feeder batch must be between 1 and 32768 events, got 0"),
        ({"batch": 40000}, "feeder batch must be between 1 and 32768 events, got 40000"),
        ({"interval": 0}, "feeder interval must be above 0 and at most 3600 seconds, got 0"),
    ],
)
def test_bad_feeder_options_are_config_errors(kw: dict[str, Any], message: str) -> None:
    log = EventLog()
    with pytest.raises(ConfigError, match=message):
        log.attach_feeder(Recorder(), **kw)
    with pytest.raises(ConfigError, match="needs a take"):
        log.attach_feeder(object())
    assert log.sinks == []


def test_the_compiled_setter_checks_its_arguments() -> None:
    log = EventLog()
    with pytest.raises(TypeError, match="callable or None"):
        log._set_handoff(5, 0, 1, 1.0)
    with pytest.raises(ValueError, match="between 1 and half the ring"):
        log._set_handoff(print, 0, 0, 1.0)
    with pytest.raises(ValueError, match="interval must be above 0"):
        log._set_handoff(print, 0, 1, -1.0)
    with pytest.raises(ValueError, match="a seq >= 0"):
        log._set_handoff(print, -1, 1, 1.0)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        log._wait_handoff(-1.0, 0, -1)


# ------------------------------------------------------------- the idle watcher's wait
def test_wait_handoff_says_when_an_idle_producers_events_are_due() -> None:
    log = EventLog()
    rec = Recorder()
    log.attach_feeder(rec, batch=1000, interval=0.02)
    r, w = os.pipe()
    try:
        assert log._wait_handoff(0.01, r, -1) == 0  # nothing waits: times out
        _emit_n(log, 3)
        t0 = time.monotonic()
        assert log._wait_handoff(5.0, r, -1) == 1  # due once the interval passed
        assert time.monotonic() - t0 < 4.0  # long before its timeout (not a speed bound)
        with log._lock:
            log._handoff_now()
        assert rec.seqs == [0, 1, 2]
        assert log._wait_handoff(0.01, r, -1) == 0
        assert log._wait_handoff(5.0, r, w) == 2  # an empty pipe is writable
        os.write(w, b"x")
        assert log._wait_handoff(5.0, r, -1) == 3  # the stop fd
        os.read(r, 1)
        log.detach_feeder(rec)
        _emit_n(log, 3, start=3)
        assert log._wait_handoff(0.05, r, -1) == 0  # no feeder: nothing is ever due
    finally:
        os.close(r)
        os.close(w)


def test_wait_handoff_lets_other_threads_run() -> None:
    log = EventLog()
    log.attach_feeder(Recorder(), batch=1000, interval=3600)
    r, w = os.pipe()
    counted = [0]

    def waiter() -> None:
        log._wait_handoff(0.3, r, -1)

    t = threading.Thread(target=waiter)
    t.start()
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:  # Python work in this thread while the other waits
        counted[0] += 1
    t.join()
    os.close(r)
    os.close(w)
    assert counted[0] > 10_000  # it held no GIL (holding it, this loop would not have run)
