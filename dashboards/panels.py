"""The two Grafana dashboards as tables: one :class:`Panel` per panel, grouped in grid rows.

A board's ``rows`` go top to bottom and each row's panels left to right on Grafana's
24-column grid (:mod:`render` computes the positions). Every metric name comes from
:mod:`hicache_obs.exporters.metric_names`; every query filters on the dashboard's
``job`` and ``instance`` variables (:mod:`promql`).
"""

from __future__ import annotations

from dataclasses import dataclass

from promql import quantile, rate, ratio, sel, sum_by

from hicache_obs.exporters import metric_names as m

__all__ = ["Panel", "Board", "OVERVIEW", "STREAM_SAFETY", "BOARDS"]


@dataclass(frozen=True)
class Panel:
    """One panel of ``kind`` ``timeseries`` or ``stat``, ``width`` columns of 24.

    ``queries`` are ``(expr, legendFormat)`` pairs; a stat has one, with no legend.
    ``stack`` and ``max_value`` (the y axis top) are for time series; ``red_from`` for
    stats: the value from which it turns red (None: always neutral).
    """

    kind: str
    title: str
    unit: str
    description: str
    queries: tuple[tuple[str, str], ...]
    width: int
    stack: bool = False
    max_value: float | None = None
    red_from: float | None = 1


@dataclass(frozen=True)
class Board:
    """A dashboard: written to ``file`` in ``dashboards/``; ``rows`` of panels, top to bottom."""

    file: str
    uid: str
    title: str
    description: str
    rows: tuple[tuple[Panel, ...], ...]


TS, STAT = "timeseries", "stat"
_DUR = m.TRANSFER_DURATION_SECONDS
_WAIT = m.QUEUE_WAIT_SECONDS

OVERVIEW = Board(
    "hicache-overview.json",
    "hicache-overview",
    "HiCache overview",
    "Hierarchical KV cache: operations, transfers, pool occupancy, allocation failures and evictions.",
    rows=(
        (
            Panel(
                TS, "Operations by direction and status", "ops",
                "Merged cache operations per second: d2h = write (device to host backup), h2d = load. "
                "submitted counts at TransferSubmitted, completed/failed at the end of the transfer.",
                ((sum_by("direction, status", rate(m.OPERATIONS_TOTAL)), "{{direction}} {{status}}"),),
                width=12,
            ),
            Panel(
                TS, "Transfers in flight by direction", "short",
                "Operations submitted on a side stream and not yet completed or failed. A level that stays "
                "above 0 while nothing completes is a stuck transfer (alert HiCacheTransfersStuck).",
                ((sum_by("direction", sel(m.TRANSFERS_IN_FLIGHT)), "{{direction}}"),),
                width=6,
            ),
            Panel(
                TS, "Failed operations ratio", "percentunit",
                "Failed / submitted operations per direction (0 when nothing was submitted).",
                (
                    (
                        ratio(
                            sum_by("direction", rate(m.OPERATIONS_TOTAL, 'status="failed"')),
                            sum_by("direction", rate(m.OPERATIONS_TOTAL, 'status="submitted"')),
                        ),
                        "{{direction}}",
                    ),
                ),
                width=6, max_value=1,
            ),
        ),
        (
            Panel(
                TS, "Slots moved per pool and direction", "cps",
                "Slots moved by completed operations per second (KV: one per token; Mamba: one per state "
                "checkpoint; SWA: the trailing window).",
                ((sum_by("pool, direction", rate(m.TRANSFER_SLOTS_TOTAL)), "{{pool}} {{direction}}"),),
                width=12,
            ),
            Panel(
                TS, "Bytes moved per pool and direction", "Bps",
                "Bytes moved by completed operations per second.",
                ((sum_by("pool, direction", rate(m.TRANSFER_BYTES_TOTAL)), "{{pool}} {{direction}}"),),
                width=12,
            ),
        ),
        (
            Panel(
                TS, "Transfer duration p50 / p99", "s",
                "Transfer time of completed operations (device-event timing when the runtime has it).",
                ((quantile(0.5, _DUR), "p50 {{direction}}"), (quantile(0.99, _DUR), "p99 {{direction}}")),
                width=8,
            ),
            Panel(
                TS, "Queue wait p50 / p99", "s",
                "Time from queueing (earliest of the merged operations) to submission on the transfer stream.",
                ((quantile(0.5, _WAIT), "p50 {{direction}}"), (quantile(0.99, _WAIT), "p99 {{direction}}")),
                width=8,
            ),
            Panel(
                TS, "Mean transfer duration and queue wait", "s",
                "Sum / count of the two histograms per direction (0 when nothing completed).",
                (
                    (
                        ratio(sum_by("direction", rate(_DUR + "_sum")), sum_by("direction", rate(_DUR + "_count"))),
                        "transfer {{direction}}",
                    ),
                    (
                        ratio(sum_by("direction", rate(_WAIT + "_sum")), sum_by("direction", rate(_WAIT + "_count"))),
                        "queue wait {{direction}}",
                    ),
                ),
                width=8,
            ),
        ),
        (
            Panel(
                TS, "Pool occupancy per pool and tier", "percentunit",
                "Allocated / capacity slots per pool (kv, mamba, swa) and tier (device, host). "
                "Pools the model does not have read 0.",
                (
                    (
                        ratio(
                            sum_by("pool, tier", sel(m.POOL_USED_SLOTS)),
                            sum_by("pool, tier", sel(m.POOL_CAPACITY_SLOTS)),
                        ),
                        "{{pool}} {{tier}}",
                    ),
                ),
                width=12, max_value=1,
            ),
            Panel(
                TS, "Used and capacity slots per pool and tier", "short",
                "Allocated slots and capacity in slots.",
                (
                    (sum_by("pool, tier", sel(m.POOL_USED_SLOTS)), "used {{pool}} {{tier}}"),
                    (sum_by("pool, tier", sel(m.POOL_CAPACITY_SLOTS)), "capacity {{pool}} {{tier}}"),
                ),
                width=12,
            ),
        ),
        (
            Panel(
                TS, "Allocation failures per pool and tier", "cps",
                "Allocations refused because a pool was short of free slots (the allocator returned None), "
                "per second.",
                ((sum_by("pool, tier", rate(m.ALLOCATION_FAILURES_TOTAL)), "{{pool}} {{tier}}"),),
                width=8,
            ),
            Panel(
                TS, "Evictions per pool and tier", "cps",
                "Eviction calls per second (device: a node leaves the device; host: its backup is dropped).",
                ((sum_by("pool, tier", rate(m.EVICTIONS_TOTAL)), "{{pool}} {{tier}}"),),
                width=8,
            ),
            Panel(
                TS, "Evicted slots per pool and tier", "cps",
                "Slots freed by eviction per second.",
                ((sum_by("pool, tier", rate(m.EVICTED_SLOTS_TOTAL)), "{{pool}} {{tier}}"),),
                width=8,
            ),
        ),
        (
            Panel(
                STAT, "Unrecorded index tensors (since start)", "short",
                "Index tensors used on a side stream without record_stream on it, since the process started. "
                "Anything above 0 is the bug of SGLang PR #22940: see the HiCache stream safety dashboard.",
                ((f"sum({sel(m.UNRECORDED_INDICES_TOTAL)})", ""),),
                width=8,
            ),
            Panel(
                STAT, "Audit violations (since start)", "short",
                "Every audit finding (all rules), since the process started.",
                ((f"sum({sel(m.AUDIT_VIOLATIONS_TOTAL)})", ""),),
                width=8,
            ),
            Panel(
                STAT, "Events per second", "cps",
                "Events the Prometheus exporter handled per second.",
                ((f"sum({rate(m.EVENTS_TOTAL)})", ""),),
                width=8, red_from=None,
            ),
        ),
    ),
)  # fmt: skip

STREAM_SAFETY = Board(
    "hicache-stream-safety.json",
    "hicache-stream-safety",
    "HiCache stream safety",
    "Index tensors used on a transfer stream without record_stream (the SGLang #22940 bug class), audit "
    "violations, stream records vs index moves, and the exporters' own errors and drops.",
    rows=(
        (
            Panel(
                STAT, "Unrecorded index tensors (since start)", "short",
                "Index tensors used on a side stream without record_stream on it (audit rule unrecorded_index), "
                "since the process started. Should be 0.",
                ((f"sum({sel(m.UNRECORDED_INDICES_TOTAL)})", ""),),
                width=6,
            ),
            Panel(
                STAT, "Audit violations (since start)", "short",
                "Audit findings of every rule since the process started. Should be 0.",
                ((f"sum({sel(m.AUDIT_VIOLATIONS_TOTAL)})", ""),),
                width=6,
            ),
            Panel(
                STAT, "Events dropped (since start)", "short",
                "Events a sink lost (queue full, or a batch the sink raised on), all sinks.",
                ((f"sum({sel(m.EVENTS_DROPPED_TOTAL)})", ""),),
                width=6,
            ),
            Panel(
                STAT, "Exporter errors (since start)", "short",
                "Exceptions raised by a sink (handle, flush or close), all sinks.",
                ((f"sum({sel(m.EXPORTER_ERRORS_TOTAL)})", ""),),
                width=6,
            ),
        ),
        (
            Panel(
                TS, "Unrecorded index tensors by pool and role", "short",
                "Index tensors a transfer used on its side stream without record_stream on that stream, per "
                "scrape interval. The caching allocator may reuse their memory while the copy still runs (illegal "
                "memory access or silent corruption). Before SGLang PR #22940 the Mamba/SWA pools' indices were "
                "never recorded.",
                ((sum_by("pool, role", rate(m.UNRECORDED_INDICES_TOTAL, fn="increase")), "{{pool}} {{role}}"),),
                width=12, stack=True,
            ),
            Panel(
                TS, "Audit violations by rule and pool", "short",
                "Audit findings per rule (unrecorded_index, index_not_on_device, length_mismatch, "
                "slot_not_allocated, double_free, incomplete_operation, pool_omitted, misplaced_indices) and pool, per scrape interval.",
                ((sum_by("rule, pool", rate(m.AUDIT_VIOLATIONS_TOTAL, fn="increase")), "{{rule}} {{pool}}"),),
                width=12, stack=True,
            ),
        ),
        (
            Panel(
                TS, "Stream records vs index moves per pool", "cps",
                "record_stream calls on a transfer stream and index tensors moved before a transfer, per pool "
                "and second. A pool whose indices move but are never recorded is the pre-#22940 pattern.",
                (
                    (sum_by("pool", rate(m.STREAM_RECORDS_TOTAL)), "records {{pool}}"),
                    (sum_by("pool", rate(m.INDEX_MOVES_TOTAL)), "moves {{pool}}"),
                ),
                width=12,
            ),
            Panel(
                TS, "Stream records and index moves by pool and role", "cps",
                "The same counters split by role (host or device index tensor).",
                (
                    (sum_by("pool, role", rate(m.STREAM_RECORDS_TOTAL)), "records {{pool}} {{role}}"),
                    (sum_by("pool, role", rate(m.INDEX_MOVES_TOTAL)), "moves {{pool}} {{role}}"),
                ),
                width=12,
            ),
        ),
        (
            Panel(
                TS, "Unrecorded index tensors per completed operation", "short",
                "Unrecorded index tensors per completed operation, per pool and direction (0 when nothing "
                "completed).",
                (
                    (
                        ratio(
                            sum_by("pool, direction", rate(m.UNRECORDED_INDICES_TOTAL)),
                            sum_by("direction", rate(m.OPERATIONS_TOTAL, 'status="completed"')),
                            "on (direction) group_left",
                        ),
                        "{{pool}} {{direction}}",
                    ),
                ),
                width=12,
            ),
            Panel(
                TS, "Exporter errors and dropped events by sink", "cps",
                "Per second: exceptions a sink raised, and events it lost. Telemetry never raises into the "
                "controller; this is where its failures show.",
                (
                    (sum_by("sink", rate(m.EXPORTER_ERRORS_TOTAL)), "errors {{sink}}"),
                    (sum_by("sink", rate(m.EVENTS_DROPPED_TOTAL)), "dropped {{sink}}"),
                ),
                width=12,
            ),
        ),
        (
            Panel(
                TS, "Events by type", "cps",
                "Events the Prometheus exporter handled per second, per event type.",
                ((sum_by("type", rate(m.EVENTS_TOTAL)), "{{type}}"),),
                width=18, stack=True,
            ),
            Panel(
                STAT, "Share of operations audited in full", "percentunit",
                "1 under the audit profile, 0 under metrics, the sampled share under sampling (lowest of the "
                "instances shown). The stream rules see every operation in each profile; the slot rules run "
                "under audit, and under sampling a free of a sampled operation's indices is a use after free.",
                ((f"min({sel(m.AUDIT_SAMPLE_RATIO)})", ""),),
                width=6, red_from=None,
            ),
        ),
    ),
)  # fmt: skip

#: Every dashboard ``generate.py`` writes, in that order.
BOARDS = (OVERVIEW, STREAM_SAFETY)
