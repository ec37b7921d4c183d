"""``hicache-obs demo``: the summary agrees with the log, faults show, runs are reproducible."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from audit_counts import violation_counts

from hicache_obs.cli._summary import transfer_totals
from hicache_obs.events._audit import audit
from hicache_obs.events._replay import replay
from hicache_obs.events._schema import TransferCompleted

REQUIRED_KEYS = {
    "steps",
    "runtime",
    "model",
    "events",
    "operations",
    "violations",
    "data_intact",
    "corrupted_slots",
    "out",
    "metrics_url",
    "slots",
    "bytes",
    "hit_rate",
    "bandwidth_bytes_per_s",
}
#: Summary keys that hold times, paths or ports: the rest must repeat for a seed.
VARYING_KEYS = {"transfer_seconds", "bandwidth_bytes_per_s", "wall_seconds", "out", "files", "metrics_url"}


def test_clean_run_agrees_with_its_event_log(clean_demo: tuple[dict[str, Any], Path]) -> None:
    s, out = clean_demo
    assert REQUIRED_KEYS <= set(s)
    assert (s["steps"], s["runtime"], s["model"]) == (40, "sim", "tiny_hybrid")
    assert s["violations"] == {}
    assert s["data_intact"] is True and s["corrupted_slots"] == []
    assert s["checked_slots"] > 0
    assert s["operations"]["d2h"] > 0 and s["operations"]["h2d"] > 0
    assert s["out"] == str(out)
    assert sorted(p.name for p in out.iterdir()) == ["events-0-00000.jsonl", "trace.json"]

    res = replay(out)
    assert s["events"] == len(res.events)
    completed = {"d2h": 0, "h2d": 0}
    for ev in res.events:
        if isinstance(ev, TransferCompleted):
            completed[ev.direction] += 1
    assert s["operations"] == completed
    totals = transfer_totals(res.events)
    assert s["slots"] == totals.slots and s["bytes"] == totals.bytes
    assert set(s["slots"]) == {"kv", "mamba"}
    assert s["slots"]["mamba"]["h2d"] > 0
    assert audit(res.events) == []
    assert sum(s["hit_rate"].values()) == pytest.approx(1.0)
    assert all(v is None or v > 0 for v in s["bandwidth_bytes_per_s"].values())


def test_metrics_url_is_loopback_on_a_free_port(clean_demo: tuple[dict[str, Any], Path]) -> None:
    url = clean_demo[0]["metrics_url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    assert int(url.split(":")[2].split("/")[0]) > 0


def test_unrecorded_pool_indices_flags_mamba_and_corrupts_data(faulty_demo: tuple[dict[str, Any], Path]) -> None:
    s, out = faulty_demo
    assert s["fault"] == "unrecorded-pool-indices"
    assert s["violations"], "the audit found nothing"
    assert set(s["violations"]) == {"unrecorded_index"}
    assert set(s["violations"]["unrecorded_index"]) == {"mamba"}  # the anchor (kv) is recorded
    assert s["data_intact"] is False
    assert s["corrupted_slots"] and {c["pool"] for c in s["corrupted_slots"]} == {"mamba"}
    for c in s["corrupted_slots"]:
        assert set(c) == {"node", "pool", "direction", "op", "tier", "slots"} and c["slots"]
    # the offline audit of the stored log finds what the live auditor found
    assert violation_counts(audit(replay(out).events)) == s["violations"]


def _normalised_events(out: Path) -> list[Any]:
    """Event types and payloads without times and pointers."""
    norm = []
    for ev in replay(out).events:
        b = msgspec.to_builtins(ev)
        for key in ("ts_ns", "duration_ns", "layer_durations_ns"):
            b.pop(key, None)
        for ref in [b.get("tensor"), *(b.get("tensors") or [])]:
            if ref is not None:
                ref.pop("ptr", None)
        norm.append((type(ev).__name__, b))
    return norm


@pytest.mark.parametrize("fault", [None, "unrecorded-pool-indices"])
def test_same_seed_same_events_and_summary(cli: Any, tmp_path: Path, fault: str | None) -> None:
    extra = ["--fault", fault] if fault else []
    runs = {}
    for name, seed in (("a", "5"), ("b", "5"), ("c", "6")):
        code, out, _ = cli("demo", "--json", "--steps", "25", "--seed", seed, "--out", str(tmp_path / name), *extra)
        assert code == 0
        runs[name] = json.loads(out)
    a, b, c = (_normalised_events(tmp_path / n) for n in "abc")
    assert a == b
    assert a != c
    strip = lambda s: {k: v for k, v in s.items() if k not in VARYING_KEYS}  # noqa: E731
    assert strip(runs["a"]) == strip(runs["b"])


@pytest.mark.parametrize("fault", ["unmoved-pool-indices", "host-indices-not-moved", "length-mismatch"])
def test_failed_transfers_are_counted_not_fatal(cli: Any, tmp_path: Path, fault: str) -> None:
    code, out, err = cli("demo", "--json", "--steps", "20", "--fault", fault, "--out", str(tmp_path))
    assert code == 0, err
    s = json.loads(out)
    assert s["failed_operations"]["d2h"] > 0
    assert s["writes"]["failed"] == s["failed_operations"]["d2h"]
    assert s["violations"]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "options",
    [
        ["--model", "tiny", "--runtime", "cpu"],
        ["--model", "tiny_swa", "--io-backend", "direct", "--layout", "page_first"],
        ["--write-policy", "write_back"],
        ["--write-policy", "write_through_selective", "--layout", "page_first"],
    ],
)
def test_other_models_runtimes_and_policies_stay_intact(cli: Any, tmp_path: Path, options: list[str]) -> None:
    code, out, err = cli("demo", "--json", "--steps", "30", "--out", str(tmp_path), *options)
    assert code == 0, err
    s = json.loads(out)
    assert s["violations"] == {} and s["data_intact"] is True
    assert s["checked_slots"] > 0


def test_rerun_into_the_same_folder_replaces_the_old_log(cli: Any, tmp_path: Path) -> None:
    for _ in range(2):
        code, out, _ = cli("demo", "--json", "--steps", "5", "--out", str(tmp_path))
        assert code == 0
    assert len(replay(tmp_path).events) == json.loads(out)["events"]


def test_human_summary_fits_80_columns(cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("demo", "--steps", "10", "--out", "out")
    assert code == 0, err
    for text in ("Transfers", "hit rate", "data intact", "ui.perfetto.dev", "hicache-obs audit out"):
        assert text in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "/metrics at http://127.0.0.1:" in err


def test_fault_that_needs_a_hybrid_model_is_a_usage_error(cli: Any, tmp_path: Path) -> None:
    code, out, err = cli("demo", "--model", "tiny", "--fault", "unrecorded-pool-indices", "--out", str(tmp_path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("hicache-obs: error:") and "hybrid" in err
    assert not any(tmp_path.iterdir())


def test_busy_metrics_port_is_one_line_exit_2(cli: Any, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = cli("demo", "--steps", "3", "--metrics-port", str(port), "--out", str(tmp_path))
    assert code == 2
    assert err.startswith("hicache-obs: error: cannot serve /metrics") and err.count("\n") == 1


# ------------------------------------------------------------------ OTLP
class _Collector(http.server.BaseHTTPRequestHandler):
    posts: list[tuple[str, str, int]] = []

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length", "0"))
        self.rfile.read(n)
        type(self).posts.append((self.path, self.headers.get("Content-Type", ""), n))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, list[tuple[str, str, int]]]]:
    posts: list[tuple[str, str, int]] = []
    handler = type("Handler", (_Collector,), {"posts": posts})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", posts
    server.shutdown()
    server.server_close()


def test_otlp_endpoint_receives_spans(cli: Any, tmp_path: Path, collector: Any) -> None:
    url, posts = collector
    code, out, err = cli("demo", "--json", "--steps", "10", "--otlp-endpoint", url, "--out", str(tmp_path))
    assert code == 0, err
    assert json.loads(out)["otlp_endpoint"] == url
    assert posts and all(p[0] == "/v1/traces" and p[2] > 0 for p in posts)


def test_otel_environment_turns_on_otlp(
    cli: Any, tmp_path: Path, collector: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, posts = collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
    code, out, err = cli("demo", "--json", "--steps", "10", "--out", str(tmp_path))
    assert code == 0, err
    assert json.loads(out)["otlp_endpoint"] == url
    assert any(p[0] == "/v1/traces" for p in posts)
