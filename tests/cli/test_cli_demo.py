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
from hicache_obs.events._schema import TensorRef, TransferCompleted

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


def test_the_metrics_profile_finds_the_unrecorded_indices_without_slot_values(
    metrics_demo: tuple[dict[str, Any], Path], faulty_demo: tuple[dict[str, Any], Path]
) -> None:
    s, out = metrics_demo
    full = faulty_demo[0]
    assert (s["profile"], s["audit_sample"]) == ("metrics", 0.0)
    assert full["profile"] == "audit" and full["audit_sample"] == 1.0
    # the same run: the same transfers, the same corruption, the #22940 finding in both
    for key in ("operations", "failed_operations", "slots", "bytes", "hit_rate", "corrupted_slots", "violations"):
        assert s[key] == full[key], key
    assert set(s["violations"]) == {"unrecorded_index"} and s["data_intact"] is False
    # our controller's bookkeeping is the fold of its events: every profile logs them all, and
    # metrics one more (the audited share); no index tensor it describes carries its values
    assert s["events"] == full["events"] + 1
    events = replay(out).events
    refs = _tensor_refs(events)
    assert refs and all(t.indices is None for t in refs)
    assert any(t.indices is not None for t in _tensor_refs(replay(faulty_demo[1]).events))
    assert violation_counts(audit(events)) == s["violations"]


def _tensor_refs(events: list[Any]) -> list[TensorRef]:
    """Every index tensor description the events carry."""
    out: list[TensorRef] = []
    for e in events:
        for name in type(e).__struct_fields__:
            value = getattr(e, name)
            out += [v for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, TensorRef)]
    return out


def test_sampling_audits_the_share_it_was_given(cli: Any, tmp_path: Path) -> None:
    code, out, err = cli("demo", "--steps", "20", "--audit-sample", "0.25", "--json", "--out", str(tmp_path / "o"))
    assert code == 0, err
    s = json.loads(out)
    assert (s["profile"], s["audit_sample"]) == ("sampling", 0.25) and s["data_intact"] is True


def test_the_human_summary_names_the_profile(cli: Any, tmp_path: Path) -> None:
    code, out, err = cli("demo", "--steps", "5", "--profile", "sampling", "--out", str(tmp_path / "o"))
    assert code == 0, err
    assert "profile sampling (0.01 of the operations audited)" in " ".join(out.split())


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--profile", "audit", "--audit-sample", "0.5"], {}, "--profile audit --audit-sample 0.5: audit_sample 0.5: "
         "the audit profile audits every operation"),
        (["--profile", "sampling", "--audit-sample", "0"], {}, "--profile sampling --audit-sample 0.0: audit_sample "
         "0: the sampling profile needs a share above 0"),
        (["--engine", "sglang-controller", "--profile", "metrics"], {}, "--profile metrics: --engine "
         "sglang-controller takes the audit profile only, not 'metrics'"),
        (["--engine", "sglang-controller"], {"HICACHE_OBS_PROFILE": "metrics"}, "HICACHE_OBS_PROFILE=metrics: "
         "--engine sglang-controller takes the audit profile only, not 'metrics'"),
        ([], {"HICACHE_OBS_PROFILE": "bogus"}, "HICACHE_OBS_PROFILE=bogus HICACHE_OBS_AUDIT_SAMPLE=: profile must "
         "be one of metrics, audit, sampling; got 'bogus'"),
        (["--engine", "sglang"], {"HICACHE_OBS_AUDIT_SAMPLE": "2"}, "HICACHE_OBS_AUDIT_SAMPLE must be a number "
         "from 0 to 1, got '2'"),
    ],
)  # fmt: skip
def test_a_profile_the_run_cannot_take_is_one_line_before_anything_starts(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], message: str
) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    out = tmp_path / "never"
    code, _, err = cli("demo", "--steps", "5", "--out", str(out), *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "env", "profile"),
    [
        ([], {}, ("audit", 1.0)),
        (["--audit-sample", "0"], {}, ("metrics", 0.0)),  # a share alone: metrics with that share
        ([], {"HICACHE_OBS_PROFILE": "metrics"}, ("metrics", 0.0)),
        ([], {"HICACHE_OBS_PROFILE": "sampling", "HICACHE_OBS_AUDIT_SAMPLE": "0.5"}, ("sampling", 0.5)),
        (["--profile", "audit"], {"HICACHE_OBS_PROFILE": "metrics"}, ("audit", 1.0)),  # an option wins
    ],
)
def test_the_profile_comes_from_the_options_else_the_environment_else_audit(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], profile: Any
) -> None:
    monkeypatch.delenv("HICACHE_OBS_PROFILE", raising=False)
    monkeypatch.delenv("HICACHE_OBS_AUDIT_SAMPLE", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    code, out, err = cli("demo", "--steps", "5", "--json", "--out", str(tmp_path / "o"), *argv)
    assert code == 0, err
    s = json.loads(out)
    assert (s["profile"], s["audit_sample"]) == profile


@pytest.mark.parametrize(
    ("argv", "env", "profile"),
    [
        ([], {}, ("metrics", 0.0)),  # the launcher's default
        ([], {"HICACHE_OBS_PROFILE": "audit"}, ("audit", 1.0)),
        (["--audit-sample", "0.1"], {"HICACHE_OBS_PROFILE": "audit"}, ("sampling", 0.1)),
    ],
)
def test_the_server_demo_resolves_its_ranks_profile_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], profile: Any
) -> None:
    from hicache_obs.cli import build_parser
    from hicache_obs.lab.cli.demo import _chosen_profile

    monkeypatch.delenv("HICACHE_OBS_PROFILE", raising=False)
    monkeypatch.delenv("HICACHE_OBS_AUDIT_SAMPLE", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    args = build_parser().parse_args(["demo", "--engine", "sglang", *argv])
    got, _ = _chosen_profile(args, "metrics")
    assert (got.name, got.audit_sample) == profile


@pytest.mark.parametrize("share", ["2", "-0.1", "lots"])
def test_an_audit_sample_outside_0_to_1_is_a_usage_error(cli: Any, tmp_path: Path, share: str) -> None:
    code, _, err = cli("demo", "--audit-sample", share, "--out", str(tmp_path / "o"))
    assert code == 2 and f"--audit-sample: {share!r} is not a number from 0 to 1" in err, err
    assert not (tmp_path / "o").exists()
