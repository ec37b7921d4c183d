"""Ack queues reaped in FIFO order, and the write policies."""

from __future__ import annotations

import pytest

from hicache_obs.core import WRITE_POLICIES, WritePolicy
from hicache_obs.errors import ConfigError
from hicache_obs.events import TransferCompleted, fold

# ------------------------------------------------------------------ acks


@pytest.mark.parametrize("runtime_name", ["sim"])
def test_write_acks_are_reaped_fifo_and_stop_at_the_first_unfinished(
    make_controller, cache_kit, runtime_name, spec_name
):
    c = make_controller(device_size=128)
    nodes = [cache_kit.alloc_node(c, 16) for _ in range(3)]
    data = [cache_kit.fill(c, n, seed=60 + i) for i, n in enumerate(nodes)]
    stream = c.write_stream
    with c.runtime.paused():
        hosts = []
        tickets = []
        for i, node in enumerate(nodes):
            hosts.append(cache_kit.write(c, node, node_id=i))
            tickets.append(stream.submitted)  # the last work item of this op: its finish event
        assert c.poll_writes() == []
        assert c.in_flight("d2h") == 3
        stream.run_until(tickets[0])  # the device finished the first op only
        assert [a.node_ids for a in c.poll_writes()] == [(0,)]
        assert cache_kit.same(cache_kit.read_host(c, hosts[0]), data[0])
        assert not cache_kit.same(cache_kit.read_host(c, hosts[1]), data[1])
        assert c.poll_writes() == [], "op 1 is unfinished: nothing behind it is reaped"
        assert len(c.state.acks["d2h"]) == 2 and c.in_flight("d2h") == 2
        assert fold(c.log.events()).snapshot() == c.state.snapshot()
    acks = c.poll_writes()
    assert [a.node_ids for a in acks] == [(1,), (2,)]
    completed = [e.op for e in c.log.events() if isinstance(e, TransferCompleted)]
    assert completed == sorted(completed), "completions are logged in submission order"
    for h, d in zip(hosts, data):
        assert cache_kit.same(cache_kit.read_host(c, h), d)


@pytest.mark.parametrize("runtime_name", ["sim"])
def test_load_acks_are_reaped_fifo(make_controller, cache_kit, runtime_name, spec_name):
    c = make_controller(device_size=128)
    backed = []
    for i in range(2):
        node = cache_kit.alloc_node(c, 16)
        data = cache_kit.fill(c, node, seed=70 + i)
        host = cache_kit.write(c, node, node_id=i)
        c.poll_writes()
        cache_kit.evict_device(c, node)
        backed.append((host, data))
    with c.runtime.paused():
        news = []
        tickets = []
        for i, (host, _) in enumerate(backed):
            news.append(cache_kit.load(c, host, node_id=10 + i))
            c.start_loading()
            tickets.append(c.load_stream.submitted)
        assert c.poll_loads() == []
        c.load_stream.run_until(tickets[0])
        acks = c.poll_loads()
        assert [(a.node_ids, a.producer_id) for a in acks] == [((10,), 0)]
        assert acks[0].layer_durations_ns is not None and len(acks[0].layer_durations_ns) == c.spec.num_layers
        assert c.in_flight("h2d") == 1
    assert [a.node_ids for a in c.poll_loads()] == [(11,)]
    for new, (_, data) in zip(news, backed):
        assert cache_kit.same(cache_kit.read_device(c, new), data)


def test_acks_carry_slots_and_bytes_per_pool(make_controller, cache_kit, runtime_name, spec_name):
    c = make_controller()
    node = cache_kit.alloc_node(c, 32)
    cache_kit.fill(c, node, seed=1)
    cache_kit.write(c, node, node_id=4, priority=9)
    [ack] = c.poll_writes()
    slots = {p: t.numel() for p, t in node.items()}
    assert dict(ack.slots_by_pool) == slots
    assert dict(ack.bytes_by_pool) == {p: n * c.spec.slot_bytes(p) for p, n in slots.items()}
    assert ack.ok and ack.error is None and ack.duration_ns is not None and ack.duration_ns >= 0
    assert c.state.completed == {"d2h": 1, "h2d": 0}
    assert not c.state.ops, "a reaped op leaves the bookkeeping"


# --------------------------------------------------------------- policies


def test_write_through_backs_up_on_the_first_hit():
    p = WritePolicy("write_through")
    assert [p.should_write_on_hit(h) for h in (0, 1, 2)] == [False, True, True]
    assert not p.should_write_on_evict()


def test_write_through_selective_waits_for_the_threshold():
    p = WritePolicy("write_through_selective", threshold=3)
    assert [p.should_write_on_hit(h) for h in (0, 1, 2, 3, 4)] == [False, False, False, True, True]
    assert not p.should_write_on_evict()


def test_write_back_writes_only_on_eviction():
    p = WritePolicy("write_back")
    assert not any(p.should_write_on_hit(h) for h in range(10))
    assert p.should_write_on_evict()


def test_write_policy_names_and_bad_values():
    assert WRITE_POLICIES == ("write_through", "write_through_selective", "write_back")
    assert WritePolicy() == WritePolicy("write_through", 2)
    with pytest.raises(ConfigError, match="'write_around'"):
        WritePolicy("write_around")
    with pytest.raises(ConfigError, match="threshold must be >= 1, got 0"):
        WritePolicy("write_through_selective", threshold=0)


def test_controller_takes_a_policy_by_name_or_object(make_controller, runtime_name, spec_name):
    c = make_controller(write_policy="write_through_selective", write_through_threshold=4)
    assert c.write_policy == WritePolicy("write_through_selective", 4)
    p = WritePolicy("write_back")
    assert make_controller(write_policy=p).write_policy is p
    with pytest.raises(ConfigError, match="'sometimes'"):
        make_controller(write_policy="sometimes")


def test_bookkeeping_detail_emits_only_what_the_fold_needs() -> None:
    from hicache_obs.core import HiCacheController, ModelSpec
    from hicache_obs.errors import ConfigError
    from hicache_obs.events import IndicesMoved, StreamRecorded, TransferSubmitted
    from hicache_obs.events._state import fold

    full = HiCacheController(ModelSpec.tiny(), runtime="sim", device_size=256)
    lean = HiCacheController(ModelSpec.tiny(), runtime="sim", device_size=256, event_detail="bookkeeping")
    for c in (full, lean):
        kv = c.alloc_device(32)
        host = c.write(kv, node_id=1)
        c.poll_writes()
        c.evict_device(kv)
        c.load(host, node_id=1)
        c.start_loading()
        c.poll_loads()
    lean_types = {type(e) for e in lean.log.events()}
    assert IndicesMoved not in lean_types and StreamRecorded not in lean_types
    assert {type(e) for e in full.log.events()} - lean_types == {IndicesMoved, StreamRecorded}
    assert all(e.tensors == () for e in lean.log.events() if isinstance(e, TransferSubmitted))
    assert fold(lean.log.events()).snapshot() == lean.state.snapshot() == full.state.snapshot()
    with pytest.raises(ConfigError, match="event_detail must be one of full, bookkeeping, got 'some'"):
        HiCacheController(ModelSpec.tiny(), event_detail="some")
