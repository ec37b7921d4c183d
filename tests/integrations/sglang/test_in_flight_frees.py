"""A free handed the indices of a write still in flight, seen without reading a device value.

With the ``kernel`` backend a write's device indices are device tensors: the adapter never
reads their values (a sync on a GPU), so the log does not say which device slots the write
reads. The evidence of a use after free is then the tensor itself: a free handed the very
tensor (or a view of its memory) that an op in flight received is an ``IndicesFreed``, and
the auditor reports ``slot_not_allocated`` for that op. With the ``direct`` backend the
slot values are known and the ``SlotsFreed`` check reports it. A free after the op
completed, or of other memory, is no finding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache_obs.core import ModelSpec
from hicache_obs.events import EventLog
from hicache_obs.events._audit import Auditor, audit
from hicache_obs.events._schema import AuditViolation, IndicesFreed
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang


class _Run:
    def __init__(self, io_backend: str) -> None:
        from hicache_obs.lab.sglang.harness import build_controller

        self.h = build_controller(ModelSpec.tiny(), io_backend=io_backend)
        self.log = EventLog()
        Auditor().attach(self.log)
        self.inst = instrument(self.h.controller, log=self.log)

    def write(self, kv: torch.Tensor) -> None:
        host, _ = self.h.write(kv, node_id=3)
        assert host is not None
        self.h.controller.start_writing()

    def findings(self) -> tuple[list[Any], list[Any]]:
        self.log.flush()
        events = self.log.events()
        live = [e for e in events if isinstance(e, AuditViolation)]
        offline = audit([e for e in events if not isinstance(e, AuditViolation)])
        return live, offline


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_freeing_the_indices_of_a_write_in_flight_is_a_use_after_free(io_backend: str) -> None:
    r = _Run(io_backend)
    page = r.h.spec.page_size
    kv = r.h.alloc_kv(2 * page)
    r.write(kv)
    r.h.kv_allocator.free(kv)  # the write's ack is not taken yet: the op is in flight
    r.h.reap(wait=True)
    live, offline = r.findings()
    assert [(f.rule, f.pool, f.role) for f in offline] == [("slot_not_allocated", "kv", "device")], offline
    assert [(v.rule, v.pool, v.op) for v in live] == [(f.rule, f.pool, f.op) for f in offline]
    assert "still uses them" in offline[0].detail
    freed = [e for e in r.log.events() if isinstance(e, IndicesFreed)]
    if io_backend == "kernel":  # no slot value known: the tensor is the evidence
        assert [(e.pool, e.tier, e.ops) for e in freed] == [("kv", "device", (offline[0].op,))]
        assert freed[0].tensor.indices is None and freed[0].tensor.numel == 2 * page
    else:  # the slots are known: the SlotsFreed check reports it
        assert freed == []
    assert r.inst.errors == 0


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_a_view_of_the_indices_is_the_same_memory(io_backend: str) -> None:
    r = _Run(io_backend)
    page = r.h.spec.page_size
    kv = r.h.alloc_kv(2 * page)
    r.write(kv)
    r.h.kv_allocator.free(kv[page:])  # the tree splits a node: its half is a view
    r.h.reap(wait=True)
    _, offline = r.findings()
    assert [(f.rule, f.pool) for f in offline] == [("slot_not_allocated", "kv")]


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_frees_after_completion_or_of_other_memory_are_clean(io_backend: str) -> None:
    r = _Run(io_backend)
    page = r.h.spec.page_size
    both = r.h.alloc_kv(2 * page)
    first, second = both[:page], both[page:]  # two nodes' views of one allocation
    other = r.h.alloc_kv(page)
    r.write(first)
    r.h.kv_allocator.free(second)  # the same storage, other slots: not the write's
    r.h.kv_allocator.free(other)
    r.h.reap(wait=True)
    r.h.kv_allocator.free(first)  # the write completed: its slots are the tree's to free
    live, offline = r.findings()
    assert live == [] and offline == []
    assert [e for e in r.log.events() if isinstance(e, IndicesFreed)] == []
    assert r.inst.errors == 0
