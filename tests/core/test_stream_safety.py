"""SGLang #22940 on the ``sim`` runtime: sidecar pool indices not recorded on the transfer stream.

Before the fix the hybrid controller recorded only the anchor's (KV) index
tensors on the side stream. With the ``kernel`` io backend the Mamba/SWA host
indices are moved to the device for the copy; once ``start_loading()`` returns
nobody holds that moved tensor, the caching allocator hands its block to the
next allocation of the same size, and the still-queued copy reads whatever the
new owner wrote there. ``FaultyHybridController`` reproduces exactly that; the
real :class:`HybridCacheController` under the same sequence keeps the data.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hicache_obs.core import HybridCacheController
from hicache_obs.core._controller import ANCHOR
from hicache_obs.events import StreamRecorded, fold


class FaultyHybridController(HybridCacheController):
    """The pre-#22940 record step: only the anchor's index tensors are recorded on the stream."""

    def _record_transfer_indices_on_stream(self, stream, host_indices, device_indices, pool_transfers, *, op=-1):
        self._record_pair(stream, ANCHOR, host_indices, device_indices, op)


def _backed_up_nodes(c, cache_kit, count):
    """Write ``count`` nodes (KV + sidecar) and wait for each; returns (device, host, data) per node."""
    out = []
    for i in range(count):
        node = cache_kit.alloc_node(c, 32)
        data = cache_kit.fill(c, node, seed=100 + i)
        host = cache_kit.write(c, node, node_id=i)
        assert host is not None
        # reap before anything else is allocated: this part of the scenario is not under test
        assert [a.ok for a in c.poll_writes()] == [True]
        assert cache_kit.same(cache_kit.read_host(c, host), data)
        out.append((node, host, data))
    return out


def _load_with_pressure(cls, make_controller, cache_kit, spec_name):
    """The scenario of the bug report; returns what the sidecar pool holds after the load."""
    c = make_controller(spec=spec_name, runtime="sim", cls=cls, io_backend="kernel", device_size=128)
    rt = c.runtime
    (node_a, host_a, data_a), (node_b, host_b, data_b) = _backed_up_nodes(c, cache_kit, 2)
    cache_kit.evict_device(c, node_a)
    cache_kit.evict_device(c, node_b)
    del node_a, node_b

    side = cache_kit.sidecars(c)[0]
    new = cache_kit.load(c, host_a, node_id=0)
    assert new is not None
    reused_before = rt.blocks_reused
    assert c.start_loading() == 0
    assert rt.pending_work() > 0, "the load must still be queued on the load stream"
    gc.collect()
    deferred = rt.deferred_blocks  # freed blocks held back until the load stream ran
    # the scheduler goes on: new device index tensors of the same size, holding other values
    pressure = [rt.to_device(host_b[side].clone()) for _ in range(4)]
    reused = rt.blocks_reused - reused_before
    acks = c.poll_loads()
    assert [a.ok for a in acks] == [True]
    got = cache_kit.read_device(c, {ANCHOR: new[ANCHOR], side: new[side]})
    recorded = {
        (e.pool, e.role) for e in c.log.events() if isinstance(e, StreamRecorded) and e.stream == "hicache-load"
    }
    assert fold(c.log.events()).snapshot() == c.state.snapshot()
    del pressure
    return got, data_a, data_b, side, reused, deferred, recorded


@pytest.mark.parametrize("spec_name", ["tiny_hybrid", "tiny_swa"])
def test_unrecorded_sidecar_indices_corrupt_the_load(make_controller, cache_kit, spec_name):
    got, data_a, data_b, side, reused, deferred, recorded = _load_with_pressure(
        FaultyHybridController, make_controller, cache_kit, spec_name
    )
    assert deferred == 1, "only the anchor's moved host indices wait for the stream"
    assert reused >= 1, "the freed index block must be handed out again"
    assert (side, "host") not in recorded
    assert cache_kit.same({ANCHOR: got[ANCHOR]}, {ANCHOR: data_a[ANCHOR]}), "the recorded anchor stays intact"
    assert not cache_kit.same({side: got[side]}, {side: data_a[side]}), f"expected corrupted {side} state"
    # not garbage by chance: the copy read the new owner's indices, i.e. node b's state
    assert cache_kit.same({side: got[side]}, {side: data_b[side]})


@pytest.mark.parametrize("spec_name", ["tiny_hybrid", "tiny_swa"])
def test_recorded_sidecar_indices_keep_the_load_intact(make_controller, cache_kit, spec_name):
    got, data_a, _, side, _, deferred, recorded = _load_with_pressure(
        HybridCacheController, make_controller, cache_kit, spec_name
    )
    assert {(ANCHOR, "host"), (ANCHOR, "device"), (side, "host"), (side, "device")} <= recorded
    assert deferred == 2, "both moved host index tensors (anchor and sidecar) wait for the stream"
    assert cache_kit.same(got, data_a)


@pytest.mark.parametrize("cls", [FaultyHybridController, HybridCacheController], ids=["faulty", "fixed"])
def test_unrecorded_sidecar_indices_misdirect_the_backup(make_controller, cache_kit, cls):
    """The write direction: the moved host indices are clobbered before the backup runs."""
    c = make_controller(spec="tiny_hybrid", runtime="sim", cls=cls, io_backend="kernel", device_size=128)
    rt = c.runtime
    node = cache_kit.alloc_node(c, 32)
    data = cache_kit.fill(c, node, seed=7)
    with rt.paused():
        host = cache_kit.write(c, node)
        assert host is not None
        gc.collect()
        # other host slots of the mamba pool, still in range
        decoy = torch.tensor([v + 4 for v in host["mamba"].tolist()], dtype=torch.int64)
        pressure = [rt.to_device(decoy) for _ in range(4)]
    assert [a.ok for a in c.poll_writes()] == [True]
    intact = cache_kit.same(cache_kit.read_host(c, host), data)
    del pressure
    assert intact is (cls is HybridCacheController)


def _detail_log(spec_name: str, fault: str | None) -> list[object]:
    """The events of a full-detail workload, with header times, pointers and durations left out."""
    import msgspec

    from hicache_obs.core import ModelSpec
    from hicache_obs.events import EventLog
    from hicache_obs.lab.workload import Workload, controller_options
    from hicache_obs.testing import make_controller

    spec = ModelSpec.preset(spec_name)
    log = EventLog(capacity=None)
    c = make_controller(spec, fault=fault, log=log, runtime="sim", event_detail="full", **controller_options(spec))
    Workload(c, seed=5).run(80)
    assert not c._reports.refs  # nothing keyed by id() outlives a submission
    c.close()

    def strip(x: object) -> object:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("ts_ns", "ptr", "duration_ns", "layer_durations_ns")}
        if isinstance(x, (list, tuple)):
            return [strip(v) for v in x]
        return x

    return [strip(msgspec.to_builtins(e)) for e in log.events()]


@pytest.mark.parametrize("spec_name", ["tiny_hybrid", "tiny_swa"])
@pytest.mark.parametrize("fault", [None, "unrecorded-pool-indices"])
def test_stream_records_reuse_the_submissions_descriptions_exactly(
    spec_name: str, fault: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache_obs.core._reports import RuntimeReports

    reused = _detail_log(spec_name, fault)
    assert sum(1 for e in reused if e["type"] == "StreamRecorded") > 20  # type: ignore[index]
    # every stream record describes its tensor anew: what the reuse must equal
    monkeypatch.setattr(RuntimeReports, "refs", property(lambda self: {}, lambda self, v: None))
    fresh = _detail_log(spec_name, fault)
    assert reused == fresh
