"""The CPU server's boot: the stand-ins in every process of a test's SGLang server, and not in
``hicache-obs instrument``, which replaces itself with the server's command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sglang_env import SERVER_RELEASE

from hicache_obs.lab.sglang.cpu_server import replaced_by_its_command, server_environment

PY = "/venv/bin/python"


@pytest.mark.parametrize(
    ("argv", "replaced"),
    [
        ([PY, "-m", "hicache_obs", "instrument", "--out", "o", "--", PY, "-m", "sglang.launch_server"], True),
        ([PY, "-W", "ignore", "-m", "hicache_obs", "instrument", "--", "sglang"], True),
        ([PY, "/venv/bin/hicache-obs", "instrument", "--out", "o", "--", "sglang"], True),
        ([PY, "-m", "sglang.launch_server", "--port", "1"], False),
        ([PY, "-m", "hicache_obs", "audit", "o"], False),
        ([PY, "/venv/bin/hicache-obs", "demo"], False),
        ([PY, "-c"], False),
        ([PY], False),
    ],
)
def test_only_the_instrument_command_is_replaced(argv: list[str], replaced: bool) -> None:
    assert replaced_by_its_command(argv) is replaced


_INSTALLED = "from hicache_obs.lab.sglang import cpu_server; print('installed', cpu_server._state.get('installed'))"


@pytest.mark.needs_sglang
@SERVER_RELEASE
def test_the_stand_ins_skip_the_launcher_and_reach_its_command(tmp_path: Path) -> None:
    env = server_environment()
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    # a Python process with the boot: the stand-ins are in place (their kernels imported)
    plain = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", _INSTALLED], env=env, capture_output=True, text=True, timeout=300
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stdout.split() == ["installed", "True"]
    assert "hicache_obs.lab.sglang.kernels" in plain.stderr
    # the launcher imports none of it; the command it becomes has them (-X importtime is the
    # launcher's own: its command prints no import lines)
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hicache_obs", "instrument", "--out", str(tmp_path / "obs"),
         "--", sys.executable, "-c", _INSTALLED],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["installed", "True"]
    assert "import time:" in run.stderr and "hicache_obs.cli" in run.stderr
    assert "hicache_obs.lab.sglang.kernels" not in run.stderr and "transformers" not in run.stderr
