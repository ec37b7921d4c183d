"""``hicache-obs instrument [options] -- COMMAND ...``: run COMMAND with every SGLang
HiCache controller it creates, in it and in the processes it spawns, instrumented.

In the manner of ``opentelemetry-instrument``: the command puts a ``sitecustomize``
first on ``PYTHONPATH`` and replaces itself with COMMAND; every Python process that
inherits the environment (SGLang's scheduler processes, one per TP rank) then
instruments the controllers it builds. Rank N serves ``/metrics`` on ``HOST:BASE+N``
(``127.0.0.1`` unless ``--metrics-host``) and writes its log under ``DIR/rank-N/``.
``--profile`` (default ``metrics``, or ``HICACHE_OBS_PROFILE``) chooses how much evidence
each rank records; ``--audit-sample`` the share ``sampling`` audits in full.
Python processes need ``hicache-obs`` importable (installed in the environment that runs
SGLang).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from .._profiles import AUDIT_SAMPLE_ENV, PROFILE_ENV, PROFILES, profile_from_env, resolve_profile
from ..errors import ConfigError
from ._common import EXIT_USAGE, CliError, formatter, port_arg

__all__ = ["register", "run", "child_environment"]

_EPILOG = """\
examples:
  hicache-obs instrument -- python -m sglang.launch_server --model-path M
  hicache-obs instrument --metrics-port 9400 --out runs/today -- python serve.py
  hicache-obs instrument --metrics-host 0.0.0.0 -- python serve.py
                                      scraped by a Prometheus on another host
  hicache-obs instrument --profile audit -- python serve.py
                                      every event and every rule (staging, CI)
  hicache-obs instrument --audit-sample 0.01 -- python serve.py
                                      metrics, and 1 % of the ops fully audited
  hicache-obs audit runs/today/       every rank's log, one report

rank N serves /metrics on HOST:BASE+N (HOST 127.0.0.1 by default)
and logs under DIR/rank-N/
"""


_port = port_arg(1)  # BASE + rank: a fixed base, never "any free port"


def _share(value: str) -> float:
    try:
        share = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number from 0 to 1") from None
    if not 0.0 <= share <= 1.0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number from 0 to 1")
    return share


def _host(value: str) -> str:
    from ..integrations.sglang._launcher import metrics_address

    try:
        metrics_address(value, 0)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def register(sub: Any) -> None:
    p = sub.add_parser(
        "instrument",
        help="run a command with SGLang's HiCache controllers instrumented",
        description="Run COMMAND so that every SGLang HiCache controller created in it, or in a "
        "process it spawns, is instrumented: metrics, event log, audit and spans per TP rank.",
        epilog=_EPILOG,
        formatter_class=formatter,
    )
    p.add_argument("--metrics-port", type=_port, default=9400, metavar="BASE",
                   help="rank N serves /metrics on HOST:BASE+N (default 9400)")
    p.add_argument("--metrics-host", type=_host, default="127.0.0.1", metavar="HOST",
                   help="the IP address /metrics binds (default 127.0.0.1, this machine only; "
                   "0.0.0.0 or :: for every interface, for a Prometheus on another host)")
    p.add_argument("--profile", choices=PROFILES, default=None,
                   help="metrics: the dashboards' metrics and the op rules, one event per submission; "
                   "audit: every event, every rule; sampling: metrics plus the full audit of a share "
                   "of the operations (default: $HICACHE_OBS_PROFILE, else metrics)")
    p.add_argument("--audit-sample", type=_share, default=None, metavar="SHARE",
                   help="share of the operations audited in full, 0 to 1 (with metrics: sampling; "
                   "default for sampling 0.01)")
    p.add_argument("--out", default="hicache-obs-sglang", metavar="DIR",
                   help="folder of the logs, one rank-N/ folder per rank (default ./hicache-obs-sglang)")
    p.add_argument("--otlp-endpoint", metavar="URL", default=None,
                   help="send spans to this OTLP/HTTP collector (default: OTEL_EXPORTER_OTLP_ENDPOINT)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the program to run")
    p.set_defaults(func=run)


def boot_dir() -> str:
    return str(Path(__file__).resolve().parent.parent / "integrations" / "sglang" / "_boot")


def child_environment(args: argparse.Namespace, env: dict[str, str] | None = None) -> dict[str, str]:
    """COMMAND's environment: the current one with the instrumentation switched on."""
    from ..integrations.sglang._launcher import ENV

    env = dict(os.environ if env is None else env)
    env[ENV["enable"]] = "1"
    env[ENV["metrics_port"]] = str(args.metrics_port)
    env[ENV["metrics_host"]] = args.metrics_host
    env[ENV["out"]] = str(Path(args.out).resolve())
    profile = getattr(args, "profile", None)
    share = getattr(args, "audit_sample", None)
    if profile is None and share is None:
        chosen = profile_from_env(env)  # checked here: a bad value fails before COMMAND starts
    else:
        chosen = resolve_profile(profile or env.get(PROFILE_ENV) or None, share, default="metrics")
    env[PROFILE_ENV] = chosen.name
    env[AUDIT_SAMPLE_ENV] = repr(chosen.audit_sample) if chosen.name == "sampling" else ""
    if args.otlp_endpoint:
        env[ENV["otlp_endpoint"]] = args.otlp_endpoint
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = boot_dir() + (os.pathsep + old if old else "")
    return env


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("instrument: no COMMAND given (hicache-obs instrument [options] -- COMMAND ...)", EXIT_USAGE)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a folder")
    exe = shutil.which(command[0])
    if exe is None:
        raise CliError(f"instrument: command not found: {command[0]!r}", 127)
    try:
        env = child_environment(args)
    except ConfigError as exc:
        raise CliError(f"instrument: {exc}", EXIT_USAGE) from None
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(exe, command, env)  # replaces this process: signals and the exit status are COMMAND's
    return 0  # not reached
