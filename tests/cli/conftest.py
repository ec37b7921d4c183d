"""Fixtures of the CLI tests: the command run in-process, and demo logs shared by the module tests.

``cli(*argv)`` runs ``hicache_obs.cli.main`` in-process and returns
``(exit_code, stdout, stderr)`` captured by pytest's ``capsys``. ``clean_demo`` and
``faulty_demo`` are demo runs (``--json``) made once per session: the parsed summary
and the output folder.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hicache_obs.cli import main

DEMO_STEPS = "40"
Run = tuple[int, str, str]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    def run(*argv: str) -> Run:
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _demo(out: Path, *extra: str) -> tuple[dict[str, Any], Path]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["demo", "--json", "--steps", DEMO_STEPS, "--out", str(out), *extra])
    assert code == 0, stderr.getvalue()
    return json.loads(stdout.getvalue()), out


@pytest.fixture(scope="session")
def clean_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    return _demo(tmp_path_factory.mktemp("clean") / "out")


@pytest.fixture(scope="session")
def faulty_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    return _demo(tmp_path_factory.mktemp("faulty") / "out", "--fault", "unrecorded-pool-indices")


@pytest.fixture(scope="session")
def metrics_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The faulty demo's run under the ``metrics`` profile."""
    out = tmp_path_factory.mktemp("metrics") / "out"
    return _demo(out, "--fault", "unrecorded-pool-indices", "--profile", "metrics")
