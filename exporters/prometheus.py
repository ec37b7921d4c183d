"""Prometheus metrics computed from the event log, and a loopback ``/metrics`` server.

:class:`PrometheusSink` is a batch sink (``handle``, ``handle_batch``, ``flush``,
``close``): attach it with ``log.add_sink(sink)`` so it runs on the log's worker
thread, never on the controller's. It keeps plain counters and registers one
collector in a :class:`~prometheus_client.CollectorRegistry` (a fresh one unless
you pass yours; the global registry is never touched). The names, types and labels
are those of :mod:`hicache_obs.exporters.metric_names` (the stable set, plus
``hicache_evictions_total`` and ``hicache_evicted_slots_total``). Label children of the
known pools, directions, roles, tiers, statuses, audit rules and event types exist
from the start, so e.g. ``hicache_unrecorded_indices_total{pool="mamba",...}``
reads 0 instead of missing. ``hicache_events_dropped_total`` and
``hicache_exporter_errors_total`` are read at scrape time from the
:class:`~hicache_obs.events.sinks.SinkRunner`\\ s of the ``log`` you pass.

What counts where:

- ``operations_total{status="submitted"|"completed"|"failed"}``: ``TransferSubmitted`` /
  ``TransferCompleted`` / ``TransferFailed``; ``transfers_in_flight``: submitted, not
  finished;
- ``transfer_slots_total``/``transfer_bytes_total``: at completion, from the op's
  ``TransferSubmitted.slots_by_pool``/``bytes_by_pool`` (failed ops move nothing);
- ``transfer_duration_seconds``: ``TransferCompleted.duration_ns`` (device-event
  timing); when the runtime did not time it, completion minus submission;
- ``queue_wait_seconds``: submission minus the earliest ``OperationQueued`` of the
  ops merged into it;
- ``unrecorded_indices_total``: one per index tensor the auditor found used without
  ``record_stream`` (an ``AuditViolation`` with rule ``unrecorded_index``);
  ``audit_violations_total``: every ``AuditViolation``. Attach an
  :class:`~hicache_obs.events.audit.Auditor` to the log to get them.

Serve with :func:`start_metrics_server` (``/metrics`` only, 127.0.0.1 by default,
port 0 picks a free one) and stop with ``server.stop()``.

Several worker processes (one controller per rank): give each process its own
sink, registry and server, on its own port (e.g. ``base_port + rank``), and let
Prometheus scrape every port as a separate target. The ``instance`` label
Prometheus attaches (``host:port``) tells the ranks apart; aggregate with
``sum without (instance) (...)``. No label is added to the stable label sets and no
shared multiprocess directory is needed::

    sink = PrometheusSink(log=controller.log)
    controller.log.add_sink(sink)
    server, port = start_metrics_server(sink.registry, port=9400 + rank)
"""

from __future__ import annotations

import bisect
import contextlib
import io
import logging
import queue
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler
from operator import itemgetter
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from hicache_obs.events.audit import RULES
from hicache_obs.events.lifecycle import NOT_OP_EVENTS, OpLifecycles
from hicache_obs.events.schema import (
    DIRECTIONS,
    EVENT_TYPES,
    ROLES,
    TIERS,
    AllocationFailed,
    AuditViolation,
    Event,
    IndicesMoved,
    PoolCreated,
    PoolsSampled,
    SlotsAllocated,
    SlotsFreed,
    StreamRecorded,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
    expanded,
)

from . import metric_names as m

_second = itemgetter(1)

__all__ = [
    "DEFAULT_POOLS",
    "DEFAULT_DURATION_BUCKETS",
    "DEFAULT_QUEUE_WAIT_BUCKETS",
    "PrometheusSink",
    "SinkStatsCollector",
    "MetricsServer",
    "start_metrics_server",
    "stop_metrics_server",
]

DEFAULT_POOLS = ("kv", "mamba", "swa")
#: transfer times: 10 us .. 10 s
DEFAULT_DURATION_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: queue waits: 1 us .. 10 s
DEFAULT_QUEUE_WAIT_BUCKETS = (
    1e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0, 10.0,
)  # fmt: skip

Labels = tuple[str, ...]

_log = logging.getLogger("hicache_obs.exporters.prometheus")


class _Histogram:
    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: above every bound
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for bound, n in zip(self.bounds, self.counts):
            acc += n
            out.append((_fmt_le(bound), acc))
        out.append(("+Inf", self.count))
        return out


def _fmt_le(bound: float) -> str:
    # the same spelling prometheus_client uses for `le`
    return repr(float(bound))


def _buckets(given: Sequence[float] | None, default: tuple[float, ...], what: str) -> tuple[float, ...]:
    from hicache_obs.errors import ConfigError

    b = tuple(float(x) for x in (given if given is not None else default))
    if not b or any(x != x or x in (float("inf"), float("-inf")) for x in b):
        raise ConfigError(f"{what} must be a non-empty list of finite bounds, got {given!r}")
    if list(b) != sorted(set(b)):
        raise ConfigError(f"{what} must be strictly increasing, got {given!r}")
    return b


class PrometheusSink:
    """Turns events into the project's Prometheus metrics (see module docstring).

    ``pools``: pools whose label children exist from the start (pools seen in
    ``PoolCreated`` are added as they appear). ``duration_buckets`` /
    ``queue_wait_buckets``: histogram upper bounds in seconds. ``log``: an
    :class:`~hicache_obs.events.log.EventLog` whose sinks' drop and error counts
    are exported (read at scrape time).
    """

    name = "prometheus"

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        pools: Iterable[str] = DEFAULT_POOLS,
        duration_buckets: Sequence[float] | None = None,
        queue_wait_buckets: Sequence[float] | None = None,
        log: Any = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.duration_buckets = _buckets(duration_buckets, DEFAULT_DURATION_BUCKETS, "duration_buckets")
        self.queue_wait_buckets = _buckets(queue_wait_buckets, DEFAULT_QUEUE_WAIT_BUCKETS, "queue_wait_buckets")
        self.log = log
        self._lock = threading.Lock()
        self._pools: list[str] = []
        self._values: dict[str, dict[Labels, float]] = {
            name: {} for name, (kind, _) in m.ALL_METRICS.items() if kind != m.HISTOGRAM
        }
        self._hists: dict[str, dict[Labels, _Histogram]] = {m.TRANSFER_DURATION_SECONDS: {}, m.QUEUE_WAIT_SECONDS: {}}
        # per rank, so that several ranks' events sum instead of overwriting each other
        self._capacity: dict[tuple[int, str, str], int] = {}
        self._used: dict[tuple[int, str, str], int] = {}
        # the ops (live, no detail): queue waits, durations, what completed ops moved, in flight
        self._ops = OpLifecycles(detail=False)
        self._closed = False
        self._pool_readers: list[tuple[int, Callable[[], Iterable[tuple[str, str, int, int]]]]] = []
        self.pool_read_errors = 0
        v = self._values
        for d in DIRECTIONS:
            for s in m.OPERATION_STATUSES:
                v[m.OPERATIONS_TOTAL][(d, s)] = 0
            self._hists[m.TRANSFER_DURATION_SECONDS][(d,)] = _Histogram(self.duration_buckets)
            self._hists[m.QUEUE_WAIT_SECONDS][(d,)] = _Histogram(self.queue_wait_buckets)
        for t in EVENT_TYPES:
            v[m.EVENTS_TOTAL][(t,)] = 0
        for rule in RULES:
            if rule == "incomplete_operation":
                v[m.AUDIT_VIOLATIONS_TOTAL][(rule, "*")] = 0
        v[m.AUDIT_SAMPLE_RATIO][()] = 1.0  # until a PoolsSampled says what the profile audits
        for p in pools:
            self._add_pool(p)
        self.collector = _SinkCollector(self)
        self.registry.register(self.collector)
        self.stats_collector: SinkStatsCollector | None = None
        if log is not None:
            self.stats_collector = SinkStatsCollector(log)
            self.registry.register(self.stats_collector)

    # ----------------------------------------------------------- label sets
    def _add_pool(self, pool: str) -> None:
        if pool in self._pools:
            return
        self._pools.append(pool)
        v = self._values
        for d in DIRECTIONS:
            v[m.TRANSFER_SLOTS_TOTAL].setdefault((pool, d), 0)
            v[m.TRANSFER_BYTES_TOTAL].setdefault((pool, d), 0)
        for role in ROLES:
            v[m.INDEX_MOVES_TOTAL].setdefault((pool, role), 0)
            v[m.STREAM_RECORDS_TOTAL].setdefault((pool, role), 0)
            for d in DIRECTIONS:
                v[m.UNRECORDED_INDICES_TOTAL].setdefault((pool, role, d), 0)
        for tier in TIERS:
            for name in (
                m.POOL_USED_SLOTS,
                m.POOL_CAPACITY_SLOTS,
                m.ALLOCATION_FAILURES_TOTAL,
                m.EVICTIONS_TOTAL,
                m.EVICTED_SLOTS_TOTAL,
            ):
                v[name].setdefault((pool, tier), 0)
        for rule in RULES:
            if rule != "incomplete_operation":
                v[m.AUDIT_VIOLATIONS_TOTAL].setdefault((rule, pool), 0)

    @property
    def pools(self) -> list[str]:
        return list(self._pools)

    def read_pools_from(self, read: Callable[[], Iterable[tuple[str, str, int, int]]], *, rank: int = 0) -> None:
        """Read rank ``rank``'s pool occupancy with ``read()`` at every scrape: ``(pool, tier,
        used, capacity)`` rows, such as
        :meth:`~hicache_obs.integrations.sglang.adapter.Instrumentation.pool_usage` of a
        controller instrumented with a profile that logs no allocation. A read that raises is
        counted in ``pool_read_errors``, and the values it last gave stay."""
        self._pool_readers.append((rank, read))

    def _read_pools(self) -> None:
        for rank, read in self._pool_readers:
            try:
                rows = list(read())
            except Exception:
                self.pool_read_errors += 1
                continue
            for pool, tier, used, capacity in rows:
                self._add_pool(pool)
                self._used[(rank, pool, tier)] = used
                self._capacity[(rank, pool, tier)] = capacity

    def _inc(self, name: str, labels: Labels, by: float = 1) -> None:
        d = self._values[name]
        d[labels] = d.get(labels, 0) + by

    # ----------------------------------------------------------- sink API
    def handle(self, event: Event) -> None:
        self.handle_batch([event])

    def handle_batch(self, events: list[Event]) -> None:
        with self._lock:
            # events as logged (an OpsSubmitted is one), by type in one pass
            by_type = self._values[m.EVENTS_TOTAL]
            for cls, n in Counter(map(type, events)).items():
                key = (cls.__name__,)
                by_type[key] = by_type.get(key, 0) + n
            events = expanded(events)  # an OpsSubmitted as the events it stands for
            used = self._used
            pools = self._pools
            apply = self._apply_other
            ev: Any
            for ev in events:
                cls = type(ev)
                if cls is SlotsAllocated:
                    k3 = (ev.rank, ev.pool, ev.tier)
                    used[k3] = used.get(k3, 0) + sum(map(_second, ev.indices))
                    if ev.pool not in pools:
                        self._add_pool(ev.pool)
                elif cls is SlotsFreed:
                    n = sum(map(_second, ev.indices))
                    k3 = (ev.rank, ev.pool, ev.tier)
                    used[k3] = used.get(k3, 0) - n
                    if ev.pool not in pools:
                        self._add_pool(ev.pool)
                    if ev.reason == "evict":
                        self._inc(m.EVICTIONS_TOTAL, (ev.pool, ev.tier))
                        self._inc(m.EVICTED_SLOTS_TOTAL, (ev.pool, ev.tier), n)
                else:
                    apply(ev)

    def flush(self) -> None:
        """Nothing to flush: values are read at scrape time."""

    def close(self) -> None:
        """Nothing to release: the registry keeps serving the last values."""
        self._closed = True

    def _apply_other(self, ev: Event) -> None:
        """Fold one event other than an allocation or a free, except for
        ``hicache_events_total`` (``handle_batch`` does those)."""
        cls = type(ev)
        if cls in NOT_OP_EVENTS:
            if cls is PoolsSampled:  # occupancy read from the allocators (profiles metrics, sampling)
                for pool, tier, used, capacity in ev.pools:  # type: ignore[attr-defined]
                    self._add_pool(pool)
                    self._capacity[(ev.rank, pool, tier)] = capacity
                    self._used[(ev.rank, pool, tier)] = used
                self._values[m.AUDIT_SAMPLE_RATIO][()] = ev.audit_sample  # type: ignore[attr-defined]
            elif isinstance(ev, PoolCreated):
                self._add_pool(ev.pool)
                k3 = (ev.rank, ev.pool, ev.tier)
                self._capacity[k3] = ev.capacity
                self._used[k3] = 0
            elif isinstance(ev, AllocationFailed):
                self._add_pool(ev.pool)
                self._inc(m.ALLOCATION_FAILURES_TOTAL, (ev.pool, ev.tier))
            return
        if isinstance(ev, IndicesMoved):
            self._add_pool(ev.pool)
            self._inc(m.INDEX_MOVES_TOTAL, (ev.pool, ev.role))
            return
        if isinstance(ev, StreamRecorded):
            self._add_pool(ev.pool)
            self._inc(m.STREAM_RECORDS_TOTAL, (ev.pool, ev.role))
            return
        if isinstance(ev, AuditViolation):
            self._inc(m.AUDIT_VIOLATIONS_TOTAL, (ev.rule, ev.pool))
            if ev.rule == "unrecorded_index":
                self._add_pool(ev.pool)
                self._inc(m.UNRECORDED_INDICES_TOTAL, (ev.pool, ev.role, ev.direction))
            return
        # queued, merged, submitted, finished: the op's lifecycle (moves, records and
        # violations change nothing the sink reads from it, so they are not folded)
        first = False
        if isinstance(ev, TransferSubmitted):  # counted once per op: a repeated submission waited no more
            before = self._ops.get(ev.rank, ev.op)
            first = before is None or before.submit is None
        got = self._ops.apply(ev)
        rec = got[1] if got is not None else None
        if isinstance(ev, TransferSubmitted):
            self._inc(m.OPERATIONS_TOTAL, (ev.direction, "submitted"))
            wait = rec.queue_wait_ns if rec is not None and first else None
            if wait is not None:
                self._observe(m.QUEUE_WAIT_SECONDS, ev.direction, wait / 1e9)
        elif isinstance(ev, TransferCompleted):
            self._inc(m.OPERATIONS_TOTAL, (ev.direction, "completed"))
            assert rec is not None  # a completion always finishes a record
            sub = rec.submit
            if sub is not None:  # what the op moved, as submitted
                for pool, n in sub.slots_by_pool:
                    self._add_pool(pool)
                    self._inc(m.TRANSFER_SLOTS_TOTAL, (pool, ev.direction), n)
                for pool, n in sub.bytes_by_pool:
                    self._inc(m.TRANSFER_BYTES_TOTAL, (pool, ev.direction), n)
            self._observe(m.TRANSFER_DURATION_SECONDS, ev.direction, (rec.duration_ns or 0) / 1e9)
        elif isinstance(ev, TransferFailed):
            self._inc(m.OPERATIONS_TOTAL, (ev.direction, "failed"))

    def _observe(self, name: str, direction: str, seconds: float) -> None:
        h = self._hists[name].get((direction,))
        if h is None:
            bounds = self.duration_buckets if name == m.TRANSFER_DURATION_SECONDS else self.queue_wait_buckets
            h = self._hists[name][(direction,)] = _Histogram(bounds)
        h.observe(seconds)

    # ------------------------------------------------------------ reading
    def snapshot(self) -> dict[str, dict[Labels, float]]:
        """Current values of the counters and gauges: ``{name: {label values: value}}``."""
        with self._lock:
            if self._pool_readers:
                self._read_pools()
            out = {name: dict(d) for name, d in self._values.items()}
            inflight = out[m.TRANSFERS_IN_FLIGHT]
            for d in DIRECTIONS:
                inflight[(d,)] = self._ops.in_flight_count(d)
            for name, per_rank in ((m.POOL_USED_SLOTS, self._used), (m.POOL_CAPACITY_SLOTS, self._capacity)):
                sums: dict[Labels, float] = {}
                for (_, pool, tier), n in per_rank.items():
                    sums[(pool, tier)] = sums.get((pool, tier), 0) + n
                out[name].update(sums)
            return out

    def _histograms(self) -> dict[str, dict[Labels, tuple[list[tuple[str, float]], float]]]:
        with self._lock:
            return {
                name: {labels: (h.buckets(), h.total) for labels, h in d.items()} for name, d in self._hists.items()
            }

    def families(self) -> list[Metric]:
        """The metric families as the collector yields them (sink-runner stats excluded)."""
        values = self.snapshot()
        hists = self._histograms()
        out: list[Metric] = []
        for name, (kind, labels) in m.ALL_METRICS.items():
            if name in (m.EVENTS_DROPPED_TOTAL, m.EXPORTER_ERRORS_TOTAL):
                continue
            doc = m.HELP[name]
            fam: Any
            if kind == m.HISTOGRAM:
                fam = HistogramMetricFamily(name, doc, labels=labels)
                for lv, (buckets, total) in sorted(hists[name].items()):
                    fam.add_metric(list(lv), buckets, total)
            else:
                fam = (CounterMetricFamily if kind == m.COUNTER else GaugeMetricFamily)(name, doc, labels=labels)
                for lv, value in sorted(values[name].items()):
                    fam.add_metric(list(lv), value)
            out.append(fam)
        return out


class _SinkCollector:
    """The registry's view of a :class:`PrometheusSink`."""

    def __init__(self, sink: PrometheusSink) -> None:
        self._sink = sink

    def collect(self) -> Iterator[Metric]:
        yield from self._sink.families()

    def describe(self) -> Iterator[Metric]:
        for name, (kind, labels) in m.ALL_METRICS.items():
            if name in (m.EVENTS_DROPPED_TOTAL, m.EXPORTER_ERRORS_TOTAL):
                continue
            cls: Any = {m.COUNTER: CounterMetricFamily, m.GAUGE: GaugeMetricFamily}.get(kind, HistogramMetricFamily)
            yield cls(name, m.HELP[name], labels=labels)


class SinkStatsCollector:
    """``hicache_events_dropped_total``/``hicache_exporter_errors_total`` per sink of a log.

    Reads ``log.sinks`` (each a :class:`~hicache_obs.events.sinks.SinkRunner` with
    ``name``, ``dropped``, ``errors``) at scrape time; runners with the same name are summed.
    A sink that loses data after it accepted it (an exporter whose endpoint is down)
    reports that through an optional ``delivery_stats()`` -> ``{"dropped": n, "errors": n}``
    (:class:`~hicache_obs.exporters.otel.OtelSpanSink`: spans it could not export), which
    is added to its runner's counts.
    """

    def __init__(self, log: Any) -> None:
        self.log = log

    def collect(self) -> Iterator[Metric]:
        dropped: dict[str, float] = {}
        errors: dict[str, float] = {}
        for runner in self.log.sinks:
            name = str(getattr(runner, "name", type(runner).__name__))
            d = getattr(runner, "dropped", 0)
            e = getattr(runner, "errors", 0)
            stats = getattr(getattr(runner, "sink", None), "delivery_stats", None)
            if callable(stats):
                try:
                    own = stats()
                    d += own.get("dropped", 0)
                    e += own.get("errors", 0)
                except Exception:  # a scrape never fails because of one sink
                    _log.exception("sink %s: delivery_stats() failed", name)
            dropped[name] = dropped.get(name, 0) + d
            errors[name] = errors.get(name, 0) + e
        d = CounterMetricFamily(m.EVENTS_DROPPED_TOTAL, m.HELP[m.EVENTS_DROPPED_TOTAL], labels=["sink"])
        e = CounterMetricFamily(m.EXPORTER_ERRORS_TOTAL, m.HELP[m.EXPORTER_ERRORS_TOTAL], labels=["sink"])
        for name in sorted(dropped):
            d.add_metric([name], dropped[name])
            e.add_metric([name], errors[name])
        yield d
        yield e

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(m.EVENTS_DROPPED_TOTAL, m.HELP[m.EVENTS_DROPPED_TOTAL], labels=["sink"])
        yield CounterMetricFamily(m.EXPORTER_ERRORS_TOTAL, m.HELP[m.EXPORTER_ERRORS_TOTAL], labels=["sink"])


# ------------------------------------------------------------------ server
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
