"""The compiled event-log core (``hicache_obs/_logcore.c``) against its pure twin
(``hicache_obs/events/_logcore_py.py``): random programs of emits (events, classes that
fail, return a non-event, ignore the seq, emit while built), appends, subscribers (that
record, raise, emit from inside, interrupt), hand-offs, closes, a resized ring and
hostile counters must give the same results and errors, the same events in the same
order to every subscriber, the same failure reports and the same hand-off batches;
stages (that find nothing, find something, raise, interrupt, emit) the same events stored,
in the same order, and the same findings placed.
Then ``gap_free_run`` on random event lists, and the idle hand-off watcher: the same
answers, and no spinning while it waits.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_obs import _logcore as c_core
from hicache_obs.events import _logcore_py as py_core

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CAUGHT = (Exception, KeyboardInterrupt)


def outcome(fn: Any, *args: Any, **kw: Any) -> tuple[Any, ...]:
    try:
        out = fn(*args, **kw)
    except CAUGHT as exc:
        return ("raised", type(exc).__name__, str(exc))
    return ("ok", getattr(out, "seq", out))


class Ev:
    __slots__ = ("seq", "ts_ns", "rank", "fields")

    def __init__(self, seq: int, ts_ns: int, rank: Any, **fields: Any) -> None:
        self.seq, self.ts_ns, self.rank, self.fields = seq, ts_ns, rank, fields


class Boom(Exception):
    pass


def _classes(core: Any) -> dict[str, Any]:
    def emits_while_built(**kw: Any) -> Ev:
        core.emit(Ev, inner=1)
        return Ev(**kw)

    return {
        "event": Ev,
        "none": lambda **kw: None,
        "wrong_seq": lambda **kw: Ev(**{**kw, "seq": kw["seq"] + 1}),
        "raises": lambda **kw: (_ for _ in ()).throw(Boom("no event")),
        "emits_while_built": emits_while_built,
    }


class Harness:
    """One core bound to plain containers, with the reports EventLog would make recorded."""

    def __init__(self, mod: Any, ring: int) -> None:
        reports: list[Any] = []
        self.reports = reports

        class Core(mod.LogCore):  # type: ignore[misc,name-defined]
            def _subscriber_failed(self, fn: Any, ev: Any, exc: BaseException) -> None:
                reports.append(("failed", fn.__name__, ev.seq, type(exc).__name__, str(exc)))

            def _appended_after_close(self, ev: Any) -> None:
                reports.append(("after_close", ev.seq))

            def _place_findings(self, ev: Any, found: list[Any]) -> Any:  # what EventLog does
                reports.append(("place", ev.seq, [(fn.__name__, list(got)) for fn, got in found]))
                for _, got in found:
                    for f in got:
                        v = Ev(self._seq, ev.ts_ns, ev.rank, finding=f)
                        self._seq += 1
                        self._publish(v)
                stored = Ev(self._seq, ev.ts_ns, ev.rank, **ev.fields)
                self._seq += 1
                self._publish(stored)
                return stored

        self.core = Core()
        self.core.rank = 3
        self.ring: list[Any] = [None] * ring
        self.events: deque[Any] = deque(maxlen=32)
        self.subs: list[Any] = []
        self.stages: list[Any] = []
        self.pending: deque[Any] = deque()
        self.seen: dict[str, list[int]] = {}
        self.batches: list[tuple[int, list[int]]] = []
        self.core._bind(
            ring=self.ring,
            events=self.events,
            subscribers=self.subs,
            blocking=[],
            pending=self.pending,
            lock=threading.RLock(),
            stages=self.stages,
        )
        self.classes = _classes(self.core)

    def subscriber(self, kind: str, k: int) -> Any:
        name = f"{kind}{k}"
        seen = self.seen.setdefault(name, [])
        core = self.core

        def fn(ev: Any) -> None:
            seen.append(ev.seq)
            if kind == "raises":
                raise Boom(f"subscriber {name} on {ev.seq}")
            if kind == "emits" and not {"nested", "inner", "finding"} & ev.fields.keys():
                core.emit(Ev, nested=ev.seq)
            if kind == "interrupts" and ev.seq % 3 == 0:
                raise KeyboardInterrupt(f"stop at {ev.seq}")

        fn.__name__ = name
        return fn

    def stage(self, kind: str, k: int) -> Any:
        name = f"stage_{kind}{k}"
        seen = self.seen.setdefault(name, [])
        core = self.core

        def fn(ev: Any) -> Any:
            seen.append(ev.seq)
            if "finding" in ev.fields:
                return None
            if kind == "finds" and ev.seq % 2 == 0:
                return [f"{name}@{ev.seq}", "second"]
            if kind == "empty":
                return []
            if kind == "raises":
                raise Boom(f"stage {name} on {ev.seq}")
            if kind == "interrupts" and ev.seq % 3 == 0:
                raise KeyboardInterrupt(f"stage stop at {ev.seq}")
            if kind == "emits" and "nested" not in ev.fields and "inner" not in ev.fields:
                core.emit(Ev, nested=ev.seq)
            return None

        fn.__name__ = name
        return fn

    def step(self, name: str, arg: Any) -> tuple[Any, ...]:
        core = self.core
        if name == "emit":
            return outcome(core.emit, self.classes[arg], a=1)
        if name == "emit_header":
            return outcome(core.emit, Ev, **{arg: 1, "b": 2})
        if name == "append":  # what EventLog.append does: spend the seq, then _publish
            ev = Ev(core._seq + arg, 0, 3)
            if arg == 0:
                spent = outcome(setattr, core, "_seq", core._seq + 1)  # refused at the end of the seq space
                if spent[0] != "ok":
                    return spent
            return outcome(core._publish, ev)
        if name == "subscribe":
            self.subs.append(self.subscriber(arg, len(self.subs)))
            return ("ok", None)
        if name == "stage":
            self.stages.append(self.stage(arg, len(self.stages)))
            return ("ok", None)
        if name == "handoff":
            batch, interval = arg
            return outcome(
                core._set_handoff, lambda s, evs: self.batches.append((s, [e.seq for e in evs])), 0, batch, interval
            )
        if name == "handoff_off":
            return outcome(core._set_handoff, None, 0, 1, 1.0)
        if name == "handoff_now":
            return outcome(core._handoff_now)
        if name == "close":
            return outcome(core._close)
        if name == "ring":
            {
                "clear": self.ring.clear,
                "grow": lambda: self.ring.append(None),
                "shrink": lambda: (
                    self.ring[:1].clear() or self.ring[-1:].clear() or (self.ring.pop() if self.ring else None)
                ),
            }[arg]()
            return ("ok", None)
        if name == "set_seq":
            return outcome(setattr, core, "_seq", arg)
        if name == "set_published":
            return outcome(setattr, core, "published", arg)
        raise AssertionError(name)

    def state(self) -> tuple[Any, ...]:
        c = self.core
        ring = [getattr(e, "seq", None) for e in self.ring]
        return (
            c._seq,
            c.published,
            c._dispatching,
            c._closed,
            c._closed_at,
            c._after_close,
            c._handoff_next,
            [e.seq for e in self.events],
            ring,
            len(self.pending),
            self.seen,
            self.reports,
            self.batches,
        )


HOSTILE_INT = st.sampled_from([-1, 0, 2**63 - 1, 2**63 - 2, 2**63, 5, "3", 1.5])


@st.composite
def program(draw: st.DrawFn) -> tuple[int, list[tuple[str, Any]]]:
    ring = draw(st.sampled_from([4, 8, 16]))
    op = st.one_of(
        st.tuples(st.just("emit"), st.sampled_from(["event", "event", "event", "none", "wrong_seq", "raises"])),
        st.tuples(st.just("emit"), st.just("emits_while_built")),
        st.tuples(st.just("emit_header"), st.sampled_from(["seq", "ts_ns", "rank"])),
        st.tuples(st.just("append"), st.sampled_from([0, 0, 0, 1, -1])),
        st.tuples(st.just("subscribe"), st.sampled_from(["records", "records", "raises", "emits", "interrupts"])),
        st.tuples(st.just("stage"), st.sampled_from(["finds", "finds", "none", "empty", "raises", "interrupts", "emits"])),
        # an interval no test outlives: the batch decides, on both clocks
        st.tuples(st.just("handoff"), st.tuples(st.integers(0, ring // 2 + 1), st.sampled_from([1e5, 0.0, -1.0]))),
        st.tuples(st.sampled_from(["handoff_off", "handoff_now", "close"]), st.none()),
        st.tuples(st.just("ring"), st.sampled_from(["clear", "grow", "shrink"])),
        st.tuples(st.sampled_from(["set_seq", "set_published"]), HOSTILE_INT),
    )
    kinds = st.sampled_from(["records", "raises", "emits", "interrupts"])
    first = [("subscribe", k) for k in draw(st.lists(kinds, min_size=1, max_size=3))]  # then events reach them
    events = st.tuples(st.just("emit"), st.just("event"))
    return ring, first + draw(st.lists(st.one_of(events, events, op), min_size=2, max_size=30))


@SETTINGS
@given(program())
def test_the_cores_agree_on_every_step(prog: tuple[int, list[tuple[str, Any]]]) -> None:
    ring, steps = prog
    c, p = Harness(c_core, ring), Harness(py_core, ring)
    for i, (name, arg) in enumerate(steps):
        got, want = c.step(name, arg), p.step(name, arg)
        assert got == want, (i, name, arg)
        assert c.state() == p.state(), (i, name, arg)


@pytest.mark.parametrize("mod", [c_core, py_core], ids=["c", "py"])
def test_a_core_whose_init_did_not_run_refuses(mod: Any) -> None:
    core = mod.LogCore()
    assert outcome(core.emit, Ev) == ("raised", "RuntimeError", "emit() on an EventLog whose __init__ did not run")
    assert outcome(core._publish, Ev(0, 0, 0)) == (
        "raised",
        "RuntimeError",
        "append() on an EventLog whose __init__ did not run",
    )
    assert outcome(core._set_handoff, None, 0, 1, 1.0)[1] == "RuntimeError"
    assert outcome(core.emit, Ev, Ev)[2] == "emit() takes the event class as its only positional argument, got 2"
    bad = {
        "ring": [None] * 3,
        "events": [],
        "subscribers": [],
        "blocking": [],
        "pending": deque(),
        "lock": threading.RLock(),
    }
    assert outcome(core._bind, **bad) == ("raised", "ValueError", "the ring's length must be a power of two, got 3")
    assert outcome(core._bind, **{**bad, "ring": ()}) == (
        "raised",
        "TypeError",
        "_bind() argument 1 must be list, not tuple",
    )
    assert outcome(core._bind, **{**bad, "ring": [None] * 4, "stages": ()}) == (
        "raised",
        "TypeError",
        "_bind() argument 'stages' must be list or None, not tuple",
    )


# --------------------------------------------------------------- gap_free_run
@st.composite
def event_list(draw: st.DrawFn) -> list[Any]:
    n = draw(st.integers(0, 12))
    first = draw(st.one_of(st.integers(-3, 10), st.sampled_from([2**63 - 3, 2**63 - 1, -(2**63), 2**63])))
    seqs = [first + i for i in range(n)]
    if n and draw(st.booleans()):
        i = draw(st.integers(0, n - 1))
        seqs[i] = draw(st.one_of(st.integers(-3, 20), st.sampled_from([2**64, "7", 1.5, True])))
    ranks = [0] * n
    if n and draw(st.booleans()):
        ranks[draw(st.integers(0, n - 1))] = draw(st.sampled_from([1, 0.0, "0", None]))
    return [Ev(s, 0, r) for s, r in zip(seqs, ranks)]


@SETTINGS
@given(event_list())
def test_gap_free_run_agrees(events: list[Any]) -> None:
    assert outcome(c_core.gap_free_run, events) == outcome(py_core.gap_free_run, events)
    assert outcome(c_core.gap_free_run, tuple(events)) == outcome(py_core.gap_free_run, tuple(events))


def test_gap_free_run_names_the_first_seq_object() -> None:
    evs = [Ev(5, 0, 1), Ev(6, 0, 1)]
    assert c_core.gap_free_run(evs) == py_core.gap_free_run(evs) == (1, 5)
    assert c_core.gap_free_run([]) is py_core.gap_free_run([]) is None


# -------------------------------------------------------- the idle watcher
@pytest.mark.parametrize("mod", [c_core, py_core], ids=["c", "py"])
def test_the_watcher_answers_and_sleeps_while_it_waits(mod: Any) -> None:
    h = Harness(mod, 16)
    core = h.core
    stop_r, stop_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        assert core._wait_handoff(0.0, stop_r, -1) == 0  # nothing waits: timed out at once
        assert outcome(core._wait_handoff, -1.0, stop_r, -1)[1] == "ValueError"
        assert core._wait_handoff(1.0, stop_r, out_w) == 2  # a pipe with room is writable
        # idle: nothing set, nothing waits; the CPU time spent while waiting stays far below the wait
        cpu = time.process_time()
        assert core._wait_handoff(0.6, stop_r, -1) == 0
        assert time.process_time() - cpu < 0.3, "the watcher spun while it waited"
        core._set_handoff(lambda s, evs: h.batches.append((s, [e.seq for e in evs])), 0, 8, 0.05)
        cpu = time.process_time()
        assert core._wait_handoff(0.6, stop_r, -1) == 0  # set, but nothing waits: looks every 50 ms
        assert time.process_time() - cpu < 0.3, "the watcher spun while it waited"
        core._set_handoff(None, 0, 1, 1.0)
        core.emit(Ev, a=1)  # one event, then a hand-off from seq 0: it waits, below the batch
        core._set_handoff(lambda s, evs: h.batches.append((s, [e.seq for e in evs])), 0, 8, 0.05)
        assert core._wait_handoff(5.0, stop_r, -1) == 1  # due 50 ms after the set
        core._handoff_now()
        assert h.batches == [(0, [0])]
        os.write(stop_w, b"x")
        assert core._wait_handoff(5.0, stop_r, -1) == 3
    finally:
        for fd in (stop_r, stop_w, out_r, out_w):
            os.close(fd)
