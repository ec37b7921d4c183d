"""Data really moves: write -> device eviction -> reuse of the slots -> load gives the bytes back.

Every test runs on each runtime (cpu, sim, cuda when present) and each model
(plain ``tiny``, hybrid ``tiny_hybrid`` and ``tiny_swa``), for both io backends
and both host layouts.
"""

from __future__ import annotations

import pytest
import torch

from hicache_obs.core import HybridCacheController, PoolTransfer
from hicache_obs.events import fold

IO_BACKENDS = ["kernel", "direct"]
HOST_LAYOUTS = ["layer_first", "page_first"]


def _reuse_freed_slots(c, cache_kit, old):
    """Allocate every free device slot, overwrite ``old``'s slots with other data, keep only those.

    Afterwards ``old``'s slots are allocated again and hold other bytes, and the
    rest of each pool is free, so a load must land elsewhere.
    """
    for pool, idx in old.items():
        filler = c.alloc_device(c.device_pool(pool).allocator.available(), pool=pool)
        assert filler is not None
        old_values = set(cache_kit.values(c, idx))
        filler_values = cache_kit.values(c, filler)
        assert old_values <= set(filler_values), "the evicted slots must be handed out again"
        rest = [v for v in filler_values if v not in old_values]
        if rest:
            c.free_device(c.runtime.to_device(torch.tensor(rest, dtype=torch.int64)), pool=pool)
    return cache_kit.fill(c, old, seed=2)


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("io_backend", IO_BACKENDS)
def test_write_evict_reuse_load_is_bit_identical(
    make_controller, cache_kit, runtime_name, spec_name, io_backend, layout
):
    c = make_controller(io_backend=io_backend, layout=layout)
    node = cache_kit.alloc_node(c, 32)
    data = cache_kit.fill(c, node, seed=1)

    host = cache_kit.write(c, node, node_id=7)
    assert host is not None and set(host) == set(node)
    acks = c.poll_writes()
    assert [(a.ok, a.node_ids, a.direction) for a in acks] == [(True, (7,), "d2h")]
    assert cache_kit.same(cache_kit.read_host(c, host), data), "the host pool must hold the written bytes"

    cache_kit.evict_device(c, node)
    other = _reuse_freed_slots(c, cache_kit, node)
    assert not cache_kit.same(other, data)

    new = cache_kit.load(c, host, node_id=8)
    assert new is not None
    producer = c.start_loading()
    assert producer == 0
    acks = c.poll_loads()
    assert [(a.ok, a.node_ids, a.direction, a.producer_id) for a in acks] == [(True, (8,), "h2d", 0)]
    for pool in node:
        assert not set(cache_kit.values(c, new[pool])) & set(cache_kit.values(c, node[pool])), (
            f"{pool}: load reused old slots"
        )

    assert cache_kit.same(cache_kit.read_device(c, new), data), "loaded bytes differ from the written ones"
    assert cache_kit.same(cache_kit.read_device(c, node), other), "the load wrote outside its own slots"
    assert cache_kit.same(cache_kit.read_host(c, host), data), "a load must not change the host copy"
    assert fold(c.log.events()).snapshot() == c.state.snapshot()

    cache_kit.evict_device(c, new)
    cache_kit.evict_device(c, node)
    cache_kit.evict_host(c, host)
    assert set(cache_kit.used(c).values()) == {0}


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("io_backend", IO_BACKENDS)
def test_merged_load_of_two_nodes_is_bit_identical(
    make_controller, cache_kit, runtime_name, spec_name, io_backend, layout
):
    c = make_controller(io_backend=io_backend, layout=layout, device_size=128)
    a, b = cache_kit.alloc_node(c, 32), cache_kit.alloc_node(c, 16)
    data_a, data_b = cache_kit.fill(c, a, seed=3), cache_kit.fill(c, b, seed=4)
    host_a, host_b = cache_kit.write(c, a, node_id=1), cache_kit.write(c, b, node_id=2)
    assert host_a is not None and host_b is not None
    assert [x.node_ids for x in c.poll_writes()] == [(1,), (2,)]
    cache_kit.evict_device(c, a)
    cache_kit.evict_device(c, b)
    cache_kit.fill(c, a, seed=5)  # stale bytes in the freed slots
    cache_kit.fill(c, b, seed=6)

    # load b first, then a: one merged op in queue order
    new_b, new_a = cache_kit.load(c, host_b, node_id=2), cache_kit.load(c, host_a, node_id=1)
    assert new_a is not None and new_b is not None
    c.start_loading()
    acks = c.poll_loads()
    assert [(x.ok, x.node_ids) for x in acks] == [(True, (2, 1))]
    assert dict(acks[0].slots_by_pool)["kv"] == 48
    assert cache_kit.same(cache_kit.read_device(c, new_a), data_a)
    assert cache_kit.same(cache_kit.read_device(c, new_b), data_b)
    assert fold(c.log.events()).snapshot() == c.state.snapshot()


@pytest.mark.parametrize("io_backend", IO_BACKENDS)
def test_write_moves_every_layer_of_every_pool(make_controller, cache_kit, runtime_name, spec_name, io_backend):
    """The host copy of each pool matches layer by layer (no layer skipped or swapped)."""
    c = make_controller(io_backend=io_backend)
    node = cache_kit.alloc_node(c, 16)
    data = cache_kit.fill(c, node, seed=11)
    host = cache_kit.write(c, node)
    assert host is not None
    c.poll_writes()
    got = cache_kit.read_host(c, host)
    for pool, planes in data.items():
        layers = len(c.spec.layer_ids(pool))
        for plane, t in planes.items():
            assert t.shape[0] == layers
            for layer in range(layers):
                assert torch.equal(cache_kit.bits(got[pool][plane][layer]), cache_kit.bits(t[layer])), (
                    pool,
                    plane,
                    layer,
                )


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("io_backend", IO_BACKENDS)
def test_swa_reusing_kv_indices_round_trips(make_controller, cache_kit, runtime_name, io_backend, layout):
    c = make_controller(spec="tiny_swa", io_backend=io_backend, layout=layout)
    assert isinstance(c, HybridCacheController)
    dev = c.alloc_device(32)
    assert dev is not None
    kv_data = cache_kit.random_data(c, "kv", 32, seed=21)
    swa_data = cache_kit.random_data(c, "swa", 32, seed=22)
    c.device_pool("kv").write_slots(dev, kv_data)
    c.device_pool("swa").write_slots(dev, swa_data)  # the SWA pool at the KV slot numbers

    res = c.write(dev, pool_transfers=[PoolTransfer("swa", indices_from_pool="kv")])
    assert res is not None
    host, resolved = res
    assert resolved is not None and resolved[0].indices_from_pool == "kv"
    c.poll_writes()
    assert cache_kit.same({"swa": c.host_pool("swa").read_slots(host)}, {"swa": swa_data})

    c.evict_device(dev)
    c.device_pool("swa").write_slots(dev, cache_kit.random_data(c, "swa", 32, seed=23))
    res = c.load(host, pool_transfers=[PoolTransfer("swa", indices_from_pool="kv")])
    assert res is not None
    new, _ = res
    c.start_loading()
    assert [a.ok for a in c.poll_loads()] == [True]
    assert cache_kit.same(cache_kit.read_device(c, {"kv": new}), {"kv": kv_data})
    assert cache_kit.same({"swa": c.device_pool("swa").read_slots(new)}, {"swa": swa_data})


def test_sim_write_is_deferred_until_polled(make_controller, cache_kit, spec_name):
    """On sim the backup runs on the write stream: the host is untouched until the work runs."""
    c = make_controller(runtime="sim")
    node = cache_kit.alloc_node(c, 16)
    data = cache_kit.fill(c, node, seed=31)
    with c.runtime.paused():
        host = cache_kit.write(c, node)
        assert host is not None
        assert c.runtime.pending_work() > 0
        assert not cache_kit.same(cache_kit.read_host(c, host), data)
        assert c.poll_writes() == []
        assert c.in_flight("d2h") == 1
    assert [a.ok for a in c.poll_writes()] == [True]
    assert c.in_flight("d2h") == 0
    assert cache_kit.same(cache_kit.read_host(c, host), data)
