"""Helpers the dashboard tests share: the generator module, PromQL parsing, external binaries.

A uniquely named module (not conftest) so that the test files can import it."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"


def load_generator() -> ModuleType:
    """``dashboards/generate.py`` imported as a module (``dashboards/`` is not a package)."""
    name = "hicache_dashboards_generate"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, DASHBOARDS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def committed_dashboards() -> dict[str, dict[str, Any]]:
    """The dashboard JSON files as committed (not as generated)."""
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panel_targets(board: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """``(panel, target)`` for every query of a dashboard (row panels' children included)."""
    for panel in board["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            for target in p.get("targets", []):
                yield p, target


def all_panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [q for p in board["panels"] for q in [p, *p.get("panels", [])]]


METRIC_TOKEN = re.compile(r"hicache_[a-z_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def metric_names_in(expr: str, all_metrics: dict[str, tuple[str, tuple[str, ...]]]) -> tuple[set[str], set[str]]:
    """``(defined, undefined)`` metric names an expression refers to (histogram series folded to the name)."""
    defined: set[str] = set()
    undefined: set[str] = set()
    for token in METRIC_TOKEN.findall(expr):
        name = token
        if name not in all_metrics:
            for suffix in HISTOGRAM_SUFFIXES:
                base = token[: -len(suffix)]
                if token.endswith(suffix) and all_metrics.get(base, ("",))[0] == "histogram":
                    name = base
                    break
        (defined if name in all_metrics else undefined).add(name)
    return defined, undefined


def calls(expr: str, functions: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(function, argument text)`` of every call of one of ``functions`` in a PromQL expression."""
    out = []
    for match in re.finditer(r"\b(" + "|".join(functions) + r")\s*\(", expr):
        depth, i = 1, match.end()
        while depth and i < len(expr):
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            i += 1
        out.append((match.group(1), expr[match.end() : i - 1]))
    return out


def require_binary(name: str, env: str) -> str:
    """Path of ``name``; skip when absent unless ``env`` is ``1`` (then fail)."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed (apt-get install prometheus)"
        if os.environ.get(env) == "1":
            pytest.fail(f"{msg} and {env}=1")
        pytest.skip(msg)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_prometheus(exe: str, folder: Path, target: str, job: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Prometheus scraping ``target`` every second as ``job``, with the shipped alert rules;
    returns the process, its URL and its log file."""
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(DASHBOARDS / "alerts.yml")],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}],
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    log_file = folder / "prometheus.log"
    for _ in range(3):  # the port may be taken between probing and binding
        port = free_port()
        with log_file.open("wb") as log:
            proc = subprocess.Popen(
                [
                    exe,
                    f"--config.file={folder / 'prometheus.yml'}",
                    f"--storage.tsdb.path={folder / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return proc, url, log_file
            time.sleep(0.1)
        stop_process(proc)
    pytest.fail(f"prometheus did not become ready:\n{log_file.read_text()[-4000:]}")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
