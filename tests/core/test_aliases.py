"""Pools that reuse another pool's indices (``indices_from_pool``), alone and merged."""

from __future__ import annotations

import pytest
import torch

from hicache_obs.core import HybridCacheController, ModelSpec, PoolTransfer
from hicache_obs.errors import UnresolvedTransferError
from hicache_obs.events import TransferSubmitted


def _swa_filled(c: HybridCacheController, value: float) -> None:
    sw = c.device_pool("swa")
    every = c.runtime.to_device(torch.arange(sw.size))
    sw.write_slots(every, {n: torch.full((p.shape[0], sw.size, *p.shape[2:]), value) for n, p in sw.planes.items()})


@pytest.mark.parametrize("merged", [False, True])
def test_an_alias_moves_only_for_the_op_that_asked(merged: bool) -> None:
    spec = ModelSpec.tiny_swa()
    c = HybridCacheController(spec, runtime="sim", device_size=256)
    ps = spec.page_size
    dev_a, dev_b = c.alloc_device(ps), c.alloc_device(ps)
    host_a, _ = c.write(dev_a, pool_transfers=[PoolTransfer("swa", indices_from_pool="kv")])
    host_b, _ = c.write(dev_b)
    c.synchronize()
    c.poll_writes()
    _swa_filled(c, 7.0)
    c.load(host_a, pool_transfers=[PoolTransfer("swa", indices_from_pool="kv")])
    if not merged:
        c.start_loading()
        c.poll_loads()
    dev_b2, _ = c.load(host_b)  # B asks for KV only
    c.start_loading()
    c.poll_loads()
    got = c.device_pool("swa").read_slots(dev_b2)
    assert all(bool((v == 7).all()) for v in got.values()), "B's sliding-window state was overwritten"
    loads = [dict(e.slots_by_pool) for e in c.log.events() if isinstance(e, TransferSubmitted) and e.direction == "h2d"]
    if merged:
        assert loads == [{"kv": 2 * ps, "swa": ps}]
    else:
        assert loads == [{"kv": ps, "swa": ps}, {"kv": ps}]


def test_an_alias_of_a_pool_the_request_does_not_move_is_refused_up_front() -> None:
    spec = ModelSpec(
        name="both", num_layers=6, num_kv_heads=2, head_dim=16, page_size=1,
        mamba_layer_ids=(0, 1), mamba_conv_shape=(4, 3), mamba_ssm_shape=(2, 4),
        swa_layer_ids=(3, 4), swa_window=8,
    )  # fmt: skip
    c = HybridCacheController(spec, runtime="sim", device_size=64, pool_sizes={"mamba": 64, "swa": 64})
    kv = c.alloc_device(2)
    before, n = c.state.snapshot(), len(c.log)
    with pytest.raises(UnresolvedTransferError, match="reuses pool 'mamba', which this request does not move"):
        c.write(kv, pool_transfers=[PoolTransfer("swa", indices_from_pool="mamba")])
    assert c.state.snapshot() == before and len(c.log) == n
