"""``audited()``: any readable log as one stream, each verdict right before the event that
revealed it, whatever the log held (violations logged after that event, before it, or none)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from event_workloads import hybrid_round_trip

from hicache_obs.core import ModelSpec
from hicache_obs.events import AuditViolation, EventLog, TransferCompleted, TransferSubmitted
from hicache_obs.events._audit import RULES, Auditor, audit, audit_batch, audited
from hicache_obs.events._schema import Event, IndicesMisplaced, TensorRef
from hicache_obs.testing import make_controller


def _unfinished_write(c: Any) -> None:
    c.write(c.alloc_device(32), node_id=9)  # submitted, never polled: incomplete at log end


# fault -> (the scenario, the rule it must show)
SCENARIOS: dict[str, tuple[Any, str]] = {
    "unrecorded-pool-indices": (hybrid_round_trip, "unrecorded_index"),
    "unmoved-pool-indices": (hybrid_round_trip, "index_not_on_device"),
    "length-mismatch": (hybrid_round_trip, "length_mismatch"),
    "use-after-free": (lambda c: hybrid_round_trip(c, evict_host_first=True), "slot_not_allocated"),
    "double-free": (lambda c: hybrid_round_trip(c, evict_host_first=True, double_evict=True), "double_free"),
    "incomplete": (_unfinished_write, "incomplete_operation"),
    "omitted-sidecar": (hybrid_round_trip, "pool_omitted"),
    "misplaced-free": (hybrid_round_trip, "misplaced_indices"),
}


def _live_log(fault: str) -> list[Event]:
    """A log with its violations logged by a live auditor (after the events that revealed them)."""
    scenario, _ = SCENARIOS[fault]
    if fault in ("omitted-sidecar", "misplaced-free"):
        return _sidecar_log(fault)
    c = make_controller(fault=None if fault == "incomplete" else fault, device_size=512, io_backend="kernel")
    auditor = Auditor().attach(c.log)
    scenario(c)
    auditor.finish()  # logs the end-of-log findings too
    return list(c.log.events())


def _sidecar_log(fault: str) -> list[Event]:
    """Our controller registers no pool that moves with another's slots (SGLang's does: a draft
    model's KV) and takes no free of indices on another device (it refuses them; SGLang's pools
    do): its clean round trip, emitted into a live-audited log saying it had one, or with a
    Mamba host free handed device indices after the first completion."""
    c = make_controller(device_size=512, io_backend="kernel")
    hybrid_round_trip(c)
    log = EventLog()
    auditor = Auditor().attach(log)
    for e in c.log.events():
        fields = msgspec.structs.asdict(e)
        del fields["seq"], fields["ts_ns"], fields["rank"]
        if isinstance(e, TransferSubmitted) and fault == "omitted-sidecar":
            fields["sidecar_pools"] = (("draft", "kv"),)
        log.emit(type(e), **fields)
        if isinstance(e, TransferCompleted) and fault == "misplaced-free" and e.op == 0:
            ref = TensorRef(pool="mamba", role="host", device="cuda:0", numel=2, dtype="int64", ptr=4096)
            log.emit(IndicesMisplaced, pool="mamba", tier="host", call="free", expected="cpu", tensor=ref)
    auditor.finish()
    return list(log.events())


def _violations_before(events: list[Event]) -> list[Event]:
    """``events`` with each run of logged violations moved before the event that revealed it
    (the event right before the run), the end-of-log ones left last: the v2 order."""
    out: list[Event] = []
    run: list[Event] = []
    for ev in events:
        if isinstance(ev, AuditViolation):
            run.append(ev)
            continue
        if run:
            out[-1:-1] = run  # before the last event kept: the one that revealed them
            run = []
        out.append(ev)
    if run:
        # a live auditor logs incomplete_operation at finish, after everything: they stay last;
        # the other verdicts of the run belong before the last event
        tail = [v for v in run if v.rule == "incomplete_operation"]
        out[-1:-1] = [v for v in run if v.rule != "incomplete_operation"]
        out += tail
    return out


def _encode(events: list[Event]) -> bytes:
    return msgspec.json.encode(events)


@pytest.mark.parametrize("fault", list(SCENARIOS))
def test_logged_after_before_or_not_at_all_give_the_same_stream(fault: str) -> None:
    log = _live_log(fault)
    logged = [e for e in log if isinstance(e, AuditViolation)]
    assert logged, "the live auditor logged the fault"
    after = _encode(list(audited(log)))
    before = _encode(list(audited(_violations_before(log))))
    none = _encode(list(audited([e for e in log if not isinstance(e, AuditViolation)])))
    assert after == before == none


@pytest.mark.parametrize("fault", list(SCENARIOS))
def test_each_rule_is_placed_before_its_event_and_nothing_is_doubled(fault: str) -> None:
    log = _live_log(fault)
    rule = SCENARIOS[fault][1]
    auditor = Auditor()
    stream = list(audited(log, auditor=auditor))
    found = auditor.findings
    assert rule in {f.rule for f in found}
    # the rules' findings, once each: as many violations as findings, none of the log's kept
    placed = [e for e in stream if isinstance(e, AuditViolation)]
    assert [(v.rule, v.pool, v.role, v.op, v.detail) for v in placed] == [
        (f.rule, f.pool, f.role, f.op, f.detail) for f in found
    ]
    assert len(placed) == len([e for e in log if isinstance(e, AuditViolation)])
    assert [f.key() for f in found] == [f.key() for f in audit(log)]
    # the log's other events are all there, in their order, unchanged
    rest = [e for e in stream if not isinstance(e, AuditViolation)]
    assert rest == [e for e in log if not isinstance(e, AuditViolation)]
    # every verdict about an event sits right before it, with its seq and time
    for i, v in enumerate(stream):
        if not isinstance(v, AuditViolation) or v.rule == "incomplete_operation":
            continue
        j = i
        while isinstance(stream[j], AuditViolation):
            j += 1
        target = stream[j]
        assert (v.seq, v.ts_ns, v.rank) == (target.seq, target.ts_ns, target.rank)
        f = found[placed.index(v)]
        assert f.seq == target.seq
        if v.rule == "unrecorded_index":
            assert isinstance(target, TransferCompleted) and target.op == v.op
        elif v.rule == "misplaced_indices":  # the adapter's evidence, before the free ran
            assert isinstance(target, IndicesMisplaced) and v.op == -1
        else:  # found at submission or at a free
            assert type(target).__name__ in ("TransferSubmitted", "SlotsFreed")


def test_end_of_log_findings_come_last_with_their_ranks_last_event() -> None:
    log = _live_log("incomplete")
    stream = list(audited(log))
    real = [e for e in log if not isinstance(e, AuditViolation)]
    assert stream[: len(real)] == real  # nothing revealed before the end
    tail = stream[len(real) :]
    assert [(v.rule, v.op, v.pool, v.role) for v in tail] == [("incomplete_operation", 0, "*", "*")]
    assert (tail[0].seq, tail[0].ts_ns) == (real[-1].seq, real[-1].ts_ns)


def test_end_of_log_findings_of_two_ranks_take_each_ranks_last_event() -> None:
    r0 = [e for e in _live_log("incomplete") if not isinstance(e, AuditViolation)]
    r1 = [msgspec.structs.replace(e, rank=1, ts_ns=e.ts_ns + 1) for e in r0[:-2]]  # rank 1 ends at its submission
    log = sorted(r0 + r1, key=lambda e: e.ts_ns)
    stream = list(audited(log))
    assert stream[: len(log)] == log
    tail = stream[len(log) :]
    assert [(v.rule, v.rank) for v in tail] == [("incomplete_operation", 0), ("incomplete_operation", 1)]
    for v, last in zip(tail, (r0[-1], r1[-1])):
        assert (v.seq, v.ts_ns) == (last.seq, last.ts_ns)


@pytest.mark.parametrize("size", [1, 2, 7, 100000])
def test_audit_batch_over_any_batching_is_audited(size: int) -> None:
    log = [e for e in _live_log("unrecorded-pool-indices") if not isinstance(e, AuditViolation)]
    want = _encode(list(audited(log)))
    auditor = Auditor()
    out: list[Event] = []
    for i in range(0, len(log), size):
        out += audit_batch(log[i : i + size], auditor)
    assert auditor.finish() == audit(log)
    assert _encode(out) == want  # no end-of-log finding here: the batches are all of it


def test_every_rule_is_placed_by_some_scenario() -> None:
    assert {rule for _, rule in SCENARIOS.values()} == set(RULES)


def test_a_log_without_findings_comes_back_as_it_was() -> None:
    c = make_controller(ModelSpec.tiny(), device_size=512, io_backend="kernel")
    kv = c.alloc_device(32)
    c.write(kv, node_id=1)
    c.poll_writes()
    c.close()
    log = list(c.log.events())
    assert list(audited(log)) == log
    assert list(audited([])) == []


def test_the_committed_v1_log_in_all_three_forms() -> None:
    from goldens import FIXTURE, REPO

    from hicache_obs.events._replay import replay

    log = replay(REPO / FIXTURE).events
    logged = [e for e in log if isinstance(e, AuditViolation)]
    assert len(logged) == 78  # a live auditor's, each after the completion that revealed it
    after = list(audited(log))
    assert _encode(after) == _encode(list(audited(_violations_before(log))))
    assert _encode(after) == _encode(list(audited([e for e in log if not isinstance(e, AuditViolation)])))
    placed = [e for e in after if isinstance(e, AuditViolation)]
    # the same verdicts as logged, now with their completion's seq and time
    assert [(v.rule, v.pool, v.role, v.op, v.detail) for v in placed] == [
        (v.rule, v.pool, v.role, v.op, v.detail) for v in logged
    ]
    done = {e.op: e for e in log if isinstance(e, TransferCompleted)}
    assert all((v.seq, v.ts_ns) == (done[v.op].seq, done[v.op].ts_ns) for v in placed)
