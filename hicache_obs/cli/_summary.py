"""Transfer totals folded from an event log: operations, slots, bytes and bandwidth per direction."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..events._schema import (
    DIRECTIONS,
    Event,
    PoolCreated,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
)

__all__ = ["TransferTotals", "transfer_totals"]


def _per_direction() -> dict[str, int]:
    return dict.fromkeys(DIRECTIONS, 0)


@dataclass
class TransferTotals:
    """Completed transfers only (failed ones moved nothing); durations are device-timed."""

    operations: dict[str, int] = field(default_factory=_per_direction)
    failed: dict[str, int] = field(default_factory=_per_direction)
    slots: dict[str, dict[str, int]] = field(default_factory=dict)  # pool -> direction -> slots
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # pool -> direction -> bytes
    duration_ns: dict[str, int] = field(default_factory=_per_direction)

    def total_bytes(self, direction: str) -> int:
        return sum(d[direction] for d in self.bytes.values())

    def bandwidth(self, direction: str) -> float | None:
        """Bytes per second of transfer time (bytes / summed durations), None without timing."""
        ns = self.duration_ns[direction]
        return self.total_bytes(direction) / (ns / 1e9) if ns > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "operations": dict(self.operations),
            "failed_operations": dict(self.failed),
            "slots": {p: dict(d) for p, d in self.slots.items()},
            "bytes": {p: dict(d) for p, d in self.bytes.items()},
            "transfer_seconds": {d: ns / 1e9 for d, ns in self.duration_ns.items()},
            "bandwidth_bytes_per_s": {d: self.bandwidth(d) for d in DIRECTIONS},
        }


def transfer_totals(events: Iterable[Event]) -> TransferTotals:
    """Fold ``events`` (one or several ranks) into :class:`TransferTotals`."""
    out = TransferTotals()
    submitted: dict[tuple[int, int], TransferSubmitted] = {}

    def pool(name: str) -> None:
        if name not in out.slots:
            out.slots[name] = _per_direction()
            out.bytes[name] = _per_direction()

    for ev in events:
        if isinstance(ev, PoolCreated):
            pool(ev.pool)
        elif isinstance(ev, TransferSubmitted):
            submitted[(ev.rank, ev.op)] = ev
        elif isinstance(ev, TransferCompleted):
            out.operations[ev.direction] += 1
            out.duration_ns[ev.direction] += ev.duration_ns
            sub = submitted.pop((ev.rank, ev.op), None)
            if sub is None:
                continue
            for name, n in sub.slots_by_pool:
                pool(name)
                out.slots[name][ev.direction] += n
            for name, n in sub.bytes_by_pool:
                pool(name)
                out.bytes[name][ev.direction] += n
        elif isinstance(ev, TransferFailed):
            out.failed[ev.direction] += 1
            submitted.pop((ev.rank, ev.op), None)
    return out
