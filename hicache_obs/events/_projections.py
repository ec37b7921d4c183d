"""Read models folded from a log: occupancy over time, op lifecycles, tensor records.

- :func:`occupancy` -> ``{(pool, tier): [(ts_ns, used_slots), ...]}``
- :func:`lifecycles` -> ``{(rank, op): OpLifecycle}``: queued -> merged -> moved ->
  submitted -> recorded -> completed/failed, with the time of each stage
- :func:`tensor_records` -> one :class:`TensorRecord` per index tensor an op used:
  where it lived, on which stream it was used, and whether it was recorded there
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ._lifecycle import OpLifecycles, OpRecord
from ._schema import Event, PoolCreated, SlotsAllocated, SlotsFreed, runs_len

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


#: One op's stages: the record of :class:`~hicache_obs.events._lifecycle.OpLifecycles` (status,
#: ``queued_ns`` ... ``finished_ns``, ``merged_from``/``merged_into``, moves, records, ``queue_wait_ns``,
#: ``duration_ns``, ``total_ns``).
OpLifecycle = OpRecord


def lifecycles(events: Iterable[Event]) -> dict[tuple[int, int], OpLifecycle]:
    """Every op's stages (see module doc), in the order of each op's first event. Merged
    source ops point at their merged op. The offline :class:`OpLifecycles` of ``events``."""
    return OpLifecycles.offline(events).records


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
    """Record status of every index tensor a submitted transfer used (ops in submission order)."""
    out = []
    subs = sorted((r for r in OpLifecycles.offline(events).records.values() if r.submit is not None), key=_submit_seq)
    for rec in subs:
        sub = rec.submit
        assert sub is not None
        on_streams: dict[tuple[str, str], list[str]] = {}
        for ev in rec.records:
            on_streams.setdefault((ev.pool, ev.role), []).append(ev.stream)
        for t in sub.tensors:
            on = tuple(on_streams.get((t.pool, t.role), ()))
            out.append(
                TensorRecord(rec.rank, rec.op, t.pool, t.role, t.device, t.numel, sub.stream, sub.stream in on, on)
            )
    return out


def _submit_seq(rec: OpRecord) -> int:
    return rec.submit.seq if rec.submit is not None else -1
