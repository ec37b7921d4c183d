"""The one op lifecycle (:mod:`hicache_obs.events._lifecycle`): its rules (a)-(h) one by one,
and, on random workloads of the demo controller, agreement with the two folds it replaced
(frozen in ``lifecycle_reference.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lifecycle_reference import RefOpTable, ref_fold_ops, ref_lifecycles

from hicache_obs.core import ModelSpec
from hicache_obs.events._audit import Auditor
from hicache_obs.events._lifecycle import NOT_OP_EVENTS, PHASES, OpLifecycles, OpRecord, Step
from hicache_obs.events._schema import (
    AllocationFailed,
    AuditViolation,
    FreeRefused,
    IndicesMisplaced,
    IndicesMoved,
    OperationQueued,
    OperationsMerged,
    PoolCreated,
    PoolsSampled,
    SlotsAllocated,
    SlotsFreed,
    StreamRecorded,
    TensorRef,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
)
from hicache_obs.lab.workload import Workload, controller_options
from hicache_obs.testing import make_controller

_seq = iter(range(1 << 30))


def _h(ts: int, rank: int = 0) -> dict[str, int]:
    return {"seq": next(_seq), "ts_ns": ts, "rank": rank}


def queued(op: int, ts: int, *, node: int = 0, prio: int | None = None, slots=(("kv", 4),), d="d2h", rank=0):
    return OperationQueued(**_h(ts, rank), op=op, direction=d, node_id=node,
                           priority=op if prio is None else prio, slots_by_pool=slots)  # fmt: skip


def merged(op: int, ops: tuple[int, ...], ts: int, *, nodes: tuple[int, ...] = (), d="d2h", rank=0):
    return OperationsMerged(**_h(ts, rank), op=op, merged_ops=ops, direction=d, node_ids=nodes)


_REF = TensorRef(pool="kv", role="host", device="cpu", numel=4, dtype="int64", ptr=1)


def moved(op: int, ts: int, rank=0):
    return IndicesMoved(**_h(ts, rank), op=op, pool="kv", role="host", src_device="cpu", dst_device="cpu", tensor=_REF)


def recorded(op: int, ts: int, rank=0):
    return StreamRecorded(**_h(ts, rank), op=op, pool="kv", role="host", stream="hicache-write", tensor=_REF)


def submitted(op: int, ts: int, *, slots=(("kv", 4),), d="d2h", stream="hicache-write", rank=0):
    return TransferSubmitted(**_h(ts, rank), op=op, direction=d, stream=stream, io_backend="direct", layout="lf",
                             tensors=(), slots_by_pool=slots, bytes_by_pool=tuple((p, 8 * n) for p, n in slots))  # fmt: skip


def completed(op: int, ts: int, *, dur: int = 0, d="d2h", rank=0):
    return TransferCompleted(**_h(ts, rank), op=op, direction=d, duration_ns=dur)


def failed(op: int, ts: int, *, d="d2h", rank=0):
    return TransferFailed(**_h(ts, rank), op=op, direction=d, error="RuntimeError: boom")


def violation(op: int, ts: int, *, rule="unrecorded_index", pool="kv", rank=0):
    return AuditViolation(**_h(ts, rank), op=op, rule=rule, pool=pool, role="host", detail="x")


def fold(events: list[Any], **kw: Any) -> tuple[OpLifecycles, list[Any]]:
    lc = OpLifecycles(**kw)
    return lc, [lc.apply(ev) for ev in events]


# ------------------------------------------------------------------ the rules
def test_a_a_merge_of_one_op_into_itself_keeps_its_record() -> None:
    q = queued(1, 100, node=7, prio=3, slots=(("kv", 4), ("mamba", 1)))
    lc, steps = fold([q, merged(1, (1,), 150, nodes=(7, 8))])
    rec = lc.get(0, 1)
    assert steps[1] == (Step.MERGED, rec) and steps[0] == (Step.QUEUED, rec)
    assert rec is not None
    assert (rec.status, rec.merged_ops, rec.merged_ns, rec.queued_ns) == ("merged", (1,), 150, 100)
    assert (rec.priority, rec.slots_by_pool, rec.node_ids) == (3, (("kv", 4), ("mamba", 1)), (7, 8))
    # a merge event without node ids leaves the queued node
    lc, _ = fold([queued(2, 100, node=9), merged(2, (2,), 120)])
    rec = lc.get(0, 2)
    assert rec is not None and rec.node_ids == (9,)
    assert lc.anomalies == []


def test_b_a_merge_of_several_ops_sums_their_slots_and_takes_the_least_priority_and_queue_time() -> None:
    evs = [
        queued(1, 300, node=10, prio=5, slots=(("kv", 4), ("mamba", 1))),
        queued(2, 200, node=11, prio=2, slots=(("kv", 8),)),
        queued(3, 250, node=12, prio=9, slots=(("mamba", 1),)),
    ]
    for keep in (False, True):
        lc, steps = fold([*evs, merged(9, (1, 2, 3), 400, nodes=(10, 11, 12))], keep=keep)
        rec = lc.get(0, 9)
        assert rec is not None and steps[-1] == (Step.MERGED, rec)
        assert rec.slots_by_pool == (("kv", 12), ("mamba", 2))
        assert (rec.priority, rec.queued_ns, rec.node_ids, rec.merged_ops) == (2, 200, (10, 11, 12), (1, 2, 3))
        assert rec.status == "merged" and rec.merged_into is None
        srcs = [lc.get(0, o) for o in (1, 2, 3)]
        if keep:  # offline: the sources stay, pointing at the merge
            assert all(s is not None and s.merged_into == 9 and s.status == "merged" for s in srcs)
            assert [r.op for r in lc.top_level()] == [9]
        else:  # live: the sources are gone
            assert srcs == [None, None, None]
            assert list(lc.records) == [(0, 9)]
    # without node ids in the event, the sources' in order
    lc, _ = fold([*evs[:2], merged(9, (2, 1), 400)])
    rec = lc.get(0, 9)
    assert rec is not None and rec.node_ids == (11, 10)


def test_c_a_submission_without_a_record_makes_one_with_the_op_as_priority() -> None:
    sub = submitted(42, 500, slots=(("kv", 16),), d="h2d", stream="hicache-load")
    lc, steps = fold([sub])
    rec = lc.get(0, 42)
    assert rec is not None and steps == [(Step.SUBMITTED, rec)]
    assert (rec.priority, rec.status, rec.direction, rec.submit) == (42, "submitted", "h2d", sub)
    assert (rec.slots_by_pool, rec.stream, rec.queued_ns, rec.queue_wait_ns) == (
        (("kv", 16),),
        "hicache-load",
        None,
        None,
    )
    assert rec.snapshot() == (42, "h2d", (), 42, (("kv", 16),), "submitted", -1)
    assert lc.in_flight_count("h2d") == 1 and list(lc.in_flight()) == [rec]


def test_d_a_merge_of_an_unknown_op_is_an_anomaly() -> None:
    m = merged(9, (1, 2), 400, nodes=(5,))
    lc, steps = fold([queued(1, 100, prio=4), m])
    rec = lc.get(0, 9)
    assert rec is not None and steps[-1] == (Step.MERGED, rec)
    assert lc.anomalies == [(m.seq, "merge_unknown_op", "2")]
    assert (rec.priority, rec.slots_by_pool, rec.queued_ns) == (4, (("kv", 4),), 100)
    # nothing known at all: the op id is the priority, no queue time
    m2 = merged(8, (3,), 400)
    lc, _ = fold([m2])
    rec = lc.get(0, 8)
    assert rec is not None and (rec.priority, rec.queued_ns, rec.slots_by_pool, rec.status) == (8, None, (), "merged")
    assert lc.anomalies == [(m2.seq, "merge_unknown_op", "3")]


@pytest.mark.parametrize("keep", [False, True])
def test_e_a_completion_or_failure_of_an_unknown_op_still_finishes_a_record(keep: bool) -> None:
    done, bad = completed(5, 900, dur=70, d="h2d"), failed(6, 950)
    lc, steps = fold([done, bad], keep=keep)
    (s1, r1), (s2, r2) = steps  # type: ignore[misc]
    assert (s1, s2) == (Step.FINISHED, Step.FINISHED)
    assert (r1.op, r1.status, r1.done, r1.direction, r1.duration_ns) == (5, "completed", done, "h2d", 70)
    assert (r2.op, r2.status, r2.error, r2.duration_ns) == (6, "failed", "RuntimeError: boom", None)
    assert r1.submit is None and r1.start_ns is None and r1.end_ns() == 900
    if keep:
        assert lc.get(0, 5) is r1 and lc.get(0, 6) is r2
    else:
        assert lc.records == {}


def test_f_a_repeated_submission_replaces_the_submission() -> None:
    first, again = submitted(3, 100), submitted(3, 180, slots=(("kv", 8),))
    lc, steps = fold([queued(3, 50), merged(3, (3,), 90), first, again])
    rec = lc.get(0, 3)
    assert rec is not None and steps[-2:] == [(Step.SUBMITTED, rec), (Step.SUBMITTED, rec)]
    assert rec.submit is again and rec.submitted_ns == 180 and rec.slots_by_pool == (("kv", 8),)
    assert rec.queue_wait_ns == 130
    assert lc.in_flight_count("d2h") == 1  # still one op in flight
    lc.apply(completed(3, 300))
    assert lc.in_flight_count("d2h") == 0 and list(lc.in_flight()) == [] and lc.unfinished() == []


def test_g_moves_and_records_of_an_op_without_a_record_make_one_except_for_a_negative_op() -> None:
    mv, rc = moved(4, 100), recorded(4, 110)
    lc, steps = fold([mv, rc, moved(-1, 120), recorded(-1, 130)])
    rec = lc.get(0, 4)
    assert rec is not None
    assert steps == [(Step.MOVED, rec), (Step.RECORDED, rec), (Step.MOVED, None), (Step.RECORDED, None)]
    assert (rec.moves, rec.records, rec.moved_ns, rec.recorded_ns) == ([mv], [rc], 100, 110)
    assert (rec.status, rec.direction) == ("queued", "")
    assert list(lc.records) == [(0, 4)]
    # detail=False keeps no lists, the times still
    lc, _ = fold([mv, rc], detail=False)
    rec = lc.get(0, 4)
    assert rec is not None and (rec.moves, rec.records, rec.moved_ns, rec.recorded_ns) == ((), (), 100, 110)


def test_h_a_violation_of_a_negative_or_unknown_op_is_loose() -> None:
    lc = OpLifecycles()
    for ev in (queued(1, 10), merged(1, (1,), 20), submitted(1, 30)):
        lc.apply(ev)
    own, neg, unknown = violation(1, 40), violation(-1, 41, rule="double_free"), violation(77, 42)
    rec = lc.get(0, 1)
    assert lc.apply(own) == (Step.VIOLATION, rec)
    assert lc.apply(neg) == (Step.VIOLATION, None)
    assert lc.apply(unknown) == (Step.VIOLATION, None)
    assert rec is not None and rec.violations == [own]
    assert (rec.unrecorded_indices, rec.unrecorded_pools) == (1, ["kv"])
    assert rec.error_description() == "unrecorded_index: pool kv host indices"
    # live: once finished, a later violation of the op is loose too
    step, fin = lc.apply(completed(1, 50))  # type: ignore[misc]
    assert step is Step.FINISHED and fin is rec and lc.get(0, 1) is None
    assert lc.apply(violation(1, 51)) == (Step.VIOLATION, None)
    # offline, it still reaches the record
    lc, _ = fold([queued(1, 10), submitted(1, 30), completed(1, 50)], keep=True)
    late = violation(1, 51)
    assert lc.apply(late) == (Step.VIOLATION, lc.get(0, 1))


_ref = TensorRef(pool="kv", role="host", device="cuda:0", numel=4, dtype="int64", ptr=64)


def test_events_that_touch_no_op_return_none() -> None:
    pool = PoolCreated(**_h(1), pool="kv", tier="device", capacity=8, page_size=1, slot_bytes=8, layout="lf")
    evs = [
        pool,
        SlotsAllocated(**_h(2), pool="kv", tier="device", indices=((0, 4),), op=3),
        SlotsFreed(**_h(3), pool="kv", tier="device", indices=((0, 4),), op=3),
        AllocationFailed(**_h(4), pool="kv", tier="device", requested=9, available=8),
        IndicesMisplaced(**_h(5), pool="kv", tier="host", call="free", expected="cpu", tensor=_ref),
        FreeRefused(**_h(6), pool="kv", tier="host", call="free", tensor=_ref, error="AssertionError"),
        PoolsSampled(**_h(7), pools=(("kv", "device", 4, 8),), audit_sample=0.0),
    ]
    lc, steps = fold(evs)
    assert steps == [None] * 7
    assert {type(e) for e in evs} == NOT_OP_EVENTS
    assert lc.records == {} and lc.anomalies == []


def test_derived_times_have_one_definition() -> None:
    # queue wait clamped at 0 (a submission stamped before the queueing, on another thread)
    lc, _ = fold([queued(1, 500), merged(1, (1,), 510), submitted(1, 490), completed(1, 700)], keep=True)
    rec = lc.get(0, 1)
    assert rec is not None
    assert (rec.queue_wait_ns, rec.duration_ns, rec.total_ns, rec.end_ns()) == (0, 210, 210, 700)
    # device-timed: the duration is the device's, the end never after the observed completion
    lc, _ = fold([submitted(2, 100), completed(2, 400, dur=120)], keep=True)
    rec = lc.get(0, 2)
    assert rec is not None and (rec.duration_ns, rec.end_ns(), rec.total_ns) == (120, 220, 300)
    lc, _ = fold([submitted(3, 100), completed(3, 150, dur=900)], keep=True)
    rec = lc.get(0, 3)
    assert rec is not None and (rec.duration_ns, rec.end_ns()) == (900, 150)
    # unfinished: end_ns is the default given
    lc, _ = fold([submitted(4, 100)], keep=True)
    rec = lc.get(0, 4)
    assert rec is not None and (rec.end_ns(), rec.end_ns(default=555), rec.duration_ns, rec.total_ns) == (
        None, 555, None, None)  # fmt: skip
    assert [r.op for r in lc.unfinished()] == [4]


def test_statuses_go_through_the_phases_and_ranks_are_apart() -> None:
    assert PHASES == ("queued", "merged", "submitted", "completed", "failed")
    lc = OpLifecycles(keep=True)
    seen = []
    for ev in (queued(1, 10, rank=1), queued(1, 11, rank=2), merged(1, (1,), 20, rank=1),
               submitted(1, 30, rank=1), failed(1, 40, rank=1)):  # fmt: skip
        lc.apply(ev)
        seen.append(lc.get(1, 1).status)  # type: ignore[union-attr]
    assert seen == ["queued", "queued", "merged", "submitted", "failed"]
    other = lc.get(2, 1)
    assert other is not None and other.status == "queued" and other.rank == 2


def test_in_flight_follows_ranks_and_directions() -> None:
    lc = OpLifecycles()
    for ev in (submitted(1, 10), submitted(2, 11, d="h2d"), submitted(1, 12, rank=3), submitted(4, 13)):
        lc.apply(ev)
    assert (lc.in_flight_count("d2h"), lc.in_flight_count("h2d")) == (3, 1)
    assert [(r.rank, r.op) for r in lc.in_flight()] == [(0, 1), (0, 2), (3, 1), (0, 4)]
    assert [r.op for r in lc.in_flight(0)] == [1, 2, 4]
    lc.apply(completed(2, 20, d="h2d"))
    lc.apply(failed(1, 21, rank=3))
    assert (lc.in_flight_count("d2h"), lc.in_flight_count("h2d")) == (2, 0)
    assert [r.key for r in lc.unfinished()] == [(0, 1), (0, 4)]


def test_record_names_and_sizes() -> None:
    rec = OpRecord(0, 1, "d2h")
    assert rec.name == "hicache.write" and OpRecord(0, 1, "h2d").name == "hicache.load"
    assert (rec.pools, rec.slots, rec.bytes, rec.node_count, rec.stream, rec.io_backend) == ([], 0, 0, 1, "", "")
    lc, _ = fold([queued(1, 1), queued(2, 2), merged(3, (1, 2), 3), submitted(3, 4, slots=(("kv", 4), ("swa", 2)))])
    rec3 = lc.get(0, 3)
    assert rec3 is not None
    assert (rec3.pools, rec3.slots, rec3.bytes, rec3.node_count) == (["kv", "swa"], 6, 48, 2)
    assert rec3.bytes_by_pool == (("kv", 32), ("swa", 16)) and rec3.merged_from == (1, 2)


# ------------------------------------------------- agreement with the old folds
FAULTS = (None, None, "unrecorded-pool-indices", "host-indices-not-moved", "unmoved-pool-indices")

_PROJECTION_FIELDS = (
    "direction", "node_ids", "merged_from", "merged_into", "queued_ns", "merged_ns", "moved_ns", "submitted_ns",
    "recorded_ns", "finished_ns", "status", "stream", "layer_durations_ns", "slots_by_pool", "bytes_by_pool",
    "error", "moves", "records", "total_ns",
)  # fmt: skip
_OPTABLE_FIELDS = (
    "key", "direction", "merged_ops", "node_ids", "merged_ns", "submit", "done", "moves", "records", "violations",
    "name", "stream", "pools", "slots", "bytes", "node_count", "unrecorded_indices", "unrecorded_pools",
    "completed", "failed", "error", "start_ns", "duration_ns", "queue_wait_ns",
)  # fmt: skip


def _batched_loads(c: Any, n: int, start: bool) -> None:
    """``n`` nodes written, evicted and loaded back in one merge (``start=False``: left queued)."""
    if c.spec.is_hybrid:
        return  # the merge of several loads is the same code on every model
    hosts = []
    for i in range(n):
        kv = c.alloc_device(16)
        if kv is None:
            break
        host = c.write(kv, node_id=1000 + i)
        c.poll_writes()
        c.evict_device(kv)
        if host is not None:
            hosts.append(host)
    for i, h in enumerate(hosts):
        c.load(h, node_id=2000 + i)
    if start:
        c.start_loading()
        c.poll_loads()


def _events(spec_name, runtime, fault, seed, steps, batch, start, close) -> list[Any]:  # type: ignore[no-untyped-def]
    spec = ModelSpec.preset(spec_name)
    if fault is not None and not spec.is_hybrid and fault in ("unrecorded-pool-indices", "unmoved-pool-indices"):
        fault = None  # hybrid-only faults
    c = make_controller(spec, fault=fault, runtime=runtime, **controller_options(spec, device_tokens=256))
    Auditor().attach(c.log)
    try:
        w = Workload(c, seed=seed)
        for _ in range(steps):
            w.step()
        _batched_loads(c, batch, start)
    finally:
        if close:
            c.close()
    return list(c.log.events())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec_name=st.sampled_from(["tiny", "tiny", "tiny_hybrid", "tiny_swa"]),
    runtime=st.sampled_from(["cpu", "sim"]),
    fault=st.sampled_from(FAULTS),
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 12),
    batch=st.integers(0, 4),
    start=st.booleans(),
    close=st.booleans(),
)
def test_the_offline_lifecycle_agrees_with_the_folds_it_replaced(
    spec_name, runtime, fault, seed, steps, batch, start, close
):
    events = _events(spec_name, runtime, fault, seed, steps, batch, start, close)
    lc = OpLifecycles(keep=True)
    loose = []
    for ev in events:
        got = lc.apply(ev)
        assert (got is None) == (type(ev) in NOT_OP_EVENTS)
        if got is not None and got[0] is Step.VIOLATION and got[1] is None:
            loose.append(ev)
    assert lc.anomalies == []

    # inspect's projection: the same ops in the same order, every field it had
    ref = ref_lifecycles(events)
    assert list(lc.records) == list(ref)
    for key, old in ref.items():
        new = lc.records[key]
        for name in _PROJECTION_FIELDS:
            assert getattr(new, name) == getattr(old, name), (key, name)
        assert new.queue_wait_ns == (None if old.queue_wait_ns is None else max(0, old.queue_wait_ns)), key
        if old.duration_ns is not None:  # the old one was the event's own field
            assert new.done is not None and new.done.duration_ns == old.duration_ns  # type: ignore[union-attr]

    # the exporters' table: every record it had, every property, the same order and loose violations
    ref_ops, ref_loose = ref_fold_ops(events)
    assert loose == ref_loose
    keys = {r.key for r in ref_ops}
    assert [r.key for r in lc.top_level() if r.key in keys] == [r.key for r in ref_ops]
    assert all(r.submit is None for r in lc.top_level() if r.key not in keys)
    last = events[-1].ts_ns if events else 0
    for old in ref_ops:
        new = lc.records[old.key]
        for name in _OPTABLE_FIELDS:
            want = getattr(old, name)
            got = getattr(new, name)
            assert got == want, (old.key, name)
        if old.queued_ns is not None:
            assert new.queued_ns == old.queued_ns, old.key
        assert new.end_ns(default=last) == old.end_ns(default=last)
        assert new.error_description() == old.error_description()
        if old.submit is not None:  # before a submission the old table had no slots
            assert (dict(new.slots_by_pool), dict(new.bytes_by_pool)) == (old.slots_by_pool, old.bytes_by_pool)

    # live, each op finishes with the same record the offline fold ends with
    live = OpLifecycles()
    table = RefOpTable(live=True)
    for ev in events:
        got = live.apply(ev)
        table.apply(ev)
        if got is not None and got[0] is Step.FINISHED:
            rec = got[1]
            assert rec is not None and live.get(*rec.key) is None
            kept = lc.records[rec.key]
            assert (rec.submit, rec.done, rec.moves, rec.records, rec.node_ids, rec.queued_ns) == (
                kept.submit, kept.done, kept.moves, kept.records, kept.node_ids, kept.queued_ns)  # fmt: skip
    started = [r.key for r in table.unfinished() if r.submit is not None or r.merged_ns is not None]
    assert [r.key for r in live.unfinished()] == started
