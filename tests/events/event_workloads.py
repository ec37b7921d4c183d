"""Small real workloads on a controller, shared by the event-log tests."""

from __future__ import annotations

import torch

from hicache_obs.core import HiCacheController, PoolTransfer


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
