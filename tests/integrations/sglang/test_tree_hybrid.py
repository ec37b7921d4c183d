"""SGLang's own hybrid (KV + Mamba) tree with HiCache, driven as the scheduler drives it: the
bug table's row 1 (SGLang PR #22940) through the tree each release ships.

0.5.10's ``HybridCacheController`` (``hybrid_cache_controller.py:251-274``, loads ``:310-340``)
neither moves the Mamba pool's index tensors to the device nor records them on the transfer
stream. With the direct backend every write and load carrying a Mamba state is an
``unrecorded_index`` finding; with the kernel backend the first write-through backup
(``HiMambaRadixCache.insert`` -> ``write_backup`` -> ``controller.write`` -> ``start_writing``)
is refused by the copy kernel ("Destination indices must be a CUDA tensor"), and the error
leaves the tree's ``insert``. 0.5.11 and later run the same workload clean: ``HiMambaRadixCache``
(0.5.11 to 0.5.13) and ``UnifiedRadixCache`` with a Mamba component (0.5.12 and later).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from sglang_env import RELEASE, mamba_layouts, needs_mamba_layout, release_tuple

from hicache_obs.core import ModelSpec
from hicache_obs.errors import ConfigError, IntegrationError
from hicache_obs.events import EventLog
from hicache_obs.events._audit import audit
from hicache_obs.events._schema import AuditViolation, TransferFailed, TransferSubmitted
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang

PAGE = ModelSpec.tiny_hybrid().page_size
BACKENDS = [
    pytest.param("direct", "page_first_direct", id="direct-page_first_direct"),
    pytest.param("direct", "layer_first", id="direct-layer_first"),
    pytest.param("kernel", "page_first", id="kernel-page_first"),
    pytest.param("kernel", "layer_first", id="kernel-layer_first"),
]
DIRECT = [p for p in BACKENDS if p.values[0] == "direct"]
KERNEL = [p for p in BACKENDS if p.values[0] == "kernel"]
TREES = ["unified", "hi_mamba"]
FIXED = release_tuple() >= (0, 5, 11)


def _seq(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PAGE))


# three conversations on a 128-token device pool (8 pages): each next turn extends its
# conversation; B's and C's first turns are demoted to the host (backed up by write_through)
# while the others run, and their next turns load KV and Mamba state back; A's last turn repeats
A1, B1, C1 = _seq(1000, 2), _seq(2000, 2), _seq(3000, 3)
A2, B2, C2 = A1 + _seq(1100, 2), B1 + _seq(2100, 2), C1 + _seq(3100, 1)
A3 = A2 + _seq(1200, 1)
WORKLOAD = [A1, B1, C1, A2, B2, C2, A3, A2]
DEVICE_HITS = [0, 0, 0, len(A1), 0, 0, 0, len(A2)]
LOADED = [0, 0, 0, 0, len(B1), len(C1), len(A2), 0]


def _available(tree: str) -> None:
    from hicache_obs.lab.sglang.tree import hybrid_trees

    if tree not in hybrid_trees():
        why = {
            "unified": "no UnifiedRadixCache with init_hicache and a Mamba component",
            "hi_mamba": "no mem_cache/hi_mamba_radix_cache.py HiMambaRadixCache",
        }
        pytest.skip(f"SGLang {RELEASE}: {why[tree]}")


def _layout(layout: str) -> None:
    needs_mamba_layout(layout)


class _Run:
    """SGLang's hybrid tree with HiCache, its controller instrumented into a log."""

    def __init__(self, io_backend: str, layout: str, tree: str | None = None) -> None:
        from hicache_obs.lab.sglang.tree import build_hybrid_tree

        self.t = build_hybrid_tree(ModelSpec.tiny_hybrid(), io_backend=io_backend, layout=layout, tree=tree)
        self.log = EventLog()
        self.inst = instrument(self.t.controller, log=self.log)

    def events(self) -> list[Any]:
        self.log.flush()
        return [e for e in self.log.events() if not isinstance(e, AuditViolation)]

    def mamba_ops(self) -> dict[int, str]:
        """The submitted ops that carried Mamba slots, and their directions."""
        return {
            e.op: e.direction
            for e in self.events()
            if isinstance(e, TransferSubmitted) and dict(e.slots_by_pool).get("mamba", 0) > 0
        }


def _served_as_planned(r: _Run) -> None:
    counter = r.t.controller.layer_done_counter
    wait, waits = counter.wait_until, []
    counter.wait_until = lambda layer: (waits.append(layer), wait(layer))[1]
    served, read = [], []
    for tokens in WORKLOAD:
        seen = len(waits)
        served.append(r.t.serve(tokens))
        read.append(waits[seen:])
    r.t.step()
    layers = list(range(ModelSpec.tiny_hybrid().num_layers))
    assert read == [layers if n else [] for n in LOADED]  # each load back read layer by layer
    assert all(s.data_ok for s in served), [s.data_ok for s in served]
    assert all(s.mamba_ok for s in served), [s.mamba_ok for s in served]
    assert [s.device_hit for s in served] == DEVICE_HITS
    assert [s.loaded for s in served] == LOADED
    assert [i for i, s in enumerate(served) if s.mamba_loaded] == [4, 5, 6]  # the Mamba states came back too


@pytest.mark.skipif(release_tuple()[:3] != (0, 5, 10), reason="SGLang 0.5.10's hybrid controller (PR #22940)")
@pytest.mark.parametrize("io_backend,layout", DIRECT)
def test_0_5_10_direct_backend_leaves_every_mamba_index_unrecorded(io_backend: str, layout: str) -> None:
    r = _Run(io_backend, layout, "hi_mamba")
    _served_as_planned(r)  # the CPU copies see no race: the data is intact
    ops = r.mamba_ops()
    assert Counter(ops.values()) == {"d2h": 7, "h2d": 3}  # seven write-through backups, three load backs
    found = audit(r.events())
    assert Counter((f.rule, f.pool) for f in found) == {("unrecorded_index", "mamba"): 10}
    assert {f.op for f in found} == set(ops)
    assert r.inst.errors == 0


@pytest.mark.skipif(release_tuple()[:3] != (0, 5, 10), reason="SGLang 0.5.10's hybrid controller (PR #22940)")
@pytest.mark.parametrize("io_backend,layout", KERNEL)
def test_0_5_10_kernel_backend_refuses_the_first_mamba_backup(io_backend: str, layout: str) -> None:
    from hicache_obs.lab.sglang.kernels.checks import KernelCheckError

    r = _Run(io_backend, layout, "hi_mamba")
    with pytest.raises(KernelCheckError, match="Destination indices must be a CUDA tensor") as raised:
        r.t.serve(WORKLOAD[0])
    names = [entry.name for entry in raised.traceback]
    assert names.index("insert") < names.index("write_backup") < names.index("start_writing")
    events = r.events()
    failed = [e for e in events if isinstance(e, TransferFailed)]
    assert len(failed) == 1 and failed[0].direction == "d2h"
    assert "Destination indices must be a CUDA tensor" in failed[0].error
    found = audit(events)
    assert [(f.rule, f.pool, f.op) for f in found] == [("index_not_on_device", "mamba", failed[0].op)]


@pytest.mark.skipif(not FIXED, reason="0.5.10 leaves the Mamba indices unmoved and unrecorded (PR #22940)")
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_fixed_releases_run_the_hybrid_tree_clean(tree: str, io_backend: str, layout: str) -> None:
    _available(tree)
    _layout(layout)
    r = _Run(io_backend, layout, tree)
    _served_as_planned(r)
    assert Counter(r.mamba_ops().values()) == {"d2h": 7, "h2d": 3}
    assert audit(r.events()) == []
    assert r.inst.errors == 0


def test_a_mamba_state_lost_on_the_host_is_seen() -> None:
    from hicache_obs.lab.sglang.harness import _tensors_of

    r = _Run("direct", "page_first_direct")
    for tokens in WORKLOAD[:4]:
        r.t.serve(tokens)
    for t in _tensors_of(r.t.harness.mamba_host):
        if t.is_floating_point():
            t.zero_()
    s = r.t.serve(WORKLOAD[4])
    assert s.loaded == len(B1) and s.mamba_loaded
    assert s.data_ok and not s.mamba_ok


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_a_layout_the_mamba_host_pool_refuses_is_sglangs_own_error(layout: str) -> None:
    from hicache_obs.lab.sglang.tree import build_hybrid_tree

    if layout in mamba_layouts():
        pytest.skip(f"SGLang {RELEASE}'s MambaPoolHost takes {layout}")
    io_backend = "direct" if layout == "page_first_direct" else "kernel"
    with pytest.raises((ValueError, AssertionError), match=layout):
        build_hybrid_tree(io_backend=io_backend, layout=layout)


def test_the_scheduler_tree_is_built_by_default() -> None:
    from hicache_obs.lab.sglang.tree import build_hybrid_tree, hybrid_trees

    trees = hybrid_trees()
    assert trees, f"SGLang {RELEASE} has no hybrid Mamba tree with HiCache"
    t = build_hybrid_tree()
    assert t.kind == trees[0]
    assert type(t.tree).__name__ == {"unified": "UnifiedRadixCache", "hi_mamba": "HiMambaRadixCache"}[t.kind]
    assert type(t.controller).__name__ == "HybridCacheController"


def test_what_the_harness_cannot_build_is_refused() -> None:
    from hicache_obs.lab.sglang.tree import HYBRID_TREES, build_hybrid_tree, hybrid_trees

    with pytest.raises(ConfigError, match="hybrid tree harness"):
        build_hybrid_tree(ModelSpec.tiny())
    with pytest.raises(ConfigError, match="tree must be one of"):
        build_hybrid_tree(tree="mamba")
    for tree in set(HYBRID_TREES) - set(hybrid_trees()):
        with pytest.raises(IntegrationError, match="cannot build a hybrid Mamba tree"):
            build_hybrid_tree(tree=tree)


def test_a_module_that_is_there_but_does_not_import_is_an_error_not_a_missing_feature(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package SGLang needs that this Python lacks is named, where before the tree was
    reported missing from the release (and its tests skipped)."""
    from hicache_obs.lab.sglang.harness import _module

    (tmp_path / "hicache_test_pkg").mkdir()
    (tmp_path / "hicache_test_pkg" / "__init__.py").write_text("")
    (tmp_path / "hicache_test_pkg" / "broken.py").write_text("import hicache_test_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _module("hicache_test_pkg.absent") is None
    assert _module("hicache_test_absent_pkg.tree") is None
    with pytest.raises(
        IntegrationError, match=r"hicache_test_pkg\.broken but it does not import.*hicache_test_absent_dependency"
    ):
        _module("hicache_test_pkg.broken")
