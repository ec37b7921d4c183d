"""Hypothesis: random workloads keep the invariants.

A workload is a random sequence of alloc / write / load / start_loading /
evict_device / evict_host / free / poll_writes / poll_loads (and, on ``sim``,
pausing the side streams so operations stay in flight). A model of the nodes
says what each call must do. After every step:

- the fold of the event log equals the live bookkeeping;
- every table respects its capacity and holds exactly the slots the model's
  nodes hold (no leak, no double booking);
- an allocation that cannot fit returns None and logs ``AllocationFailed``;
- reaped writes left the node's bytes on the host, reaped loads on the device.

At the end everything is reaped and freed, and every table is empty.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_obs.core import HiCacheController, HybridCacheController, ModelSpec
from hicache_obs.errors import ProducerSlotBusyError
from hicache_obs.events import AllocationFailed, fold

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclass
class Node:
    id: int
    data: dict
    dev: dict | None = None
    host: dict | None = None
    writing: bool = False
    loading: bool = False  # queued or submitted, not reaped


@dataclass
class Workload:
    c: HiCacheController
    cache_kit: Any
    nodes: dict[int, Node] = field(default_factory=dict)
    next_id: int = 0
    held_back: contextlib.ExitStack | None = None  # set while the side streams are paused

    # -------------------------------------------------------------- helpers
    def avail(self, pool: str, tier: str) -> int:
        return self.c.state.table(pool, tier).available

    def sizes(self, x: int) -> dict[str, int]:
        out = {"kv": 16 * (1 + x % 3)}
        for p in self.c.spec.pool_names:
            if p == "mamba":
                out[p] = 1 + (x // 3) % 4
            elif p == "swa":
                out[p] = 16 * (1 + (x // 3) % 2)
        return out

    def expect_failure(self, n_before: int, fits: bool, result: object) -> None:
        failed = [e for e in self.c.log.events()[n_before:] if isinstance(e, AllocationFailed)]
        if fits:
            assert result is not None and not failed
        else:
            assert result is None, "an allocation beyond the free slots must return None"
            assert failed and failed[0].requested > failed[0].available

    # -------------------------------------------------------------- actions
    def alloc(self, x: int) -> None:
        c = self.c
        sizes = self.sizes(x)
        node = Node(self.next_id, {})
        self.next_id += 1
        dev = {}
        for pool, n in sizes.items():
            before, n_log = self.avail(pool, "device"), len(c.log)
            t = c.alloc_device(n, pool=pool)
            self.expect_failure(n_log, n <= before, t)
            if t is None:
                for p, got in dev.items():  # the engine gives back what it took
                    c.free_device(got, pool=p)
                return
            dev[pool] = t
        node.dev = dev
        node.data = self.cache_kit.fill(c, dev, seed=node.id)
        self.nodes[node.id] = node

    def write(self, node: Node) -> None:
        fits = all(t.numel() <= self.avail(p, "host") for p, t in node.dev.items())
        n_log, used = len(self.c.log), self.cache_kit.used(self.c)
        host = self.cache_kit.write(self.c, node.dev, node_id=node.id)
        self.expect_failure(n_log, fits, host)
        if host is None:
            assert self.cache_kit.used(self.c) == used, "a failed write must roll back"
            return
        node.host, node.writing = host, True

    def load(self, node: Node) -> None:
        fits = all(t.numel() <= self.avail(p, "device") for p, t in node.host.items())
        n_log, used = len(self.c.log), self.cache_kit.used(self.c)
        dev = self.cache_kit.load(self.c, node.host, node_id=node.id)
        self.expect_failure(n_log, fits, dev)
        if dev is None:
            assert self.cache_kit.used(self.c) == used, "a failed load must roll back"
            return
        node.dev, node.loading = dev, True

    def start_loading(self, x: int = 0) -> None:
        c = self.c
        queued = list(c.state.queues["h2d"])
        before = c.state.snapshot()
        try:
            producer = c.start_loading()
        except ProducerSlotBusyError:
            assert self.held_back is not None, "only a paused stream can keep a producer slot busy"
            assert c.state.snapshot() == before
            return
        assert (producer == -1) == (not queued)

    def evict_device(self, node: Node) -> None:
        self.cache_kit.evict_device(self.c, node.dev)
        node.dev = None

    def evict_host(self, node: Node) -> None:
        self.cache_kit.evict_host(self.c, node.host)
        node.host = None
        if node.dev is None:
            del self.nodes[node.id]

    def free(self, node: Node) -> None:
        for pool, t in node.dev.items():
            self.c.free_device(t, pool=pool)
        del self.nodes[node.id]

    def poll_writes(self, x: int = 0) -> None:
        for ack in self.c.poll_writes():
            assert ack.ok, ack.error
            for nid in ack.node_ids:
                node = self.nodes[nid]
                assert node.writing
                node.writing = False
                assert self.cache_kit.same(self.cache_kit.read_host(self.c, node.host), node.data), (
                    f"node {nid}: host bytes"
                )

    def poll_loads(self, x: int = 0) -> None:
        for ack in self.c.poll_loads():
            assert ack.ok, ack.error
            for nid in ack.node_ids:
                node = self.nodes[nid]
                assert node.loading
                node.loading = False
                assert self.cache_kit.same(self.cache_kit.read_device(self.c, node.dev), node.data), (
                    f"node {nid}: device bytes"
                )

    def pause(self, x: int = 0) -> None:
        rt = self.c.runtime
        if self.held_back is None and hasattr(rt, "paused"):
            self.held_back = contextlib.ExitStack()
            self.held_back.enter_context(rt.paused())

    def resume(self, x: int = 0) -> None:
        if self.held_back is not None:
            self.held_back.close()
            self.held_back = None

    def advance(self, x: int, y: int) -> None:
        """Take node ``x`` (or a new one) one legal step further; ``y`` picks the step."""
        nodes = list(self.nodes.values())
        if not nodes or x % (len(nodes) + 1) == len(nodes):
            self.alloc(y)
            return
        n = nodes[x % (len(nodes) + 1)]
        if n.writing:
            self.poll_writes()
            return
        if n.loading:
            if n.id in self._queued_nodes():
                self.start_loading()
            else:
                self.poll_loads()
            return
        if n.dev is not None and n.host is None:
            moves = [self.write, self.free]  # device only
        elif n.dev is not None:
            moves = [self.evict_device, self.evict_host]  # on both tiers
        else:
            moves = [self.load, self.evict_host]  # host only
        moves[y % len(moves)](n)

    def _queued_nodes(self) -> set[int]:
        ops = self.c.state.ops
        return {nid for op in self.c.state.queues["h2d"] for nid in ops[op].node_ids}

    # ----------------------------------------------------------- invariants
    def check(self) -> None:
        c = self.c
        assert fold(c.log.events()).snapshot() == c.state.snapshot()
        held: dict[tuple[str, str], int] = {}
        for node in self.nodes.values():
            for tier, idx in (("device", node.dev), ("host", node.host)):
                for pool, t in (idx or {}).items():
                    held[(pool, tier)] = held.get((pool, tier), 0) + t.numel()
        for (pool, tier), table in c.state.tables.items():
            assert 0 <= table.used <= table.capacity
            assert table.used == table.capacity - table.available, f"{pool}/{tier}: partly used pages"
            assert table.used == held.get((pool, tier), 0), f"{pool}/{tier}: bookkeeping differs from the nodes"
        assert c.state.anomalies == []

    def finish(self) -> None:
        c = self.c
        self.resume()
        c.synchronize()
        self.poll_writes()
        self.start_loading()
        self.poll_loads()
        assert not c.state.queues["h2d"] and not c.state.acks["d2h"] and not c.state.acks["h2d"]
        assert not c.state.ops
        for node in list(self.nodes.values()):
            if node.dev is not None:
                for pool, t in node.dev.items():
                    c.free_device(t, pool=pool)
            if node.host is not None:
                self.cache_kit.evict_host(c, node.host)
        self.nodes.clear()
        self.check()
        assert {t.used for t in c.state.tables.values()} == {0}, "slots leaked"


#: What one step does: mostly move a node on along its life cycle, sometimes a global call.
STEP_KINDS = ("advance",) * 6 + ("start_loading", "poll_writes", "poll_loads", "pause", "resume")
steps = st.lists(
    st.tuples(st.sampled_from(STEP_KINDS), st.integers(0, 2**16), st.integers(0, 2**16)), min_size=20, max_size=40
)


@pytest.mark.parametrize("spec_name", ["tiny", "tiny_hybrid", "tiny_swa"])
@pytest.mark.parametrize("runtime_name", ["cpu", "sim"])
@SETTINGS
@given(workload=steps)
def test_random_workloads_keep_the_invariants(cache_kit, runtime_name, spec_name, workload):
    spec = ModelSpec.preset(spec_name)
    cls = HybridCacheController if spec.is_hybrid else HiCacheController
    # sidecar pools about as tight as the anchor, so either can be the one that runs out
    pool_sizes = {"swa": 64} if spec_name == "tiny_swa" else None
    w = Workload(cls(spec, runtime=runtime_name, device_size=128, pool_sizes=pool_sizes, host_ratio=1.0), cache_kit)
    try:
        w.check()
        for kind, x, y in workload:
            if kind == "advance":
                w.advance(x, y)
            else:
                getattr(w, kind)(x)
            w.check()
        w.finish()
    finally:
        w.resume()
        w.c.close()


@pytest.mark.parametrize("runtime_name", ["cpu", "sim"])
@SETTINGS
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=12), frees=st.lists(st.integers(0, 100), max_size=12))
def test_allocator_respects_capacity(runtime_name, sizes, frees):
    c = HiCacheController(ModelSpec.tiny(), runtime=runtime_name, device_size=64)
    try:
        held: list[torch.Tensor] = []
        for i, pages in enumerate(sizes):
            n = pages * 16
            avail = c.device_pool().allocator.available()
            n_log = len(c.log)
            t = c.alloc_device(n)
            if n > avail:
                assert t is None
                [ev] = c.log.events()[n_log:]
                assert isinstance(ev, AllocationFailed) and (ev.requested, ev.available) == (n, avail)
            else:
                assert t is not None and t.numel() == n
                values = c.runtime.to_host(t).tolist()
                assert len(set(values)) == n and all(0 <= v < 64 for v in values)
                assert all(v // 16 == values[k * 16] // 16 for k in range(pages) for v in values[k * 16 : k * 16 + 16])
                held.append(t)
            if i < len(frees) and held:
                c.free_device(held.pop(frees[i] % len(held)))
            table = c.state.table("kv", "device")
            assert table.used == sum(h.numel() for h in held) <= table.capacity
            all_values = [v for h in held for v in c.runtime.to_host(h).tolist()]
            assert len(all_values) == len(set(all_values)), "a slot was handed out twice"
        for h in held:
            c.free_device(h)
        assert c.state.table("kv", "device").used == 0
        assert fold(c.log.events()).snapshot() == c.state.snapshot()
    finally:
        c.close()
