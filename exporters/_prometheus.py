"""Prometheus metrics computed from the event log.

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
:class:`~hicache_obs.events._sinks.SinkRunner`\\ s of the ``log`` you pass.

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
  :class:`~hicache_obs.events._audit.Auditor` to the log to get them.

Serve with :func:`~hicache_obs.exporters._metrics_server.start_metrics_server` (``/metrics``
only, 127.0.0.1 by default, port 0 picks a free one; importable from here too) and stop
with ``server.stop()``.

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
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from hicache_obs.events._audit import RULES
from hicache_obs.events._lifecycle import NOT_OP_EVENTS, OpLifecycles
from hicache_obs.events._schema import (
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
from ._metrics_server import MetricsServer, start_metrics_server, stop_metrics_server  # the server's own module

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
    :class:`~hicache_obs.events._log.EventLog` whose sinks' drop and error counts
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
        :meth:`~hicache_obs.integrations.sglang._adapter.Instrumentation.pool_usage` of a
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

    Reads ``log.sinks`` (each a :class:`~hicache_obs.events._sinks.SinkRunner` with
    ``name``, ``dropped``, ``errors``) at scrape time; runners with the same name are summed.
    A sink that loses data after it accepted it (an exporter whose endpoint is down)
    reports that through an optional ``delivery_stats()`` -> ``{"dropped": n, "errors": n}``
    (:class:`~hicache_obs.exporters._otel.OtelSpanSink`: spans it could not export), which
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

