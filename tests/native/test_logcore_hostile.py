"""``hicache_obs._logcore``: what Python can change under the compiled log is checked.

Each case once crashed or corrupted the log; it runs in a child interpreter, so that
a regression is a failed test with the child's signal, not a dead test run.
"""

from __future__ import annotations

import textwrap

import pytest
from native_kit import crashed, run_code

PRELUDE = """
from hicache_obs.events import EventLog, SlotsFreed
def ev(log, i=0):
    return log.emit(SlotsFreed, pool="kv", tier="host", indices=((i, 1),), reason="evict", op=i)
"""


def _run(body: str) -> str:
    proc = run_code(PRELUDE + textwrap.dedent(body))
    assert not crashed(proc), f"the child crashed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("change", ["log._ring.clear()", "log._ring.append(None)", "del log._ring[5:]"])
def test_a_resized_ring_is_an_error_not_a_segfault(change: str) -> None:
    out = _run(f"""
        log = EventLog(ring_size=1 << 12)
        ev(log, 0)
        {change}
        try:
            ev(log, 1)
        except RuntimeError as exc:
            print("refused:", exc)
        print("seq", log.next_seq, "published", log.published)
    """)
    assert "refused: the log's ring was resized:" in out and "bound with 4096; the event is not stored" in out
    assert "seq 1 published 1" in out  # nothing spent


def test_a_ring_resized_by_a_blocking_runner_is_caught_before_the_store() -> None:
    out = _run("""
        log = EventLog(ring_size=1 << 12)
        class Shrinker:
            def wait_for_room(self):
                log._ring.clear()
        log._blocking.append(Shrinker())
        try:
            ev(log, 0)
        except RuntimeError as exc:
            print("refused:", exc)
    """)
    assert "refused: the log's ring was resized: 0 slots, bound with 4096" in out


def test_the_seq_cannot_be_set_to_wrap_or_go_back() -> None:
    out = _run("""
        log = EventLog()
        for v in (2**63 - 1, 2**63, -1, -(2**63), "3", 1.5):
            try:
                log._seq = v
                print("accepted", v)
            except (ValueError, TypeError) as exc:
                print(type(exc).__name__, exc)
        log._seq = 2**63 - 2
        print("last", ev(log).seq)
        try:
            ev(log)
        except OverflowError as exc:
            print("spent:", exc)
        print("next", log.next_seq)
    """)
    assert "accepted" not in out
    assert out.count("ValueError _seq must be in 0..9223372036854775806") == 4
    assert out.count("TypeError _seq must be an int") == 2
    assert f"last {2**63 - 2}" in out
    assert "spent: emit(): the log's seq space is spent (next seq 9223372036854775807)" in out
    assert f"next {2**63 - 1}" in out


def test_published_cannot_run_ahead_of_the_seqs_spent() -> None:
    out = _run("""
        log = EventLog()
        ev(log); ev(log)
        for v in (3, -1, 2**64):
            try:
                log.published = v
                print("accepted", v)
            except ValueError as exc:
                print(exc)
        try:
            log._seq = 1  # behind what is published: those seqs are taken
        except ValueError as exc:
            print(exc)
        print("state", log.next_seq, log.published)
    """)
    assert "accepted" not in out
    assert "published must be in 0..2, got 3" in out and "published must be in 0..2, got -1" in out
    assert "_seq must be in 2..9223372036854775806, got 1" in out
    assert "state 2 2" in out


def test_publish_takes_only_the_seq_just_spent() -> None:
    out = _run("""
        from hicache_obs.events import SlotsFreed
        log = EventLog()
        ev(log)
        for seq in (0, 5, 2**63 - 1):
            e = SlotsFreed(seq=seq, ts_ns=0, pool="kv", tier="host", indices=((0, 1),), reason="evict", op=0)
            try:
                log._publish(e)
                print("accepted", seq)
            except ValueError as exc:
                print(exc)
        print("state", log.next_seq, log.published)
    """)
    assert "accepted" not in out
    assert "_publish(): the event's seq must be the one just spent (0, 1 published), got 0" in out
    assert "got 9223372036854775807" in out and "state 1 1" in out


def test_an_event_class_that_returns_a_non_event_spends_no_seq() -> None:
    out = _run("""
        log = EventLog()
        got = []
        log.subscribe(got.append)
        class Stamp:
            def __init__(self, **kw): self.__dict__.update(kw)
        for cls in (lambda **kw: None, lambda **kw: 7, lambda **kw: Stamp(**{**kw, "seq": 99}), lambda **kw: Stamp(a=1)):
            try:
                log.emit(cls, a=1)
                print("accepted")
            except TypeError as exc:
                print(exc)
        print("state", log.next_seq, log.published, len(got), len(log.events()))
        print("then", ev(log).seq)
    """)
    assert "accepted" not in out
    assert "emit(): the event class returned NoneType whose seq is None, not the seq 0 it was given" in out
    assert "returned int whose seq is None" in out and "returned Stamp whose seq is 99" in out
    assert "state 0 0 0 0" in out and "then 0" in out


def test_a_keyboard_interrupt_in_a_subscriber_keeps_log_order_for_every_subscriber() -> None:
    """The issue's case: a emits on e0, b raises KeyboardInterrupt on e0: was a0 b0 a2 b2 a1 b1."""
    out = _run("""
        log = EventLog()
        seen = []
        def a(e):
            seen.append(("a", e.seq))
            if e.seq == 0:
                ev(log, 1)
        def b(e):
            seen.append(("b", e.seq))
            if e.seq == 0:
                raise KeyboardInterrupt
        log.subscribe(a); log.subscribe(b)
        try:
            ev(log, 0)
        except KeyboardInterrupt:
            print("interrupted")
        ev(log, 2)
        print(" ".join(f"{n}{s}" for n, s in seen))
        print("pending", len(log._pending), "dispatching", log._dispatching)
    """)
    assert "interrupted" in out
    assert "a0 b0 a1 b1 a2 b2" in out
    assert "pending 0 dispatching False" in out


def test_only_the_first_of_several_interrupts_is_raised_and_delivery_completes() -> None:
    out = _run("""
        log = EventLog()
        seen = []
        def boom(e):
            raise SystemExit(e.seq)
        def a(e):
            if e.seq < 3:
                ev(log, e.seq + 1)
        log.subscribe(a); log.subscribe(boom); log.subscribe(lambda e: seen.append(e.seq))
        try:
            ev(log, 0)
        except SystemExit as exc:
            print("raised", exc.code)
        print(seen)
    """)
    assert "raised 0" in out and "[0, 1, 2, 3]" in out


def test_after_close_events_stay_in_the_log_reach_no_sink_and_are_counted() -> None:
    out = _run("""
        import logging
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        from hicache_obs.events._sinks import ListSink
        log = EventLog()
        got = []
        log.subscribe(lambda e: got.append(e.seq))
        sink = ListSink()
        runner = log.add_sink(sink)
        ev(log)
        log.close()
        ev(log); ev(log)
        log.flush()
        print("state", log.next_seq, log.published, log._closed, log.closed_at, log.dropped_after_close)
        print("sink", [e.seq for e in sink.events], runner.stats())
        print("subscriber", got)
        try:
            log.add_sink(ListSink())
        except ValueError as exc:
            print(exc)
        for name in ("_dispatching", "_closed", "_closed_at", "_after_close", "_handoff_next"):
            try:
                setattr(log, name, 0)
                print("set", name)
            except AttributeError:
                print("read-only", name)
    """)
    assert "state 3 1 True 1 2" in out  # published stays where close() stopped the sinks
    assert "sink [0] {'offered': 1, 'handled': 1, 'dropped': 0, 'errors': 0, 'queued': 0}" in out
    assert "subscriber [0, 1, 2]" in out
    assert "add_sink(ListSink) on a closed EventLog: no sink gets events any more" in out
    assert out.count("read-only") == 5


def test_bind_refuses_what_the_core_cannot_use() -> None:
    out = _run("""
        import threading
        from collections import deque
        from hicache_obs._logcore import LogCore
        c = LogCore()
        kw = dict(events=deque(), subscribers=[], blocking=[], pending=deque(), lock=threading.RLock())
        for ring in ([], [None] * 3, "ab"):
            try:
                c._bind(ring=ring, **kw)
                print("bound", ring)
            except (ValueError, TypeError) as exc:
                print(type(exc).__name__, exc)
        for call in (lambda: c.emit(dict), lambda: c._publish(1), lambda: c._handoff_now(), lambda: c._set_handoff(None, 0, 1, 1.0)):
            try:
                call()
                print("ran")
            except RuntimeError as exc:
                print("RuntimeError", exc)
    """)
    assert "bound" not in out
    assert "ValueError the ring's length must be a power of two, got 0" in out and "got 3" in out
    assert out.count("__init__ did not run") == 3 and "ran" in out  # _handoff_now: nothing to hand off


def test_gap_free_run_on_hostile_lists() -> None:
    out = _run("""
        from hicache_obs._logcore import gap_free_run
        class E:
            def __init__(self, seq, rank=0): self.seq, self.rank = seq, rank
        lst = []
        class Shrink:
            rank = 0
            @property
            def seq(self):
                lst.clear()  # the list being read
                return 0
        lst.extend([Shrink(), E(1), E(2)])
        for arg in ([E(2**63 - 1), E(2**63)], [E(-(2**63)), E(2**63 - 1)], [E(2**63 - 1), E(-(2**63))], [E("a")],
                    [object()], (E(0),), [E(5, rank=1), E(6, rank=1)]):
            try:
                print(gap_free_run(arg))
            except (TypeError, AttributeError) as exc:
                print(type(exc).__name__)
        print(gap_free_run(lst), len(lst))
    """)
    assert out.split("\n")[:8] == [
        "None",
        "None",
        "None",
        "TypeError",
        "AttributeError",
        "TypeError",
        "(1, 5)",
        "(0, 0) 0",
    ]
