"""A local OTLP/HTTP trace receiver for the tests: what an exporter really sent."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class _Traces(BaseHTTPRequestHandler):
    server: OtlpReceiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        with self.server.lock:
            self.server.paths.append(self.path)
            self.server.spans.extend(sp for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: object) -> None:
        pass


class OtlpReceiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver on a free 127.0.0.1 port: keeps each request's path and spans."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Traces)
        self.lock = threading.Lock()
        self.paths: list[str] = []
        self.spans: list[Any] = []


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def span_attributes(span: Any) -> dict[str, Any]:
    """A span's attributes as Python values (arrays as lists)."""
    return {kv.key: _value(kv.value) for kv in span.attributes}
