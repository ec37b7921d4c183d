"""The golden files of the committed log fixtures (one per format version), for the tests
that compare with them.

``HICACHE_REGENERATE_GOLDENS=1`` makes :func:`check_golden` write what it was given
instead of comparing (then review ``git diff tests/data/logs/golden/``).
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from hicache_obs.events._replay import replay

REPO = Path(__file__).resolve().parents[1]
FIXTURE = "tests/data/logs/v1"  # relative to REPO: the outputs name the files read
GOLDEN = REPO / "tests/data/logs/golden/v1"
FIXTURE_V2 = "tests/data/logs/v2"
REGENERATE = os.environ.get("HICACHE_REGENERATE_GOLDENS") == "1"


def check_golden(name: str, got: bytes, *, version: int = 1) -> None:
    """``got`` equals the golden file ``name`` of the version's fixture byte for byte (or
    becomes it, when regenerating)."""
    path = REPO / f"tests/data/logs/golden/v{version}" / name
    if REGENERATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(got)
        return
    assert path.is_file(), f"{path} is missing: run with HICACHE_REGENERATE_GOLDENS=1 to write it"
    want = path.read_bytes()
    if got != want:
        diff = difflib.unified_diff(
            want.decode().splitlines(), got.decode().splitlines(), "golden", "now", n=1, lineterm=""
        )
        shown = "\n".join(line[:300] for line in list(diff)[:40])
        pytest.fail(f"{name} differs from its golden file (HICACHE_REGENERATE_GOLDENS=1 rewrites it):\n{shown}")


def check_fixture_outputs(cli: Any, version: int, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The version's committed log through ``audit --json`` (exit 1: the fixtures hold
    violations), ``inspect --json`` and ``export``, each compared with its golden file;
    returns the audit and inspect JSON. Then the library replays it the same way whole
    and streamed (unless regenerating)."""
    fixture = f"tests/data/logs/v{version}"
    code, out, err = cli("audit", fixture, "--json")
    assert code == 1, err
    check_golden("audit.json", out.encode(), version=version)
    found = json.loads(out)
    code, out, err = cli("inspect", fixture, "--json")
    assert code == 0, err
    check_golden("inspect.json", out.encode(), version=version)
    inspected = json.loads(out)
    trace, otlp = tmp_path / "trace.json", tmp_path / "otlp.json"
    code, _, err = cli("export", fixture, "--chrome-trace", str(trace), "--otlp-json", str(otlp))
    assert code == 0, err
    check_golden("chrome_trace.json", trace.read_bytes(), version=version)
    check_golden("otlp.json", otlp.read_bytes(), version=version)
    if REGENERATE:
        pytest.skip(f"regenerated the v{version} goldens")
    whole = replay(REPO / fixture, audit=True)
    streamed = replay(REPO / fixture, audit=True, keep_events=False)
    assert whole.n_events == streamed.n_events == found["events"]
    assert len(whole.findings) == len(streamed.findings) == len(found["violations"])
    assert whole.state.snapshot() == streamed.state.snapshot()
    return found, inspected
