"""The compiled slot maps (hicache_obs/_slots.c) against the pure-Python tables they
replaced (tests/events/slot_reference.py): the same results, state and free order
after any sequence of allocations, frees, checks and peeks, valid or not."""

from __future__ import annotations

import os

import pytest
import slot_reference as ref
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_obs.events.state import AllocMap, SlotTable


def _runs(cap: int, ps: int) -> st.SearchStrategy[tuple[tuple[int, int], ...]]:
    any_run = st.tuples(st.integers(-3, cap + 3), st.integers(-2, 3 * ps + 3))
    page_run = st.tuples(st.integers(0, cap // ps), st.integers(1, 3)).map(lambda t: (t[0] * ps, t[1] * ps))
    return st.lists(st.one_of(any_run, page_run), max_size=4).map(tuple)


@st.composite
def _scenario(draw: st.DrawFn) -> tuple[int, int, list[tuple[str, object]]]:
    ps = draw(st.sampled_from([1, 2, 4, 16]))
    cap = ps * draw(st.integers(1, 12))
    op = st.one_of(
        st.tuples(st.sampled_from(["alloc", "free", "check"]), _runs(cap, ps)),
        st.tuples(st.just("peek_alloc"), st.integers(0, cap // ps + 1)),  # what the allocator does
        st.tuples(st.just("is_allocated"), st.integers(-2, cap + 2)),
    )
    return ps, cap, draw(st.lists(op, max_size=40))


def _same_state(got: SlotTable, want: ref.SlotTable) -> None:
    assert got.snapshot() == want.snapshot()
    assert (got.available, got.used) == (want.available, want.used)


@settings(max_examples=400, deadline=None)
@given(_scenario())
def test_slot_table_matches_the_python_tables(scenario: tuple[int, int, list[tuple[str, object]]]) -> None:
    ps, cap, ops = scenario
    got, want = SlotTable("kv", "host", cap, ps), ref.SlotTable("kv", "host", cap, ps)
    for name, arg in ops:
        if name == "alloc":
            assert got.apply_alloc(arg) == want.apply_alloc(arg)
        elif name == "free":
            assert got.apply_free(arg) == want.apply_free(arg)
        elif name == "check":
            assert got.unallocated(arg) == want.unallocated(arg)
        elif name == "is_allocated":
            assert got.is_allocated(arg) == want.is_allocated(arg)
        else:
            k = int(arg)  # type: ignore[call-overload]
            if k > want._free_pages.n:
                with pytest.raises(ValueError, match=f"peek of {k} pages with {want._free_pages.n} free"):
                    got.peek(k)
                continue
            pages = got.peek(k)
            assert pages == want.peek(k)
            runs = tuple((p * ps, ps) for p in pages)
            assert got.apply_alloc(runs) == want.apply_alloc(runs) == []
        _same_state(got, want)


@settings(max_examples=200, deadline=None)
@given(_scenario())
def test_alloc_map_matches_the_python_map(scenario: tuple[int, int, list[tuple[str, object]]]) -> None:
    _, cap, ops = scenario
    got, want = AllocMap(cap), ref.AllocMap(cap)
    for name, arg in ops:
        if name in ("alloc", "free", "check"):
            method = {"alloc": "apply_alloc", "free": "apply_free", "check": "unallocated"}[name]
            assert getattr(got, method)(arg) == getattr(want, method)(arg)
    assert got.allocated_runs() == ref.runs_from_list([i for i, v in enumerate(want._alloc) if v])


def test_page_sizes_above_255_and_runs_beyond_64_bits() -> None:
    t = SlotTable("kv", "host", 1024, 512)  # the Python table kept page counts in bytes
    assert t.apply_alloc(((0, 512),)) == [] and t.available == 512 and t.peek(1) == [1]
    assert t.apply_free(((0, 256),)) == [] and t.available == 512
    assert t.apply_free(((256, 256),)) == [] and t.free_order() == [1, 0]
    huge = 1 << 70
    assert t.apply_alloc(((huge, 2),)) == [huge, huge + 1]
    assert t.unallocated(((3, huge),)) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert t.apply_free(((5, -huge),)) == [5] and t.used == 0
    assert not t.is_allocated(huge)


def test_bad_input_names_what_was_wrong() -> None:
    t = SlotTable("kv", "host", 16, 4)
    with pytest.raises(TypeError, match=r"a run is a \(start, length\) pair, got \(1, 2, 3\)"):
        t.apply_alloc(((1, 2, 3),))
    with pytest.raises(TypeError, match="sequence of"):
        t.apply_free(5)
    with pytest.raises(TypeError):
        t.apply_alloc(((1.5, 2),))
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        SlotTable("kv", "host", 16, 0)
    with pytest.raises(ValueError, match=r"capacity must be in 0\.\.2147483648, got -1"):
        AllocMap(-1)
    with pytest.raises(TypeError, match="tracks pages"):
        AllocMap(4).peek(1)
    assert t.used == 0 and t.available == 16  # nothing was applied
    blank = SlotTable.__new__(SlotTable)
    with pytest.raises(RuntimeError, match="__init__ did not run"):
        blank.apply_alloc(())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
def test_untouched_pages_cost_no_memory() -> None:
    # a pool of 2^28 slots (the schema's bound): about 3.5 GiB of maps if they were touched
    before = _rss_bytes()
    t = SlotTable("kv", "host", 1 << 28, 1)
    assert t.peek(3) == [0, 1, 2] and t.available == 1 << 28
    assert t.apply_alloc(((1 << 27, 4),)) == [] and t.peek(2) == [0, 1] and t.used == 4
    assert t.apply_free(((1 << 27, 4),)) == [] and t.used == 0 and t.available == 1 << 28
    assert _rss_bytes() - before < 64 << 20
