"""Helpers of the exporter tests: a real workload on the ``sim`` runtime, and scraping.

``run_workload(c)`` drives a controller the way a serving engine does (write-through
of new nodes, device eviction, memory pressure on the freed slots, merged load-back,
read-back check) and returns what it did, computed from its own calls:
:class:`Expected` (slots and bytes per pool and direction, completed ops per
direction, used slots per pool and tier, whether every loaded slot matched).
``scrape(url)`` fetches ``/metrics`` over HTTP and parses it with prometheus_client's
parser into ``{(sample name, frozenset(labels)): value}``.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families

from hicache_obs.core import HybridCacheController, PoolTransfer

MAMBA_SLOTS = 2  # state slots per node in the mamba pool
KV_SLOTS = (32, 16)  # kv slots of the two nodes written each round


@dataclass
class Expected:
    slots: dict[tuple[str, str], int] = field(default_factory=dict)  # (pool, direction) -> slots moved
    bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=lambda: {"d2h": 0, "h2d": 0})  # completed merged ops
    used: dict[tuple[str, str], int] = field(default_factory=dict)  # (pool, tier) -> allocated slots
    evicted: dict[tuple[str, str], int] = field(default_factory=dict)  # (pool, tier) -> slots evicted
    evictions: dict[tuple[str, str], int] = field(default_factory=dict)  # (pool, tier) -> eviction calls
    intact: bool = True
    op_ids: dict[str, list[int]] = field(default_factory=lambda: {"d2h": [], "h2d": []})
    clean_ops: list[int] = field(default_factory=list)  # ops without a mamba part
    mamba_ops: list[int] = field(default_factory=list)

    def moved(self, pool: str, direction: str, n: int, slot_bytes: int) -> None:
        self.slots[(pool, direction)] = self.slots.get((pool, direction), 0) + n
        self.bytes[(pool, direction)] = self.bytes.get((pool, direction), 0) + n * slot_bytes

    def alloc(self, pool: str, tier: str, n: int) -> None:
        self.used[(pool, tier)] = self.used.get((pool, tier), 0) + n

    def evict(self, pool: str, tier: str, n: int) -> None:
        self.used[(pool, tier)] = self.used.get((pool, tier), 0) - n
        self.evicted[(pool, tier)] = self.evicted.get((pool, tier), 0) + n
        self.evictions[(pool, tier)] = self.evictions.get((pool, tier), 0) + 1


def _random(c: Any, pool: str, n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dp = c.device_pool(pool)
    return {p.name: torch.randn((len(dp.layer_ids), n, *p.item_shape), generator=g).to(p.dtype) for p in dp.plane_specs}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def run_workload(c: Any, *, rounds: int = 3, kv_only_node: bool = True) -> Expected:
    """Write two nodes per round, evict them from the device, reuse the slots, load both back (one merged op).

    On a hybrid controller each node also has a mamba part; with ``kv_only_node``
    the last round adds one node without one (a clean op even under the fault).
    """
    exp = Expected()
    hybrid = isinstance(c, HybridCacheController)
    sb = {p: c.spec.slot_bytes(p) for p in c.spec.pool_names}
    seed = 0
    for r in range(rounds):
        nodes = []
        sizes = list(KV_SLOTS)
        for i, n in enumerate(sizes):
            seed += 1
            parts = {"kv": c.alloc_device(n)}
            exp.alloc("kv", "device", n)
            with_mamba = hybrid and not (kv_only_node and r == rounds - 1 and i == 1)
            if with_mamba:
                parts["mamba"] = c.alloc_device(MAMBA_SLOTS, pool="mamba")
                exp.alloc("mamba", "device", MAMBA_SLOTS)
            data = {p: _random(c, p, t.numel(), seed * 7 + j) for j, (p, t) in enumerate(parts.items())}
            for p, t in parts.items():
                c.device_pool(p).write_slots(t, data[p])
            if hybrid:
                transfers = [PoolTransfer("mamba", device_indices=parts["mamba"])] if with_mamba else None
                res = c.write(parts["kv"], node_id=seed, pool_transfers=transfers)
                assert res is not None, "test set-up: host pool full"
                host = {"kv": res[0]}
                for t in res[1] or ():
                    host[t.pool] = t.host_indices
            else:
                h = c.write(parts["kv"], node_id=seed)
                assert h is not None, "test set-up: host pool full"
                host = {"kv": h}
            for p, t in parts.items():
                exp.alloc(p, "host", t.numel())
                exp.moved(p, "d2h", t.numel(), sb[p])
            acks = c.poll_writes()
            assert [a.ok for a in acks] == [True]
            exp.ops["d2h"] += 1
            exp.op_ids["d2h"].append(acks[0].op_id)
            (exp.mamba_ops if "mamba" in parts else exp.clean_ops).append(acks[0].op_id)
            nodes.append((parts, host, data))
        # evict the nodes from the device and put other data in the freed slots (memory pressure)
        for parts, _, _ in nodes:
            for p, t in parts.items():
                c.evict_device(t, pool=p)
                exp.evict(p, "device", t.numel())
        del parts
        junk = []
        for parts_, _, _ in nodes:
            for p, t in parts_.items():
                j = c.alloc_device(t.numel(), pool=p)
                exp.alloc(p, "device", t.numel())
                c.device_pool(p).write_slots(j, _random(c, p, t.numel(), 999))
                junk.append((p, j))
        # load both nodes back: queued separately, merged into one op
        loaded = []
        for _, host, data in nodes:
            if hybrid:
                transfers = [PoolTransfer(p, host_indices=h) for p, h in host.items() if p != "kv"] or None
                res = c.load(host["kv"], node_id=seed, pool_transfers=transfers)
                assert res is not None, "test set-up: device pool full"
                dev = {"kv": res[0]}
                for t in res[1] or ():
                    dev[t.pool] = t.device_indices
            else:
                d = c.load(host["kv"], node_id=seed)
                assert d is not None
                dev = {"kv": d}
            for p, t in dev.items():
                exp.alloc(p, "device", t.numel())
                exp.moved(p, "h2d", t.numel(), sb[p])
            loaded.append((dev, data))
        assert c.start_loading() >= 0
        acks = c.poll_loads()
        assert [a.ok for a in acks] == [True]
        exp.ops["h2d"] += 1
        exp.op_ids["h2d"].append(acks[0].op_id)
        (exp.mamba_ops if hybrid else exp.clean_ops).append(acks[0].op_id)
        for dev, data in loaded:
            for p, t in dev.items():
                if not _same(c.device_pool(p).read_slots(t), data[p]):
                    exp.intact = False
        # the junk goes; the loaded nodes and the host copies stay
        for p, j in junk:
            c.evict_device(j, pool=p)
            exp.evict(p, "device", j.numel())
    return exp


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_exposition(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample with exactly these labels (KeyError when the series is missing)."""
    return samples[(name, frozenset(labels.items()))]


def values(samples: Samples, name: str, **labels: str) -> list[float]:
    """Every sample of ``name`` whose labels include these."""
    want = set(labels.items())
    return [v for (n, ls), v in samples.items() if n == name and want <= ls]
