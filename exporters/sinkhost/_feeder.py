"""Feeding a sink host from the producer's own thread: :class:`HostFeeder`, :func:`add_sink_host`."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

from hicache_obs.errors import ConfigError
from hicache_obs.events._log import HandoffWake
from hicache_obs.events._sinks import report_losses
from hicache_obs.events._store import close_at_exit

from ._client import SinkHost, SinkHostError
from ._specs import check_specs

__all__ = ["HostFeeder", "add_sink_host"]

_log = logging.getLogger("hicache_obs.sinkhost")


class HostFeeder:
    """Feeds a :class:`SinkHost` from the producer's own thread (``EventLog.attach_feeder``).

    The log hands it every ``batch`` events (or what waits, ``interval`` seconds after the
    last hand-off) while the producer emits; :meth:`take` encodes them into one frame and
    writes what the pipe takes without waiting. No worker thread runs while the controller works, so the
    controller never waits for the GIL to come back from one. A watcher thread sleeps
    without the GIL in its :class:`~hicache_obs.events._log.FeederHandle`'s ``wait`` and acts
    only when the producer is idle with events waiting, or when frames wait for room in the pipe.

    When more than ``max_queue`` events wait for the pipe (a child that does not keep
    up), policy ``"drop"`` drops the oldest whole frames not begun; ``"block"`` first
    makes the producer wait up to ``block_timeout`` seconds. Every event is accounted
    for: :meth:`stats` ``offered == handled + dropped + queued``, where ``handled``
    counts events written to the child's pipe. It has the runner API the log's other
    sinks have (``name``, ``sink``, ``policy``, ``dropped``, ``errors``, ``stats()``,
    ``flush()``, ``close()``).
    """

    def __init__(
        self,
        host: SinkHost,
        log: Any,
        *,
        name: str | None = None,
        policy: str = "drop",
        max_queue: int = 100_000,
        block_timeout: float = 1.0,
        batch: int = 256,
        interval: float = 0.05,
        backfill: bool = True,
    ) -> None:
        if policy not in ("drop", "block"):
            raise ConfigError(f"sink queue policy {policy!r} is not 'drop' or 'block'")
        if max_queue < 1:
            raise ConfigError(f"max_queue must be at least 1 event, got {max_queue}")
        if not block_timeout >= 0:
            raise ConfigError(f"block_timeout must be >= 0 seconds, got {block_timeout}")
        self.sink = host
        self.log = log
        self.name = name or host.name
        self.policy = policy
        self.max_queue = max_queue
        self.block_timeout = block_timeout
        self.errors = 0
        # guards the feeder's own state (next, errors, the report's clock, close's once-only
        # check): take() runs on the producer's thread, the watcher and flush/close on others.
        # A leaf lock: nothing else is taken while it is held (take holds the log's lock outside it)
        self._lock = threading.Lock()
        self._closing = False
        self._lost = 0  # events that never reached the host's queue (the ring lapped them, encoding failed)
        self._closed = False
        self._stopped_at: int | None = None
        self._last_report = 0.0
        self.next: int | None = None  # the next seq to take (None: the first hand-off says)
        # wakes the watcher: frames were left queued (it then waits for room in the pipe), or close
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._kicked = False
        try:
            self.start_seq = log.attach_feeder(self, backfill=backfill, batch=batch, interval=interval)
            self._handle = log.feeder_handle(self)
        except BaseException:
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        with self._lock:  # a hand-off may have come first (it set next)
            if self.next is None:
                self.next = self.start_seq
        self._thread = threading.Thread(target=self._watch, name=f"hicache-feeder-{self.name}", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self._lost + self.sink.discarded_events

    @property
    def handled(self) -> int:
        return self.sink.sent_events

    @property
    def offered(self) -> int:
        end = self._stopped_at if self._stopped_at is not None else self.log.published
        return end - self.start_seq

    def lag(self) -> int:
        """Events published that have not reached the child's pipe yet."""
        nxt = self.start_seq if self.next is None else self.next
        return self.log.published - nxt + self.sink.queued_events

    # ------------------------------------------------------ producer's side
    def take(self, start: int, events: list[Any]) -> None:
        """Events ``start, start + 1, ...`` from the log (its lock held): queue them for the child."""
        with self._lock:
            nxt = start if self.next is None else self.next
            end = start + len(events)
            if end <= nxt or self._closed:
                return
            if start > nxt:  # the ring lapped events not taken yet
                self._lost += start - nxt
            elif start < nxt:
                events = events[nxt - start :]
            self.next = end
        host = self.sink
        try:
            frame = host.encode(events)
        except Exception as exc:  # an event the wire cannot carry: the batch is lost, counted
            self._lost += len(events)
            self._failed("encode", exc, len(events))
            return
        try:
            host.push(
                frame,
                len(events),
                self.max_queue,
                time.monotonic() + self.block_timeout if self.policy == "block" else None,
            )
        except SinkHostError as exc:  # the child is gone: what was queued is counted as discarded
            self._failed("send", exc, len(events))
        if host.queued_events and not self._kicked:  # the watcher writes the rest as the pipe drains
            self._kicked = True
            self._wake()

    def _failed(self, what: str, exc: BaseException, n: int) -> None:
        # the producer, the watcher and a flushing thread all count here: one at a time
        with self._lock:
            self.errors += 1
            now = time.monotonic()
            report = self.errors == 1 or now - self._last_report >= 10.0  # not a line per batch from a dead child
            if report:
                self._last_report = now
        if report:
            _log.error(
                "sink host %s: %s of %d events failed (%d errors, %d events dropped so far): %s",
                self.name,
                what,
                n,
                self.errors,
                self.dropped,
                exc,
            )

    # ---------------------------------------------------------- the watcher
    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, BrokenPipeError):  # a byte is waiting already / it is gone
            os.write(self._wake_w, b"w")

    def _watch(self) -> None:
        handle, host = self._handle, self.sink
        try:
            while True:
                out = host.out_fd if host.queued_events else -1
                code = handle.wait(1.0, self._wake_r, out)
                if code == HandoffWake.WOKEN:  # close, or frames left queued (watched from the next wait on)
                    os.read(self._wake_r, 4096)
                    self._kicked = False
                    if self._closed:
                        return
                elif code == HandoffWake.DUE:  # the producer went idle with events waiting
                    handle.handoff_now()  # nothing once close detached the feeder
                elif code == HandoffWake.WRITABLE:  # room in the pipe for what waits
                    try:
                        host.pump()
                    except SinkHostError as exc:
                        self._failed("send", exc, 0)
        except Exception:  # the next hand-off, flush or close still sends what waits
            _log.exception("sink host %s: its watcher stopped", self.name)
        finally:
            os.close(self._wake_r)

    # ------------------------------------------------------------ runner API
    def flush(self, timeout: float | None = 10.0) -> bool:
        """Hand over what is published, then wait until the child handled it and flushed its sinks."""
        if not self._handle.handoff_now():  # detached: close flushed everything the feeder was offered
            return True
        try:
            self.sink.flush(timeout)
        except SinkHostError as exc:
            self._failed("flush", exc, 0)
            return False
        return True

    def close(self, timeout: float | None = 10.0) -> None:
        """Hand over what is published, close the child's sinks (they flush first) and stop."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        # under the log's lock: what is published is handed over, and no take() comes after it
        stopped = self._handle.detach()
        with self._lock:
            self._stopped_at = stopped
            self._closed = True
        self._wake()  # the watcher sees _closed and exits
        os.close(self._wake_w)
        try:
            self.sink.close(timeout)
        except SinkHostError as exc:
            self._failed("close", exc, 0)
        report_losses(self)

    def stats(self) -> dict[str, int]:
        end = self._stopped_at if self._stopped_at is not None else self.log.published
        nxt = self.start_seq if self.next is None else self.next
        return {
            "offered": self.offered,
            "handled": self.handled,
            "dropped": self.dropped,
            "errors": self.errors,
            "queued": max(0, end - nxt) + self.sink.queued_events,
        }


def add_sink_host(
    log: Any, sinks: list[dict[str, Any]], *, batch: int = 256, interval: float = 0.05, **host_options: Any
) -> HostFeeder:
    """Start a :class:`SinkHost` and feed it from ``log`` (a :class:`HostFeeder`); returns the feeder.

    ``batch`` / ``interval``: the log hands events over once that many wait, or once
    that long passed since the last hand-off. The feeder makes the producer wait (up to
    its ``block_timeout``) rather than drop when the host holds a durable store, as
    :func:`~hicache_obs.events._store.open_store` does, and is closed at exit then.
    """
    specs = check_specs(sinks)
    for spec in specs:  # a hosted store names its segments after the log's rank
        if spec["sink"] == "jsonl":
            spec.setdefault("rank", log.rank)
    host = SinkHost(specs, **host_options)
    durable = any(s["sink"] == "jsonl" for s in host.specs)
    try:
        feeder = HostFeeder(host, log, policy="block" if durable else "drop", batch=batch, interval=interval)
    except BaseException:
        host.close()
        raise
    if durable:  # like open_store: what is queued reaches the disk at exit too
        close_at_exit(feeder)
    return feeder
