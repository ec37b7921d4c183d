"""Small real workloads on a controller, shared by the event-log tests."""

from __future__ import annotations

from typing import Any

import torch

from hicache_obs.core import HiCacheController, PoolTransfer
from hicache_obs.events._schema import (
    PoolCreated,
    SlotsAllocated,
    SlotsFreed,
    TensorRef,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
)


def run_workload(c: HiCacheController, rounds: int = 6, tokens: int = 32, *, poll: bool = True) -> dict[str, int]:
    """Write, evict, load back and free ``rounds`` nodes; returns slot counts moved per direction."""
    hybrid = c.spec.is_hybrid
    side = "mamba" if "mamba" in c.spec.pool_names else "swa"
    side_n = 1 if side == "mamba" else min(tokens, c.spec.swa_window)
    moved = {"d2h": 0, "h2d": 0}
    for i in range(rounds):
        kv = c.alloc_device(tokens)
        assert kv is not None
        transfers = None
        mb = None
        if hybrid:
            mb = c.alloc_device(side_n, pool=side)
            transfers = [PoolTransfer(side, device_indices=mb)]
        res = c.write(kv, node_id=i, pool_transfers=transfers) if hybrid else c.write(kv, node_id=i)
        assert res is not None
        host, tr = res if hybrid else (res, None)
        moved["d2h"] += tokens
        if not poll:
            continue
        c.poll_writes()
        c.evict_device(kv)
        if mb is not None:
            c.evict_device(mb, pool=side)
        if hybrid:
            assert tr is not None
            got = c.load(host, node_id=i, pool_transfers=[PoolTransfer(side, host_indices=tr[0].host_indices)])
            assert got is not None
            dev, tr2 = got
        else:
            dev = c.load(host, node_id=i)
            assert dev is not None
        c.start_loading()
        c.poll_loads()
        moved["h2d"] += tokens
        c.evict_device(dev)
        if hybrid:
            c.evict_device(tr2[0].device_indices, pool=side)
            c.evict_host(tr[0].host_indices, pool=side)
        c.evict_host(host)
    return moved


def fill(c: HiCacheController, pool: str, idx: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """Write seeded random data into device slots; returns what was written."""
    g = torch.Generator().manual_seed(seed)
    dp = c.device_pool(pool)
    n = idx.numel()
    data = {
        name: torch.randn((p.shape[0], n, *p.shape[2:]), generator=g).to(p.dtype) for name, p in dp.planes.items()
    }
    dp.write_slots(idx, data)
    return data


def hybrid_round_trip(
    c: HiCacheController, *, with_data: bool = False, evict_host_first: bool = False, double_evict: bool = False
) -> None:
    """A hybrid write and load back of one node (the scenario each fault shows itself in):
    ``with_data`` fills the slots first; ``evict_host_first`` evicts the host copy before
    the load (``double_evict``: twice, and no load)."""
    kv = c.alloc_device(32)
    mb = c.alloc_device(1, pool="mamba")
    if with_data:
        fill(c, "kv", kv, 1)
        fill(c, "mamba", mb, 2)
    host, tr = c.write(kv, node_id=7, pool_transfers=[PoolTransfer("mamba", device_indices=mb)])
    c.poll_writes()
    c.evict_device(kv)
    c.evict_device(mb, pool="mamba")
    if evict_host_first:
        c.evict_host(host)
        if double_evict:
            c.evict_host(host)
            return
    c.load(host, node_id=7, pool_transfers=[PoolTransfer("mamba", host_indices=tr[0].host_indices)])
    c.start_loading()
    c.poll_loads()


class EventList:
    """Builds a gap-free event sequence for one rank."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def add(self, cls: type, **fields: Any) -> None:
        self.events.append(cls(seq=len(self.events), ts_ns=1_000 + len(self.events), **fields))

    def pool(self, capacity: int = 1024) -> EventList:
        self.add(PoolCreated, pool="kv", tier="host", capacity=capacity, page_size=1, slot_bytes=2, layout="layer_first")
        return self

    def alloc(self, *runs: tuple[int, int]) -> None:
        self.add(SlotsAllocated, pool="kv", tier="host", indices=tuple(runs))

    def free(self, *runs: tuple[int, int]) -> None:
        self.add(SlotsFreed, pool="kv", tier="host", indices=tuple(runs), reason="evict")

    def submit(self, op: int, *runs: tuple[int, int]) -> None:
        n = sum(length for _, length in runs)
        ref = TensorRef(pool="kv", role="host", device="cpu", numel=n, dtype="int64", ptr=1, indices=tuple(runs))
        self.add(
            TransferSubmitted,
            op=op,
            direction="d2h",
            stream="hicache-write",
            io_backend="direct",
            layout="layer_first",
            tensors=(ref,),
            slots_by_pool=(("kv", n),),
            bytes_by_pool=(("kv", 2 * n),),
            device="cpu",
        )

    def done(self, op: int) -> None:
        self.add(TransferCompleted, op=op, direction="d2h", duration_ns=5)

    def failed(self, op: int) -> None:
        self.add(TransferFailed, op=op, direction="d2h", error="refused")
