"""The compiled slot maps (hicache_obs/_slots.c) against the pure-Python tables they
replaced (tests/events/slot_reference.py): the same results, state and free order
after any sequence of allocations, frees, checks and peeks, valid or not; and its
run-length encoding of index values against a plain Python one."""

from __future__ import annotations

import os

import numpy as np
import pytest
import slot_reference as ref
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_obs._slots import pair_runs_of, runs_of, side_runs
from hicache_obs.core._transfer import pair_runs, tensor_pair_runs
from hicache_obs.events._schema import runs_from_list
from hicache_obs.events._state import AllocMap, SlotTable


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
    _consistent(got)


def _consistent(t: SlotTable) -> None:
    """What holds whatever the history: the free list is exactly the pages whose slots are
    all free, each once (a check that needs no oracle: it caught what both shared)."""
    ps = t.page_size
    free = [p for p in range(t.capacity // ps) if not any(t.is_allocated(p * ps + i) for i in range(ps))]
    order = t.free_order()
    assert sorted(order) == free and len(order) == len(set(order)) == t.available // ps
    assert t.used == sum(t.is_allocated(s) for s in range(t.capacity))


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


def test_a_page_taken_out_of_order_and_freed_is_listed_once() -> None:
    # what a replayed log from another allocator can do: take pages above the fresh ones
    t = SlotTable("kv", "host", 11, 1)
    assert t.apply_alloc(((0, 1), (2, 6))) == []
    assert t.apply_free(((1, 4), (0, 1))) == [1]
    order = t.free_order()
    assert sorted(order) == [0, 1, 2, 3, 4, 8, 9, 10] and len(order) == t.available == 8
    assert order == [1, 8, 9, 10, 2, 3, 4, 0]  # never-used pages first, then in the order freed
    pages = t.peek(8)
    assert t.apply_alloc(tuple((p, 1) for p in pages)) == [] and t.available == 0


@pytest.mark.parametrize(
    "steps",
    [
        [("alloc", ((2, 1),)), ("free", ((2, 1),)), ("alloc", ((2, 1),)), ("free", ((2, 1),))],
        [("alloc", ((1, 1),)), ("free", ((1, 1),)), ("alloc", ((0, 1),)), ("alloc", ((1, 1),))],
    ],
)
def test_a_freed_page_above_the_fresh_ones_taken_again_is_not_listed_free(steps: list[tuple[str, object]]) -> None:
    got, want = SlotTable("kv", "host", 4, 1), ref.SlotTable("kv", "host", 4, 1)
    for name, runs in steps:
        assert getattr(got, f"apply_{name}")(runs) == getattr(want, f"apply_{name}")(runs) == []
        _same_state(got, want)


def test_runs_whose_values_change_the_runs_while_read() -> None:
    runs: list[list[object]] = []

    class Shrinking:
        def __index__(self) -> int:
            runs.clear()  # a run's value that empties the list being read
            return 1

    runs.append([Shrinking(), 1])
    t = SlotTable("kv", "host", 8, 1)
    assert t.apply_alloc(runs) == [] and t.used == 1  # read from a copy: no dangling reference

    class Clearing:
        def __index__(self) -> int:
            values.clear()
            return 3

    values: list[object] = [1, 2, Clearing(), 4]
    with pytest.raises(RuntimeError, match="changed size while they were read"):
        runs_of(values)


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


# ------------------------------------------------------ run-length encoding
def _ref_runs(values: list[int]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for v in values:
        if out and v == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((v, 1))
    return tuple(out)


def _ref_pair_runs(host: list[int], device: list[int]) -> tuple[tuple[int, int, int], ...]:
    out: list[tuple[int, int, int]] = []
    for h, d in zip(host, device):
        if out and h == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((h, d, 1))
    return tuple(out)


_VALUES = st.lists(st.integers(-5, 40), max_size=60)


@settings(max_examples=300, deadline=None)
@given(values=_VALUES, dtype=st.sampled_from(["int64", "int32", "int16", "int8"]), step=st.sampled_from([1, 2]))
def test_runs_of_lists_and_buffers_of_every_integer_width(values: list[int], dtype: str, step: int) -> None:
    want = _ref_runs(values)
    assert runs_of(values) == runs_from_list(values) == want
    assert runs_of(tuple(values)) == want
    arr = np.repeat(np.asarray(values, dtype=dtype), step)[::step]  # a strided view when step is 2
    assert runs_of(arr) == want
    assert runs_of(torch.tensor(values, dtype=torch.int64).numpy()) == want


@settings(max_examples=300, deadline=None)
@given(host=_VALUES, device=_VALUES)
def test_pair_runs_of_matches_zip_of_both_sides(host: list[int], device: list[int]) -> None:
    want = _ref_pair_runs(host, device)
    assert pair_runs_of(host, device) == pair_runs(host, device) == want
    n = min(len(host), len(device))
    h, d = torch.tensor(host[:n], dtype=torch.int64), torch.tensor(device[:n], dtype=torch.int64)
    assert tensor_pair_runs(h, d) == want


def test_run_encoding_at_the_edges_of_64_bits_and_bad_input() -> None:
    top = (1 << 63) - 1
    assert runs_of([top - 1, top, -(1 << 63)]) == ((top - 1, 2), (-(1 << 63), 1))
    assert runs_of(np.array([top, top], dtype=np.int64)) == ((top, 1), (top, 1))  # no wrap-around
    assert runs_of(np.array([1, 2], dtype=np.uint64)) == ((1, 2),)
    with pytest.raises(OverflowError, match="does not fit in 64 bits"):
        runs_of([1 << 64])
    with pytest.raises(OverflowError, match="does not fit in 64 bits"):
        runs_of(np.array([1 << 63], dtype=np.uint64))
    with pytest.raises(TypeError, match="1-D buffer of integers is needed, got format d"):
        runs_of(np.zeros(3))
    with pytest.raises(TypeError, match="with 2 dimensions"):
        runs_of(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(TypeError):
        runs_of([1.5])
    with pytest.raises(TypeError, match="a sequence of ints"):
        runs_of(5)
    assert runs_of([]) == () and pair_runs_of([], [1]) == ()


def _ref_side_runs(pairs: tuple[tuple[int, int, int], ...], side: int) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for run in pairs:
        s, n = run[side], run[2]
        if out and s == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return tuple(out)


@settings(max_examples=300, deadline=None)
@given(host=_VALUES.map(lambda v: [abs(x) for x in v]), device=_VALUES.map(lambda v: [abs(x) for x in v]))
def test_side_runs_joins_one_side_of_the_pair_runs(host: list[int], device: list[int]) -> None:
    pairs = pair_runs_of(host, device)
    for side in (0, 1):
        assert side_runs(pairs, side) == _ref_side_runs(pairs, side)
        assert side_runs(list(pairs), side) == _ref_side_runs(pairs, side)
    n = min(len(host), len(device))
    assert side_runs(pairs, 0) == runs_of(host[:n]) and side_runs(pairs, 1) == runs_of(device[:n])
    with pytest.raises(ValueError, match=r"side must be 0 \(host\) or 1 \(device\), got 2"):
        side_runs(pairs, 2)
    with pytest.raises(TypeError, match=r"a pair run is \(host, device, length\)"):
        side_runs(((1, 2),), 0)
