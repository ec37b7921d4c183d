"""A draft model's KV pool (speculative decoding) left out of the hybrid controller's copies.

SGLang 0.5.12 and 0.5.13 register a draft model's KV pool with ``set_draft_kv_pool``; the base
controller copies it with every write and load, but ``HybridCacheController`` overrides both and
never does (SGLang #27953): the draft KV is never backed up and is stale after a load. The
adapter follows a pool registered to move with the KV slots and names it in each
``TransferSubmitted`` (``sidecar_pools``); an op that moves the KV without it is
``pool_omitted``. 0.5.2x carries the draft as a host pool group entry that takes the KV
indices, named in each op by the tree.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sglang_env import release_tuple, skip_draft_with_the_kernel_backend_on_0_5_17

from hicache_obs.core import ModelSpec
from hicache_obs.core._torch_compat import plain_tensor_calls
from hicache_obs.events import EventLog
from hicache_obs.events._audit import Auditor, audit
from hicache_obs.events._schema import AuditViolation, TransferSubmitted
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang


def _harness(spec: ModelSpec, io_backend: str) -> Any:
    from hicache_obs.lab.sglang.harness import build_controller

    h = build_controller(spec, io_backend=io_backend)
    c = h.controller
    if not (callable(getattr(c, "set_draft_kv_pool", None)) or callable(getattr(c, "register_host_pool_entry", None))):
        pytest.skip("this SGLang release's controller takes no draft KV pool")
    return h


def _plain(t: torch.Tensor) -> torch.Tensor:
    with plain_tensor_calls():
        return t.detach().clone().as_subclass(torch.Tensor).to(torch.int64)


def _round_trip(h: Any, *, omit_draft: bool = False, before_attach: bool = True) -> tuple[list[Any], bool]:
    """A write then a load of KV (and a Mamba slot) with draft KV rows filled; returns the events
    and whether the draft rows came back."""
    log = EventLog()
    Auditor().attach(log)
    if before_attach:
        h.add_draft()
    inst = instrument(h.controller, log=log)
    if not before_attach:
        h.add_draft()  # as the scheduler does, after the tree built the controller
    kv = h.alloc_kv(2 * h.spec.page_size)
    mamba = h.alloc_mamba(1) if h.mamba_pool is not None else None
    idx = _plain(kv)
    with plain_tensor_calls():
        for buf in h.draft_layers():
            buf[idx] = torch.randn(buf[idx].shape).to(buf.dtype)
        want = torch.stack([buf[idx].float().clone() for buf in h.draft_layers()])
    host, t = h.write(kv, mamba, omit_draft=omit_draft)
    h.controller.start_writing()
    h.reap(wait=True)
    with plain_tensor_calls():
        for buf in h.draft_layers():
            buf[idx] = 0
    h.kv_allocator.free(kv)
    dev, _ = h.load(host, t.host_indices if t is not None else None, omit_draft=omit_draft)
    h.controller.start_loading()
    h.reap(wait=True)
    didx = _plain(dev)
    with plain_tensor_calls():
        got = torch.stack([buf[didx].float() for buf in h.draft_layers()])
    log.flush()
    assert inst.errors == 0
    inst.detach()
    return log.events(), torch.equal(got, want)


def _omitted(events: list[Any]) -> list[tuple[str, str, str]]:
    return sorted(
        (f.rule, f.pool, f.direction) for f in audit([e for e in events if not isinstance(e, AuditViolation)])
    )


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("before_attach", [True, False], ids=["registered-before", "registered-after"])
def test_the_hybrid_controller_leaves_the_draft_out_or_carries_it(io_backend: str, before_attach: bool) -> None:
    if release_tuple() < (0, 5, 11):
        pytest.skip("0.5.10's hybrid controller has its own finding first (#22940)")
    skip_draft_with_the_kernel_backend_on_0_5_17(io_backend)
    h = _harness(ModelSpec.tiny_hybrid(), io_backend)
    events, restored = _round_trip(h, before_attach=before_attach)
    subs = [e for e in events if isinstance(e, TransferSubmitted)]
    assert [e.sidecar_pools for e in subs] == [(("draft", "kv"),)] * 2
    if release_tuple() <= (0, 5, 13):  # SGLang #27953 (fixed by 0.5.18, which copies it)
        assert _omitted(events) == [("pool_omitted", "draft", "d2h"), ("pool_omitted", "draft", "h2d")]
        live = [(v.rule, v.pool, v.direction) for v in events if isinstance(v, AuditViolation)]
        assert sorted(live) == _omitted(events)
        assert not restored  # the draft KV never left the device: the load left zeros
    else:  # set_draft_kv_pool copied by the hybrid controller too, or 0.5.23's sidecar entry
        assert _omitted(events) == []
        assert restored
        assert {t.pool for e in subs for t in e.tensors} >= {"kv", "mamba", "draft"}


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_the_base_controller_copies_the_draft_and_is_clean(io_backend: str) -> None:
    h = _harness(ModelSpec.tiny(), io_backend)
    if not callable(getattr(h.controller, "set_draft_kv_pool", None)):
        pytest.skip("0.5.2x's KV-only controller takes a draft through its host pool group")
    events, restored = _round_trip(h)
    assert _omitted(events) == [] and restored


def test_an_op_that_leaves_out_a_sidecar_entry_is_pool_omitted() -> None:
    h = _harness(ModelSpec.tiny_hybrid(), "direct")
    if callable(getattr(h.controller, "set_draft_kv_pool", None)):
        pytest.skip("0.5.12 and 0.5.13 register the draft with set_draft_kv_pool (the test above)")
    events, restored = _round_trip(h, omit_draft=True)
    assert _omitted(events) == [("pool_omitted", "draft", "d2h"), ("pool_omitted", "draft", "h2d")]
    assert not restored
