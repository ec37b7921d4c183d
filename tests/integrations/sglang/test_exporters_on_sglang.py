"""The exporters and the command line work unchanged on an instrumented SGLang controller's log."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sglang_env import release_tuple

from hicache_obs.core import ModelSpec
from hicache_obs.events import EventLog
from hicache_obs.events._audit import Auditor
from hicache_obs.events._store import open_store
from hicache_obs.exporters._chrome_trace import write_chrome_trace
from hicache_obs.exporters._otel import OtelSpanSink
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang
FIXED = release_tuple() >= (0, 5, 11)
README = Path(__file__).resolve().parents[3] / "README.md"


def _run(h: Any, nodes: int = 3) -> None:
    hosts = []
    for i in range(nodes):
        kv = h.alloc_kv(32)
        host, t = h.write(kv, h.alloc_mamba(1), node_id=i)
        hosts.append((kv, host, t))
    h.reap()
    for i, (kv, host, t) in enumerate(hosts):
        h.kv_allocator.free(kv)
        h.load(host, t.host_indices, node_id=i)
    h.controller.start_loading()
    h.reap()


def test_spans_logs_and_trace_from_an_sglang_log(tmp_path: Path) -> None:
    from hicache_obs.lab.sglang.harness import build_controller

    h = build_controller(ModelSpec.tiny_hybrid(), io_backend="kernel" if FIXED else "direct")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    log = EventLog()
    Auditor().attach(log)
    log.add_sink(OtelSpanSink(provider))
    open_store(log, tmp_path / "log")
    inst = instrument(h.controller, log=log)
    _run(h)
    inst.detach()
    log.close()
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans].count("hicache.write") == 3
    assert [s.name for s in spans].count("hicache.load") == 1
    unrecorded = {s.name: s.attributes["hicache.unrecorded_indices"] for s in spans}
    if FIXED:
        assert set(unrecorded.values()) == {0}
    else:  # every op's Mamba device indices went unrecorded
        assert all(n > 0 for n in unrecorded.values())
        assert all("mamba" in s.attributes["hicache.unrecorded_pools"] for s in spans)
    write_chrome_trace(log.events(), tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    slices = sorted(e["name"] for e in trace["traceEvents"] if e.get("ph") == "X")
    submitted = [e for e in log.events() if type(e).__name__ == "TransferSubmitted"]
    names = {"d2h": "hicache.write", "h2d": "hicache.load"}
    assert slices == sorted(f"{names[e.direction]} op {e.op}" for e in submitted) and len(slices) == 4
    # the command line reads the durable log as it reads ours
    audit = subprocess.run([sys.executable, "-m", "hicache_obs", "audit", str(tmp_path / "log"), "--json"],
                           capture_output=True, text=True, timeout=120)
    assert audit.returncode == (0 if FIXED else 1), audit.stderr
    inspect = subprocess.run([sys.executable, "-m", "hicache_obs", "inspect", str(tmp_path / "log"), "--json"],
                             capture_output=True, text=True, timeout=120)
    assert inspect.returncode == 0, inspect.stderr
    ops = json.loads(inspect.stdout)["ops"]
    assert sorted((o["direction"], o["status"]) for o in ops) == [("d2h", "completed")] * 3 + [("h2d", "completed")]


def test_readme_sglang_example_runs() -> None:
    from hicache_obs.lab.sglang.harness import build_controller

    block = re.search(r"## Instrumenting SGLang\n.*?```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    h = build_controller(ModelSpec.tiny_hybrid(), io_backend="kernel" if FIXED else "direct")

    class _Scheduler:  # what the README's example reaches through
        class tree_cache:
            cache_controller = h.controller

    code = block.group(1).replace("    ...                                     # serve; inst.log is the event log",
                                  "    _run(h, 2)")
    scope: dict[str, Any] = {"scheduler": _Scheduler, "_run": _run, "h": h}
    exec(compile(code, str(README), "exec"), scope)  # the README's own code
    inst = scope["inst"]
    assert inst.detached and type(h.controller.write_queue) is list
    assert sum(type(e).__name__ == "TransferCompleted" for e in inst.log.events()) == 3
