"""``hicache-obs demo --engine sglang-controller``: the demo workload through SGLang's real controller.

The runs on SGLang need a release (``needs_sglang``); the refusals and the missing-SGLang
error are checked everywhere (they happen before SGLang is imported).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from audit_counts import violation_counts
from prometheus_client.parser import text_string_to_metric_families
from sglang_env import RELEASE, release_tuple

from hicache_obs.cli import main
from hicache_obs.core._pools import LAYOUTS
from hicache_obs.events._audit import audit
from hicache_obs.events._replay import replay
from hicache_obs.events._schema import TransferCompleted, TransferFailed, TransferSubmitted

REPO = Path(__file__).resolve().parents[3]
# 0.5.11 and later move and record every pool's indices (PR #22940 and its follow-ups)
FIXED = release_tuple() >= (0, 5, 11)
STEPS = "30"


def _has_pool_host_package() -> bool:
    """0.5.2x's ``mem_cache/pool_host`` package, whose Mamba host pool takes page layouts only."""
    if RELEASE is None:
        return False
    from importlib.metadata import distribution

    return Path(str(distribution("sglang").locate_file("sglang/srt/mem_cache/pool_host/mamba.py"))).exists()


PAGE_LAYOUTS_ONLY = _has_pool_host_package()
#: the adapter names the streams after SGLang's attributes (ours are hicache-write/-load)
SGLANG_STREAMS = {"device_to_host_stream", "host_to_device_stream", "write_stream", "load_stream"}


def _demo(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["demo", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _ours_keys(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> set[str]:
    code, out, err = _demo(capsys, "--json", "--steps", "3", "--out", str(tmp_path / "ours"))
    assert code == 0, err
    return set(json.loads(out))


# ------------------------------------------------------- everywhere: before SGLang is needed
def _python_without_sglang() -> str | None:
    if RELEASE is None:
        return sys.executable
    venv = REPO / ".venv" / "bin" / "python"
    if not venv.exists():
        return None
    probe = "from hicache_obs.lab.sglang.harness import sglang_version as v; raise SystemExit(v() is not None)"
    ok = subprocess.run([str(venv), "-c", probe], capture_output=True, timeout=120).returncode == 0
    return str(venv) if ok else None


@pytest.mark.parametrize("engine", ["sglang", "sglang-controller"])
def test_missing_sglang_is_one_line_exit_2(tmp_path: Path, engine: str) -> None:
    python = _python_without_sglang()
    if python is None:
        pytest.skip("no Python without SGLang here (.venv is the one the repository builds)")
    out = tmp_path / "out"
    proc = subprocess.run(
        [python, "-m", "hicache_obs", "demo", "--engine", engine, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"hicache-obs: error: --engine {engine}: SGLang is not installed")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not out.exists()  # refused before --out is touched


@pytest.mark.parametrize(
    "option, value, says",
    [
        ("--model", "tiny_swa", "tiny, tiny_hybrid"),
        ("--runtime", "sim", "runtime cpu"),
        ("--runtime", "sim", "runtime cuda"),
        pytest.param(
            "--runtime",
            "cuda",
            "no CUDA device here",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --runtime cuda runs"),
        ),
        ("--fault", "unrecorded-pool-indices", "SGLang 0.5.10"),
        ("--fault", "double-free", "injects nothing"),
        ("--layout", "page_first_direct", "--io-backend direct only"),
    ],
)
def test_inapplicable_options_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, option: str, value: str, says: str
) -> None:
    out = tmp_path / "out"
    code, stdout, err = _demo(capsys, "--engine", "sglang-controller", option, value, "--out", str(out))
    assert code == 2 and stdout == ""
    assert err.startswith(f"hicache-obs: error: {option} {value}: ") and err.count("\n") == 1
    assert says in err
    assert not out.exists()


# ----------------------------------------------------------------------- on SGLang
def _serve(python: str, out: Path, *extra: str) -> tuple[dict[str, Any], str, int]:
    """Run the demo with ``--serve``; returns (summary, /metrics text scraped while it serves,
    exit code after Ctrl-C)."""
    err_path = out.parent / "stderr.txt"
    with err_path.open("w") as err:
        argv = ["demo", "--engine", "sglang-controller", "--steps", STEPS, "--json", "--serve", "--out", str(out), *extra]
        proc = subprocess.Popen(
            [python, "-m", "hicache_obs", *argv],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            assert proc.stdout is not None
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if line.rstrip() == "}":
                    break
            assert lines and lines[-1].rstrip() == "}", f"no summary; stderr:\n{err_path.read_text()}"
            summary = json.loads("".join(lines))
            with urllib.request.urlopen(summary["metrics_url"], timeout=30) as resp:
                text = resp.read().decode()
            assert proc.poll() is None, "the demo exited instead of serving"
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "Traceback" not in err_path.read_text()
    return summary, text, code


def _completed_ops(metrics: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(metrics):
        for s in fam.samples:
            if s.name == "hicache_operations_total" and s.labels.get("status") == "completed":
                out[s.labels["direction"]] = s.value
    return out


@pytest.mark.needs_sglang
@pytest.mark.skipif(RELEASE is not None and not FIXED, reason="0.5.10 is the pre-#22940 code: see the 0.5.10 tests")
def test_clean_run_on_sglang(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    s, metrics, code = _serve(sys.executable, out)
    assert code == 0
    assert set(s) == _ours_keys(capsys, tmp_path)  # the same summary as the ours engine
    assert (s["steps"], s["runtime"], s["model"], s["fault"]) == (int(STEPS), "cpu", "tiny_hybrid", None)
    assert s["layout"] in LAYOUTS  # the release's own default
    assert s["violations"] == {}
    assert s["data_intact"] is True and s["corrupted_slots"] == [] and s["checked_slots"] > 0
    assert s["operations"]["d2h"] > 0 and s["operations"]["h2d"] > 0
    assert s["failed_operations"] == {"d2h": 0, "h2d": 0}
    assert s["slots"]["mamba"]["d2h"] > 0 and s["slots"]["mamba"]["h2d"] > 0
    assert s["writes"]["completed"] == s["operations"]["d2h"]
    # /metrics was served, and counted what the summary counts
    assert _completed_ops(metrics) == {d: float(n) for d, n in s["operations"].items()}
    # the stored log replays to the summary; the copies were SGLang's
    assert sorted(p.name for p in out.iterdir()) == ["events-0-00000.jsonl", "trace.json"]
    events = replay(out).events
    assert len(events) == s["events"]
    done = {"d2h": 0, "h2d": 0}
    for ev in events:
        if isinstance(ev, TransferCompleted):
            done[ev.direction] += 1
    assert done == s["operations"]
    assert audit(events) == []
    streams = {e.stream for e in events if isinstance(e, TransferSubmitted)}
    assert streams and streams <= SGLANG_STREAMS, streams
    assert json.loads((out / "trace.json").read_text())["traceEvents"]


@pytest.mark.needs_sglang
@pytest.mark.skipif(RELEASE is not None and FIXED, reason="the pre-#22940 findings are 0.5.10's")
def test_sglang_0_5_10_direct_leaves_mamba_indices_unrecorded(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    code, stdout, err = _demo(
        capsys, "--engine", "sglang-controller", "--io-backend", "direct", "--steps", STEPS, "--json", "--out", str(out)
    )
    assert code == 0, err
    s = json.loads(stdout)
    assert s["violations"].get("unrecorded_index", {}).get("mamba", 0) > 0, s["violations"]
    assert not any("kv" in pools for pools in s["violations"].values()), s["violations"]
    assert s["operations"]["d2h"] > 0 and s["operations"]["h2d"] > 0
    assert s["data_intact"] is True  # direct copies read the indices at once: nothing reused them yet
    assert violation_counts(audit(replay(out).events)) == s["violations"]


@pytest.mark.needs_sglang
@pytest.mark.skipif(RELEASE is not None and FIXED, reason="the pre-#22940 findings are 0.5.10's")
def test_sglang_0_5_10_kernel_copies_fail_and_the_run_goes_on(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # SGLang bug #24121: 0.5.10 never moves the Mamba host indices to the device; the kernel refuses them
    out = tmp_path / "out"
    code, stdout, err = _demo(capsys, "--engine", "sglang-controller", "--steps", STEPS, "--json", "--out", str(out))
    assert code == 0, err
    assert "Traceback" not in err
    s = json.loads(stdout)
    assert s["io_backend"] == "kernel"
    assert s["failed_operations"]["d2h"] > 0 and s["operations"]["d2h"] == 0
    assert s["writes"]["failed"] == s["failed_operations"]["d2h"] == s["writes"]["issued"]
    assert s["violations"].get("index_not_on_device", {}).get("mamba", 0) > 0, s["violations"]
    assert not any("kv" in pools for pools in s["violations"].values()), s["violations"]
    errors = {e.error for e in replay(out).events if isinstance(e, TransferFailed)}
    assert errors and all("Destination indices must be a CUDA tensor" in e for e in errors), errors


@pytest.mark.needs_sglang
@pytest.mark.skipif(
    RELEASE is not None and not PAGE_LAYOUTS_ONLY, reason="this release's Mamba host pool takes layer_first"
)
def test_a_layout_sglang_refuses_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, err = _demo(capsys, "--engine", "sglang-controller", "--layout", "layer_first", "--out", str(out))
    assert code == 2 and stdout == ""
    assert err.startswith(f"hicache-obs: error: SGLang {RELEASE} refuses ") and err.count("\n") == 1
    assert "--layout layer_first" in err
    assert not out.exists()
