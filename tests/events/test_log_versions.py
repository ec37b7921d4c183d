"""Logs of every readable format version replay; the committed v1 log gives the golden outputs.

``tests/data/logs/v1/`` is a log written before segments had a header (format version 1):
``hicache-obs demo --steps 40 --fault unrecorded-pool-indices``. Its ``audit --json``,
``inspect --json`` and ``export`` outputs are pinned under ``tests/data/logs/golden/v1/``
(regenerate with ``HICACHE_REGENERATE_GOLDENS=1``, see ``tests/exporters/test_golden.py``).
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import pytest

from hicache_obs.cli import main
from hicache_obs.events.replay import replay

REPO = Path(__file__).resolve().parents[2]
V1 = "tests/data/logs/v1"  # relative to REPO: the outputs name the files read
GOLDEN = REPO / "tests/data/logs/golden/v1"
REGENERATE = os.environ.get("HICACHE_REGENERATE_GOLDENS") == "1"


def _check_golden(name: str, got: bytes) -> None:
    path = GOLDEN / name
    if REGENERATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(got)
        return
    want = path.read_bytes()
    if got != want:
        diff = difflib.unified_diff(
            want.decode().splitlines(), got.decode().splitlines(), "golden", "now", n=1, lineterm=""
        )
        shown = "\n".join(line[:300] for line in list(diff)[:40])
        pytest.fail(f"{name} differs from its golden file (HICACHE_REGENERATE_GOLDENS=1 rewrites it):\n{shown}")


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """``cli(*argv) -> (exit code, stdout, stderr)``, run in-process from the repository root."""
    monkeypatch.chdir(REPO)

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_v1_fixture_replays(cli, tmp_path: Path) -> None:
    code, out, err = cli("audit", V1, "--json")
    assert code == 1, err  # the fixture's fault: violations
    _check_golden("audit.json", out.encode())
    audit = json.loads(out)
    assert audit["events"] == 1166 and audit["torn_lines"] == []
    assert {v["rule"] for v in audit["violations"]} == {"unrecorded_index"}

    code, out, err = cli("inspect", V1, "--json")
    assert code == 0, err
    _check_golden("inspect.json", out.encode())
    assert len(json.loads(out)["ops"]) == 39

    trace, otlp = tmp_path / "trace.json", tmp_path / "otlp.json"
    code, _, err = cli("export", V1, "--chrome-trace", str(trace), "--otlp-json", str(otlp))
    assert code == 0, err
    _check_golden("chrome_trace.json", trace.read_bytes())
    _check_golden("otlp.json", otlp.read_bytes())
    if REGENERATE:
        pytest.skip("regenerated the v1 goldens")

    # the library reads it the same way, whole or streamed
    whole = replay(REPO / V1, audit=True)
    streamed = replay(REPO / V1, audit=True, keep_events=False)
    assert whole.n_events == streamed.n_events == 1166
    assert len(whole.findings) == len(streamed.findings) == len(audit["violations"])
    assert whole.state.snapshot() == streamed.state.snapshot()
