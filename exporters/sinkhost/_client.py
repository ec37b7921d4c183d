"""The parent's side of a sink host: :class:`SinkHost`, the child process and the pipe to it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import sys
import threading
import time
from collections import deque
from typing import Any

import msgspec

from hicache_obs.errors import ConfigError, HiCacheError

from ._specs import check_specs
from ._wire import CLOSE, EVENTS, F_SETPIPE_SZ, FLUSH, HEADER, PIPE_BYTES

__all__ = ["SinkHost", "SinkHostError"]

class SinkHostError(HiCacheError, RuntimeError):
    """The sink host process failed to start, answer or stay alive."""


class SinkHost:
    """A batch sink that forwards every batch to sinks running in a child process.

    Two ways to feed it: :func:`add_sink_host` attaches it to a log through a
    :class:`HostFeeder` (batches handed over from the producer's thread, written to the
    pipe without waiting); ``log.add_sink(host)`` runs it behind a
    :class:`~hicache_obs.events._sinks.SinkRunner` thread instead (``handle_batch`` waits
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
        self.specs = check_specs(sinks)
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
        # the child's stdin (batches and commands), fd 3 (replies) and fd 4 (a byte there wakes
        # it: it reads stdin on a timer, so a batch written costs no wake-up); no shell, a
        # fixed argv, and no other descriptor of this process (Python's are not inheritable)
        fds: list[int] = []
        try:
            for _ in range(3):
                fds.extend(os.pipe())
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        in_r, in_w, rep_r, rep_w, wake_r, wake_w = fds
        argv = [sys.executable, "-m", "hicache_obs.exporters.sinkhost", "--reply-fd", "3", "--wake-fd", "4"]
        argv.append(json.dumps(self.specs))
        try:
            self.pid = os.posix_spawn(
                sys.executable,
                argv,
                os.environ if env is None else env,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, in_r, 0),
                    (os.POSIX_SPAWN_DUP2, rep_w, 3),
                    (os.POSIX_SPAWN_DUP2, wake_r, 4),
                ],
            )
        except BaseException:
            for fd in (in_w, rep_r, wake_w):
                os.close(fd)
            raise
        finally:
            for fd in (in_r, rep_w, wake_r):
                os.close(fd)
        os.set_blocking(wake_w, False)
        self._wake_fd = wake_w
        # writes never block: what the pipe does not take stays queued (see _pump)
        os.set_blocking(in_w, False)
        with contextlib.suppress(OSError):  # a larger pipe holds more of a burst; the default works too
            fcntl.fcntl(in_w, F_SETPIPE_SZ, PIPE_BYTES)
        self.out_fd = in_w
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
            for fd in (self.out_fd, self._reply_fd, self._wake_fd):
                os.close(fd)
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
            self._request(FLUSH, str(self._token).encode(), deadline)
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
                self._request(CLOSE, b"", deadline)
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
                    os.close(self._wake_fd)
                    self._wake_fd = -1
                os.close(self._reply_fd)
                if self.returncode is None:
                    _UNREAPED.add(self)

    # ------------------------------------------------------- feeder's calls
    def encode(self, events: list[Any]) -> bytearray:
        """One events frame: the header, then the batch as msgpack (encoded in place)."""
        frame = bytearray(HEADER.size)
        self._encode_into(events, frame, HEADER.size)
        HEADER.pack_into(frame, 0, EVENTS, len(frame) - HEADER.size)
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
                    self._wait_writable(left)
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
            except BlockingIOError:  # the pipe is full: the child reads it now, not at its next look
                self._ring()
                return
            except OSError as exc:  # BrokenPipeError: the child is gone, and what is queued with it
                self._discard(0, begun_too=True)
                raise SinkHostError(f"sink host pid {self.pid} is gone (exit code {self.returncode}): {exc}") from None
            if n < len(frame[0]):
                frame[0] = frame[0][n:]
                frame[2] = True
                self._ring()
                return
            frames.popleft()
            self.queued_events -= frame[1]
            self.sent_events += frame[1]
            self._frames_written += 1

    def _wait_writable(self, seconds: float | None) -> None:
        """Sleep until the pipe to the child takes more, at most ``seconds`` (None: no bound).
        A poll object of its own: a producer waiting in ``push`` and a flush waiting in
        ``_wait_written`` may both be here (one object polled from two threads is a
        ``RuntimeError``)."""
        fd = self.out_fd
        if fd < 0:
            return
        p = select.poll()
        p.register(fd, select.POLLOUT)
        p.poll(None if seconds is None else max(1, int(seconds * 1000)))

    def _ring(self) -> None:
        """Wake the child (it reads the frames' pipe at once). The caller holds _wlock."""
        if self._wake_fd >= 0:
            with contextlib.suppress(BlockingIOError, BrokenPipeError):  # a byte waits already / it is gone
                os.write(self._wake_fd, b"w")

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
            self._wait_writable(left)

    def _request(self, kind: bytes, payload: bytes, deadline: float) -> None:
        with self._wlock:
            if self.out_fd < 0:
                raise SinkHostError(f"sink host pid {self.pid} is closed")
            n = self._queue(HEADER.pack(kind, len(payload)) + payload, 0)
            self._pump()
        self._wait_written(n, deadline)
        with self._wlock:  # a request is answered at once, not at the child's next look
            self._ring()

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


#: Hosts closed before their child had exited; reaped when the next host starts.
_UNREAPED: set[SinkHost] = set()


def _reap_finished() -> None:
    for host in list(_UNREAPED):
        _ = host.returncode  # reaps it when it has exited
