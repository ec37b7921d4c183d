"""Read models folded from a log: occupancy over time, op lifecycles, tensor records.

- :func:`occupancy` -> ``{(pool, tier): [(ts_ns, used_slots), ...]}``
- :func:`lifecycles` -> ``{(rank, op): OpLifecycle}``: queued -> merged -> moved ->
  submitted -> recorded -> completed/failed, with the time of each stage
- :func:`tensor_records` -> one :class:`TensorRecord` per index tensor an op used:
  where it lived, on which stream it was used, and whether it was recorded there
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .schema import (
    Event,
    IndicesMoved,
    OperationQueued,
    OperationsMerged,
    PoolCreated,
    SlotsAllocated,
    SlotsFreed,
    StreamRecorded,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
    runs_len,
)

__all__ = ["occupancy", "OpLifecycle", "lifecycles", "TensorRecord", "tensor_records"]


def occupancy(events: Iterable[Event]) -> dict[tuple[str, str], list[tuple[int, int]]]:
    """Used slots per (pool, tier) after every allocation or free, with its time.

    Several ranks are summed per (pool, tier).
    """
    used: dict[tuple[int, str, str], int] = {}
    total: dict[tuple[str, str], int] = {}
    out: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for ev in events:
        if isinstance(ev, PoolCreated):
            used[(ev.rank, ev.pool, ev.tier)] = 0
            key = (ev.pool, ev.tier)
            total.setdefault(key, 0)
            out.setdefault(key, []).append((ev.ts_ns, total[key]))
        elif isinstance(ev, (SlotsAllocated, SlotsFreed)):
            n = runs_len(ev.indices)
            delta = n if isinstance(ev, SlotsAllocated) else -n
            k = (ev.rank, ev.pool, ev.tier)
            used[k] = used.get(k, 0) + delta
            key = (ev.pool, ev.tier)
            total[key] = total.get(key, 0) + delta
            out.setdefault(key, []).append((ev.ts_ns, total[key]))
    return out


@dataclass
class OpLifecycle:
    rank: int
    op: int
    direction: str
    node_ids: tuple[int, ...] = ()
    merged_from: tuple[int, ...] = ()
    merged_into: int | None = None
    queued_ns: int | None = None
    merged_ns: int | None = None
    moved_ns: int | None = None
    submitted_ns: int | None = None
    recorded_ns: int | None = None
    finished_ns: int | None = None
    status: str = "queued"
    stream: str = ""
    duration_ns: int | None = None
    layer_durations_ns: tuple[int, ...] | None = None
    slots_by_pool: tuple[tuple[str, int], ...] = ()
    bytes_by_pool: tuple[tuple[str, int], ...] = ()
    error: str | None = None
    moves: list[IndicesMoved] = field(default_factory=list)
    records: list[StreamRecorded] = field(default_factory=list)

    @property
    def queue_wait_ns(self) -> int | None:
        if self.queued_ns is None or self.submitted_ns is None:
            return None
        return self.submitted_ns - self.queued_ns

    @property
    def total_ns(self) -> int | None:
        if self.submitted_ns is None or self.finished_ns is None:
            return None
        return self.finished_ns - self.submitted_ns


def lifecycles(events: Iterable[Event]) -> dict[tuple[int, int], OpLifecycle]:
    """Every op's stages (see module doc). Merged source ops point at their merged op."""
    ops: dict[tuple[int, int], OpLifecycle] = {}

    def get(rank: int, op: int, direction: str = "") -> OpLifecycle:
        lc = ops.get((rank, op))
        if lc is None:
            lc = ops[(rank, op)] = OpLifecycle(rank, op, direction)
        elif direction and not lc.direction:
            lc.direction = direction
        return lc

    for ev in events:
        if isinstance(ev, OperationQueued):
            lc = get(ev.rank, ev.op, ev.direction)
            lc.queued_ns = ev.ts_ns
            lc.node_ids = (ev.node_id,)
            lc.slots_by_pool = ev.slots_by_pool
        elif isinstance(ev, OperationsMerged):
            lc = get(ev.rank, ev.op, ev.direction)
            lc.merged_ns = ev.ts_ns
            lc.merged_from = ev.merged_ops
            lc.node_ids = ev.node_ids or lc.node_ids
            lc.status = "merged"
            if len(ev.merged_ops) > 1 or ev.merged_ops != (ev.op,):
                queued = [ops[(ev.rank, o)].queued_ns for o in ev.merged_ops if (ev.rank, o) in ops]
                lc.queued_ns = min((q for q in queued if q is not None), default=None)
                for o in ev.merged_ops:
                    src = get(ev.rank, o, ev.direction)
                    src.merged_into = ev.op
                    src.status = "merged"
        elif isinstance(ev, IndicesMoved):
            lc = get(ev.rank, ev.op)
            lc.moved_ns = ev.ts_ns if lc.moved_ns is None else lc.moved_ns
            lc.moves.append(ev)
        elif isinstance(ev, TransferSubmitted):
            lc = get(ev.rank, ev.op, ev.direction)
            lc.submitted_ns = ev.ts_ns
            lc.stream = ev.stream
            lc.status = "submitted"
            lc.slots_by_pool = ev.slots_by_pool
            lc.bytes_by_pool = ev.bytes_by_pool
        elif isinstance(ev, StreamRecorded):
            lc = get(ev.rank, ev.op)
            lc.recorded_ns = ev.ts_ns if lc.recorded_ns is None else lc.recorded_ns
            lc.records.append(ev)
        elif isinstance(ev, TransferCompleted):
            lc = get(ev.rank, ev.op, ev.direction)
            lc.finished_ns = ev.ts_ns
            lc.status = "completed"
            lc.duration_ns = ev.duration_ns
            lc.layer_durations_ns = ev.layer_durations_ns
        elif isinstance(ev, TransferFailed):
            lc = get(ev.rank, ev.op, ev.direction)
            lc.finished_ns = ev.ts_ns
            lc.status = "failed"
            lc.error = ev.error
    return ops


@dataclass(frozen=True)
class TensorRecord:
    rank: int
    op: int
    pool: str
    role: str
    device: str
    numel: int
    stream: str
    recorded: bool
    recorded_on: tuple[str, ...]

    @property
    def needs_record(self) -> bool:
        return self.device != "cpu" and self.numel > 0


def tensor_records(events: Iterable[Event]) -> list[TensorRecord]:
    """Record status of every index tensor a submitted transfer used."""
    subs: dict[tuple[int, int], TransferSubmitted] = {}
    recs: dict[tuple[int, int, str, str], list[str]] = {}
    for ev in events:
        if isinstance(ev, TransferSubmitted):
            subs[(ev.rank, ev.op)] = ev
        elif isinstance(ev, StreamRecorded):
            recs.setdefault((ev.rank, ev.op, ev.pool, ev.role), []).append(ev.stream)
    out = []
    for (rank, op), sub in subs.items():
        for t in sub.tensors:
            on = tuple(recs.get((rank, op, t.pool, t.role), ()))
            out.append(
                TensorRecord(rank, op, t.pool, t.role, t.device, t.numel, sub.stream, sub.stream in on, on)
            )
    return out
