"""The CPU stand-ins for SGLang's KV-transfer kernels (no SGLang needed).

Buffers have the shapes SGLang's pools use and the ops get arguments built the
way its host pools build them; each result is compared with plain indexing.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_obs.lab.sglang import kernels as K
from hicache_obs.lab.sglang.kernels import KernelCheckError, UnmappedAddressError

L, H, D = 3, 2, 8  # layers, heads, head_dim
DEV, HOST = 24, 32  # device and host slots (tokens)
DT = torch.float16
STRIDE = H * D * DT.itemsize  # token_stride_size: bytes of one token in one layer
LAYOUT = STRIDE * L  # layout_dim of a page-first host buffer

fast = settings(max_examples=15, deadline=None)


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, like the harness's device index tensors."""

    @property  # type: ignore[misc]
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def dev(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(FakeCuda)


def idx(values: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return dev(torch.tensor(list(values), dtype=dtype))


def cpu_idx(values: Any) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def ptrs(tensors: Any) -> torch.Tensor:
    """A pointer table, as ``torch.tensor([x.data_ptr() for x in ...], dtype=torch.uint64)`` in the pools."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def rand(*shape: int, dtype: torch.dtype = DT) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so NaN payloads and -0.0 compare exactly."""
    return t.contiguous().view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.fixture
def registered() -> Iterator[Callable[..., None]]:
    """register(*tensors) into the default registry, forgotten again after the test."""
    added: list[torch.Tensor] = []

    def register(*tensors: Any) -> None:
        flat = list(K._flatten(tensors))
        K.register_buffers(*flat)
        added.extend(flat)

    yield register
    for t in added:
        K.MEMORY.unregister(t)


def pairs(src_slots: int, dst_slots: int, max_size: int = 8) -> st.SearchStrategy[tuple[list[int], list[int]]]:
    """Random index pairs: distinct destinations (a kernel's duplicate writes race), any sources."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[list[int], list[int]]:
        dst = draw(st.lists(st.integers(0, dst_slots - 1), min_size=1, max_size=max_size, unique=True))
        src = draw(st.lists(st.integers(0, src_slots - 1), min_size=len(dst), max_size=len(dst)))
        return src, dst

    return build()


def page_pairs(src_pages: int, dst_pages: int, page: int) -> st.SearchStrategy[tuple[list[int], list[int]]]:
    """Token indices of whole pages, as the controllers hand them over."""

    def tokens(pages: list[int]) -> list[int]:
        return [p * page + t for p in pages for t in range(page)]

    return pairs(src_pages, dst_pages, 4).map(lambda sd: (tokens(sd[0]), tokens(sd[1])))


def mha_device() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """MHATokenToKVPool's k_buffer / v_buffer: one [size, head_num, head_dim] tensor per layer."""
    return [rand(DEV, H, D) for _ in range(L)], [rand(DEV, H, D) for _ in range(L)]


# --------------------------------------------------------------------------- memory


def test_memory_resolves_views_and_copies_through() -> None:
    mem = K.Memory()
    t = torch.arange(64, dtype=torch.uint8)
    mem.register(t[8:])  # a view registers its whole storage
    assert mem.ranges() == [(t.data_ptr(), 64)]
    view = mem.view(t.data_ptr() + 4, 8)
    assert view.tolist() == list(range(4, 12))
    view.fill_(0)
    assert t[4:12].tolist() == [0] * 8
    rows = mem.gather(t.data_ptr(), torch.tensor([16, 40]), 4)
    assert rows.tolist() == [[16, 17, 18, 19], [40, 41, 42, 43]]
    mem.scatter(t.data_ptr() + 1, torch.tensor([0, 50]), torch.full((2, 3), 7, dtype=torch.uint8))
    assert t[1:4].tolist() == [7, 7, 7] and t[51:54].tolist() == [7, 7, 7]
    buf, at = mem.locate(t.data_ptr() + 10, 2)
    assert at == 10 and buf.data_ptr() == t.data_ptr()


def test_memory_word_path_matches_bytes() -> None:
    mem = K.Memory()
    t = torch.randint(0, 255, (256,), dtype=torch.uint8)
    mem.register(t)
    aligned = mem.gather(t.data_ptr(), torch.tensor([0, 64, 8]), 16)  # 8-byte words
    odd = mem.gather(t.data_ptr(), torch.tensor([3, 17]), 5)  # bytes
    assert torch.equal(aligned, torch.stack([t[0:16], t[64:80], t[8:24]]))
    assert torch.equal(odd, torch.stack([t[3:8], t[17:22]]))


def test_memory_errors_name_the_address() -> None:
    mem = K.Memory()
    t = torch.zeros(16, dtype=torch.uint8)
    mem.register(t)
    other = torch.zeros(4)
    with pytest.raises(UnmappedAddressError, match=rf"{other.data_ptr():#x} \(\+4 bytes\) is in no registered buffer"):
        mem.view(other.data_ptr(), 4)
    with pytest.raises(UnmappedAddressError, match=r"runs 4 bytes past the end of the registered buffer"):
        mem.view(t.data_ptr() + 12, 8)


def test_memory_forgets_freed_buffers_and_unregisters() -> None:
    mem = K.Memory()
    t = torch.zeros(8)
    mem.register(t)
    mem.register(t[2:])  # same storage: one range
    assert len(mem.ranges()) == 1
    del t
    assert mem.ranges() == []
    u = torch.zeros(8)
    K.register_buffers([u, [None, u[1:]]], memory=mem)
    assert mem.unregister(u) and not mem.unregister(u)
    mem.register(u)
    mem.clear()
    assert mem.ranges() == []


# --------------------------------------------------------------------------- kernel ops, MHA


@fast
@given(pairs(HOST, DEV), st.integers(0, L - 1))
def test_per_layer_layer_first(sd: tuple[list[int], list[int]], layer: int) -> None:
    """0.5.10/0.5.23 load, layer_first host (2, layers, size, heads, dim) -> device layer."""
    src, dst = sd
    host = rand(2, L, HOST, H, D)
    dk, dv = mha_device()
    want_k, want_v = [t.clone() for t in dk], [t.clone() for t in dv]
    want_k[layer][dst] = host[0, layer][src]
    want_v[layer][dst] = host[1, layer][src]
    K.transfer_kv_per_layer(
        src_k=host[0][layer],
        dst_k=dk[layer],
        src_v=host[1][layer],
        dst_v=dv[layer],
        src_indices=idx(src),
        dst_indices=idx(dst),
        item_size=STRIDE,
    )
    assert all(same(a, b) for a, b in zip(dk + dv, want_k + want_v))


@fast
@given(pairs(HOST, DEV), st.integers(0, L - 1))
def test_per_layer_page_first_to_layer_first(sd: tuple[list[int], list[int]], layer: int) -> None:
    """Load from a page_first host (2, size, layers, heads, dim): offset = index * layout_dim + layer * item_size."""
    src, dst = sd
    host = rand(2, HOST, L, H, D)
    dk, dv = mha_device()
    want_k, want_v = [t.clone() for t in dk], [t.clone() for t in dv]
    want_k[layer][dst] = host[0][src, layer]
    want_v[layer][dst] = host[1][src, layer]
    K.transfer_kv_per_layer_pf_lf(
        src_k=host[0],
        dst_k=dk[layer],
        src_v=host[1],
        dst_v=dv[layer],
        src_indices=idx(src),
        dst_indices=idx(dst),
        layer_id=layer,
        item_size=STRIDE,
        src_layout_dim=LAYOUT,
    )
    assert all(same(a, b) for a, b in zip(dk + dv, want_k + want_v))


@fast
@given(pairs(DEV, HOST))
def test_all_layer_through_pointer_tables(sd: tuple[list[int], list[int]]) -> None:
    """Backup, layer_first host: device k_data_ptrs -> host k_data_ptrs of kv_buffer[0][i]."""
    src, dst = sd
    host = torch.zeros(2, L, HOST, H, D, dtype=DT)
    dk, dv = mha_device()
    want = host.clone()
    for layer in range(L):
        want[0, layer][dst] = dk[layer][src]
        want[1, layer][dst] = dv[layer][src]
    mem_before = len(K.MEMORY.ranges())
    K.register_buffers(dk, dv, host)
    try:
        K.transfer_kv_all_layer(
            src_k_layers=ptrs(dk),
            dst_k_layers=ptrs(host[0][i] for i in range(L)),
            src_v_layers=ptrs(dv),
            dst_v_layers=ptrs(host[1][i] for i in range(L)),
            src_indices=idx(src),
            dst_indices=idx(dst),
            item_size=STRIDE,
            num_layers=L,
        )
    finally:
        for t in (*dk, *dv, host):
            K.MEMORY.unregister(t)
    assert len(K.MEMORY.ranges()) == mem_before
    assert same(host, want)


@fast
@given(pairs(DEV, HOST))
def test_all_layer_layer_first_to_page_first(sd: tuple[list[int], list[int]]) -> None:
    """Backup into a page_first host: dst offset = index * dst_layout_dim + layer * item_size."""
    src, dst = sd
    host = rand(2, HOST, L, H, D)
    dk, dv = mha_device()
    want = host.clone()
    for layer in range(L):
        want[0][dst, layer] = dk[layer][src]
        want[1][dst, layer] = dv[layer][src]
    K.register_buffers(dk, dv)
    try:
        K.transfer_kv_all_layer_lf_pf(
            src_k_layers=ptrs(dk),
            dst_k=host[0],
            src_v_layers=ptrs(dv),
            dst_v=host[1],
            src_indices=idx(src),
            dst_indices=idx(dst),
            item_size=STRIDE,
            dst_layout_dim=LAYOUT,
            num_layers=L,
        )
    finally:
        for t in (*dk, *dv):
            K.MEMORY.unregister(t)
    assert same(host, want)


def test_draft_layers_concatenated_tables(registered: Callable[..., None]) -> None:
    """0.5.23 cats the draft pools' tables onto the target's: layers may live in separate allocations."""
    dk, dv = mha_device()
    draft_k, draft_v = rand(DEV, H, D), rand(DEV, H, D)
    host = torch.zeros(2, HOST, L + 1, H, D, dtype=DT)
    registered(dk, dv, draft_k, draft_v)
    K.transfer_kv_all_layer_lf_pf(
        src_k_layers=torch.cat([ptrs(dk), ptrs([draft_k])]),
        dst_k=host[0],
        src_v_layers=torch.cat([ptrs(dv), ptrs([draft_v])]),
        dst_v=host[1],
        src_indices=idx([5, 1]),
        dst_indices=idx([0, 9]),
        item_size=STRIDE,
        dst_layout_dim=STRIDE * (L + 1),
        num_layers=L + 1,
    )
    assert same(host[0][[0, 9], L], draft_k[[5, 1]]) and same(host[1][[0, 9], 0], dv[0][[5, 1]])


def test_page_head_round_trip(registered: Callable[..., None]) -> None:
    """page_head host [page, head, page_size, layer, dim], head by head (0.5.10 imports these unguarded)."""
    page = 4
    dk, dv = mha_device()
    host = torch.zeros(2, HOST // page, H, page, L, D, dtype=DT)
    registered(dk, dv)
    src, dst = [4, 5, 6, 7, 12, 13, 14, 15], [8, 9, 10, 11, 0, 1, 2, 3]
    K.transfer_kv_all_layer_lf_ph(
        src_k_layers=ptrs(dk),
        dst_k=host[0],
        src_v_layers=ptrs(dv),
        dst_v=host[1],
        src_indices=idx(src),
        dst_indices=idx(dst),
        item_size=STRIDE,
        dst_layout_dim=LAYOUT,
        num_layers=L,
        page_size=page,
        head_num=H,
    )
    for s, d in zip(src, dst):
        for layer in range(L):
            assert same(host[0, d // page, :, d % page, layer], dk[layer][s])
            assert same(host[1, d // page, :, d % page, layer], dv[layer][s])
    back_k, back_v = [torch.zeros_like(t) for t in dk], [torch.zeros_like(t) for t in dv]
    for layer in range(L):
        K.transfer_kv_per_layer_ph_lf(
            src_k=host[0],
            dst_k=back_k[layer],
            src_v=host[1],
            dst_v=back_v[layer],
            src_indices=idx(dst),
            dst_indices=idx(src),
            layer_id=layer,
            item_size=STRIDE,
            src_layout_dim=LAYOUT,
            page_size=page,
            head_num=H,
        )
        assert same(back_k[layer][src], dk[layer][src]) and same(back_v[layer][src], dv[layer][src])
        assert not back_k[layer][[0, 1, 2, 3]].any()


# --------------------------------------------------------------------------- kernel ops, single buffer (MLA, Mamba)

STATE = (2, 4, 4)  # Mamba temporal state per slot (float32): 128 bytes
CONV = (3, 16)  # one conv state per slot (bfloat16): 96 bytes
MAMBA_SLOTS, MAMBA_HOST = 9, 12


def mamba_device() -> tuple[torch.Tensor, torch.Tensor]:
    """MambaPool's temporal [layers, size + 1, *state] and one conv [layers, size + 1, *conv]."""
    return rand(L, MAMBA_SLOTS, *STATE, dtype=torch.float32), rand(L, MAMBA_SLOTS, *CONV, dtype=torch.bfloat16)


def item_size(t: torch.Tensor) -> int:
    """MambaPoolHost._item_size_per_index."""
    return int(t[0].numel() * t.element_size())


@fast
@given(pairs(MAMBA_HOST, MAMBA_SLOTS), st.integers(0, L - 1))
def test_mla_per_layer_moves_mamba_state_layer_first(sd: tuple[list[int], list[int]], layer: int) -> None:
    """0.5.10/0.5.23 MambaPoolHost._copy_tensor (kernel): transfer_kv_per_layer_mla on one layer."""
    src, dst = sd
    temporal, conv = mamba_device()
    host_t = rand(L, MAMBA_HOST, *STATE, dtype=torch.float32)
    host_c = rand(L, MAMBA_HOST, *CONV, dtype=torch.bfloat16)
    want_t, want_c = temporal.clone(), conv.clone()
    want_t[layer][dst], want_c[layer][dst] = host_t[layer][src], host_c[layer][src]
    for s, d in ((host_t[layer], temporal[layer]), (host_c[layer], conv[layer])):
        K.transfer_kv_per_layer_mla(src=s, dst=d, src_indices=idx(src), dst_indices=idx(dst), item_size=item_size(s))
    assert same(temporal, want_t) and same(conv, want_c)


@fast
@given(pairs(MAMBA_HOST, MAMBA_SLOTS), st.integers(0, L - 1))
def test_mla_page_first_load_of_mamba_state(sd: tuple[list[int], list[int]], layer: int) -> None:
    """0.5.10 MambaPoolHost._copy_tensor_pf_lf: host (size, layers, 1, *state), layout_dim = item_size * layers."""
    src, dst = sd
    temporal, _ = mamba_device()
    host = rand(MAMBA_HOST, L, 1, *STATE, dtype=torch.float32)
    want = temporal.clone()
    want[layer][dst] = host[src, layer, 0]
    size = item_size(temporal[layer])
    K.transfer_kv_per_layer_mla_pf_lf(
        src=host,
        dst=temporal[layer],
        src_indices=idx(src),
        dst_indices=idx(dst),
        layer_id=layer,
        item_size=size,
        src_layout_dim=size * L,
    )
    assert same(temporal, want)


@fast
@given(pairs(MAMBA_SLOTS, MAMBA_HOST))
def test_mla_all_layer_backup_of_mamba_state(sd: tuple[list[int], list[int]]) -> None:
    """0.5.10 MambaPoolHost._copy_tensor_all_layers_lf_pf: src_ptrs of temporal[i] into the page-first host."""
    src, dst = sd
    _, conv = mamba_device()
    host = rand(MAMBA_HOST, L, 1, *CONV, dtype=torch.bfloat16)
    want = host.clone()
    for layer in range(L):
        want[dst, layer, 0] = conv[layer][src]
    size = item_size(conv[0])
    K.register_buffers(conv)
    try:
        K.transfer_kv_all_layer_mla_lf_pf(
            src_layers=ptrs(conv[i] for i in range(L)),
            dst=host,
            src_indices=idx(src),
            dst_indices=idx(dst),
            item_size=size,
            dst_layout_dim=size * L,
            num_layers=L,
        )
    finally:
        K.MEMORY.unregister(conv)
    assert same(host, want)


def test_mla_all_layer_layer_first(registered: Callable[..., None]) -> None:
    """MLA pools: one [size, 1, kv_lora_rank + rope] buffer per layer, pointer tables on both sides."""
    device = [rand(DEV, 1, 36) for _ in range(L)]
    host = torch.zeros(L, HOST, 1, 36, dtype=DT)
    registered(device, host)
    K.transfer_kv_all_layer_mla(
        src_layers=ptrs(device),
        dst_layers=ptrs(host[i] for i in range(L)),
        src_indices=idx([3, 0, 7]),
        dst_indices=idx([1, 2, 30]),
        item_size=36 * DT.itemsize,
        num_layers=L,
    )
    for layer in range(L):
        assert same(host[layer][[1, 2, 30]], device[layer][[3, 0, 7]])
        assert not host[layer][[0, 3, 29, 31]].any()


# --------------------------------------------------------------------------- 0.5.23 transfer_mamba


@fast
@given(pairs(MAMBA_HOST, MAMBA_SLOTS), st.integers(0, L - 1))
def test_mamba_jit_load(sd: tuple[list[int], list[int]], layer: int) -> None:
    """0.5.23 MambaPoolHost._copy_tensor_pf_lf (kernel): transfer_kv_mamba_pf_lf."""
    src, dst = sd
    _, conv = mamba_device()
    host = rand(MAMBA_HOST, L, 1, *CONV, dtype=torch.bfloat16)
    want = conv.clone()
    want[layer][dst] = host[src, layer, 0]
    size = item_size(conv[layer])
    K.transfer_kv_mamba_pf_lf(
        src=host,
        dst=conv[layer],
        src_indices=idx(src),
        dst_indices=idx(dst),
        layer_id=layer,
        item_size=size,
        src_layout_dim=size * L,
    )
    assert same(conv, want)


@fast
@given(pairs(MAMBA_SLOTS, MAMBA_HOST))
def test_mamba_jit_backup(sd: tuple[list[int], list[int]]) -> None:
    """0.5.23 MambaPoolHost._copy_tensor_all_layers_lf_pf (kernel): temporal_device_ptrs into the host."""
    src, dst = sd
    temporal, _ = mamba_device()
    layers = list(temporal.unbind(0))
    host = rand(MAMBA_HOST, L, 1, *STATE, dtype=torch.float32)
    want = host.clone()
    for layer in range(L):
        want[dst, layer, 0] = temporal[layer][src]
    size = item_size(layers[0])
    K.register_buffers(temporal)
    try:
        K.transfer_kv_mamba_lf_pf(
            src_ptrs=ptrs(layers),
            dst=host,
            src_indices=idx(src),
            dst_indices=idx(dst),
            item_size=size,
            dst_layout_dim=size * L,
            num_layers=L,
        )
    finally:
        K.MEMORY.unregister(temporal)
    assert same(host, want)


def _mamba_load(src_indices: torch.Tensor, dst_indices: torch.Tensor, size: int = 128) -> None:
    temporal, _ = mamba_device()
    host = rand(MAMBA_HOST, L, 1, *STATE, dtype=torch.float32)
    K.transfer_kv_mamba_pf_lf(host, temporal[0], src_indices, dst_indices, 0, size, size * L)


@pytest.mark.parametrize(
    ("src", "dst", "size", "message"),
    [
        (
            cpu_idx([1]),
            idx([1]),
            128,
            r"\(src_indices\)\n- Root cause: Device value \[cpu\] not in the allowed options: \[cuda\]",
        ),
        (idx([1]), cpu_idx([1]), 128, r"\(dst_indices\)\n- Root cause: Device mismatch: expected cuda but got cpu"),
        (idx([1], torch.int32), idx([1]), 128, r"Dtype value \[int32\] not in the allowed options: \[int64\]"),
        (idx([1]), idx([1], torch.int32), 128, r"DType mismatch: expected int64 but got int32"),
        (idx([1, 2]), idx([1]), 128, r"Size mismatch for shape#0\('num_indices'\): expected 2 but got 1"),
        (dev(torch.zeros(1, 1, dtype=torch.int64)), idx([1]), 128, r"Tensor dimension mismatch: expected 1 but got 2"),
        (idx([1]), idx([1]), 8, r"^transfer_mamba: item_size must be 16-byte aligned \(uint4\)$"),
        (idx([1]), idx([1]), 0, r"^transfer_mamba: item_size must be positive$"),
        (idx([-1]), idx([1]), 128, r"src_indices holds -1 at position 0"),
    ],
)
def test_mamba_jit_checks(src: torch.Tensor, dst: torch.Tensor, size: int, message: str) -> None:
    with pytest.raises(KernelCheckError, match=message):
        _mamba_load(src, dst, size)


def test_mamba_jit_backup_checks_the_table() -> None:
    temporal, _ = mamba_device()
    host = torch.zeros(MAMBA_HOST, L, 1, *STATE)
    good = ptrs(temporal.unbind(0))

    def backup(table: torch.Tensor, num_layers: int = L, items: int = 1) -> None:
        K.transfer_kv_mamba_lf_pf(table, host, idx([0] * items), idx([0] * items), 128, 128 * L, num_layers)

    with pytest.raises(
        KernelCheckError, match=r"\(src_ptrs\)\n- Root cause: Size mismatch for shape#0: expected 3 but got 2"
    ):
        backup(good[:2])
    with pytest.raises(KernelCheckError, match=r"Dtype value \[int64\] not in the allowed options: \[uint64\]"):
        backup(good.view(torch.int64))
    with pytest.raises(KernelCheckError, match=r"^transfer_mamba: num_layers must be positive$"):
        backup(good[:0], 0)
    backup(good, items=0)  # 0 items: the JIT launcher returns before launching
    with pytest.raises(UnmappedAddressError, match=rf"src_ptrs\[0\] address {temporal.data_ptr():#x}"):
        backup(good)  # nothing registered


# --------------------------------------------------------------------------- launcher checks, every kernel op

ITEM = STRIDE


def _launchers() -> dict[str, Callable[[torch.Tensor, torch.Tensor, int], None]]:
    dk, dv = mha_device()
    pf = torch.zeros(2, HOST, L, H, D, dtype=DT)
    ph = torch.zeros(2, HOST // 4, H, 4, L, D, dtype=DT)
    table_k, table_v = ptrs(dk), ptrs(dv)
    keep = (dk, dv)  # the tables point into these

    def keepalive(fn: Callable[..., None]) -> Callable[[torch.Tensor, torch.Tensor, int], None]:
        def run(s: torch.Tensor, d: torch.Tensor, n: int) -> None:
            assert keep
            fn(s, d, n)

        return run

    return {
        "transfer_kv_per_layer": keepalive(
            lambda s, d, n: K.transfer_kv_per_layer(dk[0], dk[1], dv[0], dv[1], s, d, n)
        ),
        "transfer_kv_per_layer_pf_lf": keepalive(
            lambda s, d, n: K.transfer_kv_per_layer_pf_lf(pf[0], dk[0], pf[1], dv[0], s, d, 0, n, LAYOUT)
        ),
        "transfer_kv_per_layer_ph_lf": keepalive(
            lambda s, d, n: K.transfer_kv_per_layer_ph_lf(ph[0], dk[0], ph[1], dv[0], s, d, 0, n, LAYOUT, 4, H)
        ),
        "transfer_kv_all_layer": keepalive(
            lambda s, d, n: K.transfer_kv_all_layer(table_k, table_v, table_v, table_k, s, d, n, L)
        ),
        "transfer_kv_all_layer_lf_pf": keepalive(
            lambda s, d, n: K.transfer_kv_all_layer_lf_pf(table_k, pf[0], table_v, pf[1], s, d, n, LAYOUT, L)
        ),
        "transfer_kv_all_layer_lf_ph": keepalive(
            lambda s, d, n: K.transfer_kv_all_layer_lf_ph(table_k, ph[0], table_v, ph[1], s, d, n, LAYOUT, L, 4, H)
        ),
        "transfer_kv_per_layer_mla": keepalive(lambda s, d, n: K.transfer_kv_per_layer_mla(dk[0], dk[1], s, d, n)),
        "transfer_kv_per_layer_mla_pf_lf": keepalive(
            lambda s, d, n: K.transfer_kv_per_layer_mla_pf_lf(pf[0], dk[0], s, d, 1, n, LAYOUT)
        ),
        "transfer_kv_all_layer_mla": keepalive(
            lambda s, d, n: K.transfer_kv_all_layer_mla(table_k, table_v, s, d, n, L)
        ),
        "transfer_kv_all_layer_mla_lf_pf": keepalive(
            lambda s, d, n: K.transfer_kv_all_layer_mla_lf_pf(table_k, pf[0], s, d, n, LAYOUT, L)
        ),
    }


LAUNCHERS = sorted(_launchers())

CHECKS = [
    pytest.param(cpu_idx([1]), idx([1]), ITEM, r"^Source indices must be a CUDA tensor$", id="cpu-src"),
    pytest.param(idx([1]), cpu_idx([1]), ITEM, r"^Destination indices must be a CUDA tensor$", id="cpu-dst"),
    pytest.param(
        torch.tensor([1], dtype=torch.int32), idx([1]), ITEM, r"^Source indices must be a CUDA tensor$", id="cpu-first"
    ),
    pytest.param(idx([1], torch.int32), idx([1]), ITEM, r"^Source indices must be of type long$", id="int32-src"),
    pytest.param(idx([1]), idx([1], torch.int32), ITEM, r"^Destination indices must be of type long$", id="int32-dst"),
    pytest.param(idx([1, 2]), idx([1]), ITEM, r"^Source and destination indices must have the same length$", id="len"),
    pytest.param(idx([1]), idx([1]), 12, r"^Item byte size must be divisible by 8$", id="item-size"),
    pytest.param(idx([]), idx([]), ITEM, r"a transfer of 0 items", id="empty"),
    pytest.param(idx([1, -1]), idx([1, 2]), ITEM, r"^src_indices holds -1 at position 1", id="negative"),
]


@pytest.mark.parametrize("op", LAUNCHERS)
@pytest.mark.parametrize(("src", "dst", "size", "message"), CHECKS)
def test_launcher_checks(op: str, src: torch.Tensor, dst: torch.Tensor, size: int, message: str) -> None:
    with pytest.raises(KernelCheckError, match=message):
        _launchers()[op](src, dst, size)


@pytest.mark.parametrize("op", [op for op in LAUNCHERS if "all_layer" in op])
def test_layer_count_check_comes_first(op: str) -> None:
    dk, dv = mha_device()
    pf = torch.zeros(2, HOST, L, H, D, dtype=DT)
    k, v, s = ptrs(dk[:2]), ptrs(dv[:2]), cpu_idx([1])  # CPU indices: the layer check runs before the launcher's
    calls = {
        "transfer_kv_all_layer": lambda: K.transfer_kv_all_layer(k, k, v, v, s, s, ITEM, L),
        "transfer_kv_all_layer_lf_pf": lambda: K.transfer_kv_all_layer_lf_pf(k, pf[0], v, pf[1], s, s, ITEM, LAYOUT, L),
        "transfer_kv_all_layer_lf_ph": lambda: K.transfer_kv_all_layer_lf_ph(
            k, pf[0], v, pf[1], s, s, ITEM, LAYOUT, L, 4, H
        ),
        "transfer_kv_all_layer_mla": lambda: K.transfer_kv_all_layer_mla(k, k, s, s, ITEM, L),
        "transfer_kv_all_layer_mla_lf_pf": lambda: K.transfer_kv_all_layer_mla_lf_pf(k, pf[0], s, s, ITEM, LAYOUT, L),
    }
    which = "source tensor" if "mla" in op else "source k tensor"
    with pytest.raises(KernelCheckError, match=rf"^Number of layers in {which} does not match num_layers$"):
        calls[op]()


def test_pointer_tables_must_be_uint64_and_registered(registered: Callable[..., None]) -> None:
    dk, _ = mha_device()
    host = torch.zeros(L, HOST, H, D, dtype=DT)
    args = (idx([0]), idx([0]), ITEM, L)
    with pytest.raises(KernelCheckError, match=r"^expected scalar type UInt64 but found Long$"):
        K.transfer_kv_all_layer_mla(ptrs(dk).view(torch.int64), ptrs(host.unbind(0)), *args)
    with pytest.raises(
        UnmappedAddressError, match=rf"src_layers\[0\] address {dk[0].data_ptr():#x} \(\+{ITEM} bytes\)"
    ):
        K.transfer_kv_all_layer_mla(ptrs(dk), ptrs(host.unbind(0)), *args)
    registered(dk)
    with pytest.raises(UnmappedAddressError, match=rf"dst_layers\[0\] address {host.data_ptr():#x}"):
        K.transfer_kv_all_layer_mla(ptrs(dk), ptrs(host.unbind(0)), *args)
    with pytest.raises(KernelCheckError, match=r"dst_layers holds 2 layer pointers but the kernel reads 3"):
        K.transfer_kv_all_layer_mla(ptrs(dk), ptrs(host.unbind(0))[:2], *args)


def test_tensor_side_is_bounded_by_its_storage() -> None:
    host = rand(2, L, HOST, H, D)
    dk, dv = mha_device()
    # index HOST of layer 0 is row 0 of layer 1 in the same storage: the kernel reads it, so do we
    K.transfer_kv_per_layer(host[0][0], dk[0], host[1][0], dv[0], idx([HOST]), idx([2]), STRIDE)
    assert same(dk[0][2], host[0, 1, 0]) and same(dv[0][2], host[1, 1, 0])
    with pytest.raises(UnmappedAddressError, match=r"dst_k: the copy would touch .* outside the 768-byte storage"):
        K.transfer_kv_per_layer(host[0][0], dk[0], host[1][0], dv[0], idx([0]), idx([DEV]), STRIDE)


def test_launch_configuration_checks() -> None:
    dk, _ = mha_device()
    with pytest.raises(KernelCheckError, match=r"block_quota=0 and num_warps_per_block=32 must be positive"):
        K.transfer_kv_per_layer_mla(dk[0], dk[1], idx([0]), idx([1]), ITEM, block_quota=0)
    with pytest.raises(KernelCheckError, match=r"CUDA error: invalid configuration argument"):
        K.transfer_kv_per_layer_mla(dk[0], dk[1], idx([0]), idx([1]), ITEM, num_warps_per_block=33)
    K.transfer_kv_per_layer_mla(dk[0], dk[1], idx([0]), idx([1]), ITEM, block_quota=None, num_warps_per_block=16)
    assert same(dk[1][1], dk[0][0])


def test_indices_are_read_back_from_a_subclass_and_from_plain_tensors() -> None:
    assert idx([1]).is_cuda and not cpu_idx([1]).is_cuda and idx([1]).device.type == "cpu"
    values = K._plain(idx([[3, 1]]))
    assert type(values) is torch.Tensor and values.tolist() == [3, 1]
    assert K._plain(cpu_idx([2, 4])).tolist() == [2, 4]


# --------------------------------------------------------------------------- direct ops


@fast
@given(page_pairs(HOST // 4, DEV // 4, 4), st.booleans())
def test_direct_layer_first(sd: tuple[list[int], list[int]], fake_cuda: bool) -> None:
    """transfer_kv_direct: load one layer ([k, v] of the layer) and back up all layers (k layers + v layers)."""
    src, dst = sd
    make = idx if fake_cuda else cpu_idx
    host = rand(2, L, HOST, H, D)
    dk, dv = mha_device()
    want_k = [t.clone() for t in dk]
    want_k[1][dst] = host[0, 1][src]
    K.transfer_kv_direct(
        src_layers=[host[0][1], host[1][1]],
        dst_layers=[dk[1], dv[1]],
        src_indices=make(src),
        dst_indices=make(dst),
        page_size=4,
    )
    assert all(same(a, b) for a, b in zip(dk, want_k)) and same(dv[1][dst], host[1, 1][src])
    back = torch.zeros_like(host)
    K.transfer_kv_direct(
        src_layers=dk + dv,
        dst_layers=[back[0][i] for i in range(L)] + [back[1][i] for i in range(L)],
        src_indices=make(dst),
        dst_indices=make(src),
        page_size=4,
    )
    want = torch.zeros_like(host)
    for s, d in zip(src, dst):  # in order: a host slot written twice keeps the later copy
        for layer in range(L):
            want[0, layer, s], want[1, layer, s] = dk[layer][d], dv[layer][d]
    assert same(back, want)


def test_direct_merges_runs_and_copies_later_runs_last() -> None:
    src, dst = torch.arange(10, dtype=torch.float32)[:, None], torch.zeros(6, 1)
    K.transfer_kv_direct([src], [dst], cpu_idx([0, 1, 2, 7, 3]), cpu_idx([1, 2, 3, 1, 5]), 1)
    assert dst.reshape(-1).tolist() == [0, 7, 1, 2, 0, 3]


@fast
@given(page_pairs(HOST // 4, DEV // 4, 4), st.integers(0, L - 1))
def test_direct_page_first_direct(sd: tuple[list[int], list[int]], layer: int) -> None:
    """page_first_direct host (2, page_num, layers, page_size, heads, dim): load one layer, back up all."""
    src, dst = sd
    page = 4
    host = rand(2, HOST // page, L, page, H, D)
    dk, dv = mha_device()
    K.transfer_kv_per_layer_direct_pf_lf(
        src_ptrs=[host[0], host[1]],
        dst_ptrs=[dk[layer], dv[layer]],
        src_indices=idx(src),
        dst_indices=idx(dst),
        layer_id=layer,
        page_size=page,
    )
    for s, d in zip(src[::page], dst[::page]):
        assert same(dk[layer][d : d + page], host[0, s // page, layer])
        assert same(dv[layer][d : d + page], host[1, s // page, layer])
    back = torch.zeros_like(host)
    K.transfer_kv_all_layer_direct_lf_pf(
        src_ptrs=dk + dv,
        dst_ptrs=[back[0], back[1]],
        src_indices=cpu_idx(dst),
        dst_indices=cpu_idx(src),
        page_size=page,
    )
    want = torch.zeros_like(host)
    for s, d in zip(src[::page], dst[::page]):  # in order: a host page written twice keeps the later copy
        for i in range(L):
            want[0, s // page, i], want[1, s // page, i] = dk[i][d : d + page], dv[i][d : d + page]
    assert same(back, want)


def test_direct_mamba_state_single_buffer() -> None:
    """MambaPoolHost (direct): page_size 1, one page-first host buffer, is_mla (one src or one dst tensor)."""
    temporal, _ = mamba_device()
    host = torch.zeros(MAMBA_HOST, L, 1, *STATE)
    K.transfer_kv_all_layer_direct_lf_pf(
        src_ptrs=[temporal[i] for i in range(L)],
        dst_ptrs=[host],
        src_indices=idx([4, 2]),
        dst_indices=idx([0, 11]),
        page_size=1,
    )
    for layer in range(L):
        assert same(host[[0, 11], layer, 0], temporal[layer][[4, 2]])
    out = torch.zeros_like(temporal)
    K.transfer_kv_per_layer_direct_pf_lf(
        src_ptrs=[host], dst_ptrs=[out[2]], src_indices=idx([11]), dst_indices=idx([5]), layer_id=2, page_size=1
    )
    assert same(out[2][5], temporal[2][2]) and not out[:2].any()
    layer_first = rand(L, MAMBA_HOST, *STATE, dtype=torch.float32)
    K.transfer_kv_direct(
        src_layers=[layer_first[1]], dst_layers=[out[1]], src_indices=idx([3]), dst_indices=idx([8]), page_size=1
    )
    assert same(out[1][8], layer_first[1][3])


def test_direct_checks() -> None:
    a, b = torch.zeros(8, 2), torch.zeros(8, 2)
    with pytest.raises(KernelCheckError, match=r"^Source and destination layers must have the same number of layers$"):
        K.transfer_kv_direct([a, a], [b], cpu_idx([0]), cpu_idx([0]), 1)
    for op in (K.transfer_kv_direct, K.transfer_kv_all_layer_direct_lf_pf):
        with pytest.raises(KernelCheckError, match=r"^Source and destination indices must have the same length$"):
            op([a], [b], cpu_idx([0, 1]), cpu_idx([0]), 1)
        with pytest.raises(KernelCheckError, match=r"^Page size must be positive$"):
            op([a], [b], cpu_idx([0]), cpu_idx([0]), 0)
        with pytest.raises(KernelCheckError, match=r"^Source indices size must be divisible by page size$"):
            op([a], [b], cpu_idx([0, 1, 2]), cpu_idx([0, 1, 2]), 2)
    with pytest.raises(KernelCheckError, match=r"^Page size must be positive$"):
        K.transfer_kv_per_layer_direct_pf_lf([a], [b], cpu_idx([0]), cpu_idx([0]), 0, 0)
    with pytest.raises(KernelCheckError, match=r"^expected scalar type Long but found Int$"):
        K.transfer_kv_direct([a], [b], idx([0], torch.int32), idx([0]), 1)
    # the page-first direct ops read indices with item<int64_t>(): int32 is fine
    host = rand(4, 1, 2, 2, dtype=torch.float32)
    K.transfer_kv_per_layer_direct_pf_lf(
        [host], [b], torch.tensor([2, 3], dtype=torch.int32), torch.tensor([6, 7], dtype=torch.int32), 0, 2
    )
    assert same(b[6:8], host[1, 0])


# --------------------------------------------------------------------------- signatures

SIGNATURES = {
    "transfer_kv_per_layer": "src_k dst_k src_v dst_v src_indices dst_indices item_size block_quota=2 num_warps_per_block=32",
    "transfer_kv_per_layer_pf_lf": "src_k dst_k src_v dst_v src_indices dst_indices layer_id item_size src_layout_dim block_quota=2 num_warps_per_block=32",
    "transfer_kv_per_layer_ph_lf": "src_k dst_k src_v dst_v src_indices dst_indices layer_id item_size src_layout_dim page_size head_num block_quota=2 num_warps_per_block=32",
    "transfer_kv_all_layer": "src_k_layers dst_k_layers src_v_layers dst_v_layers src_indices dst_indices item_size num_layers block_quota=2 num_warps_per_block=32",
    "transfer_kv_all_layer_lf_pf": "src_k_layers dst_k src_v_layers dst_v src_indices dst_indices item_size dst_layout_dim num_layers block_quota=2 num_warps_per_block=32",
    "transfer_kv_all_layer_lf_ph": "src_k_layers dst_k src_v_layers dst_v src_indices dst_indices item_size dst_layout_dim num_layers page_size head_num block_quota=2 num_warps_per_block=32",
    "transfer_kv_per_layer_mla": "src dst src_indices dst_indices item_size block_quota=None num_warps_per_block=32",
    "transfer_kv_per_layer_mla_pf_lf": "src dst src_indices dst_indices layer_id item_size src_layout_dim block_quota=None num_warps_per_block=32",
    "transfer_kv_all_layer_mla": "src_layers dst_layers src_indices dst_indices item_size num_layers block_quota=2 num_warps_per_block=32",
    "transfer_kv_all_layer_mla_lf_pf": "src_layers dst src_indices dst_indices item_size dst_layout_dim num_layers block_quota=2 num_warps_per_block=32",
    "transfer_kv_direct": "src_layers dst_layers src_indices dst_indices page_size",
    "transfer_kv_per_layer_direct_pf_lf": "src_ptrs dst_ptrs src_indices dst_indices layer_id page_size",
    "transfer_kv_all_layer_direct_lf_pf": "src_ptrs dst_ptrs src_indices dst_indices page_size",
    "transfer_kv_mamba_pf_lf": "src dst src_indices dst_indices layer_id item_size src_layout_dim num_warps_per_item=32",
    "transfer_kv_mamba_lf_pf": "src_ptrs dst src_indices dst_indices item_size dst_layout_dim num_layers num_warps_per_item=32",
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_match_the_real_wrappers(name: str) -> None:
    params = inspect.signature(K.OPS[name]).parameters.values()
    shown = " ".join(p.name if p.default is p.empty else f"{p.name}={p.default}" for p in params)
    assert shown == SIGNATURES[name]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)


def test_op_tables() -> None:
    assert set(K.OPS) == set(SIGNATURES) == set(K.KVCACHEIO_OPS) | set(K.TRANSFER_MAMBA_OPS)
    assert all(getattr(K, name) is fn for name, fn in K.OPS.items())


# --------------------------------------------------------------------------- install / bind


@pytest.fixture
def no_sgl_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "sgl_kernel" or n.startswith("sgl_kernel.")]:
        monkeypatch.delitem(sys.modules, name)
    if importlib.util.find_spec("sgl_kernel") is not None:
        pytest.skip("a real sgl_kernel is installed here")


def test_install_puts_stand_ins_into_sys_modules(no_sgl_kernel: None) -> None:
    inst = K.install()
    try:
        assert set(inst.stand_ins) == {"sgl_kernel", "sgl_kernel.kvcacheio"}
        assert K.TRANSFER_MAMBA_MODULE in inst.skipped
        from sgl_kernel.kvcacheio import (  # type: ignore[import-not-found]
            transfer_kv_all_layer_lf_ph,
            transfer_kv_direct,
            transfer_kv_per_layer,
        )

        assert transfer_kv_per_layer is K.transfer_kv_per_layer and transfer_kv_direct is K.transfer_kv_direct
        assert transfer_kv_all_layer_lf_ph is K.transfer_kv_all_layer_lf_ph
        import sgl_kernel  # type: ignore[import-not-found]

        assert sgl_kernel.kvcacheio is sys.modules["sgl_kernel.kvcacheio"]
        assert importlib.util.find_spec("sgl_kernel") is not None  # a __spec__, so find_spec does not raise
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("sgl_kernel.flash_attn")
        again = K.install()
        assert again.stand_ins == {} and "already installed" in again.skipped[K.KVCACHEIO_MODULE]
    finally:
        K.uninstall(inst)
    assert "sgl_kernel" not in sys.modules and "sgl_kernel.kvcacheio" not in sys.modules


def test_install_leaves_a_kvcacheio_that_imports(no_sgl_kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    real = types.ModuleType("sgl_kernel.kvcacheio")
    monkeypatch.setitem(sys.modules, "sgl_kernel", types.ModuleType("sgl_kernel"))
    monkeypatch.setitem(sys.modules, "sgl_kernel.kvcacheio", real)
    inst = K.install()
    assert inst.stand_ins == {} and sys.modules["sgl_kernel.kvcacheio"] is real
    K.uninstall(inst)


def test_install_adds_kvcacheio_under_a_real_package(no_sgl_kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    package = types.ModuleType("sgl_kernel")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "sgl_kernel", package)
    inst = K.install()
    try:
        assert list(inst.stand_ins) == ["sgl_kernel.kvcacheio"] and sys.modules["sgl_kernel"] is package
        assert package.kvcacheio.transfer_kv_per_layer_mla is K.transfer_kv_per_layer_mla
    finally:
        K.uninstall(inst)
    assert not hasattr(package, "kvcacheio")


POOL_MODULE = '''
"""Stands for sglang 0.5.23 pool_host/mamba.py: CUDA-guarded imports, skipped on a CPU."""
import functools

_is_cuda = False
transfer_mamba_state = None
if _is_cuda:
    from sgl_kernel.kvcacheio import transfer_kv_direct, transfer_kv_per_layer_mla
    from sglang.kernels.ops.mamba.transfer_mamba import transfer_kv_mamba_lf_pf, transfer_kv_mamba_pf_lf

transfer_kv_per_layer_direct_pf_lf = "mine"


def synchronized(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def load_everything():
    return [transfer_kv_direct]


class Pool:
    @staticmethod
    def _copy_tensor(io_backend):
        if io_backend == "kernel":
            return transfer_kv_per_layer_mla
        return transfer_mamba_state

    @synchronized
    def backup(self):
        return (lambda: transfer_kv_mamba_lf_pf)()

    @property
    def load(self):
        return transfer_kv_mamba_pf_lf

    def direct(self):
        return transfer_kv_per_layer_direct_pf_lf, self.transfer_kv_all_layer

    class Inner:
        @classmethod
        def op(cls):
            return [transfer_kv_all_layer_mla_lf_pf for _ in range(1)]
'''


def _load(path: Any, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not put into sys.modules
    return module


def test_bind_fills_only_the_missing_op_names(tmp_path: Any) -> None:
    path = tmp_path / "fake_pool_host_mamba.py"
    path.write_text(POOL_MODULE)
    module = _load(path, "fake_pool_host_mamba")
    with pytest.raises(NameError):
        module.Pool._copy_tensor("kernel")
    bound = K.bind(module)
    try:
        assert bound == [
            "transfer_kv_all_layer_mla_lf_pf",
            "transfer_kv_direct",
            "transfer_kv_mamba_lf_pf",
            "transfer_kv_mamba_pf_lf",
            "transfer_kv_per_layer_mla",
        ]
        pool = module.Pool()
        assert module.Pool._copy_tensor("kernel") is K.transfer_kv_per_layer_mla
        assert module.Pool._copy_tensor("kernel_ascend") is None  # an existing name is never overwritten
        assert pool.backup() is K.transfer_kv_mamba_lf_pf and pool.load is K.transfer_kv_mamba_pf_lf
        assert module.load_everything() == [K.transfer_kv_direct]
        assert module.transfer_kv_per_layer_direct_pf_lf == "mine"
        assert not hasattr(module, "transfer_kv_all_layer")  # an attribute name, not a global
        assert K.bind(module) == []
    finally:
        K.unbind(module)
    assert not hasattr(module, "transfer_kv_direct") and module.transfer_kv_per_layer_direct_pf_lf == "mine"


def test_bind_reads_the_source_when_there_is_one(tmp_path: Any) -> None:
    path = tmp_path / "fake_source_only.py"
    path.write_text("import sys\nif sys is None:\n    transfer_kv_per_layer(1)\n")
    module = _load(path, "fake_source_only")
    assert K.bind(module) == ["transfer_kv_per_layer"]
    K.unbind(module)
    plain = types.ModuleType("no_source")
    assert K.bind(plain) == []


def test_install_binds_the_modules_it_is_given(no_sgl_kernel: None, tmp_path: Any) -> None:
    path = tmp_path / "fake_pool_host_mha.py"
    path.write_text("def load(x):\n    return transfer_kv_per_layer_pf_lf(x)\n")
    module = _load(path, "fake_pool_host_mha")
    inst = K.install([module])
    assert inst.bound == {"fake_pool_host_mha": ["transfer_kv_per_layer_pf_lf"]}
    K.uninstall(inst)
    assert not hasattr(module, "transfer_kv_per_layer_pf_lf") and "sgl_kernel" not in sys.modules
