"""Every path by which SGLang's allocators hand out, pre-allocate, return or clear slots.

Each test drives the real allocators and host pools of a real controller as SGLang's own
code does (the scheduler's Mamba allocation groups, its free groups, a page allocator's
extend and decode allocations and page frees, ``/flush_cache``'s clears), then checks
that the audit finds nothing and that the fold of the log, and the occupancy gauge, are
what the allocators' own free lists say.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from sglang_env import RELEASE, release_tuple

from hicache_obs.core import ModelSpec
from hicache_obs.events import EventLog
from hicache_obs.events._audit import Auditor, audit
from hicache_obs.events._schema import AuditViolation, SlotsAllocated, SlotsFreed
from hicache_obs.events._state import fold
from hicache_obs.exporters._prometheus import PrometheusSink
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang

# 0.5.10 does not record a write's Mamba indices on the stream (SGLang #22940, a true finding):
# its writes here back up the KV only
MAMBA_WRITES = release_tuple() >= (0, 5, 11)


def _free_slots(obj: Any) -> set[int]:
    """Every slot on one of SGLang's allocators' free lists, read as the allocator keeps them."""
    if hasattr(obj, "free_pages"):  # token and page allocators: pages (slots where page_size is 1)
        page = int(obj.page_size)
        parts = [obj.free_pages, getattr(obj, "release_pages", None), *(getattr(obj, "staged_pages", None) or [])]
    else:  # Mamba allocators and pools, host pools: slots
        page = 1
        parts = [obj.free_slots, *(getattr(obj, "release_slots", None) or [])]
    out: set[int] = set()
    for part in parts:
        if part is not None:
            for v in part.cpu().tolist():
                out.update(range(v * page, (v + 1) * page))
    return out


def _slots(runs: Any) -> set[int]:
    return {s + k for s, n in runs for k in range(n)}


class _Observed:
    """A real controller for ``spec``, instrumented into a log with the live auditor and a
    Prometheus sink (as the launcher wires them); ``before(harness)`` runs first."""

    def __init__(self, spec: ModelSpec | None = None, before: Callable[[Any], None] | None = None, **kw: Any) -> None:
        from hicache_obs.lab.sglang.harness import build_controller

        self.h = build_controller(spec or ModelSpec.tiny_hybrid(), io_backend="direct", **kw)
        if before is not None:
            before(self.h)
        self.log = EventLog()
        Auditor().attach(self.log)
        self.sink = PrometheusSink(log=self.log)
        self.log.add_sink(self.sink)
        self.inst = instrument(self.h.controller, log=self.log)

    def tiers(self) -> dict[tuple[str, str], Any]:
        h = self.h
        out = {("kv", "device"): h.kv_allocator, ("kv", "host"): h.kv_host}
        if h.mamba_allocator is not None:
            out[("mamba", "device")] = h.mamba_allocator
            out[("mamba", "host")] = h.mamba_host
        return out

    def check(self) -> None:
        """No finding, no anomaly, no failed read; every pool tier's fold and occupancy gauge
        are its allocator's real state."""
        self.log.flush()
        events = self.log.events()
        assert [e for e in events if isinstance(e, AuditViolation)] == []
        plain = [e for e in events if not isinstance(e, AuditViolation)]
        assert audit(plain) == []
        state = fold(plain)
        assert state.anomalies == []
        assert self.inst.errors == 0
        for (pool, tier), obj in self.tiers().items():
            table = state.table(pool, tier)
            real = set(range(table.capacity)) - _free_slots(obj)
            assert _slots(table.snapshot()["allocated"]) == real, (pool, tier)
            gauge = self.sink.registry.get_sample_value("hicache_pool_used_slots", {"pool": pool, "tier": tier})
            assert gauge == len(real), (pool, tier, gauge, len(real))


def _write_back(o: _Observed, kv: torch.Tensor, mamba: torch.Tensor | None) -> tuple[Any, Any]:
    """Back ``kv`` (and a Mamba slot, where the release records it) up to the host and reap the write."""
    host, t = o.h.write(kv, mamba if MAMBA_WRITES else None, node_id=7)
    assert host is not None
    o.h.controller.start_writing()
    assert o.h.reap(wait=True) == 1
    return host, t


# ------------------------------------------------------------------ the Mamba allocation group
def test_a_mamba_allocation_group_takes_its_batch_once() -> None:
    """The scheduler's match-prefix pass (``alloc_group_begin(len(waiting))``, one ``alloc(1)``
    per request, ``alloc_group_end()``): the batch leaves the free list at the group's start,
    the slots the requests did not take return at its end; nothing is freed twice."""
    o = _Observed()
    m = o.h.mamba_allocator
    if not callable(getattr(m, "alloc_group_begin", None)):
        pytest.skip(f"SGLang {RELEASE}'s Mamba allocator has no allocation groups")
    kept = []
    for waiting, served in ((4, 2), (2, 3)):  # fewer requests than pre-allocated; then more
        m.alloc_group_begin(waiting)
        kept += [m.alloc(1) for _ in range(served)]
        o.check()
        m.alloc_group_end()
        o.check()
    # a slot from a group is the request's state: backed up and freed as any other
    _, t = _write_back(o, o.h.alloc_kv(16), kept[0])
    o.check()
    for slot in kept:
        m.free(slot)
    if t is not None:
        o.h.mamba_host.free(t.host_indices)
    o.check()


# ------------------------------------------------------------------------- /flush_cache
def test_flush_cache_clears_every_pool_and_the_fold_follows() -> None:
    """``/flush_cache``: the tree's reset (the controller's ``reset()``, the host pool group's
    ``clear()``), then the scheduler clears the Mamba and KV allocators. Every slot in use
    returns to the free lists; the pools then serve again from their first slots."""
    o = _Observed()
    h, c = o.h, o.h.controller
    _write_back(o, h.alloc_kv(64), h.alloc_mamba(1))
    h.alloc_kv(32)
    h.alloc_mamba(2)
    o.check()
    c.reset()
    c.mem_pool_host.clear()
    h.mamba_allocator.clear()
    h.kv_allocator.clear()
    o.check()
    assert o.sink.registry.get_sample_value("hicache_pool_used_slots", {"pool": "kv", "tier": "host"}) == 0
    _write_back(o, h.alloc_kv(48), h.alloc_mamba(1))  # the same slots again: no double allocation
    o.check()


# --------------------------------------------------------------------------- free groups
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_free_group_returns_its_slots_when_it_ends(page_size: int) -> None:
    """The scheduler's batch result pass (``free_group_begin()``, frees, ``free_group_end()``):
    the frees inside the group are deferred; the slots return once, at its end."""
    o = _Observed(ModelSpec.tiny_hybrid(page_size=page_size))
    a = o.h.kv_allocator
    first, second = o.h.alloc_kv(32), o.h.alloc_kv(48)
    a.free_group_begin()
    a.free(first)
    a.free(second[:16])
    o.check()  # nothing has returned yet
    a.free_group_end()
    o.check()
    a.free(second[16:])
    o.check()


def test_page_frees_return_whole_pages() -> None:
    """A page allocator's ``free`` of some tokens of a page frees the page; 0.5.2x's
    ``free_segment``/``free_page_ids`` (also inside a free group) free pages by id."""
    o = _Observed()
    a = o.h.kv_allocator
    x = o.h.alloc_kv(64)
    a.free(x[:5])  # five tokens of the first page: the allocator frees the whole page
    o.check()
    if not callable(getattr(a, "free_page_ids", None)):
        a.free(x[16:])
        o.check()
        return
    a.free_segment(x[16:40], start_pos=16)  # pages 2 and 3 of the request, the last in part
    o.check()
    a.free_group_begin()
    a.free_page_ids(x[48:49] // a.page_size)
    o.check()
    a.free_group_end()
    o.check()


# ---------------------------------------------------------- extend and decode allocations
class _Grid:
    """A Triton kernel's ``kernel[grid](...)`` call, run by a torch function (a stand-in for the
    releases whose page allocator has no path off the GPU)."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self.fn


def _decode_naive(seq_lens, last_loc, free_pages, out_indices, _bs_pow2, page_size):  # type: ignore[no-untyped-def]
    """What SGLang's ``alloc_decode_kernel`` computes: a new page's first slot for each request
    whose next token starts a page, in request order; the next slot otherwise."""
    new_page = ((seq_lens - 1) % page_size == 0).to(torch.int64)
    rank = torch.cumsum(new_page, 0) - new_page
    starts = free_pages[rank.clamp(max=max(len(free_pages) - 1, 0))] * page_size
    out_indices.copy_(torch.where(new_page.bool(), starts, last_loc + 1))


@contextlib.contextmanager
def _page_kernels_on_cpu(allocator: Any) -> Iterator[None]:
    """The allocator's extend and decode kernels as torch code where its release has no CPU path."""
    if getattr(allocator, "use_triton_kernels", None) is False:
        yield  # it runs its own torch path here
        return
    mod = importlib.import_module(type(allocator).__module__)
    naive = mod.alloc_extend_naive

    def extend(prefix, seq, last, free, out, _bs_pow2, page):  # type: ignore[no-untyped-def]
        naive(prefix, seq, last, free, out, page, free.device)

    saved = mod.alloc_extend_kernel, mod.alloc_decode_kernel
    mod.alloc_extend_kernel, mod.alloc_decode_kernel = _Grid(extend), _Grid(_decode_naive)
    try:
        yield
    finally:
        mod.alloc_extend_kernel, mod.alloc_decode_kernel = saved


def test_extend_and_decode_allocations_take_whole_pages() -> None:
    """``alloc_extend`` gives a request's new tokens (some in the page it has, the rest in new
    pages) and ``alloc_decode`` one token each: the new pages are what leaves the free list."""
    o = _Observed()
    a = o.h.kv_allocator
    prefix = o.h.alloc_kv(16)  # a cached prefix of 10 tokens in one page
    lens = (torch.tensor([10]), torch.tensor([30]))
    with _page_kernels_on_cpu(a):
        out = a.alloc_extend(lens[0], lens[0], lens[1], lens[1], prefix[9:10].clone(), 20)
        assert out is not None
        o.check()
        step = a.alloc_decode(torch.tensor([33]), torch.tensor([33]), out[-1:].clone() + 2)  # starts a page
        assert step is not None
        o.check()
        more = a.alloc_decode(torch.tensor([34]), torch.tensor([34]), step.clone())  # in that page
        assert more is not None
        o.check()
    a.free(torch.cat([prefix, out, step, more]))
    o.check()


def test_restoring_a_backed_up_allocator_state_returns_its_slots() -> None:
    """``backup_state()`` / ``restore_state(state)`` (0.5.1x): what was allocated in between
    is free again."""
    o = _Observed()
    a = o.h.kv_allocator
    if not callable(getattr(a, "restore_state", None)):
        pytest.skip(f"SGLang {RELEASE}'s allocators keep no backup state")
    state = a.backup_state()
    o.h.alloc_kv(48)
    o.check()
    a.restore_state(state)
    o.check()


@pytest.mark.parametrize("page_size", [1, 16])
def test_sorted_frees_wait_apart_and_merge(page_size: int) -> None:
    """An allocator that sorts its frees (``need_sort``) keeps them apart until an allocation
    runs short, then merges them: slots waiting there are free when instrumenting, and the
    merge changes nothing in use."""

    def staged(h: Any) -> None:
        h.kv_allocator.need_sort = True
        h.kv_allocator.free(h.alloc_kv(64))

    o = _Observed(ModelSpec.tiny_hybrid(page_size=page_size), before=staged, device_size=256)
    o.check()
    a = o.h.kv_allocator
    x = o.h.alloc_kv(160)
    a.free(x[:64])
    o.check()
    y = o.h.alloc_kv(a.available_size())  # more than the sorted list holds: the frees merge first
    o.check()
    a.free(torch.cat([x[64:], y]))
    o.check()


def test_host_pool_frees_wait_apart_and_merge() -> None:
    """A host pool's frees wait apart (0.5.2x) until an allocation runs short."""
    o = _Observed(device_size=128)
    host = o.h.kv_host
    x = host.alloc(128)
    host.free(x[:64])
    o.check()
    y = host.alloc(host.available_size())
    o.check()
    host.free(torch.cat([x[64:], y]))
    o.check()


# --------------------------------------------------------------------------------- coverage
_FREE_LISTS = "free_pages|release_pages|staged_pages|free_slots|release_slots"
_CHANGES = re.compile(
    rf"self\.(?:{_FREE_LISTS})\b\s*(?:,[^=\n]*)?=(?!=)"  # rebinds (also ``self.a, self.b = ...``)
    rf"|self\.(?:{_FREE_LISTS})\.(?:append|extend|insert|pop|clear|remove)\("  # grows or shrinks a list
    rf"|self\.(?:{_FREE_LISTS})\[[^\]\n]*\]\s*=(?!=)"  # writes in place
)


def _changes_free_lists(obj: Any) -> set[str]:
    """The methods of an allocator's SGLang classes whose own code changes a free list."""
    out: set[str] = set()
    for cls in type(obj).__mro__:
        if not cls.__module__.startswith("sglang."):
            continue
        for name, fn in vars(cls).items():
            if name == "__init__" or not inspect.isfunction(inspect.unwrap(fn) if callable(fn) else None):
                continue
            if _CHANGES.search(inspect.getsource(inspect.unwrap(fn))):
                out.add(name)
    return out


def test_every_call_that_changes_a_free_list_is_observed() -> None:
    """Read from SGLang's own code: every method of every device allocator and host pool that
    changes a free list itself is hooked on the instance, whatever its release names it."""
    o = _Observed()
    for (pool, tier), obj in o.tiers().items():
        changers = _changes_free_lists(obj)
        assert "clear" in changers and len(changers) > 2, (pool, tier, changers)  # the scan reads SGLang's code
        assert changers <= set(vars(obj)), (pool, tier, changers - set(vars(obj)))
    o.inst.detach()
    for obj in o.tiers().values():
        assert not _changes_free_lists(obj) & set(vars(obj))  # and only while instrumented


def test_an_allocation_out_of_a_taken_batch_reports_nothing() -> None:
    """A call that leaves the free lists as they were is no event (an allocation served from a
    batch taken earlier, a free deferred to its group's end)."""
    o = _Observed()
    m = o.h.mamba_allocator
    if not callable(getattr(m, "alloc_group_begin", None)):
        pytest.skip(f"SGLang {RELEASE}'s Mamba allocator has no allocation groups")
    m.alloc_group_begin(3)
    n = len([e for e in o.log.events() if isinstance(e, (SlotsAllocated, SlotsFreed))])
    slots = [m.alloc(1) for _ in range(3)]
    assert len([e for e in o.log.events() if isinstance(e, (SlotsAllocated, SlotsFreed))]) == n
    m.alloc_group_end()
    m.free(torch.cat(slots))
    o.check()
