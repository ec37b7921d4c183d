"""The SGLang engine's acks: what each says comes from its op's lifecycle record.

The engine reaps SGLang's own ack queues; the slots, bytes, producer and timing of each
ack must be those the log holds for that op (its ``TransferSubmitted`` and completion),
and a write that failed in its submission is acked as failed, with its op's slots.
"""

from __future__ import annotations

import pytest
from sglang_env import RELEASE, release_tuple

from hicache_obs.core._operations import PoolTransfer
from hicache_obs.core._spec import ModelSpec
from hicache_obs.events._log import EventLog
from hicache_obs.events._schema import D2H, H2D, OperationQueued, TransferCompleted, TransferFailed, TransferSubmitted

FIXED = release_tuple() >= (0, 5, 11)


def _engine(spec: ModelSpec, io_backend: str = "kernel") -> tuple[object, EventLog]:
    from hicache_obs.lab.sglang.engine import build_engine, build_harness

    h = build_harness(
        spec, io_backend=io_backend, layout="page_first", write_policy="write_through", device_tokens=16 * spec.page_size
    )
    log = EventLog()
    return build_engine(h, log=log), log


def _by_op(log: EventLog, cls: type) -> dict[int, object]:
    return {e.op: e for e in log.events() if isinstance(e, cls)}


@pytest.mark.needs_sglang
def test_each_ack_says_what_the_log_holds_for_its_op() -> None:
    spec = ModelSpec.tiny()
    eng, log = _engine(spec)
    try:
        nodes = {11: 2, 12: 1}  # node id -> pages
        dev = {n: eng.alloc_device(p * spec.page_size) for n, p in nodes.items()}
        host = {n: eng.write(dev[n], node_id=n) for n in nodes}
        assert all(t is not None for t in host.values())
        eng.start_writing()
        eng.synchronize()
        writes = eng.poll_writes()
        for n in nodes:
            eng.free_device(dev[n])
        loaded = {n: eng.load(host[n], node_id=n) for n in nodes}
        assert all(t is not None for t in loaded.values())
        eng.start_loading()
        eng.synchronize()
        loads = eng.poll_loads()
    finally:
        eng.close()
    submitted = _by_op(log, TransferSubmitted)
    completed = _by_op(log, TransferCompleted)
    assert [a.direction for a in writes] == [D2H] * len(writes) and writes
    assert [a.direction for a in loads] == [H2D] and sorted(loads[0].node_ids) == sorted(nodes)
    assert sorted(n for a in writes for n in a.node_ids) == sorted(nodes)
    for ack in writes + loads:
        sub, done = submitted[ack.op_id], completed[ack.op_id]
        assert ack.ok and ack.error is None
        assert ack.slots_by_pool == sub.slots_by_pool and sum(s for _, s in ack.slots_by_pool) > 0
        assert ack.bytes_by_pool == sub.bytes_by_pool and sum(b for _, b in ack.bytes_by_pool) > 0
        assert ack.producer_id == sub.producer_id
        assert ack.duration_ns == done.duration_ns
        assert ack.layer_durations_ns == done.layer_durations_ns
    tokens = sum(nodes.values()) * spec.page_size
    assert sum(s for a in writes for _, s in a.slots_by_pool) == tokens
    assert sum(s for _, s in loads[0].slots_by_pool) == tokens
    assert not eng._finished  # every finished record was handed to its ack, none kept


@pytest.mark.needs_sglang
@pytest.mark.skipif(RELEASE is not None and FIXED, reason="0.5.10's kernel copy refuses the Mamba host indices")
def test_a_write_that_fails_at_submission_is_acked_failed_with_its_slots() -> None:
    spec = ModelSpec.tiny_hybrid()
    eng, log = _engine(spec, "kernel")
    try:
        kv = eng.alloc_device(spec.page_size)
        mamba = eng.alloc_device(1, pool="mamba")
        res = eng.write(kv, node_id=5, pool_transfers=[PoolTransfer("mamba", device_indices=mamba)])
        assert res is not None
        eng.synchronize()
        acks = eng.poll_writes()
    finally:
        eng.close()
    failed = _by_op(log, TransferFailed)
    assert len(acks) == 1 and not acks[0].ok
    ack = acks[0]
    assert ack.op_id in failed and ack.error == failed[ack.op_id].error
    assert "Destination indices must be a CUDA tensor" in (ack.error or "")
    assert ack.node_ids == (5,)
    queued = [e for e in log.events() if isinstance(e, OperationQueued)]
    want: dict[str, int] = {}
    for q in queued:
        for pool, n in q.slots_by_pool:
            want[pool] = want.get(pool, 0) + n
    sub = _by_op(log, TransferSubmitted).get(ack.op_id)
    assert dict(ack.slots_by_pool) == (dict(sub.slots_by_pool) if sub is not None else want)
    assert dict(ack.slots_by_pool).get("kv", 0) == spec.page_size, ack.slots_by_pool
