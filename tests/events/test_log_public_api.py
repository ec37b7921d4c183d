"""The log's public operations that sinks, feeders and the controller use instead of its
internals: ``read``, the feeder handle, ``bind_owner``/``owner``."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest

from hicache_obs.errors import ConfigError
from hicache_obs.events import AllocationFailed, EventLog
from hicache_obs.events._log import HandoffWake


def _emit_n(log: EventLog, n: int) -> None:
    for i in range(n):
        log.emit(AllocationFailed, pool="kv", tier="host", requested=i, available=0)


# ---------------------------------------------------------------------- read
def test_read_returns_the_range_of_events_in_order() -> None:
    log = EventLog(ring_size=1 << 12)
    _emit_n(log, 50)
    got = log.read(10, 20)
    assert [ev.seq for ev in got] == list(range(10, 20))
    assert [ev.requested for ev in got] == list(range(10, 20))  # type: ignore[attr-defined]
    assert got == log.events()[10:20]  # the same objects the log retained
    assert log.read(7, 7) == []
    assert [ev.seq for ev in log.read(0, 50)] == list(range(50))


def test_read_leaves_out_what_the_ring_lapped() -> None:
    log = EventLog(ring_size=1 << 12)
    _emit_n(log, (1 << 12) + 100)  # seqs 0..99 were overwritten by 4096..4195
    assert [ev.seq for ev in log.read(0, 200)] == list(range(100, 200))
    assert log.read(0, 100) == []
    whole = log.read(log.published - (1 << 12) - 5, log.published)  # 5 more than the ring holds
    assert [ev.seq for ev in whole] == list(range(100, log.published))


@pytest.mark.parametrize(
    ("start", "end"),
    [(5, 3), (-1, 2), (0, 11), (11, 11)],
)
def test_read_outside_what_is_published_is_refused_with_the_range(start: int, end: int) -> None:
    log = EventLog()
    _emit_n(log, 10)
    with pytest.raises(ValueError) as info:
        log.read(start, end)
    assert str(info.value) == (
        f"read({start}, {end}): the range must satisfy 0 <= start <= end <= published (10)"
    )


# ------------------------------------------------------------- feeder handle
class Recorder:
    """A feeder that keeps what it is handed."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int]]] = []  # (start, seqs)

    def take(self, start: int, events: list[Any]) -> None:
        self.calls.append((start, [e.seq for e in events]))


def test_the_handle_of_a_feeder_hands_off_on_demand_and_detaches() -> None:
    log = EventLog(ring_size=1 << 12)
    _emit_n(log, 3000)
    rec = Recorder()
    start = log.attach_feeder(rec, batch=1000, interval=3600)
    assert start == 3000 - (1 << 11)  # backfilled: half the ring
    handle = log.feeder_handle(rec)
    assert handle.feeder is rec
    assert handle.start_seq == start
    assert rec.calls == []  # attached alone: the first hand-off brings the backfill
    assert handle.handoff_now() is True
    assert rec.calls == [(start, list(range(start, 3000)))]
    _emit_n(log, 5)
    assert len(rec.calls) == 1  # 5 < batch, and the interval is an hour
    assert handle.detach() == 3005  # what waited was handed over first
    assert rec.calls[1:] == [(3000, [3000, 3001, 3002, 3003, 3004])]
    _emit_n(log, 5)
    assert handle.handoff_now() is False  # detached: nothing is handed any more
    assert handle.detach() == 3010  # idempotent: only says where the log is
    assert len(rec.calls) == 2
    with pytest.raises(ConfigError) as info:
        log.feeder_handle(rec)
    assert str(info.value) == (
        "feeder_handle(Recorder): that feeder is not attached to this log (attach_feeder first)"
    )


def test_the_handles_wait_says_why_it_woke() -> None:
    log = EventLog()
    rec = Recorder()
    log.attach_feeder(rec, batch=1000, interval=0.02)
    handle = log.feeder_handle(rec)
    r, w = os.pipe()
    try:
        assert handle.wait(0.0) is HandoffWake.TIMEOUT  # nothing waits
        _emit_n(log, 3)
        assert handle.wait(30.0, r, -1) is HandoffWake.DUE  # once the interval passed
        assert handle.handoff_now()
        assert rec.calls == [(0, [0, 1, 2])]
        assert handle.wait(30.0, r, w) is HandoffWake.WRITABLE  # an empty pipe takes bytes
        os.write(w, b"x")
        assert handle.wait(30.0, r, -1) is HandoffWake.WOKEN
        assert [int(code) for code in HandoffWake] == [0, 1, 2, 3]  # the compiled wait's codes
    finally:
        os.close(r)
        os.close(w)


# --------------------------------------------------------------------- owner
class Owner:
    def __init__(self) -> None:
        self.closed = False


def test_a_log_has_one_open_owner_at_a_time() -> None:
    log = EventLog(rank=2)
    assert log.owner is None
    a, b = Owner(), Owner()
    log.bind_owner(a)
    assert log.owner is a
    log.bind_owner(a)  # binding the owner again changes nothing
    with pytest.raises(ConfigError) as info:
        log.bind_owner(b)
    assert str(info.value) == (
        "this EventLog (rank 2) already records an open Owner; its bookkeeping is the fold of that log, "
        "so give each controller (each rank) its own log"
    )
    assert log.owner is a
    a.closed = True
    log.bind_owner(b)  # the first one is closed
    assert log.owner is b
    del b, info  # the refusal's traceback held b too
    gc.collect()
    assert log.owner is None  # held weakly: a dropped owner leaves the log free
    c = Owner()
    log.bind_owner(c)
    assert log.owner is c


def test_an_owner_without_a_closed_attribute_is_refused() -> None:
    log = EventLog()
    with pytest.raises(ConfigError) as info:
        log.bind_owner(object())
    assert str(info.value) == (
        "bind_owner(object): an owner needs a closed attribute (a second owner is refused while the first is open)"
    )
    assert log.owner is None


def test_a_controller_binds_itself_as_its_logs_owner() -> None:
    from hicache_obs.core import HiCacheController, ModelSpec

    log = EventLog()
    c = HiCacheController(ModelSpec.tiny(), runtime="cpu", device_size=256, log=log)
    assert log.owner is c
    c.close()
    assert log.owner is c and c.closed


# --------------------------------------------------- subscribers with backfill
def test_a_backfilled_subscriber_gets_the_retained_events_then_the_later_ones() -> None:
    log = EventLog(capacity=4)
    _emit_n(log, 6)  # seqs 0 and 1 evicted by the bound
    seen: list[int] = []
    log.subscribe(lambda ev: seen.append(ev.seq), backfill=True)
    assert seen == [2, 3, 4, 5]
    _emit_n(log, 2)
    assert seen == [2, 3, 4, 5, 6, 7]  # none missed, none twice


# ------------------------------------------------------- the fold's dispatch
def test_the_states_handlers_are_the_folds_apply_dispatches_to() -> None:
    from hicache_obs.events import PoolCreated, SlotsFreed
    from hicache_obs.events._state import HANDLERS, CacheState

    assert {t.__name__ for t in HANDLERS} == {
        "PoolCreated",
        "SlotsAllocated",
        "SlotsFreed",
        "AllocationFailed",
        "OperationQueued",
        "OperationsMerged",
        "OpsSubmitted",  # folded as the events it stands for
        "TransferSubmitted",
        "TransferCompleted",
        "TransferFailed",
    }
    with pytest.raises(TypeError):
        HANDLERS[SlotsFreed] = print  # type: ignore[index]  # read-only: the fold is fixed
    state = CacheState()
    HANDLERS[PoolCreated](
        state,
        PoolCreated(seq=0, ts_ns=1, pool="kv", tier="host", capacity=64, page_size=1, slot_bytes=8, layout="lf"),
    )
    bad = HANDLERS[SlotsFreed](state, SlotsFreed(seq=1, ts_ns=2, pool="kv", tier="host", indices=((3, 2),)))
    assert bad == ((3, 2),)  # nothing was allocated: both slots are reported, as runs
    assert state.anomalies == [(1, "double_free", "kv/host slots [3, 4]")]
    assert state.last_seq == -1  # the handler folds; apply() is what also moves last_seq
