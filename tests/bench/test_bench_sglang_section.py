"""The bench's sglang section where SGLang is not installed (or its run fails): its shape."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from hicache_obs.cli import main
from hicache_obs.lab import bench
from hicache_obs.lab.sglang import harness


@pytest.fixture
def no_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    """This Python has no SGLang, whatever is installed."""
    monkeypatch.setattr(harness, "sglang_version", lambda: None)


def test_not_installed_is_a_reason_not_a_failure(no_sglang: None) -> None:
    out = bench.bench_sglang(rounds=1)
    assert set(out) == {"available", "reason"} and out["available"] is False
    assert "SGLang is not installed in this Python" in out["reason"] and "make sglang" in out["reason"]


@pytest.mark.skipif(harness.sglang_version() is not None, reason="SGLang is installed in this Python")
def test_this_python_reports_it_unavailable() -> None:
    assert bench.bench_sglang(rounds=1)["available"] is False


def test_json_section_and_its_target_row(no_sglang: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--section", "sglang", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sglang"]["available"] is False and isinstance(result["sglang"]["reason"], str)
    assert set(result) == {"machine", "quick", "sglang", "targets"}
    rows = {r["key"]: r for r in result["targets"]}
    row = rows["sglang.overhead_ratio"]
    assert row == {"key": "sglang.overhead_ratio", "target": "<= 1.05", "value": None, "met": None}
    assert rows["overhead.events_metrics_ratio"]["met"] is None  # the other sections did not run


def test_text_says_so_in_one_line(no_sglang: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--section", "sglang"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "sglang:" in ln]
    assert len(lines) == 1 and lines[0].startswith("sglang: not measured: SGLang is not installed"), out


def test_a_failed_run_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # SGLang "present"; the child refuses the backend before it imports SGLang: the bench says why
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the child's scratch folder
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the parent's
    monkeypatch.setattr(bench, "sglang_unavailable_reason", lambda python=None: None)
    monkeypatch.setattr(harness, "sglang_version", lambda: "0.0.0")
    out = bench.bench_sglang(nodes=2, batch=2, rounds=1, timeout=120, backends=(("bogus", "page_first"),))
    assert set(out) == {"available", "release", "error"}
    assert out["available"] is True and out["release"] == "0.0.0"
    assert out["error"].startswith("the SGLang bench exited 1: ")
    assert "io_backend must be 'kernel' or 'direct', got 'bogus'" in out["error"]
    assert list(tmp_path.iterdir()) == []  # neither process left its scratch folder behind


@pytest.mark.parametrize(("profile_rounds", "limit"), [(None, 600), (7, 1440), (45, 6000)])
def test_the_child_may_run_longer_the_more_profile_rounds_it_has(
    monkeypatch: pytest.MonkeyPatch, profile_rounds: int | None, limit: int
) -> None:
    import subprocess

    monkeypatch.setattr(bench, "sglang_unavailable_reason", lambda python=None: None)
    monkeypatch.setattr(harness, "sglang_version", lambda: "0.0.0")
    given: list[float] = []

    def run(*args: object, timeout: float, **kw: object) -> None:
        given.append(timeout)
        raise subprocess.TimeoutExpired("child", timeout)

    monkeypatch.setattr(subprocess, "run", run)
    out = bench.bench_sglang(rounds=1, profile_rounds=profile_rounds)
    assert given == [limit] and out["error"] == f"the SGLang bench ran past {limit} s"


def test_line_of_a_measured_and_a_failed_section() -> None:
    from hicache_obs.lab.cli.bench import _sglang_line

    measured = {
        "available": True,
        "release": "0.5.23",
        "model": "tiny_hybrid",
        "io_backend": "kernel",
        "layout": "page_first",
        "rounds": 15,
        "overhead_ratio": 1.031,
        "overhead_ratio_spread": [0.98, 1.2],
        "overhead_ratio_iqr": [1.01, 1.05],
        "per_op_overhead_us": 41.6,
        "bare_per_op_us": 900.0,
    }
    line = _sglang_line(measured)
    assert line.startswith("sglang 0.5.23 (tiny_hybrid, kernel/page_first, 15 rounds")
    assert "instrumented / bare 1.031 (IQR 1.010-1.050, range 0.980-1.200)" in line and "+42 us per operation" in line
    assert "in-process" not in line  # a result from before the in-process runs
    split = _sglang_line({**measured, "in_process_ratio": 1.012, "in_process_per_op_us": 10.6})
    assert split == line + "; into an in-process log with no sinks 1.012, +11 us"
    faster = _sglang_line({**measured, "per_op_overhead_us": -3.2, "in_process_ratio": 0.99, "in_process_per_op_us": -7})
    assert "-3 us per operation" in faster and faster.endswith("no sinks 0.990, -7 us")  # a run's noise, signed
    waited = _sglang_line({**measured, "in_process_ratio": 1.012, "in_process_per_op_us": 10.6, "flush_wait_per_op_us": 38.4})
    assert waited == split + "; the wait for the sink host at each run's end 38 us an operation"
    failed = _sglang_line({"available": True, "release": "0.5.23", "error": "the SGLang bench exited 1: boom"})
    assert failed == "sglang 0.5.23: the bench failed: the SGLang bench exited 1: boom"
