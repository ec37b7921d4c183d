"""Sinks in a process of their own: the controller's process only encodes batches.

A sink on a worker thread shares the GIL with the controller. Every torch call the
controller makes hands the GIL over, so the sink's CPU time comes almost fully out of
the controller's wall time. :class:`SinkHost` runs the sinks in a child process
(``python -m hicache_obs.exporters.sinkhost``) instead, fed through a pipe; the child
decodes the batches and feeds its sinks in log order.

:func:`add_sink_host` feeds it with a :class:`HostFeeder`: the log hands the feeder
every ``batch`` events (256) from the producer's own thread (``EventLog.attach_feeder``),
which msgpack-encodes them (about 0.3 us per event) and writes what the pipe takes
without waiting; the rest waits in a bounded queue (policy ``drop`` or ``block``, every
event counted). A worker thread costs the controller a GIL hand-over each time it
wakes up (on the bench workload, 2-3 ms a run: about what the encoding costs), and
leaves up to an interval's worth of events for the child to handle at close. The feeder's watcher
thread sleeps without the GIL and acts only when the producer went idle with events
waiting (after ``interval``, 50 ms) or when queued frames fit into the pipe again.
``log.add_sink(host)`` still works: a :class:`~hicache_obs.events.sinks.SinkRunner`
thread then calls :meth:`SinkHost.handle_batch`, which waits for room in the pipe.

The sinks are described, not passed, as JSON-able dicts (the child builds them):

- ``{"sink": "prometheus", "port": 0, "addr": "127.0.0.1", "pools": [...]}``: the child
  serves ``/metrics`` (``port`` 0 takes a free port; :attr:`SinkHost.metrics_port` says
  which). Its ``hicache_events_dropped_total`` counts the child's own sinks only; the
  parent's feeder counts what never reached the child (``feeder.stats()``).
- ``{"sink": "structlog", "file": PATH | "-", "level": "info"}``: JSON lines appended to
  ``PATH`` (created 0o644) or written to stdout (``"-"``).
- ``{"sink": "otel", "endpoint": URL}`` (OTLP/HTTP; without ``endpoint`` the
  ``OTEL_EXPORTER_OTLP_*`` environment decides) or ``{"sink": "otel", "exporter":
  "memory"}`` (spans kept in the child, counted in :attr:`SinkHost.stats`). With a
  structlog sink in the same host, its lines carry the spans' ``trace_id``/``span_id``.
- ``{"sink": "jsonl", "dir": PATH, "max_bytes": N, "fsync": false, "rank": R}``: the
  durable store (:func:`add_sink_host` fills ``rank`` from the log). The feeder of a
  host with a store should block rather than drop, and be closed at exit
  (:func:`add_sink_host` does both, as ``open_store`` does).

- ``{"sink": "audit"}``: the stream-safety auditor runs in the host instead of inline
  in the controller's process. Its ``AuditViolation`` events reach the host's other sinks
  right after the event that revealed them (metrics, span attributes and status, log
  lines: the same as with an inline auditor), and the end-of-log findings at close. They
  do not enter the parent's log, nor a ``jsonl`` store in the host (they have no ``seq``
  of their own); ``hicache-obs audit`` finds them again in the stored log.

Bad specs raise :class:`~hicache_obs.errors.ConfigError` in the parent before any process
starts; a child that cannot build its sinks makes the constructor raise with the child's
message. The child finishes its set-up (imports, decoder, auditor) before it says it is
ready, so none of it runs beside the controller's work. After ``close()`` the child has
flushed and closed every sink; it exits right after. A child that dies turns every
later batch into a counted error (and drops).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import json
import logging
import os
import select
import signal
import struct
import sys
import threading
import time
from collections import deque
from typing import Any

import msgspec

from hicache_obs.errors import ConfigError, HiCacheError
from hicache_obs.events.sinks import report_losses
from hicache_obs.events.store import close_at_exit

__all__ = ["SinkHost", "SinkHostError", "HostFeeder", "add_sink_host", "SINK_KINDS", "PIPE_BYTES"]

_log = logging.getLogger("hicache_obs.sinkhost")

#: The size asked of the kernel for the pipe to the child (Linux ``F_SETPIPE_SZ``; an
#: unprivileged process may ask up to ``/proc/sys/fs/pipe-max-size``, 1 MiB by default).
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)

#: The sinks a host can run, with the keys each one takes.
SINK_KINDS: dict[str, frozenset[str]] = {
    "audit": frozenset(),
    "prometheus": frozenset({"port", "addr", "pools"}),
    "structlog": frozenset({"file", "level"}),
    "otel": frozenset({"endpoint", "exporter", "service_name"}),
    "jsonl": frozenset({"dir", "max_bytes", "fsync", "rank"}),
}

_HEADER = struct.Struct("<cI")  # frame kind, payload length
_EVENTS, _FLUSH, _CLOSE = b"E", b"F", b"C"


class SinkHostError(HiCacheError, RuntimeError):
    """The sink host process failed to start, answer or stay alive."""


def _check_specs(sinks: Any) -> list[dict[str, Any]]:
    if not isinstance(sinks, (list, tuple)) or not sinks:
        raise ConfigError(f"a sink host needs a non-empty list of sink specs, got {sinks!r}")
    out = []
    seen: set[str] = set()
    for i, spec in enumerate(sinks):
        if not isinstance(spec, dict) or not isinstance(spec.get("sink"), str):
            raise ConfigError(f"sink spec {i} must be a dict with a 'sink' name, got {spec!r}")
        kind = spec["sink"]
        if kind not in SINK_KINDS:
            raise ConfigError(f"sink spec {i}: unknown sink {kind!r}; known: {', '.join(SINK_KINDS)}")
        if kind in seen:
            raise ConfigError(f"sink spec {i}: a host runs one {kind!r} sink, given twice")
        seen.add(kind)
        extra = set(spec) - {"sink"} - SINK_KINDS[kind]
        if extra:
            raise ConfigError(
                f"sink spec {i} ({kind}): unknown keys {sorted(extra)}; it takes {sorted(SINK_KINDS[kind])}"
            )
        if kind == "jsonl" and not isinstance(spec.get("dir"), str):
            raise ConfigError(f"sink spec {i} (jsonl): 'dir' must be a path string, got {spec.get('dir')!r}")
        if kind == "otel" and spec.get("exporter", "otlp") not in ("otlp", "memory"):
            raise ConfigError(f"sink spec {i} (otel): exporter must be 'otlp' or 'memory', got {spec['exporter']!r}")
        try:
            json.dumps(spec)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"sink spec {i} ({kind}) is not JSON-able: {exc}") from None
        out.append(dict(spec))
    return out


class SinkHost:
    """A batch sink that forwards every batch to sinks running in a child process.

    Two ways to feed it: :func:`add_sink_host` attaches it to a log through a
    :class:`HostFeeder` (batches handed over from the producer's thread, written to the
    pipe without waiting); ``log.add_sink(host)`` runs it behind a
    :class:`~hicache_obs.events.sinks.SinkRunner` thread instead (``handle_batch`` waits
    for room in the pipe).
    """

    name = "sinkhost"

    def __init__(
        self,
        sinks: list[dict[str, Any]],
        *,
        start_timeout: float = 30.0,
        reply_timeout: float = 10.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.specs = _check_specs(sinks)
        self.reply_timeout = reply_timeout
        self.stats: dict[str, Any] = {}
        self.closed = False
        self._token = 0
        self._buf = b""
        self._encode_into = msgspec.msgpack.Encoder().encode_into
        self._code: int | None = None
        # frames not fully written to the child yet, oldest first: [what is left of it,
        # events in it, begun]; a frame is written whole before the next one starts
        self._frames: deque[list[Any]] = deque()
        self._frames_queued = 0  # frames ever queued; the n-th is written once _frames_written >= n
        self._frames_written = 0
        #: events in queued frames, in frames fully written to the pipe, in frames
        #: dropped before they were written (to make room, or because the child is gone)
        self.queued_events = 0
        self.sent_events = 0
        self.discarded_events = 0
        _reap_finished()
        # the child's stdin (batches and commands) and fd 3 (replies); no shell, a fixed
        # argv, and no other descriptor of this process (Python's are not inheritable)
        in_r, in_w = os.pipe()
        rep_r, rep_w = os.pipe()
        argv = [sys.executable, "-m", "hicache_obs.exporters.sinkhost", "--reply-fd", "3", json.dumps(self.specs)]
        try:
            self.pid = os.posix_spawn(
                sys.executable,
                argv,
                os.environ if env is None else env,
                file_actions=[(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, rep_w, 3)],
            )
        except BaseException:
            for fd in (in_w, rep_r):
                os.close(fd)
            raise
        finally:
            for fd in (in_r, rep_w):
                os.close(fd)
        # writes never block: what the pipe does not take stays queued (see _pump)
        os.set_blocking(in_w, False)
        with contextlib.suppress(OSError):  # a larger pipe holds more of a burst; the default works too
            fcntl.fcntl(in_w, _F_SETPIPE_SZ, PIPE_BYTES)
        self.out_fd = in_w
        self._writable = select.poll()
        self._writable.register(in_w, select.POLLOUT)
        self._reply_fd = rep_r
        # _wlock: the frame queue and the pipe (held briefly); _rlock: one request and its
        # reply at a time (flush, close), which must not hold up the frames of the producer
        self._wlock = threading.Lock()
        self._rlock = threading.Lock()
        try:
            ready = self._reply(time.monotonic() + start_timeout)
            if "error" in ready:
                raise ConfigError(f"sink host could not start its sinks: {ready['error']}")
        except BaseException:
            self._kill()
            os.close(self.out_fd)
            os.close(self._reply_fd)
            raise
        self.metrics_port: int | None = ready.get("prometheus_port")

    # ------------------------------------------------------------ sink API
    def handle_batch(self, events: list[Any]) -> None:
        """Send a batch, waiting for room in the pipe as long as it takes (a runner thread's call)."""
        frame = self.encode(events)
        with self._wlock:
            n = self._queue(frame, len(events))
            self._pump()
        self._wait_written(n, None)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the child handled everything sent so far and flushed its sinks.

        ``timeout`` (default ``reply_timeout``) bounds the whole call: a child that does
        not take the frames or answer in time is a :class:`SinkHostError`.
        """
        deadline = time.monotonic() + (self.reply_timeout if timeout is None else timeout)
        with self._rlock:
            self._token += 1
            self._request(_FLUSH, str(self._token).encode(), deadline)
            while True:
                reply = self._reply(deadline)
                if reply.get("flushed") == self._token:
                    self.stats = reply["stats"]
                    return

    def close(self, timeout: float | None = None) -> None:
        """Close the child's sinks (each flushes first); returns once they are closed.

        The child then exits on its own (it only calls ``os._exit`` after its reply);
        :meth:`wait` waits for that, and a later host (or :meth:`wait`) reaps it. Not
        waiting here keeps the process teardown (a few ms) out of the caller's close.
        ``timeout`` (default ``reply_timeout``) bounds the call; frames still queued when
        it fails are counted in :attr:`discarded_events`.
        """
        deadline = time.monotonic() + (self.reply_timeout if timeout is None else timeout)
        with self._rlock:
            if self.closed:
                return
            self.closed = True
            try:
                self._request(_CLOSE, b"", deadline)
                while True:
                    reply = self._reply(deadline)
                    if reply.get("closed"):
                        self.stats = reply["stats"]
                        break
            except SinkHostError as exc:
                self._kill()
                with self._wlock:  # the child is gone, with everything still queued for it
                    self._discard(0, begun_too=True)
                raise SinkHostError(f"sink host pid {self.pid} did not close cleanly: {exc}") from None
            finally:
                with self._wlock:
                    os.close(self.out_fd)
                    self.out_fd = -1
                os.close(self._reply_fd)
                if self.returncode is None:
                    _UNREAPED.add(self)

    # ------------------------------------------------------- feeder's calls
    def encode(self, events: list[Any]) -> bytearray:
        """One events frame: the header, then the batch as msgpack (encoded in place)."""
        frame = bytearray(_HEADER.size)
        self._encode_into(events, frame, _HEADER.size)
        _HEADER.pack_into(frame, 0, _EVENTS, len(frame) - _HEADER.size)
        return frame

    def push(self, frame: bytearray, events: int, keep: int, block_until: float | None) -> None:
        """Queue an encoded frame of ``events`` events and write what the pipe takes now.

        With more than ``keep`` events still queued, wait for the pipe until
        ``block_until`` (monotonic; ``None``: do not wait), then drop the oldest frames
        not begun until ``keep`` are left (counted in :attr:`discarded_events`).
        :class:`SinkHostError` when the child is gone (every queued frame then counts
        as discarded).
        """
        with self._wlock:
            if self.closed:
                self.discarded_events += events
                raise SinkHostError(f"sink host pid {self.pid} is closed")
            self._queue(frame, events)
            self._pump()
            if self.queued_events > keep and block_until is not None:
                while self.queued_events > keep:
                    left = block_until - time.monotonic()
                    if left <= 0:
                        break
                    self._writable.poll(max(1, int(left * 1000)))
                    self._pump()
            if self.queued_events > keep:
                self._discard(keep)

    def pump(self) -> None:
        """Write what the pipe takes of the queued frames, without waiting."""
        with self._wlock:
            if self.out_fd >= 0:
                self._pump()

    # ------------------------------------------------------------ plumbing
    def _queue(self, frame: bytes | bytearray, events: int) -> int:
        """Append a frame (the caller holds _wlock); its number, for _wait_written."""
        self._frames.append([memoryview(frame), events, False])
        self.queued_events += events
        self._frames_queued += 1
        return self._frames_queued

    def _pump(self) -> None:
        """Write queued frames, oldest first, until the pipe is full (the caller holds _wlock)."""
        frames = self._frames
        while frames:
            frame = frames[0]
            try:
                n = os.write(self.out_fd, frame[0])
            except BlockingIOError:
                return
            except OSError as exc:  # BrokenPipeError: the child is gone, and what is queued with it
                self._discard(0, begun_too=True)
                raise SinkHostError(f"sink host pid {self.pid} is gone (exit code {self.returncode}): {exc}") from None
            if n < len(frame[0]):
                frame[0] = frame[0][n:]
                frame[2] = True
                return
            frames.popleft()
            self.queued_events -= frame[1]
            self.sent_events += frame[1]
            self._frames_written += 1

    def _discard(self, keep: int, *, begun_too: bool = False) -> None:
        """Drop the oldest event frames not begun until at most ``keep`` events are queued
        (``begun_too``: every frame, a child that is gone). The caller holds _wlock."""
        kept: deque[list[Any]] = deque()
        for frame in self._frames:
            if begun_too or (self.queued_events > keep and frame[1] and not frame[2]):
                self.queued_events -= frame[1]
                self.discarded_events += frame[1]
                self._frames_written += 1  # settled: nobody waits for it any more
            else:
                kept.append(frame)
        self._frames = kept

    def _wait_written(self, n: int, deadline: float | None) -> None:
        """Wait until frame ``n`` left the queue, writing as the pipe takes it (not holding _wlock while waiting)."""
        while True:
            with self._wlock:
                if self._frames_written >= n:
                    return
                if self.out_fd < 0:
                    raise SinkHostError(f"sink host pid {self.pid} is closed")
                self._pump()
                if self._frames_written >= n:
                    return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise SinkHostError(f"sink host pid {self.pid} did not take its input in time")
            self._writable.poll(None if left is None else max(1, int(left * 1000)))

    def _request(self, kind: bytes, payload: bytes, deadline: float) -> None:
        with self._wlock:
            if self.out_fd < 0:
                raise SinkHostError(f"sink host pid {self.pid} is closed")
            n = self._queue(_HEADER.pack(kind, len(payload)) + payload, 0)
            self._pump()
        self._wait_written(n, deadline)

    def _reply(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SinkHostError(f"sink host pid {self.pid} did not answer in time")
            ready, _, _ = select.select([self._reply_fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._reply_fd, 65536)
            if not chunk:
                code = self.wait(1.0)
                raise SinkHostError(f"sink host pid {self.pid} exited with code {code}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the child to exit; its exit code (``None`` if it still runs at ``timeout``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.002)
        return self._code

    @property
    def returncode(self) -> int | None:
        """The child's exit code (negative: the signal that ended it), ``None`` while it runs."""
        if self._code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._code = os.waitstatus_to_exitcode(status)
                _UNREAPED.discard(self)
        return self._code

    def _kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.wait()


class HostFeeder:
    """Feeds a :class:`SinkHost` from the producer's own thread (``EventLog.attach_feeder``).

    The log hands it every ``batch`` events (or what waits, ``interval`` seconds after the
    last hand-off) while the producer emits; :meth:`take` encodes them into one frame and
    writes what the pipe takes without waiting. No worker thread runs while the controller works, so the
    controller never waits for the GIL to come back from one. A watcher thread sleeps
    without the GIL in ``_wait_handoff`` and acts only when the producer is idle with
    events waiting, or when frames wait for room in the pipe.

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
        except BaseException:
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        with log._lock:
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
        with self.log._lock:
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
        log, host = self.log, self.sink
        try:
            while True:
                out = host.out_fd if host.queued_events else -1
                code = log._wait_handoff(1.0, self._wake_r, out)
                if code == 3:  # woken: close, or frames left queued (watched from the next wait on)
                    os.read(self._wake_r, 4096)
                    self._kicked = False
                    if self._closed:
                        return
                elif code == 1:  # the producer went idle with events waiting
                    with log._lock:
                        if not self._closed:
                            log._handoff_now()
                elif code == 2:  # room in the pipe for what waits
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
        with self.log._lock:
            if self._closed:  # close flushed everything the feeder was offered
                return True
            self.log._handoff_now()
        try:
            self.sink.flush(timeout)
        except SinkHostError as exc:
            self._failed("flush", exc, 0)
            return False
        return True

    def close(self, timeout: float | None = 10.0) -> None:
        """Hand over what is published, close the child's sinks (they flush first) and stop."""
        log = self.log
        with log._lock:
            if self._closed:
                return
            log._handoff_now()
            log.detach_feeder(self)
            self._closed = True
            self._stopped_at = log.published
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


#: Hosts closed before their child had exited; reaped when the next host starts.
_UNREAPED: set[SinkHost] = set()


def _reap_finished() -> None:
    for host in list(_UNREAPED):
        _ = host.returncode  # reaps it when it has exited


def add_sink_host(
    log: Any, sinks: list[dict[str, Any]], *, batch: int = 256, interval: float = 0.05, **host_options: Any
) -> HostFeeder:
    """Start a :class:`SinkHost` and feed it from ``log`` (a :class:`HostFeeder`); returns the feeder.

    ``batch`` / ``interval``: the log hands events over once that many wait, or once
    that long passed since the last hand-off. The feeder makes the producer wait (up to
    its ``block_timeout``) rather than drop when the host holds a durable store, as
    :func:`~hicache_obs.events.store.open_store` does, and is closed at exit then.
    """
    specs = _check_specs(sinks)
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


# ------------------------------------------------------------------ child side
def _build(specs: list[dict[str, Any]]) -> tuple[list[Any], dict[str, Any], list[Any]]:
    """The child's sinks in handling order (spans before lines), its ready reply, closers."""
    from hicache_obs._files import FILE_MODE, make_dirs

    sinks: list[Any] = []
    ready: dict[str, Any] = {"ready": True}
    closers: list[Any] = []
    by_kind = {s["sink"]: s for s in specs}
    otel = None
    if "otel" in by_kind:
        from .otel import OtelSpanSink

        s = by_kind["otel"]
        exporter: Any = None
        if s.get("exporter") == "memory":
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

            exporter = InMemorySpanExporter()
        elif s.get("endpoint"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=s["endpoint"])
        otel = OtelSpanSink(service_name=s.get("service_name", "hicache-obs"), exporter=exporter)
        sinks.append(otel)
    if "prometheus" in by_kind:
        from .prometheus import DEFAULT_POOLS, PrometheusSink, start_metrics_server

        s = by_kind["prometheus"]
        prom = PrometheusSink(pools=s.get("pools", DEFAULT_POOLS))
        # the server lives as long as the process (its exit closes the socket)
        _server, port = start_metrics_server(prom.registry, s.get("port", 0), s.get("addr", "127.0.0.1"))
        ready["prometheus_port"] = port
        sinks.append(prom)
    if "structlog" in by_kind:
        from .structlog_sink import StructlogSink

        s = by_kind["structlog"]
        target = s.get("file", "-")
        if target == "-":
            fh = sys.stdout
        else:
            make_dirs(os.path.dirname(os.path.abspath(target)))
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
            fh = os.fdopen(fd, "a", encoding="utf-8")
            closers.append(fh.close)
        sinks.append(StructlogSink(file=fh, level=s.get("level", "info"), span_ids=otel))
    if "jsonl" in by_kind:
        from hicache_obs.events.store import JsonlStore

        s = by_kind["jsonl"]
        sinks.append(
            JsonlStore(
                s["dir"],
                rank=s.get("rank", 0),
                max_bytes=s.get("max_bytes", 64 << 20),
                fsync=bool(s.get("fsync", False)),
            )
        )
    return sinks, ready, closers


class _HostAudit:
    """The auditor in the host: its violations are inserted after the events that revealed them."""

    def __init__(self) -> None:
        from hicache_obs.events.audit import Auditor

        self.auditor = Auditor(emit=self._emit)
        self._out: list[Any] = []
        self._cur: Any = None
        self._finishing = False

    def _emit(self, cls: Any, **fields: Any) -> None:
        cur = self._cur  # the event that revealed it (the last one, at the end of the log)
        ts = time.time_ns() if self._finishing else cur.ts_ns
        self._out.append(cls(seq=cur.seq, ts_ns=ts, rank=cur.rank, **fields))

    def run(self, batch: list[Any]) -> list[Any]:
        out = self._out = []
        handle = self.auditor.handle
        for ev in batch:
            out.append(ev)
            self._cur = ev
            handle(ev)
        return out

    def finish(self) -> list[Any]:
        self._out = []
        if self._cur is not None:
            self._finishing = True
            self.auditor.finish()
        return self._out


def _feed(sinks: list[Any], batch: list[Any], audited: list[Any], errors: dict[str, int]) -> None:
    """Stores get ``batch`` (the log's own events); the other sinks ``audited`` (with violations)."""
    for s in sinks:
        events = batch if getattr(s, "paths", None) is not None else audited
        if not events:
            continue
        try:
            s.handle_batch(events)
        except Exception as exc:  # one sink failing must not stop the others
            errors[s.name] = errors.get(s.name, 0) + 1
            print(f"hicache sink host: sink {s.name} failed on a batch: {exc!r}", file=sys.stderr, flush=True)


_READY_CPU = [0.0]  # the child's process_time() when it said it was ready


def _stats(
    sinks: list[Any], events: int, batches: int, errors: dict[str, int], audit: _HostAudit | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"events": events, "batches": batches, "errors": dict(errors)}
    out["cpu_s"] = time.process_time() - _READY_CPU[0]  # the host's CPU time since it was ready
    if audit is not None:
        out["violations"] = audit.auditor.counts()
    for s in sinks:
        if hasattr(s, "spans_ended"):
            out["spans_ended"] = s.spans_ended
            out["spans_exported"] = s.spans_exported
            out["spans_dropped"] = s.spans_dropped
        if hasattr(s, "lines_written"):
            out["lines_written"] = s.lines_written
        if hasattr(s, "paths"):
            out["paths"] = [str(p) for p in s.paths]
    return out


def _read_exact(stream: Any, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def _call_all(sinks: list[Any], method: str, errors: dict[str, int], *args: Any) -> None:
    for s in sinks:
        try:
            getattr(s, method)(*args)
        except Exception as exc:  # one sink failing must not stop the others
            errors[s.name] = errors.get(s.name, 0) + 1
            print(f"hicache sink host: sink {s.name} failed to {method}: {exc!r}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache_obs.exporters.sinkhost")
    p.add_argument("--reply-fd", type=int, required=True)
    p.add_argument("specs")
    args = p.parse_args(argv)
    reply = os.fdopen(args.reply_fd, "wb", buffering=0)

    def say(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj).encode() + b"\n")

    try:
        specs = _check_specs(json.loads(args.specs))
        sinks, ready, closers = _build(specs)
        from hicache_obs.events.schema import AnyEvent

        audit = _HostAudit() if any(spec["sink"] == "audit" for spec in specs) else None
        decode = msgspec.msgpack.Decoder(list[AnyEvent]).decode  # type: ignore[valid-type]
    except Exception as exc:
        say({"error": f"{type(exc).__name__}: {exc}"})
        return 2
    # all set-up done before the parent hears "ready": none of it runs beside its work
    gc.collect()
    gc.freeze()  # what start-up built stays: later collections skip it
    _READY_CPU[0] = time.process_time()
    say(ready)
    inp = sys.stdin.buffer
    events = batches = 0
    errors: dict[str, int] = {}
    while True:
        header = _read_exact(inp, _HEADER.size)
        if len(header) < _HEADER.size:  # the parent went away: close what we have
            if audit is not None:
                _feed(sinks, [], audit.finish(), errors)
            _call_all(sinks, "close", errors)
            break
        kind, n = _HEADER.unpack(header)
        payload = _read_exact(inp, n)
        if kind == _EVENTS:
            batch = decode(payload)
            events += len(batch)
            batches += 1
            _feed(sinks, batch, audit.run(batch) if audit is not None else batch, errors)
        elif kind == _FLUSH:
            _call_all(sinks, "flush", errors)
            say({"flushed": int(payload), "stats": _stats(sinks, events, batches, errors, audit)})
        elif kind == _CLOSE:
            if audit is not None:  # end of the log: ops submitted and never finished
                _feed(sinks, [], audit.finish(), errors)
            _call_all(sinks, "close", errors)
            for fn in closers:
                fn()
            sys.stdout.flush()
            say({"closed": True, "stats": _stats(sinks, events, batches, errors, audit)})
            break
        else:
            print(f"hicache sink host: unknown frame {kind!r}; stopping", file=sys.stderr, flush=True)
            return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # every sink is closed: skip the interpreter's teardown


if __name__ == "__main__":
    sys.exit(main())
