"""Sinks: consumers of events, isolated from the controller's thread.

A sink is any object with these operations (the :class:`Sink` protocol):

- ``handle(event)`` or ``handle_batch(events)``: consume events, in log order
- ``flush()``: make what was handled durable/visible
- ``close()``: release resources; called once

:class:`SinkRunner` feeds a sink from a bounded queue on a worker thread. When
the queue is full it drops (policy ``"drop"``) or blocks the producer up to
``block_timeout`` seconds and then drops (policy ``"block"``). Every drop and every
exception a sink raises is counted (``dropped``, ``errors``) and logged; nothing
raises into the controller. A batch the sink raised on counts as one error
and as ``len(batch)`` drops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Protocol, runtime_checkable

from .schema import Event

__all__ = ["Sink", "BatchSink", "SinkRunner", "ListSink"]

_log = logging.getLogger("hicache_obs.sinks")


@runtime_checkable
class Sink(Protocol):
    def handle(self, event: Event) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class BatchSink(Protocol):
    def handle_batch(self, events: list[Event]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class ListSink:
    """Keeps every event it is given, in order (tests, small tools)."""

    name = "memory"

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.flushed = 0
        self.closed = False

    def handle(self, event: Event) -> None:
        self.events.append(event)

    def handle_batch(self, events: list[Event]) -> None:
        self.events.extend(events)

    def flush(self) -> None:
        self.flushed += 1

    def close(self) -> None:
        self.closed = True


class SinkRunner:
    """Runs one sink on a worker thread behind a bounded queue (see module doc)."""

    def __init__(
        self,
        sink: Any,
        *,
        name: str | None = None,
        max_queue: int = 100_000,
        policy: str = "drop",
        block_timeout: float = 1.0,
        batch_size: int = 4096,
        interval: float = 0.005,
    ) -> None:
        if policy not in ("drop", "block"):
            from ..errors import ConfigError

            raise ConfigError(f"sink queue policy {policy!r} is not 'drop' or 'block'")
        self.sink = sink
        self.name = name or getattr(sink, "name", None) or type(sink).__name__
        self.max_queue = max_queue
        self.policy = policy
        self.block_timeout = block_timeout
        self.batch_size = batch_size
        self.interval = interval
        self.offered = 0
        self.handled = 0
        self.dropped = 0
        self.errors = 0
        self._buf: deque[Event] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._stop = False
        self._closed = False
        self._batch = getattr(sink, "handle_batch", None)
        self._thread = threading.Thread(target=self._run, name=f"hicache-sink-{self.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------- producer side
    def offer(self, event: Event) -> None:
        """Queue one event; never raises, never blocks longer than the policy allows."""
        self.offered += 1
        buf = self._buf
        if self._stop:
            self.dropped += 1
            return
        if len(buf) >= self.max_queue:
            if self.policy == "block":
                deadline = time.monotonic() + self.block_timeout
                while len(buf) >= self.max_queue and time.monotonic() < deadline and not self._stop:
                    with self._cv:
                        self._cv.notify_all()
                    time.sleep(0.0005)
            if len(buf) >= self.max_queue:
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 10_000 == 0:
                    _log.warning("sink %s queue full: %d events dropped so far", self.name, self.dropped)
                return
        buf.append(event)

    # --------------------------------------------------------- worker side
    def _run(self) -> None:
        buf = self._buf
        while True:
            with self._cv:
                if not buf and not self._stop:
                    self._cv.wait(self.interval)
                if not buf and self._stop:
                    self._cv.notify_all()
                    return
                self._busy = True
            try:
                while buf:
                    n = min(len(buf), self.batch_size)
                    batch = [buf.popleft() for _ in range(n)]
                    self._handle(batch)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _handle(self, batch: list[Event]) -> None:
        try:
            if self._batch is not None:
                self._batch(batch)
            else:
                handle = self.sink.handle
                for ev in batch:
                    handle(ev)
            self.handled += len(batch)
        except Exception:
            # the batch did not reach the sink: an error and, for each event, a drop
            self.errors += 1
            self.dropped += len(batch)
            _log.exception("sink %s failed on a batch of %d events", self.name, len(batch))

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until the queue is empty and the sink flushed; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._cv.notify_all()
            while self._buf or self._busy:
                if not self._thread.is_alive():
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cv.wait(0.01 if remaining is None else min(0.01, remaining))
        try:
            self.sink.flush()
        except Exception:
            self.errors += 1
            _log.exception("sink %s failed to flush", self.name)
        return True

    def close(self, timeout: float | None = 10.0) -> None:
        """Deliver what is queued, flush, stop the worker and close the sink."""
        if self._closed:
            return
        self._closed = True
        done = self.flush(timeout)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)
        left = len(self._buf)
        if left or not done:
            self.dropped += left
            self._buf.clear()
        try:
            self.sink.close()
        except Exception:
            self.errors += 1
            _log.exception("sink %s failed to close", self.name)
        if self.dropped or self.errors:
            _log.warning(
                "sink %s closed: %d offered, %d handled, %d dropped, %d errors",
                self.name,
                self.offered,
                self.handled,
                self.dropped,
                self.errors,
            )

    def stats(self) -> dict[str, int]:
        return {
            "offered": self.offered,
            "handled": self.handled,
            "dropped": self.dropped,
            "errors": self.errors,
            "queued": len(self._buf),
        }
