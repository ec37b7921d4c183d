"""Sinks: consumers of events, isolated from the controller's thread.

A sink is any object with these operations (the :class:`Sink` protocol):

- ``handle(event)`` or ``handle_batch(events)``: consume events, in log order
- ``flush()``: make what was handled durable/visible
- ``close()``: release resources; called once

:class:`SinkRunner` feeds a sink on a worker thread that reads the log's ring of
recent events in batches, so the producer does no per-sink work. When a runner
falls more than ``max_queue`` events behind it drops the oldest (policy
``"drop"``) or blocks the producer up to ``block_timeout`` seconds and then drops
(policy ``"block"``). Every drop and every
exception a sink raises is counted (``dropped``, ``errors``) and logged; nothing
raises into the controller. A batch the sink raised on counts as one error
and as ``len(batch)`` drops.

A runner's counts always add up: ``offered == handled + dropped + queued`` in any
:meth:`SinkRunner.stats`, whatever the producer and the worker are doing (a batch
the worker holds counts as queued until the sink returned), and after ``close``
``queued`` is 0 unless the sink hung past the timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol, runtime_checkable

from ._schema import Event

__all__ = ["Sink", "BatchSink", "SinkRunner", "ListSink", "report_losses"]

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
    """Runs one sink on a worker thread that pulls batches from its log (see module doc).

    The producer pays nothing per sink: each event is stored once in the log's ring
    and every runner reads the ring at its own pace. A runner that falls more than
    ``max_queue`` events behind drops the oldest it has not handled (policy
    ``"drop"``, counted) or makes the producer wait up to ``block_timeout`` seconds
    first (policy ``"block"``).
    """

    def __init__(
        self,
        sink: Any,
        log: Any,
        *,
        name: str | None = None,
        max_queue: int = 100_000,
        policy: str = "drop",
        block_timeout: float = 1.0,
        batch_size: int | None = None,
        interval: float = 0.05,
        start_seq: int | None = None,
    ) -> None:
        from ..errors import ConfigError

        if policy not in ("drop", "block"):
            raise ConfigError(f"sink queue policy {policy!r} is not 'drop' or 'block'")
        if type(max_queue) is not int or max_queue < 1:
            raise ConfigError(f"sink max_queue must be an int >= 1 (events a sink may fall behind), got {max_queue!r}")
        # a batch is at most half the ring, so a runner may fall half the ring behind before
        # it drops (the default: 4096, or half of a smaller ring)
        half = log.ring_size // 2
        if batch_size is None:
            batch_size = min(4096, half)
        elif type(batch_size) is not int or not 1 <= batch_size <= half:
            raise ConfigError(
                f"sink batch_size must be an int between 1 and {half} (half the log's ring of {log.ring_size}), "
                f"got {batch_size!r}"
            )
        for what, value in (("block_timeout", block_timeout), ("interval", interval)):
            if type(value) not in (int, float) or not 0 < value <= 3600:
                raise ConfigError(f"sink {what} must be a number of seconds above 0 and at most 3600, got {value!r}")
        self.sink = sink
        self.log = log
        self.name = name or getattr(sink, "name", None) or type(sink).__name__
        self.max_queue = min(max_queue, log.ring_size - batch_size)  # both at least 1 (checked above)
        self.policy = policy
        self.block_timeout = block_timeout
        self.batch_size = batch_size
        self.interval = interval
        self.start_seq = log.published if start_seq is None else start_seq
        self.next = self.start_seq  # the next seq this runner hands to the sink
        self.handled = 0
        self.done = self.start_seq  # every seq below it was handed to the sink (or dropped)
        self._inflight = 0  # events of the batch the sink holds now (taken, not yet handled or dropped)
        # guards next, handled, dropped, done and _inflight together: stats() reads them at one instant
        self._progress = threading.Condition(threading.Lock())
        self.dropped = 0
        self.errors = 0
        self._wake = threading.Event()
        self._stop = False
        self._closed = False
        self._stopped_at: int | None = None
        self._batch = getattr(sink, "handle_batch", None)
        self._thread = threading.Thread(target=self._run, name=f"hicache-sink-{self.name}", daemon=True)
        self._thread.start()

    def _limit(self) -> int | None:
        """Where this runner stops: its own close, else its log's (events from there on are not its)."""
        stopped = self._stopped_at
        return stopped if stopped is not None else getattr(self.log, "closed_at", None)

    def _end(self) -> int:
        """The seq below which events are this runner's: what the log published, up to the stop."""
        pub = self.log.published  # read first: a stop set after this read lies at or above it
        limit = self._limit()
        return pub if limit is None or pub < limit else limit

    @property
    def offered(self) -> int:
        return self._end() - self.start_seq

    def lag(self) -> int:
        return self.log.published - self.next

    # ------------------------------------------------------- producer side
    def wait_for_room(self) -> None:
        """Called by the log before it publishes, for ``block`` runners only."""
        if self.log.published - self.next < self.max_queue or self._stop:
            return
        self._wake.set()
        deadline = time.monotonic() + self.block_timeout
        while self.log.published - self.next >= self.max_queue and not self._stop:
            if time.monotonic() >= deadline:
                return  # the worker will count what it cannot keep as dropped
            time.sleep(0.0002)

    # --------------------------------------------------------- worker side
    def _run(self) -> None:
        read = self.log.read
        progress = self._progress
        while True:
            pub = self._end()
            stopped = self._stopped_at
            nxt = self.next
            if nxt >= pub:
                if self._stop:  # _stopped_at was set first; pub may have been read before it
                    if stopped is not None and nxt >= stopped:
                        return
                    continue
                self._wake.wait(self.interval)
                self._wake.clear()
                continue
            lag = pub - nxt
            lost = lag - self.max_queue if lag > self.max_queue else 0
            end = min(pub, nxt + lost + self.batch_size)
            batch = read(nxt + lost, end)  # short by what the producer lapped meanwhile
            with progress:
                if self.next != nxt:  # close() took the rest meanwhile (counted there)
                    continue
                self._drop(end - nxt - len(batch))
                self.next = end
                self._inflight = len(batch)
            handled = self._handle(batch) if batch else True
            with progress:
                if handled:
                    self.handled += len(batch)
                else:
                    self.dropped += len(batch)
                self._inflight = 0
                self.done = max(self.done, end)
                progress.notify_all()

    def _drop(self, n: int) -> None:
        self.dropped += n
        if n and (self.dropped == n or self.dropped // 10_000 != (self.dropped - n) // 10_000):
            _log.warning("sink %s fell behind: %d events dropped so far", self.name, self.dropped)

    def _handle(self, batch: list[Event]) -> bool:
        """Hand a batch to the sink; False when it raised (the caller counts the batch dropped)."""
        try:
            if self._batch is not None:
                self._batch(batch)
            else:
                handle = self.sink.handle
                for ev in batch:
                    handle(ev)
            return True
        except Exception:
            # the batch did not reach the sink: an error and, for each event, a drop
            self.errors += 1
            _log.exception("sink %s failed on a batch of %d events", self.name, len(batch))
            return False

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until the sink handled every event published so far, then flush it; False on timeout."""
        target = self._end()
        deadline = None if timeout is None else time.monotonic() + timeout
        progress = self._progress
        with progress:
            while self.done < target and self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._wake.set()
                # the worker notifies after every batch it handed to the sink
                progress.wait(0.05 if left is None else min(left, 0.05))
        return self._bounded(self.sink.flush, "flush", deadline)

    def close(self, timeout: float | None = 10.0) -> None:
        """Deliver what is published, flush, stop the worker and close the sink."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        with self._progress:
            self._stopped_at = self._end()
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        with self._progress:  # what the worker did not take in time is lost: counted
            left = self._stopped_at - self.next
            if left > 0:
                self._drop(left)
                self.next = self._stopped_at
        self._bounded(self.sink.close, "close", None if timeout is None else time.monotonic() + timeout)
        report_losses(self)

    def _bounded(self, fn: Any, what: str, deadline: float | None) -> bool:
        """Run the sink's ``flush``/``close`` on a helper thread, waiting until ``deadline``.

        A sink that hangs there costs the caller at most the timeout; it counts as an error.
        """
        failed: list[BaseException] = []

        def call() -> None:
            try:
                fn()
            except Exception as exc:
                failed.append(exc)

        t = threading.Thread(target=call, name=f"hicache-sink-{self.name}-{what}", daemon=True)
        t.start()
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            self.errors += 1
            _log.error("sink %s did not %s in time; carrying on without it", self.name, what)
            return False
        if failed:
            self.errors += 1
            _log.error("sink %s failed to %s: %r", self.name, what, failed[0])
            return False
        return True

    def stats(self) -> dict[str, int]:
        """The runner's counts at one instant: ``offered == handled + dropped + queued``."""
        with self._progress:
            end = self._end()
            return {
                "offered": end - self.start_seq,
                "handled": self.handled,
                "dropped": self.dropped,
                "errors": self.errors,
                "queued": end - self.next + self._inflight,
            }


def report_losses(runner: Any) -> None:
    """At close: one warning with a runner's counts when it dropped events or met errors."""
    if runner.dropped or runner.errors:
        _log.warning(
            "sink %s closed: %d offered, %d handled, %d dropped, %d errors",
            runner.name,
            runner.offered,
            runner.handled,
            runner.dropped,
            runner.errors,
        )
