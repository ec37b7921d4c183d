"""The ``sgl_kernel.kvcacheio`` ops SGLang's host pools call, copying the same bytes with torch.

* ``kernel`` ops copy ``item_size`` bytes per index pair. A layer-first side
  addresses ``base + index * item_size`` from its per-layer base (a tensor's
  ``data_ptr()`` or one entry of a uint64 pointer table); a page-first side
  addresses ``base + index * layout_dim + layer_id * item_size`` in the whole
  buffer; a page_head side addresses each head apart. Each op runs its
  launcher's checks (:func:`~.checks.check_launch`), then copies.
* ``direct`` ops copy tensor slices page by page, reading the indices back to
  the host first, as sgl-kernel's ``transfer_kv_direct`` family does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hicache_obs.lab.sglang.kernels import memory
from hicache_obs.lab.sglang.kernels.arguments import as_int, plain
from hicache_obs.lab.sglang.kernels.checks import (
    BLOCK_QUOTA,
    NUM_WARPS_PER_BLOCK,
    KernelCheckError,
    check_direct,
    check_launch,
    pointers,
    require_dtype,
)
from hicache_obs.lab.sglang.kernels.memory import Side, copy_items, layer_first, page_first, tensor_side

__all__ = [
    "KVCACHEIO_MODULE",
    "KVCACHEIO_OPS",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf",
]

KVCACHEIO_MODULE = "sgl_kernel.kvcacheio"


def transfer_kv_per_layer(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int = BLOCK_QUOTA,
    num_warps_per_block: int = NUM_WARPS_PER_BLOCK,
) -> None:
    """One layer, layer-first to layer-first: item ``p`` of K and of V at ``data_ptr() + p * item_size``."""
    go = check_launch("transfer_kv_per_layer", src_indices, dst_indices, item_size, block_quota, num_warps_per_block)
    if go is None:
        return
    so, do = layer_first(go.src, go.item_size), layer_first(go.dst, go.item_size)
    for sname, sbuf, dname, dbuf in (("src_k", src_k, "dst_k", dst_k), ("src_v", src_v, "dst_v", dst_v)):
        copy_items(tensor_side(sname, sbuf), so, tensor_side(dname, dbuf), do, go.item_size)


def transfer_kv_per_layer_pf_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int = BLOCK_QUOTA,
    num_warps_per_block: int = NUM_WARPS_PER_BLOCK,
) -> None:
    """Layer ``layer_id`` of a page-first K/V buffer (``src_layout_dim`` bytes per page) into one layer-first layer."""
    go = check_launch(
        "transfer_kv_per_layer_pf_lf", src_indices, dst_indices, item_size, block_quota, num_warps_per_block
    )
    if go is None:
        return
    layer_id, layout = as_int(layer_id, "layer_id"), as_int(src_layout_dim, "src_layout_dim")
    so, do = page_first(go.src, layer_id, layout, go.item_size), layer_first(go.dst, go.item_size)
    for sname, sbuf, dname, dbuf in (("src_k", src_k, "dst_k", dst_k), ("src_v", src_v, "dst_v", dst_v)):
        copy_items(tensor_side(sname, sbuf), so, tensor_side(dname, dbuf), do, go.item_size)


def transfer_kv_all_layer(
    src_k_layers: torch.Tensor,
    dst_k_layers: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = BLOCK_QUOTA,
    num_warps_per_block: int = NUM_WARPS_PER_BLOCK,
) -> None:
    """Every layer, layer-first to layer-first, through uint64 tables of per-layer base addresses."""
    go = check_launch(
        "transfer_kv_all_layer",
        src_indices,
        dst_indices,
        item_size,
        block_quota,
        num_warps_per_block,
        num_layers=num_layers,
        first_table=src_k_layers,
    )
    if go is None:
        return
    n = go.num_layers
    sk, dk = pointers(src_k_layers, "src_k_layers", n), pointers(dst_k_layers, "dst_k_layers", n)
    sv, dv = pointers(src_v_layers, "src_v_layers", n), pointers(dst_v_layers, "dst_v_layers", n)
    so, do = layer_first(go.src, go.item_size), layer_first(go.dst, go.item_size)
    for layer in range(n):
        for sname, sptr, dname, dptr in (
            ("src_k_layers", sk, "dst_k_layers", dk),
            ("src_v_layers", sv, "dst_v_layers", dv),
        ):
            src = Side(f"{sname}[{layer}]", sptr[layer], None)
            copy_items(src, so, Side(f"{dname}[{layer}]", dptr[layer], None), do, go.item_size)


def transfer_kv_all_layer_lf_pf(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = BLOCK_QUOTA,
    num_warps_per_block: int = NUM_WARPS_PER_BLOCK,
) -> None:
    """Every layer, from per-layer bases in uint64 tables into a page-first K/V buffer (``dst_layout_dim`` bytes per page)."""
    go = check_launch(
        "transfer_kv_all_layer_lf_pf",
        src_indices,
        dst_indices,
        item_size,
        block_quota,
        num_warps_per_block,
        num_layers=num_layers,
        first_table=src_k_layers,
    )
    if go is None:
        return
    n, layout = go.num_layers, as_int(dst_layout_dim, "dst_layout_dim")
    sk, sv = pointers(src_k_layers, "src_k_layers", n), pointers(src_v_layers, "src_v_layers", n)
    so = layer_first(go.src, go.item_size)
    for layer in range(n):
        do = page_first(go.dst, layer, layout, go.item_size)
        for sname, sptr, dname, dbuf in (("src_k_layers", sk, "dst_k", dst_k), ("src_v_layers", sv, "dst_v", dst_v)):
            copy_items(Side(f"{sname}[{layer}]", sptr[layer], None), so, tensor_side(dname, dbuf), do, go.item_size)


def transfer_kv_per_layer_mla(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    block_quota: int | None = None,
    num_warps_per_block: int = NUM_WARPS_PER_BLOCK,
) -> None:
    """One buffer, one layer, layer-first to layer-first (SGLang also moves Mamba state with it)."""
    go = check_launch(
        "transfer_kv_per_layer_mla", src_indices, dst_indices, item_size, block_quota, num_warps_per_block
    )
    if go is None:
        return
    so, do = layer_first(go.src, go.item_size), layer_first(go.dst, go.item_size)
    copy_items(tensor_side("src", src), so, tensor_side("dst", dst), do, go.item_size)


def transfer_kv_per_layer_mla_pf_lf(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int | None = None,
    num_warps_per_block: int = NUM_WARPS_PER_BLOCK,
) -> None:
    """Layer ``layer_id`` of one page-first buffer into one layer-first layer."""
    go = check_launch(
        "transfer_kv_per_layer_mla_pf_lf", src_indices, dst_indices, item_size, block_quota, num_warps_per_block
    )
    if go is None:
        return
    layer_id, layout = as_int(layer_id, "layer_id"), as_int(src_layout_dim, "src_layout_dim")
    so, do = page_first(go.src, layer_id, layout, go.item_size), layer_first(go.dst, go.item_size)
    copy_items(tensor_side("src", src), so, tensor_side("dst", dst), do, go.item_size)


def transfer_kv_all_layer_mla(
    src_layers: torch.Tensor,
    dst_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = BLOCK_QUOTA,
    num_warps_per_block: int = NUM_WARPS_PER_BLOCK,
) -> None:
    """Every layer of one buffer, layer-first to layer-first, through uint64 pointer tables."""
    go = check_launch(
        "transfer_kv_all_layer_mla",
        src_indices,
        dst_indices,
        item_size,
        block_quota,
        num_warps_per_block,
        num_layers=num_layers,
        first_table=src_layers,
    )
    if go is None:
        return
    n = go.num_layers
    sptr, dptr = pointers(src_layers, "src_layers", n), pointers(dst_layers, "dst_layers", n)
    so, do = layer_first(go.src, go.item_size), layer_first(go.dst, go.item_size)
    for layer in range(n):
        src = Side(f"src_layers[{layer}]", sptr[layer], None)
        copy_items(src, so, Side(f"dst_layers[{layer}]", dptr[layer], None), do, go.item_size)


def transfer_kv_all_layer_mla_lf_pf(
    src_layers: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = BLOCK_QUOTA,
    num_warps_per_block: int = NUM_WARPS_PER_BLOCK,
) -> None:
    """Every layer, from per-layer bases in a uint64 table into one page-first buffer."""
    go = check_launch(
        "transfer_kv_all_layer_mla_lf_pf",
        src_indices,
        dst_indices,
        item_size,
        block_quota,
        num_warps_per_block,
        num_layers=num_layers,
        first_table=src_layers,
    )
    if go is None:
        return
    n, layout = go.num_layers, as_int(dst_layout_dim, "dst_layout_dim")
    sptr, so = pointers(src_layers, "src_layers", n), layer_first(go.src, go.item_size)
    for layer in range(n):
        do = page_first(go.dst, layer, layout, go.item_size)
        copy_items(Side(f"src_layers[{layer}]", sptr[layer], None), so, tensor_side("dst", dst), do, go.item_size)


# page_head: ``[page_num, head_num, page_size, layer_num, head_dim]`` (imported unguarded by 0.5.10).


def _ph_offsets(
    pages: torch.Tensor, heads: torch.Tensor, layer: int, page_dim: int, item_size: int, head_num: int, page_size: int
) -> torch.Tensor:
    p, h = pages[:, None], heads[None, :]
    return (
        torch.div(p, page_size, rounding_mode="floor") * page_size * page_dim
        + (page_dim // head_num) * h * page_size
        + torch.div((p % page_size) * page_dim, head_num, rounding_mode="floor")
        + layer * item_size // head_num
    ).reshape(-1)


def _per_head_lf_offsets(pages: torch.Tensor, heads: torch.Tensor, item_size: int, head_num: int) -> torch.Tensor:
    return (pages[:, None] * item_size + (item_size // head_num) * heads[None, :]).reshape(-1)


def transfer_kv_per_layer_ph_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    page_size: int,
    head_num: int,
    block_quota: int = BLOCK_QUOTA,
    num_warps_per_block: int = NUM_WARPS_PER_BLOCK,
) -> None:
    """Layer ``layer_id`` of a page_head K/V buffer into one layer-first layer, head by head."""
    go = check_launch(
        "transfer_kv_per_layer_ph_lf",
        src_indices,
        dst_indices,
        item_size,
        block_quota,
        num_warps_per_block,
        page_size=page_size,
        head_num=head_num,
    )
    if go is None:
        return
    layer_id, layout = as_int(layer_id, "layer_id"), as_int(src_layout_dim, "src_layout_dim")
    heads = torch.arange(go.head_num)
    width = go.item_size // go.head_num // 8 * 8  # the warp copies whole 8-byte words
    so = _ph_offsets(go.src, heads, layer_id, layout, go.item_size, go.head_num, go.page_size)
    do = _per_head_lf_offsets(go.dst, heads, go.item_size, go.head_num)
    for sname, sbuf, dname, dbuf in (("src_k", src_k, "dst_k", dst_k), ("src_v", src_v, "dst_v", dst_v)):
        copy_items(tensor_side(sname, sbuf), so, tensor_side(dname, dbuf), do, width)


def transfer_kv_all_layer_lf_ph(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    page_size: int,
    head_num: int,
    block_quota: int = BLOCK_QUOTA,
    num_warps_per_block: int = NUM_WARPS_PER_BLOCK,
) -> None:
    """Every layer, from per-layer bases in uint64 tables into a page_head K/V buffer, head by head."""
    go = check_launch(
        "transfer_kv_all_layer_lf_ph",
        src_indices,
        dst_indices,
        item_size,
        block_quota,
        num_warps_per_block,
        num_layers=num_layers,
        first_table=src_k_layers,
        page_size=page_size,
        head_num=head_num,
    )
    if go is None:
        return
    n, layout = go.num_layers, as_int(dst_layout_dim, "dst_layout_dim")
    heads = torch.arange(go.head_num)
    width = go.item_size // go.head_num // 8 * 8
    so = _per_head_lf_offsets(go.src, heads, go.item_size, go.head_num)
    sk, sv = pointers(src_k_layers, "src_k_layers", n), pointers(src_v_layers, "src_v_layers", n)
    for layer in range(n):
        do = _ph_offsets(go.dst, heads, layer, layout, go.item_size, go.head_num, go.page_size)
        for sname, sptr, dname, dbuf in (("src_k_layers", sk, "dst_k", dst_k), ("src_v_layers", sv, "dst_v", dst_v)):
            copy_items(Side(f"{sname}[{layer}]", sptr[layer], None), so, tensor_side(dname, dbuf), do, width)


# --------------------------------------------------------------------------- direct (tensor slice) ops


def _copy_page(src: torch.Tensor, dst: torch.Tensor, src_index: int, dst_index: int, count: int) -> None:
    """``dst[dst_index : dst_index + count] = src[src_index : src_index + count]`` with slice clamping, as at::slice does."""
    if memory.copy_gate is not None and not memory.copy_gate(dst):
        return
    dst[dst_index : dst_index + count].copy_(src[src_index : src_index + count])


def _as_int64(values: torch.Tensor) -> torch.Tensor:
    """What ``Tensor::item<int64_t>()`` reads from each element."""
    if values.dtype.is_floating_point:
        return values.trunc().to(torch.int64)
    return values.to(torch.int64)


def _trunc_div(values: torch.Tensor, divisor: int) -> torch.Tensor:
    return torch.div(values, divisor, rounding_mode="trunc")


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Copy token rows ``src_layers[j][src] -> dst_layers[j][dst]``, merging runs that step by 1 on both sides."""
    if len(src_layers) != len(dst_layers):
        raise KernelCheckError("Source and destination layers must have the same number of layers")
    check_direct(src_indices, dst_indices, page_size)
    src, dst = plain(src_indices), plain(dst_indices)
    require_dtype(src, torch.int64)
    require_dtype(dst, torch.int64)
    n = src.numel()
    if n == 0:
        return
    breaks = ((src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)).nonzero().reshape(-1) + 1
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], n]
    src_list, dst_list = src.tolist(), dst.tolist()
    for start, end in zip(starts, ends):
        for s_layer, d_layer in zip(src_layers, dst_layers):
            _copy_page(s_layer, d_layer, src_list[start], dst_list[start], end - start)


def _pages(src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> tuple[list[int], list[int]]:
    src = _as_int64(plain(src_indices))[::page_size]
    dst = _as_int64(plain(dst_indices))[::page_size]
    return src.tolist(), dst.tolist()


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Page by page from page_first_direct buffers ``[page, layer, page_size, ...]`` (K, or K and V) into per-layer tensors."""
    page_size = check_direct(src_indices, dst_indices, page_size)
    layer_id = as_int(layer_id, "layer_id")
    src, dst = _pages(src_indices, dst_indices, page_size)
    is_mla = len(src_ptrs) == 1
    num_layers = len(dst_ptrs) if is_mla else len(dst_ptrs) // 2
    for s_index, d_index in zip(_trunc_div(torch.tensor(src, dtype=torch.int64), page_size).tolist(), dst):
        for j in range(num_layers):
            _copy_page(src_ptrs[0].select(0, s_index).select(0, layer_id + j), dst_ptrs[j], 0, d_index, page_size)
            if not is_mla:
                _copy_page(
                    src_ptrs[1].select(0, s_index).select(0, layer_id + j),
                    dst_ptrs[j + num_layers],
                    0,
                    d_index,
                    page_size,
                )


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Page by page from per-layer tensors (K layers, then V layers) into page_first_direct buffers."""
    page_size = check_direct(src_indices, dst_indices, page_size)
    src, dst = _pages(src_indices, dst_indices, page_size)
    is_mla = len(dst_ptrs) == 1
    num_layers = len(src_ptrs) if is_mla else len(src_ptrs) // 2
    for s_index, d_index in zip(src, _trunc_div(torch.tensor(dst, dtype=torch.int64), page_size).tolist()):
        for j in range(num_layers):
            _copy_page(src_ptrs[j], dst_ptrs[0].select(0, d_index).select(0, j), s_index, 0, page_size)
            if not is_mla:
                _copy_page(src_ptrs[j + num_layers], dst_ptrs[1].select(0, d_index).select(0, j), s_index, 0, page_size)


KVCACHEIO_OPS: dict[str, Callable[..., None]] = {
    "transfer_kv_per_layer": transfer_kv_per_layer,
    "transfer_kv_per_layer_pf_lf": transfer_kv_per_layer_pf_lf,
    "transfer_kv_per_layer_ph_lf": transfer_kv_per_layer_ph_lf,
    "transfer_kv_all_layer": transfer_kv_all_layer,
    "transfer_kv_all_layer_lf_pf": transfer_kv_all_layer_lf_pf,
    "transfer_kv_all_layer_lf_ph": transfer_kv_all_layer_lf_ph,
    "transfer_kv_per_layer_mla": transfer_kv_per_layer_mla,
    "transfer_kv_per_layer_mla_pf_lf": transfer_kv_per_layer_mla_pf_lf,
    "transfer_kv_all_layer_mla": transfer_kv_all_layer_mla,
    "transfer_kv_all_layer_mla_lf_pf": transfer_kv_all_layer_mla_lf_pf,
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
}
"""The ``sgl_kernel.kvcacheio`` ops SGLang's host pools import (0.5.10 imports all of them unguarded)."""
