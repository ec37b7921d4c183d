"""Exports re-run the audit, the demo reports lost spans, and a failed start leaves --out alone."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_obs.core import ModelSpec
from hicache_obs.events import EventLog
from hicache_obs.events._store import open_store
from hicache_obs.lab.workload import Workload, controller_options
from hicache_obs.testing import make_controller


def _log_without_auditor(out: Path) -> None:
    log = EventLog()
    open_store(log, out)
    spec = ModelSpec.tiny_hybrid()
    c = make_controller(spec, fault="unrecorded-pool-indices", log=log, **controller_options(spec))
    Workload(c, seed=1, fault="unrecorded-pool-indices").run(30)
    c.close()
    log.close()


def test_export_shows_violations_of_a_log_recorded_without_a_live_auditor(cli: Any, tmp_path: Path) -> None:
    _log_without_auditor(tmp_path / "log")
    code, _, _ = cli("export", str(tmp_path / "log"), "--otlp-json", str(tmp_path / "spans.json"),
                     "--chrome-trace", str(tmp_path / "trace.json"))  # fmt: skip
    assert code == 0
    doc = json.loads((tmp_path / "spans.json").read_text())
    spans = [s for r in doc["resourceSpans"] for ss in r["scopeSpans"] for s in ss["spans"]]
    unrecorded = [
        a["value"]["intValue"] for s in spans for a in s["attributes"] if a["key"] == "hicache.unrecorded_indices"
    ]
    assert spans and all(int(v) == 2 for v in unrecorded)  # mamba host + device, every op
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert any(e.get("cat") == "violation" or "unrecorded_index" in e.get("name", "") for e in trace["traceEvents"])


def test_demo_counts_spans_an_unreachable_collector_never_took(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    t0 = time.perf_counter()
    code, out, _ = cli("demo", "--json", "--steps", "20", "--out", str(tmp_path / "o"),
                       "--otlp-endpoint", f"http://127.0.0.1:{port}")  # fmt: skip
    assert code == 0
    summary = json.loads(out)
    assert summary["sinks"]["otel"]["dropped"] > 0
    assert summary["sinks"]["otel"]["errors"] > 0
    assert summary["data_intact"] is True
    assert time.perf_counter() - t0 < 60


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_runtime_that_cannot_start_leaves_the_output_folder_alone(cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "old"
    out.mkdir()
    (out / "events-0-00000.jsonl").write_text("earlier run\n")
    (out / "trace.json").write_text("{}")
    code, _, err = cli("demo", "--runtime", "cuda", "--out", str(out))
    assert code == 2 and "torch.cuda.is_available() is False" in err
    assert (out / "events-0-00000.jsonl").read_text() == "earlier run\n"
    assert (out / "trace.json").exists()
