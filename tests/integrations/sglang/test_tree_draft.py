"""A draft model's KV pool (speculative decoding) through SGLang's own trees with HiCache, driven
as the scheduler drives them (SGLang PR #27953).

The scheduler registers the draft after the tree built its controller. From 0.5.11 until the
sidecar pools it does so with ``controller.set_draft_kv_pool`` (0.5.13 ``mem_cache/kv_cache_builder.py``
``maybe_register_hicache_draft``; 0.5.11, 0.5.12 ``Scheduler._maybe_register_hicache_draft``),
and their ``HybridCacheController`` overrides ``start_writing``/``start_loading`` without the
base controller's draft copies: the draft KV is never backed up and is stale after a load back,
one ``pool_omitted`` finding for pool ``draft`` per op; 0.5.14's copies carry the draft, clean
(the fix). ``UnifiedRadixCache.init_hicache``
builds a ``HybridCacheController`` for a KV-only tree too, so the KV-only ``UnifiedRadixCache``
(``SGLANG_ENABLE_UNIFIED_RADIX_TREE``) has the same findings; the base controller, which copies
the draft, is ``HiRadixCache``'s (``test_draft_pools.py`` runs it on the controller). 0.5.2x
registers the draft as a sidecar pool of the tree (``register_sidecar_pool`` with the entries of
``build_hicache_draft_sidecars``) and the tree names its transfer in each op: clean.
"""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Any

import pytest
from sglang_env import RELEASE, needs_mamba_layout, release_tuple, skip_draft_with_the_kernel_backend_on_0_5_17

# test_tree_hybrid.py's workload: three conversations on a 128-token device pool; B2, C2 and A3
# load their prefixes back; A2 repeats last, a device hit on what A3 loaded back
from test_tree_hybrid import A1, BACKENDS, LOADED, TREES, WORKLOAD

from hicache_obs.core import ModelSpec
from hicache_obs.errors import ConfigError, IntegrationError
from hicache_obs.events import EventLog
from hicache_obs.events._audit import audit
from hicache_obs.events._schema import AuditViolation, TransferSubmitted
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang

# the draft rows each request reads: intact until the first load back; where the controller
# leaves the draft out, every load back leaves the slots' previous draft rows (stale), and A2's
# repeat reads what A3 loaded back
DRAFT_STALE = [True] * 4 + [False] * 4
OPS = {"d2h": 7, "h2d": 3}  # seven write-through backups, three load backs


def _sidecar_release() -> bool:
    """Whether SGLang builds a draft as a sidecar pool of the tree (0.5.2x)."""
    from hicache_obs.lab.sglang.harness import _module, prepare

    if RELEASE is None:
        return False
    prepare("cpu")
    assembler = _module("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler")
    return callable(getattr(assembler, "build_hicache_draft_sidecars", None))


def _set_draft_release() -> bool:
    """Whether SGLang registers a draft with the controller's ``set_draft_kv_pool`` (0.5.11 until the sidecars)."""
    if RELEASE is None or _sidecar_release():
        return False
    from hicache_obs.lab.sglang.harness import prepare

    prepare("cpu")
    cc = importlib.import_module("sglang.srt.managers.cache_controller")
    return callable(getattr(cc.HiCacheController, "set_draft_kv_pool", None))


#: SGLang #27953's fix: 0.5.14's HybridCacheController copies a set_draft_kv_pool draft too
DRAFT_FIXED = release_tuple() >= (0, 5, 14)
SIDECAR = _sidecar_release()
SET_DRAFT = _set_draft_release()
needs_set_draft = pytest.mark.skipif(
    not SET_DRAFT, reason="this release's scheduler registers no draft with set_draft_kv_pool (0.5.11-0.5.2x)"
)
needs_sidecar = pytest.mark.skipif(not SIDECAR, reason="this release builds no draft sidecar (0.5.2x)")


def _available(tree: str) -> None:
    from hicache_obs.lab.sglang.tree import hybrid_trees

    if tree not in hybrid_trees():
        pytest.skip(f"SGLang {RELEASE} has no {tree} hybrid tree with HiCache")


def _layout(layout: str) -> None:
    needs_mamba_layout(layout)


def _unified() -> None:
    from hicache_obs.lab.sglang.tree import has_unified_hicache

    if not has_unified_hicache():
        pytest.skip("this SGLang release has no UnifiedRadixCache with HiCache (init_hicache)")


class _Run:
    """A tree with HiCache, its controller instrumented as soon as the tree built it, then a
    draft registered as the scheduler registers it (``draft_first``: registered before the
    controller is instrumented); the workload served."""

    def __init__(self, t: Any, *, draft_first: bool = False) -> None:
        self.t = t
        self.log = EventLog()
        if draft_first:
            t.add_draft()
        self.inst = instrument(t.controller, log=self.log)  # the controller exists ...
        if not draft_first:
            t.add_draft()  # ... then the scheduler registers the draft
        self.served = [t.serve(tokens) for tokens in WORKLOAD]
        t.step()

    def events(self) -> list[Any]:
        self.log.flush()
        return [e for e in self.log.events() if not isinstance(e, AuditViolation)]

    def kv_ops(self) -> dict[int, str]:
        """The submitted ops that moved KV slots, and their directions."""
        return {
            e.op: e.direction
            for e in self.events()
            if isinstance(e, TransferSubmitted) and dict(e.slots_by_pool).get("kv", 0) > 0
        }

    def check_served(self, *, draft_intact: bool, mamba: bool) -> None:
        s = self.served
        assert [x.loaded for x in s] == LOADED
        assert all(x.data_ok for x in s), [x.data_ok for x in s]
        if mamba:
            assert all(x.mamba_ok for x in s), [x.mamba_ok for x in s]
        assert [x.draft_ok for x in s] == ([True] * len(s) if draft_intact else DRAFT_STALE)
        assert self.inst.errors == 0

    def check_omitted(self) -> None:
        """One ``pool_omitted`` finding for pool draft per op, on every op that moved KV, and no
        other finding."""
        ops = self.kv_ops()
        assert Counter(ops.values()) == OPS
        subs = [e for e in self.events() if isinstance(e, TransferSubmitted)]
        assert {e.sidecar_pools for e in subs} == {(("draft", "kv"),)}  # the adapter followed the registration
        found = audit(self.events())
        assert Counter((f.rule, f.pool, f.direction) for f in found) == {
            ("pool_omitted", "draft", "d2h"): OPS["d2h"],
            ("pool_omitted", "draft", "h2d"): OPS["h2d"],
        }
        assert sorted(f.op for f in found) == sorted(ops)  # once per op
        assert all(ops[f.op] == f.direction for f in found)

    def check_draft(self, *, mamba: bool) -> None:
        """A draft registered with ``set_draft_kv_pool``: left out of every copy up to 0.5.13
        (SGLang #27953), carried from 0.5.14."""
        if DRAFT_FIXED:
            self.check_served(draft_intact=True, mamba=mamba)
            self.check_clean()
        else:
            self.check_served(draft_intact=False, mamba=mamba)
            self.check_omitted()

    def check_clean(self) -> None:
        ops = self.kv_ops()
        assert Counter(ops.values()) == OPS
        subs = [e for e in self.events() if isinstance(e, TransferSubmitted)]
        assert {e.sidecar_pools for e in subs} == {(("draft", "kv"),)}
        assert all("draft" in {t.pool for t in e.tensors} for e in subs)  # the tree named the draft
        assert audit(self.events()) == []


def _hybrid(io_backend: str, layout: str, tree: str) -> Any:
    from hicache_obs.lab.sglang.tree import build_hybrid_tree

    skip_draft_with_the_kernel_backend_on_0_5_17(io_backend)
    _available(tree)
    _layout(layout)
    return build_hybrid_tree(ModelSpec.tiny_hybrid(), io_backend=io_backend, layout=layout, tree=tree)


def _kv_only(io_backend: str, layout: str) -> Any:
    from hicache_obs.lab.sglang.tree import build_tree

    _unified()
    # write_through: the workload backs up as the hybrid one does (and 0.5.12's write_back
    # demotion has its own finding, test_tree.py)
    return build_tree(ModelSpec.tiny(), io_backend=io_backend, layout=layout, write_policy="write_through")


@needs_set_draft
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_the_hybrid_tree_leaves_the_draft_out_until_0_5_14(tree: str, io_backend: str, layout: str) -> None:
    r = _Run(_hybrid(io_backend, layout, tree))
    assert type(r.t.controller).__name__ == "HybridCacheController"
    assert r.t.controller.has_draft
    r.check_draft(mamba=True)


@needs_sidecar
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_the_unified_tree_carries_the_draft_sidecar(io_backend: str, layout: str) -> None:
    r = _Run(_hybrid(io_backend, layout, "unified"))
    names = [spec.pool_name.name for spec in r.t.tree.sidecar_pool_specs]
    assert names == ["DRAFT"]  # registered through the tree
    r.check_served(draft_intact=True, mamba=True)
    r.check_clean()


@needs_set_draft
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_the_kv_only_unified_tree_leaves_the_draft_out_too(io_backend: str, layout: str) -> None:
    """``init_hicache`` builds a ``HybridCacheController`` for a KV-only ``UnifiedRadixCache``
    as well (0.5.12 on): the same omission as the hybrid trees' (0.5.12, 0.5.13), the same fix."""
    r = _Run(_kv_only(io_backend, layout))
    assert type(r.t.controller).__name__ == "HybridCacheController"
    r.check_draft(mamba=False)


@needs_sidecar
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_the_kv_only_unified_tree_carries_the_draft_sidecar(io_backend: str, layout: str) -> None:
    r = _Run(_kv_only(io_backend, layout))
    r.check_served(draft_intact=True, mamba=False)
    r.check_clean()


@pytest.mark.skipif(not (SIDECAR or SET_DRAFT), reason="this release's scheduler registers no draft")
def test_a_draft_registered_before_the_controller_is_instrumented_is_followed_too() -> None:
    from hicache_obs.lab.sglang.tree import hybrid_trees

    tree = hybrid_trees()[0]
    r = _Run(_hybrid("direct", "page_first_direct", tree), draft_first=True)
    if SIDECAR:
        r.check_served(draft_intact=True, mamba=True)
        r.check_clean()
    else:
        r.check_draft(mamba=True)


def test_a_tree_without_a_draft_checks_none() -> None:
    from hicache_obs.lab.sglang.tree import build_hybrid_tree, hybrid_trees

    if not hybrid_trees():
        pytest.skip(f"SGLang {RELEASE} has no hybrid Mamba tree with HiCache")
    t = build_hybrid_tree()
    assert t.draft is None
    assert t.serve(A1).draft_ok is None


@pytest.mark.skipif(not (SIDECAR or SET_DRAFT), reason="this release's scheduler registers no draft")
def test_a_second_draft_is_refused() -> None:
    from hicache_obs.lab.sglang.tree import build_hybrid_tree

    t = build_hybrid_tree()
    t.add_draft()
    with pytest.raises(ConfigError, match="draft KV pool already"):
        t.add_draft()


@pytest.mark.skipif(SIDECAR or SET_DRAFT or RELEASE is None, reason="this release's scheduler registers a draft")
def test_a_release_without_a_draft_registration_is_refused() -> None:
    from hicache_obs.lab.sglang.tree import build_hybrid_tree

    assert release_tuple() < (0, 5, 11)
    t = build_hybrid_tree()
    with pytest.raises(IntegrationError, match="takes no draft KV pool"):
        t.add_draft()
