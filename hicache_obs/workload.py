"""A synthetic prefix-reuse serving workload that drives a cache controller like SGLang's radix cache.

Requests (from a seeded RNG) share prefixes taken from a small set of
"documents" (system prompts, few-shot blocks), each a chain of nodes of 16 to
128 tokens (whole pages), and end with a short unique suffix. Each step serves
one request:

1. match its path in the tree: nodes on the device are *device hits*, nodes only
   on the host are *host hits* and are loaded back (``load`` per node, then one
   ``start_loading``);
2. prefill the rest (new document nodes and the suffix): allocate device slots
   (one Mamba slot per node for hybrid models, the trailing window for SWA; the
   sidecar pools first), write random KV/state with ``DevicePool.write_slots``
   and remember it. These allocations land between ``start_loading()`` and
   ``poll_loads()``, the memory pressure under which an index tensor that was
   not ``record_stream``-ed gets its memory reused;
3. reap loads and compare every loaded slot with what was written (bit-identical
   expected), reap writes and compare the host copy;
4. count hits and write through per the controller's :class:`WritePolicy`
   (after 1 hit, after ``threshold`` hits, or on eviction for ``write_back``).

Device eviction is LRU over device leaves: a backed-up node loses its device
slots only; a node without a host copy is written first (``write_back``) or
dropped. Host eviction is LRU over host-only leaves. A transfer that fails
(``Ack.ok`` false) did not move the data: a failed write frees its host slots, a
failed load drops the node (its data is lost). Everything is deterministic for
a seed.

With the ``double-free`` and ``use-after-free`` faults (which only remove the
controller's guard) the workload also plays the buggy caller: it frees a host
copy twice, or keeps a node whose host copy it freed and loads it later.

>>> from hicache_obs.core import HybridCacheController, ModelSpec
>>> spec = ModelSpec.tiny_hybrid()
>>> c = HybridCacheController(spec, runtime="sim", **controller_options(spec))
>>> stats = run_workload(c, seed=0, steps=50)
>>> stats.data_intact, stats.hit_rate["miss"] < 1
(True, True)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .core.controller import ANCHOR, Ack, HiCacheController, HybridCacheController
from .core.operations import PoolTransfer
from .core.spec import ModelSpec
from .errors import ConfigError
from .events.schema import D2H, H2D

__all__ = [
    "WorkloadConfig",
    "WorkloadStats",
    "Corruption",
    "Workload",
    "controller_options",
    "run_workload",
]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: How many corruptions :class:`WorkloadStats` lists one by one (the count is always exact).
MAX_LISTED_CORRUPTIONS = 100


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the synthetic traffic."""

    documents: int = 8
    chunks_per_document: int = 8
    chunk_tokens: tuple[int, int] = (16, 128)
    suffix_tokens: tuple[int, int] = (16, 64)
    popularity: float = 0.8  # Zipf exponent over documents: a few hot, a long tail

    def __post_init__(self) -> None:
        if self.documents < 1 or self.chunks_per_document < 1:
            raise ConfigError(
                f"WorkloadConfig needs documents >= 1 and chunks_per_document >= 1, "
                f"got {self.documents} and {self.chunks_per_document}"
            )
        for name in ("chunk_tokens", "suffix_tokens"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ConfigError(f"WorkloadConfig.{name} must be (lo, hi) with 0 < lo <= hi, got {(lo, hi)}")


def controller_options(spec: ModelSpec, device_tokens: int = 1024) -> dict[str, Any]:
    """Controller keyword arguments that fit the workload: ``device_size`` and ``pool_sizes``.

    The KV device pool holds ``device_tokens`` (the source of eviction pressure). The
    sidecar pools (Mamba, SWA) are sized so that every index value the workload can
    produce is a valid slot for them: when an unrecorded index block is reused (the
    ``unrecorded-pool-indices`` fault), the copy then reads or writes the *wrong* slots
    (silent corruption, which the data checks find) rather than an out-of-range one,
    which on a GPU is an illegal memory access and would end the run.
    """
    ps = spec.page_size
    if device_tokens <= 0 or device_tokens % ps:
        raise ConfigError(f"device_tokens must be a positive multiple of page size {ps}, got {device_tokens}")
    largest_index = 2 * device_tokens + 2 * ps  # above the KV host pool's capacity (ratio 2 + a spare page)
    sizes: dict[str, int] = {}
    if "mamba" in spec.pool_names:
        sizes["mamba"] = largest_index
    if "swa" in spec.pool_names:
        sizes["swa"] = largest_index
    return {"device_size": device_tokens, "host_ratio": 2.0, "pool_sizes": sizes}


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


Indices = dict[str, torch.Tensor]  # pool -> index tensor
Data = dict[str, dict[str, torch.Tensor]]  # pool -> plane -> (layers, n, *item)


class _Node:
    __slots__ = (
        "id",
        "parent",
        "children",
        "slot",
        "tokens",
        "sizes",
        "data",
        "device",
        "host",
        "pending_host",
        "loading",
        "stale",
        "hits",
        "last_used",
        "lock",
        "alive",
    )

    def __init__(self, node_id: int, parent: _Node | None, slot: tuple[int, int] | None, sizes: dict[str, int]) -> None:
        self.id = node_id
        self.parent = parent
        self.children: list[_Node] = []
        self.slot = slot  # (document, chunk) or None for a suffix
        self.sizes = sizes  # pool -> slots
        self.tokens = sizes[ANCHOR]
        self.data: Data = {}
        self.device: Indices | None = None
        self.host: Indices | None = None
        self.pending_host: Indices | None = None
        self.loading = False
        self.stale = False  # host indices kept after they were freed (use-after-free caller bug)
        self.hits = 0
        self.last_used = 0
        self.lock = 0
        self.alive = True


class Workload:
    """Drives ``controller`` with the synthetic traffic; :meth:`run` returns :class:`WorkloadStats`.

    ``fault`` names the fault the controller was built with (see
    :data:`hicache_obs.testing.FAULTS`); the workload plays the buggy caller for
    ``double-free`` and ``use-after-free`` and otherwise ignores it.
    """

    def __init__(
        self,
        controller: HiCacheController,
        *,
        seed: int = 0,
        config: WorkloadConfig | None = None,
        fault: str | None = None,
    ) -> None:
        self.c = controller
        self.spec = controller.spec
        self.seed = seed
        self.cfg = config if config is not None else WorkloadConfig()
        self.fault = fault
        self.rng = random.Random(seed)
        self.hybrid = isinstance(controller, HybridCacheController)
        self.sidecars = [p for p in self.spec.pool_names if p != ANCHOR]
        self.policy = controller.write_policy
        self.stats = WorkloadStats()
        cfg = self.cfg
        self.documents = [
            [self._tokens(cfg.chunk_tokens) for _ in range(cfg.chunks_per_document)] for _ in range(cfg.documents)
        ]
        self._weights = [1.0 / (i + 1) ** cfg.popularity for i in range(cfg.documents)]
        self.doc_nodes: list[list[_Node | None]] = [[None] * cfg.chunks_per_document for _ in range(cfg.documents)]
        self.nodes: dict[int, _Node] = {}
        self.pending_writes: dict[int, _Node] = {}
        self.pending_loads: dict[int, _Node] = {}
        self._next_node = 0
        self._tick = 0

    # ----------------------------------------------------------------- sizes
    def _tokens(self, bounds: tuple[int, int]) -> int:
        ps = self.spec.page_size
        lo, hi = max(1, -(-bounds[0] // ps)), max(1, bounds[1] // ps)
        return self.rng.randint(lo, max(lo, hi)) * ps

    def _sizes(self, tokens: int) -> dict[str, int]:
        sizes = {ANCHOR: tokens}
        ps = self.spec.page_size
        for p in self.sidecars:
            if p == "mamba":
                sizes[p] = 1  # one state checkpoint per node
            else:  # swa: the trailing window, in whole pages
                sizes[p] = min(tokens, -(-self.spec.swa_window // ps) * ps)
        return sizes

    def _available(self, pool: str, tier: str) -> int:
        return self.c.state.table(pool, tier).available

    # ------------------------------------------------------------------ run
    def run(self, steps: int, on_step: Callable[[int], None] | None = None) -> WorkloadStats:
        """Serve ``steps`` requests, then reap every outstanding transfer."""
        for i in range(steps):
            self.step()
            if on_step is not None:
                on_step(i + 1)
        self.finish()
        return self.stats

    def step(self) -> None:
        """Serve one request (see the module docstring)."""
        self._tick += 1
        self.stats.steps += 1
        self.stats.requests += 1
        rng = self.rng
        doc = rng.choices(range(self.cfg.documents), weights=self._weights)[0]
        depth = rng.randint(1, self.cfg.chunks_per_document)
        suffix_tokens = self._tokens(self.cfg.suffix_tokens)
        requested = sum(self.documents[doc][:depth]) + suffix_tokens

        # 1. match the cached prefix and lock it
        path: list[_Node] = []
        for k in range(depth):
            node = self.doc_nodes[doc][k]
            if node is None:
                break
            path.append(node)
        for n in path:
            n.lock += 1
        device_hits = [n for n in path if n.device is not None]
        for n in device_hits:
            self.stats.tokens["device_hit"] += n.tokens
        to_load = [n for n in path if n.device is None]

        # 2. load back what is on the host only; the path ends where a load cannot start
        queued: list[_Node] = []
        truncated = False
        for n in to_load:
            if not self._load(n):
                cut = path.index(n)
                for m in path[cut:]:
                    m.lock -= 1
                path = path[:cut]
                truncated = True
                break
            queued.append(n)
        if queued:
            self.c.start_loading()

        # 3. prefill the rest while the loads are in flight (allocation pressure)
        created: list[_Node] = []
        if not truncated:
            parent = path[-1] if path else None
            for k in range(len(path), depth):
                node = self._prefill(parent, (doc, k), self.documents[doc][k])
                if node is None:
                    truncated = True
                    break
                created.append(node)
                parent = node
            else:
                node = self._prefill(parent, None, suffix_tokens)
                if node is None:
                    truncated = True
                else:
                    created.append(node)
        if truncated:
            self.stats.truncated_requests += 1

        # 4. reap: loads of this step (check the data), writes of earlier steps
        self._complete_loads()
        self._handle_writes(self.c.poll_writes())

        # 5. hits and write-through
        for n in device_hits + queued:
            if not n.alive or n.device is None:
                continue
            if n in queued:
                self.stats.tokens["host_hit"] += n.tokens
            n.hits += 1
            if n.host is None and n.pending_host is None and self.policy.should_write_on_hit(n.hits):
                self._write(n)
        self.stats.tokens["miss"] += requested - sum(
            n.tokens for n in device_hits + queued if n.alive and n.device is not None
        )
        for n in path + created:
            n.lock -= 1
            n.last_used = self._tick

    def finish(self) -> None:
        """Wait for and reap every outstanding write and load."""
        if self.pending_loads:
            self._complete_loads()
        self._drain_writes()

    # ------------------------------------------------------------- prefill
    def _prefill(self, parent: _Node | None, slot: tuple[int, int] | None, tokens: int) -> _Node | None:
        sizes = self._sizes(tokens)
        if not self._ensure_device(sizes):
            return None
        device: Indices = {}
        # sidecar pools first: their small index tensors are the ones an unrecorded
        # transfer lost to the allocator, so the next request reuses that memory
        for p in [*self.sidecars, ANCHOR]:
            t = self.c.alloc_device(sizes[p], pool=p)
            if t is None:  # cannot happen after _ensure_device; stay correct anyway
                for q, u in device.items():
                    self.c.free_device(u, pool=q)
                return None
            device[p] = t
        node = _Node(self._next_node, parent, slot, sizes)
        self._next_node += 1
        node.device = device
        for p, idx in device.items():
            node.data[p] = self._random_data(node.id, p, sizes[p])
            self.c.device_pool(p).write_slots(idx, node.data[p])
        node.lock = 1
        node.last_used = self._tick
        if parent is not None:
            parent.children.append(node)
        if slot is not None:
            self.doc_nodes[slot[0]][slot[1]] = node
        self.nodes[node.id] = node
        self.stats.nodes_created += 1
        return node

    def _random_data(self, node_id: int, pool: str, n: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(
            ((self.seed * 1_000_003 + node_id) * 4 + self.spec.pool_names.index(pool)) & 0x7FFF_FFFF_FFFF_FFFF
        )
        dp = self.c.device_pool(pool)
        return {
            p.name: torch.randn((len(dp.layer_ids), n, *p.item_shape), generator=g).to(p.dtype) for p in dp.plane_specs
        }

    # --------------------------------------------------------------- loads
    def _load(self, node: _Node) -> bool:
        assert node.host is not None
        if not self._ensure_device(node.sizes):
            self.stats.loads["device_full"] += 1
            return False
        host = node.host
        if self.hybrid:
            assert isinstance(self.c, HybridCacheController)
            transfers = [PoolTransfer(p, host_indices=host[p]) for p in self.sidecars] or None
            res = self.c.load(host[ANCHOR], node_id=node.id, pool_transfers=transfers)
            if res is None:
                self.stats.loads["device_full"] += 1
                return False
            dev, resolved = res
            device = {ANCHOR: dev}
            for t in resolved or ():
                assert t.device_indices is not None
                device[t.pool] = t.device_indices
        else:
            d = self.c.load(host[ANCHOR], node_id=node.id)
            if d is None:
                self.stats.loads["device_full"] += 1
                return False
            device = {ANCHOR: d}
        node.device = device
        node.loading = True
        self.pending_loads[node.id] = node
        self.stats.loads["issued"] += 1
        return True

    def _complete_loads(self) -> None:
        acks = self.c.poll_loads()
        if any(nid not in {i for a in acks for i in a.node_ids} for nid in self.pending_loads):
            self.c.synchronize()  # a batch waits for its loads (per layer in an engine)
            acks += self.c.poll_loads()
        lost: list[_Node] = []
        for ack in acks:
            for nid in ack.node_ids:
                node = self.pending_loads.pop(nid, None)
                if node is None:
                    continue
                node.loading = False
                if not ack.ok:
                    self.stats.loads["failed"] += 1
                    lost.append(node)
                    continue
                self.stats.loads["completed"] += 1
                assert node.device is not None
                self._check(node, node.device, "device", ack, H2D)
                if node.stale:  # the caller forgets the host copy it had already freed
                    node.host, node.stale = None, False
        for node in lost:
            if node.alive:
                self.stats.evictions["lost"] += 1
                self._drop(node)

    # -------------------------------------------------------------- writes
    def _write(self, node: _Node) -> bool:
        assert node.device is not None
        if not self._ensure_host(node.sizes):
            self.stats.writes["host_full"] += 1
            return False
        dev = node.device
        if self.hybrid:
            assert isinstance(self.c, HybridCacheController)
            transfers = [PoolTransfer(p, device_indices=dev[p]) for p in self.sidecars] or None
            res = self.c.write(dev[ANCHOR], node_id=node.id, pool_transfers=transfers)
            if res is None:
                self.stats.writes["host_full"] += 1
                return False
            h, resolved = res
            host = {ANCHOR: h}
            for t in resolved or ():
                assert t.host_indices is not None
                host[t.pool] = t.host_indices
        else:
            h2 = self.c.write(dev[ANCHOR], node_id=node.id)
            if h2 is None:
                self.stats.writes["host_full"] += 1
                return False
            host = {ANCHOR: h2}
        node.pending_host = host
        self.pending_writes[node.id] = node
        self.stats.writes["issued"] += 1
        return True

    def _handle_writes(self, acks: list[Ack]) -> None:
        for ack in acks:
            for nid in ack.node_ids:
                node = self.pending_writes.pop(nid, None)
                if node is None:
                    continue
                host, node.pending_host = node.pending_host, None
                assert host is not None
                if not ack.ok:  # the data was not moved: give the host slots back
                    self.stats.writes["failed"] += 1
                    self._free_host(host)
                    continue
                self.stats.writes["completed"] += 1
                if not node.alive:
                    self._free_host(host)
                    continue
                node.host = host
                self._check(node, host, "host", ack, D2H)

    def _drain_writes(self) -> None:
        if not self.pending_writes:
            self._handle_writes(self.c.poll_writes())
            return
        self.c.synchronize()
        self._handle_writes(self.c.poll_writes())

    # ------------------------------------------------------------ eviction
    def _ensure_device(self, need: dict[str, int]) -> bool:
        while any(self._available(p, "device") < n for p, n in need.items()):
            victim = None
            for n in self.nodes.values():
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
            if victim is None:
                return False
            self._evict_device(victim)
        return True

    def _evict_device(self, node: _Node) -> None:
        if node.host is None and self.policy.should_write_on_evict() and self._write(node):
            self._drain_writes()  # write-back: the copy must finish before the slots are reused
        if node.alive and node.host is not None:
            assert node.device is not None
            for p, idx in node.device.items():
                self.c.evict_device(idx, pool=p)
            node.device = None
            self.stats.evictions["device"] += 1
        elif node.alive:
            self.stats.evictions["dropped"] += 1
            self._drop(node)

    def _ensure_host(self, need: dict[str, int]) -> bool:
        while any(self._available(p, "host") < n for p, n in need.items()):
            victim = None
            for n in self.nodes.values():
                if n.host is None or n.stale or n.device is not None or n.lock or n.children:
                    continue
                if victim is None or (n.last_used, n.id) < (victim.last_used, victim.id):
                    victim = n
            if victim is None:
                return False
            self._evict_host(victim)
        return True

    def _evict_host(self, node: _Node) -> None:
        assert node.host is not None
        self._free_host(node.host)
        self.stats.evictions["host"] += 1
        if self.fault == "double-free":  # the buggy caller frees the same host copy again
            self._free_host(node.host)
        if self.fault == "use-after-free":  # the buggy caller keeps the freed host indices
            node.stale = True
            return
        node.host = None
        self._unlink(node)

    def _free_host(self, host: Indices) -> None:
        for p, idx in host.items():
            self.c.evict_host(idx, pool=p)

    def _drop(self, node: _Node) -> None:
        """Forget a node and its subtree, freeing every slot they hold."""
        for ch in list(node.children):
            self._drop(ch)
        if node.pending_host is not None:
            self._drain_writes()  # its device slots are still being read
        if node.device is not None:
            for p, idx in node.device.items():
                self.c.evict_device(idx, pool=p)
            node.device = None
        if node.host is not None and not node.stale:
            self._free_host(node.host)
        node.host = None
        self._unlink(node)

    def _unlink(self, node: _Node) -> None:
        node.alive = False
        if node.parent is not None and node in node.parent.children:
            node.parent.children.remove(node)
        if node.slot is not None and self.doc_nodes[node.slot[0]][node.slot[1]] is node:
            self.doc_nodes[node.slot[0]][node.slot[1]] = None
        self.nodes.pop(node.id, None)

    # ---------------------------------------------------------- data checks
    def _check(self, node: _Node, indices: Indices, tier: str, ack: Ack, direction: str) -> None:
        rt = self.c.runtime
        for p, idx in indices.items():
            pool = self.c.device_pool(p) if tier == "device" else self.c.host_pool(p)
            got = pool.read_slots(idx)
            want = node.data[p]
            n = idx.numel()
            bad = torch.zeros(n, dtype=torch.bool)
            for plane, w in want.items():
                g = got[plane]
                diff = _bits(g) != _bits(w)
                bad |= diff.reshape(diff.shape[0], n, -1).any(dim=2).any(dim=0)
            self.stats.checked_slots += n
            if bool(bad.any()):
                values = rt.to_host(idx).tolist()
                slots = tuple(values[i] for i in bad.nonzero().flatten().tolist())
                self.stats.corruptions += 1
                if len(self.stats.corrupted) < MAX_LISTED_CORRUPTIONS:
                    self.stats.corrupted.append(Corruption(node.id, p, direction, ack.op_id, tier, slots))
                node.data[p] = got  # later checks compare with what is there now


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def run_workload(
    controller: HiCacheController,
    *,
    seed: int = 0,
    steps: int = 200,
    config: WorkloadConfig | None = None,
    fault: str | None = None,
    on_step: Callable[[int], None] | None = None,
) -> WorkloadStats:
    """Run :class:`Workload` for ``steps`` requests; the controller stays open."""
    return Workload(controller, seed=seed, config=config, fault=fault).run(steps, on_step)
