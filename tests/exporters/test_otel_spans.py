"""OtelSpanSink: one span per merged op, received by a real OTLP/HTTP endpoint and in memory."""

from __future__ import annotations

import base64
import copy
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from exporters_kit import run_workload
from google.protobuf import json_format
from opentelemetry import trace as otel_trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from hicache_obs.core import PoolTransfer
from hicache_obs.events._schema import AuditViolation, TransferCompleted, TransferSubmitted
from hicache_obs.exporters._otel import SPAN_ATTRIBUTES, OtelSpanSink, otlp_json


# --------------------------------------------------------------- OTLP endpoint
class _Collector(BaseHTTPRequestHandler):
    server: _OtlpServer

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path != "/v1/traces":
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        with self.server.lock:
            self.server.requests.append(req)
            self.server.content_types.append(self.headers.get("Content-Type", ""))
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format, *args):
        pass


class _OtlpServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Collector)
        self.lock = threading.Lock()
        self.requests: list[ExportTraceServiceRequest] = []
        self.content_types: list[str] = []

    def spans(self):
        out = []
        with self.lock:
            for req in self.requests:
                for rs in req.resource_spans:
                    resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for sp in ss.spans:
                            out.append((resource, sp))
        return out


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


@pytest.fixture
def otlp_endpoint():
    server = _OtlpServer()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def memory_provider():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


# ------------------------------------------------------------------- tests
@pytest.mark.parametrize("env", ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"])
def test_spans_reach_a_real_otlp_http_endpoint(controller, otlp_endpoint, monkeypatch, env):
    port = otlp_endpoint.server_address[1]
    url = f"http://127.0.0.1:{port}" + ("/v1/traces" if env.endswith("TRACES_ENDPOINT") else "")
    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(env, url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    global_before = otel_trace.get_tracer_provider()

    c = controller("tiny_hybrid", fault="unrecorded-pool-indices")
    sink = OtelSpanSink()  # provider built from the environment
    assert otel_trace.get_tracer_provider() is global_before, "the global provider must not be set"
    c.log.add_sink(sink)
    exp = run_workload(c, rounds=2)
    c.close()  # closes the log it owns: sinks flushed and closed, provider shut down

    got = otlp_endpoint.spans()
    assert otlp_endpoint.content_types and all(ct == "application/x-protobuf" for ct in otlp_endpoint.content_types)
    by_op = {}
    for resource, sp in got:
        assert resource["service.name"] == "hicache-obs"
        attrs = {kv.key: _value(kv.value) for kv in sp.attributes}
        assert set(attrs) == set(SPAN_ATTRIBUTES)
        by_op[attrs["hicache.op_id"]] = (sp, attrs)
    ops = exp.op_ids["d2h"] + exp.op_ids["h2d"]
    assert sorted(by_op) == sorted(ops)
    for op in ops:
        sp, attrs = by_op[op]
        direction = "d2h" if op in exp.op_ids["d2h"] else "h2d"
        assert sp.name == ("hicache.write" if direction == "d2h" else "hicache.load")
        assert attrs["hicache.direction"] == direction
        assert attrs["hicache.io_backend"] == "kernel" and attrs["hicache.layout"] == "layer_first"
        assert attrs["hicache.slots"] > 0 and attrs["hicache.bytes"] > 0
        assert sp.end_time_unix_nano >= sp.start_time_unix_nano > 0
        if op in exp.mamba_ops:
            assert attrs["hicache.unrecorded_indices"] == 2, op  # mamba host + device index tensors
            assert attrs["hicache.unrecorded_pools"] == ["mamba"]
            assert "mamba" in attrs["hicache.pools"]
            assert sp.status.code == 2 and "unrecorded_index" in sp.status.message  # STATUS_CODE_ERROR
            assert sum(1 for e in sp.events if e.name == "hicache.audit_violation") == 2
        else:
            assert attrs["hicache.unrecorded_indices"] == 0, op
            assert attrs["hicache.unrecorded_pools"] == []
            assert sp.status.code == 0
    assert exp.clean_ops and exp.mamba_ops
    assert {by_op[op][1]["hicache.node_count"] for op in exp.op_ids["h2d"]} == {2}  # two loads merged


def test_in_memory_spans_of_a_clean_workload(controller, memory_provider):
    provider, exporter = memory_provider
    c = controller("tiny_hybrid")
    sink = OtelSpanSink(provider)
    c.log.add_sink(sink)
    exp = run_workload(c, rounds=2)
    c.log.flush()
    spans = exporter.get_finished_spans()
    assert len(spans) == exp.ops["d2h"] + exp.ops["h2d"]
    events = c.log.events()
    submitted = {e.op: e for e in events if isinstance(e, TransferSubmitted)}
    completed = {e.op: e for e in events if isinstance(e, TransferCompleted)}
    for sp in spans:
        a = dict(sp.attributes)
        assert set(a) == set(SPAN_ATTRIBUTES)
        op = a["hicache.op_id"]
        sub = submitted[op]
        assert a["hicache.unrecorded_indices"] == 0 and a["hicache.unrecorded_pools"] == ()
        assert sp.status.status_code == StatusCode.UNSET
        assert sp.start_time == sub.ts_ns
        assert sub.ts_ns <= sp.end_time <= completed[op].ts_ns
        assert a["hicache.pools"] == tuple(p for p, _ in sub.slots_by_pool)
        assert a["hicache.slots"] == sum(n for _, n in sub.slots_by_pool)
        assert a["hicache.bytes"] == sum(n for _, n in sub.bytes_by_pool)
        names = [e.name for e in sp.events]
        recorded = {
            (e.attributes["hicache.pool"], e.attributes["hicache.role"])
            for e in sp.events
            if e.name == "hicache.stream_recorded"
        }
        assert {p for p, _ in recorded} == set(a["hicache.pools"])
        assert names.count("hicache.indices_moved") == len(a["hicache.pools"])
        assert sp.parent is None, "each op is its own trace"
    # the span ids the sink reports are the exported ones
    for sp in spans:
        ids = sink.span_ids(sp.attributes["hicache.op_id"])
        assert ids == (format(sp.context.trace_id, "032x"), format(sp.context.span_id, "016x"))
    assert sink.span_ids(10_000) is None


def _fault_events(controller):
    c = controller("tiny_hybrid", fault="unrecorded-pool-indices")
    run_workload(c, rounds=1)
    return c.log.events()


def _attrs_by_op(exporter):
    return {
        sp.attributes["hicache.op_id"]: (dict(sp.attributes), sp.status.status_code)
        for sp in exporter.get_finished_spans()
    }


@pytest.mark.parametrize("split", ["one_by_one", "at_each_completion", "whole_log"])
def test_violations_reach_the_span_whatever_the_batch_boundaries(controller, split):
    events = _fault_events(controller)
    assert any(isinstance(e, AuditViolation) for e in events)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sink = OtelSpanSink(provider)
    if split == "one_by_one":
        for e in events:
            sink.handle(e)
    elif split == "at_each_completion":  # a batch ends right after each TransferCompleted
        batch = []
        for e in events:
            batch.append(e)
            if isinstance(e, TransferCompleted):
                sink.handle_batch(batch)
                batch = []
        sink.handle_batch(batch)
    else:
        sink.handle_batch(list(events))
    sink.flush()
    got = _attrs_by_op(exporter)
    violations = {}
    for e in events:
        if isinstance(e, AuditViolation) and e.rule == "unrecorded_index":
            violations[e.op] = violations.get(e.op, 0) + 1
    ops = {e.op for e in events if isinstance(e, TransferSubmitted)}
    assert set(got) == ops
    for op in ops:
        attrs, status = got[op]
        assert attrs["hicache.unrecorded_indices"] == violations.get(op, 0)
        assert status == (StatusCode.ERROR if violations.get(op) else StatusCode.UNSET)
    sink.close()


def test_failed_and_incomplete_operations_end_with_error(controller, memory_provider):
    provider, exporter = memory_provider
    c = controller("tiny", fault="host-indices-not-moved")
    sink = OtelSpanSink(provider)
    c.log.add_sink(sink)
    kv = c.alloc_device(32)
    host = c.write(kv, node_id=1)  # the kernel backend rejects the CPU host indices: TransferFailed
    acks = c.poll_writes()
    assert [a.ok for a in acks] == [False]
    c.log.flush()
    (sp,) = exporter.get_finished_spans()
    assert sp.status.status_code == StatusCode.ERROR
    assert "transfer failed" in sp.status.description and "index_not_on_device" in sp.status.description
    assert sp.attributes["hicache.unrecorded_indices"] == 0

    provider2 = TracerProvider()
    exporter2 = InMemorySpanExporter()
    provider2.add_span_processor(SimpleSpanProcessor(exporter2))
    c2 = controller("tiny")
    kv = c2.alloc_device(32)
    host = c2.write(kv, node_id=2)
    c2.poll_writes()
    c2.evict_device(kv)
    c2.load(host, node_id=2)
    c2.start_loading()  # never reaped before the sink closes
    sink2 = OtelSpanSink(provider2)
    sink2.handle_batch(c2.log.events())
    sink2.close()
    by_name = {sp.name: sp for sp in exporter2.get_finished_spans()}
    assert by_name["hicache.write"].status.status_code == StatusCode.UNSET
    load = by_name["hicache.load"]
    assert load.status.status_code == StatusCode.ERROR and "incomplete_operation" in load.status.description
    assert load.end_time >= load.start_time


def test_otlp_json_is_a_valid_deterministic_export_request(controller):
    c = controller("tiny_hybrid", fault="unrecorded-pool-indices")
    exp = run_workload(c, rounds=1)
    events = c.log.events()
    doc = otlp_json(events)
    assert otlp_json(iter(events)) == doc, "same log, same ids"
    json.dumps(doc)  # plain JSON
    (rs,) = doc["resourceSpans"]
    spans = rs["scopeSpans"][0]["spans"]
    assert len(spans) == exp.ops["d2h"] + exp.ops["h2d"]
    for sp in spans:
        assert len(sp["traceId"]) == 32 and len(sp["spanId"]) == 16
        int(sp["traceId"], 16), int(sp["spanId"], 16)
    # the protobuf JSON mapping takes bytes as base64: convert the hex ids, then parse strictly
    as_proto = copy.deepcopy(doc)
    for sp in as_proto["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        sp["traceId"] = base64.b64encode(bytes.fromhex(sp["traceId"])).decode()
        sp["spanId"] = base64.b64encode(bytes.fromhex(sp["spanId"])).decode()
    req = json_format.ParseDict(as_proto, ExportTraceServiceRequest())
    parsed = req.resource_spans[0].scope_spans[0].spans
    by_op = {}
    for sp in parsed:
        attrs = {kv.key: _value(kv.value) for kv in sp.attributes}
        assert set(attrs) == set(SPAN_ATTRIBUTES)
        by_op[attrs["hicache.op_id"]] = (sp, attrs)
    for op in exp.mamba_ops:
        sp, attrs = by_op[op]
        assert attrs["hicache.unrecorded_indices"] == 2 and attrs["hicache.unrecorded_pools"] == ["mamba"]
        assert sp.status.code == 2
    for op in exp.clean_ops:
        assert by_op[op][1]["hicache.unrecorded_indices"] == 0 and by_op[op][0].status.code == 0
    assert otlp_json([]) == {"resourceSpans": []}


def test_pool_only_load_and_node_count(controller, memory_provider):
    provider, exporter = memory_provider
    c = controller("tiny_hybrid")
    sink = OtelSpanSink(provider)
    c.log.add_sink(sink)
    kv = c.alloc_device(16)
    mb = c.alloc_device(2, pool="mamba")
    _, tr = c.write(kv, node_id=1, pool_transfers=[PoolTransfer("mamba", device_indices=mb)])
    c.poll_writes()
    c.evict_device(mb, pool="mamba")
    import torch

    empty = torch.empty(0, dtype=torch.int64)
    c.load(empty, node_id=1, pool_transfers=[PoolTransfer("mamba", host_indices=tr[0].host_indices)])
    c.start_loading()
    c.poll_loads()
    c.log.flush()
    load = next(sp for sp in exporter.get_finished_spans() if sp.name == "hicache.load")
    assert load.attributes["hicache.slots"] == 2
    assert load.attributes["hicache.node_count"] == 1
