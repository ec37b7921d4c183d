"""Read models: occupancy over time, op lifecycles, per-tensor record status."""

from __future__ import annotations

import torch
from event_workloads import run_workload

from hicache_obs.core import ModelSpec
from hicache_obs.events import OperationsMerged, SlotsAllocated, SlotsFreed
from hicache_obs.events._projections import lifecycles, occupancy, tensor_records
from hicache_obs.testing import capture_events, make_controller


def test_occupancy_follows_allocations_and_frees() -> None:
    c = make_controller(ModelSpec.tiny(), device_size=512)
    kv = c.alloc_device(64)
    host = c.write(kv, node_id=1)
    c.poll_writes()
    c.evict_device(kv)
    c.evict_host(host)
    occ = occupancy(c.log.events())
    assert [u for _, u in occ[("kv", "device")]] == [0, 64, 0]
    assert [u for _, u in occ[("kv", "host")]] == [0, 64, 0]
    ts = [t for t, _ in occ[("kv", "host")]]
    assert ts == sorted(ts)


def test_lifecycle_stages_in_order_with_durations() -> None:
    c = make_controller(ModelSpec.tiny_hybrid(), device_size=512)
    run_workload(c, rounds=2)
    lcs = lifecycles(c.log.events())
    done = [lc for lc in lcs.values() if lc.status == "completed"]
    assert len(done) == 4
    for lc in done:
        stages = [lc.queued_ns, lc.merged_ns, lc.moved_ns, lc.submitted_ns, lc.recorded_ns, lc.finished_ns]
        assert None not in stages, lc
        assert stages == sorted(stages)  # type: ignore[type-var]
        assert lc.queue_wait_ns is not None and lc.queue_wait_ns >= 0
        assert lc.duration_ns is not None
        assert dict(lc.slots_by_pool) == {"kv": 32, "mamba": 1}
        assert {r.pool for r in lc.records} == {"kv", "mamba"}
    loads = [lc for lc in done if lc.direction == "h2d"]
    assert all(lc.layer_durations_ns is not None and len(lc.layer_durations_ns) == 8 for lc in loads)


def test_merged_ops_point_at_their_merge() -> None:
    c = make_controller(ModelSpec.tiny(), device_size=512)
    kv = [c.alloc_device(16) for _ in range(3)]
    hosts = [c.write(k, node_id=i) for i, k in enumerate(kv)]
    c.poll_writes()
    for k in kv:
        c.evict_device(k)
    for i, h in enumerate(hosts):
        c.load(h, node_id=10 + i)
    c.start_loading()
    c.poll_loads()
    merged = [e for e in c.log.events() if isinstance(e, OperationsMerged) and len(e.merged_ops) > 1]
    assert len(merged) == 1
    m = merged[0]
    lcs = lifecycles(c.log.events())
    assert lcs[(0, m.op)].node_ids == (10, 11, 12)
    assert lcs[(0, m.op)].status == "completed"
    for src in m.merged_ops:
        assert lcs[(0, src)].merged_into == m.op


def test_tensor_records_show_what_was_recorded() -> None:
    with capture_events() as cap:
        c = make_controller(fault="unrecorded-pool-indices", device_size=512, log=cap.log)
        run_workload(c, rounds=1)
    recs = tensor_records(cap.events)
    needing = [r for r in recs if r.needs_record]
    assert {(r.pool, r.role, r.recorded) for r in needing} == {
        ("kv", "host", True),
        ("kv", "device", True),
        ("mamba", "host", False),
        ("mamba", "device", False),
    }
    assert all(r.stream in ("hicache-write", "hicache-load") for r in recs)


def test_capture_events_collects_only_inside_the_block() -> None:
    c = make_controller(ModelSpec.tiny(), device_size=512)
    with capture_events(c.log) as cap:
        kv = c.alloc_device(16)
    c.evict_device(kv)
    assert cap.types() == ["SlotsAllocated"]
    assert isinstance(kv, torch.Tensor)
    (allocated,) = cap.of_type(SlotsAllocated)
    assert allocated.pool == "kv" and allocated.tier == "device"
    assert cap.of_type(SlotsFreed) == [] and cap.of_type(SlotsFreed, SlotsAllocated) == [allocated]
