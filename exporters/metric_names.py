"""Prometheus metric names, types and label sets: the single source for code and dashboards.

Every metric name the project promises its users (:data:`DESIGN_METRICS`, the
stable set) is a constant here; :data:`ALL_METRICS` maps each exposed name to
``(type, label names)``. :data:`ADDITIONS` lists the series exposed beyond that
stable set. The dashboards test imports this
module so that no query can name a metric the code does not define.
"""

from __future__ import annotations

__all__ = [
    "OPERATIONS_TOTAL",
    "TRANSFERS_IN_FLIGHT",
    "TRANSFER_SLOTS_TOTAL",
    "TRANSFER_BYTES_TOTAL",
    "TRANSFER_DURATION_SECONDS",
    "QUEUE_WAIT_SECONDS",
    "INDEX_MOVES_TOTAL",
    "STREAM_RECORDS_TOTAL",
    "UNRECORDED_INDICES_TOTAL",
    "AUDIT_VIOLATIONS_TOTAL",
    "POOL_USED_SLOTS",
    "POOL_CAPACITY_SLOTS",
    "ALLOCATION_FAILURES_TOTAL",
    "EVENTS_TOTAL",
    "EVENTS_DROPPED_TOTAL",
    "EXPORTER_ERRORS_TOTAL",
    "EVICTIONS_TOTAL",
    "EVICTED_SLOTS_TOTAL",
    "COUNTER",
    "GAUGE",
    "HISTOGRAM",
    "DESIGN_METRICS",
    "ADDITIONS",
    "ALL_METRICS",
    "HELP",
    "OPERATION_STATUSES",
    "series_names",
]

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"

OPERATIONS_TOTAL = "hicache_operations_total"
TRANSFERS_IN_FLIGHT = "hicache_transfers_in_flight"
TRANSFER_SLOTS_TOTAL = "hicache_transfer_slots_total"
TRANSFER_BYTES_TOTAL = "hicache_transfer_bytes_total"
TRANSFER_DURATION_SECONDS = "hicache_transfer_duration_seconds"
QUEUE_WAIT_SECONDS = "hicache_queue_wait_seconds"
INDEX_MOVES_TOTAL = "hicache_index_moves_total"
STREAM_RECORDS_TOTAL = "hicache_stream_records_total"
UNRECORDED_INDICES_TOTAL = "hicache_unrecorded_indices_total"
AUDIT_VIOLATIONS_TOTAL = "hicache_audit_violations_total"
POOL_USED_SLOTS = "hicache_pool_used_slots"
POOL_CAPACITY_SLOTS = "hicache_pool_capacity_slots"
ALLOCATION_FAILURES_TOTAL = "hicache_allocation_failures_total"
EVENTS_TOTAL = "hicache_events_total"
EVENTS_DROPPED_TOTAL = "hicache_events_dropped_total"
EXPORTER_ERRORS_TOTAL = "hicache_exporter_errors_total"

# additions beyond the stable set
EVICTIONS_TOTAL = "hicache_evictions_total"
EVICTED_SLOTS_TOTAL = "hicache_evicted_slots_total"
AUDIT_SAMPLE_RATIO = "hicache_audit_sample_ratio"

#: values of the ``status`` label of :data:`OPERATIONS_TOTAL`
OPERATION_STATUSES = ("submitted", "completed", "failed")

#: The stable metric names users depend on: name -> (type, label names).
DESIGN_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    OPERATIONS_TOTAL: (COUNTER, ("direction", "status")),
    TRANSFERS_IN_FLIGHT: (GAUGE, ("direction",)),
    TRANSFER_SLOTS_TOTAL: (COUNTER, ("pool", "direction")),
    TRANSFER_BYTES_TOTAL: (COUNTER, ("pool", "direction")),
    TRANSFER_DURATION_SECONDS: (HISTOGRAM, ("direction",)),
    QUEUE_WAIT_SECONDS: (HISTOGRAM, ("direction",)),
    INDEX_MOVES_TOTAL: (COUNTER, ("pool", "role")),
    STREAM_RECORDS_TOTAL: (COUNTER, ("pool", "role")),
    UNRECORDED_INDICES_TOTAL: (COUNTER, ("pool", "role", "direction")),
    AUDIT_VIOLATIONS_TOTAL: (COUNTER, ("rule", "pool")),
    POOL_USED_SLOTS: (GAUGE, ("pool", "tier")),
    POOL_CAPACITY_SLOTS: (GAUGE, ("pool", "tier")),
    ALLOCATION_FAILURES_TOTAL: (COUNTER, ("pool", "tier")),
    EVENTS_TOTAL: (COUNTER, ("type",)),
    EVENTS_DROPPED_TOTAL: (COUNTER, ("sink",)),
    EXPORTER_ERRORS_TOTAL: (COUNTER, ("sink",)),
}

#: Series exposed beyond the stable set (documented in the README).
ADDITIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    EVICTIONS_TOTAL: (COUNTER, ("pool", "tier")),
    EVICTED_SLOTS_TOTAL: (COUNTER, ("pool", "tier")),
    AUDIT_SAMPLE_RATIO: (GAUGE, ()),
}

#: Every metric :class:`~hicache_obs.exporters._prometheus.PrometheusSink` exposes.
ALL_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {**DESIGN_METRICS, **ADDITIONS}

HELP: dict[str, str] = {
    OPERATIONS_TOTAL: "Cache operations (merged) by direction (d2h write, h2d load) and status.",
    TRANSFERS_IN_FLIGHT: "Operations submitted on a side stream and not yet completed or failed.",
    TRANSFER_SLOTS_TOTAL: "Slots moved by completed operations, per pool and direction.",
    TRANSFER_BYTES_TOTAL: "Bytes moved by completed operations, per pool and direction.",
    TRANSFER_DURATION_SECONDS: "Transfer time of completed operations (device-event timing when the runtime has it).",
    QUEUE_WAIT_SECONDS: "Time from queueing (earliest of the merged ops) to submission.",
    INDEX_MOVES_TOTAL: "Index tensors moved between devices before a transfer, per pool and role.",
    STREAM_RECORDS_TOTAL: "record_stream calls on a transfer stream, per pool and role.",
    UNRECORDED_INDICES_TOTAL: "Device index tensors used on a side stream without record_stream on it (audit rule unrecorded_index).",
    AUDIT_VIOLATIONS_TOTAL: "Audit findings per rule and pool.",
    POOL_USED_SLOTS: "Allocated slots per pool and tier.",
    POOL_CAPACITY_SLOTS: "Capacity in slots per pool and tier.",
    ALLOCATION_FAILURES_TOTAL: "Allocations refused because a pool was short of free slots.",
    EVENTS_TOTAL: "Events handled by the Prometheus exporter, per event type.",
    EVENTS_DROPPED_TOTAL: "Events a sink lost (queue full, or a batch the sink raised on).",
    EXPORTER_ERRORS_TOTAL: "Exceptions raised by a sink (handle, flush or close).",
    EVICTIONS_TOTAL: "Evictions (SlotsFreed with reason evict), per pool and tier.",
    EVICTED_SLOTS_TOTAL: "Slots freed by eviction, per pool and tier.",
    AUDIT_SAMPLE_RATIO: "Share of operations audited in full: 1 (profile audit), 0 (metrics), the sampled share (sampling).",
}


def series_names(name: str) -> tuple[str, ...]:
    """The sample names a metric produces in the text exposition (histograms: _bucket/_sum/_count)."""
    kind, _ = ALL_METRICS[name]
    if kind == HISTOGRAM:
        return (f"{name}_bucket", f"{name}_sum", f"{name}_count")
    return (name,)
