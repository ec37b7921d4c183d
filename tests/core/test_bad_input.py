"""Misuse raises a specific HiCacheError naming pool, argument and value, and changes nothing.

Each rejected call is checked with ``assert_rejected``: the exact exception class, the
message fragments, and that bookkeeping, event log, queued work and the bytes of
every pool are the same afterwards.
"""

from __future__ import annotations

import pytest
import torch

from hicache_obs.core import HiCacheController, HybridCacheController, ModelSpec, PoolTransfer, make_runtime
from hicache_obs.errors import (
    ControllerClosedError,
    DoubleFreeError,
    InvalidIndicesError,
    LengthMismatchError,
    PageSizeError,
    RuntimeUnavailableError,
    SlotNotAllocatedError,
    UnknownBackendError,
    UnknownLayoutError,
    UnknownPoolError,
    UnresolvedTransferError,
)

HYBRID = ["tiny_hybrid", "tiny_swa"]


@pytest.fixture
def backed_up(make_controller, cache_kit, runtime_name, spec_name):
    """A controller with one node on the device and its backup on the host (reaped)."""
    c = make_controller()
    node = cache_kit.alloc_node(c, 16)
    cache_kit.fill(c, node, seed=1)
    host = cache_kit.write(c, node, node_id=1)
    assert host is not None
    assert [a.ok for a in c.poll_writes()] == [True]
    return c, node, host


def _cpu(c, t):
    return c.runtime.to_host(t)


def _dev(c, values):
    return c.runtime.to_device(torch.tensor(values, dtype=torch.int64))


def _values_checked(c, t):
    """Index values are checked where reading them needs no device sync (cpu, sim), not on cuda."""
    return c.runtime.values_readable(t)


# ------------------------------------------------------------- index tensors


@pytest.mark.parametrize(
    ("dtype", "shown"), [(torch.int32, "torch.int32"), (torch.float32, "torch.float32")], ids=["int32", "float"]
)
def test_wrong_dtype(backed_up, cache_kit, assert_rejected, dtype, shown):
    c, node, host = backed_up
    bad_dev = c.runtime.to_device(_cpu(c, node["kv"]).to(dtype))
    assert_rejected(
        c, InvalidIndicesError, lambda: cache_kit.write(c, {**node, "kv": bad_dev}), "device_indices", "'kv'", shown
    )
    bad_host = host["kv"].to(dtype)
    assert_rejected(
        c, InvalidIndicesError, lambda: cache_kit.load(c, {**host, "kv": bad_host}), "host_indices", "'kv'", shown
    )
    assert_rejected(c, InvalidIndicesError, lambda: c.evict_host(bad_host), "host_indices", "'kv'", shown)
    assert_rejected(c, InvalidIndicesError, lambda: c.evict_device(bad_dev), "device_indices", "'kv'", shown)


@pytest.mark.parametrize("spec_name", HYBRID)
def test_wrong_dtype_of_a_sidecar_transfer(backed_up, cache_kit, assert_rejected, runtime_name, spec_name):
    c, node, _host = backed_up
    side = cache_kit.sidecars(c)[0]
    bad = c.runtime.to_device(_cpu(c, node[side]).to(torch.int32))
    assert_rejected(
        c,
        InvalidIndicesError,
        lambda: cache_kit.write(c, {**node, side: bad}),
        "device_indices",
        repr(side),
        "torch.int32",
    )


def test_wrong_rank(backed_up, cache_kit, assert_rejected):
    c, node, host = backed_up
    bad_dev = c.runtime.to_device(_cpu(c, node["kv"]).reshape(2, 8))
    assert_rejected(
        c, InvalidIndicesError, lambda: cache_kit.write(c, {**node, "kv": bad_dev}), "device_indices", "'kv'", "(2, 8)"
    )
    bad_host = host["kv"].reshape(4, 4)
    assert_rejected(
        c, InvalidIndicesError, lambda: cache_kit.load(c, {**host, "kv": bad_host}), "host_indices", "'kv'", "(4, 4)"
    )


def test_not_a_tensor(backed_up, cache_kit, assert_rejected):
    c, _node, host = backed_up
    values = host["kv"].tolist()
    assert_rejected(c, InvalidIndicesError, lambda: c.evict_host(values), "host_indices", "'kv'", "list")


@pytest.mark.parametrize("runtime_name", ["sim"])
def test_cpu_tensor_as_device_indices_on_sim(backed_up, cache_kit, assert_rejected, runtime_name):
    c, node, _host = backed_up
    on_cpu = _cpu(c, node["kv"])
    assert_rejected(
        c,
        InvalidIndicesError,
        lambda: cache_kit.write(c, {**node, "kv": on_cpu}),
        "device_indices",
        "'kv'",
        "sim:0",
        "cpu",
    )
    assert_rejected(c, InvalidIndicesError, lambda: c.evict_device(on_cpu), "device_indices", "'kv'", "cpu")


@pytest.mark.parametrize("runtime_name", ["sim"])
def test_sim_device_tensor_as_host_indices(backed_up, cache_kit, assert_rejected, runtime_name):
    c, _node, host = backed_up
    on_dev = c.runtime.to_device(host["kv"])
    assert_rejected(
        c, InvalidIndicesError, lambda: cache_kit.load(c, {**host, "kv": on_dev}), "host_indices", "'kv'", "sim:0"
    )
    assert_rejected(c, InvalidIndicesError, lambda: c.evict_host(on_dev), "host_indices", "'kv'", "sim:0")


def test_out_of_range(backed_up, cache_kit, assert_rejected):
    c, node, host = backed_up
    dev_values = cache_kit.values(c, node["kv"])
    bad_dev = _dev(c, [9999, *dev_values[1:]])
    if _values_checked(c, bad_dev):
        assert_rejected(
            c,
            SlotNotAllocatedError,
            lambda: cache_kit.write(c, {**node, "kv": bad_dev}),
            "device_indices",
            "'kv'",
            "9999",
        )
    bad_host = torch.tensor([*host["kv"].tolist()[:-1], -3], dtype=torch.int64)
    assert_rejected(
        c, SlotNotAllocatedError, lambda: cache_kit.load(c, {**host, "kv": bad_host}), "host_indices", "'kv'", "-3"
    )
    assert_rejected(c, SlotNotAllocatedError, lambda: c.evict_host(bad_host), "host_indices", "'kv'", "-3")


def test_duplicate_slots(backed_up, cache_kit, assert_rejected):
    c, node, host = backed_up
    v = cache_kit.values(c, node["kv"])
    dup_dev = _dev(c, [v[0], *v[:-1]])
    if _values_checked(c, dup_dev):
        assert_rejected(
            c,
            InvalidIndicesError,
            lambda: cache_kit.write(c, {**node, "kv": dup_dev}),
            "device_indices",
            "'kv'",
            f"[{v[0]}]",
        )
    h = host["kv"].tolist()
    dup_host = torch.tensor([*h[:-1], h[3]], dtype=torch.int64)
    assert_rejected(
        c, InvalidIndicesError, lambda: cache_kit.load(c, {**host, "kv": dup_host}), "host_indices", "'kv'", f"[{h[3]}]"
    )


def test_use_of_slots_that_are_not_allocated(backed_up, cache_kit, assert_rejected):
    c, node, host = backed_up
    cache_kit.evict_host(c, host)
    assert_rejected(
        c, SlotNotAllocatedError, lambda: cache_kit.load(c, host), "host_indices", "'kv'", str(host["kv"].tolist()[:8])
    )
    cache_kit.evict_device(c, node)
    if _values_checked(c, node["kv"]):
        assert_rejected(
            c, SlotNotAllocatedError, lambda: cache_kit.write(c, node), "device_indices", "'kv'", "not allocated"
        )


def test_length_mismatch_in_move_indices(backed_up, assert_rejected):
    c, node, host = backed_up
    short = node["kv"][:8]
    assert_rejected(
        c,
        LengthMismatchError,
        lambda: c.move_indices(host["kv"], short),
        "'kv'",
        "host indices have 16",
        "device indices 8",
    )


@pytest.mark.parametrize("spec_name", HYBRID)
def test_length_mismatch_of_a_sidecar_in_move_hybrid_indices(
    backed_up, cache_kit, assert_rejected, runtime_name, spec_name
):
    from hicache_obs.core import CacheOperation

    c, node, host = backed_up
    side = cache_kit.sidecars(c)[0]
    t = PoolTransfer(side, host[side], node[side][:1])
    op = CacheOperation(host["kv"], node["kv"], pool_transfers=(t,))
    assert_rejected(
        c,
        LengthMismatchError,
        lambda: c.move_hybrid_indices(op),
        repr(side),
        f"host indices have {host[side].numel()}",
        "device indices 1",
    )
    assert op.pool_transfers == (t,) and t.device_indices.numel() == 1  # type: ignore[union-attr]


def test_double_free(backed_up, cache_kit, assert_rejected):
    c, node, host = backed_up
    c.evict_host(host["kv"])
    assert_rejected(
        c,
        DoubleFreeError,
        lambda: c.evict_host(host["kv"]),
        "host_indices",
        "'kv'",
        "double free",
        str(host["kv"].tolist()[:8]),
    )
    c.evict_device(node["kv"])
    assert_rejected(c, DoubleFreeError, lambda: c.evict_device(node["kv"]), "device_indices", "'kv'", "double free")


# ------------------------------------------------------------------ pools


def test_unknown_pool(backed_up, cache_kit, assert_rejected):
    c, _node, host = backed_up
    assert_rejected(c, UnknownPoolError, lambda: c.alloc_device(16, pool="nope"), "pool", "'nope'")
    assert_rejected(c, UnknownPoolError, lambda: c.evict_host(host["kv"], pool="nope"), "pool", "'nope'")
    assert_rejected(c, UnknownPoolError, lambda: c.device_pool("nope"), "pool", "'nope'")


@pytest.mark.parametrize("spec_name", HYBRID)
def test_unknown_pool_in_a_transfer(backed_up, cache_kit, assert_rejected, runtime_name, spec_name):
    c, node, _host = backed_up
    side = cache_kit.sidecars(c)[0]
    t = PoolTransfer("nope", device_indices=node[side])
    assert_rejected(c, UnknownPoolError, lambda: c.write(node["kv"], pool_transfers=[t]), "pool", "'nope'")
    kv_as_side = PoolTransfer("kv", device_indices=node["kv"])
    assert_rejected(c, UnknownPoolError, lambda: c.write(node["kv"], pool_transfers=[kv_as_side]), "pool", "'kv'")


def test_unknown_pool_in_pool_sizes(runtime_name):
    with pytest.raises(UnknownPoolError, match=r"pool_sizes.*'mamba'"):
        HiCacheController(ModelSpec.tiny(), runtime=runtime_name, device_size=64, pool_sizes={"mamba": 8})


# -------------------------------------------------------------- constructor


@pytest.mark.parametrize(
    ("options", "error", "fragments"),
    [
        ({"io_backend": "dma"}, UnknownBackendError, ("io backend", "'dma'")),
        ({"layout": "head_first"}, UnknownLayoutError, ("layout", "'head_first'")),
        (
            {"layout": "page_first_direct", "io_backend": "kernel"},
            UnknownLayoutError,
            ("'page_first_direct'", "'kernel'"),
        ),
    ],
    ids=["backend", "layout", "page_first_direct+kernel"],
)
def test_unknown_backend_or_layout(runtime_name, spec_name, options, error, fragments):
    spec = ModelSpec.preset(spec_name)
    cls = HybridCacheController if spec.is_hybrid else HiCacheController
    with pytest.raises(error) as info:
        cls(spec, runtime=runtime_name, device_size=64, **options)
    assert type(info.value) is error
    for f in fragments:
        assert f in str(info.value)


def test_page_first_direct_with_direct_works(make_controller, cache_kit, runtime_name, spec_name):
    c = make_controller(io_backend="direct", layout="page_first_direct")
    node = cache_kit.alloc_node(c, 16)
    data = cache_kit.fill(c, node, seed=3)
    host = cache_kit.write(c, node)
    assert host is not None
    c.poll_writes()
    assert cache_kit.same(cache_kit.read_host(c, host), data)


# ---------------------------------------------------------- pool transfers


@pytest.mark.parametrize("spec_name", HYBRID)
def test_pool_transfers_none_means_no_transfers(backed_up, cache_kit, runtime_name, spec_name):
    c, node, _host = backed_up
    res = c.write(node["kv"], pool_transfers=None)
    assert res is not None
    h, transfers = res
    assert transfers is None
    acks = c.poll_writes()
    assert [dict(a.slots_by_pool) for a in acks] == [{"kv": 16}]
    res = c.load(h, pool_transfers=None)
    assert res is not None and res[1] is None


@pytest.mark.parametrize("spec_name", HYBRID)
def test_a_transfer_with_a_none_side_is_unresolved(backed_up, cache_kit, assert_rejected, runtime_name, spec_name):
    c, node, host = backed_up
    side = cache_kit.sidecars(c)[0]
    write_t = PoolTransfer(side, host_indices=host[side])  # device side missing
    assert_rejected(
        c,
        UnresolvedTransferError,
        lambda: c.write(node["kv"], pool_transfers=[write_t]),
        repr(side),
        "device_indices",
        "None",
    )
    load_t = PoolTransfer(side, device_indices=node[side])  # host side missing
    assert_rejected(
        c,
        UnresolvedTransferError,
        lambda: c.load(host["kv"], pool_transfers=[load_t]),
        repr(side),
        "host_indices",
        "None",
    )


# ---------------------------------------------------------------- page size


def test_page_size_violations(backed_up, cache_kit, assert_rejected):
    c, node, host = backed_up
    assert_rejected(c, PageSizeError, lambda: c.alloc_device(10), "'kv'", "10", "page size 16")
    part = node["kv"][:8]
    assert_rejected(
        c,
        PageSizeError,
        lambda: cache_kit.write(c, {**node, "kv": part}),
        "device_indices",
        "'kv'",
        "8 entries",
        "page size 16",
    )
    assert_rejected(c, PageSizeError, lambda: c.evict_host(host["kv"][:4]), "host_indices", "'kv'", "4 entries")


@pytest.mark.parametrize("spec_name", ["tiny_swa"])
def test_page_size_of_a_sidecar(backed_up, cache_kit, assert_rejected, runtime_name, spec_name):
    c, node, _host = backed_up
    part = node["swa"][:5]
    assert_rejected(
        c,
        PageSizeError,
        lambda: cache_kit.write(c, {**node, "swa": part}),
        "device_indices",
        "'swa'",
        "5 entries",
        "16",
    )
    assert_rejected(c, PageSizeError, lambda: c.alloc_device(3, pool="swa"), "'swa'", "3")


# --------------------------------------------------------------- life cycle


def test_operations_after_close(backed_up, cache_kit, assert_rejected):
    c, node, host = backed_up
    c.close()
    c.close()  # idempotent
    assert c.closed
    for call in (
        lambda: c.alloc_device(16),
        lambda: cache_kit.write(c, node),
        lambda: cache_kit.load(c, host),
        lambda: c.start_writing(),
        lambda: c.start_loading(),
        lambda: c.evict_device(node["kv"]),
        lambda: c.evict_host(host["kv"]),
        lambda: c.free_device(node["kv"]),
        lambda: c.move_indices(host["kv"], node["kv"]),
        lambda: c.poll_writes(),
        lambda: c.poll_loads(),
    ):
        assert_rejected(c, ControllerClosedError, call, "closed")


def test_cuda_runtime_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(RuntimeUnavailableError, match=r"'cuda'.*is_available"):
        make_runtime("cuda")
    with pytest.raises(RuntimeUnavailableError, match="'cuda'"):
        HiCacheController(ModelSpec.tiny(), runtime="cuda", device_size=64)
