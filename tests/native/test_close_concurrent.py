"""``EventLog.close()`` while other threads emit: nothing appended is lost or uncounted.

``close`` fixes the sinks' stopping point under the log's lock (``closed_at``): every
event below it reached every sink or was counted as dropped by that sink's runner; every
event appended later is still in the log (and its subscribers) and is counted in
``dropped_after_close``. Each runner's ``stats()`` adds up at every instant
(``offered == handled + dropped + queued``; ``handled <= offered``), read by a thread
that polls them while the producers and workers race.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hicache_obs.events import EventLog, SlotsFreed
from hicache_obs.events._replay import read_segments
from hicache_obs.events._sinks import ListSink
from hicache_obs.events._store import JsonlStore

EMITTERS = 4



class SlowSink(ListSink):
    """Sleeps on every batch, so its runner falls behind and drops (policy drop)."""

    name = "slow"

    def handle_batch(self, events: list[Any]) -> None:
        time.sleep(0.002)
        super().handle_batch(events)


def _emit(log: EventLog, i: int) -> None:
    log.emit(SlotsFreed, pool="kv", tier="host", indices=((i, 1),), reason="evict", op=i)


def _emitter(
    log: EventLog, spent: list[int], errors: list[BaseException], start: threading.Event, stop: threading.Event
) -> None:
    start.wait()
    n = 0
    while not stop.is_set():
        try:
            _emit(log, n)
        except BaseException as exc:  # reported by the test
            errors.append(exc)
            break
        n += 1
    spent.append(n)


def _check(stats: dict[str, int], where: str) -> None:
    assert stats["offered"] == stats["handled"] + stats["dropped"] + stats["queued"], (where, stats)
    assert 0 <= stats["handled"] <= stats["offered"] and stats["queued"] >= 0, (where, stats)


@pytest.mark.parametrize("round_", range(3))
def test_close_while_threads_emit_loses_nothing_and_counts_add_up(
    fast_switching: None, tmp_path: Path, round_: int
) -> None:
    log = EventLog(capacity=None)  # the default ring: room for a max_queue beyond this run's events
    fast = ListSink()
    slow = SlowSink()
    store = JsonlStore(tmp_path / "store", max_bytes=1 << 30)
    runners = [
        log.add_sink(fast),
        log.add_sink(slow, max_queue=256, batch_size=64),
        log.add_sink(store, batch_size=512),
    ]
    bad: list[tuple[str, dict[str, int]]] = []
    polling = threading.Event()

    def poll() -> None:  # stats read at any instant must add up
        while not polling.is_set():
            for r in runners:
                s = r.stats()
                if s["offered"] != s["handled"] + s["dropped"] + s["queued"] or s["handled"] > s["offered"]:
                    bad.append((r.name, s))

    spent: list[int] = []
    errors: list[BaseException] = []
    start, stop = threading.Event(), threading.Event()
    threads = [threading.Thread(target=_emitter, args=(log, spent, errors, start, stop)) for _ in range(EMITTERS)]
    poller = threading.Thread(target=poll)
    poller.start()
    for t in threads:
        t.start()
    start.set()
    target = 3000 + 2000 * round_
    while log.published < target and not errors:
        time.sleep(0.001)
    log.close(timeout=30)
    closed_at = log.closed_at
    assert closed_at is not None
    while len(log) < closed_at + 500 and not errors:  # the emitters carry on after close
        time.sleep(0.001)
    stop.set()
    for t in threads:
        t.join(30)
    polling.set()
    poller.join(30)

    assert not errors, errors
    assert not bad, bad[:3]
    n = len(log)
    assert sum(spent) == n and closed_at >= target  # every emit that returned appended one event
    assert [e.seq for e in log.events()] == list(range(n))
    assert log.dropped_after_close == n - closed_at >= 500  # appended after close: in the log, counted
    assert log.published == closed_at  # and not in the ring, where a runner still reading would lose events
    # the fast sink and the store got every event up to the stopping point, once, in order
    assert [e.seq for e in fast.events] == list(range(closed_at))
    assert store.events_written == closed_at, [r.stats() for r in runners]
    on_disk = read_segments(store.paths)
    assert [e.seq for e in on_disk.events] == list(range(closed_at))
    for r in runners:
        s = r.stats()
        _check(s, r.name)
        assert s["offered"] == closed_at and s["queued"] == 0, (r.name, s)
    assert runners[0].stats()["dropped"] == 0 and runners[2].stats()["dropped"] == 0
    s = runners[1].stats()
    assert s["handled"] == len(slow.events) and s["dropped"] == closed_at - len(slow.events)
    # nothing lost between the log and its sinks: offered + counted after close == every event
    assert all(r.stats()["offered"] + log.dropped_after_close == n for r in runners)


def test_a_runner_closed_on_its_own_counts_what_the_producer_publishes_later(fast_switching: None) -> None:
    """``SinkRunner.close()`` while the log stays open: what comes later is not the runner's."""
    log = EventLog(capacity=None)  # the default ring: max_queue far beyond what this test emits
    sink = ListSink()
    runner = log.add_sink(sink, batch_size=32)
    stop = threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set():
            _emit(log, i)
            i += 1

    t = threading.Thread(target=produce)
    t.start()
    while log.published < 2000:
        time.sleep(0.001)
    runner.close(timeout=30)
    at_close = runner.stats()
    while log.published < at_close["offered"] + 2000:
        time.sleep(0.001)
    stop.set()
    t.join(30)
    s = runner.stats()
    _check(s, "after")
    assert s == at_close and s["queued"] == 0 and s["dropped"] == 0
    assert [e.seq for e in sink.events] == list(range(s["offered"]))  # never more than offered
    log.close()


def test_an_emit_racing_close_is_either_delivered_or_counted() -> None:
    """The boundary itself: an emit waiting on the lock while close runs."""
    log = EventLog(capacity=None)
    sink = ListSink()
    log.add_sink(sink)
    _emit(log, 0)
    entered = threading.Event()
    release = threading.Event()
    outcome: list[object] = []

    def blocker(ev: Any) -> None:
        if ev.op == 1:
            entered.set()
            release.wait(10)

    log.subscribe(blocker)
    holder = threading.Thread(target=_emit, args=(log, 1))  # holds the lock inside a subscriber
    holder.start()
    assert entered.wait(10)

    def late() -> None:
        outcome.append(log.emit(SlotsFreed, pool="kv", tier="host", indices=((2, 1),), reason="evict", op=2))

    closer = threading.Thread(target=log.close)
    closer.start()
    waiter = threading.Thread(target=late)
    waiter.start()
    release.set()
    for t in (holder, closer, waiter):
        t.join(30)
    assert len(outcome) == 1 and len(log) == 3
    closed_at = log.closed_at
    assert closed_at in (2, 3)  # the late emit got the lock before close, or after it
    assert [e.seq for e in sink.events] == list(range(closed_at))
    assert log.dropped_after_close == 3 - closed_at
