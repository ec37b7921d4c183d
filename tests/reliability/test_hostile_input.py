"""Hostile arguments to every public controller call: a specific HiCacheError, and nothing changes.

Hypothesis builds index tensors that are wrong in every way a caller can get them
wrong (dtype, rank, device, values: negative, out of range, 2**62, duplicates,
unallocated, split pages, empty, not a tensor at all), bad allocation sizes, unknown
pool names, pool transfers with a None side, and calls on a closed controller. They
go to ``write``/``load``/``evict_host``/``evict_device``/``free_device``/
``move_indices``/``alloc_device`` on the ``cpu`` and ``sim`` runtimes, for the plain
(``tiny``, :class:`HiCacheController`) and the hybrid (``tiny_hybrid``,
:class:`HybridCacheController`) model.

Every case must raise a specific subclass of :class:`HiCacheError` (never a bare
``ValueError``/``TypeError``/``IndexError``/``RuntimeError`` from torch) and leave
the controller as it was: the fold of its event log equals ``controller.state`` and
equals the fold before the call, ``len(controller.log)`` is the same, no side-stream
work was queued or run, and every plane of every device and host pool holds the
same bytes.

The world each example starts from has one node backed up and reaped (device and
host copies) and a second node whose write is still in flight (on ``sim`` its copy
is queued on the write stream), so a call that ran or reaped work would show.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hicache_obs.core import CacheOperation, HiCacheController, HybridCacheController, ModelSpec, PoolTransfer
from hicache_obs.errors import (
    ControllerClosedError,
    HiCacheError,
    InvalidIndicesError,
    LengthMismatchError,
    PageSizeError,
    SlotNotAllocatedError,
    UnknownPoolError,
    UnresolvedTransferError,
)
from hicache_obs.events._schema import AllocationFailed
from hicache_obs.events._state import fold

FUZZ = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SETUPS = [("cpu", "tiny"), ("cpu", "tiny_hybrid"), ("sim", "tiny"), ("sim", "tiny_hybrid")]
SETUP_IDS = [f"{rt}-{spec}" for rt, spec in SETUPS]
HYBRID_SETUPS = [s for s in SETUPS if s[1] == "tiny_hybrid"]
HYBRID_IDS = [f"{rt}-{spec}" for rt, spec in HYBRID_SETUPS]
SIDE = "mamba"  # the sidecar pool of tiny_hybrid
NODE_SLOTS = {"kv": 16, "mamba": 2}  # a node: one KV page, two Mamba state slots
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# --------------------------------------------------------------------- world
@dataclass
class World:
    c: HiCacheController
    node: dict[str, torch.Tensor]  # device indices of a backed-up node (write reaped)
    host: dict[str, torch.Tensor]  # its host copy
    busy: dict[str, torch.Tensor]  # device indices of a node whose write is in flight
    busy_host: dict[str, torch.Tensor]

    @property
    def hybrid(self) -> bool:
        return isinstance(self.c, HybridCacheController)

    @property
    def pools(self) -> list[str]:
        return list(self.c.spec.pool_names)

    def values(self, pool: str, tier: str) -> list[int]:
        t = self.node[pool] if tier == "device" else self.host[pool]
        return self.c.runtime.to_host(t).tolist()  # type: ignore[no-any-return]

    def place(self, t: torch.Tensor, tier: str) -> torch.Tensor:
        """Put an index tensor where the controller expects it for ``tier``."""
        return self.c.runtime.to_device(t) if tier == "device" else t

    def misplace(self, t: torch.Tensor, tier: str) -> torch.Tensor:
        """Put it on the other side (sim only: on cpu both sides are host tensors)."""
        return t if tier == "device" else self.c.runtime.to_device(t)

    def page_size(self, pool: str, tier: str) -> int:
        return self.c.state.table(pool, tier).page_size

    def capacity(self, pool: str, tier: str) -> int:
        return self.c.state.table(pool, tier).capacity

    def free_slots(self, pool: str, tier: str) -> list[int]:
        tab = self.c.state.table(pool, tier)
        return [s for s in range(tab.capacity) if not tab.is_allocated(s)]


def _fill(c: HiCacheController, pool: str, idx: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    dp = c.device_pool(pool)
    data = {
        p.name: torch.randn((len(dp.layer_ids), idx.numel(), *p.item_shape), generator=g).to(p.dtype)
        for p in dp.plane_specs
    }
    dp.write_slots(idx, data)


def _write_node(c: HiCacheController, node: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(c, HybridCacheController):
        res = c.write(node["kv"], node_id=1, pool_transfers=[PoolTransfer(SIDE, device_indices=node[SIDE])])
        assert res is not None
        host, transfers = res
        assert transfers is not None and transfers[0].host_indices is not None
        return {"kv": host, SIDE: transfers[0].host_indices}
    h = c.write(node["kv"], node_id=1)
    assert h is not None
    return {"kv": h}


def make_world(runtime: str, spec_name: str) -> World:
    spec = ModelSpec.preset(spec_name)
    cls = HybridCacheController if spec.is_hybrid else HiCacheController
    c = cls(spec, runtime=runtime, device_size=64)
    nodes = []
    for seed in (1, 2):
        node = {}
        for pool in spec.pool_names:
            t = c.alloc_device(NODE_SLOTS[pool], pool=pool)
            assert t is not None
            _fill(c, pool, t, seed * 10 + len(node))
            node[pool] = t
        nodes.append(node)
    host = _write_node(c, nodes[0])
    assert [a.ok for a in c.poll_writes()] == [True]
    busy_host = _write_node(c, nodes[1])  # not reaped: in flight (queued on sim)
    return World(c, nodes[0], host, nodes[1], busy_host)


# ------------------------------------------------------------------ checking
@dataclass
class Snapshot:
    folded: dict[str, Any]
    log_len: int
    planes: dict[str, torch.Tensor]
    pending: int


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def snapshot(c: HiCacheController) -> Snapshot:
    folded = fold(c.log.events()).snapshot()
    assert folded == c.state.snapshot(), "controller.state is not the fold of its log"
    rt = c.runtime
    planes = {}
    for tier, pools in (("device", c.device_pools), ("host", c.host_pools)):
        for name, pool in pools.items():
            for plane, t in pool.planes.items():
                planes[f"{tier}/{name}/{plane}"] = _bits(rt.to_host(t).clone())
    pending = getattr(rt, "pending_work", None)
    return Snapshot(folded, len(c.log), planes, int(pending()) if pending is not None else 0)


def assert_unchanged(c: HiCacheController, before: Snapshot) -> None:
    after = snapshot(c)
    assert after.log_len == before.log_len, f"events were logged: {c.log.events()[before.log_len :]}"
    assert after.folded == before.folded, "the bookkeeping changed"
    assert after.pending == before.pending, "side-stream work was queued or run"
    changed = [k for k, v in before.planes.items() if not torch.equal(v, after.planes[k])]
    assert not changed, f"pool data changed: {changed}"


def assert_rejected(c: HiCacheController, call: Callable[[], object], expected: type[HiCacheError]) -> HiCacheError:
    """``call()`` raises a specific HiCacheError subclass that is ``expected``, and changes nothing."""
    before = snapshot(c)
    with pytest.raises(HiCacheError) as info:  # anything else propagates and fails the test as it is
        call()
    exc = info.value
    assert type(exc) is not HiCacheError, f"the root class itself, not a specific one: {exc}"
    assert isinstance(exc, expected), f"expected {expected.__name__}, got {type(exc).__name__}: {exc}"
    assert str(exc) and "\n" not in str(exc)
    assert_unchanged(c, before)
    return exc


# ------------------------------------------------------- hostile index tensors
DTYPES = [
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
    torch.complex64,
]
NOT_TENSORS = st.one_of(
    st.lists(st.integers(0, 15), max_size=16),
    st.lists(st.integers(0, 15), max_size=16).map(tuple),
    st.integers(INT64_MIN, INT64_MAX),
    st.floats(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.dictionaries(st.integers(0, 3), st.integers(0, 3), max_size=2),
    st.just(range(16)),
)
#: kind -> the error class the call must raise (``empty`` is a no-op for frees, see below)
KINDS: dict[str, type[HiCacheError]] = {
    "dtype": InvalidIndicesError,
    "zero_dim": InvalidIndicesError,
    "multi_dim": InvalidIndicesError,
    "wrong_device": InvalidIndicesError,  # sim only
    "not_tensor": InvalidIndicesError,
    "negative": SlotNotAllocatedError,
    "out_of_range": SlotNotAllocatedError,
    "huge": SlotNotAllocatedError,
    "duplicate": InvalidIndicesError,
    "unallocated": SlotNotAllocatedError,  # DoubleFreeError (a subclass) for frees
    "not_page_multiple": PageSizeError,  # pools with pages > 1 slot
    "empty": InvalidIndicesError,  # write/load; frees of nothing are a no-op
}


def bad_indices(draw: st.DrawFn, w: World, pool: str, tier: str, kind: str) -> Any:
    """An index argument for ``pool``/``tier`` that is wrong in the way ``kind`` says."""
    values = w.values(pool, tier)
    n = len(values)
    cap = w.capacity(pool, tier)
    if kind == "dtype":
        dtype = draw(st.sampled_from(DTYPES))
        return w.place(torch.tensor(values).to(dtype), tier)
    if kind == "zero_dim":
        return w.place(torch.tensor(draw(st.sampled_from([*values, -1, cap, 2**62]))), tier)
    if kind == "multi_dim":
        shape = draw(
            st.sampled_from([(1, n), (n, 1), (n // 2, 2), (2, n // 2), (1, 1, n)])
            if n % 2 == 0
            else st.sampled_from([(1, n), (n, 1), (1, 1, n)])
        )
        return w.place(torch.tensor(values).reshape(shape), tier)
    if kind == "wrong_device":
        return w.misplace(torch.tensor(values), tier)
    if kind == "not_tensor":
        return draw(NOT_TENSORS)
    if kind in ("negative", "out_of_range", "huge"):
        bad = {
            "negative": st.integers(INT64_MIN, -1),
            "out_of_range": st.integers(cap, INT64_MAX),
            "huge": st.sampled_from([2**62, 2**62 + cap, INT64_MAX, INT64_MIN, -(2**62)]),
        }[kind]
        positions = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
        out = list(values)
        for i in positions:
            out[i] = draw(bad)
        return w.place(torch.tensor(out, dtype=torch.int64), tier)
    if kind == "duplicate":
        i, j = draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
        out = list(values)
        out[j] = out[i]
        return w.place(torch.tensor(out, dtype=torch.int64), tier)
    if kind == "unallocated":
        ps = w.page_size(pool, tier)
        free = w.free_slots(pool, tier)
        free_set = set(free)
        pages = sorted({s // ps for s in free if free_set.issuperset(range(s // ps * ps, s // ps * ps + ps))})
        page = draw(st.sampled_from(pages))
        fresh = (
            list(range(page * ps, page * ps + ps))
            if ps > 1
            else draw(st.lists(st.sampled_from(free), min_size=1, max_size=n, unique=True))
        )
        out = list(values)
        out[: len(fresh)] = fresh
        out = out[: max(n, len(fresh))]
        return w.place(torch.tensor(out, dtype=torch.int64), tier)
    if kind == "not_page_multiple":
        ps = w.page_size(pool, tier)
        extra = [s for s in range(cap) if s not in values]
        k = draw(st.integers(1, 2 * ps - 1).filter(lambda k: k % ps != 0))
        out = (values + extra)[:k]
        return w.place(torch.tensor(out, dtype=torch.int64), tier)
    if kind == "empty":
        return w.place(torch.empty(0, dtype=torch.int64), tier)
    raise AssertionError(kind)


def kinds_for(w: World, pool: str, tier: str) -> list[str]:
    out = list(KINDS)
    if not w.c.runtime.has_device:
        out.remove("wrong_device")  # on cpu every index tensor is a host tensor
    if w.page_size(pool, tier) == 1:
        out.remove("not_page_multiple")
    if len(w.values(pool, tier)) < 2:
        out.remove("duplicate")
    return out


#: operation -> the tier of the index argument it takes
OPS = {"write": "device", "load": "host", "evict_host": "host", "evict_device": "device", "free_device": "device"}


def _call(w: World, op: str, pool: str, bad: Any, with_side: bool) -> Callable[[], object]:
    c = w.c
    if op in ("evict_host", "evict_device", "free_device"):
        return lambda: getattr(c, op)(bad, pool=pool)
    if not w.hybrid:
        return lambda: getattr(c, op)(bad)
    assert isinstance(c, HybridCacheController)
    if op == "write":
        if pool == SIDE:
            return lambda: c.write(w.node["kv"], pool_transfers=[PoolTransfer(SIDE, device_indices=bad)])
        side = [PoolTransfer(SIDE, device_indices=w.node[SIDE])] if with_side else None
        return lambda: c.write(bad, pool_transfers=side)
    if pool == SIDE:
        return lambda: c.load(w.host["kv"], pool_transfers=[PoolTransfer(SIDE, host_indices=bad)])
    side = [PoolTransfer(SIDE, host_indices=w.host[SIDE])] if with_side else None
    return lambda: c.load(bad, pool_transfers=side)


#: every kind on every runtime and model (a CPU tensor is a device tensor on ``cpu``: no wrong device there)
INDEX_CASES = [
    (rt, spec, kind) for rt, spec in SETUPS for kind in KINDS if not (rt == "cpu" and kind == "wrong_device")
]


@pytest.mark.parametrize(("runtime", "spec_name", "kind"), INDEX_CASES, ids=["-".join(c) for c in INDEX_CASES])
@settings(FUZZ, max_examples=20)
@given(data=st.data())
def test_hostile_index_tensors_are_rejected_and_change_nothing(
    runtime: str, spec_name: str, kind: str, data: st.DataObject
) -> None:
    w = make_world(runtime, spec_name)
    targets = [(op, pool) for op in sorted(OPS) for pool in w.pools if kind in kinds_for(w, pool, OPS[op])]
    op, pool = data.draw(st.sampled_from(targets), label="op, pool")
    tier = OPS[op]
    with_side = (
        w.hybrid
        and op in ("write", "load")
        and pool == "kv"
        and kind != "empty"  # empty anchor indices with a pool transfer: a valid pool-only transfer
        and data.draw(st.booleans(), label="with_side")
    )
    event(f"{op} {pool}{' +side' if with_side else ''}")
    bad = bad_indices(data.draw, w, pool, tier, kind)
    call = _call(w, op, pool, bad, with_side)
    if kind == "empty" and op in ("evict_host", "evict_device", "free_device"):
        before = snapshot(w.c)
        assert call() == 0  # freeing nothing is allowed, and does nothing
        assert_unchanged(w.c, before)
        return
    assert_rejected(w.c, call, KINDS[kind])


# ---------------------------------------------------------------- move_indices
@pytest.mark.parametrize(("runtime", "spec_name"), SETUPS, ids=SETUP_IDS)
@FUZZ
@given(data=st.data())
def test_move_indices_with_mismatched_lengths(runtime: str, spec_name: str, data: st.DataObject) -> None:
    w = make_world(runtime, spec_name)
    c = w.c
    pool = data.draw(st.sampled_from(w.pools), label="pool")
    nh, nd = data.draw(st.lists(st.integers(0, 40), min_size=2, max_size=2, unique=True), label="lengths")
    hv, dv = w.values(pool, "host"), w.values(pool, "device")
    host = torch.tensor([hv[i % len(hv)] for i in range(nh)], dtype=torch.int64)
    device = w.place(torch.tensor([dv[i % len(dv)] for i in range(nd)], dtype=torch.int64), "device")
    exc = assert_rejected(c, lambda: c.move_indices(host, device, pool=pool), LengthMismatchError)
    assert f"{nh} entries" in str(exc) and f"device indices {nd}" in str(exc)
    if w.hybrid and pool == SIDE:  # the same inside a hybrid op: nothing of the op is moved
        assert isinstance(c, HybridCacheController)
        op = CacheOperation(w.host["kv"], w.node["kv"], pool_transfers=(PoolTransfer(SIDE, host, device),))
        assert_rejected(c, lambda: c.move_hybrid_indices(op), LengthMismatchError)


#: Structural misuse of move_indices (its values are not checked: it only normalises placement)
MOVE_KINDS = ["dtype", "zero_dim", "multi_dim", "wrong_device", "not_tensor", "unknown_pool"]


@pytest.mark.parametrize(("runtime", "spec_name"), SETUPS, ids=SETUP_IDS)
@FUZZ
@given(data=st.data())
def test_move_indices_rejects_hostile_tensors(runtime: str, spec_name: str, data: st.DataObject) -> None:
    """BUG (core/controller.py move_indices): only the lengths are checked today."""
    w = make_world(runtime, spec_name)
    c = w.c
    pool = data.draw(st.sampled_from(w.pools), label="pool")
    kinds = [k for k in MOVE_KINDS if c.runtime.has_device or k != "wrong_device"]
    kind = data.draw(st.sampled_from(kinds), label="kind")
    host, device = w.host[pool], w.node[pool]
    if kind == "unknown_pool":
        name = data.draw(st.text(max_size=6).filter(lambda s: s not in w.pools), label="name")
        assert_rejected(c, lambda: c.move_indices(host, device, pool=name), UnknownPoolError)
        return
    # host indices already on the device are fine for the kernel backend (moving them is a no-op);
    # device indices on the host are not
    side = "device" if kind == "wrong_device" else data.draw(st.sampled_from(["host", "device"]), label="side")
    bad = bad_indices(data.draw, w, pool, side, kind)
    if side == "host":
        assert_rejected(c, lambda: c.move_indices(bad, device, pool=pool), InvalidIndicesError)
    else:
        assert_rejected(c, lambda: c.move_indices(host, bad, pool=pool), InvalidIndicesError)


# ------------------------------------------------------------- alloc_device(n)
def _bad_sizes(page_size: int) -> st.SearchStrategy[Any]:
    options = [
        st.integers(INT64_MIN, -1),
        st.booleans(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(0, 64).map(float),  # 16.0: integral, still not an int
        st.none(),
        st.text(max_size=3),
        st.integers(0, 64).map(lambda n: torch.tensor(n)),
        st.complex_numbers(max_magnitude=100),
    ]
    if page_size > 1:
        options.append(st.integers(1, 2**62).filter(lambda n: n % page_size != 0))
    return st.one_of(*options)


@pytest.mark.parametrize(("runtime", "spec_name"), SETUPS, ids=SETUP_IDS)
@FUZZ
@given(data=st.data())
def test_bad_allocation_sizes_are_rejected(runtime: str, spec_name: str, data: st.DataObject) -> None:
    w = make_world(runtime, spec_name)
    pool = data.draw(st.sampled_from(w.pools), label="pool")
    n = data.draw(_bad_sizes(w.page_size(pool, "device")), label="n")
    assert_rejected(w.c, lambda: w.c.alloc_device(n, pool=pool), InvalidIndicesError)


@pytest.mark.parametrize(("runtime", "spec_name"), SETUPS, ids=SETUP_IDS)
@FUZZ
@given(data=st.data())
def test_huge_allocations_are_a_value_not_an_error(runtime: str, spec_name: str, data: st.DataObject) -> None:
    """More than the pool holds (up to 2**62 slots) is an expected failure: None plus one AllocationFailed."""
    w = make_world(runtime, spec_name)
    c = w.c
    pool = data.draw(st.sampled_from(w.pools), label="pool")
    ps = w.page_size(pool, "device")
    available = c.state.table(pool, "device").available
    pages = data.draw(st.one_of(st.integers(available // ps + 1, 2**62 // ps), st.just(2**62 // ps)), label="pages")
    before = snapshot(c)
    assert c.alloc_device(pages * ps, pool=pool) is None
    new = c.log.events()[before.log_len :]
    assert [type(e) for e in new] == [AllocationFailed]
    ev = new[0]
    assert isinstance(ev, AllocationFailed)
    assert (ev.pool, ev.tier, ev.requested, ev.available) == (pool, "device", pages * ps, available)
    after = snapshot(c)
    assert after.folded["allocation_failures"] == before.folded["allocation_failures"] + 1
    assert {k: v for k, v in after.folded.items() if k != "allocation_failures"} == {
        k: v for k, v in before.folded.items() if k != "allocation_failures"
    }
    assert after.pending == before.pending
    assert all(torch.equal(v, after.planes[k]) for k, v in before.planes.items())
    assert c.alloc_device(0, pool=pool).numel() == 0  # type: ignore[union-attr]  # nothing: no event
    assert len(c.log) == before.log_len + 1


# ------------------------------------------------------------------ pool names
UNKNOWN_POOLS = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["KV", " kv", "kv ", "kv\x00", "Mamba", "mamba ", "swa", "mamba", "host", "device", "*"]),
    st.integers(INT64_MIN, INT64_MAX),
    st.none(),
    st.floats(),
)


@pytest.mark.parametrize(("runtime", "spec_name"), SETUPS, ids=SETUP_IDS)
@FUZZ
@given(data=st.data())
def test_unknown_pools_are_rejected(runtime: str, spec_name: str, data: st.DataObject) -> None:
    w = make_world(runtime, spec_name)
    c = w.c
    name = data.draw(UNKNOWN_POOLS.filter(lambda p: p not in w.pools), label="pool")
    calls: dict[str, Callable[[], object]] = {
        "alloc_device": lambda: c.alloc_device(16, pool=name),
        "alloc_device_1": lambda: c.alloc_device(1, pool=name),
        "free_device": lambda: c.free_device(w.node["kv"], pool=name),
        "evict_device": lambda: c.evict_device(w.node["kv"], pool=name),
        "evict_host": lambda: c.evict_host(w.host["kv"], pool=name),
    }
    if isinstance(c, HybridCacheController):
        hc = c
        calls["write_transfer"] = lambda: hc.write(
            w.node["kv"], pool_transfers=[PoolTransfer(name, device_indices=w.node[SIDE])]
        )
        calls["load_transfer"] = lambda: hc.load(
            w.host["kv"], pool_transfers=[PoolTransfer(name, host_indices=w.host[SIDE])]
        )
        if name is not None:  # indices_from_pool=None: the transfer has its own indices
            calls["write_from_pool"] = lambda: hc.write(
                w.node["kv"], pool_transfers=[PoolTransfer(SIDE, indices_from_pool=name)]
            )
    which = data.draw(st.sampled_from(sorted(calls)), label="call")
    assert_rejected(c, calls[which], UnknownPoolError)


@pytest.mark.parametrize(("runtime", "spec_name"), SETUPS, ids=SETUP_IDS)
def test_unhashable_pool_names_are_rejected(runtime: str, spec_name: str) -> None:
    """BUG (core/controller.py _pool): an unhashable name raises TypeError from the dict lookup."""
    w = make_world(runtime, spec_name)
    c = w.c
    for name in (["kv"], {"kv": 1}, {"kv"}):
        for call in (
            lambda name=name: c.alloc_device(16, pool=name),
            lambda name=name: c.evict_host(w.host["kv"], pool=name),
            lambda name=name: c.free_device(w.node["kv"], pool=name),
        ):
            assert_rejected(c, call, UnknownPoolError)


# ------------------------------------------------------------ pool transfers
NONE_SIDE_CASES = [
    "write-both-none",
    "write-device-none",
    "load-both-none",
    "load-host-none",
    "write-host-given",
    "load-device-given",
    "move-host-none",
    "move-device-none",
    "from-pool-with-own-indices",
]


@pytest.mark.parametrize(("runtime", "spec_name"), HYBRID_SETUPS, ids=HYBRID_IDS)
@pytest.mark.parametrize("case", NONE_SIDE_CASES)
def test_pool_transfers_with_a_none_or_extra_side(runtime: str, spec_name: str, case: str) -> None:
    w = make_world(runtime, spec_name)
    c = w.c
    assert isinstance(c, HybridCacheController)
    kv_d, kv_h, sd, sh = w.node["kv"], w.host["kv"], w.node[SIDE], w.host[SIDE]
    cases: dict[str, tuple[Callable[[], object], type[HiCacheError]]] = {
        "write-both-none": (lambda: c.write(kv_d, pool_transfers=[PoolTransfer(SIDE)]), UnresolvedTransferError),
        "write-device-none": (
            lambda: c.write(kv_d, pool_transfers=[PoolTransfer(SIDE, host_indices=sh)]),
            UnresolvedTransferError,
        ),
        "load-both-none": (lambda: c.load(kv_h, pool_transfers=[PoolTransfer(SIDE)]), UnresolvedTransferError),
        "load-host-none": (
            lambda: c.load(kv_h, pool_transfers=[PoolTransfer(SIDE, device_indices=sd)]),
            UnresolvedTransferError,
        ),
        "write-host-given": (
            lambda: c.write(kv_d, pool_transfers=[PoolTransfer(SIDE, host_indices=sh, device_indices=sd)]),
            InvalidIndicesError,
        ),
        "load-device-given": (
            lambda: c.load(kv_h, pool_transfers=[PoolTransfer(SIDE, host_indices=sh, device_indices=sd)]),
            InvalidIndicesError,
        ),
        "move-host-none": (
            lambda: c.move_hybrid_indices(CacheOperation(kv_h, kv_d, pool_transfers=(PoolTransfer(SIDE, None, sd),))),
            UnresolvedTransferError,
        ),
        "move-device-none": (
            lambda: c.move_hybrid_indices(CacheOperation(kv_h, kv_d, pool_transfers=(PoolTransfer(SIDE, sh, None),))),
            UnresolvedTransferError,
        ),
        "from-pool-with-own-indices": (
            lambda: c.write(kv_d, pool_transfers=[PoolTransfer(SIDE, device_indices=sd, indices_from_pool="kv")]),
            InvalidIndicesError,
        ),
    }
    call, expected = cases[case]
    assert_rejected(c, call, expected)


@pytest.mark.parametrize(("runtime", "spec_name"), HYBRID_SETUPS, ids=HYBRID_IDS)
def test_a_pool_cannot_reuse_the_indices_of_a_pool_with_another_index_space(runtime: str, spec_name: str) -> None:
    """BUG (core/controller.py _check_transfers): Mamba (8 device slots, 1 per page) may reuse KV's indices.

    KV's 16 slot indices go to the Mamba pool unchecked: on ``cpu`` the copy raises a
    torch RuntimeError inside ``write`` after four events were logged; on ``sim`` the
    write is accepted and the deferred copy raises out of the next ``poll_writes``.
    """
    w = make_world(runtime, spec_name)
    c = w.c
    assert isinstance(c, HybridCacheController)
    assert_rejected(
        c, lambda: c.write(w.node["kv"], pool_transfers=[PoolTransfer(SIDE, indices_from_pool="kv")]), HiCacheError
    )
    c.close()  # reaps the in-flight write: must not raise either


# ------------------------------------------------------------------ scalars
@pytest.mark.parametrize(("runtime", "spec_name"), SETUPS, ids=SETUP_IDS)
def test_non_integer_priority_or_node_id_is_rejected(runtime: str, spec_name: str) -> None:
    """BUG (core/controller.py _write/_load): ``priority`` and ``node_id`` are not validated.

    ``priority="high"`` raises ValueError from ``int()`` after the host slots were
    allocated (a ``SlotsAllocated`` event, a leak); ``node_id="x"`` (or None, 1.5) is
    accepted and written to the log, which ``replay`` then rejects as malformed.
    """
    w = make_world(runtime, spec_name)
    c = w.c
    for arg, value in [("priority", "high"), ("priority", [1]), ("node_id", "x"), ("node_id", None), ("node_id", 1.5)]:
        kw = {arg: value}
        assert_rejected(c, lambda kw=kw: c.write(w.node["kv"], **kw), HiCacheError)
        assert_rejected(c, lambda kw=kw: c.load(w.host["kv"], **kw), HiCacheError)


# ------------------------------------------------------------ closed controller
def _any_arg(w: World) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from([w.node["kv"], w.host["kv"], w.busy["kv"], w.busy_host["kv"]]),
        NOT_TENSORS,
        st.none(),
    )


@pytest.mark.parametrize(("runtime", "spec_name"), SETUPS, ids=SETUP_IDS)
@FUZZ
@given(data=st.data())
def test_every_call_on_a_closed_controller_is_refused(runtime: str, spec_name: str, data: st.DataObject) -> None:
    w = make_world(runtime, spec_name)
    c = w.c
    c.close()
    c.close()  # idempotent
    assert c.closed
    a, b = data.draw(_any_arg(w), label="a"), data.draw(_any_arg(w), label="b")
    n = data.draw(st.one_of(st.integers(-(2**62), 2**62), st.just(16), st.none()), label="n")
    pool = data.draw(st.one_of(st.sampled_from(w.pools), st.text(max_size=4)), label="pool")
    calls: dict[str, Callable[[], object]] = {
        "alloc_device": lambda: c.alloc_device(n, pool=pool),  # type: ignore[arg-type]
        "write": lambda: c.write(a),
        "load": lambda: c.load(a),
        "evict_host": lambda: c.evict_host(a, pool=pool),
        "evict_device": lambda: c.evict_device(a, pool=pool),
        "free_device": lambda: c.free_device(a, pool=pool),
        "move_indices": lambda: c.move_indices(a, b, pool=pool),
        "start_writing": c.start_writing,
        "start_loading": c.start_loading,
        "poll_writes": c.poll_writes,
        "poll_loads": c.poll_loads,
    }
    if isinstance(c, HybridCacheController):
        hc = c
        calls["write_hybrid"] = lambda: hc.write(a, pool_transfers=[PoolTransfer(SIDE, device_indices=b)])
        calls["load_hybrid"] = lambda: hc.load(a, pool_transfers=[PoolTransfer(SIDE, host_indices=b)])
    which = data.draw(st.sampled_from(sorted(calls)), label="call")
    assert_rejected(c, calls[which], ControllerClosedError)
