"""Allocator methods SGLang took before the controller was instrumented.

SGLang's tree components keep bound methods of the allocators from when the tree was built
(0.5.12 and 0.5.13: ``self._free_full = allocator.free``), before any controller exists.
``instrument()`` finds such references where they are held and puts its hook there, so
the frees through them are events too; ``detach()`` puts the originals back. A
reference it cannot rewrite (a slot, a tuple) is named in one warning.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from hicache_obs.core import ModelSpec
from hicache_obs.core._torch_compat import plain_tensor_calls
from hicache_obs.events import EventLog
from hicache_obs.events._schema import SlotsFreed
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang


class _Component:  # holds a bound method as an instance attribute, as SGLang's components do
    def __init__(self, free: Any) -> None:
        self._free_full = free


class _Slotted:
    __slots__ = ("free",)

    def __init__(self, free: Any) -> None:
        self.free = free


def _plain(t: torch.Tensor) -> set[int]:
    with plain_tensor_calls():
        return set(t.detach().clone().as_subclass(torch.Tensor).tolist())


def _slots(events: list[Any], cls: type) -> set[int]:
    out: set[int] = set()
    for e in events:
        if isinstance(e, cls) and e.pool == "kv" and e.tier == "device":
            out |= {s for start, n in e.indices for s in range(start, start + n)}
    return out


def test_frees_through_methods_taken_before_instrumenting_are_seen_and_restored() -> None:
    from hicache_obs.lab.sglang.harness import build_controller

    h = build_controller(ModelSpec.tiny(), io_backend="direct")
    allocator = h.kv_allocator
    component = _Component(allocator.free)
    held = [allocator.free]
    table = {"free": allocator.free}
    free = allocator.free

    def through_a_closure(t: torch.Tensor) -> None:
        free(t)

    originals = (component._free_full, held[0], table["free"], free)
    page = h.spec.page_size
    taken = [h.alloc_kv(page) for _ in range(4)]
    log = EventLog()
    inst = instrument(h.controller, log=log)
    try:
        log.flush()
        start = len(log.events())
        component._free_full(taken[0])
        held[0](taken[1])
        table["free"](taken[2])
        through_a_closure(taken[3])
        log.flush()
        freed = _slots(log.events()[start:], SlotsFreed)
        assert freed == set().union(*(_plain(t) for t in taken))
        assert inst.errors == 0
    finally:
        inst.detach()
    # SGLang's references are its own bound methods again
    assert (component._free_full, held[0], table["free"], free) == originals
    assert all(type(m).__name__ == "method" for m in (component._free_full, held[0], table["free"], free))


def test_a_reference_it_cannot_rewrite_is_named_in_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    from hicache_obs.lab.sglang.harness import build_controller

    h = build_controller(ModelSpec.tiny(), io_backend="direct")
    slotted = _Slotted(h.kv_allocator.free)
    with caplog.at_level(logging.WARNING, logger="hicache_obs.integrations.sglang"):
        with instrument(h.controller):
            pass
    lines = [r.getMessage() for r in caplog.records if "cannot see" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"{type(h.kv_allocator).__name__}.free" in lines[0] and "_Slotted" in lines[0] and "'kv'" in lines[0]
    assert type(slotted.free).__name__ == "method"  # left alone
