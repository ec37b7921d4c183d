"""A use after free is found whatever the size of the free, live and offline.

The check used to expand the freed slots into a set, and gave up (an empty set) past
2**20 slots: a free of more slots than that, taking the slots of a transfer still in
flight, went unreported. It now intersects intervals. With more than a few ops in flight
their slots are indexed in a tree; a differential test against a set-based reference
drives it past that point.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_obs.events._audit import Auditor, Finding, audit
from hicache_obs.events._log import EventLog
from hicache_obs.events._replay import replay
from hicache_obs.events._schema import (
    PoolCreated,
    SlotsAllocated,
    SlotsFreed,
    TensorRef,
    TransferCompleted,
    TransferSubmitted,
)
from hicache_obs.events._store import JsonlStore

CAP = 1 << 23
Spec = list[tuple[type, dict[str, Any]]]


def _submit(op: int, runs: tuple[tuple[int, int], ...]) -> tuple[type, dict[str, Any]]:
    n = sum(k for _, k in runs)
    ref = TensorRef(pool="kv", role="host", device="cpu", numel=n, dtype="int64", ptr=4096, indices=runs)
    return TransferSubmitted, dict(
        op=op,
        direction="d2h",
        stream="hicache-write",
        io_backend="direct",
        layout="layer_first",
        tensors=(ref,),
        slots_by_pool=(("kv", n),),
        bytes_by_pool=(("kv", n),),
        device="cpu",
    )


def _pool(cap: int = CAP) -> Spec:
    return [
        (PoolCreated, dict(pool="kv", tier="host", capacity=cap, page_size=1, slot_bytes=8, layout="layer_first")),
        (SlotsAllocated, dict(pool="kv", tier="host", indices=((0, cap),))),
    ]


def _uaf(used: tuple[tuple[int, int], ...], freed: tuple[tuple[int, int], ...]) -> Spec:
    return [
        *_pool(),
        _submit(7, used),
        (SlotsFreed, dict(pool="kv", tier="host", indices=freed, reason="evict")),
        (TransferCompleted, dict(op=7, direction="d2h", duration_ns=5)),
    ]


def _live(spec: Spec) -> tuple[list[Finding], EventLog]:
    log = EventLog()
    auditor = Auditor().attach(log)
    for cls, fields in spec:
        log.emit(cls, **fields)
    return auditor.finish(), log


def _uaf_findings(findings: list[Finding]) -> list[tuple[int, str]]:
    return [(f.op, f.detail) for f in findings if f.rule == "slot_not_allocated"]


def test_a_free_of_more_than_2_20_slots_in_use_is_a_use_after_free_live_offline_and_from_disk(tmp_path) -> None:
    n = (1 << 22) + 3  # past the old threshold of 2**20
    live, log = _live(_uaf(((0, n),), ((0, n),)))
    assert [(f.rule, f.pool, f.role, f.op) for f in live] == [("slot_not_allocated", "kv", "host", 7)]
    assert "host slots [0, 1, 2, 3, 4, 5, 6, 7] of pool 'kv' were freed (evict)" in live[0].detail
    assert "still uses them (use after free)" in live[0].detail
    offline = audit(log.events())
    assert [f.detail for f in offline] == [f.detail for f in live]
    store = JsonlStore(tmp_path)
    store.handle_batch(log.events())  # the live auditor's AuditViolation too: not counted again
    store.close()
    for states in (True, False):  # the replay's fold, and what hicache-obs audit runs
        res = replay(tmp_path, audit=True, keep_events=False, states=states)
        assert [f.detail for f in res.findings] == [f.detail for f in live]


def test_the_slots_shown_are_the_first_in_both_whatever_the_order_of_the_runs() -> None:
    big = 1 << 21
    used = ((big + 100, 50), (5, big))  # out of order, the second longer than 2**20
    freed = ((big + 120, 1 << 20), (big + 2, 10))
    found = _uaf_findings(_live(_uaf(used, freed))[0])
    want = list(range(big + 2, big + 5)) + list(range(big + 120, big + 125))
    assert found == [(7, found[0][1])] and f"host slots {want} of pool" in found[0][1]


def test_a_free_next_to_the_slots_in_use_is_no_use_after_free() -> None:
    n = 1 << 21
    spec = _uaf(((10, n),), ((0, 10), (10 + n, 1 << 21)))
    assert _uaf_findings(_live(spec)[0]) == []


def test_one_finding_per_op_and_pool_tier_however_many_frees_take_its_slots() -> None:
    spec = [
        *_pool(),
        _submit(1, ((0, 100),)),
        (SlotsFreed, dict(pool="kv", tier="host", indices=((0, 10),))),
        (SlotsFreed, dict(pool="kv", tier="host", indices=((10, 10),))),
        (TransferCompleted, dict(op=1, direction="d2h", duration_ns=5)),
    ]
    found = _uaf_findings(_live(spec)[0])
    assert [op for op, _ in found] == [1] and "slots [0, 1, 2, 3, 4, 5, 6, 7]" in found[0][1]


# ------------------------------------------------------------------ differential
runs_st = st.lists(st.tuples(st.integers(0, 190), st.integers(1, 12)), min_size=1, max_size=3).map(tuple)
steps_st = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), runs_st),
        st.tuples(st.just("free"), runs_st),
        st.tuples(st.just("complete"), st.integers(0, 200)),
    ),
    min_size=1,
    max_size=160,
)


def _reference(steps: list[tuple[str, Any]]) -> list[tuple[int, list[int]]]:
    """Sets: per free, each op in flight (in submission order) whose slots it takes, once."""
    inflight: dict[int, set[int]] = {}
    order: list[int] = []
    out = []
    next_op = 0
    for kind, arg in steps:
        if kind == "submit":
            inflight[next_op] = {s for a, n in arg for s in range(a, a + n)}
            order.append(next_op)
            next_op += 1
        elif kind == "free":
            freed = {s for a, n in arg for s in range(a, a + n)}
            for op in order:
                slots = inflight.get(op)
                if slots and slots & freed:
                    out.append((op, sorted(slots & freed)[:8]))
                    inflight[op] = set()  # reported: not again
        elif order:
            op = order[arg % len(order)]
            inflight.pop(op, None)
            order.remove(op)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=steps_st, warm=st.integers(0, 60))
def test_use_after_free_agrees_with_a_set_reference_with_few_and_many_ops_in_flight(steps, warm) -> None:
    # `warm` ops on far slots first, so that the index (past 32 ops in flight) is used or not
    steps = [("submit", ((250, 1),))] * warm + list(steps)
    spec = _pool(256)
    live_ops: list[int] = []
    next_op = 0
    for kind, arg in steps:
        if kind == "submit":
            spec.append(_submit(next_op, arg))
            live_ops.append(next_op)
            next_op += 1
        elif kind == "free":
            spec.append((SlotsFreed, dict(pool="kv", tier="host", indices=arg)))
        elif live_ops:
            op = live_ops.pop(arg % len(live_ops))
            spec.append((TransferCompleted, dict(op=op, direction="d2h", duration_ns=1)))
    want = _reference(steps)
    found, log = _live(spec)
    uaf = [(f.op, f.detail) for f in found if "(use after free)" in f.detail]
    assert [(op, f"host slots {slots} of pool") for op, slots in want] == [
        (op, detail[: detail.index(" of pool") + 8]) for op, detail in uaf
    ]
    assert [f.key() for f in audit(log.events())] == [f.key() for f in found]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.lists(runs_st, min_size=0, max_size=60),
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "remove", "hits", "hits"]), st.integers(0, 400), runs_st), max_size=200
    ),
)
def test_the_index_of_slots_in_use_finds_exactly_the_ops_a_free_overlaps(base, ops) -> None:
    from hicache_obs.events._audit import _InUse, _spans

    use, ref = _InUse(), {}
    # `base` ops first (ids 1000...): past 32 of them the tree is used, below 8 dropped again
    for kind, op, runs in [("add", 1000 + i, r) for i, r in enumerate(base)] + ops:
        if kind == "add" and op not in ref:
            use.add(op, _spans(runs))
            ref[op] = {s for a, n in runs for s in range(a, a + n)}
        elif kind == "remove":
            use.remove(op)
            ref.pop(op, None)
        else:
            freed = {s for a, n in runs for s in range(a, a + n)}
            assert use.hits(runs) == [o for o, slots in ref.items() if slots & freed]


def test_ops_that_share_a_run_start_leave_in_any_order() -> None:
    """Many ops in flight from the same slot (the shared leaf's largest end is a heap, rebuilt
    when mostly ops that left): each free finds exactly the ops still in flight it overlaps."""
    from hicache_obs.events._audit import _InUse, _spans

    use = _InUse()
    ends = {op: 1 + (op * 7) % 50 for op in range(200)}  # op uses slots [0, end)
    for op, end in ends.items():
        use.add(op, _spans(((0, end),)))
    # the longest first (each leaving changes the leaf's largest end), then every other one
    order = sorted(ends, key=lambda op: (-ends[op], op))
    left = set(ends)
    for i, op in enumerate(order[:150]):
        use.remove(op)
        left.discard(op)
        if i % 10 == 0:
            for slot in (0, 10, 30, 49):
                assert use.hits(((slot, 1),)) == [o for o in ends if o in left and ends[o] > slot], (i, slot)
    assert len(use._ends[0]) <= 2 * len(left) + 8  # the stale entries were dropped
    # ops come and go beside one long-lived op: the heap stays bounded
    use.add(1000, _spans(((0, 64),)))
    for op in range(2000, 2400):
        use.add(op, _spans(((0, 2),)))
        use.remove(op)
    assert len(use._ends[0]) <= 2 * (len(left) + 1) + 8
    assert use.hits(((63, 1),)) == [1000]
