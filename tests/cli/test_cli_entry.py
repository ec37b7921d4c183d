"""Entry points: ``--help`` everywhere, usage errors, ``python -m hicache_obs``, ``make demo``, ``--serve``."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hicache_obs.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]
VENV_CLI = REPO / ".venv" / "bin" / "hicache-obs"


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_has_examples(cli: Any, command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, text, _ = cli(*([command] if command else []), "--help")
    assert code == 0
    assert "examples:" in text
    assert max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["demo", "--steps", "0"],
        ["demo", "--fault", "nope"],
        ["demo", "--metrics-port", "70000"],
        ["audit"],
    ],
)
def test_usage_errors_exit_2(cli: Any, argv: list[str]) -> None:
    code, _, err = cli(*argv)
    assert code == 2
    assert "Traceback" not in err and err.strip()


def test_python_dash_m(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_obs", "audit", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.startswith("hicache-obs: error:") and proc.stderr.count("\n") == 1
    proc = subprocess.run([sys.executable, "-m", "hicache_obs", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "demo" in proc.stdout and "audit" in proc.stdout


def _imported(argv: list[str]) -> set[str]:
    """The modules ``python -m hicache_obs ARGV`` imported (``-X importtime``, its own only)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hicache_obs", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = {ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    assert "hicache_obs.cli" in got, proc.stderr[-2000:]
    return got


def test_commands_that_read_logs_or_launch_start_without_torch(tmp_path: Path) -> None:
    """Only the command run builds its options: audit, inspect and export read logs, and
    instrument replaces itself with its command; none of them imports torch (about a second)."""
    log = tmp_path / "log"
    log.mkdir()
    (log / "events-0-00000.jsonl").write_text("")
    for argv in (
        ["audit", str(log)],
        ["inspect", "--help"],
        ["export", "--help"],
        ["instrument", "--out", str(tmp_path / "obs"), "--", sys.executable, "-c", "pass"],
    ):
        assert "torch" not in _imported(argv), argv
    assert "torch" in _imported(["demo", "--help"])  # its choices come from the controller's modules


@pytest.mark.skipif(not VENV_CLI.exists(), reason="needs the console script in .venv (make venv)")
def test_make_demo_runs_hicache_obs_demo(tmp_path: Path) -> None:
    out = tmp_path / "demo-out"
    args = f"--steps 5 --out {out}"
    plan = subprocess.run(
        ["make", "-n", "demo", f"DEMO_ARGS={args}"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    line = next(ln for ln in plan.splitlines() if "hicache-obs demo" in ln)
    assert line.strip() == f".venv/bin/hicache-obs demo {args}"
    proc = subprocess.run(shlex.split(line), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["events-0-00000.jsonl", "trace.json"]
    assert "data intact" in proc.stdout


def test_serve_keeps_metrics_up_until_interrupted(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache_obs", "demo", "--steps", "5", "--json", "--serve", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
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
        summary = json.loads("".join(lines))
        with urllib.request.urlopen(summary["metrics_url"], timeout=30) as resp:
            body = resp.read().decode()
        assert 'hicache_operations_total{direction="h2d",status="completed"}' in body
        assert proc.poll() is None, "the demo exited instead of serving"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
