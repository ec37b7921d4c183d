"""The ``hicache-obs`` command (also ``python -m hicache_obs``).

Subcommands, one module each, every one with ``register(subparsers)`` and
``run(args) -> int``:

- ``demo``: the synthetic serving workload with every exporter attached (:mod:`hicache_obs.lab.cli.demo`)
- ``audit``: replay logs and apply the audit rules; exit 1 on violations (:mod:`._audit`)
- ``inspect``: operations as a tree or a timeline (:mod:`._inspect`)
- ``export``: Chrome trace / OTLP JSON from a log (:mod:`._export`)
- ``bench``: overhead and bandwidth ratios measured side by side (:mod:`hicache_obs.lab.cli.bench`)
- ``instrument``: run a command with SGLang's controllers instrumented (:mod:`._instrument`)

Exit codes: 0 success (clean), 1 violations found, 2 usage error or unreadable
input, 130 interrupted (SIGINT, Ctrl-C), 143 terminated (SIGTERM). Errors are one line
on stderr, never a traceback, from the first import on.

SIGTERM takes the path SIGINT takes: it raises :class:`Terminated` (a
``KeyboardInterrupt``) in the main thread, so every ``with``/``finally`` runs and the
demo closes its controller and event log (every queued event reaches the store) before
it exits. A second SIGTERM while that runs is ignored; SIGKILL is the way to stop it
without the flush.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from .. import __version__
from ..errors import HiCacheError
from ._common import EXIT_USAGE, CliError, formatter

__all__ = ["main"]

EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM: unwinds like Ctrl-C, so nothing is left unflushed."""


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the block runs (closing a log: an interrupt in the middle
    of its flush would lose the tail), then raise what came: ``KeyboardInterrupt`` or
    :class:`Terminated`. A signal that was ignored before the block stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        got.append(signum)

    previous: dict[int, Any] = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    unwinding = False
    try:
        yield
    except BaseException:
        unwinding = True  # the block's own exception goes on; what was held is dropped
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        came = [s for s in got if previous[s] is not signal.SIG_IGN]
        if came and not unwinding:
            if signal.SIGTERM in came:
                if previous[signal.SIGTERM] is not signal.SIG_DFL:
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as the first SIGTERM does
                raise Terminated()
            raise KeyboardInterrupt()


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While the command runs, SIGTERM raises :class:`Terminated` (once; later ones are ignored
    so the unwinding can finish). Left alone where someone else installed a handler, or off
    the main thread (Python only runs signal handlers there).

    An interrupt raised while a finalizer (``__del__``, a weakref callback) runs is printed
    and dropped by Python, and the command would go on as if no signal had come. While the
    command runs, such a dropped ``KeyboardInterrupt`` or :class:`Terminated` is not printed:
    its signal is raised again, to be handled at the next point outside the finalizer."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the unwinding below must not be cut short
        raise Terminated()

    previous_hook = sys.unraisablehook

    def redeliver(unraisable: Any) -> None:
        exc = unraisable.exc_value
        main_thread = threading.current_thread() is threading.main_thread()
        if isinstance(exc, Terminated) and ours and main_thread:
            signal.signal(signal.SIGTERM, on_sigterm)
            sig = signal.SIGTERM
        elif (
            type(exc) is KeyboardInterrupt
            and main_thread
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            sig = signal.SIGINT
        else:
            previous_hook(unraisable)
            return
        while True:  # sent from a thread, so it is handled once this hook has returned
            try:
                threading.Timer(0.01, os.kill, (os.getpid(), sig)).start()
                return
            except KeyboardInterrupt:  # the one sent before landed in here: send it again
                if sig == signal.SIGTERM:
                    signal.signal(signal.SIGTERM, on_sigterm)

    previous = signal.signal(signal.SIGTERM, on_sigterm) if ours else None
    sys.unraisablehook = redeliver
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        if ours:
            signal.signal(signal.SIGTERM, previous)


#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS = ("demo", "audit", "inspect", "export", "bench", "instrument")

#: Commands whose module lives in the lab (:mod:`hicache_obs.lab`), loaded by name: the
#: product never imports the lab; this table is the one place it names it.
_LAB_COMMANDS = {"demo": "hicache_obs.lab.cli.demo", "bench": "hicache_obs.lab.cli.bench"}

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


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command of :data:`COMMANDS`, or just ``only`` (what a
    run of that command parses with: the others' options, and what they import to list them,
    such as torch for the demo's, are not built)."""
    parser = argparse.ArgumentParser(
        prog="hicache-obs",
        description="A hierarchical KV-cache controller whose every state change is an event: "
        "run the demo, audit, inspect and export event logs.",
        epilog=_EPILOG,
        formatter_class=formatter,
    )
    parser.add_argument("--version", action="version", version=f"hicache-obs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS if only is None else (only,):
        importlib.import_module(_LAB_COMMANDS.get(name, f"{__name__}._{name}")).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    try:
        with _sigterm_unwinds():
            return _main(argv)
    except Terminated:  # during start-up, or raised again while a command unwound
        _error("terminated")
        return EXIT_TERMINATED
    except KeyboardInterrupt:  # e.g. Ctrl-C while torch is imported
        _error("interrupted")
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(given[0] if given and given[0] in COMMANDS else None)
    try:
        args = parser.parse_args(given)
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
    except Terminated:
        _error("terminated")
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED


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
