"""SGLang's own ``UnifiedRadixCache`` with HiCache, driven as the scheduler drives it, under
``write_back`` until the device pool must evict (SGLang PR #24585).

0.5.12's ``_evict_device_leaf`` submits a node's write-back (``write_backup(node,
write_back=True)``) and demotes the node at once (``_evict_to_host`` frees its device slots)
while the D2H copy still reads them; its next ``check_hicache_events`` then fails its own
assertion (``writing_check`` -> ``dec_lock_ref`` -> ``release_component_lock``:
``cd.value is not None``). 0.5.13 waits for the write (``writing_check(write_back=True)``)
before demoting; 0.5.2x too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sglang_env import release_tuple

from hicache_obs.core import ModelSpec
from hicache_obs.errors import IntegrationError
from hicache_obs.events import EventLog
from hicache_obs.events._audit import audit
from hicache_obs.events._replay import replay
from hicache_obs.events._schema import AuditViolation, SlotsFreed, TransferCompleted, TransferSubmitted
from hicache_obs.integrations.sglang import instrument
from hicache_obs.lab.sglang.server import free_port

pytestmark = pytest.mark.needs_sglang

BACKENDS = [
    pytest.param("direct", "page_first_direct", id="direct-page_first_direct"),
    pytest.param("direct", "layer_first", id="direct-layer_first"),
    pytest.param("kernel", "page_first", id="kernel-page_first"),
    pytest.param("kernel", "layer_first", id="kernel-layer_first"),
]
PAGE = ModelSpec.tiny().page_size
P = list(range(1000, 1000 + 2 * PAGE))
Q = list(range(2000, 2000 + 2 * PAGE))


def _req(prefix: list[int], tag: int) -> list[int]:
    return prefix + [tag * 100 + i for i in range(2 * PAGE)]


# a 128-token device pool: the third request must evict the first two's suffixes (never backed
# up under write_back); the fourth and sixth hit them on the host and load them back
WORKLOAD = [_req(P, 1), _req(P, 2), _req(Q, 3), _req(P, 1), _req(Q, 4), _req(P, 2)]
EVICTING = 2


@pytest.fixture
def unified() -> None:
    from hicache_obs.lab.sglang.tree import has_unified_hicache

    if not has_unified_hicache():
        pytest.skip("this SGLang release has no UnifiedRadixCache with HiCache (init_hicache)")


class _Run:
    """SGLang's tree with HiCache, its controller instrumented into a log."""

    def __init__(self, io_backend: str, layout: str) -> None:
        from hicache_obs.lab.sglang.tree import build_tree

        self.t = build_tree(ModelSpec.tiny(), io_backend=io_backend, layout=layout, device_size=128)
        self.log = EventLog()
        self.inst = instrument(self.t.controller, log=self.log)

    def events(self) -> list[Any]:
        self.log.flush()
        return [e for e in self.log.events() if not isinstance(e, AuditViolation)]


def _first_write_back(events: list[Any]) -> tuple[TransferSubmitted, list[SlotsFreed], list[TransferCompleted]]:
    """The first D2H submission, the device KV frees after it, and its completions."""
    sub = next(e for e in events if isinstance(e, TransferSubmitted) and e.direction == "d2h")
    frees = [
        e for e in events if isinstance(e, SlotsFreed) and e.seq > sub.seq and (e.pool, e.tier) == ("kv", "device")
    ]
    done = [e for e in events if isinstance(e, TransferCompleted) and e.op == sub.op]
    return sub, frees, done


@pytest.mark.skipif(release_tuple()[:3] != (0, 5, 12), reason="SGLang 0.5.12's write-back demotion (PR #24585)")
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_0_5_12_frees_a_write_back_in_flight_then_fails_its_assertion(
    unified: None, io_backend: str, layout: str
) -> None:
    r = _Run(io_backend, layout)
    for tokens in WORKLOAD[: EVICTING + 1]:
        assert r.t.serve(tokens).data_ok
    sub, frees, done = _first_write_back(r.events())
    assert frees and done == []  # the node's device slots went back with its write in flight
    with pytest.raises(AssertionError) as raised:
        r.t.serve(WORKLOAD[EVICTING + 1])  # its first call: check_hicache_events
    assert raised.traceback[-1].name == "release_component_lock"
    names = [entry.name for entry in raised.traceback]
    assert names.index("check_hicache_events") < names.index("writing_check") < names.index("dec_lock_ref")
    sub, frees, done = _first_write_back(r.events())
    assert len(done) == 1 and sub.seq < frees[0].seq < done[0].seq  # submitted, freed, completed


@pytest.mark.skipif(release_tuple()[:3] != (0, 5, 12), reason="SGLang 0.5.12's write-back demotion (PR #24585)")
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_0_5_12_use_after_free_is_a_finding(unified: None, io_backend: str, layout: str) -> None:
    r = _Run(io_backend, layout)
    for tokens in WORKLOAD[: EVICTING + 1]:
        r.t.serve(tokens)
    with pytest.raises(AssertionError):
        r.t.serve(WORKLOAD[EVICTING + 1])
    sub, _, _ = _first_write_back(r.events())
    found = [(f.rule, f.pool, f.role, f.direction, f.op) for f in audit(r.events()) if f.rule == "slot_not_allocated"]
    assert ("slot_not_allocated", "kv", "device", "d2h", sub.op) in found


CRASHING = """
import os, sys
from hicache_obs.core import ModelSpec
from hicache_obs.lab.sglang.tree import build_tree

tree = build_tree(ModelSpec.tiny(), io_backend=sys.argv[1], layout=sys.argv[2], device_size=128)
try:
    for tokens in WORKLOAD:
        tree.serve(tokens)
except AssertionError:
    print("sglang-assertion", flush=True)
    os._exit(3)  # as a crashed scheduler is killed: no atexit, nothing written after this
"""


@pytest.mark.skipif(release_tuple()[:3] != (0, 5, 12), reason="SGLang 0.5.12's write-back demotion (PR #24585)")
@pytest.mark.parametrize("io_backend,layout", [BACKENDS[0], BACKENDS[2]])
def test_the_finding_is_on_disk_before_sglangs_assertion_ends_the_process(
    unified: None, io_backend: str, layout: str, tmp_path: Path
) -> None:
    """Under ``hicache-obs instrument`` (the controller instrumented as SGLang builds it, the
    tree's allocator methods taken before), a process that dies right after SGLang's assertion
    leaves the finding in its log files (a use after free: the audit profile's slot rules)."""
    script = f"WORKLOAD = {WORKLOAD!r}\n" + CRASHING
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hicache_obs", "instrument", "--profile", "audit"]
    cmd += ["--metrics-port", str(free_port()), "--out", str(out)]
    proc = subprocess.run(
        [*cmd, "--", sys.executable, "-W", "ignore", "-c", script, io_backend, layout],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 3 and "sglang-assertion" in proc.stdout, proc.stderr[-3000:]
    res = replay(out)
    live = [(v.rule, v.pool, v.role, v.direction) for v in res.events if isinstance(v, AuditViolation)]
    assert ("slot_not_allocated", "kv", "device", "d2h") in live, live
    found = {(f.rule, f.pool, f.role, f.direction) for f in audit(res.events) if f.rule != "incomplete_operation"}
    assert found == {("slot_not_allocated", "kv", "device", "d2h")}


@pytest.mark.skipif(release_tuple() < (0, 5, 13), reason="0.5.13 waits for a write-back before it demotes")
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_write_back_eviction_waits_for_the_copy(unified: None, io_backend: str, layout: str) -> None:
    r = _Run(io_backend, layout)
    served = [r.t.serve(tokens) for tokens in WORKLOAD]
    r.t.step()
    assert all(s.data_ok for s in served)
    assert [s.loaded for s in served] == [0, 0, 0, 2 * PAGE, 0, 2 * PAGE]  # both suffixes came back
    events = r.events()
    _, frees, done = _first_write_back(events)
    assert frees and len(done) == 1 and done[0].seq < frees[0].seq  # completed, then freed
    assert audit(events) == []
    assert r.inst.errors == 0


def test_a_tree_without_a_scheduler_call_is_refused(unified: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache_obs.lab.sglang.tree import build_tree

    cls = __import__("sglang.srt.mem_cache.unified_radix_cache", fromlist=["UnifiedRadixCache"]).UnifiedRadixCache
    monkeypatch.setattr(cls, "init_load_back", None)  # BasePrefixCache defines one too
    with pytest.raises(IntegrationError, match="init_load_back"):
        build_tree(ModelSpec.tiny())
