"""Log stages: the live auditor's verdicts stored right before the event that revealed them.

A stage (``EventLog.add_stage``) sees each event in the producer's thread before it is
stored; what it finds is stored first, with the revealing event's time, and the event
takes the next seq. So every reader of a live log (subscribers, sink runners, feeders,
the stored log) meets the verdicts on an op before that op's completion, as the offline
:func:`~hicache_obs.events._audit.audited` stream gives them.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import msgspec
import pytest

from hicache_obs.core import ModelSpec
from hicache_obs.errors import ConfigError, SequenceError
from hicache_obs.events import AuditViolation
from hicache_obs.events._audit import Auditor, AuditStage, audit, audited
from hicache_obs.events._log import EventLog
from hicache_obs.events._schema import AllocationFailed, Event, TransferCompleted, TransferSubmitted
from hicache_obs.events._sinks import ListSink
from hicache_obs.lab.workload import Workload, controller_options
from hicache_obs.testing import FAULTS, make_controller


def _emit_alloc_failed(log: EventLog, n: int = 1) -> list[Event]:
    return [log.emit(AllocationFailed, pool="kv", tier="host", requested=i, available=0) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class _F:
    """A finding as a stage returns it: anything with ``to_event(seq=, ts_ns=)``."""

    rank: int
    rule: str = "double_free"

    def to_event(self, *, seq: int, ts_ns: int) -> AuditViolation:
        return AuditViolation(seq=seq, ts_ns=ts_ns, rank=self.rank, op=-1, rule=self.rule, pool="kv", role="host", detail="d")


class _FindOn:
    """Finds ``k`` things about every AllocationFailed that asked for ``requested``."""

    def __init__(self, requested: int, k: int = 1) -> None:
        self.requested, self.k = requested, k
        self.seen: list[tuple[str, int]] = []
        self.placed_events: list[Event] = []
        self.finished = 0

    def __call__(self, ev: Event) -> list[_F] | None:
        self.seen.append((type(ev).__name__, ev.seq))
        if type(ev) is AllocationFailed and ev.requested == self.requested:
            return [_F(ev.rank)] * self.k
        return None

    def placed(self, ev: Event) -> None:
        self.placed_events.append(ev)

    def finish(self) -> None:
        self.finished += 1


# ------------------------------------------------------------------ the log's side
def test_findings_are_stored_before_the_event_that_revealed_them_with_its_time() -> None:
    log = EventLog(rank=3)
    stage = _FindOn(requested=1, k=2)
    log.add_stage(stage)
    got = _emit_alloc_failed(log, 3)
    events = log.events()
    assert [(type(e).__name__, e.seq) for e in events] == [
        ("AllocationFailed", 0),
        ("AuditViolation", 1),
        ("AuditViolation", 2),
        ("AllocationFailed", 3),  # re-stamped: the next seq after its findings
        ("AllocationFailed", 4),
    ]
    assert events[1].ts_ns == events[2].ts_ns == events[3].ts_ns
    assert all(e.rank == 3 for e in events)
    # emit returns the event as stored, the stage is told it, and it saw the event as built
    assert got[1] is events[3] and got[1].requested == 1
    assert stage.placed_events == [events[3]]
    assert stage.seen == [("AllocationFailed", 0), ("AllocationFailed", 1), ("AllocationFailed", 4)]
    assert log.next_seq == 5 and log.published == 5


def test_subscribers_and_sinks_see_the_findings_first() -> None:
    log = EventLog()
    seen: list[tuple[str, int]] = []
    log.subscribe(lambda e: seen.append((type(e).__name__, e.seq)))
    sink = ListSink()
    log.add_sink(sink)
    log.add_stage(_FindOn(requested=0))
    _emit_alloc_failed(log, 2)
    log.close()
    want = [("AuditViolation", 0), ("AllocationFailed", 1), ("AllocationFailed", 2)]
    assert seen == want
    assert [(type(e).__name__, e.seq) for e in sink.events] == want


def test_append_refuses_an_event_a_stage_finds_something_about_and_appends_nothing() -> None:
    log = EventLog()
    log.add_stage(_FindOn(requested=5))
    log.append(AllocationFailed(seq=0, ts_ns=1, rank=0, pool="kv", tier="host", requested=4, available=0))
    bad = AllocationFailed(seq=1, ts_ns=2, rank=0, pool="kv", tier="host", requested=5, available=0)
    with pytest.raises(SequenceError, match=r"append\(AllocationFailed seq 1\): this log's stages found 1 violation"):
        log.append(bad)
    assert log.next_seq == 1 and [e.seq for e in log.events()] == [0]


def test_close_finishes_each_stage_while_sinks_still_take_events() -> None:
    log = EventLog()
    sink = ListSink()
    log.add_sink(sink)
    stage = _FindOn(requested=-1)

    def finish() -> None:  # an end-of-log finding, logged by the stage itself
        stage.finished += 1
        log.emit(AuditViolation, op=9, rule="incomplete_operation", pool="*", role="*", detail="never completed")

    stage.finish = finish  # type: ignore[method-assign]
    log.add_stage(stage)
    _emit_alloc_failed(log, 1)
    log.close()
    log.close()  # idempotent: finish ran once
    assert stage.finished == 1
    assert [type(e).__name__ for e in sink.events] == ["AllocationFailed", "AuditViolation"]
    assert log.dropped_after_close == 0


def test_a_raising_stage_is_counted_and_the_event_goes_on() -> None:
    log = EventLog()

    def boom(ev: Event) -> None:
        raise ValueError("stage bug")

    log.add_stage(boom)
    after = _FindOn(requested=0)
    log.add_stage(after)
    _emit_alloc_failed(log, 2)
    assert [type(e).__name__ for e in log.events()] == ["AuditViolation", "AllocationFailed", "AllocationFailed"]
    assert log.subscriber_errors == {boom.__qualname__: 2}


def test_a_stage_that_emits_is_refused_and_nothing_is_stored() -> None:
    log = EventLog()

    def emits(ev: Event) -> None:
        if type(ev) is AllocationFailed:
            log.emit(AuditViolation, op=-1, rule="x", pool="kv", role="host", detail="d")

    log.add_stage(emits)
    with pytest.raises(RuntimeError, match="a stage emitted into the log"):
        _emit_alloc_failed(log, 1)


def test_a_removed_stage_sees_nothing_more() -> None:
    log = EventLog()
    stage = _FindOn(requested=0)
    remove = log.add_stage(stage)
    with pytest.raises(ConfigError, match="already on this log"):
        log.add_stage(stage)
    remove()
    remove()  # idempotent
    assert log.stages == []
    _emit_alloc_failed(log, 1)
    assert stage.seen == [] and [type(e).__name__ for e in log.events()] == ["AllocationFailed"]

def test_a_stage_added_later_sees_the_retained_events_and_logs_their_findings_after_them() -> None:
    log = EventLog()
    _emit_alloc_failed(log, 2)
    stage = _FindOn(requested=0)
    log.add_stage(stage, backfill=True)
    assert stage.seen == [("AllocationFailed", 0), ("AllocationFailed", 1)]
    assert [(type(e).__name__, e.seq) for e in log.events()] == [
        ("AllocationFailed", 0),
        ("AllocationFailed", 1),
        ("AuditViolation", 2),  # event 0 is out already
    ]


def test_a_stage_is_refused_on_a_closed_log_and_must_be_callable() -> None:
    log = EventLog()
    with pytest.raises(ConfigError, match="a stage must be callable"):
        log.add_stage(42)  # type: ignore[arg-type]
    log.close()
    with pytest.raises(ConfigError, match=r"add_stage\(_FindOn\) on a closed EventLog"):
        log.add_stage(_FindOn(0))


def test_concurrent_emitters_with_a_stage_get_gap_free_seqs_and_each_finding_before_its_event() -> None:
    log = EventLog()
    log.add_stage(_FindOn(requested=1))
    threads = [threading.Thread(target=_emit_alloc_failed, args=(log, 50)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = log.events()
    assert [e.seq for e in events] == list(range(4 * 51))
    for i, e in enumerate(events):
        if type(e) is AuditViolation:
            nxt = events[i + 1]
            assert type(nxt) is AllocationFailed and nxt.requested == 1 and nxt.ts_ns == e.ts_ns


# ------------------------------------------------------------------ the live auditor
def _run_faulty(fault: str | None, steps: int = 30) -> tuple[EventLog, Auditor, Any]:
    spec = ModelSpec.tiny_hybrid()
    c = make_controller(spec, fault=fault, runtime="sim", **controller_options(spec, 512))
    auditor = Auditor().attach(c.log)
    Workload(c, seed=1, fault=fault).run(steps)
    c.close()
    auditor.finish()
    return c.log, auditor, c


def _no_seq(ev: Event) -> dict[str, Any]:
    d = msgspec.structs.asdict(ev)
    d.pop("seq")
    return {"type": type(ev).__name__, **d}


@pytest.mark.parametrize("fault", [*FAULTS])
def test_a_live_audited_log_is_already_in_the_order_audited_gives(fault: str) -> None:
    log, auditor, c = _run_faulty(fault)
    events = log.events()
    assert [e.seq for e in events] == list(range(len(events)))
    violations = [i for i, e in enumerate(events) if type(e) is AuditViolation]
    assert violations, f"fault {fault} found nothing"
    for i in violations:  # each right before the event that revealed it, with its time
        j = i + 1
        while type(events[j]) is AuditViolation:
            j += 1
        assert events[j].ts_ns == events[i].ts_ns
        assert events[i].op == -1 or events[j].rank == events[i].rank
    # the offline stream of the stored log: the same events, in the same order, at the same times
    assert [_no_seq(e) for e in audited(events)] == [_no_seq(e) for e in events]
    # the live findings name the revealing events by the seqs the log stored them with
    offline = audit(events)
    assert [dataclasses.astuple(f) for f in auditor.findings] == [dataclasses.astuple(f) for f in offline]
    for f in auditor.findings:
        if f.seq >= 0:
            assert type(events[f.seq]) is not AuditViolation
    # the controller folded each of its events as stored (re-stamped after its verdicts)
    assert c.state.last_seq == [e for e in events if type(e) is not AuditViolation][-1].seq


def test_an_unrecorded_index_verdict_comes_before_the_completion_of_its_op() -> None:
    log, auditor, _ = _run_faulty("unrecorded-pool-indices")
    events = log.events()
    unrecorded = [i for i, e in enumerate(events) if type(e) is AuditViolation and e.rule == "unrecorded_index"]
    assert unrecorded
    for i in unrecorded:
        op = events[i].op
        done = next(j for j in range(i + 1, len(events)) if type(events[j]) is TransferCompleted and events[j].op == op)
        assert all(type(events[k]) is AuditViolation for k in range(i, done))  # nothing else in between
    assert {f.rule for f in auditor.findings} == {"unrecorded_index"}


def test_an_op_left_in_flight_is_reported_at_finish_and_at_close_once() -> None:
    c = make_controller(ModelSpec.tiny(), runtime="sim")
    log = c.log
    sink = ListSink()
    log.add_sink(sink)
    Auditor().attach(log)
    kv = c.alloc_device(16)
    assert c.write(kv, node_id=1) is not None  # write-through: submitted, never polled
    log.close()  # the auditor's stage finishes first: the sink gets the verdict
    submitted = [e.op for e in log.events() if type(e) is TransferSubmitted]
    got = [(e.rule, e.op) for e in sink.events if type(e) is AuditViolation]
    assert len(submitted) == 1 and got == [("incomplete_operation", submitted[0])]
    assert sum(type(e) is AuditViolation for e in log.events()) == 1


def test_an_auditor_attaches_to_one_log_once() -> None:
    log = EventLog()
    a = Auditor().attach(log)
    with pytest.raises(ConfigError, match="already reports into a log"):
        a.attach(EventLog())
    assert [type(s) for s in log.stages] == [AuditStage]
