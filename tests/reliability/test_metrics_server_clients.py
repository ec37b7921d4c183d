"""The /metrics server against idle, half-sent, flooding and vanishing clients (loopback only).

What is checked: the server's threads stay at ``1 + max_handlers`` however many clients
hold connections; a normal scrape succeeds while they do; idle and half-sent clients are
closed after ``read_timeout`` (they read EOF) and counted; beyond ``max_connections`` the
oldest unfinished connection is closed, counted; a client that resets the connection
before its answer is written costs a count, not a traceback on stderr.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from hicache_obs.errors import ConfigError
from hicache_obs.exporters._metrics_server import MetricsServer, start_metrics_server


def _registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("hicache_probe_total", "a metric to find in the exposition", registry=reg).inc()
    return reg


@contextlib.contextmanager
def _server(registry: CollectorRegistry | None = None, **options: object) -> Iterator[MetricsServer]:
    server, _ = start_metrics_server(registry or _registry(), **options)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


def _server_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hicache-metrics")]


def _scrape(port: int) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _wait_for(cond: object, what: str, limit: float = 20.0) -> None:
    """Poll ``cond()`` (a liveness bound, not a timing assertion: it only ends a hung test)."""
    deadline = time.monotonic() + limit
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.01)


def _reads_eof(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True  # closed with data unread on our side: also a close


def test_200_idle_and_100_half_sent_clients_hold_no_threads_and_a_scrape_gets_through() -> None:
    # read_timeout: longer than connecting 300 clients takes on a loaded machine (it took over
    # 1 s once), so that all 300 are open together when the scrape comes
    with _server(read_timeout=5.0, max_handlers=4, max_connections=400) as server:
        port = server.port
        assert len(_server_threads()) == 5  # the acceptor and 4 workers
        threads_before = threading.active_count()
        clients: list[socket.socket] = []
        try:
            for _ in range(200):  # connect and say nothing
                clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            for i in range(100):  # half a request: the head never ends
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * i)
                clients.append(s)
            _wait_for(lambda: server.stats()["accepted"] >= 300, "the server to accept 300 clients")
            assert server.stats()["open"] == 300
            # a normal scrape while all 300 are connected
            status, body = _scrape(port)
            assert status == 200 and b"hicache_probe_total 1.0" in body
            assert len(_server_threads()) == 5
            assert threading.active_count() == threads_before
            # each of them is closed by the server after read_timeout, and counted
            assert all(_reads_eof(s) for s in clients)
            _wait_for(lambda: server.stats()["open"] == 0, "the server to close the idle clients")
            st = server.stats()
            assert st["timed_out"] == 300 and st["served"] == 1 and st["client_errors"] == 0
            assert _scrape(port)[0] == 200
        finally:
            for s in clients:
                s.close()


def test_beyond_max_connections_the_oldest_unfinished_connection_is_closed() -> None:
    with _server(read_timeout=30.0, max_connections=50) as server:
        clients = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(120)]
        try:
            _wait_for(lambda: server.stats()["accepted"] == 120, "the server to accept 120 clients")
            st = server.stats()
            assert st["open"] == 50 and st["evicted"] == 70
            assert all(_reads_eof(s) for s in clients[:70])  # the 70 oldest, closed
            status, body = _scrape(server.port)  # one more: evicts one more, is served
            assert status == 200 and b"hicache_probe_total" in body
            assert server.stats()["evicted"] == 71 and len(_server_threads()) == 5
            assert _reads_eof(clients[70])  # the oldest of the 50 made room for the scrape
        finally:
            for s in clients:
                s.close()


class _Big:
    """A collector whose exposition takes a while to build: the reset arrives first."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("hicache_probe_big", "many samples", labels=["i"])
        for i in range(5_000):
            g.add_metric([f"{i:040d}"], float(i))
        yield g


def test_clients_that_reset_before_the_answer_cost_a_count_not_a_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    reg = CollectorRegistry()
    reg.register(_Big())  # type: ignore[arg-type]
    with _server(reg) as server:
        for _ in range(8):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # a reset, while the server builds or writes the answer
        _wait_for(lambda: server.stats()["client_errors"] + server.stats()["served"] == 8, "the 8 requests")
        assert server.stats()["client_errors"] >= 1
        status, body = _scrape(server.port)
        assert status == 200 and body.count(b"hicache_probe_big{") == 5_000
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err and "ConnectionReset" not in err, err
    assert err == "", err


def test_a_head_over_the_limit_is_answered_431_and_the_server_keeps_serving() -> None:
    with _server() as server, socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 70_000)
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 431 "), answer
        assert server.stats()["too_large"] == 1
        assert _scrape(server.port)[0] == 200


@pytest.mark.parametrize(
    ("option", "bad"),
    [("read_timeout", 0), ("read_timeout", float("inf")), ("read_timeout", "5"), ("max_handlers", 0),
     ("max_connections", True), ("max_pending", 1.5)],
)  # fmt: skip
def test_bad_limits_are_refused_by_name(option: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=f"{option} must be .*got {bad!r}"):
        MetricsServer(_registry(), **{option: bad})  # type: ignore[arg-type]
