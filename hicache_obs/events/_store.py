"""The durable event store: JSON Lines segments, written off the controller's thread.

Every segment starts with a header line,
``{"format":"hicache-obs/events","version":1,"rank":R,"segment":K}``, written when the
segment is opened (``version``: :data:`~hicache_obs.events._schema.LOG_FORMAT_VERSION`;
``K``: the ``<n>`` of its name). Then one event per line, a JSON object whose ``type``
field names the event class (see ``docs/events.md``). Segments are named
``events-<rank>-<n>.jsonl`` and rotated when a segment would grow past ``max_bytes``
(a segment holds its header and at least one event); a line is never split
across segments. The header and each batch are written with one ``write`` each, unbuffered,
so another process can read the file while it grows; only the very last line can be torn
by a crash, and replay reports and skips it.

Use :func:`open_store` to attach a store to a log: it runs the store behind a
:class:`~hicache_obs.events._sinks.SinkRunner` (policy ``block`` by default, so
a slow disk slows the producer instead of losing events; drops, if any, are
counted) and closes it at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any

import msgspec

from ..errors import ConfigError
from ._schema import LOG_FORMAT, LOG_FORMAT_VERSION, Event

__all__ = ["JsonlStore", "open_store", "segment_name", "segment_header", "SEGMENT_GLOB"]

SEGMENT_GLOB = "events*.jsonl"
_log = logging.getLogger("hicache_obs.store")


def segment_name(rank: int, index: int) -> str:
    return f"events-{rank}-{index:05d}.jsonl"


def segment_header(rank: int, index: int) -> bytes:
    """The header line, newline included, that starts segment ``index`` of ``rank``."""
    return (
        msgspec.json.encode({"format": LOG_FORMAT, "version": LOG_FORMAT_VERSION, "rank": rank, "segment": index})
        + b"\n"
    )


class JsonlStore:
    """A batch sink that appends events to rotating JSON Lines segments."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        rank: int = 0,
        max_bytes: int = 64 << 20,
        fsync: bool = False,
        mode: int = 0o600,
        name: str = "jsonl",
    ) -> None:
        if max_bytes <= 0:
            raise ConfigError(f"JsonlStore max_bytes must be > 0, got {max_bytes}")
        self.directory = Path(directory)
        from .._files import make_dirs

        make_dirs(self.directory)
        self.rank = rank
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.mode = mode
        self.name = name
        self._enc = msgspec.json.Encoder()
        self._index = 0
        self._fd: int | None = None
        self._size = 0  # bytes in the open segment, its header included
        self._body = 0  # bytes of events in the open segment
        self.paths: list[Path] = []
        self.events_written = 0
        self.bytes_written = 0
        self.write_errors = 0
        self.events_lost = 0
        self._closed = False
        self._lock = threading.Lock()
        while (self.directory / segment_name(rank, self._index)).exists():
            self._index += 1  # never overwrite an earlier run's segments

    def _open_next(self) -> None:
        """Open the next segment and write its header. Raises OSError; then no segment is open
        (the next batch tries a new one) and the file opened, if any, is left empty."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        path = self.directory / segment_name(self.rank, self._index)
        header = segment_header(self.rank, self._index)
        self._index += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, self.mode)
        self.paths.append(path)
        try:
            if os.write(fd, header) != len(header):  # a short write of a few dozen bytes: disk full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            self.write_errors += 1
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # an empty segment reads as no events; a torn header would be reported
            os.close(fd)
            raise
        self._fd = fd
        self._size = len(header)
        self._body = 0
        self.bytes_written += len(header)

    def handle(self, event: Event) -> None:
        self.handle_batch([event])

    def handle_batch(self, events: list[Event]) -> None:
        """Encode and append events; rotates between lines. Raises OSError on a failed write."""
        with self._lock:
            self._handle_batch(events)

    def _handle_batch(self, events: list[Event]) -> None:
        if self._closed:
            raise ConfigError("JsonlStore is closed")
        enc = self._enc.encode
        chunk: list[bytes] = []
        size = 0
        written = self.events_written
        for ev in events:
            line = enc(ev) + b"\n"
            if self._fd is None or (self._size + size + len(line) > self.max_bytes and (self._body + size) > 0):
                if chunk:
                    self._write(b"".join(chunk), len(chunk))
                    chunk, size = [], 0
                try:
                    self._open_next()
                except OSError:
                    self.events_lost += len(events) - (self.events_written - written)
                    raise
            chunk.append(line)
            size += len(line)
        if chunk:
            self._write(b"".join(chunk), len(chunk))

    def _write(self, data: bytes, n_events: int) -> None:
        assert self._fd is not None
        try:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError:
            self.write_errors += 1
            self.events_lost += n_events
            # a partial line must not sit in the middle of a segment: cut it off, or
            # failing that start a new segment with the next batch
            try:
                os.ftruncate(self._fd, self._size)
            except OSError:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = None
            raise
        self._size += len(data)
        self._body += len(data)
        self.bytes_written += len(data)
        self.events_written += n_events

    def flush(self) -> None:
        with self._lock:
            if self._fd is not None and self.fsync:
                os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._fd is not None:
            try:
                if self.fsync:
                    os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None


_open_runners: weakref.WeakSet[Any] = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for runner in list(_open_runners):
        try:
            runner.close(5.0)
        except Exception:  # pragma: no cover - best effort at exit
            _log.exception("closing an event store at exit failed")


atexit.register(_close_all_at_exit)


def close_at_exit(runner: Any) -> None:
    """Close ``runner`` at interpreter exit unless it was closed before (durable sinks)."""
    _open_runners.add(runner)


def open_store(
    log: Any,
    directory: str | os.PathLike[str],
    *,
    max_bytes: int = 64 << 20,
    policy: str = "block",
    max_queue: int = 1_000_000,
    fsync: bool = False,
    mode: int = 0o600,
) -> Any:
    """Attach a :class:`JsonlStore` to ``log`` behind a worker thread; returns the runner.

    ``runner.sink`` is the store (``.paths``); ``runner.close()`` (also run at exit, and
    by ``log.close()``) writes what is queued, closes the file and reports drops.
    """
    store = JsonlStore(directory, rank=log.rank, max_bytes=max_bytes, fsync=fsync, mode=mode)
    runner = log.add_sink(store, name="jsonl", policy=policy, max_queue=max_queue)
    close_at_exit(runner)
    return runner
