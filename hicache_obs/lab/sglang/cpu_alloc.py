"""The paged KV allocator's slot kernels on a CPU, for SGLang releases before 0.5.23 (test support).

SGLang 0.5.10 and 0.5.11's ``PagedTokenToKVPoolAllocator`` (``--page-size`` above 1)
always launches the Triton kernels ``alloc_extend_kernel`` and ``alloc_decode_kernel``
(``sglang/srt/mem_cache/allocator.py:429`` and ``:467`` in 0.5.11): off CUDA, Triton has no
driver (``RuntimeError: 0 active drivers ([]). There should only be one.``). SGLang 0.5.23
(``allocator/paged.py``) falls back to torch itself (``alloc_extend_naive`` /
``alloc_decode_naive``) when Triton is unavailable. Here the module's two kernel names are
replaced by objects launched the same way (``kernel[(bs,)](...)``) that run
torch code: extend is SGLang's own ``alloc_extend_naive`` of the same module (the NPU
allocator's fallback), decode follows ``alloc_decode_kernel`` line by line. Releases
whose module has no such kernels (0.5.23: ``sglang.srt.mem_cache.allocator`` is a
package) are left alone.
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["TARGET_MODULE", "patch_module"]

TARGET_MODULE = "sglang.srt.mem_cache.allocator"
"""The module to patch right after it runs."""

_FLAG = "_hicache_obs_cpu_alloc"


class _Launch:
    """``kernel[grid]`` -> ``run``, as a Triton kernel is launched."""

    def __init__(self, name: str, run: Any) -> None:
        self.__name__ = name
        self.run = run
        setattr(self, _FLAG, True)

    def __getitem__(self, grid: Any) -> Any:
        return self.run


def _decode(seq_lens: Any, last_loc: Any, free_pages: Any, out_indices: Any, bs_upper: int, page_size: int) -> None:
    """``alloc_decode_kernel``: each request's next slot is after its last one, or the first
    slot of the next free page when it starts a new page (pages handed out in batch order)."""
    import torch

    new_page = ((seq_lens + page_size - 1) // page_size - (seq_lens - 1 + page_size - 1) // page_size).to(torch.int64)
    start = torch.cumsum(new_page, 0) - new_page
    page = free_pages[start.clamp(max=max(free_pages.numel() - 1, 0))] if free_pages.numel() else start
    out_indices.copy_(torch.where(new_page.bool(), page * page_size, last_loc + 1))


def patch_module(module: types.ModuleType) -> None:
    extend_naive = getattr(module, "alloc_extend_naive", None)
    if extend_naive is None or not hasattr(module, "alloc_extend_kernel") or not hasattr(module, "alloc_decode_kernel"):
        return
    if getattr(module.alloc_extend_kernel, _FLAG, False):
        return

    def extend(
        prefix_lens: Any, seq_lens: Any, last_loc: Any, free_pages: Any, out_indices: Any, bs_upper: int, page_size: int
    ) -> None:
        extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device)

    module.alloc_extend_kernel = _Launch("alloc_extend_kernel", extend)  # type: ignore[attr-defined]
    module.alloc_decode_kernel = _Launch("alloc_decode_kernel", _decode)  # type: ignore[attr-defined]
