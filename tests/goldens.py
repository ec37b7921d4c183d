"""The golden files of the committed log fixtures (one per format version), for the tests
that compare with them.

``HICACHE_REGENERATE_GOLDENS=1`` makes :func:`check_golden` write what it was given
instead of comparing (then review ``git diff tests/data/logs/golden/``).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

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
