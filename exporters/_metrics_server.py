"""The ``/metrics`` HTTP server: a registry served to scrapers, bounded whatever clients do.

:func:`start_metrics_server` serves a :class:`~prometheus_client.CollectorRegistry` (a
:class:`~hicache_obs.exporters._prometheus.PrometheusSink`'s ``registry``) at ``/metrics``,
on 127.0.0.1 unless told otherwise, port 0 taking a free one; stop it with
``server.stop()``. :class:`MetricsServer` says what slow, idle or hostile clients can cost.
"""

from __future__ import annotations

import contextlib
import io
import logging
import queue
import selectors
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

__all__ = ["MetricsServer", "start_metrics_server", "stop_metrics_server"]

_log = logging.getLogger("hicache_obs.exporters.metrics_server")

#: a request head (request line and headers) larger than this is refused with 431
MAX_REQUEST_HEAD = 64 * 1024


class _SocketWriter:
    """``wfile`` for the handler: every write is a ``sendall`` (no partial writes)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def write(self, data: bytes) -> int:
        self._sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _MetricsHandler(BaseHTTPRequestHandler):
    """One request whose head the server already read: ``request`` is ``(socket, head)``."""

    server: MetricsServer  # type: ignore[assignment]
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        sock, head = self.request
        self.connection = sock
        self.rfile = io.BytesIO(head)
        self.wfile = _SocketWriter(sock)  # type: ignore[assignment]

    def finish(self) -> None:
        self.rfile.close()

    def _respond(self, body: bool) -> None:
        path = urlsplit(self.path).path
        if path != "/metrics":
            self._plain(404, b"not found: only /metrics is served\n", body)
            return
        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        try:
            output = encoder(self.server.registry)
        except Exception as exc:  # a collector failed: tell the scraper, keep serving
            self._plain(500, f"error collecting metrics: {type(exc).__name__}: {exc}\n".encode(), body)
            return
        self._headers(200, content_type, len(output))
        if body:
            self.wfile.write(output)

    def _headers(self, code: int, content_type: str, length: int) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.send_header("Connection", "close")  # one request per connection: see MetricsServer
        self.close_connection = True
        self.end_headers()

    def _plain(self, code: int, text: bytes, body: bool) -> None:
        self._headers(code, "text/plain; charset=utf-8", len(text))
        if body:
            self.wfile.write(text)

    def do_GET(self) -> None:
        self._respond(True)

    def do_HEAD(self) -> None:
        self._respond(False)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: scrapes are not worth a line on stderr."""


class _Conn:
    __slots__ = ("head", "deadline")

    def __init__(self, deadline: float) -> None:
        self.head = bytearray()
        self.deadline = deadline


class MetricsServer:
    """Serves ``registry`` at ``/metrics`` (404 elsewhere), bounded whatever the clients do.

    One thread (``thread``, ``hicache-metrics``) accepts connections and reads request heads
    without blocking; a complete head goes to one of ``max_handlers`` worker threads
    (``hicache-metrics-N``), which answer it and close the connection (one request per
    connection, ``Connection: close``). So:

    - threads: ``1 + max_handlers``, however many clients connect;
    - a client that sends nothing, or half a request, holds a socket, not a thread, and is
      closed ``read_timeout`` seconds after it connected (``stats()["timed_out"]``); a worker
      writing to a client waits at most ``read_timeout`` per send;
    - open connections: at most ``max_connections``; one more closes the oldest that has not
      sent a whole request (``"evicted"``), so a scraper always gets in;
    - complete requests wait in a queue of ``max_pending``; beyond it they are answered 503
      at once (``"busy"``);
    - a head over ``MAX_REQUEST_HEAD`` bytes is answered 431 (``"too_large"``);
    - a client that goes away early (a reset, a broken pipe) is counted
      (``"client_errors"``), never a traceback on stderr.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        addr: str = "127.0.0.1",
        port: int = 0,
        *,
        read_timeout: float = 5.0,
        max_handlers: int = 4,
        max_connections: int = 256,
        max_pending: int = 64,
    ) -> None:
        from hicache_obs.errors import ConfigError

        if not (isinstance(read_timeout, (int, float)) and 0 < read_timeout < float("inf")):
            raise ConfigError(f"metrics server read_timeout must be a positive number of seconds, got {read_timeout!r}")
        for name, n in (("max_handlers", max_handlers), ("max_connections", max_connections), ("max_pending", max_pending)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"metrics server {name} must be an integer >= 1, got {n!r}")
        self.registry = registry
        self.read_timeout = float(read_timeout)
        self.max_handlers = max_handlers
        self.max_connections = max_connections
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((addr, port))
            self.socket.listen(128)
            self.socket.setblocking(False)
        except BaseException:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()
        self._jobs: queue.Queue[tuple[socket.socket, bytes] | None] = queue.Queue(max_pending)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._conns: dict[socket.socket, _Conn] = {}
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self._stopping = False
        self._stopped = False
        self._workers = [
            threading.Thread(target=self._work, name=f"hicache-metrics-{i}", daemon=True) for i in range(max_handlers)
        ]
        self.thread = threading.Thread(target=self.serve_forever, name="hicache-metrics", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        host = str(self.server_address[0])
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/metrics"

    def stats(self) -> dict[str, int]:
        """Connections ``accepted``, requests ``served``, and those closed without an answer
        or with an error answer: ``timed_out``, ``evicted``, ``busy``, ``too_large``,
        ``client_errors``; ``open`` connections now."""
        with self._counts_lock:
            out = {k: self._counts[k] for k in ("accepted", "served", "timed_out", "evicted", "busy", "too_large")}
            out["client_errors"] = self._counts["client_errors"]
            out["open"] = len(self._conns)
        return out

    def start(self) -> None:
        """Start the workers, then the acceptor thread."""
        self._start_workers()
        self.thread.start()

    def _start_workers(self) -> None:
        with self._counts_lock:
            for w in self._workers:
                if w.ident is None:
                    w.start()

    def _count(self, what: str) -> None:
        with self._counts_lock:
            self._counts[what] += 1

    # ------------------------------------------------------- the acceptor
    def serve_forever(self, poll_interval: float = 0.1) -> None:
        """Accept and read request heads until :meth:`stop` (runs on ``thread``)."""
        self._start_workers()
        sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stopping:
                now = time.monotonic()
                first = min((c.deadline for c in self._conns.values()), default=now + poll_interval)
                for key, _ in sel.select(max(0.0, min(poll_interval, first - now))):
                    sock = key.fileobj
                    if sock is self.socket:
                        self._accept(sel)
                    elif sock is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._read(sel, sock)  # type: ignore[arg-type]
                now = time.monotonic()
                for sock in [s for s, c in self._conns.items() if c.deadline <= now]:
                    self._count("timed_out")
                    self._drop(sel, sock)
        finally:
            for sock in list(self._conns):
                self._drop(sel, sock)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                sock, _ = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of descriptors: the client waits in the backlog
                return
            sock.setblocking(False)
            oldest = None
            with self._counts_lock:  # one step for stats(): accepted, evicted and open agree
                self._counts["accepted"] += 1
                if len(self._conns) >= self.max_connections:
                    self._counts["evicted"] += 1
                    oldest = next(iter(self._conns))  # the oldest, still sending its head
                    del self._conns[oldest]
                self._conns[sock] = _Conn(time.monotonic() + self.read_timeout)
            if oldest is not None:
                self._drop(sel, oldest)
            sel.register(sock, selectors.EVENT_READ)

    def _read(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        conn = self._conns.get(sock)
        if conn is None:
            return
        try:
            data = sock.recv(MAX_REQUEST_HEAD + 1 - len(conn.head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._count("client_errors")
            self._drop(sel, sock)
            return
        if not data:  # the client went away before it finished a request
            self._drop(sel, sock)
            return
        head = conn.head
        head += data
        if head.startswith((b"\r\n", b"\n")) or b"\r\n\r\n" in head or b"\n\n" in head:
            del self._conns[sock]
            sel.unregister(sock)
            try:
                self._jobs.put_nowait((sock, bytes(head)))
            except queue.Full:
                self._count("busy")
                self._reply_and_close(sock, b"503 Service Unavailable", b"busy: try again\n")
        elif len(head) > MAX_REQUEST_HEAD:
            del self._conns[sock]
            sel.unregister(sock)
            self._count("too_large")
            self._reply_and_close(sock, b"431 Request Header Fields Too Large", b"request head too large\n")

    @staticmethod
    def _reply_and_close(sock: socket.socket, status: bytes, text: bytes) -> None:
        """A short answer, sent without waiting (what does not fit the socket buffer is lost)."""
        msg = (
            b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: " + str(len(text)).encode() + b"\r\nConnection: close\r\n\r\n" + text
        )
        with contextlib.suppress(OSError):
            sock.send(msg)
        with contextlib.suppress(OSError):
            sock.close()

    def _drop(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        self._conns.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            sel.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()

    # -------------------------------------------------------- the workers
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            sock, head = job
            try:
                sock.setblocking(True)
                sock.settimeout(self.read_timeout)  # a client that does not read holds a worker this long per send
                peer: Any = ("", 0)
                with contextlib.suppress(OSError):
                    peer = sock.getpeername()
                _MetricsHandler((sock, head), peer, self)  # type: ignore[arg-type]
                self._count("served")
            except OSError:  # reset, broken pipe, a send timed out: the client's doing
                self._count("client_errors")
            except Exception:  # pragma: no cover - the handler answers its own errors
                self._count("client_errors")
                _log.debug("metrics request failed", exc_info=True)
            finally:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
                with contextlib.suppress(OSError):
                    sock.close()

    # ----------------------------------------------------------- stopping
    def stop(self) -> None:
        """Stop serving and release the port; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self.thread.is_alive():
            self.thread.join(5)
        for w in self._workers:
            if w.is_alive():
                self._jobs.put(None)
        for w in self._workers:
            if w.is_alive():
                w.join(5)
        while True:  # requests that were waiting for a worker: closed unanswered
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                with contextlib.suppress(OSError):
                    job[0].close()
        for s in (self.socket, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()

    def shutdown(self) -> None:
        """Same as :meth:`stop` (the name ``socketserver`` servers use)."""
        self.stop()

    def server_close(self) -> None:
        """Same as :meth:`stop`."""
        self.stop()


def start_metrics_server(
    registry: CollectorRegistry,
    port: int = 0,
    addr: str = "127.0.0.1",
    *,
    read_timeout: float = 5.0,
    max_handlers: int = 4,
    max_connections: int = 256,
) -> tuple[MetricsServer, int]:
    """Serve ``registry`` at ``http://addr:port/metrics`` on daemon threads.

    Binds the loopback interface unless told otherwise; ``port=0`` takes a free
    port. ``read_timeout``, ``max_handlers``, ``max_connections``: see
    :class:`MetricsServer` (what slow or idle clients can cost). Returns
    ``(server, port)``; stop with ``server.stop()`` (or :func:`stop_metrics_server`).
    """
    server = MetricsServer(
        registry, addr, port, read_timeout=read_timeout, max_handlers=max_handlers, max_connections=max_connections
    )
    server.start()
    return server, server.port


def stop_metrics_server(server: MetricsServer) -> None:
    """Stop a server started by :func:`start_metrics_server`."""
    server.stop()
