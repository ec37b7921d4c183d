"""Modules talk through public seams: the count of ``_private`` members one module reaches in
another (ruff's SLF001) may only go down.

The package still has such accesses (the log's internals, the op tables); each change that
removes some lowers ``LIMIT`` here, and a change that adds one fails this test with the new
places listed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("hicache_obs", "exporters")
#: the SLF001 count of ``ruff check --select SLF001 hicache_obs exporters``; lower it as accesses go
LIMIT = 34


def _ruff() -> str:
    beside = Path(sys.executable).parent / "ruff"  # the venv's own, as make lint runs it
    path = str(beside) if beside.exists() else shutil.which("ruff")
    if path is None:
        msg = f"ruff is not installed (neither beside {sys.executable} nor on PATH; make venv installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{msg} and CI=true")
        pytest.skip(msg)
    return path


def _ruff_slf001(ruff: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [ruff, "check", "--no-cache", "--select", "SLF001", *args, *TARGETS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode not in (0, 1):  # 1: violations found; anything else: ruff itself failed
        pytest.fail(f"ruff exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def test_private_member_accesses_do_not_grow() -> None:
    ruff = _ruff()
    stats = json.loads(_ruff_slf001(ruff, "--statistics", "--output-format", "json").stdout or "[]")
    counts = {row["code"]: row["count"] for row in stats}
    assert set(counts) <= {"SLF001"}, f"ruff reported other codes under --select SLF001: {counts}"
    count = counts.get("SLF001", 0)
    if count > LIMIT:
        where = _ruff_slf001(ruff, "--output-format", "concise").stdout
        pytest.fail(
            f"{count} private-member accesses (SLF001) in {', '.join(TARGETS)}, more than the {LIMIT} allowed: "
            f"reach another module through a public method or attribute instead.\n{where}"
        )
