"""OpenTelemetry spans: one per merged cache operation, live or from a replayed log.

:class:`OtelSpanSink` is a batch sink (``handle``, ``handle_batch``, ``flush``,
``close``) for ``log.add_sink``. Each merged operation becomes one span named
``hicache.write`` (d2h) or ``hicache.load`` (h2d), started at its
``TransferSubmitted`` and ended at its completion (submission + device-timed
duration when the runtime timed it, never after the observed completion; else the
observed ``TransferCompleted``/``TransferFailed``). Attributes (exactly these):

``hicache.op_id``, ``hicache.direction``, ``hicache.io_backend``, ``hicache.layout``,
``hicache.pools`` (list of str), ``hicache.slots`` (int, all pools), ``hicache.bytes``,
``hicache.node_count``, ``hicache.unrecorded_indices`` (int, always set, 0 when clean)
and ``hicache.unrecorded_pools`` (list of str); ``hicache.omitted_pools`` (list of str, empty
when clean): pools registered to move with the op's slots that it left out (``pool_omitted``).

Span events: ``hicache.indices_moved`` per ``IndicesMoved`` (the moves happen just
before submission, so these events may precede the span's start),
``hicache.stream_recorded`` per ``StreamRecorded`` and ``hicache.audit_violation``
per ``AuditViolation`` of the op. Status ERROR, with a description, when the op
failed or the auditor reported a violation for it.

The spans follow the live op lifecycle (:class:`~hicache_obs.events._lifecycle.OpLifecycles`),
and a span ends at its op's completion or failure, in the batch that holds it: in an
audited log every ``AuditViolation`` of an op comes before the event that revealed it
(the live auditor is a stage of the log; the sink host and ``export`` feed
:func:`~hicache_obs.events._audit.audited`), so the span's verdict is known by then.
Violations given after their op's span ended (a hand-made event list in another
order: feed it through ``audited()``) are counted in :attr:`OtelSpanSink.late_violations`.

With ``tracer_provider=None`` the sink builds its own SDK ``TracerProvider`` with
a ``BatchSpanProcessor`` and an OTLP/HTTP exporter configured by the standard
``OTEL_EXPORTER_OTLP_*`` / ``OTEL_BSP_*`` / ``OTEL_SERVICE_NAME`` /
``OTEL_RESOURCE_ATTRIBUTES`` environment variables, and shuts it down on
``close()``. The global provider is never set.

Delivery failures are counted, never silent: with its own provider the sink wraps
the span exporter, so every batch the endpoint refused, timed out on or that
raised adds its spans to ``spans_dropped`` and one to ``export_errors``
(``spans_exported`` counts the delivered ones); spans the SDK's queue lost
(overflow, or still queued at shutdown) are added to ``spans_dropped`` on
``close()``. :meth:`OtelSpanSink.delivery_stats` gives both, and the Prometheus
exporter reports them as ``hicache_events_dropped_total{sink="otel"}`` and
``hicache_exporter_errors_total{sink="otel"}`` (next to what the sink's runner
dropped). ``flush()`` and ``close()`` are bounded: exports that would start after
``flush_timeout_s`` fail at once (counted), and on ``close()`` the exporter is
shut down at that deadline so no retry backoff outlives it; one export already on
the wire still runs to its own timeout (``export_timeout_s``, else
``OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT``, 10 s by default).

:meth:`OtelSpanSink.span_ids` gives the (hex) trace and span id of an op's span,
for log correlation (:class:`~hicache_obs.exporters._structlog_sink.StructlogSink`).
:func:`otlp_json` renders a replayed log as an OTLP/JSON
``ExportTraceServiceRequest`` (``hicache-obs export --otlp-json``), with
deterministic ids.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from hicache_obs.events._lifecycle import NOT_OP_EVENTS, OpKey, OpLifecycles, OpRecord, Step
from hicache_obs.events._schema import (
    AuditViolation,
    Event,
    IndicesMoved,
    StreamRecorded,
    expanded,
)

__all__ = [
    "SPAN_ATTRIBUTES",
    "INSTRUMENTATION_NAME",
    "OtelSpanSink",
    "make_tracer_provider",
    "span_attributes",
    "otlp_json",
]

INSTRUMENTATION_NAME = "hicache_obs.exporters.otel"

#: The attribute keys every span carries (a stable set: dashboards and queries use them).
SPAN_ATTRIBUTES = (
    "hicache.op_id",
    "hicache.direction",
    "hicache.io_backend",
    "hicache.layout",
    "hicache.pools",
    "hicache.slots",
    "hicache.bytes",
    "hicache.node_count",
    "hicache.unrecorded_indices",
    "hicache.unrecorded_pools",
    "hicache.omitted_pools",
)

_INCOMPLETE = "incomplete_operation: submitted but never completed or failed"

_log = logging.getLogger("hicache_obs.exporters.otel")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("hicache-obs")
    except Exception:
        return "0"


def make_tracer_provider(service_name: str = "hicache-obs", exporter: Any = None) -> Any:
    """An SDK ``TracerProvider`` exporting through a ``BatchSpanProcessor``.

    ``exporter`` defaults to an OTLP/HTTP ``OTLPSpanExporter`` configured from the
    ``OTEL_EXPORTER_OTLP_*`` environment. ``OTEL_SERVICE_NAME``, when set, wins over
    the default ``service_name``. The provider is returned, never made global.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    attrs: dict[str, Any] = {}
    if not (service_name == "hicache-obs" and os.environ.get("OTEL_SERVICE_NAME")):
        attrs["service.name"] = service_name
    provider = TracerProvider(resource=Resource.create(attrs))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def span_attributes(rec: OpRecord) -> dict[str, Any]:
    """The span attributes of an operation (all of :data:`SPAN_ATTRIBUTES`)."""
    return {
        "hicache.op_id": rec.op,
        "hicache.direction": rec.direction,
        "hicache.io_backend": rec.io_backend,
        "hicache.layout": rec.layout,
        "hicache.pools": list(rec.pools),
        "hicache.slots": rec.slots,
        "hicache.bytes": rec.bytes,
        "hicache.node_count": rec.node_count,
        "hicache.unrecorded_indices": rec.unrecorded_indices,
        "hicache.unrecorded_pools": list(rec.unrecorded_pools),
        "hicache.omitted_pools": list(rec.omitted_pools),
    }


def _span_event(ev: Event) -> tuple[str, dict[str, Any]] | None:
    if isinstance(ev, IndicesMoved):
        return "hicache.indices_moved", {
            "hicache.pool": ev.pool,
            "hicache.role": ev.role,
            "hicache.src_device": ev.src_device,
            "hicache.dst_device": ev.dst_device,
            "hicache.numel": ev.tensor.numel,
        }
    if isinstance(ev, StreamRecorded):
        return "hicache.stream_recorded", {
            "hicache.pool": ev.pool,
            "hicache.role": ev.role,
            "hicache.stream": ev.stream,
            "hicache.numel": ev.tensor.numel,
        }
    if isinstance(ev, AuditViolation):
        return "hicache.audit_violation", {
            "hicache.rule": ev.rule,
            "hicache.pool": ev.pool,
            "hicache.role": ev.role,
            "hicache.detail": ev.detail,
        }
    return None


class _CountingExporter:
    """Wraps a span exporter: counts delivered and failed spans, refuses exports past a deadline.

    A SpanExporter (``export``, ``shutdown``, ``force_flush``) for the SDK's batch
    processor. It never raises: an exporter that raises counts as a failed export.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.deadline: float | None = None  # time.monotonic(); exports starting later fail at once
        self.exported = 0  # spans delivered
        self.failed = 0  # spans in batches that failed (refused, timed out, raised, past the deadline)
        self.errors = 0  # failed export calls
        self._lock = threading.Lock()
        self._shut = False

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        n = len(spans)
        deadline = self.deadline
        if deadline is not None and time.monotonic() >= deadline:
            ok = False
        else:
            try:
                ok = self.inner.export(spans) == SpanExportResult.SUCCESS
            except Exception:
                _log.exception("span exporter %s raised on a batch of %d spans", type(self.inner).__name__, n)
                ok = False
        with self._lock:
            if ok:
                self.exported += n
            else:
                self.failed += n
                self.errors += 1
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def settled_counts(self) -> tuple[int, int]:
        """``(exported, failed)`` spans, read together under the lock ``export`` counts under."""
        with self._lock:
            return self.exported, self.failed

    def abort(self) -> None:
        """Shut the inner exporter down now: its retry backoff ends and later exports fail."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
        try:
            self.inner.shutdown()
        except Exception:
            _log.exception("span exporter %s failed to shut down", type(self.inner).__name__)

    def shutdown(self) -> None:
        self.abort()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        flush = getattr(self.inner, "force_flush", None)
        return bool(flush(timeout_millis)) if flush is not None else True


class OtelSpanSink:
    """Turns merged operations into OpenTelemetry spans (see module docstring).

    ``tracer_provider``: an SDK (or any API) ``TracerProvider``; None builds one
    from the ``OTEL_*`` environment (:func:`make_tracer_provider`), owned and shut
    down by this sink, whose export failures are counted (``spans_dropped``,
    ``export_errors``). ``exporter``: the span exporter of that own provider
    (default: OTLP/HTTP from the environment, with ``export_timeout_s`` seconds per
    request when given). ``flush_timeout_s``: the budget of ``flush()`` and of
    ``close()``. ``max_ids``: how many ops' span ids :meth:`span_ids` remembers.
    """

    name = "otel"

    def __init__(
        self,
        tracer_provider: Any = None,
        *,
        service_name: str = "hicache-obs",
        max_ids: int = 65536,
        flush_timeout_s: float = 5.0,
        exporter: Any = None,
        export_timeout_s: float | None = None,
    ) -> None:
        self._owns_provider = tracer_provider is None
        self._exporter: _CountingExporter | None = None
        if tracer_provider is None:
            if exporter is None:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                exporter = OTLPSpanExporter(timeout=export_timeout_s)
            self._exporter = _CountingExporter(exporter)
            self.provider = make_tracer_provider(service_name, exporter=self._exporter)
        else:
            self.provider = tracer_provider
        self.tracer = self.provider.get_tracer(INSTRUMENTATION_NAME, _version())
        self.max_ids = max_ids
        self.flush_timeout_s = flush_timeout_s
        self._lock = threading.Lock()
        self._ops = OpLifecycles()
        self.late_violations = 0  # violations of an op whose span had ended (or never started)
        self._spans: dict[OpKey, Span] = {}
        self._ids: OrderedDict[OpKey, tuple[int, int]] = OrderedDict()
        self._seen: dict[int, int] = {}  # rank -> highest seq handled
        self._last_ts: dict[int, int] = {}
        self._cv = threading.Condition()
        self.closed = False
        self.spans_started = 0
        self.spans_ended = 0
        self._lost_in_queue = 0

    # ------------------------------------------------------------ sink API
    def handle(self, event: Event) -> None:
        self.handle_batch([event])

    def handle_batch(self, events: list[Event]) -> None:
        events = expanded(events)  # an OpsSubmitted as the events it stands for
        with self._lock:
            apply = self._apply
            for ev in events:
                if type(ev) in NOT_OP_EVENTS:
                    continue  # allocations and frees touch no span
                apply(ev)
            last = {ev.rank: ev for ev in events}  # each rank's last event of the batch
            for rank, ev in last.items():
                self._last_ts[rank] = ev.ts_ns
        with self._cv:
            seen = self._seen
            for rank, ev in last.items():
                if ev.seq > seen.get(rank, -1):
                    seen[rank] = ev.seq
            self._cv.notify_all()

    def flush(self) -> None:
        """Flush the provider (within ``flush_timeout_s``): every ended span goes out."""
        flush = getattr(self.provider, "force_flush", None)
        if flush is None:
            return
        ex = self._exporter
        if ex is not None and ex.deadline is None:
            # the SDK's force_flush exports every queued batch and ignores its timeout
            ex.deadline = time.monotonic() + self.flush_timeout_s
            try:
                flush(int(self.flush_timeout_s * 1000))
            finally:
                ex.deadline = None
        else:
            flush(int(self.flush_timeout_s * 1000))

    def close(self) -> None:
        """End every span (ops never completed: status ERROR), and shut down an owned provider."""
        with self._lock:
            if self.closed:
                return
            for rec in self._ops.unfinished():
                self._end(rec, incomplete=True)
            self.closed = True
        with self._cv:
            self._cv.notify_all()
        if not self._owns_provider:
            flush = getattr(self.provider, "force_flush", None)
            if flush is not None:
                flush(int(self.flush_timeout_s * 1000))
            return
        ex = self._exporter
        assert ex is not None
        ex.deadline = time.monotonic() + self.flush_timeout_s
        # at the deadline the exporter is shut down: a retry backoff ends there
        timer = threading.Timer(self.flush_timeout_s, ex.abort)
        timer.daemon = True
        timer.start()
        try:
            self.provider.shutdown()
        finally:
            timer.cancel()
        exported, failed = ex.settled_counts()
        self._lost_in_queue = max(0, self.spans_ended - exported - failed)
        if self.spans_dropped:
            _log.warning(
                "otel: %d of %d spans not exported (%d failed exports)",
                self.spans_dropped,
                self.spans_ended,
                self.export_errors,
            )

    # ---------------------------------------------------------- delivery
    @property
    def spans_exported(self) -> int:
        """Spans the exporter delivered (own provider only; 0 otherwise)."""
        return self._exporter.exported if self._exporter is not None else 0

    @property
    def spans_dropped(self) -> int:
        """Spans that never reached the endpoint: failed exports, plus (after ``close()``) queue losses."""
        if self._exporter is None:
            return 0
        return self._exporter.failed + self._lost_in_queue

    @property
    def export_errors(self) -> int:
        """Failed export calls (refused, timed out, raised, or past the flush/close deadline)."""
        return self._exporter.errors if self._exporter is not None else 0

    def delivery_stats(self) -> dict[str, int]:
        """``{"dropped": spans_dropped, "errors": export_errors}``, read by the Prometheus exporter."""
        return {"dropped": self.spans_dropped, "errors": self.export_errors}

    # ---------------------------------------------------------- span ids
    def span_ids(self, op: int, rank: int = 0) -> tuple[str, str] | None:
        """``(trace_id, span_id)`` in hex of op's span, once its submission was handled."""
        with self._cv:
            ids = self._ids.get((rank, op))
        if ids is None:
            return None
        return format(ids[0], "032x"), format(ids[1], "016x")

    def seen_seq(self, rank: int = 0) -> int:
        """The highest ``seq`` of ``rank`` this sink has handled (-1: none)."""
        with self._cv:
            return self._seen.get(rank, -1)

    def wait_seen(self, seq: int, rank: int = 0, timeout: float = 1.0) -> bool:
        """Wait until this sink handled ``seq`` of ``rank`` (or closed); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._seen.get(rank, -1) < seq and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))
        return True

    # ----------------------------------------------------------- folding
    def _apply(self, ev: Event) -> None:
        """Fold one event into the spans (``handle_batch`` records what was seen, and when)."""
        got = self._ops.apply(ev)
        if got is None:
            return
        step, rec = got
        if rec is None:
            if step is Step.VIOLATION and ev.op >= 0:  # type: ignore[attr-defined]
                self.late_violations += 1
            return
        if step is Step.FINISHED:
            self._end(rec)
        elif step is Step.SUBMITTED:
            self._start(rec)
        elif step is Step.MOVED or step is Step.RECORDED or step is Step.VIOLATION:
            span = self._spans.get(rec.key)
            described = _span_event(ev) if span is not None else None
            if span is not None and described is not None:
                span.add_event(described[0], described[1], timestamp=ev.ts_ns)

    def _start(self, rec: OpRecord) -> None:
        sub = rec.submit
        assert sub is not None
        if rec.key in self._spans:  # a repeated submission of the same op: keep the first
            return
        span = self.tracer.start_span(
            rec.name,
            context=otel_context.Context(),  # a root span: never the thread's current span
            kind=SpanKind.INTERNAL,
            attributes=span_attributes(rec),
            start_time=sub.ts_ns,
        )
        self.spans_started += 1
        # what came before the submission, as the offline spans (otlp_json) have it
        for ev in sorted([*rec.moves, *rec.records, *rec.violations], key=_seq_of):
            described = _span_event(ev)
            if described is not None:
                span.add_event(described[0], described[1], timestamp=ev.ts_ns)
        self._spans[rec.key] = span
        sc = span.get_span_context()
        with self._cv:
            self._ids[rec.key] = (sc.trace_id, sc.span_id)
            while len(self._ids) > self.max_ids:
                self._ids.popitem(last=False)

    def _end(self, rec: OpRecord, *, incomplete: bool = False) -> None:
        span = self._spans.pop(rec.key, None)
        if span is None:
            return
        span.set_attribute("hicache.unrecorded_indices", rec.unrecorded_indices)
        span.set_attribute("hicache.unrecorded_pools", list(rec.unrecorded_pools))
        span.set_attribute("hicache.omitted_pools", list(rec.omitted_pools))
        desc = rec.error_description()
        if incomplete:
            desc = f"{_INCOMPLETE}; {desc}" if desc else _INCOMPLETE
        if desc:
            span.set_status(Status(StatusCode.ERROR, desc))
        start = rec.start_ns or 0
        end = rec.end_ns(default=self._last_ts.get(rec.rank, start))
        span.end(end_time=max(start, end if end is not None else start))
        self.spans_ended += 1


# ------------------------------------------------------------------ OTLP/JSON
def _any_value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_any_value(x) for x in v]}}
    return {"stringValue": str(v)}


def _kv(attrs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _any_value(v)} for k, v in attrs.items()]


def _ids_for(rec: OpRecord) -> tuple[str, str]:
    seed = f"{rec.rank}/{rec.op}/{rec.start_ns}".encode()
    h = hashlib.blake2b(seed, digest_size=24).digest()
    trace, span = h[:16], h[16:]
    if not any(trace):
        trace = b"\x01" + trace[1:]
    if not any(span):
        span = b"\x01" + span[1:]
    return trace.hex(), span.hex()


def _span_json(rec: OpRecord, last_ts: int) -> dict[str, Any]:
    trace_id, span_id = _ids_for(rec)
    start = rec.start_ns or 0
    end = rec.end_ns(default=last_ts)
    end = max(start, end if end is not None else start)
    events = []
    for ev in sorted([*rec.moves, *rec.records, *rec.violations], key=lambda e: e.seq):
        described = _span_event(ev)
        if described is not None:
            events.append({"timeUnixNano": str(ev.ts_ns), "name": described[0], "attributes": _kv(described[1])})
    desc = rec.error_description()
    if rec.done is None:
        desc = f"{_INCOMPLETE}; {desc}" if desc else _INCOMPLETE
    span: dict[str, Any] = {
        "traceId": trace_id,
        "spanId": span_id,
        "name": rec.name,
        "kind": 1,  # SPAN_KIND_INTERNAL
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(end),
        "attributes": _kv(span_attributes(rec)),
        "events": events,
        "status": {"code": 2, "message": desc} if desc else {},  # 2: STATUS_CODE_ERROR
    }
    return span


def _seq_of(ev: Event) -> int:
    return ev.seq


def otlp_json(events: Iterable[Event], *, service_name: str = "hicache-obs") -> dict[str, Any]:
    """An OTLP/JSON ``ExportTraceServiceRequest`` with one span per submitted operation.

    One ``resourceSpans`` entry per rank (resource attributes ``service.name`` and
    ``hicache.rank``). Ids are hex (as OTLP/JSON requires) and derived from
    (rank, op, submission time), so exporting the same log twice gives the same ids.
    Ops submitted but never completed end at the rank's last event, status ERROR.
    """
    evs: Sequence[Event] = events if isinstance(events, (list, tuple)) else list(events)
    ops = OpLifecycles.offline(evs).top_level()
    last_ts: dict[int, int] = {}
    for ev in evs:
        if ev.ts_ns > last_ts.get(ev.rank, 0):
            last_ts[ev.rank] = ev.ts_ns
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for rec in ops:
        if rec.submit is None:
            continue
        by_rank.setdefault(rec.rank, []).append(_span_json(rec, last_ts.get(rec.rank, 0)))
    resource_spans = []
    for rank in sorted(by_rank):
        resource_spans.append(
            {
                "resource": {"attributes": _kv({"service.name": service_name, "hicache.rank": rank})},
                "scopeSpans": [
                    {
                        "scope": {"name": INSTRUMENTATION_NAME, "version": _version()},
                        "spans": by_rank[rank],
                    }
                ],
            }
        )
    return {"resourceSpans": resource_spans}
