"""The ``hicache-obs`` command (also ``python -m hicache_obs``).

Subcommands, one module each, every one with ``register(subparsers)`` and
``run(args) -> int``:

- ``demo``: the synthetic serving workload with every exporter attached (:mod:`.demo`)
- ``audit``: replay logs and apply the audit rules; exit 1 on violations (:mod:`.audit`)
- ``inspect``: operations as a tree or a timeline (:mod:`.inspect`)
- ``export``: Chrome trace / OTLP JSON from a log (:mod:`.export`)
- ``bench``: overhead and bandwidth ratios measured side by side (:mod:`.bench`)
- ``instrument``: run a command with SGLang's controllers instrumented (:mod:`.instrument`)

Exit codes: 0 success (clean), 1 violations found, 2 usage error or unreadable
input, 130 interrupted. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import HiCacheError
from ._common import EXIT_USAGE, CliError, formatter

__all__ = ["main", "build_parser", "COMMANDS"]

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS = ("demo", "audit", "inspect", "export", "bench", "instrument")

_EPILOG = """\
examples:
  hicache-obs demo                    run the demo; output in ./hicache-demo/
  hicache-obs demo --fault unrecorded-pool-indices --json
  hicache-obs audit hicache-demo/     exit 0 clean, 1 violations, 2 unreadable
  hicache-obs inspect hicache-demo/ --violations-only
  hicache-obs export hicache-demo/ --chrome-trace trace.json
  hicache-obs bench --quick           overhead and bandwidth ratios
  hicache-obs instrument -- python -m sglang.launch_server ...

Run `hicache-obs COMMAND --help` for the options of each command.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hicache-obs",
        description="A hierarchical KV-cache controller whose every state change is an event: "
        "run the demo, audit, inspect and export event logs.",
        epilog=_EPILOG,
        formatter_class=formatter,
    )
    parser.add_argument("--version", action="version", version=f"hicache-obs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except BrokenPipeError:  # `hicache-obs ... | head`: stop quietly
        _silence_stdout()
        return 141
    except CliError as exc:
        _error(str(exc))
        return exc.code
    except (HiCacheError, OSError) as exc:
        _error(str(exc) or type(exc).__name__)
        return EXIT_USAGE
    except KeyboardInterrupt:
        _error("interrupted")
        return 130


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _error(message: str) -> None:
    from ._common import escape_text

    # an error may quote a log (a line, a name): never let it drive the terminal
    print(f"hicache-obs: error: {escape_text(message, markup=False)}", file=sys.stderr)
