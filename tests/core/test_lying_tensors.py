"""Index tensors whose values and storage disagree, and copies that fail after submission.

A tensor the copies would read differently from its values (they read storage: the
native loop through numpy views, the ``sim`` side stream through captured arena offsets)
is refused before anything is emitted, on ``cpu`` and ``sim``, as any argument that
carries indices (the anchor's and a sidecar pool's). Views the copies read correctly (a
storage offset, a stride) move their data bit for bit.

A copy that raises after the op was submitted (the native loop, a torch kernel deferred
on a sim side stream, the sim runtime rebuilding captured tensors, the runtime's event
query) fails that op only: its ack says ``ok=False`` with the error, in FIFO order,
nothing raises from another call, the failure is counted, the fold equals the state,
the audit is clean and the slots are all accounted for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hicache_obs.core import HiCacheController, HybridCacheController, ModelSpec, PoolTransfer
from hicache_obs.core import _transfer as transfer
from hicache_obs.core._sim import SimEvent, SimRuntime, SimTensor
from hicache_obs.errors import InvalidIndicesError
from hicache_obs.events._audit import audit
from hicache_obs.events._schema import D2H, H2D, SlotsFreed, TransferFailed, TransferSubmitted
from hicache_obs.events._state import fold
from hicache_obs.exporters._prometheus import PrometheusSink

RUNTIMES = ["cpu", "sim"]
SPECS = ["tiny", "tiny_hybrid"]


class _Marked(torch.Tensor):
    """A subclass that answers for its values: the copies would read its storage."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def,override]
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.tolist:
            return [v + 1 for v in out]
        return out


def _on(c: HiCacheController, t: torch.Tensor, tier: str) -> torch.Tensor:
    return c.runtime.to_device(t) if tier == "device" else t


def _lying(kind: str, c: HiCacheController, good: torch.Tensor, tier: str) -> tuple[torch.Tensor, str]:
    """A tensor holding ``good``'s values (the CPU copy), lying in the way ``kind`` says,
    and a fragment the refusal must name."""
    if kind == "neg_view":
        return torch._neg_view(_on(c, good.neg(), tier)), "negative bit"
    if kind == "subclass":
        t = good.clone().as_subclass(_Marked)
        return t, "must be a plain torch.Tensor"
    if kind == "parameter":
        # on a plain tensor (a Parameter of a SimTensor is a SimTensor again)
        return torch.nn.Parameter(good.clone(), requires_grad=False), "must be a plain torch.Tensor"
    if kind == "zero_tensor":
        return torch._efficientzerotensor(good.numel(), dtype=torch.int64), "zero tensor"
    if kind == "sparse":
        return good.to_sparse(), "dense (strided)"
    if kind == "expanded":
        return _on(c, good[:1], tier).expand(good.numel()), "overlaps itself"
    if kind == "short_storage":
        t = good.clone()
        t.untyped_storage().resize_(8)
        return t, "storage of 8 bytes"
    if kind == "meta":
        return good.to("meta"), "got one on meta"
    if kind == "other_sim":
        other = SimRuntime()
        return other.to_device(good), "another SimRuntime"
    raise AssertionError(kind)


KINDS = ["neg_view", "subclass", "parameter", "zero_tensor", "sparse", "expanded", "short_storage", "meta", "other_sim"]


def _controller(runtime: str, spec: str, **kw: Any) -> HiCacheController:
    s = ModelSpec.preset(spec)
    cls = HybridCacheController if s.is_hybrid else HiCacheController
    return cls(s, runtime=runtime, device_size=64, **kw)


@pytest.fixture
def controllers() -> Iterator[Callable[..., HiCacheController]]:
    made: list[HiCacheController] = []

    def make(runtime: str, spec: str, **kw: Any) -> HiCacheController:
        c = _controller(runtime, spec, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _sidecars(c: HiCacheController) -> list[str]:
    return [p for p in c.spec.pool_names if p != "kv"]


def _alloc(c: HiCacheController, kv: int = 16) -> dict[str, torch.Tensor]:
    node = {"kv": c.alloc_device(kv)}
    for p in _sidecars(c):
        node[p] = c.alloc_device(2 if p == "mamba" else 16, pool=p)
    assert all(t is not None for t in node.values())
    return node  # type: ignore[return-value]


def _fill(c: HiCacheController, node: dict[str, torch.Tensor], seed: int) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for i, (pool, idx) in enumerate(node.items()):
        dp = c.device_pool(pool)
        g = torch.Generator().manual_seed(seed * 31 + i)
        data = {
            p.name: torch.randn((len(dp.layer_ids), idx.numel(), *p.item_shape), generator=g).to(p.dtype)
            for p in dp.plane_specs
        }
        dp.write_slots(idx, data)
        out[pool] = data
    return out


def _write(c: HiCacheController, node: dict[str, torch.Tensor], node_id: int = -1) -> dict[str, torch.Tensor]:
    if isinstance(c, HybridCacheController):
        res = c.write(node["kv"], node_id=node_id, pool_transfers=[PoolTransfer(p, device_indices=node[p]) for p in _sidecars(c)])
        assert res is not None
        out = {"kv": res[0]}
        out.update({t.pool: t.host_indices for t in res[1] or ()})  # type: ignore[misc]
        return out
    h = c.write(node["kv"], node_id=node_id)
    assert h is not None
    return {"kv": h}


def _load(c: HiCacheController, host: dict[str, torch.Tensor], node_id: int = -1) -> dict[str, torch.Tensor]:
    if isinstance(c, HybridCacheController):
        res = c.load(host["kv"], node_id=node_id, pool_transfers=[PoolTransfer(p, host_indices=host[p]) for p in _sidecars(c)])
        assert res is not None
        out = {"kv": res[0]}
        out.update({t.pool: t.device_indices for t in res[1] or ()})  # type: ignore[misc]
        return out
    d = c.load(host["kv"], node_id=node_id)
    assert d is not None
    return {"kv": d}


def _same(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        a[p].keys() == b[p].keys() and all(torch.equal(a[p][k].view(torch.uint8), b[p][k].contiguous().view(torch.uint8)) for k in a[p])
        for p in a
    )


def _bits(d: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    return {p: {k: v.contiguous() for k, v in planes.items()} for p, planes in d.items()}


def _read_host(c: HiCacheController, host: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    return _bits({p: c.host_pool(p).read_slots(i) for p, i in host.items()})


def _read_device(c: HiCacheController, dev: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    return _bits({p: c.device_pool(p).read_slots(i) for p, i in dev.items()})


def _consistent(c: HiCacheController) -> None:
    """The fold of the log is the live state, with no anomaly, and the audit is clean."""
    events = c.log.events()
    folded = fold(events)
    assert folded.snapshot() == c.state.snapshot()
    assert folded.anomalies == []
    assert audit(events) == []


# ------------------------------------------------------------------ refused


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["kv", "sidecar"])
@pytest.mark.parametrize("direction", ["write", "load"])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_lying_index_tensor_is_refused_before_anything_is_emitted(
    controllers: Callable[..., HiCacheController],
    assert_rejected: Callable[..., BaseException],
    runtime: str,
    direction: str,
    where: str,
    kind: str,
) -> None:
    spec = "tiny_hybrid" if where == "sidecar" else "tiny"
    if kind == "other_sim" and (runtime != "sim" or direction == "load"):
        pytest.skip("another SimRuntime's tensor is a device tensor: write's device indices on sim")
    c = controllers(runtime, spec)
    node = _alloc(c)
    host = _write(c, node)
    c.synchronize()
    assert [a.ok for a in c.poll_writes()] == [True]
    pool = "mamba" if where == "sidecar" else "kv"
    if direction == "write":
        tier, arg, src = "device", "device_indices", node
    else:
        tier, arg, src = "host", "host_indices", host
    good = c.runtime.to_host(src[pool]).clone()
    if kind == "short_storage" and good.numel() * 8 <= 8:
        good = torch.cat([good, good + 100])[: good.numel()]  # storage must outgrow 8 bytes
    bad, fragment = _lying(kind, c, good, tier)
    args = dict(src)
    args[pool] = bad
    call = (lambda: _write(c, args)) if direction == "write" else (lambda: _load(c, args))
    assert_rejected(c, InvalidIndicesError, call, arg, repr(pool), fragment)
    _consistent(c)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_move_indices_refuses_a_neg_view(
    controllers: Callable[..., HiCacheController], assert_rejected: Callable[..., BaseException], runtime: str
) -> None:
    c = controllers(runtime, "tiny")
    d = c.alloc_device(16)
    assert d is not None
    h = torch._neg_view(torch.arange(16).neg())
    assert_rejected(c, InvalidIndicesError, lambda: c.move_indices(h, d), "host_indices", "negative bit")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_views_with_an_offset_or_a_stride_move_their_data_exactly(
    controllers: Callable[..., HiCacheController], runtime: str, spec: str
) -> None:
    """Accepted as given: the copies read them through their offset and strides."""
    c = controllers(runtime, spec)
    node = _alloc(c, kv=32)
    data = _fill(c, node, seed=3)
    rt = c.runtime

    def strided(t: torch.Tensor, tier: str) -> torch.Tensor:
        vals = rt.to_host(t)
        buf = torch.full((2 * vals.numel() + 1,), -7, dtype=torch.int64)
        buf[1::2] = vals  # offset 1, stride 2; the -7s between are not indices
        out = _on(c, buf, tier)[1::2]
        assert out.storage_offset() > 0 and out.stride() == (2,) and not out.is_contiguous()
        return out

    views = {p: strided(t, "device") for p, t in node.items()}
    host = _write(c, views, node_id=1)
    c.synchronize()
    assert [a.ok for a in c.poll_writes()] == [True]
    assert _same(_bits(data), _read_host(c, host))
    for p, t in node.items():
        c.evict_device(t, pool=p)
    dev = _load(c, {p: strided(t, "host") for p, t in host.items()}, node_id=1)
    c.start_loading()
    c.synchronize()
    assert [a.ok for a in c.poll_loads()] == [True]
    assert _same(_bits(data), _read_device(c, dev))
    _consistent(c)


# ------------------------------------------------------- failed after submission


class _Boom(Exception):
    pass


@contextlib.contextmanager
def _doomed_copies(c: HiCacheController) -> Iterator[None]:
    """Every copy launched inside the block raises when it runs (later, on a sim side stream)."""

    def boom(*args: object) -> None:
        raise _Boom("injected copy failure")

    saved_kernels = dict(transfer._KERNELS)
    saved_native = getattr(c.runtime, "native_copies", None)
    for k in saved_kernels:
        transfer._KERNELS[k] = (boom, boom)
    if saved_native is not None:
        c.runtime.native_copies = type("Doomed", (), {"copy_runs": staticmethod(boom)})()  # type: ignore[attr-defined]
    try:
        yield
    finally:
        transfer._KERNELS.update(saved_kernels)
        if saved_native is not None:
            c.runtime.native_copies = saved_native  # type: ignore[attr-defined]


def _failed_count(c: HiCacheController, direction: str) -> float:
    sink = PrometheusSink()
    sink.handle_batch(list(c.log.events()))
    return sink.snapshot()["hicache_operations_total"][(direction, "failed")]


def _free_node(c: HiCacheController, node: dict[str, torch.Tensor], tier: str) -> None:
    for p, t in node.items():
        (c.evict_host if tier == "host" else c.free_device)(t, pool=p)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_write_whose_copy_fails_after_submission_is_that_ops_failure(
    controllers: Callable[..., HiCacheController], runtime: str, spec: str
) -> None:
    c = controllers(runtime, spec)
    a, b = _alloc(c), _alloc(c)
    _fill(c, a, seed=1)
    data_b = _fill(c, b, seed=2)
    used0 = {k: t.used for k, t in c.state.tables.items()}
    with _doomed_copies(c):
        host_a = _write(c, a, node_id=1)  # launched (on sim: queued) inside the block
    host_b = _write(c, b, node_id=2)
    # unrelated calls drain the side stream (sim) and never raise the copy's failure
    assert c.poll_loads() == []
    c.synchronize()
    acks = c.poll_writes()
    assert [(x.node_ids, x.ok) for x in acks] == [((1,), False), ((2,), True)]
    assert acks[0].error is not None and "_Boom: injected copy failure" in acks[0].error
    assert dict(acks[0].slots_by_pool) == {p: t.numel() for p, t in host_a.items()}
    assert _same(_bits(data_b), _read_host(c, host_b))
    assert c.state.failed[D2H] == 1 and c.state.completed[D2H] == 1
    assert _failed_count(c, D2H) == 1
    failed = [e for e in c.log.events() if isinstance(e, TransferFailed)]
    assert [e.op for e in failed] == [acks[0].op_id]
    _consistent(c)
    # the caller gives the failed write's host slots back (the contract of ok=False): no leak
    _free_node(c, host_a, "host")
    _free_node(c, host_b, "host")
    assert {k: t.used for k, t in c.state.tables.items()} == used0
    _consistent(c)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_load_whose_copy_fails_after_submission_is_that_ops_failure(
    controllers: Callable[..., HiCacheController], runtime: str, spec: str
) -> None:
    c = controllers(runtime, spec)
    a, b = _alloc(c), _alloc(c)
    _fill(c, a, seed=1)
    data_b = _fill(c, b, seed=2)
    host_a, host_b = _write(c, a, node_id=1), _write(c, b, node_id=2)
    c.synchronize()
    assert [x.ok for x in c.poll_writes()] == [True, True]
    _free_node(c, a, "device")
    _free_node(c, b, "device")
    used0 = {k: t.used for k, t in c.state.tables.items()}
    dev_a = _load(c, host_a, node_id=1)
    with _doomed_copies(c):
        c.start_loading()  # node 1's load only
    dev_b = _load(c, host_b, node_id=2)
    c.start_loading()
    assert c.poll_writes() == []
    c.synchronize()
    acks = c.poll_loads()
    assert [(x.node_ids, x.ok) for x in acks] == [((1,), False), ((2,), True)]
    assert acks[0].error is not None and "_Boom: injected copy failure" in acks[0].error
    assert _same(_bits(data_b), _read_device(c, dev_b))
    assert c.state.failed[H2D] == 1 and _failed_count(c, H2D) == 1
    _consistent(c)
    _free_node(c, dev_a, "device")  # a failed load's device slots are the caller's to give back
    _free_node(c, dev_b, "device")
    assert {k: t.used for k, t in c.state.tables.items()} == used0
    _consistent(c)


class _FaultySim(SimRuntime):
    """A sim runtime that fails, when armed, to rebuild the tensors of the work it queues,
    or to answer the query of an event made while armed."""

    armed: str = ""

    def _capture(self, t: Any) -> Any:
        c = super()._capture(t)
        return ("doomed", c) if self.armed == "materialise" else c

    def _materialise(self, c: Any) -> Any:
        if c[0] == "doomed":
            raise _Boom("injected: the arena view could not be rebuilt")
        return super()._materialise(c)

    def event(self, enable_timing: bool = False) -> SimEvent:
        return _BadQuery(self, enable_timing) if self.armed == "query" else super().event(enable_timing)


class _BadQuery(SimEvent):
    __slots__ = ()

    def query(self) -> bool:
        raise _Boom("injected: event query failed")


@pytest.mark.parametrize("fault", ["materialise", "query"])
@pytest.mark.parametrize("spec", SPECS)
def test_a_sim_runtime_failure_after_submission_is_that_ops_failure(
    controllers: Callable[..., HiCacheController], spec: str, fault: str
) -> None:
    rt = _FaultySim()
    c = controllers(rt, spec)
    a, b = _alloc(c), _alloc(c)
    _fill(c, a, seed=1)
    data_b = _fill(c, b, seed=2)
    with rt.paused():  # both stay queued on the write stream
        rt.armed = fault
        _write(c, a, node_id=1)
        rt.armed = ""
        host_b = _write(c, b, node_id=2)
    c.synchronize()
    acks = c.poll_writes()
    assert [(x.node_ids, x.ok) for x in acks] == [((1,), False), ((2,), True)]
    assert acks[0].error is not None and "_Boom: injected" in acks[0].error
    assert _same(_bits(data_b), _read_host(c, host_b))
    _consistent(c)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_failure_at_the_index_move_ends_the_merged_op(
    controllers: Callable[..., HiCacheController], runtime: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception between OperationsMerged and TransferSubmitted used to leave the op
    'merged' forever; it is now submitted without tensors and failed."""
    c = controllers(runtime, "tiny")
    node = _alloc(c)
    host = _write(c, node)
    c.synchronize()
    c.poll_writes()
    c.free_device(node["kv"])
    dev = _load(c, host, node_id=5)

    def refuse(*args: object, **kw: object) -> None:
        raise _Boom("injected index move failure")

    monkeypatch.setattr(c, "_move_op", refuse)
    assert c.start_loading() >= 0
    monkeypatch.undo()
    acks = c.poll_loads()
    assert [(x.node_ids, x.ok) for x in acks] == [((5,), False)]
    assert "injected index move failure" in (acks[0].error or "")
    sub = [e for e in c.log.events() if isinstance(e, TransferSubmitted)][-1]
    assert sub.op == acks[0].op_id and sub.tensors == ()
    assert c.state.ops == {}
    _consistent(c)
    c.free_device(dev["kv"])
    assert not [e for e in c.log.events() if isinstance(e, SlotsFreed) and e.reason == "failed"]


def test_a_sim_tensor_with_a_neg_bit_is_not_captured_for_a_side_stream() -> None:
    """The runtime's own guard, under the controller's refusal: a capture keeps offsets,
    not the view's bits."""
    rt = SimRuntime()
    t = torch._neg_view(rt.to_device(torch.arange(4)))
    assert isinstance(t, SimTensor) and t.is_neg()
    s = rt.stream("side")
    with rt.use(s), pytest.raises(ValueError, match="negative bit"):
        rt.launch(lambda x: None, t)
    assert rt.pending_work() == 0
