"""The workload's driver: :class:`Workload` serves one request per step against a cache controller.

Each step:

1. match the request's path in the tree (:mod:`.radix`): nodes on the device are
   *device hits*, nodes only on the host are *host hits* and are loaded back (``load``
   per node, then one ``start_loading``); the path ends before a load that cannot start;
2. prefill the rest (new document nodes and the suffix): allocate device slots (one
   Mamba slot per node for hybrid models, the trailing window for SWA; the sidecar
   pools first), write random KV/state with ``DevicePool.write_slots`` and remember it.
   These allocations land between ``start_loading()`` and ``poll_loads()``, the memory
   pressure under which an index tensor that was not ``record_stream``-ed gets its
   memory reused;
3. reap loads and compare every loaded slot with what was written (:mod:`.checker`),
   reap writes and compare the host copy;
4. count hits and write through per the controller's :class:`WritePolicy` (after 1
   hit, after ``threshold`` hits, or on eviction for ``write_back``).

Room is made by LRU eviction (:mod:`.eviction`). A transfer that fails (``Ack.ok``
false) did not move the data: a failed write frees its host slots, a failed load
drops the node (its data is lost). Everything is deterministic for a seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hicache_obs.core._controller import ANCHOR, Ack, HiCacheController, HybridCacheController
from hicache_obs.core._operations import PoolTransfer
from hicache_obs.core._spec import ModelSpec
from hicache_obs.errors import ConfigError
from hicache_obs.events._schema import D2H, H2D
from hicache_obs.lab.workload.checker import DataChecker
from hicache_obs.lab.workload.eviction import Evictor
from hicache_obs.lab.workload.faults import CallerBugs
from hicache_obs.lab.workload.radix import DocSlot, Indices, RadixNode, RadixTree
from hicache_obs.lab.workload.stats import WorkloadStats

__all__ = ["WorkloadConfig", "Request", "Workload", "controller_options", "run_workload"]


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


@dataclass(frozen=True, slots=True)
class Request:
    """One request: the first ``depth`` chunks of ``document``, then a suffix of its own."""

    document: int
    depth: int
    suffix_tokens: int
    tokens: int  # all of it: the chunks and the suffix


class Workload:
    """Drives ``controller`` with the synthetic traffic; :meth:`run` returns :class:`WorkloadStats`.

    ``fault`` names the fault the controller was built with (see
    :data:`hicache_obs.testing.FAULTS`); the workload plays the buggy caller for
    ``double-free`` and ``use-after-free`` (:mod:`.faults`) and otherwise ignores it.
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
        self.tree = RadixTree(cfg.documents, cfg.chunks_per_document)
        self.pending_writes: dict[int, RadixNode] = {}
        self.pending_loads: dict[int, RadixNode] = {}
        self.checker = DataChecker(controller, self.stats)
        self.evictor = Evictor(
            controller,
            self.tree,
            self.stats,
            self.policy,
            CallerBugs.of(fault),
            write=self._write,
            drain_writes=self._drain_writes,
        )
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
        """Serve one request (see :mod:`hicache_obs.lab.workload.driver`)."""
        self._tick += 1
        self.stats.steps += 1
        self.stats.requests += 1
        req = self._request()

        # 1. match the cached prefix and lock it
        path = self.tree.match(req.document, req.depth)
        for n in path:
            n.lock += 1
        device_hits = [n for n in path if n.device is not None]
        for n in device_hits:
            self.stats.tokens["device_hit"] += n.tokens

        # 2. load back what is on the host only
        path, queued, complete = self._load_back(path)

        # 3. prefill the rest while the loads are in flight (allocation pressure)
        created: list[RadixNode] = []
        if complete:
            created, complete = self._prefill_rest(req, path)
        if not complete:
            self.stats.truncated_requests += 1

        # 4. reap: loads of this step (check the data), writes of earlier steps
        self._complete_loads()
        self._handle_writes(self.c.poll_writes())

        # 5. hits and write-through
        self._count_hits(req, device_hits, queued)
        for n in path + created:
            n.lock -= 1
            n.last_used = self._tick

    def finish(self) -> None:
        """Wait for and reap every outstanding write and load."""
        if self.pending_loads:
            self._complete_loads()
        self._drain_writes()

    def _request(self) -> Request:
        rng = self.rng
        doc = rng.choices(range(self.cfg.documents), weights=self._weights)[0]
        depth = rng.randint(1, self.cfg.chunks_per_document)
        suffix_tokens = self._tokens(self.cfg.suffix_tokens)
        return Request(doc, depth, suffix_tokens, sum(self.documents[doc][:depth]) + suffix_tokens)

    def _load_back(self, path: list[RadixNode]) -> tuple[list[RadixNode], list[RadixNode], bool]:
        """Start a load of every node of ``path`` that is on the host only: ``(path, queued, complete)``.

        Where a load cannot start the path ends (its nodes from there on unlocked) and
        ``complete`` is False; the loads that did start are submitted either way.
        """
        queued: list[RadixNode] = []
        complete = True
        for n in [n for n in path if n.device is None]:
            if not self._load(n):
                cut = path.index(n)
                for m in path[cut:]:
                    m.lock -= 1
                path = path[:cut]
                complete = False
                break
            queued.append(n)
        if queued:
            self.c.start_loading()
        return path, queued, complete

    def _prefill_rest(self, req: Request, path: list[RadixNode]) -> tuple[list[RadixNode], bool]:
        """Create the chunks of ``req`` after ``path``, then its suffix: ``(created, complete)``."""
        created: list[RadixNode] = []
        parent = path[-1] if path else None
        for k in range(len(path), req.depth):
            node = self._prefill(parent, DocSlot(req.document, k), self.documents[req.document][k])
            if node is None:
                return created, False
            created.append(node)
            parent = node
        node = self._prefill(parent, None, req.suffix_tokens)
        if node is None:
            return created, False
        created.append(node)
        return created, True

    def _count_hits(self, req: Request, device_hits: list[RadixNode], queued: list[RadixNode]) -> None:
        """Count the tokens served from the host and computed; write through what the policy asks for."""
        served = device_hits + queued
        for n in served:
            if not n.alive or n.device is None:
                continue
            if n in queued:
                self.stats.tokens["host_hit"] += n.tokens
            n.hits += 1
            if n.host is None and n.pending_host is None and self.policy.should_write_on_hit(n.hits):
                self._write(n)
        self.stats.tokens["miss"] += req.tokens - sum(n.tokens for n in served if n.alive and n.device is not None)

    # ------------------------------------------------------------- prefill
    def _prefill(self, parent: RadixNode | None, slot: DocSlot | None, tokens: int) -> RadixNode | None:
        sizes = self._sizes(tokens)
        if not self.evictor.ensure_device(sizes):
            return None
        device: Indices = {}
        # sidecar pools first: their small index tensors are the ones an unrecorded
        # transfer lost to the allocator, so the next request reuses that memory
        for p in [*self.sidecars, ANCHOR]:
            t = self.c.alloc_device(sizes[p], pool=p)
            if t is None:  # cannot happen after ensure_device; stay correct anyway
                for q, u in device.items():
                    self.c.free_device(u, pool=q)
                return None
            device[p] = t
        node = self.tree.add(parent, slot, sizes)
        node.device = device
        for p, idx in device.items():
            node.data[p] = self._random_data(node.id, p, sizes[p])
            self.c.device_pool(p).write_slots(idx, node.data[p])
        node.lock = 1
        node.last_used = self._tick
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
    def _load(self, node: RadixNode) -> bool:
        assert node.host is not None
        if not self.evictor.ensure_device(node.sizes):
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
        lost: list[RadixNode] = []
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
                self.checker.check(node, node.device, "device", ack, H2D)
                if node.stale:  # the caller forgets the host copy it had already freed
                    node.host, node.stale = None, False
        for node in lost:
            if node.alive:
                self.stats.evictions["lost"] += 1
                self.evictor.drop(node)

    # -------------------------------------------------------------- writes
    def _write(self, node: RadixNode) -> bool:
        assert node.device is not None
        if not self.evictor.ensure_host(node.sizes):
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
                    self.evictor.free_host(host)
                    continue
                self.stats.writes["completed"] += 1
                if not node.alive:
                    self.evictor.free_host(host)
                    continue
                node.host = host
                self.checker.check(node, host, "host", ack, D2H)

    def _drain_writes(self) -> None:
        if not self.pending_writes:
            self._handle_writes(self.c.poll_writes())
            return
        self.c.synchronize()
        self._handle_writes(self.c.poll_writes())


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
