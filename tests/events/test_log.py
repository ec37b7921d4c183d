"""The in-memory log: gap-free seq, subscriber order, bounds, and sink isolation."""

from __future__ import annotations

import logging
import sys
import threading
import time

import pytest

from hicache_obs.errors import ConfigError, SequenceError
from hicache_obs.events import AllocationFailed, AuditViolation, EventLog, ListSink, SlotsFreed


def _emit_n(log: EventLog, n: int) -> None:
    for i in range(n):
        log.emit(AllocationFailed, pool="kv", tier="host", requested=i, available=0)


def test_seq_is_gap_free_and_header_is_stamped() -> None:
    log = EventLog(rank=3)
    _emit_n(log, 5)
    evs = log.events()
    assert [e.seq for e in evs] == [0, 1, 2, 3, 4]
    assert all(e.rank == 3 for e in evs)
    assert all(e.ts_ns > 0 for e in evs)
    assert [e.ts_ns for e in evs] == sorted(e.ts_ns for e in evs)


def test_events_are_frozen() -> None:
    log = EventLog()
    ev = log.emit(SlotsFreed, pool="kv", tier="host", indices=((0, 4),))
    with pytest.raises(AttributeError):
        ev.pool = "mamba"  # type: ignore[misc]


def test_append_rejects_a_seq_out_of_order() -> None:
    log = EventLog()
    _emit_n(log, 2)
    bad = AllocationFailed(seq=5, ts_ns=1, pool="kv", tier="host", requested=1, available=0)
    with pytest.raises(SequenceError, match="seq 5 appended where seq 2 was expected"):
        log.append(bad)
    assert len(log) == 2
    ok = AllocationFailed(seq=2, ts_ns=1, pool="kv", tier="host", requested=1, available=0)
    assert log.append(ok) is ok


def test_bound_evicts_oldest_and_counts_overflow() -> None:
    log = EventLog(capacity=3)
    seen: list[int] = []
    log.subscribe(lambda e: seen.append(e.seq))
    _emit_n(log, 5)
    assert [e.seq for e in log.events()] == [2, 3, 4]
    assert log.overflowed == 2
    assert seen == [0, 1, 2, 3, 4]  # subscribers still see every event


def test_overflow_counts_appended_events_too() -> None:
    log = EventLog(capacity=2)
    _emit_n(log, 2)
    log.append(AllocationFailed(seq=2, ts_ns=1, pool="kv", tier="host", requested=1, available=0))
    _emit_n(log, 1)
    assert [e.seq for e in log.events()] == [2, 3] and log.overflowed == 2
    assert EventLog(capacity=None).overflowed == 0


@pytest.mark.parametrize("field", ["seq", "ts_ns", "rank"])
def test_emit_refuses_a_header_field_and_spends_no_seq(field: str) -> None:
    log = EventLog()
    with pytest.raises(TypeError, match="stamps seq, ts_ns and rank itself"):
        log.emit(AllocationFailed, pool="kv", tier="host", requested=1, available=0, **{field: 7})
    with pytest.raises(TypeError):  # an unknown field: the event is never built
        log.emit(AllocationFailed, pool="kv", tier="host", requested=1, available=0, colour="red")
    _emit_n(log, 1)
    assert [e.seq for e in log.events()] == [0] and len(log) == 1 and log.overflowed == 0


def test_reentrant_emit_is_delivered_after_the_current_event() -> None:
    log = EventLog()
    first: list[int] = []
    second: list[int] = []

    def auditor(ev: object) -> None:
        first.append(ev.seq)  # type: ignore[attr-defined]
        if isinstance(ev, AllocationFailed):
            log.emit(AuditViolation, op=-1, rule="x", pool="kv", role="host", detail="d")

    log.subscribe(auditor)
    log.subscribe(lambda e: second.append(e.seq))
    _emit_n(log, 2)
    assert first == [0, 1, 2, 3]
    assert second == [0, 1, 2, 3]  # every subscriber sees log order


def test_a_raising_subscriber_is_counted_and_isolated() -> None:
    log = EventLog()
    got: list[int] = []

    def boom(ev: object) -> None:
        raise RuntimeError("subscriber bug")

    log.subscribe(boom)
    log.subscribe(lambda e: got.append(e.seq))
    _emit_n(log, 3)
    assert got == [0, 1, 2]
    assert sum(log.subscriber_errors.values()) == 3


def test_unsubscribe() -> None:
    log = EventLog()
    got: list[int] = []
    unsub = log.subscribe(lambda e: got.append(e.seq))
    _emit_n(log, 1)
    unsub()
    _emit_n(log, 1)
    assert got == [0]


def test_sink_gets_backfill_and_every_later_event_in_order() -> None:
    log = EventLog()
    _emit_n(log, 3)
    sink = ListSink()
    runner = log.add_sink(sink)
    _emit_n(log, 100)
    log.flush()
    assert [e.seq for e in sink.events] == list(range(103))
    log.close()
    assert sink.closed
    assert runner.stats()["dropped"] == 0


class _Slow:
    name = "slow"

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.handled = 0

    def handle(self, ev: object) -> None:
        time.sleep(self.delay)
        self.handled += 1

    def flush(self) -> None: ...

    def close(self) -> None: ...


def test_drop_policy_counts_every_drop_and_never_blocks() -> None:
    log = EventLog()
    sink = _Slow(0.01)
    runner = log.add_sink(sink, max_queue=10, policy="drop")
    t0 = time.perf_counter()
    _emit_n(log, 500)
    elapsed = time.perf_counter() - t0
    runner.close(timeout=5)
    st = runner.stats()
    assert st["offered"] == 500
    assert st["handled"] + st["dropped"] == 500
    assert st["dropped"] > 0
    assert sink.handled == st["handled"]
    # the producer never waited for the sink (500 * 10 ms would be 5 s)
    assert elapsed < 2.5


def test_block_policy_loses_nothing() -> None:
    log = EventLog()
    sink = ListSink()
    runner = log.add_sink(sink, max_queue=8, policy="block", block_timeout=5.0)
    _emit_n(log, 2000)
    log.close()
    assert runner.stats()["dropped"] == 0
    assert [e.seq for e in sink.events] == list(range(2000))


def test_raising_sink_counts_errors_and_drops() -> None:
    class Boom:
        name = "boom"

        def handle(self, ev: object) -> None:
            raise ValueError("broken exporter")

        def flush(self) -> None: ...

        def close(self) -> None: ...

    log = EventLog()
    runner = log.add_sink(Boom())
    _emit_n(log, 50)
    log.close()
    st = runner.stats()
    assert st["errors"] >= 1
    assert st["dropped"] == 50
    assert st["handled"] == 0


def test_a_sink_on_the_smallest_ring_may_fall_half_of_it_behind() -> None:
    """The default batch is at most half the ring: on a ring of 4,096 a sink falls up to
    2,048 events behind before it drops (a 4,096-event batch left it room for one)."""
    log = EventLog(ring_size=1 << 12)
    gate = threading.Event()

    class Held(ListSink):
        def handle(self, ev: object) -> None:
            gate.wait(10)
            super().handle(ev)  # type: ignore[arg-type]

    sink = Held()
    runner = log.add_sink(sink)
    _emit_n(log, 1500)  # while the sink is held on its first event
    gate.set()
    log.close()
    assert runner.stats()["dropped"] == 0
    assert [e.seq for e in sink.events] == list(range(1500))
    assert runner.batch_size == 2048 and runner.max_queue == 2048
    with pytest.raises(
        ConfigError, match=r"batch_size must be an int between 1 and 2048 \(half the log's ring of 4096\), got 4096"
    ):
        EventLog(ring_size=1 << 12).add_sink(ListSink(), batch_size=4096)


@pytest.mark.parametrize("bad", [0, 2.5, "10", True])
def test_a_batch_size_that_is_not_a_whole_number_in_range_is_rejected(bad: object) -> None:
    log = EventLog()
    with pytest.raises(ConfigError, match=rf"sink batch_size must be an int between 1 and 32768 .*got {bad!r}$"):
        log.add_sink(ListSink(), batch_size=bad)
    assert log._sinks == []  # no runner was started


@pytest.mark.parametrize("option", ["block_timeout", "interval"])
@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), 7200, "1", None])
def test_a_runner_wait_that_is_not_a_positive_number_of_seconds_is_rejected(option: str, bad: object) -> None:
    log = EventLog()
    with pytest.raises(ConfigError, match=rf"sink {option} must be a number of seconds above 0 and at most 3600, got "):
        log.add_sink(ListSink(), **{option: bad})
    assert log._sinks == []  # no runner was started


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ConfigError, match="'sometimes'"):
        EventLog().add_sink(ListSink(), policy="sometimes")


@pytest.mark.parametrize("bad", [0, -5, 2.5, "10"])
def test_a_queue_bound_below_one_is_rejected(bad: object) -> None:
    log = EventLog()
    with pytest.raises(ConfigError, match=rf"max_queue must be an int >= 1 \(events a sink may fall behind\), got {bad!r}"):
        log.add_sink(ListSink(), max_queue=bad)
    assert log._sinks == []  # no runner was started


def test_concurrent_emitters_get_unique_gap_free_seqs() -> None:
    log = EventLog()
    sink = ListSink()
    log.add_sink(sink, policy="block")

    def worker() -> None:
        _emit_n(log, 500)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    assert sorted(e.seq for e in log.events()) == list(range(2000))
    assert [e.seq for e in sink.events] == list(range(2000))


# ---------------------------------------------------- the compiled emit (_logcore.c)
class _Made:
    """A non-struct event class: any callable taking the fields and the header works."""

    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)


def test_emit_takes_the_class_as_its_only_positional_argument() -> None:
    log = EventLog()
    with pytest.raises(TypeError, match="only positional argument, got 2"):
        log.emit(AllocationFailed, "kv")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="only positional argument, got 0"):
        log.emit()  # type: ignore[call-arg]
    assert len(log) == 0


def test_emit_stamps_the_wall_clock_and_the_current_rank() -> None:
    log = EventLog(rank=2)
    before = time.time_ns()
    a = log.emit(AllocationFailed, pool="kv", tier="host", requested=1, available=0)
    log.rank = 5
    b = log.emit(AllocationFailed, pool="kv", tier="host", requested=1, available=0)
    after = time.time_ns()
    assert before <= a.ts_ns <= b.ts_ns <= after
    assert (a.rank, b.rank) == (2, 5)
    assert (a.seq, b.seq, log.published, log.next_seq) == (0, 1, 2, 2)


def test_emit_with_many_fields_and_many_distinct_field_sets() -> None:
    log = EventLog(capacity=None)
    wide = {f"f{i}": i for i in range(40)}  # more than the compiled path keeps on its stack
    ev = log.emit(_Made, **wide)
    assert {k: getattr(ev, k) for k in wide} == wide and ev.seq == 0
    for i in range(5000):  # more field sets than the name cache holds: it starts over
        ev = log.emit(_Made, **{f"x{i}": i, "pool": "kv"})
        assert getattr(ev, f"x{i}") == i and ev.pool == "kv" and ev.seq == i + 1
    with pytest.raises(TypeError, match=r"emit\(_Made, \.\.\.\) stamps seq, ts_ns and rank itself; got \['a', 'seq'\]"):
        log.emit(_Made, seq=1, a=2)
    assert len(log) == 5001


def test_emit_keeps_no_reference_it_should_not() -> None:
    log = EventLog(capacity=0, ring_size=1 << 12)
    marker = object()
    base = sys.getrefcount(marker)
    for _ in range(3 * log.ring_size):
        log.emit(_Made, value=marker)
    assert sys.getrefcount(marker) == base + log.ring_size  # the ring's events hold it, nothing else
    for _ in range(log.ring_size):
        log.emit(_Made, value=None)
    assert sys.getrefcount(marker) == base
    with pytest.raises(TypeError):
        log.emit(AllocationFailed, pool=marker, nothing=1)
    assert sys.getrefcount(marker) == base


def test_a_subscriber_failure_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    log = EventLog()

    def broken(ev: object) -> None:
        raise ValueError("bad subscriber")

    log.subscribe(broken)
    with caplog.at_level(logging.ERROR, logger="hicache_obs.events"):
        _emit_n(log, 1)
    (rec,) = caplog.records
    assert "broken" in rec.getMessage() and "seq=0" in rec.getMessage()
    assert rec.exc_info is not None and isinstance(rec.exc_info[1], ValueError)
    assert "bad subscriber" in caplog.text and "Traceback" in caplog.text


def test_a_base_exception_in_a_subscriber_propagates_and_leaves_the_log_usable() -> None:
    log = EventLog()
    got: list[int] = []
    stop = [True]

    def interrupting(ev: object) -> None:
        if stop[0]:
            stop[0] = False
            raise KeyboardInterrupt

    log.subscribe(interrupting)
    log.subscribe(lambda e: got.append(e.seq))
    with pytest.raises(KeyboardInterrupt):
        _emit_n(log, 1)
    # appended and delivered to every subscriber (the interrupt is raised once delivery is done)
    assert len(log) == 1 and got == [0]
    # the lock was released and delivery is not stuck in "dispatching"
    t = threading.Thread(target=_emit_n, args=(log, 1))
    t.start()
    t.join(5)
    assert not t.is_alive()
    _emit_n(log, 1)
    assert got == [0, 1, 2] and len(log) == 3


def test_emit_without_init_is_an_error() -> None:
    log = EventLog.__new__(EventLog)
    with pytest.raises(RuntimeError, match="__init__ did not run"):
        log.emit(AllocationFailed, pool="kv", tier="host", requested=1, available=0)


def test_an_event_class_that_emits_while_built_is_refused_not_given_a_repeated_seq() -> None:
    log = EventLog()

    def sneaky(**fields: object) -> _Made:
        log.emit(AllocationFailed, pool="kv", tier="host", requested=1, available=0)  # takes seq 0
        return _Made(**fields)

    with pytest.raises(RuntimeError, match="took seq 0 for another event"):
        log.emit(sneaky, pool="kv")
    assert [e.seq for e in log.events()] == [0] and log.published == 1
    assert log.emit(_Made, pool="kv").seq == 1


def test_append_stores_and_delivers_as_emit_does() -> None:
    log = EventLog(capacity=2)
    first: list[int] = []
    second: list[int] = []

    def appender(ev: object) -> None:
        first.append(ev.seq)  # type: ignore[attr-defined]
        if ev.seq == 0:  # type: ignore[attr-defined]
            log.append(AllocationFailed(seq=1, ts_ns=1, pool="kv", tier="host", requested=1, available=0))
            log.emit(AllocationFailed, pool="kv", tier="host", requested=2, available=0)

    def broken(ev: object) -> None:
        raise ValueError("bad subscriber")

    log.subscribe(appender)
    log.subscribe(broken)
    log.subscribe(lambda e: second.append(e.seq))
    log.append(AllocationFailed(seq=0, ts_ns=1, pool="kv", tier="host", requested=0, available=0))
    assert first == second == [0, 1, 2]  # queued while delivering, then in log order
    assert sum(log.subscriber_errors.values()) == 3 and log.published == 3
    assert [e.seq for e in log.events()] == [1, 2] and log.overflowed == 1
