"""Allocators, host sizing, atomic multi-pool allocation with rollback, and pool-only transfers."""

from __future__ import annotations

import pytest
import torch

from hicache_obs.core import HiCacheController, HybridCacheController, ModelSpec, PoolTransfer
from hicache_obs.core._pools import host_size
from hicache_obs.errors import InvalidIndicesError
from hicache_obs.events import (
    AllocationFailed,
    OperationQueued,
    PoolCreated,
    SlotsAllocated,
    SlotsFreed,
    expand_runs,
    fold,
)
from hicache_obs.events._state import SlotTable

HYBRID = ["tiny_hybrid", "tiny_swa"]


def _events_since(c, n, cls=None):
    evs = c.log.events()[n:]
    return [e for e in evs if cls is None or isinstance(e, cls)]


# ------------------------------------------------------------- host sizing


def test_host_size_is_whole_pages_plus_one_spare():
    assert host_size(100, 16, ratio=2.0) == 192 + 16  # 200 slots -> 12 whole pages, plus one
    assert host_size(64, 16, ratio=2.0) == 128 + 16
    assert host_size(64, 16, ratio=0.1) == 16  # less than a page: only the spare one
    assert host_size(8, 1, ratio=2.0) == 17
    assert host_size(64, 16, ratio=1.5625) == 96 + 16


def test_host_pools_follow_the_ratio(make_controller, runtime_name, spec_name):
    c = make_controller(device_size=64, host_ratio=3.0)
    created = {(e.pool, e.tier): e for e in c.log.events() if isinstance(e, PoolCreated)}
    assert set(created) == {(p, t) for p in c.spec.pool_names for t in ("device", "host")}
    for pool in c.spec.pool_names:
        dev, host = created[(pool, "device")], created[(pool, "host")]
        ps = 1 if pool == "mamba" else c.spec.page_size
        assert dev.page_size == host.page_size == ps
        assert host.capacity == host_size(dev.capacity, ps, ratio=3.0) == c.host_pool(pool).size
        assert host.capacity % ps == 0
        assert host.slot_bytes == dev.slot_bytes == c.spec.slot_bytes(pool)
        assert c.state.table(pool, "host").capacity == host.capacity


def test_host_pools_fit_a_byte_budget(make_controller, runtime_name, spec_name):
    spec = ModelSpec.preset(spec_name)
    c0 = make_controller(device_size=64)
    device_bytes = sum(c0.device_pool(p).size * spec.slot_bytes(p) for p in spec.pool_names)
    c = make_controller(device_size=64, host_bytes=3 * device_bytes)
    spare = 0
    for pool in spec.pool_names:
        ps = 1 if pool == "mamba" else spec.page_size
        assert c.host_pool(pool).size == host_size(c.device_pool(pool).size, ps, ratio=3.0)
        spare += ps * spec.slot_bytes(pool)
    host_bytes = sum(c.host_pool(p).size * spec.slot_bytes(p) for p in spec.pool_names)
    assert host_bytes <= 3 * device_bytes + spare  # whole pages within the budget, plus the spare pages
    # an odd budget on the plain model: 100 slots' worth -> 96 whole slots + one spare page
    if spec_name == "tiny":
        c = make_controller(device_size=64, host_bytes=100 * spec.slot_bytes("kv"))
        assert c.host_pool().size == 96 + 16


def test_plane_bytes_match_the_spec(make_controller, runtime_name, spec_name):
    c = make_controller(layout="page_first")
    spec = c.spec
    assert spec.kv_size_per_token == 2 * spec.num_kv_heads * spec.head_dim * len(spec.kv_layer_ids) * 2
    for pool in spec.pool_names:
        host = c.host_pool(pool)
        n_layers = len(spec.layer_ids(pool))
        per_slot = sum(t[0, 0].numel() * t.element_size() for t in host.planes.values()) * n_layers
        assert per_slot == spec.slot_bytes(pool)
        for plane in host.planes.values():
            assert plane.shape[:2] == (host.size, n_layers)  # page_first: slots, then layers


# --------------------------------------------------------------- allocator


def test_allocation_is_page_granular_and_reuses_freed_pages_fifo(make_controller, cache_kit, runtime_name, spec_name):
    c = make_controller(device_size=64)
    a = c.alloc_device(16)
    b = c.alloc_device(32)
    assert a is not None and b is not None
    assert cache_kit.values(c, a) == list(range(16))
    assert cache_kit.values(c, b) == list(range(16, 48))
    c.free_device(a)
    c.evict_device(b)
    # free pages in FIFO order: the never-used page 3 first, then page 0, then pages 1 and 2
    assert c.state.table("kv", "device").peek(4) == [3, 0, 1, 2]
    d = c.alloc_device(48)
    assert d is not None
    assert cache_kit.values(c, d) == list(range(48, 64)) + list(range(16)) + list(range(16, 32))
    assert c.device_pool().allocator.available() == 16
    n = len(c.log)
    assert c.alloc_device(32) is None
    [failed] = _events_since(c, n)
    assert isinstance(failed, AllocationFailed)
    assert (failed.pool, failed.tier, failed.requested, failed.available) == ("kv", "device", 32, 16)
    assert c.state.allocation_failures == 1
    empty = c.alloc_device(0)
    assert empty is not None and empty.numel() == 0
    assert fold(c.log.events()).snapshot() == c.state.snapshot()


@pytest.mark.parametrize("spec_name", ["tiny_hybrid"])
def test_mamba_slots_are_single_slot_pages(make_controller, cache_kit, runtime_name, spec_name):
    c = make_controller(pool_sizes={"mamba": 4})
    a = c.alloc_device(3, pool="mamba")
    assert a is not None and cache_kit.values(c, a) == [0, 1, 2]
    c.evict_device(c.runtime.to_device(torch.tensor([1], dtype=torch.int64)), pool="mamba")
    b = c.alloc_device(2, pool="mamba")
    assert b is not None and cache_kit.values(c, b) == [3, 1]
    assert c.alloc_device(1, pool="mamba") is None


def test_alloc_emits_the_slots_it_hands_out(make_controller, cache_kit, runtime_name, spec_name):
    c = make_controller()
    n = len(c.log)
    t = c.alloc_device(32)
    assert t is not None
    [ev] = _events_since(c, n)
    assert isinstance(ev, SlotsAllocated) and (ev.pool, ev.tier) == ("kv", "device")
    assert expand_runs(ev.indices) == cache_kit.values(c, t)
    c.evict_device(t)
    [ev] = _events_since(c, n + 1)
    assert isinstance(ev, SlotsFreed) and ev.reason == "evict" and expand_runs(ev.indices) == cache_kit.values(c, t)


def test_a_page_returns_only_when_all_its_slots_are_free():
    table = SlotTable("kv", "host", capacity=32, page_size=16)
    table.apply_alloc(((0, 16),))
    assert table.available == 16 and table.used == 16
    assert table.apply_free(((0, 8),)) == []
    assert table.available == 16 and table.used == 8
    assert table.apply_free(((8, 8),)) == []
    assert table.available == 32 and table.used == 0
    assert table.peek(2) == [1, 0]
    assert table.apply_free(((0, 1),)) == [0], "a double free is reported, not applied"
    assert table.used == 0


# ---------------------------------------------------------------- rollback


@pytest.mark.parametrize("spec_name", HYBRID)
def test_a_write_that_cannot_back_up_every_pool_rolls_back(make_controller, cache_kit, runtime_name, spec_name):
    side = "mamba" if spec_name == "tiny_hybrid" else "swa"
    c = make_controller(device_size=64, pool_sizes={side: 128}, host_ratio=0.1)
    assert isinstance(c, HybridCacheController)
    ps = c.host_pool(side).page_size
    too_many = c.host_pool(side).size + ps  # more than the sidecar's host pool holds
    kv = c.alloc_device(16)
    dev_side = c.alloc_device(too_many, pool=side)
    assert kv is not None and dev_side is not None
    assert c.host_pool().size >= 16, "the anchor alone would fit"
    before = cache_kit.used(c)
    n = len(c.log)
    res = c.write(kv, pool_transfers=[PoolTransfer(side, device_indices=dev_side)])
    assert res is None
    evs = _events_since(c, n)
    assert [type(e).__name__ for e in evs] == ["SlotsAllocated", "AllocationFailed", "SlotsFreed"]
    alloc, failed, freed = evs
    assert (alloc.pool, alloc.tier) == ("kv", "host")
    assert (failed.pool, failed.tier, failed.requested, failed.available) == (
        side,
        "host",
        too_many,
        c.host_pool(side).size,
    )
    assert (freed.pool, freed.tier, freed.reason, freed.indices) == ("kv", "host", "rollback", alloc.indices)
    assert freed.op == alloc.op
    assert cache_kit.used(c) == before, "slots leaked"
    assert not _events_since(c, n, OperationQueued) and c.state.queues == {"d2h": [], "h2d": []}
    assert c.runtime.to_host(kv).tolist() == list(range(16)), "the caller's indices are unchanged"
    assert fold(c.log.events()).snapshot() == c.state.snapshot()


@pytest.mark.parametrize("spec_name", HYBRID)
def test_a_load_that_cannot_place_every_pool_rolls_back(make_controller, cache_kit, runtime_name, spec_name):
    c = make_controller(device_size=64)
    node = cache_kit.alloc_node(c, 16)
    data = cache_kit.fill(c, node, seed=5)
    host = cache_kit.write(c, node)
    assert host is not None
    c.poll_writes()
    cache_kit.evict_device(c, node)
    side = cache_kit.sidecars(c)[0]
    hog = c.alloc_device(c.device_pool(side).allocator.available(), pool=side)  # the sidecar's device pool is full
    assert hog is not None
    before = cache_kit.used(c)
    n = len(c.log)
    assert cache_kit.load(c, host) is None
    evs = _events_since(c, n)
    assert [(type(e).__name__, e.pool, e.tier) for e in evs] == [
        ("SlotsAllocated", "kv", "device"),
        ("AllocationFailed", side, "device"),
        ("SlotsFreed", "kv", "device"),
    ]
    assert evs[2].reason == "rollback"
    assert cache_kit.used(c) == before
    assert c.start_loading() == -1
    # with room again the same load goes through
    c.evict_device(hog, pool=side)
    new = cache_kit.load(c, host)
    assert new is not None
    c.start_loading()
    assert [a.ok for a in c.poll_loads()] == [True]
    assert cache_kit.same(cache_kit.read_device(c, new), data)
    assert fold(c.log.events()).snapshot() == c.state.snapshot()


def test_a_plain_write_that_does_not_fit_returns_none(make_controller, cache_kit, runtime_name, spec_name):
    c = make_controller(device_size=64, host_ratio=0.1)  # 16 host slots per page-sized pool
    node = cache_kit.alloc_node(c, 32)
    before = cache_kit.used(c)
    n = len(c.log)
    assert cache_kit.write(c, node) is None
    assert [type(e).__name__ for e in _events_since(c, n)] == ["AllocationFailed"]
    assert cache_kit.used(c) == before


# -------------------------------------------------------------- pool-only


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("spec_name", HYBRID)
def test_pool_only_write_and_load(make_controller, cache_kit, runtime_name, spec_name, io_backend):
    c = make_controller(io_backend=io_backend)
    assert isinstance(c, HybridCacheController)
    side = cache_kit.sidecars(c)[0]
    node = cache_kit.alloc_node(c, 16)
    data = cache_kit.fill(c, node, seed=8)
    empty = c.runtime.to_device(torch.empty(0, dtype=torch.int64))
    res = c.write(empty, pool_transfers=[PoolTransfer(side, device_indices=node[side])])
    assert res is not None
    kv_host, (wt,) = res  # type: ignore[misc]
    assert kv_host.numel() == 0
    acks = c.poll_writes()
    assert [dict(a.slots_by_pool) for a in acks] == [{"kv": 0, side: node[side].numel()}]
    assert cache_kit.same({side: c.host_pool(side).read_slots(wt.host_indices)}, {side: data[side]})

    c.evict_device(node[side], pool=side)
    c.device_pool(side).write_slots(node[side], cache_kit.random_data(c, side, node[side].numel(), seed=9))
    res = c.load(torch.empty(0, dtype=torch.int64), pool_transfers=[PoolTransfer(side, host_indices=wt.host_indices)])
    assert res is not None
    kv_dev, (lt,) = res  # type: ignore[misc]
    assert kv_dev.numel() == 0
    c.start_loading()
    assert [(a.ok, dict(a.slots_by_pool)) for a in c.poll_loads()] == [(True, {"kv": 0, side: node[side].numel()})]
    assert cache_kit.same({side: c.device_pool(side).read_slots(lt.device_indices)}, {side: data[side]})
    assert fold(c.log.events()).snapshot() == c.state.snapshot()


def test_an_empty_anchor_without_transfers_is_refused(
    make_controller, cache_kit, assert_rejected, runtime_name, spec_name
):
    c = make_controller()
    empty_dev = c.runtime.to_device(torch.empty(0, dtype=torch.int64))
    empty_host = torch.empty(0, dtype=torch.int64)
    assert_rejected(
        c, InvalidIndicesError, lambda: cache_kit.write(c, {"kv": empty_dev}), "device_indices", "'kv'", "empty"
    )
    assert_rejected(
        c, InvalidIndicesError, lambda: cache_kit.load(c, {"kv": empty_host}), "host_indices", "'kv'", "empty"
    )


def test_a_hybrid_model_needs_the_hybrid_controller(runtime_name):
    from hicache_obs.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'tiny_hybrid'.*HybridCacheController"):
        HiCacheController(ModelSpec.tiny_hybrid(), runtime=runtime_name, device_size=64)
