"""Fixtures of the core tests: the runtime x model matrix and a small cache kit.

``runtime_name`` runs a test on ``cpu``, ``sim`` and (marked ``cuda``) ``cuda``;
``spec_name`` on the plain ``tiny`` model and the hybrid ``tiny_hybrid`` (KV +
Mamba) and ``tiny_swa`` (KV + SWA) models. ``make_controller`` builds the
controller class that fits the model and closes it after the test. ``cache_kit``
holds helpers that write, read and move whole "nodes" (a KV part plus one part
per sidecar pool) so each test reads as its scenario.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hicache_obs.core import HiCacheController, HybridCacheController, ModelSpec, PoolTransfer

RUNTIMES = ["cpu", "sim", pytest.param("cuda", marks=pytest.mark.cuda)]
SPECS = ["tiny", "tiny_hybrid", "tiny_swa"]

#: Slots per node in each sidecar pool (KV takes the size the test asks for).
SIDECAR_SLOTS = {"mamba": 2, "swa": 16}

Node = dict[str, torch.Tensor]  # pool -> indices (device or host)
Data = dict[str, dict[str, torch.Tensor]]  # pool -> plane -> (layers, n, *item)

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(params=RUNTIMES)
def runtime_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=SPECS)
def spec_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def controller_class(spec: ModelSpec) -> type[HiCacheController]:
    return HybridCacheController if spec.is_hybrid else HiCacheController


@pytest.fixture
def make_controller(request: pytest.FixtureRequest) -> Iterator[Callable[..., HiCacheController]]:
    """``make_controller(spec=..., runtime=..., **options)``.

    ``spec``/``runtime`` default to the test's ``spec_name``/``runtime_name``, which the
    test must then request itself (that is what parametrizes it over the matrix).
    """
    made: list[HiCacheController] = []

    def make(spec: ModelSpec | str | None = None, runtime: Any = None, cls: type | None = None, **kw: Any) -> Any:
        if spec is None:
            spec = request.getfixturevalue("spec_name")
        if isinstance(spec, str):
            spec = ModelSpec.preset(spec)
        if runtime is None:
            runtime = request.getfixturevalue("runtime_name")
        kw.setdefault("device_size", 64)
        c = (cls or controller_class(spec))(spec, runtime=runtime, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


class CacheKit:
    """Helpers over a controller, the same for plain and hybrid ones."""

    @staticmethod
    def sidecars(c: HiCacheController) -> list[str]:
        return [p for p in c.spec.pool_names if p != "kv"]

    def alloc_node(self, c: HiCacheController, kv_slots: int = 32) -> Node:
        node = {"kv": c.alloc_device(kv_slots)}
        for p in self.sidecars(c):
            node[p] = c.alloc_device(SIDECAR_SLOTS[p], pool=p)
        missing = [p for p, t in node.items() if t is None]
        assert not missing, f"test set-up: device pools {missing} are full"
        return node  # type: ignore[return-value]

    @staticmethod
    def random_data(c: HiCacheController, pool: str, n: int, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        dp = c.device_pool(pool)
        return {
            p.name: torch.randn((len(dp.layer_ids), n, *p.item_shape), generator=g).to(p.dtype) for p in dp.plane_specs
        }

    def fill(self, c: HiCacheController, node: Node, seed: int) -> Data:
        """Write random data (a function of ``seed``) into the node's device slots; returns it."""
        data = {}
        for i, (pool, idx) in enumerate(node.items()):
            data[pool] = self.random_data(c, pool, idx.numel(), seed * 31 + i)
            c.device_pool(pool).write_slots(idx, data[pool])
        return data

    @staticmethod
    def read_device(c: HiCacheController, node: Node) -> Data:
        return {pool: c.device_pool(pool).read_slots(idx) for pool, idx in node.items()}

    @staticmethod
    def read_host(c: HiCacheController, host: Node) -> Data:
        return {pool: c.host_pool(pool).read_slots(idx) for pool, idx in host.items()}

    @staticmethod
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(_INT_VIEW[t.element_size()])

    def same(self, a: Data, b: Data) -> bool:
        """Bit-identical, pool by pool and plane by plane."""
        if a.keys() != b.keys():
            return False
        for pool in a:
            if a[pool].keys() != b[pool].keys():
                return False
            for plane in a[pool]:
                x, y = a[pool][plane], b[pool][plane]
                if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(self.bits(x), self.bits(y)):
                    return False
        return True

    def write(self, c: HiCacheController, node: Node, node_id: int = -1, priority: int | None = None) -> Node | None:
        """Back the node up; returns its host indices per pool, or None when the host is full."""
        if isinstance(c, HybridCacheController):
            transfers = [PoolTransfer(p, device_indices=node[p]) for p in node if p != "kv"] or None
            res = c.write(node["kv"], priority, node_id, pool_transfers=transfers)
            if res is None:
                return None
            host, resolved = res
            out = {"kv": host}
            for t in resolved or ():
                assert t.host_indices is not None
                out[t.pool] = t.host_indices
            return out
        h = c.write(node["kv"], priority, node_id)
        return None if h is None else {"kv": h}

    def load(self, c: HiCacheController, host: Node, node_id: int = -1, priority: int | None = None) -> Node | None:
        """Queue a load of the node; returns its new device indices per pool, or None when full."""
        if isinstance(c, HybridCacheController):
            transfers = [PoolTransfer(p, host_indices=host[p]) for p in host if p != "kv"] or None
            res = c.load(host["kv"], priority, node_id, pool_transfers=transfers)
            if res is None:
                return None
            dev, resolved = res
            out = {"kv": dev}
            for t in resolved or ():
                assert t.device_indices is not None
                out[t.pool] = t.device_indices
            return out
        d = c.load(host["kv"], priority, node_id)
        return None if d is None else {"kv": d}

    @staticmethod
    def evict_device(c: HiCacheController, node: Node) -> None:
        for pool, idx in node.items():
            c.evict_device(idx, pool=pool)

    @staticmethod
    def evict_host(c: HiCacheController, host: Node) -> None:
        for pool, idx in host.items():
            c.evict_host(idx, pool=pool)

    @staticmethod
    def values(c: HiCacheController, t: torch.Tensor) -> list[int]:
        return c.runtime.to_host(t).tolist()  # type: ignore[no-any-return]

    @staticmethod
    def used(c: HiCacheController) -> dict[str, int]:
        return {f"{p}/{t}": tab.used for (p, t), tab in c.state.tables.items()}


@pytest.fixture
def cache_kit() -> CacheKit:
    return CacheKit()


class Unchanged:
    """Snapshot of everything a rejected call must leave alone: bookkeeping, log, pool bytes, queued work."""

    def __init__(self, c: HiCacheController) -> None:
        self.c = c
        self.state = c.state.snapshot()
        self.log_len = len(c.log)
        self.data = self._data()
        self.pending = self._pending()

    def _data(self) -> dict[str, torch.Tensor]:
        rt = self.c.runtime
        out = {}
        for tier, pools in (("device", self.c.device_pools), ("host", self.c.host_pools)):
            for name, pool in pools.items():
                for plane, t in pool.planes.items():
                    out[f"{tier}/{name}/{plane}"] = rt.to_host(t).clone()
        return out

    def _pending(self) -> int:
        pending = getattr(self.c.runtime, "pending_work", None)
        return int(pending()) if pending is not None else 0

    def check(self) -> None:
        c = self.c
        assert c.state.snapshot() == self.state, "the bookkeeping changed"
        assert len(c.log) == self.log_len, f"events were logged: {c.log.events()[self.log_len :]}"
        assert self._pending() == self.pending, "work was queued"
        now = self._data()
        changed = [k for k in self.data if not torch.equal(CacheKit.bits(now[k]), CacheKit.bits(self.data[k]))]
        assert not changed, f"pool data changed: {changed}"


def _assert_rejected(
    c: HiCacheController, error: type[BaseException], call: Callable[[], object], *fragments: str
) -> BaseException:
    """``call()`` raises ``error`` (a HiCacheError) naming every fragment, and changes nothing."""
    from hicache_obs.errors import HiCacheError

    assert issubclass(error, HiCacheError)
    before = Unchanged(c)
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, (
        f"expected exactly {error.__name__}, got {type(info.value).__name__}: {info.value}"
    )
    msg = str(info.value)
    missing = [f for f in fragments if f not in msg]
    assert not missing, f"message {msg!r} does not name {missing}"
    before.check()
    return info.value


@pytest.fixture
def assert_rejected() -> Callable[..., BaseException]:
    """``assert_rejected(controller, ErrorClass, lambda: call(...), *fragments_the_message_names)``."""
    return _assert_rejected
