"""Helpers the subcommands share: errors, reading logs, formatting, the console."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import IO, Any

from ..errors import HiCacheError

__all__ = [
    "CliError",
    "EXIT_OK",
    "EXIT_FINDINGS",
    "EXIT_USAGE",
    "read_log",
    "console",
    "fmt_bytes",
    "fmt_ns",
    "fmt_rate",
    "fmt_ids",
    "formatter",
    "escape_text",
]

EXIT_OK = 0
EXIT_FINDINGS = 1  # audit: the log holds violations
EXIT_USAGE = 2  # bad arguments or unreadable input


class CliError(Exception):
    """An error the command reports as one line on stderr, exiting with ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the line breaks of multi-line text (the examples) and wraps one-paragraph text."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text.strip():
            return super()._fill_text(text, width, indent)
        # past the raw formatter in the MRO: HelpFormatter's wrapping
        return super(argparse.RawDescriptionHelpFormatter, self)._fill_text(text, width, indent)

    def _split_lines(self, text: str, width: int) -> list[str]:
        # names such as unrecorded-pool-indices stay whole
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def formatter(prog: str) -> argparse.HelpFormatter:
    """Help that keeps the examples' line breaks and fits 80 columns."""
    return _HelpFormatter(prog, width=min(80, _columns()))


def _columns() -> int:
    try:
        return max(40, int(os.environ.get("COLUMNS", "80")))
    except ValueError:
        return 80


def read_log(paths: Sequence[str], **replay_options: Any) -> Any:
    """Replay files or folders of segments (``replay_options``: see
    :func:`~hicache_obs.events._replay.replay`); any unreadable input becomes a :class:`CliError`."""
    from ..events._replay import replay

    try:
        return replay(list(paths), **replay_options)
    except (HiCacheError, OSError, UnicodeError) as exc:
        raise CliError(f"cannot read log: {exc}") from None


def escape_text(value: object, *, markup: bool = True) -> str:
    """``value`` as text that is safe to print on a terminal: what comes from a log goes through here.

    Every character that is not printable (C0 and C1 controls, ESC, DEL, bidi overrides and
    other format characters, line/paragraph separators, lone surrogates, unassigned code
    points) becomes a visible ``\\xNN``/``\\uNNNN``/``\\UNNNNNNNN`` escape, so a log cannot
    move the cursor, clear the screen, plant an OSC 8 hyperlink or reorder what is shown.
    With ``markup`` (text that goes to ``rich``'s ``print`` as markup) brackets are escaped
    too, so ``[/x]`` or ``[link=...]`` print as written instead of being read as markup.
    """
    text = value if isinstance(value, str) else str(value)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else _escape_char(c) for c in text)
    if markup and ("[" in text or text.endswith("\\")):
        from rich.markup import escape

        text = escape(text)
    return text


def _escape_char(c: str) -> str:
    o = ord(c)
    if o <= 0xFF:
        return f"\\x{o:02x}"
    if o <= 0xFFFF:
        return f"\\u{o:04x}"
    return f"\\U{o:08x}"


def console(*, stderr: bool = False, file: IO[str] | None = None) -> Any:
    """A rich console on stdout (or stderr); 80 columns unless the terminal says otherwise."""
    from rich.console import Console

    stream = file if file is not None else (sys.stderr if stderr else sys.stdout)
    width = None if stream.isatty() else _columns()
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - loop always returns


def fmt_ns(ns: float | None) -> str:
    if ns is None:
        return "-"
    if ns < 1_000:
        return f"{ns:.0f} ns"
    if ns < 1_000_000:
        return f"{ns / 1e3:.1f} us"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"


def fmt_rate(bytes_per_s: float | None) -> str:
    return "-" if bytes_per_s is None else f"{fmt_bytes(bytes_per_s)}/s"


def fmt_ids(ids: Sequence[int], limit: int = 10) -> str:
    """``3, 5, 9 (+12 more)``."""
    shown = ", ".join(str(i) for i in ids[:limit])
    return shown + (f" (+{len(ids) - limit} more)" if len(ids) > limit else "")


def port_arg(low: int = 0) -> Any:
    """An argparse type for a TCP port from ``low`` to 65535 (0: a free port, where allowed)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
        if not low <= n <= 65535:
            free = " (0: a free port)" if low == 0 else ""
            raise argparse.ArgumentTypeError(f"port must be {low}..65535{free}, got {n}")
        return n

    return parse

