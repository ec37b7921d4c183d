"""``CacheState`` keeps its ops in the live op lifecycle: the records, the snapshot tuple and
the anomalies a bookkeeping reader sees."""

from __future__ import annotations

from typing import Any

import pytest

from hicache_obs.events._lifecycle import OpLifecycles, OpRecord
from hicache_obs.events._schema import (
    OperationQueued,
    OperationsMerged,
    PoolCreated,
    SlotsFreed,
    TransferCompleted,
    TransferSubmitted,
)
from hicache_obs.events._state import CacheState, OpState, fold


def _events(*specs: tuple[type, dict[str, Any]]) -> list[Any]:
    return [cls(seq=i, ts_ns=1_000 + i, rank=0, **kw) for i, (cls, kw) in enumerate(specs)]


def _queued(op: int, node: int, prio: int, slots: tuple[tuple[str, int], ...]) -> tuple[type, dict[str, Any]]:
    return OperationQueued, {"op": op, "direction": "h2d", "node_id": node, "priority": prio, "slots_by_pool": slots}


def _submitted(op: int, slots: tuple[tuple[str, int], ...], producer: int = -1) -> tuple[type, dict[str, Any]]:
    return TransferSubmitted, {
        "op": op,
        "direction": "h2d",
        "stream": "hicache-load",
        "io_backend": "direct",
        "layout": "layer_first",
        "tensors": (),
        "slots_by_pool": slots,
        "bytes_by_pool": (),
        "producer_id": producer,
    }


def test_ops_are_the_lifecycles_records_and_the_snapshot_keeps_its_tuple() -> None:
    assert OpState is OpRecord
    evs = _events(
        _queued(1, 10, 5, (("kv", 16),)),
        _queued(2, 11, 3, (("kv", 16), ("mamba", 1))),
        _queued(3, 12, 9, (("kv", 4),)),
        (OperationsMerged, {"op": 4, "merged_ops": (1, 2), "direction": "h2d"}),
    )
    st = fold(evs)
    assert isinstance(st.lifecycles, OpLifecycles) and not st.lifecycles.keep and not st.lifecycles.detail
    assert list(st.ops) == [3, 4] and all(isinstance(r, OpRecord) for r in st.ops.values())
    assert st.snapshot()["ops"] == {
        3: (3, "h2d", (12,), 9, (("kv", 4),), "queued", -1),
        4: (4, "h2d", (10, 11), 3, (("kv", 32), ("mamba", 1)), "merged", -1),
    }
    assert st.snapshot()["queues"]["h2d"] == (3,)
    st.apply(TransferSubmitted(seq=4, ts_ns=1_004, rank=0, **_submitted(4, (("kv", 32), ("mamba", 1)), 7)[1]))
    assert st.snapshot()["ops"][4] == (4, "h2d", (10, 11), 3, (("kv", 32), ("mamba", 1)), "submitted", 7)
    assert st.snapshot()["acks"]["h2d"] == (4,)
    st.apply(TransferCompleted(seq=5, ts_ns=1_005, rank=0, op=4, direction="h2d", duration_ns=1))
    assert list(st.ops) == [3] and 4 not in st.ops and st.completed["h2d"] == 1
    assert st.lifecycles.get(0, 4) is None  # live: a finished op is forgotten


def test_ops_are_read_only() -> None:
    st = fold(_events(_queued(1, 10, 5, (("kv", 16),))))
    with pytest.raises(TypeError):
        st.ops[2] = st.ops[1]  # type: ignore[index]
    assert st.ops[1].node_ids == (10,) and len(st.ops) == 1 and 1 in st.ops and 2 not in st.ops
    with pytest.raises(KeyError):
        st.ops[2]


def test_a_submission_without_a_queue_entry_gets_the_op_id_as_priority() -> None:
    st = fold(_events(_submitted(6, (("kv", 8),), 2)))
    assert st.snapshot()["ops"] == {6: (6, "h2d", (), 6, (("kv", 8),), "submitted", 2)}


def test_merge_anomalies_keep_their_place_among_the_others() -> None:
    evs = _events(
        (
            PoolCreated,
            {"pool": "kv", "tier": "host", "capacity": 8, "page_size": 1, "slot_bytes": 8, "layout": "layer_first"},
        ),
        (SlotsFreed, {"pool": "kv", "tier": "host", "indices": ((0, 1),), "op": -1, "reason": "evict"}),
        (OperationsMerged, {"op": 9, "merged_ops": (9, 77), "direction": "h2d"}),
        (TransferCompleted, {"op": 5, "direction": "h2d", "duration_ns": 1}),
        (SlotsFreed, {"pool": "kv", "tier": "host", "indices": ((1, 1),), "op": -1, "reason": "evict"}),
    )
    st = CacheState()
    for ev in evs:
        st.apply(ev)
    assert [(seq, kind) for seq, kind, _ in st.anomalies] == [
        (1, "double_free"),
        (2, "merge_unknown_op"),
        (2, "merge_unknown_op"),
        (3, "ack_unknown_op"),
        (4, "double_free"),
    ]
    assert st.lifecycles.anomalies is st.anomalies
    assert st.snapshot()["ops"] == {9: (9, "h2d", (), 9, (), "merged", -1)}


def test_apply_freed_returns_the_slots_a_free_found_not_allocated() -> None:
    import msgspec

    from hicache_obs.core import ModelSpec
    from hicache_obs.events import CacheState, SlotsFreed
    from hicache_obs.testing import make_controller

    c = make_controller(ModelSpec.tiny(), device_size=512)
    kv = c.alloc_device(32)
    state = CacheState()
    for ev in c.log.events():
        state.apply(ev)
    (alloc,) = [e for e in c.log.events() if type(e).__name__ == "SlotsAllocated"]
    free = SlotsFreed(pool=alloc.pool, tier=alloc.tier, indices=alloc.indices, seq=alloc.seq + 1, ts_ns=alloc.ts_ns)
    assert state.apply_freed(free) == () and state.last_seq == free.seq  # they were allocated
    again = msgspec.structs.replace(free, seq=free.seq + 1)
    assert [tuple(r) for r in state.apply_freed(again)] == [tuple(r) for r in alloc.indices]  # a double free
    assert any(kind == "double_free" for _, kind, _ in state.anomalies)
    del kv
    c.close()
