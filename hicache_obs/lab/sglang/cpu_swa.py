"""Sliding-window layers read in the SWA pool's index space under ``torch_native`` (test support).

SGLang 0.5.23's ``TorchNativeAttnBackend`` writes a sliding-window layer's K/V at the
full->SWA translated slots (``swa_out_cache_loc``) but reads them back with the request's
row of ``req_to_token``, which holds *full*-pool slots
(``torch_native_backend.py:140``, ``_run_sdpa_forward_extend``, and ``:241``,
``_run_sdpa_forward_decode``): the SWA buffer is indexed with full slots. Both allocators
hand out slots in the same order from a fresh start, so the first requests read the right
rows by accident; once they diverge the layer reads other tokens' K/V, and as soon as a
full slot exceeds the SWA pool's size it raises ``IndexError: index N is out of bounds for
dimension 0 with size swa_size + 1``. The Intel AMX backend translates the rows
(``intel_amx_backend.py``, ``_swa_kv_indices``); this does the same for ``torch_native``:
for a sliding-window layer, ``forward_extend`` / ``forward_decode`` see a
``req_to_token`` whose rows are translated with the pool's own
``translate_loc_from_full_to_swa``. Positions outside the window translate to whatever the
mapping holds (0 once freed) and are masked out by the backend's sliding-window mask.
Full-attention layers and non-SWA pools are untouched.
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["TARGET_MODULE", "patch_module"]

TARGET_MODULE = "sglang.srt.layers.attention.torch_native_backend"
"""The module to patch right after it runs."""

_WRAPPED = "_hicache_obs_swa_reads"


class _TranslatedRows:
    """``req_to_token`` indexed as SGLang's backend does, each slot mapped full -> SWA."""

    def __init__(self, table: Any, pool: Any) -> None:
        self.table = table
        self.pool = pool
        self.shape = table.shape
        self.dtype = table.dtype
        self.device = table.device

    def __getitem__(self, key: Any) -> Any:
        return self.pool.translate_loc_from_full_to_swa(self.table[key]).to(self.table.dtype)


class _SWAView:
    """The request-to-token pool as a sliding-window layer must read it."""

    def __init__(self, pool: Any, kv_pool: Any) -> None:
        self._pool = pool
        self.req_to_token = _TranslatedRows(pool.req_to_token, kv_pool)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def _is_swa_layer(backend: Any, layer: Any) -> bool:
    if not getattr(backend, "use_sliding_window_kv_pool", False):
        return False
    mapping = getattr(backend.token_to_kv_pool, "layers_mapping", None)
    return bool(mapping and mapping[layer.layer_id][1])


def _wrap(original: Any) -> Any:
    def forward(self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_swa_layer(self, layer):
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
        pool = self.req_to_token_pool
        self.req_to_token_pool = _SWAView(pool, self.token_to_kv_pool)
        try:
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            self.req_to_token_pool = pool

    forward.__name__ = forward.__qualname__ = original.__name__
    forward.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(forward, _WRAPPED, True)
    return forward


def patch_module(module: types.ModuleType) -> list[str]:
    """Wrap ``TorchNativeAttnBackend.forward_extend`` / ``forward_decode`` in ``module`` so
    that sliding-window layers read SWA slots; return the names wrapped. Idempotent."""
    cls = getattr(module, "TorchNativeAttnBackend", None)
    names = []
    for name in ("forward_extend", "forward_decode"):
        original = getattr(cls, name, None)
        if original is None or getattr(original, _WRAPPED, False):
            continue
        setattr(cls, name, _wrap(original))
        names.append(name)
    return names
