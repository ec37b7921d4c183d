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
and ``hicache.unrecorded_pools`` (list of str).

Span events: ``hicache.indices_moved`` per ``IndicesMoved`` (the moves happen just
before submission, so these events may precede the span's start),
``hicache.stream_recorded`` per ``StreamRecorded`` and ``hicache.audit_violation``
per ``AuditViolation`` of the op. Status ERROR, with a description, when the op
failed or the auditor reported a violation for it.

The live auditor appends its ``unrecorded_index`` violations right after the
``TransferCompleted``; a span is therefore ended only when the next event of the
same rank (not a violation of that op) arrives, or on ``flush()``/``close()``,
whatever the batch boundaries (see :mod:`hicache_obs.exporters._ops`).

With ``tracer_provider=None`` the sink builds its own SDK ``TracerProvider`` with
a ``BatchSpanProcessor`` and an OTLP/HTTP exporter configured by the standard
``OTEL_EXPORTER_OTLP_*`` / ``OTEL_BSP_*`` / ``OTEL_SERVICE_NAME`` /
``OTEL_RESOURCE_ATTRIBUTES`` environment variables, and shuts it down on
``close()``. The global provider is never set.

:meth:`OtelSpanSink.span_ids` gives the (hex) trace and span id of an op's span,
for log correlation (:class:`~hicache_obs.exporters.structlog_sink.StructlogSink`).
:func:`otlp_json` renders a replayed log as an OTLP/JSON
``ExportTraceServiceRequest`` (``hicache-obs export --otlp-json``), with
deterministic ids.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from hicache_obs.events.schema import (
    AuditViolation,
    Event,
    IndicesMoved,
    StreamRecorded,
    TransferSubmitted,
)

from ._ops import OpKey, OpRecord, OpTable, fold_ops

__all__ = [
    "SPAN_ATTRIBUTES",
    "INSTRUMENTATION_NAME",
    "OtelSpanSink",
    "make_tracer_provider",
    "span_attributes",
    "otlp_json",
]

INSTRUMENTATION_NAME = "hicache_obs.exporters.otel"

#: The attribute keys every span carries (DESIGN.md "Spans").
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
)

_INCOMPLETE = "incomplete_operation: submitted but never completed or failed"


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
    sub = rec.submit
    return {
        "hicache.op_id": rec.op,
        "hicache.direction": rec.direction,
        "hicache.io_backend": sub.io_backend if sub is not None else "",
        "hicache.layout": sub.layout if sub is not None else "",
        "hicache.pools": list(rec.pools),
        "hicache.slots": rec.slots,
        "hicache.bytes": rec.bytes,
        "hicache.node_count": rec.node_count,
        "hicache.unrecorded_indices": rec.unrecorded_indices,
        "hicache.unrecorded_pools": list(rec.unrecorded_pools),
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


class OtelSpanSink:
    """Turns merged operations into OpenTelemetry spans (see module docstring).

    ``tracer_provider``: an SDK (or any API) ``TracerProvider``; None builds one
    from the ``OTEL_*`` environment (:func:`make_tracer_provider`), owned and shut
    down by this sink. ``max_ids``: how many ops' span ids :meth:`span_ids` remembers.
    """

    name = "otel"

    def __init__(
        self,
        tracer_provider: Any = None,
        *,
        service_name: str = "hicache-obs",
        max_ids: int = 65536,
        flush_timeout_s: float = 5.0,
    ) -> None:
        self._owns_provider = tracer_provider is None
        self.provider = tracer_provider if tracer_provider is not None else make_tracer_provider(service_name)
        self.tracer = self.provider.get_tracer(INSTRUMENTATION_NAME, _version())
        self.max_ids = max_ids
        self.flush_timeout_s = flush_timeout_s
        self._lock = threading.Lock()
        self._table = OpTable(live=True)
        self._spans: dict[OpKey, Span] = {}
        self._ids: OrderedDict[OpKey, tuple[int, int]] = OrderedDict()
        self._seen: dict[int, int] = {}  # rank -> highest seq handled
        self._last_ts: dict[int, int] = {}
        self._cv = threading.Condition()
        self.closed = False
        self.spans_started = 0
        self.spans_ended = 0

    # ------------------------------------------------------------ sink API
    def handle(self, event: Event) -> None:
        self.handle_batch([event])

    def handle_batch(self, events: list[Event]) -> None:
        with self._lock:
            for ev in events:
                self._apply(ev)
        with self._cv:
            self._cv.notify_all()

    def flush(self) -> None:
        """End the spans of every completed op and flush the provider."""
        with self._lock:
            for rec in self._table.settle_all():
                self._end(rec)
        flush = getattr(self.provider, "force_flush", None)
        if flush is not None:
            flush(int(self.flush_timeout_s * 1000))

    def close(self) -> None:
        """End every span (ops never completed: status ERROR), and shut down an owned provider."""
        with self._lock:
            if self.closed:
                return
            for rec in self._table.settle_all():
                self._end(rec)
            for rec in self._table.unfinished():
                self._end(rec, incomplete=True)
            self.closed = True
        with self._cv:
            self._cv.notify_all()
        if self._owns_provider:
            self.provider.shutdown()
        else:
            flush = getattr(self.provider, "force_flush", None)
            if flush is not None:
                flush(int(self.flush_timeout_s * 1000))

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
        rec, settled = self._table.apply(ev)
        for r in settled:
            self._end(r)
        self._last_ts[ev.rank] = ev.ts_ns
        if rec is not None:
            if isinstance(ev, TransferSubmitted):
                self._start(rec)
            else:
                span = self._spans.get(rec.key)
                described = _span_event(ev) if span is not None else None
                if span is not None and described is not None:
                    span.add_event(described[0], described[1], timestamp=ev.ts_ns)
        with self._cv:
            if ev.seq > self._seen.get(ev.rank, -1):
                self._seen[ev.rank] = ev.seq

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
        for ev in rec.moves:
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


def otlp_json(events: Iterable[Event], *, service_name: str = "hicache-obs") -> dict[str, Any]:
    """An OTLP/JSON ``ExportTraceServiceRequest`` with one span per submitted operation.

    One ``resourceSpans`` entry per rank (resource attributes ``service.name`` and
    ``hicache.rank``). Ids are hex (as OTLP/JSON requires) and derived from
    (rank, op, submission time), so exporting the same log twice gives the same ids.
    Ops submitted but never completed end at the rank's last event, status ERROR.
    """
    evs: Sequence[Event] = events if isinstance(events, (list, tuple)) else list(events)
    ops, _ = fold_ops(evs)
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
