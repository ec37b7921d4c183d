"""The package installs and works where no C compiler runs: every piece pure.

The repository's tracked files are copied to a fresh folder (no in-place built
extension can come along), installed with ``CC=false`` into a target folder, and run
by the base interpreter with this environment's site-packages on ``PYTHONPATH`` but
not its ``.pth`` files, so the editable install of the working tree cannot stand in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = "tests/data/logs/v1"
GOLDEN = ROOT / "tests" / "data" / "logs" / "golden" / "v1" / "audit.json"


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs from a git checkout: the tracked files are what gets installed")
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [f for f in out.stdout.decode().split("\0") if f and (ROOT / f).is_file()]


def _copy_tracked(src: Path) -> None:
    """The repository's tracked files, copied to ``src`` (no built extension comes along)."""
    for rel in _tracked_files():
        dst = src / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst)


def _no_compiler_env() -> dict[str, str]:
    """This environment without hicache-obs's variables, with no C compiler and no index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_OBS_")}
    env.update(CC="false", CXX="false", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


@pytest.fixture(scope="module")
def pure_install(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    src = tmp_path_factory.mktemp("src")
    _copy_tracked(src)
    target = tmp_path_factory.mktemp("installed")
    env = _no_compiler_env()
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), "."],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run_env = {k: v for k, v in env.items() if k not in ("CC", "CXX")}
    run_env["PYTHONPATH"] = os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]])
    # the runs' folder holds the fixture under its repository path, and no package source
    here = tmp_path_factory.mktemp("here")
    shutil.copytree(ROOT / FIXTURE, here / FIXTURE)
    return here, target, run_env


def _python() -> str:
    return getattr(sys, "_base_executable", None) or sys.executable


def test_no_extension_is_built_and_every_piece_runs_pure(pure_install: tuple[Path, Path, dict[str, str]]) -> None:
    here, target, env = pure_install
    assert not [p.name for p in target.rglob("*.so")]
    proc = subprocess.run(
        [_python(), "-c", "import json, hicache_obs, hicache_obs._native as n; "
         "print(hicache_obs.__file__); print(json.dumps(n.IMPLEMENTATIONS))"],
        cwd=here, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, impls = proc.stdout.splitlines()[-2:]
    assert Path(where).is_relative_to(target)  # the installed copy, not the working tree
    assert json.loads(impls) == {"logcore": "py", "slots": "py", "copy": "py"}


def test_the_pure_install_audits_a_log_as_the_compiled_one_does(pure_install: tuple[Path, Path, dict[str, str]]) -> None:
    here, _, env = pure_install
    proc = subprocess.run(
        [_python(), "-m", "hicache_obs", "audit", "--json", FIXTURE],
        cwd=here, env=env, capture_output=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # the fixture's findings
    assert proc.stdout == GOLDEN.read_bytes()


def test_the_pure_install_runs_the_demo(pure_install: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> None:
    here, _, env = pure_install
    proc = subprocess.run(
        [_python(), "-m", "hicache_obs", "demo", "--steps", "20", "--json", "--out", str(tmp_path / "run")],
        cwd=here, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["data_intact"] is True
    assert summary["events"] > 0


def test_the_wheel_builds_without_a_warning_and_carries_its_license_and_types(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _copy_tracked(src)
    env = _no_compiler_env()
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "w"), "."],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    said = (proc.stdout + proc.stderr).splitlines()
    # setuptools' own warnings (a deprecated field, a folder shipped as data); not pip's or the
    # compiler's (CC=false: the extensions fall back to their pure versions, as they should)
    warned = [line for line in said if "BuildBackendWarning" in line or "SetuptoolsDeprecationWarning" in line]
    assert warned == [], "\n".join(warned)
    import zipfile

    (wheel,) = (tmp_path / "w").glob("hicache_obs-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "hicache_obs/py.typed",
        "hicache_obs/_logcore.pyi",
        "hicache_obs/integrations/sglang/_boot/sitecustomize.py",
        "hicache_obs/lab/sglang/_cpu_boot/sitecustomize.py",
    } <= names
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert b"Apache License" in zipfile.ZipFile(wheel).read(license_file)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
