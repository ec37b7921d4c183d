"""Per-layer load completion: LayerDoneCounter's ring of three, busy slots and ``wait_until``."""

from __future__ import annotations

import pytest
import torch

from hicache_obs.core import LayerDoneCounter
from hicache_obs.core._sim import SimRuntime
from hicache_obs.errors import ConfigError, ProducerSlotBusyError


def _backed_up_evicted(c, cache_kit, n_nodes):
    """``n_nodes`` nodes written, reaped and evicted from the device; returns (host, data) per node."""
    out = []
    for i in range(n_nodes):
        node = cache_kit.alloc_node(c, 16)
        data = cache_kit.fill(c, node, seed=40 + i)
        host = cache_kit.write(c, node, node_id=i)
        assert host is not None
        assert [a.ok for a in c.poll_writes()] == [True]
        cache_kit.evict_device(c, node)
        out.append((host, data))
    return out


def _arrived_layers(c, cache_kit, new, data):
    """Global layer ids whose bytes (every pool, every plane) arrived in ``new``'s device slots."""
    got = cache_kit.read_device(c, new)
    per_layer: dict[int, bool] = {}
    for pool, planes in data.items():
        layer_ids = c.spec.layer_ids(pool)
        for plane, want in planes.items():
            for local, layer in enumerate(layer_ids):
                same = torch.equal(cache_kit.bits(got[pool][plane][local]), cache_kit.bits(want[local]))
                per_layer[layer] = per_layer.get(layer, True) and same
    return sorted(layer for layer, ok in per_layer.items() if ok)


def _clear(c, cache_kit, new):
    for pool, idx in new.items():
        planes = cache_kit.random_data(c, pool, idx.numel(), seed=0)
        c.device_pool(pool).write_slots(idx, {k: torch.zeros_like(v) for k, v in planes.items()})


def test_start_loading_walks_a_ring_of_three(make_controller, cache_kit, runtime_name, spec_name):
    c = make_controller(device_size=128)
    nodes = _backed_up_evicted(c, cache_kit, 1)
    host, data = nodes[0]
    assert c.start_loading() == -1, "nothing queued"
    producers = []
    for _ in range(5):
        new = cache_kit.load(c, host)
        assert new is not None
        producers.append(c.start_loading())
        assert [a.ok for a in c.poll_loads()] == [True]
        assert cache_kit.same(cache_kit.read_device(c, new), data)
        cache_kit.evict_device(c, new)
    assert producers == [0, 1, 2, 0, 1]


@pytest.mark.parametrize("runtime_name", ["sim"])
def test_a_busy_producer_slot_is_refused(make_controller, cache_kit, assert_rejected, runtime_name, spec_name):
    c = make_controller(device_size=128)
    nodes = _backed_up_evicted(c, cache_kit, 4)
    rt = c.runtime
    news = []
    with rt.paused():
        for i, (host, _) in enumerate(nodes[:3]):
            news.append(cache_kit.load(c, host, node_id=i))
            assert c.start_loading() == i
        news.append(cache_kit.load(c, nodes[3][0], node_id=3))
        err = assert_rejected(c, ProducerSlotBusyError, c.start_loading, "slot 0", "previous load")
        assert "poll" in str(err)
        assert c.poll_loads() == []
        assert c.layer_done_counter.producer_index == 2
    assert [a.node_ids for a in c.poll_loads()] == [(0,), (1,), (2,)]
    assert c.start_loading() == 0, "the slot is free once its load finished"
    assert [a.node_ids for a in c.poll_loads()] == [(3,)]
    for new, (_, data) in zip(news, nodes):
        assert cache_kit.same(cache_kit.read_device(c, new), data)


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("runtime_name", ["sim"])
def test_wait_until_runs_exactly_the_work_up_to_that_layer(
    make_controller, cache_kit, runtime_name, spec_name, io_backend
):
    c = make_controller(io_backend=io_backend)
    rt = c.runtime
    [(host, data)] = _backed_up_evicted(c, cache_kit, 1)
    ldc = c.layer_done_counter
    with rt.paused():
        new = cache_kit.load(c, host)
        assert new is not None
        _clear(c, cache_kit, new)
        producer = c.start_loading()
    assert _arrived_layers(c, cache_kit, new, data) == []
    queued = rt.pending_work()
    assert queued > 0

    ldc.wait_until(0)  # no consumer yet: nothing happens
    assert rt.pending_work() == queued and _arrived_layers(c, cache_kit, new, data) == []

    ldc.set_consumer(producer)
    ldc.wait_until(0)
    assert _arrived_layers(c, cache_kit, new, data) == [0]
    after_first = rt.pending_work()
    assert 0 < after_first < queued
    last = c.spec.num_layers - 1
    ldc.wait_until(last - 1)
    assert _arrived_layers(c, cache_kit, new, data) == list(range(last))
    ldc.wait_until(1)  # already done: runs nothing more
    assert _arrived_layers(c, cache_kit, new, data) == list(range(last))
    ldc.wait_until(last)
    assert _arrived_layers(c, cache_kit, new, data) == list(range(last + 1))
    assert [a.ok for a in c.poll_loads()] == [True]
    assert cache_kit.same(cache_kit.read_device(c, new), data)

    ldc.reset()
    assert ldc.consumer_index == -1
    ldc.wait_until(last + 10)  # a no-op again, even for a layer that does not exist


def test_wait_until_on_a_synchronous_runtime_finds_everything_there(make_controller, cache_kit, spec_name):
    c = make_controller(runtime="cpu")
    [(host, data)] = _backed_up_evicted(c, cache_kit, 1)
    new = cache_kit.load(c, host)
    assert new is not None
    c.layer_done_counter.set_consumer(c.start_loading())
    c.layer_done_counter.wait_until(0)
    assert cache_kit.same(cache_kit.read_device(c, new), data)


def test_layer_and_consumer_bounds(make_controller, runtime_name, spec_name):
    ldc = make_controller().layer_done_counter
    with pytest.raises(ConfigError, match="consumer index 3"):
        ldc.set_consumer(3)
    ldc.set_consumer(0)
    with pytest.raises(ConfigError, match=f"layer {ldc.num_layers} outside"):
        ldc.wait_until(ldc.num_layers)


def test_update_producer_checks_the_slot_it_takes_next():
    rt = SimRuntime()
    side = rt.stream("side")
    ldc = LayerDoneCounter(rt, num_layers=2)
    with rt.paused():
        finishes = []
        for expected in (0, 1, 2):
            assert ldc.update_producer() == expected
            ev = rt.event()
            ev.record(side)
            ldc.set_finish_event(expected, ev)
            finishes.append(ev)
        with pytest.raises(ProducerSlotBusyError, match="slot 0"):
            ldc.update_producer()
        assert ldc.producer_index == 2
    assert ldc.update_producer() == 0  # query() ran the side stream up to slot 0's event
    assert finishes[0].query()
    # a fresh set of layer events for the new load
    assert all(e.stream is None for e in ldc.events[0])
