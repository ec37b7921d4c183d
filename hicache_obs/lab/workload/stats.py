"""What a workload run counted: requests, tokens by where they were served from, transfers, evictions, checks.

The event log counts the transfers as the controller saw them; these are the
workload's own counts (its part of the ``hicache-obs demo --json`` summary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hicache_obs.lab.workload.checker import Corruption

__all__ = ["WorkloadStats"]


@dataclass
class WorkloadStats:
    """What a run did, counted by the workload (the event log counts the transfers)."""

    steps: int = 0
    requests: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: {"device_hit": 0, "host_hit": 0, "miss": 0})
    nodes_created: int = 0
    writes: dict[str, int] = field(default_factory=lambda: {"issued": 0, "completed": 0, "failed": 0, "host_full": 0})
    loads: dict[str, int] = field(default_factory=lambda: {"issued": 0, "completed": 0, "failed": 0, "device_full": 0})
    evictions: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "dropped": 0, "lost": 0})
    truncated_requests: int = 0
    checked_slots: int = 0
    corruptions: int = 0
    corrupted: list[Corruption] = field(default_factory=list)

    @property
    def data_intact(self) -> bool:
        """Every checked slot was bit-identical to what was written."""
        return self.corruptions == 0

    @property
    def hit_rate(self) -> dict[str, float]:
        """Fractions of requested tokens served from the device, from the host, or computed."""
        total = sum(self.tokens.values())
        if not total:
            return {"device": 0.0, "host": 0.0, "miss": 0.0}
        return {
            "device": self.tokens["device_hit"] / total,
            "host": self.tokens["host_hit"] / total,
            "miss": self.tokens["miss"] / total,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "requests": self.requests,
            "tokens": dict(self.tokens),
            "hit_rate": self.hit_rate,
            "nodes_created": self.nodes_created,
            "writes": dict(self.writes),
            "loads": dict(self.loads),
            "evictions": dict(self.evictions),
            "truncated_requests": self.truncated_requests,
            "checked_slots": self.checked_slots,
            "data_intact": self.data_intact,
            "corruptions": self.corruptions,
            "corrupted_slots": [c.to_dict() for c in self.corrupted],
        }
