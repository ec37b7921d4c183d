"""Indices of another device handed to a pool, and frees SGLang refuses, on its real pools.

SGLang #23427 (a regression of #22940's first fix, never on PyPI): a hybrid controller moved
a Mamba transfer's host indices to the GPU in place, in the tree's own ``PoolTransfer``; the
host eviction later handed those GPU indices to ``MambaPoolHost.free``. The adapter reads the
device of the tensor each free (and each allocation's ``last_loc``) is handed, never its
values, and compares it with the device of the pool's free lists: an ``IndicesMisplaced``
before the call runs, a ``misplaced_indices`` finding. The harness keeps the device tiers on
CUDA stand-ins, so the devices differ as on a GPU.

A free that raises and changes nothing (0.5.23's host pools assert against a double free) is
a ``FreeRefused`` with what it was handed and what it raised; the exception reaches the
caller unchanged and the auditor reports the ``double_free`` the assertion saw.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache_obs.core import ModelSpec
from hicache_obs.events import EventLog
from hicache_obs.events._audit import Auditor, audit
from hicache_obs.events._schema import AuditViolation, FreeRefused, IndicesMisplaced, SlotsFreed
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang


class _Run:
    def __init__(self, spec: ModelSpec, io_backend: str = "direct", layout: str = "page_first_direct") -> None:
        from hicache_obs.lab.sglang.harness import build_controller

        self.h = build_controller(spec, io_backend=io_backend, layout=layout)
        self.log = EventLog()
        Auditor().attach(self.log)
        self.inst = instrument(self.h.controller, log=self.log)

    def events(self) -> list[Any]:
        self.log.flush()
        return list(self.log.events())

    def findings(self) -> list[Any]:
        events = self.events()
        live = [(v.rule, v.pool, v.role, v.op) for v in events if isinstance(v, AuditViolation)]
        offline = audit([e for e in events if not isinstance(e, AuditViolation)])
        assert live == [(f.rule, f.pool, f.role, f.op) for f in offline]
        return offline


def _on_device(t: torch.Tensor) -> torch.Tensor:
    from hicache_obs.lab.sglang.harness import CudaStandIn

    return t.detach().clone().as_subclass(CudaStandIn)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().as_subclass(torch.Tensor)


def test_a_mamba_host_free_handed_the_moved_device_indices_is_misplaced() -> None:
    r = _Run(ModelSpec.tiny_hybrid())
    h = r.h
    kv, mamba = h.alloc_kv(h.spec.page_size), h.alloc_mamba(1)
    host, t = h.write(kv, mamba, node_id=1)
    h.controller.start_writing()
    h.reap(wait=True)
    moved = _on_device(t.host_indices)  # what #23427's in-place move left in the tree's transfer
    before = len(r.events())
    h.mamba_host.free(moved)  # the host eviction
    new = r.events()[before:]
    misplaced = [e for e in new if isinstance(e, IndicesMisplaced)]
    assert [(e.pool, e.tier, e.call, e.expected, e.tensor.device) for e in misplaced] == [
        ("mamba", "host", "free", "cpu", "cuda:0")
    ]
    assert misplaced[0].tensor.indices is None  # its values were not read
    assert new.index(misplaced[0]) < next(i for i, e in enumerate(new) if isinstance(e, SlotsFreed))  # before the call
    found = [f for f in r.findings() if f.rule != "unrecorded_index"]  # 0.5.10's own bug (#22940)
    assert [(f.rule, f.pool, f.role, f.op) for f in found] == [("misplaced_indices", "mamba", "host", -1)]
    assert "free() was handed 1 indices on cuda:0, where the pool's indices live on cpu" in found[0].detail
    # the same eviction with the host indices as the tree keeps them since #23427: clean
    h.kv_host.free(host)
    assert [f for f in r.findings() if f.rule != "unrecorded_index"] == found and r.inst.errors == 0


def test_a_device_free_handed_host_indices_is_misplaced() -> None:
    r = _Run(ModelSpec.tiny())
    h = r.h
    kv = h.alloc_kv(2 * h.spec.page_size)
    h.kv_allocator.free(kv[: h.spec.page_size])  # a device tensor: clean
    h.kv_allocator.free(_plain(kv[h.spec.page_size :]))  # the same slots' values, on the CPU
    found = r.findings()
    assert [(f.rule, f.pool, f.role) for f in found] == [("misplaced_indices", "kv", "device")]
    assert "on cpu, where the pool's indices live on cuda:0" in found[0].detail
    assert r.inst.errors == 0


def test_a_double_host_free_is_a_double_free_whether_sglang_refuses_it_or_not() -> None:
    r = _Run(ModelSpec.tiny())
    h = r.h
    kv = h.alloc_kv(h.spec.page_size)
    host, _ = h.write(kv, node_id=1)
    h.controller.start_writing()
    h.reap(wait=True)
    h.kv_host.free(host)
    try:
        h.kv_host.free(host)
        raised: BaseException | None = None
    except AssertionError as exc:  # 0.5.23's host pools: "Double-free detected: ..."
        raised = exc
    refused = [e for e in r.events() if isinstance(e, FreeRefused)]
    found = r.findings()
    assert [(f.rule, f.pool, f.role) for f in found] == [("double_free", "kv", "host")]
    if raised is None:  # the release frees twice: the second SlotsFreed names free slots
        assert refused == []
    else:  # SGLang's own message, unchanged, and the evidence before it left
        assert "Double-free detected" in str(raised)
        assert [(e.pool, e.tier, e.call) for e in refused] == [("kv", "host", "free")]
        assert refused[0].error.startswith("AssertionError: Double-free detected")
        assert refused[0].tensor.indices is not None  # host indices: on the CPU, read
        assert "refused them (AssertionError: Double-free detected" in found[0].detail
    assert r.inst.errors == 0


def test_a_free_that_raises_propagates_unchanged_and_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache_obs.lab.sglang.harness import build_controller

    boom = RuntimeError("SGLang's own check")

    def free(self: Any, indices: Any) -> int:  # a host pool whose free refuses everything
        raise boom

    host_cls = type(build_controller(ModelSpec.tiny(), io_backend="direct", layout="page_first_direct").kv_host)
    monkeypatch.setattr(host_cls, "free", free)
    r = _Run(ModelSpec.tiny())
    host = r.h.kv_host.alloc(r.h.spec.page_size)
    with pytest.raises(RuntimeError) as info:
        r.h.kv_host.free(host)
    assert info.value is boom  # the very exception
    refused = [e for e in r.events() if isinstance(e, FreeRefused)]
    assert [(e.pool, e.tier, e.call, e.error) for e in refused] == [
        ("kv", "host", "free", "RuntimeError: SGLang's own check")
    ]
    assert refused[0].tensor.indices == ((int(host[0]), r.h.spec.page_size),)
    assert r.findings() == [] and r.inst.errors == 0  # the slots were in use: refusing them was right
