"""StructlogSink: one JSON line per finished op and per violation, carrying its span's ids."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog
from exporters_kit import run_workload
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hicache_obs.errors import ConfigError
from hicache_obs.exporters._otel import OtelSpanSink
from hicache_obs.exporters._structlog_sink import StructlogSink, make_json_logger


def _lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


@pytest.mark.parametrize("order", ["log_sink_first", "span_sink_first"])
def test_log_lines_carry_the_ids_of_their_spans(controller, order):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    configured = structlog.is_configured()
    c = controller("tiny_hybrid", fault="unrecorded-pool-indices")
    spans = OtelSpanSink(provider)
    buf = io.StringIO()
    lines_sink = StructlogSink(file=buf, span_ids=spans)
    for s in (lines_sink, spans) if order == "log_sink_first" else (spans, lines_sink):
        c.log.add_sink(s)
    exp = run_workload(c, rounds=2)
    c.close()
    assert structlog.is_configured() == configured, "the sink must never configure structlog"

    by_op = {
        sp.attributes["hicache.op_id"]: (format(sp.context.trace_id, "032x"), format(sp.context.span_id, "016x"))
        for sp in exporter.get_finished_spans()
    }
    lines = _lines(buf)
    done = [ln for ln in lines if ln["event"] == "hicache.transfer_completed"]
    assert sorted(ln["op"] for ln in done) == sorted(exp.op_ids["d2h"] + exp.op_ids["h2d"])
    for ln in lines:
        assert (ln["trace_id"], ln["span_id"]) == by_op[ln["op"]], ln
    violations = [ln for ln in lines if ln["event"] == "hicache.audit_violation"]
    assert len(violations) == 2 * len(exp.mamba_ops)
    assert {ln["op"] for ln in violations} == set(exp.mamba_ops)
    assert all(
        ln["level"] == "warning" and ln["rule"] == "unrecorded_index" and ln["pool"] == "mamba" for ln in violations
    )
    for ln in done:
        assert ln["level"] == "info"
        assert ln["unrecorded_indices"] == (2 if ln["op"] in exp.mamba_ops else 0)
    # an op's line comes before the lines of its violations
    order_of = [(ln["event"], ln["op"]) for ln in lines]
    for op in exp.mamba_ops:
        assert order_of.index(("hicache.transfer_completed", op)) < order_of.index(("hicache.audit_violation", op))


def test_line_fields_without_span_correlation(controller):
    c = controller("tiny_hybrid")
    buf = io.StringIO()
    c.log.add_sink(StructlogSink(file=buf, level="debug"))
    exp = run_workload(c, rounds=1)
    c.log.flush()
    lines = _lines(buf)
    assert len(lines) == exp.ops["d2h"] + exp.ops["h2d"]
    sb = {p: c.spec.slot_bytes(p) for p in c.spec.pool_names}
    for ln in lines:
        assert ln["event"] == "hicache.transfer_completed" and ln["level"] == "debug"
        assert "trace_id" not in ln and "span_id" not in ln
        assert ln["direction"] in ("d2h", "h2d") and ln["status"] == "completed"
        assert ln["slots"] == sum(ln["slots_by_pool"].values())
        assert ln["bytes"] == sum(n * sb[p] for p, n in ln["slots_by_pool"].items())
        assert ln["pools"] == list(ln["slots_by_pool"])
        assert ln["duration_s"] > 0 and ln["queue_wait_s"] >= 0
        assert ln["timestamp"].endswith("Z") and ln["rank"] == 0
    loads = [ln for ln in lines if ln["direction"] == "h2d"]
    assert [len(ln["node_ids"]) for ln in loads] == [2]


def test_failed_operation_is_an_error_line_and_stdlib_loggers_work(controller):
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    std = logging.getLogger("hicache-test-structlog-sink")
    std.propagate = False
    std.setLevel(logging.DEBUG)
    handler = Keep()
    std.addHandler(handler)
    try:
        c = controller("tiny", fault="host-indices-not-moved")
        c.log.add_sink(StructlogSink(std))
        c.write(c.alloc_device(16), node_id=3)
        assert [a.ok for a in c.poll_writes()] == [False]
        c.log.flush()
    finally:
        std.removeHandler(handler)
    lines = [json.loads(r.getMessage()) for r in records]
    failed = [ln for ln in lines if ln["event"] == "hicache.transfer_failed"]
    assert len(failed) == 1 and failed[0]["level"] == "error" and "error" in failed[0]
    assert [r.levelno for r in records if json.loads(r.getMessage())["event"] == "hicache.transfer_failed"] == [
        logging.ERROR
    ]
    assert any(ln["event"] == "hicache.audit_violation" and ln["rule"] == "index_not_on_device" for ln in lines)


def test_make_json_logger_and_level_check():
    buf = io.StringIO()
    make_json_logger(buf).info("hello", answer=42)
    assert json.loads(buf.getvalue()) == {"answer": 42, "event": "hello", "level": "info"}
    with pytest.raises(ConfigError):
        StructlogSink(level="loud")


def test_lines_do_not_wait_forever_for_a_span_sink_that_never_catches_up(controller):
    """The span sink never sees the events: lines still come out (without ids) after ``id_wait_s``."""
    spans = OtelSpanSink(TracerProvider())
    buf = io.StringIO()
    sink = StructlogSink(file=buf, span_ids=spans, id_wait_s=0.05)
    c = controller("tiny")
    c.log.add_sink(sink)
    exp = run_workload(c, rounds=1)
    c.log.flush()
    lines = _lines(buf)
    assert len(lines) == exp.ops["d2h"] + exp.ops["h2d"]
    assert all("trace_id" not in ln for ln in lines)
