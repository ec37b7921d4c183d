"""``EventLog.close()`` while other threads emit: nothing appended is lost or uncounted.

Once ``close`` holds the log's lock, every later ``emit``/``append`` raises
``LogClosedError`` and spends no seq. Every event the log did append reached every
sink or was counted as dropped, and each runner's ``stats()`` adds up at every instant
(``offered == handled + dropped + queued``; ``handled <= offered``), read by a thread
that polls them while the producers and workers race.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_obs.errors import LogClosedError
from hicache_obs.events import EventLog, SlotsFreed
from hicache_obs.events.replay import read_segments
from hicache_obs.events.sinks import ListSink
from hicache_obs.events.store import JsonlStore

EMITTERS = 4


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads every microsecond: the races show within a run."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class SlowSink(ListSink):
    """Sleeps on every batch, so its runner falls behind and drops (policy drop)."""

    name = "slow"

    def handle_batch(self, events: list[Any]) -> None:
        time.sleep(0.002)
        super().handle_batch(events)


def _emit(log: EventLog, i: int) -> None:
    log.emit(SlotsFreed, pool="kv", tier="host", indices=((i, 1),), reason="evict", op=i)


def _emitter(log: EventLog, spent: list[int], errors: list[BaseException], start: threading.Event) -> None:
    start.wait()
    n = 0
    while True:
        try:
            _emit(log, n)
        except LogClosedError:
            break
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
    start = threading.Event()
    threads = [threading.Thread(target=_emitter, args=(log, spent, errors, start)) for _ in range(EMITTERS)]
    poller = threading.Thread(target=poll)
    poller.start()
    for t in threads:
        t.start()
    start.set()
    target = 3000 + 2000 * round_
    while log.published < target and not errors:
        time.sleep(0.001)
    log.close(timeout=30)
    for t in threads:
        t.join(30)
    polling.set()
    poller.join(30)

    assert not errors, errors
    assert not bad, bad[:3]
    n = len(log)
    assert sum(spent) == n >= target  # every emit that returned appended one event; no seq lost
    assert [e.seq for e in log.events()] == list(range(n))
    # the fast sink and the store got every event, once, in order; nothing dropped
    assert [e.seq for e in fast.events] == list(range(n))
    assert store.events_written == n
    on_disk = read_segments(store.paths)
    assert [e.seq for e in on_disk.events] == list(range(n))
    for r in runners:
        s = r.stats()
        _check(s, r.name)
        assert s["offered"] == n and s["queued"] == 0, (r.name, s)
    assert runners[0].stats()["dropped"] == 0 and runners[2].stats()["dropped"] == 0
    s = runners[1].stats()
    assert s["handled"] == len(slow.events) and s["dropped"] == n - len(slow.events)
    # after close: an error, and nothing spent
    with pytest.raises(LogClosedError, match=r"SlotsFreed on a closed EventLog"):
        _emit(log, 0)
    with pytest.raises(LogClosedError, match="on a closed EventLog"):
        log.append(SlotsFreed(seq=n, ts_ns=0, pool="kv", tier="host", indices=((0, 1),), reason="evict", op=0))
    assert len(log) == n and log.published == n


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


def test_an_emit_racing_close_is_either_appended_and_delivered_or_refused() -> None:
    """The boundary itself: an emit blocked on the lock while close runs is refused."""
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
        try:
            outcome.append(log.emit(SlotsFreed, pool="kv", tier="host", indices=((2, 1),), reason="evict", op=2))
        except LogClosedError as exc:
            outcome.append(exc)

    closer = threading.Thread(target=log.close)
    closer.start()
    waiter = threading.Thread(target=late)
    waiter.start()
    release.set()
    for t in (holder, closer, waiter):
        t.join(30)
    assert len(outcome) == 1
    n = len(log)
    assert [e.seq for e in sink.events] == list(range(n))
    if isinstance(outcome[0], LogClosedError):
        assert n == 2
    else:
        assert n == 3
