"""Fixtures of the event-log tests."""

from __future__ import annotations

import pytest
from goldens import REPO

from hicache_obs.cli import main


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
