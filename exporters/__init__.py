"""Exporters: sinks that turn the event log into metrics, spans, log lines and traces.

Installed as ``hicache_obs.exporters``; import the sinks from here. Each is optional and
imported lazily (the names below resolve on first use, so importing this package pulls in
neither prometheus_client, opentelemetry nor structlog).

- :mod:`.metric_names`: metric name constants and ``ALL_METRICS``
- :class:`PrometheusSink`, :func:`start_metrics_server`, :func:`stop_metrics_server`
- :class:`OtelSpanSink`, :func:`otlp_json`
- :class:`StructlogSink`, :func:`make_json_logger`
- :class:`ChromeTraceSink`, :func:`write_chrome_trace`
- :mod:`.sinkhost`: :func:`~.sinkhost.add_sink_host`, sinks in a process of their own

Every sink is attached with ``log.add_sink(sink)``: it then runs on a worker
thread behind a bounded queue, and its errors and drops are counted, never raised
into the controller.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "PrometheusSink",
    "start_metrics_server",
    "stop_metrics_server",
    "OtelSpanSink",
    "otlp_json",
    "StructlogSink",
    "make_json_logger",
    "ChromeTraceSink",
    "write_chrome_trace",
]

_WHERE = {
    "PrometheusSink": "prometheus",
    "start_metrics_server": "prometheus",
    "stop_metrics_server": "prometheus",
    "OtelSpanSink": "otel",
    "otlp_json": "otel",
    "StructlogSink": "structlog_sink",
    "make_json_logger": "structlog_sink",
    "ChromeTraceSink": "chrome_trace",
    "write_chrome_trace": "chrome_trace",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}._{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
