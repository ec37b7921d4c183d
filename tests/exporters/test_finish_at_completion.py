"""The span and log sinks finish an op at its completion, in the batch that holds it.

In an audited log (the live auditor is a stage of the log) every verdict on an op comes
before the event that revealed it, so a sink needs no later event to know an op's
verdict: a batch that ends right after a completion ends that op's span and writes its
line, with the verdict in it.
"""

from __future__ import annotations

import io
import json

from exporters_kit import run_workload
from goldens import FIXTURE, REPO
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from hicache_obs.events._replay import read_segments
from hicache_obs.events._schema import AuditViolation, TransferCompleted, TransferFailed
from hicache_obs.exporters._otel import OtelSpanSink
from hicache_obs.exporters._structlog_sink import StructlogSink


def _batches_ending_at_each_completion(events):
    batch = []
    for e in events:
        batch.append(e)
        if type(e) in (TransferCompleted, TransferFailed):
            yield batch, e
            batch = []
    if batch:
        yield batch, None


def _unrecorded(events) -> dict[int, int]:
    out: dict[int, int] = {}
    for e in events:
        if type(e) is AuditViolation and e.rule == "unrecorded_index":
            out[e.op] = out.get(e.op, 0) + 1
    return out


def test_a_batch_ending_at_a_completion_ends_its_span_with_the_verdict(controller) -> None:
    c = controller("tiny_hybrid", fault="unrecorded-pool-indices")
    run_workload(c, rounds=3)
    events = c.log.events()
    unrecorded = _unrecorded(events)
    assert unrecorded, "the fault found nothing"
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sink = OtelSpanSink(provider)
    ended = 0
    for batch, done in _batches_ending_at_each_completion(events):
        sink.handle_batch(batch)
        if done is None:
            continue
        spans = {sp.attributes["hicache.op_id"]: sp for sp in exporter.get_finished_spans()}
        ended += 1
        assert len(spans) == ended, "the span ended in the batch of its completion, no flush"
        sp = spans[done.op]
        assert sp.attributes["hicache.unrecorded_indices"] == unrecorded.get(done.op, 0)
        assert sp.status.status_code == (StatusCode.ERROR if unrecorded.get(done.op) else StatusCode.UNSET)
        violations = [e for e in sp.events if e.name == "hicache.audit_violation"]
        assert len(violations) == unrecorded.get(done.op, 0)
    assert sink.late_violations == 0
    sink.close()


def test_a_batch_ending_at_a_completion_writes_its_line_with_the_verdict(controller) -> None:
    c = controller("tiny_hybrid", fault="unrecorded-pool-indices")
    run_workload(c, rounds=3)
    events = c.log.events()
    unrecorded = _unrecorded(events)
    buf = io.StringIO()
    sink = StructlogSink(file=buf)
    for batch, done in _batches_ending_at_each_completion(events):
        sink.handle_batch(batch)
        if done is None:
            continue
        lines = [json.loads(x) for x in buf.getvalue().splitlines()]
        ops = [x for x in lines if x["event"] == "hicache.transfer_completed"]
        assert ops and ops[-1]["op"] == done.op, "the line of the op is written in its batch"
        assert ops[-1]["unrecorded_indices"] == unrecorded.get(done.op, 0)
        after = [x for x in lines if x["event"] == "hicache.audit_violation" and x["op"] == done.op]
        assert len(after) == unrecorded.get(done.op, 0)
    sink.close()


def test_verdicts_after_their_ops_end_are_counted_late_not_put_on_a_span() -> None:
    # a version 1 log holds each verdict after the completion that revealed it; fed as is
    # (not through audited()), the spans have ended when the verdicts come
    events = read_segments([REPO / FIXTURE]).events
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sink = OtelSpanSink(provider)
    sink.handle_batch(events)
    sink.close()
    late = sum(type(e) is AuditViolation and e.op >= 0 for e in events)
    assert late == 78 and sink.late_violations == late
    assert all(sp.attributes["hicache.unrecorded_indices"] == 0 for sp in exporter.get_finished_spans())
