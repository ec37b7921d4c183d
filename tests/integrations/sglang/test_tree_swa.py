"""SGLang's own SWA (full + sliding-window KV) tree with HiCache, driven as the scheduler drives
it: ``UnifiedRadixCache`` with FULL and SWA components over ``SWAKVPool`` and
``SWATokenToKVPoolAllocator``, whose ``init_hicache`` builds the KV and SWA host pools and the
``HybridCacheController`` (``attach_hybrid_pool_to_unified_cache``: the FULL + SWA branch of
0.5.12's and 0.5.13's ``hybrid_cache/hybrid_pool_assembler.py``, ``_SwaStrategy`` in
0.5.23's). A multi-turn workload with shared prefixes under device pressure (and SWA device
pressure: an SWA pool smaller than the full one) runs clean on every release that has the
tree: each hit's full rows and its last window's SWA rows intact, each load back read layer by
layer, each write and load carrying both pools' slots, nothing for the audit.

0.5.10 has no ``mem_cache/unified_radix_cache.py``; 0.5.11's ``UnifiedRadixCache`` has no
``init_hicache`` (no HiCache through the tree): both skip.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from sglang_env import RELEASE

# test_tree_hybrid.py's workload, in pages of the same size: three conversations on a 128-token
# device pool (8 pages); each next turn extends its conversation; B's and C's first turns are
# demoted to the host (backed up by write_through) while the others run, and their next turns
# load full and SWA KV back; A's last turn repeats
from test_tree_hybrid import A1, A2, B1, C1, DEVICE_HITS, LOADED, WORKLOAD

from hicache_obs.core import ModelSpec
from hicache_obs.errors import ConfigError, IntegrationError
from hicache_obs.events import EventLog
from hicache_obs.events._audit import audit
from hicache_obs.events._schema import AuditViolation, TransferSubmitted
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang

SPEC = ModelSpec.tiny_swa()
PAGE = SPEC.page_size
WINDOW = SPEC.swa_window
BACKENDS = [
    pytest.param("direct", "page_first_direct", id="direct-page_first_direct"),
    pytest.param("kernel", "page_first", id="kernel-page_first"),
]


def test_the_workload_is_in_pages_of_this_model() -> None:
    assert ModelSpec.tiny_hybrid().page_size == PAGE and len(A1) == 2 * PAGE


# (SWA device pool, device hits, loaded backs, ops carrying SWA slots by direction)
PLANS = {
    # SWA pool as large as the full one: the full pool's pressure alone evicts
    "swa_128": (128, DEVICE_HITS, LOADED, 7, 3),
    # a 96-token SWA pool: A1's SWA rows are evicted before A2 runs, and A2 loads A1 back
    "swa_96": (96, [0, 0, 0, 0, 0, 0, 0, len(A2)], [0, 0, 0, len(A1), len(B1), len(C1), len(A2), 0], 7, 4),
}


def _available() -> None:
    from hicache_obs.lab.sglang.tree import swa_tree_missing

    missing = swa_tree_missing()
    if missing is not None:
        pytest.skip(f"SGLang {RELEASE} has {missing}: no SWA HiCache through a tree")


class _Run:
    """SGLang's SWA tree with HiCache, its controller instrumented into a log."""

    def __init__(self, io_backend: str, layout: str, swa_size: int | None = None) -> None:
        from hicache_obs.lab.sglang.tree import build_swa_tree

        self.t = build_swa_tree(SPEC, io_backend=io_backend, layout=layout, swa_size=swa_size)
        self.log = EventLog()
        self.inst = instrument(self.t.controller, log=self.log)

    def events(self) -> list[Any]:
        self.log.flush()
        return [e for e in self.log.events() if not isinstance(e, AuditViolation)]

    def ops(self) -> list[tuple[str, dict[str, int]]]:
        """Each submitted op's direction and slots by pool."""
        return [(e.direction, dict(e.slots_by_pool)) for e in self.events() if isinstance(e, TransferSubmitted)]


def _served_as_planned(r: _Run, device_hits: list[int], loaded: list[int]) -> list[Any]:
    counter = r.t.controller.layer_done_counter
    wait, waits = counter.wait_until, []
    counter.wait_until = lambda layer: (waits.append(layer), wait(layer))[1]
    served, read = [], []
    for tokens in WORKLOAD:
        seen = len(waits)
        served.append(r.t.serve(tokens))
        read.append(waits[seen:])
    r.t.step()
    layers = list(range(SPEC.num_layers))
    assert read == [layers if n else [] for n in loaded]  # each load back read layer by layer
    assert all(s.data_ok for s in served), [s.data_ok for s in served]
    assert all(s.swa_ok for s in served), [s.swa_ok for s in served]
    assert [s.device_hit for s in served] == device_hits
    assert [s.loaded for s in served] == loaded
    return served


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_the_swa_tree_runs_clean_under_pressure(io_backend: str, layout: str, plan: str) -> None:
    _available()
    swa_size, device_hits, loaded, writes, loads = PLANS[plan]
    r = _Run(io_backend, layout, swa_size)
    _served_as_planned(r, device_hits, loaded)
    ops = r.ops()
    # every op moves the full rows and their SWA peers together
    assert all(slots.get("kv", 0) == slots.get("swa", 0) > 0 for _, slots in ops), ops
    assert Counter(direction for direction, _ in ops) == {"d2h": writes, "h2d": loads}
    assert audit(r.events()) == []
    assert r.inst.errors == 0


def test_swa_rows_lost_on_the_host_are_seen() -> None:
    """The SWA check reads the SWA pool: SWA rows zeroed on the host come back wrong while the
    full rows stay intact."""
    from hicache_obs.lab.sglang.harness import _tensors_of

    _available()
    r = _Run("direct", "page_first_direct")
    for tokens in WORKLOAD[:4]:
        r.t.serve(tokens)
    for t in _tensors_of(r.t.harness.extras["swa_host"]):
        if t.is_floating_point():
            t.zero_()
    s = r.t.serve(WORKLOAD[4])
    assert s.loaded == len(B1)
    assert s.data_ok and not s.swa_ok


def test_the_tree_is_sglangs() -> None:
    _available()
    t = _Run("direct", "page_first_direct").t
    assert type(t.tree).__name__ == "UnifiedRadixCache"
    assert {c.name for c in t.tree.components} == {"FULL", "SWA"}
    assert type(t.controller).__name__ == "HybridCacheController"
    assert type(t.allocator).__name__ == "SWATokenToKVPoolAllocator"


def test_what_the_harness_cannot_build_is_refused() -> None:
    from hicache_obs.lab.sglang.tree import build_swa_tree, swa_tree_missing

    with pytest.raises(ConfigError, match="SWA tree harness"):
        build_swa_tree(ModelSpec.tiny())
    with pytest.raises(ConfigError, match="swa_size"):
        build_swa_tree(swa_size=PAGE + 1)
    if swa_tree_missing() is not None:
        with pytest.raises(IntegrationError, match="cannot build an SWA tree"):
            build_swa_tree()


def test_build_controller_points_a_swa_model_to_the_tree() -> None:
    from hicache_obs.lab.sglang.harness import build_controller

    with pytest.raises(ConfigError, match=r"only through its tree's init_hicache: use tree\.build_swa_tree"):
        build_controller(SPEC)
