"""The demo workload, part by part: the tree, the LRU choice, the buggy caller, the data check, whole runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hicache_obs.lab.workload as workload
from hicache_obs.core import ModelSpec
from hicache_obs.lab.workload import MAX_LISTED_CORRUPTIONS, Corruption, Workload, WorkloadStats, controller_options
from hicache_obs.lab.workload.checker import DataChecker, bits
from hicache_obs.lab.workload.eviction import device_victim, host_victim
from hicache_obs.lab.workload.faults import CALLER_FAULTS, CallerBugs
from hicache_obs.lab.workload.radix import DocSlot, RadixNode, RadixTree
from hicache_obs.testing import FAULTS, make_controller


# ---------------------------------------------------------------- package
def test_package_names_are_the_modules_objects() -> None:
    from hicache_obs.lab.workload import checker, driver, stats

    assert workload.Workload is driver.Workload and workload.run_workload is driver.run_workload
    assert workload.WorkloadConfig is driver.WorkloadConfig
    assert workload.controller_options is driver.controller_options
    assert workload.WorkloadStats is stats.WorkloadStats
    assert workload.Corruption is checker.Corruption and MAX_LISTED_CORRUPTIONS == checker.MAX_LISTED_CORRUPTIONS == 100


# ------------------------------------------------------------------- tree
def test_tree_matches_a_chain_up_to_its_first_missing_chunk_and_unlinks() -> None:
    tree = RadixTree(documents=2, chunks_per_document=4)
    a = tree.add(None, DocSlot(1, 0), {"kv": 16})
    b = tree.add(a, DocSlot(1, 1), {"kv": 32})
    suffix = tree.add(b, None, {"kv": 16})
    c = tree.add(b, DocSlot(1, 3), {"kv": 16})  # chunk 2 missing: not reachable by a match
    assert [n.id for n in (a, b, suffix, c)] == [0, 1, 2, 3]
    assert tree.match(1, 4) == [a, b] and tree.match(1, 1) == [a] and tree.match(0, 4) == []
    assert b.children == [suffix, c] and b.tokens == 32 and set(tree.nodes) == {0, 1, 2, 3}

    tree.unlink(b)
    assert not b.alive and a.children == [] and tree.match(1, 4) == [a]
    assert set(tree.nodes) == {0, 2, 3} and tree.doc_nodes[1] == [a, None, None, c]
    assert tree.add(a, DocSlot(1, 1), {"kv": 16}).id == 4  # ids are never reused


# -------------------------------------------------------------- eviction
def _node(node_id: int, last_used: int, *, device: bool = True, host: bool = False) -> RadixNode:
    n = RadixNode(node_id, None, None, {"kv": 16})
    n.device = {"kv": torch.arange(16)} if device else None
    n.host = {"kv": torch.arange(16)} if host else None
    n.last_used = last_used
    return n


def test_device_victim_is_the_lru_leaf_that_is_free_to_go() -> None:
    old, mid, new = _node(5, 1), _node(3, 2), _node(1, 2)
    assert device_victim([new, mid, old]) is old
    old.lock = 1  # used by the current request
    assert device_victim([new, mid, old]) is new  # same age as mid: the lower id
    new.loading = True
    assert device_victim([new, mid, old]) is mid
    mid.pending_host = {"kv": torch.arange(16)}  # being written
    assert device_victim([new, mid, old]) is None
    parent, child = _node(7, 0), _node(8, 9)
    parent.children.append(child)
    assert device_victim([parent, child]) is child  # the parent has a child on the device
    child.device = None
    assert device_victim([parent, child]) is parent
    assert device_victim([_node(9, 0, device=False)]) is None


def test_host_victim_is_the_lru_host_only_leaf() -> None:
    on_device, host_only, newer = (
        _node(1, 0, host=True),
        _node(2, 1, device=False, host=True),
        _node(3, 2, device=False, host=True),
    )
    assert host_victim([newer, on_device, host_only]) is host_only
    host_only.stale = True  # its host copy was freed already (use-after-free): not again
    assert host_victim([newer, on_device, host_only]) is newer
    newer.children.append(_node(4, 0, device=False))
    assert host_victim([newer, on_device, host_only]) is None


# ----------------------------------------------------------- buggy caller
def test_caller_bugs_of_each_fault() -> None:
    assert set(CALLER_FAULTS) <= set(FAULTS), "a caller fault the controller does not know"
    assert CallerBugs.of("double-free") == CallerBugs(frees_twice=True)
    assert CallerBugs.of("use-after-free") == CallerBugs(keeps_freed=True)
    for fault in [None, *(f for f in FAULTS if f not in CALLER_FAULTS)]:
        assert CallerBugs.of(fault) == CallerBugs()


# ------------------------------------------------------------- data check
def test_checker_reports_the_slot_that_differs_once() -> None:
    spec = ModelSpec.tiny()
    c = make_controller(spec, runtime="sim", device_size=64)
    try:
        dev = c.alloc_device(32)
        assert dev is not None
        pool = c.device_pool("kv")
        g = torch.Generator().manual_seed(0)
        data = {
            p.name: torch.randn((len(pool.layer_ids), 32, *p.item_shape), generator=g).to(p.dtype)
            for p in pool.plane_specs
        }
        pool.write_slots(dev, data)
        host = c.write(dev, node_id=0)
        assert host is not None
        c.synchronize()
        (ack,) = c.poll_writes()
        node = RadixNode(0, None, None, {"kv": 32})
        plane = next(iter(data))
        want = {k: v.clone() for k, v in data.items()}
        want[plane][0, 5] += 1  # what the workload "wrote" differs from the copy at slot 5
        node.data = {"kv": want}
        stats = WorkloadStats()
        checker = DataChecker(c, stats)

        checker.check(node, {"kv": host}, "host", ack, "d2h")
        host_slot = int(host[5])
        assert stats.checked_slots == 32 and stats.corruptions == 1 and not stats.data_intact
        assert stats.corrupted == [
            Corruption(node=0, pool="kv", direction="d2h", op=ack.op_id, tier="host", slots=(host_slot,))
        ]
        assert stats.to_dict()["corrupted_slots"][0]["slots"] == [host_slot]

        checker.check(node, {"kv": host}, "host", ack, "d2h")  # the node now holds what is there
        assert stats.checked_slots == 64 and stats.corruptions == 1
    finally:
        c.close()


def test_bits_tell_nan_and_negative_zero_apart() -> None:
    x = torch.tensor([float("nan"), 0.0, -0.0], dtype=torch.bfloat16)
    y = torch.tensor([float("nan"), -0.0, -0.0], dtype=torch.bfloat16)
    assert (bits(x) == bits(y)).tolist() == [True, False, True]


# ---------------------------------------------------------------- whole runs
BASE = {"steps": 80, "requests": 80}
#: Counts of 80 requests (seed 3, 256 device tokens, sim): the same before and after the
#: workload became a package of modules. A change here is a change of the workload's behaviour.
RUNS: dict[str, tuple[str, dict[str, Any], str | None, dict[str, Any]]] = {
    "hybrid": (
        "tiny_hybrid", {}, None,
        {"tokens": {"device_hit": 2000, "host_hit": 4048, "miss": 25488}, "nodes_created": 141,
         "writes": {"issued": 13, "completed": 13, "failed": 0, "host_full": 0},
         "loads": {"issued": 52, "completed": 52, "failed": 0, "device_full": 1},
         "evictions": {"device": 64, "host": 7, "dropped": 127, "lost": 0}, "truncated_requests": 54,
         "checked_slots": 5041, "data_intact": True, "corruptions": 0},
    ),
    "swa-write-back": (
        "tiny_swa", {"write_policy": "write_back"}, None,
        {"tokens": {"device_hit": 2496, "host_hit": 3584, "miss": 25456}, "nodes_created": 154,
         "writes": {"issued": 152, "completed": 152, "failed": 0, "host_full": 0},
         "loads": {"issued": 45, "completed": 45, "failed": 0, "device_full": 0},
         "evictions": {"device": 197, "host": 146, "dropped": 0, "lost": 0}, "truncated_requests": 53,
         "checked_slots": 24640, "data_intact": True, "corruptions": 0},
    ),
    "use-after-free": (
        "tiny_hybrid", {}, "use-after-free",
        {"tokens": {"device_hit": 2112, "host_hit": 4032, "miss": 25392}, "nodes_created": 137,
         "writes": {"issued": 16, "completed": 16, "failed": 0, "host_full": 2},
         "loads": {"issued": 51, "completed": 51, "failed": 0, "device_full": 3},
         "evictions": {"device": 61, "host": 8, "dropped": 125, "lost": 0}, "truncated_requests": 56,
         "checked_slots": 5203, "data_intact": False, "corruptions": 5},
    ),
    "double-free": (
        "tiny", {}, "double-free",
        {"tokens": {"device_hit": 2000, "host_hit": 4048, "miss": 25488}, "nodes_created": 141,
         "writes": {"issued": 13, "completed": 13, "failed": 0, "host_full": 0},
         "loads": {"issued": 52, "completed": 52, "failed": 0, "device_full": 1},
         "evictions": {"device": 64, "host": 7, "dropped": 127, "lost": 0}, "truncated_requests": 54,
         "checked_slots": 4976, "data_intact": True, "corruptions": 0},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_run_counts_what_it_did(name: str) -> None:
    model, options, fault, expected = RUNS[name]
    spec = getattr(ModelSpec, model)()
    c = make_controller(spec, runtime="sim", fault=fault, **options, **controller_options(spec, 256))
    try:
        stats = Workload(c, seed=3, fault=fault).run(80)
    finally:
        c.close()
    got = stats.to_dict()
    listed = got.pop("corrupted_slots")
    got.pop("hit_rate")
    assert got == {**BASE, **expected}
    assert len(listed) == stats.corruptions == len(stats.corrupted)
    if fault == "use-after-free":  # the freed host copy was reused, then loaded back into the device
        assert {(x["pool"], x["direction"], x["tier"]) for x in listed} == {("kv", "h2d", "device")}
