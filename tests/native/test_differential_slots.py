"""The compiled slot maps (``hicache_obs/_slots.c``) against their pure twin
(``hicache_obs/events/_slots_py.py``): random programs of allocations, frees, checks and
peeks, and random index values for the run encoders, valid or hostile, must give the
same results, the same state after every step, and the same errors (type and message).

Both run in this interpreter: the hostile cases the C code must survive are probed in
child interpreters by ``test_fuzz_native.py`` and ``test_slots_hostile.py``.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_obs import _slots as c_slots
from hicache_obs.events import _slots_py as py_slots

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

I64 = (-(2**63), 2**63 - 1)
HUGE = [2**31 + 1, 2**32, 2**63, 2**64, -(2**63), -(2**70), 2**70]
EDGE = [0, 1, -1, 2, 7, 8, 2**31, 2**32, 2**62, 2**63 - 2, 2**63 - 1, -(2**63), 2**63, 2**64 - 1, 2**64, -(2**70)]


def outcome(fn: Any, *args: Any) -> tuple[Any, ...]:
    """What a call gives: its result, or the type and message of what it raised."""
    try:
        return ("ok", fn(*args))
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        return ("raised", type(exc).__name__, str(exc))


def state(m: Any) -> tuple[Any, ...]:
    return (
        m.capacity,
        m.page_size,
        m.used,
        m.free_pages,
        m.available,
        outcome(m.free_order) if m.free_pages <= 4096 else outcome(m.peek, 3),
        m.allocated_runs(),
        # every slot of a small map; of a big one (a count drawn near 2^31) both ends
        [m.is_allocated(s) for s in (range(-1, m.capacity + 1) if m.capacity <= 4096 else (-1, 0, m.capacity - 1))],
    )


class _Items(list):  # type: ignore[type-arg]
    """The items of an iterator drawn: each side is given its own iterator over them."""


def _fresh(v: Any) -> Any:
    return iter(list(v)) if isinstance(v, _Items) else v


# ------------------------------------------------------------------ slot maps
class Index:
    """An int-like value that is not an int (``__index__``)."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v

    def __repr__(self) -> str:
        return f"Index({self.v})"


def _value(cap: int) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.integers(-3, cap + 3),
        st.sampled_from(EDGE),
        st.integers(-3, cap + 3).map(Index),
        st.sampled_from([1.5, "2", None, True]),
    )


def _run(cap: int, ps: int) -> st.SearchStrategy[Any]:
    pair = st.tuples(st.integers(-3, cap + 3), st.integers(-2, 3 * ps + 3))
    pages = st.tuples(st.integers(0, max(cap // ps, 0)), st.integers(1, 3)).map(lambda t: (t[0] * ps, t[1] * ps))
    hostile = st.one_of(
        st.tuples(_value(cap), _value(cap)),
        st.lists(st.integers(-3, cap + 3), min_size=0, max_size=3),  # a list pair, or not a pair
        st.sampled_from([5, "ab", None, (1, 2, 3), ()]),
    )
    return st.one_of(pair, pair, pages, pages, hostile)


def _runs(cap: int, ps: int) -> st.SearchStrategy[Any]:
    runs = st.lists(_run(cap, ps), max_size=4)
    return st.one_of(
        runs.map(tuple),
        runs,  # a list: copied before it is read
        st.sampled_from([5, None, {0: 1}, "x"]),
        st.lists(st.tuples(st.integers(0, cap), st.integers(1, 3)), max_size=3).map(_Items),  # an iterator
    )


@st.composite
def program(draw: st.DrawFn) -> tuple[tuple[Any, ...], list[tuple[str, Any]]]:
    ps = draw(st.sampled_from([1, 1, 2, 3, 4, 16]))
    cap = draw(st.one_of(st.integers(0, 12).map(lambda k: k * ps), st.integers(0, 40)))
    track = draw(st.booleans())
    # a few runs taken, freed and taken again in any order: pages above the fresh ones
    # taken out of order, freed, retaken (the free list's holes)
    valid = st.one_of(
        st.tuples(st.integers(0, max(cap - 1, 0)), st.integers(1, 2 * ps)),
        st.tuples(st.integers(0, max(cap // ps - 1, 0)), st.integers(1, 2)).map(lambda t: (t[0] * ps, t[1] * ps)),
    )
    pool = draw(st.lists(valid, min_size=1, max_size=3))
    again = st.tuples(st.sampled_from(["apply_alloc", "apply_free"]), st.sampled_from(pool).map(lambda r: (r,)))
    op = st.one_of(
        again,
        again,
        again,
        st.tuples(st.sampled_from(["apply_alloc", "apply_free", "unallocated"]), _runs(cap, ps)),
        st.tuples(st.just("alloc_peeked"), st.integers(0, cap // ps + 1)),  # what the allocator does
        st.tuples(st.just("peek"), st.one_of(st.integers(-2, cap // ps + 2), st.sampled_from(EDGE), _value(cap))),
        st.tuples(st.just("is_allocated"), _value(cap)),
        st.tuples(st.sampled_from(["free_order", "allocated_runs"]), st.none()),
    )
    return (cap, ps, track), draw(st.lists(op, max_size=30))


def _step(m: Any, name: str, arg: Any) -> tuple[Any, ...]:
    if name == "alloc_peeked":
        got = outcome(m.peek, arg)
        if got[0] != "ok":
            return got
        return got, outcome(m.apply_alloc, tuple((p * m.page_size, m.page_size) for p in got[1]))
    if name in ("free_order", "allocated_runs"):
        return outcome(getattr(m, name))
    return outcome(getattr(m, name), _fresh(arg))


@SETTINGS
@given(program())
def test_slot_maps_agree_on_every_step(prog: tuple[tuple[Any, ...], list[tuple[str, Any]]]) -> None:
    args, steps = prog
    c, p = c_slots.SlotMap(*args), py_slots.SlotMap(*args)
    assert state(c) == state(p)
    for i, (name, arg) in enumerate(steps):
        got, want = _step(c, name, arg), _step(p, name, arg)
        assert got == want, (i, name, arg)
        assert state(c) == state(p), (i, name, arg)


@st.composite
def churn(draw: st.DrawFn) -> tuple[tuple[Any, ...], list[tuple[str, Any]]]:
    """Valid runs only, a few of them taken and freed again and again, with the allocator's own
    takes between: what reaches the free list's holes (pages above the fresh ones taken out of
    order, freed, taken again)."""
    ps = draw(st.sampled_from([1, 1, 2, 4]))
    cap = ps * draw(st.integers(1, 8))
    pool = draw(
        st.lists(
            st.one_of(
                st.tuples(st.integers(0, cap - 1), st.integers(1, ps + 1)),
                st.tuples(st.integers(0, cap // ps - 1), st.just(1)).map(lambda t: (t[0] * ps, ps)),
            ),
            min_size=1,
            max_size=3,
        )
    )
    op = st.one_of(
        st.tuples(st.sampled_from(["apply_alloc", "apply_free"]), st.sampled_from(pool).map(lambda r: (r,))),
        st.tuples(st.just("alloc_peeked"), st.integers(0, 2)),
    )
    return (cap, ps, True), draw(st.lists(op, min_size=3, max_size=20))


@SETTINGS
@given(churn())
def test_slot_maps_agree_under_churn(prog: tuple[tuple[Any, ...], list[tuple[str, Any]]]) -> None:
    test_slot_maps_agree_on_every_step.hypothesis.inner_test(prog)  # type: ignore[attr-defined]


@SETTINGS
@given(
    # counts up to 2^31 are valid: not drawn here, a map that big costs gigabytes of address space
    st.lists(
        st.one_of(st.integers(-3, 70), st.sampled_from(HUGE), st.sampled_from([1.5, "4", None])), min_size=1, max_size=3
    ),
    st.sampled_from([{}, {"track_pages": False}, {"track_pages": 0}, {"track_pages": "yes"}]),
)
def test_construction_agrees_hostile_counts_included(args: list[Any], kw: dict[str, Any]) -> None:
    if kw and len(args) == 3:  # an arity error: worded differently by C and Python
        args = args[:2]
    made = outcome(lambda: state(c_slots.SlotMap(*args, **kw)))
    assert made == outcome(lambda: state(py_slots.SlotMap(*args, **kw)))
    kw8 = {"capacity": 8, "page_size": 2}
    assert outcome(lambda: state(c_slots.SlotMap(**kw8))) == outcome(lambda: state(py_slots.SlotMap(**kw8)))


def test_a_map_whose_init_did_not_run_refuses_every_call() -> None:
    for mod in (c_slots, py_slots):
        blank = mod.SlotMap.__new__(mod.SlotMap)
        for call in (
            lambda b: b.apply_alloc(((0, 1),)),
            lambda b: b.apply_free(()),
            lambda b: b.unallocated(()),
            lambda b: b.is_allocated(0),
            lambda b: b.peek(1),
            lambda b: b.free_order(),
            lambda b: b.allocated_runs(),
        ):
            assert outcome(call, blank) == ("raised", "RuntimeError", "SlotMap.__init__ did not run")
        assert (blank.capacity, blank.used, blank.free_pages, blank.available) == (0, 0, 0, 0)


def test_subclasses_with_slots_and_a_reinit_agree() -> None:
    """The event log's SlotTable/AllocMap subclass SlotMap with __slots__ and call __init__ again."""
    out = []
    for mod in (c_slots, py_slots):

        class Table(mod.SlotMap):  # type: ignore[name-defined,misc]
            __slots__ = ("pool",)

            def __init__(self, cap: int) -> None:
                super().__init__(cap, 4, True)
                self.pool = "kv"

        t = Table(16)
        t.apply_alloc(((0, 8),))
        before = state(t)
        assert outcome(t.__init__, -1)[0] == "raised"  # a refused re-init leaves the map as it was
        assert state(t) == before
        t.__init__(8)
        out.append((before, state(t), hasattr(t, "__dict__"), t.pool))
    assert out[0] == out[1] and out[0][2] is False


def _changing_lists(mod: Any) -> tuple[Any, ...]:
    runs: list[Any] = []

    class Shrinking:
        def __index__(self) -> int:
            runs.clear()
            return 1

    runs.append([Shrinking(), 1])
    m = mod.SlotMap(8, 1)
    alloc = (m.apply_alloc(runs), m.used)  # read from a copy

    class Clearing:
        def __index__(self) -> int:
            values.clear()
            return 3

    values: list[Any] = [1, 2, Clearing(), 4]
    return alloc, outcome(mod.runs_of, values)


def test_runs_whose_values_change_the_list_while_read() -> None:
    want = (([], 1), ("raised", "RuntimeError", "the values changed size while they were read"))
    assert _changing_lists(c_slots) == _changing_lists(py_slots) == want


# ------------------------------------------------------------ run encoders
INTS = st.one_of(st.integers(-5, 40), st.sampled_from(EDGE), st.integers(*I64))
DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


@st.composite
def values(draw: st.DrawFn, n: int | None = None) -> Any:
    """Index values in one of the forms the encoders take, sometimes hostile."""
    size = st.integers(0, 40) if n is None else st.just(n)
    k = draw(size)
    base = draw(st.integers(-5, 40))
    ints = draw(
        st.one_of(
            st.lists(INTS, min_size=k, max_size=k),
            st.lists(st.integers(0, 3), min_size=k, max_size=k).map(  # mostly consecutive
                lambda steps: [base + i + sum(steps[: i + 1]) // 3 for i in range(len(steps))]
            ),
        )
    )
    form = draw(st.sampled_from(["list", "tuple", "numpy", "numpy", "strided", "reversed", "array", "other"]))
    if form == "list":
        return ints
    if form == "tuple":
        return tuple(ints)
    if form == "other":
        fit = [v for v in ints if I64[0] <= v <= I64[1]]
        others = [
            lambda: [*ints, 1.5],
            lambda: [*ints, "x"],
            lambda: [*ints, Index(3)],
            lambda: [Index(v) for v in fit],
            lambda: bytes(v % 256 for v in ints),
            lambda: bytearray(v % 256 for v in ints),
            lambda: 5,
            lambda: None,
            lambda: np.zeros(3),
            lambda: np.zeros((2, 2), dtype=np.int64),
            lambda: np.array(fit[0] if fit else 7, dtype=np.int64).reshape(()),
            lambda: memoryview(array("q", fit)).cast("B"),
            lambda: array("d", [1.0]),
            lambda: range(len(ints)),
            lambda: _Items(ints),
        ]
        return others[draw(st.integers(0, len(others) - 1))]()
    dtype = draw(st.sampled_from(DTYPES))
    info = np.iinfo(dtype)
    fit = [v for v in ints if info.min <= v <= info.max]
    if form == "array":
        code = {"int8": "b", "int16": "h", "int32": "i", "int64": "q", "uint8": "B", "uint16": "H"}
        code |= {"uint32": "I", "uint64": "Q"}
        return array(code[dtype], fit)
    arr = np.asarray(fit, dtype=dtype)
    if form == "strided":
        return np.repeat(arr, 2)[::2]
    if form == "reversed":
        return arr[::-1]
    return arr


def _same(fn: str, *args: Any) -> None:
    got = outcome(getattr(c_slots, fn), *(_fresh(a) for a in args))
    want = outcome(getattr(py_slots, fn), *(_fresh(a) for a in args))
    assert got == want, args
    if got[0] == "ok":
        out = got[1]
        assert type(out) is tuple and all(type(r) is tuple and r[-1] >= 1 for r in out)


@SETTINGS
@given(values())
def test_runs_of_agrees(v: Any) -> None:
    _same("runs_of", v)


@SETTINGS
@given(st.data())
def test_pair_runs_of_agrees(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 30))
    host = data.draw(values(n))
    device = data.draw(st.one_of(values(n), values()))  # as zip(): up to the shorter side
    _same("pair_runs_of", host, device)


@SETTINGS
@given(st.data())
def test_side_runs_agrees(data: st.DataObject) -> None:
    if data.draw(st.booleans()):  # the runs pair_runs_of gives
        h = data.draw(st.lists(st.integers(0, 40), max_size=30))
        d = data.draw(st.lists(st.integers(0, 40), max_size=30))
        pairs: Any = c_slots.pair_runs_of(h, d)
    else:
        item = st.one_of(
            st.tuples(INTS, INTS, st.one_of(st.integers(-2, 8), st.sampled_from(EDGE))),
            st.lists(st.integers(0, 9), max_size=4),
            st.tuples(st.sampled_from([1.5, "a", None, Index(4)]), INTS, st.integers(1, 4)),
            st.sampled_from([5, None]),
        )
        pairs = data.draw(st.one_of(st.lists(item, max_size=5), st.lists(item, max_size=5).map(tuple)))
        pairs = data.draw(st.sampled_from([pairs, pairs, 5, None]))
    side = data.draw(st.one_of(st.sampled_from([0, 1, 0, 1]), st.sampled_from([2, -1, 2**40, -(2**40), 1.5, "0"])))
    _same("side_runs", pairs, side)


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        ("runs_of", ([2**63 - 2, 2**63 - 1],)),
        ("runs_of", ([2**63 - 1, -(2**63)],)),
        ("runs_of", (np.array([2**63 - 1, 2**63 - 1], dtype=np.int64),)),
        ("runs_of", (array("Q", [2**64 - 1]),)),
        ("runs_of", (array("Q", [1, 2, 2**63]),)),
        ("runs_of", (np.array([1, 2], dtype=np.uint64),)),
        ("pair_runs_of", ([2**63 - 1, 0], [0, 1])),
        ("pair_runs_of", (array("Q", [1, 2**63]), [0])),  # the value past the shorter side is not read
        ("pair_runs_of", (np.arange(5), np.arange(3, 8)[::-1])),
        ("side_runs", (((0, 0, 2**63 - 1), (2**63 - 1, 5, 1)), 0)),
        ("side_runs", (((-(2**63), 0, 2**63 - 1), (-1, 0, 2**63 - 1)), 0)),
        ("side_runs", (((0, 9, 2), (2, 1, 3)), 0)),
    ],
)
def test_the_ends_of_64_bits_agree(fn: str, args: tuple[Any, ...]) -> None:
    _same(fn, *args)
