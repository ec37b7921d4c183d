"""Hypothesis-driven probes of every C entry point, each batch in a child interpreter.

A batch of probes (see ``native_kit``) runs in a fresh interpreter: a crash is a
non-zero signal exit (or a sanitizer report under ``make sanitize``) and fails the
test with the probe it died on. ``HICACHE_FUZZ_EXAMPLES`` sets the number of batches
per entry point (default 6 here: a few seconds; CI's sanitizer job runs the default,
a longer local run e.g. ``HICACHE_FUZZ_EXAMPLES=300``).
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_kit import run_probes

EXAMPLES = int(os.environ.get("HICACHE_FUZZ_EXAMPLES", "6"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
BATCH = 40

EDGE = [0, 1, -1, 2, 3, 7, 8, 63, 64, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63), 2**63, 2**64 + 1, -(2**70)]


def _big(v: int) -> Any:
    return {"int": str(v)} if abs(v) >= 2**53 else v


small = st.integers(-3, 70)
hostile_int = st.one_of(small, st.sampled_from(EDGE), st.integers(-(2**65), 2**65)).map(_big)

# ---------------------------------------------------------------- copy_runs
stride = st.one_of(st.sampled_from([1, 2, 3, 4, 8, 16, 64, 128, 256, 1024]), hostile_int)


@st.composite
def copy_probe(draw: st.DrawFn) -> dict[str, Any]:
    layers = draw(st.one_of(st.integers(1, 4), hostile_int))
    chunk = draw(st.one_of(st.sampled_from([1, 2, 16, 64, 128]), hostile_int))
    geometry = [layers, chunk]
    for _ in range(2):  # dst, src: slots, slot stride, layer stride, mostly a real layout
        slots = draw(st.one_of(st.integers(0, 40), st.sampled_from([-1, -2, -(2**63) + 5]), hostile_int))
        if draw(st.booleans()) and isinstance(chunk, int) and isinstance(slots, int) and isinstance(layers, int):
            pad = draw(st.sampled_from([0, 0, 16, -1]))
            if draw(st.booleans()):  # layer_first
                geometry += [slots, chunk + pad, max(slots, 0) * (chunk + pad) + max(pad, 0)]
            else:  # page_first
                geometry += [slots, max(layers, 0) * (chunk + pad), chunk + pad]
        else:
            geometry += [slots, draw(stride), draw(stride)]
    start = st.one_of(st.integers(0, 40), hostile_int)
    length = st.one_of(st.integers(1, 8), st.sampled_from([2**63 - 1, 2**62, 2**32, 0, -1]).map(_big), hostile_int)
    runs = draw(st.lists(st.tuples(start, start, length), max_size=2))
    runs += draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 8)), max_size=3))
    addr = draw(st.sampled_from(["real", "real", "real", "null", "negative", "top", "beyond", "low"]))
    return {
        "geometry": geometry,
        "runs": [list(r) for r in runs],
        "swap": draw(st.booleans()),
        "addr": addr,
        "format": draw(st.sampled_from(["q", "q", "q", "l", "i", "b", "bytes", "d"])),
    }


@FUZZ
@given(st.lists(copy_probe(), min_size=1, max_size=BATCH))
def test_copy_runs_survives_hostile_arguments(probes: list[dict[str, Any]]) -> None:
    _, failure = run_probes("copy", probes)
    assert not failure, failure


# ------------------------------------------------------------------- _slots
run = st.one_of(
    st.tuples(hostile_int, hostile_int).map(list),
    st.sampled_from(["ab", None, 3, [1], [1, 2, 3]]),
)
calls = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["apply_alloc", "apply_free", "unallocated"]), st.lists(run, max_size=4)),
        st.tuples(st.sampled_from(["peek", "is_allocated"]), st.one_of(hostile_int, st.sampled_from(["x", None]))),
        st.tuples(st.sampled_from(["free_order", "allocated_runs"]), st.none()),
    ),
    max_size=12,
)
ints_for = {
    "list": hostile_int,
    "q": st.integers(-(2**63), 2**63 - 1),
    "b": st.integers(-128, 127),
    "H": st.integers(0, 2**16 - 1),
    "Q": st.integers(0, 2**64 - 1),
    "i": st.integers(-(2**31), 2**31 - 1),
}


@st.composite
def slots_probe(draw: st.DrawFn) -> dict[str, Any]:
    op = draw(st.sampled_from(["map", "map", "runs_of", "pair_runs_of", "side_runs"]))
    if op == "map":
        cap = draw(st.one_of(st.integers(0, 300), st.sampled_from([-1, 2**31 + 1, 2**63 - 1])))
        page = draw(st.one_of(st.sampled_from([1, 2, 4, 16]), st.sampled_from([0, -3, 2**40])))
        return {"op": op, "args": [_big(cap), _big(page), draw(st.booleans())], "calls": draw(calls)}
    fmt = draw(st.sampled_from(list(ints_for)))
    vals = st.lists(ints_for[fmt].map(_big) if fmt != "list" else ints_for[fmt], max_size=20)
    if op == "runs_of":
        return {"op": op, "args": [draw(vals), fmt]}
    if op == "pair_runs_of":
        return {"op": op, "args": [draw(vals), draw(vals), fmt]}
    pairs = st.lists(st.one_of(st.tuples(hostile_int, hostile_int, hostile_int).map(list), st.just([1, 2])), max_size=6)
    return {"op": op, "args": [draw(pairs), draw(st.sampled_from([0, 1, 2, -1]))]}


@FUZZ
@given(st.lists(slots_probe(), min_size=1, max_size=BATCH))
def test_slot_maps_and_run_encoders_survive_hostile_arguments(probes: list[dict[str, Any]]) -> None:
    _, failure = run_probes("slots", probes)
    assert not failure, failure


# ----------------------------------------------------------------- _logcore
step = st.one_of(
    st.tuples(st.sampled_from(["set_seq", "set_published", "publish", "rebind"]), hostile_int),
    st.tuples(st.just("ring"), st.sampled_from(["clear", "append", "pop"])),
    st.tuples(st.just("sub"), st.sampled_from(["interrupt", "emits", "fails"])),
    st.tuples(st.just("emit"), st.sampled_from(["event", "event", "event", "none", "int", "wrong_seq", "raises"])),
    st.tuples(
        st.just("handoff"), st.tuples(hostile_int, hostile_int, st.sampled_from([0.01, 1.0, -1.0, 1e9])).map(list)
    ),
    st.tuples(
        st.just("gap_free_run"),
        st.lists(
            st.tuples(st.one_of(hostile_int, st.sampled_from(["x"])), st.sampled_from([0, 1, "r"])).map(list),
            max_size=6,
        ),
    ),
)


@st.composite
def logcore_probe(draw: st.DrawFn) -> dict[str, Any]:
    return {"ring": draw(st.sampled_from([1, 2, 4, 16, 3, 0])), "steps": draw(st.lists(step, max_size=16))}


@FUZZ
@given(st.lists(logcore_probe(), min_size=1, max_size=BATCH))
def test_the_log_core_survives_hostile_state_and_classes(probes: list[dict[str, Any]]) -> None:
    _, failure = run_probes("logcore", probes)
    assert not failure, failure
