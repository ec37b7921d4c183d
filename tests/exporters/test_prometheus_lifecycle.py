"""PrometheusSink on the live op lifecycle: queue waits, durations, in-flight and moved slots
for hand-written logs, including ones no correct controller writes."""

from __future__ import annotations

from hicache_obs.events._schema import (
    OperationQueued,
    OperationsMerged,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
)
from hicache_obs.exporters import metric_names as m
from hicache_obs.exporters._prometheus import PrometheusSink


def _q(seq: int, ts: int, op: int) -> OperationQueued:
    return OperationQueued(seq=seq, ts_ns=ts, op=op, direction="h2d", node_id=op, priority=op,
                           slots_by_pool=(("kv", 4),))  # fmt: skip


def _sub(seq: int, ts: int, op: int, slots: int = 8) -> TransferSubmitted:
    return TransferSubmitted(seq=seq, ts_ns=ts, op=op, direction="h2d", stream="hicache-load", io_backend="direct",
                             layout="lf", tensors=(), slots_by_pool=(("kv", slots),),
                             bytes_by_pool=(("kv", 16 * slots),))  # fmt: skip


def _hist(sink: PrometheusSink, name: str) -> tuple[float, float]:
    """(count, sum) of the h2d histogram ``name``."""
    buckets, total = sink._histograms()[name][("h2d",)]
    return dict(buckets)["+Inf"], total


def test_queue_wait_is_the_earliest_queueing_of_the_merge_and_counted_once_per_op() -> None:
    sink = PrometheusSink()
    merged = OperationsMerged(seq=2, ts_ns=3_000_000_000, op=9, merged_ops=(1, 2), direction="h2d")
    sink.handle_batch([_q(0, 1_000_000_000, 1), _q(1, 2_000_000_000, 2), merged, _sub(3, 4_000_000_000, 9)])
    assert _hist(sink, m.QUEUE_WAIT_SECONDS) == (1, 3.0)  # 4 s - 1 s
    snap = sink.snapshot()
    assert snap[m.TRANSFERS_IN_FLIGHT][("h2d",)] == 1
    sink.handle(_sub(4, 5_000_000_000, 9, slots=2))  # a repeated submission: still one op, waited once
    assert _hist(sink, m.QUEUE_WAIT_SECONDS) == (1, 3.0)
    assert sink.snapshot()[m.TRANSFERS_IN_FLIGHT][("h2d",)] == 1
    sink.handle(TransferCompleted(seq=5, ts_ns=5_500_000_000, op=9, direction="h2d", duration_ns=0))
    snap = sink.snapshot()
    assert snap[m.TRANSFERS_IN_FLIGHT][("h2d",)] == 0
    assert snap[m.TRANSFER_SLOTS_TOTAL][("kv", "h2d")] == 2  # as last submitted
    assert snap[m.TRANSFER_BYTES_TOTAL][("kv", "h2d")] == 32
    assert _hist(sink, m.TRANSFER_DURATION_SECONDS) == (1, 0.5)  # not device-timed: completion - submission
    assert snap[m.OPERATIONS_TOTAL][("h2d", "submitted")] == 2


def test_a_completion_of_an_unknown_op_is_counted_and_a_failure_moves_nothing() -> None:
    sink = PrometheusSink()
    sink.handle_batch([
        TransferCompleted(seq=0, ts_ns=10, op=3, direction="h2d", duration_ns=2_000_000_000),
        _sub(1, 20, 4),
        TransferFailed(seq=2, ts_ns=30, op=4, direction="h2d", error="RuntimeError: x"),
        TransferCompleted(seq=3, ts_ns=40, op=5, direction="h2d", duration_ns=0),
    ])  # fmt: skip
    snap = sink.snapshot()
    assert snap[m.OPERATIONS_TOTAL][("h2d", "completed")] == 2
    assert snap[m.OPERATIONS_TOTAL][("h2d", "failed")] == 1
    assert snap[m.TRANSFERS_IN_FLIGHT][("h2d",)] == 0
    assert snap[m.TRANSFER_SLOTS_TOTAL][("kv", "h2d")] == 0
    assert _hist(sink, m.TRANSFER_DURATION_SECONDS) == (2, 2.0)  # the timed one, and 0 for the unknown untimed one
    assert _hist(sink, m.QUEUE_WAIT_SECONDS) == (0, 0.0)  # op 4 was never queued
