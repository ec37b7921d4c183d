"""The OTel sink's counting exporter: what it delivered and what failed, read as one pair."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace.export import SpanExportResult

from hicache_obs.exporters._otel import _CountingExporter


class _Inner:
    """A span exporter that answers each batch from a script: SUCCESS, FAILURE or raise."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        answer = self.answers.pop(0)
        if answer == "raise":
            raise ConnectionError("collector gone")
        return SpanExportResult.SUCCESS if answer == "ok" else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        pass


def test_settled_counts_are_the_spans_delivered_and_the_spans_of_failed_batches() -> None:
    ex = _CountingExporter(_Inner(["ok", "fail", "raise", "ok"]))
    assert ex.settled_counts() == (0, 0)
    results = [ex.export([object()] * n) for n in (3, 2, 4, 1)]
    assert results == [SpanExportResult.SUCCESS, SpanExportResult.FAILURE, SpanExportResult.FAILURE, SpanExportResult.SUCCESS]
    assert ex.settled_counts() == (4, 6) and ex.errors == 2
    ex.deadline = 0.0  # past: a later batch fails without reaching the inner exporter
    assert ex.export([object()] * 5) == SpanExportResult.FAILURE
    assert ex.settled_counts() == (4, 11)
