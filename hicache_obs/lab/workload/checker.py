"""The data check: every slot a transfer filled holds, bit for bit, what the workload wrote there.

After a write the host copy is compared with the node's data, after a load the device
slots are. Each check adds to :attr:`WorkloadStats.checked_slots`; a pool whose slots
differ is one :class:`Corruption` (always counted, listed up to
:data:`MAX_LISTED_CORRUPTIONS`), and the node's data becomes what is there now, so a
later check reports new damage only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from hicache_obs.core._controller import Ack, HiCacheController
from hicache_obs.lab.workload.radix import Indices, RadixNode

if TYPE_CHECKING:
    from hicache_obs.lab.workload.stats import WorkloadStats

__all__ = ["MAX_LISTED_CORRUPTIONS", "Corruption", "DataChecker", "bits"]

#: How many corruptions :class:`WorkloadStats` lists one by one (the count is always exact).
MAX_LISTED_CORRUPTIONS = 100

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Corruption:
    """Slots whose data differed from what the workload wrote there."""

    node: int
    pool: str
    direction: str  # d2h: the host copy after a write; h2d: the device slots after a load
    op: int
    tier: str
    slots: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["slots"] = list(self.slots)
        return d


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as integers of the same width: equal exactly when the bytes are (NaN too)."""
    return t.contiguous().view(_INT_VIEW[t.element_size()])


class DataChecker:
    """Compares a node's slots in a controller's pools with the node's data, counting into ``stats``."""

    def __init__(self, controller: HiCacheController, stats: WorkloadStats) -> None:
        self.c = controller
        self.stats = stats

    def check(self, node: RadixNode, indices: Indices, tier: str, ack: Ack, direction: str) -> None:
        """Compare ``node``'s slots ``indices`` on ``tier`` after the transfer ``ack`` reported."""
        rt = self.c.runtime
        stats = self.stats
        for p, idx in indices.items():
            pool = self.c.device_pool(p) if tier == "device" else self.c.host_pool(p)
            got = pool.read_slots(idx)
            want = node.data[p]
            n = idx.numel()
            bad = torch.zeros(n, dtype=torch.bool)
            for plane, w in want.items():
                g = got[plane]
                diff = bits(g) != bits(w)
                bad |= diff.reshape(diff.shape[0], n, -1).any(dim=2).any(dim=0)
            stats.checked_slots += n
            if bool(bad.any()):
                values = rt.to_host(idx).tolist()
                slots = tuple(values[i] for i in bad.nonzero().flatten().tolist())
                stats.corruptions += 1
                if len(stats.corrupted) < MAX_LISTED_CORRUPTIONS:
                    stats.corrupted.append(
                        Corruption(node=node.id, pool=p, direction=direction, op=ack.op_id, tier=tier, slots=slots)
                    )
                node.data[p] = got  # later checks compare with what is there now
