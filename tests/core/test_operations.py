"""Operations: ``merge_ops`` semantics and SGLang #23429 (moves never mutate the caller's transfers)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hicache_obs.core import CacheOperation, HybridCacheController, ModelSpec, PoolTransfer
from hicache_obs.core._operations import merge_ops
from hicache_obs.errors import ConfigError, UnresolvedTransferError
from hicache_obs.events import IndicesMoved


def _t(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ------------------------------------------------------------------ merge_ops


def test_merge_of_one_op_is_an_alias():
    t = PoolTransfer("mamba", _t(1), _t(2))
    op = CacheOperation(_t(0, 1), _t(2, 3), node_ids=(5,), pool_transfers=(t,))
    assert merge_ops([op]) is op


def test_merge_of_nothing_is_refused():
    with pytest.raises(ConfigError, match="at least one"):
        merge_ops([])


def test_merge_concatenates_in_queue_order():
    a = CacheOperation(_t(4, 5), _t(10, 11), node_ids=(1,), priority=7)
    b = CacheOperation(_t(0), _t(20), node_ids=(2,), priority=3)
    c = CacheOperation(_t(9, 8), _t(30, 31), node_ids=(3, 4), priority=5)
    m = merge_ops([a, b, c], new_id=1000)
    assert m.host_indices.tolist() == [4, 5, 0, 9, 8]
    assert m.device_indices.tolist() == [10, 11, 20, 30, 31]
    assert m.node_ids == (1, 2, 3, 4)
    assert m.priority == 3
    assert m.id == 1000
    assert m.pool_transfers is None
    # the inputs are untouched
    assert a.host_indices.tolist() == [4, 5] and a.node_ids == (1,) and a.priority == 7


def test_merge_priority_defaults_to_the_op_ids():
    a = CacheOperation(_t(0), _t(0))
    b = CacheOperation(_t(1), _t(1))
    assert a.priority == a.id and b.priority == b.id and b.id > a.id
    m = merge_ops([b, a])
    assert m.priority == a.id
    assert m.id not in (a.id, b.id)


def test_merge_groups_pool_transfers_by_pool_and_source_in_first_seen_order():
    a = CacheOperation(
        _t(0),
        _t(0),
        pool_transfers=(
            PoolTransfer("mamba", _t(1), _t(11)),
            PoolTransfer("swa", indices_from_pool="kv"),
        ),
    )
    b = CacheOperation(_t(1), _t(1))  # no transfers at all
    c = CacheOperation(
        _t(2),
        _t(2),
        pool_transfers=[  # a list is accepted and stored as a tuple
            PoolTransfer("swa", _t(40), _t(50)),
            PoolTransfer("swa", indices_from_pool="kv"),
            PoolTransfer("mamba", None, _t(12)),  # host side not resolved yet
            PoolTransfer("mamba", _t(3), _t(13)),
        ],
    )
    assert isinstance(c.pool_transfers, tuple)
    m = merge_ops([a, b, c])
    assert m.pool_transfers is not None
    got = [
        (
            t.pool,
            t.indices_from_pool,
            None if t.host_indices is None else t.host_indices.tolist(),
            None if t.device_indices is None else t.device_indices.tolist(),
        )
        for t in m.pool_transfers
    ]
    assert got == [
        ("mamba", None, [1, 3], [11, 12, 13]),  # non-None sides concatenated
        ("swa", "kv", None, None),
        ("swa", None, [40], [50]),
    ]
    # the callers' transfers are unchanged
    assert a.pool_transfers is not None and a.pool_transfers[0].host_indices.tolist() == [1]  # type: ignore[union-attr]


def test_operations_and_transfers_are_frozen():
    t = PoolTransfer("mamba", _t(1), _t(2))
    op = CacheOperation(_t(0), _t(0), pool_transfers=(t,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.host_indices = _t(9)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.host_indices = _t(9)  # type: ignore[misc]
    t2 = t.with_indices(_t(7), _t(8))
    assert t2 is not t and t.host_indices.tolist() == [1] and t2.host_indices.tolist() == [7]  # type: ignore[union-attr]
    assert t.name == "mamba"


def test_pool_transfer_rejects_an_unknown_hit_policy():
    with pytest.raises(ConfigError, match=r"'mamba'.*'newest'"):
        PoolTransfer("mamba", hit_policy="newest")


# ---------------------------------------------------------- SGLang #23429


def _snapshot(rt, op: CacheOperation):
    """Identity, device and values of every tensor the caller's op holds."""
    out = [("op", "host", id(op.host_indices), rt.tensor_device(op.host_indices), rt.to_host(op.host_indices).tolist())]
    out.append(
        (
            "op",
            "device",
            id(op.device_indices),
            rt.tensor_device(op.device_indices),
            rt.to_host(op.device_indices).tolist(),
        )
    )
    for t in op.pool_transfers or ():
        for role, x in (("host", t.host_indices), ("device", t.device_indices)):
            out.append(
                (
                    t.pool,
                    role,
                    id(x),
                    None if x is None else rt.tensor_device(x),
                    None if x is None else rt.to_host(x).tolist(),
                )
            )
    return out


def _hybrid_op(c: HybridCacheController, *, with_alias: bool) -> CacheOperation:
    rt = c.runtime
    transfers = [PoolTransfer("mamba", _t(6, 2), rt.to_device(_t(4, 1)))]
    if with_alias:
        transfers.append(PoolTransfer("swa", indices_from_pool="kv"))
    host = torch.arange(47, 31, -1, dtype=torch.int64)  # unsorted: `direct` + layer_first sorts it
    device = rt.to_device(torch.arange(16, dtype=torch.int64))
    return CacheOperation(host, device, node_ids=(3,), pool_transfers=tuple(transfers))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("through_merge", [False, True], ids=["op", "merge_alias"])
def test_move_hybrid_indices_leaves_the_callers_transfers_alone(
    make_controller, runtime_name, io_backend, layout, through_merge
):
    # Mamba and SWA in one model: a real transfer and an alias of the anchor's indices
    spec = dataclasses.replace(ModelSpec.tiny_hybrid(), name="tiny_mamba_swa", swa_layer_ids=(3,), swa_window=64)
    c = make_controller(spec=spec, io_backend=io_backend, layout=layout)
    assert isinstance(c, HybridCacheController)
    rt = c.runtime
    op = _hybrid_op(c, with_alias=True)
    caller_transfers = op.pool_transfers
    before = _snapshot(rt, op)

    target = merge_ops([op]) if through_merge else op
    assert target is op
    moved = c.move_hybrid_indices(target)

    assert moved is not op
    assert op.pool_transfers is caller_transfers
    assert _snapshot(rt, op) == before, "the caller's op or transfers were changed"
    assert moved.pool_transfers is not None and len(moved.pool_transfers) == 2
    for new, old in zip(moved.pool_transfers, caller_transfers or ()):
        assert new is not old and new.pool == old.pool
    mamba, swa = moved.pool_transfers
    # the alias's indices come from the (moved) anchor
    assert swa.host_indices is moved.host_indices and swa.device_indices is moved.device_indices
    # pairs stay pairs whatever the move did
    pairs = dict(zip(rt.to_host(moved.host_indices).tolist(), rt.to_host(moved.device_indices).tolist()))
    assert pairs == dict(zip(range(47, 31, -1), range(16)))
    assert dict(zip(rt.to_host(mamba.host_indices).tolist(), rt.to_host(mamba.device_indices).tolist())) == {6: 4, 2: 1}  # type: ignore[arg-type]
    if io_backend == "kernel" and rt.has_device:
        assert rt.is_device(moved.host_indices) and rt.is_device(mamba.host_indices)  # type: ignore[arg-type]
        moves = [(e.pool, e.role) for e in c.log.events() if isinstance(e, IndicesMoved)]
        assert moves == [("kv", "host"), ("mamba", "host")]
    if io_backend == "direct":
        assert not rt.is_device(moved.device_indices) and not rt.is_device(mamba.device_indices)  # type: ignore[arg-type]
        if layout == "layer_first":
            assert rt.to_host(moved.host_indices).tolist() == sorted(range(32, 48))


def test_move_hybrid_indices_rejects_an_unresolved_transfer(make_controller, assert_rejected, runtime_name):
    c = make_controller(spec="tiny_hybrid")
    device = c.runtime.to_device(_t(*range(16)))
    op = CacheOperation(_t(*range(16)), device, pool_transfers=(PoolTransfer("mamba", _t(1), None),))
    assert_rejected(c, UnresolvedTransferError, lambda: c.move_hybrid_indices(op), "'mamba'", "device_indices is None")
    assert op.pool_transfers[0].device_indices is None  # type: ignore[index]
    # an alias of a pool the op does not carry
    op = CacheOperation(_t(*range(16)), device, pool_transfers=(PoolTransfer("swa", indices_from_pool="mamba"),))
    assert_rejected(c, UnresolvedTransferError, lambda: c.move_hybrid_indices(op), "'swa'", "'mamba'", "lacks")


@pytest.mark.parametrize("spec_name", ["tiny_hybrid", "tiny_swa"])  # plain controllers take no transfers
def test_write_and_load_never_change_the_callers_transfers(make_controller, cache_kit, runtime_name, spec_name):
    c = make_controller()
    assert isinstance(c, HybridCacheController)
    side = cache_kit.sidecars(c)[0]
    node = cache_kit.alloc_node(c, 16)
    wt = PoolTransfer(side, device_indices=node[side])
    before = (wt.host_indices, wt.device_indices, cache_kit.values(c, node[side]))
    res = c.write(node["kv"], pool_transfers=[wt])
    assert res is not None
    host, resolved = res
    assert resolved is not None and resolved[0] is not wt
    c.poll_writes()
    assert (wt.host_indices, wt.device_indices) == before[:2] and cache_kit.values(c, wt.device_indices) == before[2]

    cache_kit.evict_device(c, node)
    lt = PoolTransfer(side, host_indices=resolved[0].host_indices)
    res = c.load(host, pool_transfers=(lt,))
    assert res is not None
    c.start_loading()
    c.poll_loads()
    assert lt.device_indices is None and lt.host_indices is resolved[0].host_indices
    assert not c.runtime.is_device(lt.host_indices)  # type: ignore[arg-type]
    assert not c.runtime.is_device(host)
