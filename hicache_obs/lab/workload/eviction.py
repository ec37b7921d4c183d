"""LRU eviction: making room on the device and on the host, and dropping nodes.

Device: the least recently used device *leaf* goes first (no child of it on the
device, not used by the current request, not loading, not being written). A node with
a host copy loses its device slots only; one without is written first when the write
policy backs up on eviction (``write_back``), else dropped with its subtree. Host:
the least recently used host-only leaf goes, its host slots freed (and, for the caller
fault modes, mishandled: :mod:`.faults`). A node that is dropped gives back every slot
of its subtree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hicache_obs.core._controller import HiCacheController
from hicache_obs.core._policy import WritePolicy
from hicache_obs.lab.workload.faults import CallerBugs
from hicache_obs.lab.workload.radix import Indices, RadixNode, RadixTree
from hicache_obs.lab.workload.stats import WorkloadStats

__all__ = ["Evictor", "device_victim", "host_victim"]


def device_victim(nodes: Iterable[RadixNode]) -> RadixNode | None:
    """The least recently used node whose device slots can go now (ties: the lowest id)."""
    victim = None
    for n in nodes:
        if (
            n.device is None
            or n.lock
            or n.loading
            or n.pending_host is not None
            or any(ch.device is not None for ch in n.children)
        ):
            continue
        if victim is None or (n.last_used, n.id) < (victim.last_used, victim.id):
            victim = n
    return victim


def host_victim(nodes: Iterable[RadixNode]) -> RadixNode | None:
    """The least recently used host-only leaf (ties: the lowest id)."""
    victim = None
    for n in nodes:
        if n.host is None or n.stale or n.device is not None or n.lock or n.children:
            continue
        if victim is None or (n.last_used, n.id) < (victim.last_used, victim.id):
            victim = n
    return victim


class Evictor:
    """Frees slots of ``tree``'s nodes in ``controller``'s pools when a tier runs short.

    ``write(node)`` starts a backup of a node (False when it could not start) and
    ``drain_writes()`` waits for and reaps every write in flight: the workload's own
    steps, which a write-back eviction and the drop of a node being written need.
    """

    def __init__(
        self,
        controller: HiCacheController,
        tree: RadixTree,
        stats: WorkloadStats,
        policy: WritePolicy,
        bugs: CallerBugs,
        *,
        write: Callable[[RadixNode], bool],
        drain_writes: Callable[[], None],
    ) -> None:
        self.c = controller
        self.tree = tree
        self.stats = stats
        self.policy = policy
        self.bugs = bugs
        self.write = write
        self.drain_writes = drain_writes

    def _available(self, pool: str, tier: str) -> int:
        return self.c.state.table(pool, tier).available

    # ------------------------------------------------------------ device
    def ensure_device(self, need: dict[str, int]) -> bool:
        """Evict until every pool of ``need`` has that many free device slots; False when nothing more can go."""
        while any(self._available(p, "device") < n for p, n in need.items()):
            victim = device_victim(self.tree.nodes.values())
            if victim is None:
                return False
            self.evict_device(victim)
        return True

    def evict_device(self, node: RadixNode) -> None:
        """Free ``node``'s device slots, keeping it when it has (or now gets) a host copy."""
        if node.host is None and self.policy.should_write_on_evict() and self.write(node):
            self.drain_writes()  # write-back: the copy must finish before the slots are reused
        if node.alive and node.host is not None:
            assert node.device is not None
            for p, idx in node.device.items():
                self.c.evict_device(idx, pool=p)
            node.device = None
            self.stats.evictions["device"] += 1
        elif node.alive:
            self.stats.evictions["dropped"] += 1
            self.drop(node)

    # -------------------------------------------------------------- host
    def ensure_host(self, need: dict[str, int]) -> bool:
        """Evict until every pool of ``need`` has that many free host slots; False when nothing more can go."""
        while any(self._available(p, "host") < n for p, n in need.items()):
            victim = host_victim(self.tree.nodes.values())
            if victim is None:
                return False
            self.evict_host(victim)
        return True

    def evict_host(self, node: RadixNode) -> None:
        """Free ``node``'s host copy; the node (host-only) leaves the tree, unless the caller keeps it by mistake."""
        assert node.host is not None
        self.free_host(node.host)
        self.stats.evictions["host"] += 1
        if self.bugs.frees_twice:
            self.free_host(node.host)
        if self.bugs.keeps_freed:
            node.stale = True
            return
        node.host = None
        self.tree.unlink(node)

    def free_host(self, host: Indices) -> None:
        """Give host slots back to the controller."""
        for p, idx in host.items():
            self.c.evict_host(idx, pool=p)

    # -------------------------------------------------------------- drop
    def drop(self, node: RadixNode) -> None:
        """Forget a node and its subtree, freeing every slot they hold."""
        for ch in list(node.children):
            self.drop(ch)
        if node.pending_host is not None:
            self.drain_writes()  # its device slots are still being read
        if node.device is not None:
            for p, idx in node.device.items():
                self.c.evict_device(idx, pool=p)
            node.device = None
        if node.host is not None and not node.stale:
            self.free_host(node.host)
        node.host = None
        self.tree.unlink(node)
