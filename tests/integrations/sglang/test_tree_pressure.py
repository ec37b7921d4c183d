"""SGLang's own trees under device and host pressure: a hot conversation among cold requests.

A conversation's turns come between two cold four-page requests each, on a 128-token device
pool with a host pool half as large again (write_through): the cold requests push the
conversation's prefix off the device, its next turn loads it back, and the host pool fills
with cold requests, so the tree evicts host nodes (their host slots freed) while loads run.
Every hit's rows are checked (KV, and the Mamba state or the SWA window where the model has
them); the log has host frees and loads back and no finding of any rule. Each tree runs on the
releases that have it; 0.5.10's hybrid controller has its own finding (#22940) and is left out.
"""

from __future__ import annotations

from typing import Any

import pytest
from sglang_env import RELEASE, needs_mamba_layout, release_tuple
from test_tree_hybrid import _seq  # pages of the same size

from hicache_obs.core import ModelSpec
from hicache_obs.events import EventLog
from hicache_obs.events._audit import audit
from hicache_obs.events._schema import AuditViolation, SlotsFreed
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang

BACKENDS = [
    pytest.param("direct", "page_first_direct", id="direct-page_first_direct"),
    pytest.param("kernel", "page_first", id="kernel-page_first"),
]


def _workload() -> list[list[int]]:
    hot, cold, out = _seq(1000, 2), 0, []
    for turn in range(4):
        hot = hot + _seq(1000 + 100 * (turn + 1), 1)
        out.append(list(hot))
        for _ in range(2):
            cold += 1
            out.append(_seq(5000 + 100 * cold, 4))
    return out


WORKLOAD = _workload()
HOT_TURNS = [i for i in range(len(WORKLOAD)) if WORKLOAD[i][0] == 1000]


def _tree(kind: str, io_backend: str, layout: str) -> Any:
    from hicache_obs.lab.sglang import tree

    if kind == "kv":
        if not tree.has_unified_hicache():
            pytest.skip(f"SGLang {RELEASE} has no UnifiedRadixCache with HiCache")
        return tree.build_tree(
            ModelSpec.tiny(), io_backend=io_backend, layout=layout, write_policy="write_through", host_ratio=1.5
        )
    if kind == "hybrid":
        if not tree.hybrid_trees():
            pytest.skip(f"SGLang {RELEASE} has no hybrid Mamba tree with HiCache")
        if release_tuple() < (0, 5, 11):
            pytest.skip("SGLang 0.5.10's hybrid controller (PR #22940): test_bug_table.py")
        needs_mamba_layout(layout)
        return tree.build_hybrid_tree(io_backend=io_backend, layout=layout, host_ratio=1.5)
    missing = tree.swa_tree_missing()
    if missing is not None:
        pytest.skip(f"SGLang {RELEASE}: {missing}")
    return tree.build_swa_tree(io_backend=io_backend, layout=layout, host_ratio=1.5)


@pytest.mark.parametrize("kind", ["kv", "hybrid", "swa"])
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_a_hot_conversation_loads_back_while_the_host_evicts(kind: str, io_backend: str, layout: str) -> None:
    t = _tree(kind, io_backend, layout)
    log = EventLog()
    inst = instrument(t.controller, log=log)
    served = [t.serve(tokens) for tokens in WORKLOAD]
    t.step()
    assert all(s.data_ok for s in served), [s.data_ok for s in served]
    for extra in ("mamba_ok", "swa_ok"):
        assert all(getattr(s, extra, None) is not False for s in served), [getattr(s, extra) for s in served]
    loaded = [i for i, s in enumerate(served) if s.loaded]
    assert loaded == HOT_TURNS[1:]  # every later turn of the hot conversation came back from the host
    log.flush()
    events = [e for e in log.events() if not isinstance(e, AuditViolation)]
    assert any(isinstance(e, SlotsFreed) and e.tier == "host" for e in events)  # the host evicted
    assert audit(events) == []
    assert inst.errors == 0
