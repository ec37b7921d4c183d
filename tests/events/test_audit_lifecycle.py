"""The auditor keeps what it knows of an op in flight on the op's lifecycle record: in fold
mode the bookkeeping's own (one fold for replay and audit), live its own."""

from __future__ import annotations

from typing import Any

from event_workloads import EventList

from hicache_obs.events._audit import Auditor, audit
from hicache_obs.events._replay import replay
from hicache_obs.events._schema import (
    OperationQueued,
    OperationsMerged,
    PoolCreated,
    SlotsAllocated,
    SlotsFreed,
    StreamRecorded,
    TensorRef,
    TransferCompleted,
    TransferSubmitted,
)


def _ref(role: str, device: str, slots: tuple[tuple[int, int], ...]) -> TensorRef:
    return TensorRef(
        pool="kv", role=role, device=device, dtype="int64", numel=sum(n for _, n in slots), indices=slots, ptr=1
    )


def _submit(log: EventList, op: int, *tensors: TensorRef) -> None:
    log.add(
        TransferSubmitted,
        op=op,
        direction="d2h",
        stream="hicache-write",
        io_backend="direct",
        layout="layer_first",
        tensors=tensors,
        slots_by_pool=(("kv", 2),),
        bytes_by_pool=(("kv", 16),),
    )


def _pool(log: EventList) -> None:
    log.add(PoolCreated, pool="kv", tier="host", capacity=8, page_size=1, slot_bytes=8, layout="layer_first")
    log.add(SlotsAllocated, pool="kv", tier="host", indices=((0, 4),))


def _keys(found: list[Any]) -> list[tuple[Any, ...]]:
    return [(f.rule, f.op, f.pool, f.role, f.seq, f.detail) for f in found]


def test_a_merge_that_names_an_op_in_flight_loses_none_of_its_findings() -> None:
    # the bookkeeping's lifecycle forgets op 1 at the merge (a source of op 5); its transfer still runs
    log = EventList()
    _pool(log)
    log.add(OperationQueued, op=2, direction="d2h", node_id=2, priority=0, slots_by_pool=(("kv", 1),))
    _submit(log, 1, _ref("host", "cpu", ((0, 2),)))
    log.add(OperationsMerged, op=5, merged_ops=(1, 2), direction="d2h")
    log.add(SlotsFreed, pool="kv", tier="host", indices=((0, 1),))
    live = audit(log.events)
    fold = replay(log.events, audit=True).findings
    assert fold is not None
    assert _keys(live) == _keys(fold)
    assert [(f.rule, f.op) for f in live] == [("slot_not_allocated", 1), ("incomplete_operation", 1)]
    assert "while d2h op 1 on stream 'hicache-write' still uses them (use after free)" in live[0].detail
    assert "op 1 (d2h) was submitted on stream 'hicache-write' at seq 3" in live[1].detail


def test_a_merged_away_op_still_needs_its_record_stream_and_leaves_at_its_end() -> None:
    log = EventList()
    _pool(log)
    _submit(log, 1, _ref("device", "sim:0", ((0, 2),)))
    log.add(OperationsMerged, op=5, merged_ops=(1, 9), direction="d2h")
    log.add(TransferCompleted, op=1, direction="d2h", duration_ns=1)
    found = replay(log.events, audit=True).findings
    assert found is not None
    assert _keys(found) == _keys(audit(log.events))
    assert [(f.rule, f.op, f.role, f.seq) for f in found] == [("unrecorded_index", 1, "device", 4)]


def test_fold_mode_keeps_the_evidence_on_the_bookkeepings_record() -> None:
    log = EventList()
    _pool(log)
    _submit(log, 3, _ref("device", "sim:0", ((0, 2),)))
    auditor = Auditor(fold_state=True).feed(log.events)
    rec = auditor.states[0].lifecycles.get(0, 3)
    assert rec is not None and rec.status == "submitted" and rec.evidence is not None
    log.add(
        StreamRecorded,
        op=3,
        pool="kv",
        role="device",
        stream="hicache-write",
        tensor=_ref("device", "sim:0", ((0, 2),)),
    )
    log.add(TransferCompleted, op=3, direction="d2h", duration_ns=1)
    auditor.feed(log.events[-2:])
    assert auditor.states[0].lifecycles.get(0, 3) is None  # finished: forgotten
    assert auditor.finish() == []  # recorded on its stream before it completed
