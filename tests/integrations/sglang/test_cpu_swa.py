"""The ``torch_native`` sliding-window stand-in (:mod:`hicache_obs.lab.sglang.cpu_swa`)
on SGLang's own backend class: a sliding-window layer reads the SWA pool at the full->SWA
translated slots, as it wrote them; a full-attention layer is untouched."""

from __future__ import annotations

import types
from types import SimpleNamespace

import pytest
import torch
from sglang_env import SERVER_RELEASE, fresh_module

from hicache_obs.lab.sglang import cpu_swa

HEADS, DIM, FULL, SWA = 2, 8, 40, 12


class Pool:
    """An SWA pool as the backend sees it: layer 0 sliding-window, layer 1 full attention."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.layers_mapping = {0: (0, True), 1: (0, False)}
        self.swa = [torch.randn(SWA, HEADS, DIM, generator=g) for _ in range(2)]
        self.full = [torch.randn(FULL, HEADS, DIM, generator=g) for _ in range(2)]
        # full slots 30..39 live at SWA slots 11..2; the rest were freed (0)
        self.mapping = torch.zeros(FULL + 1, dtype=torch.int64)
        self.mapping[30:40] = torch.arange(11, 1, -1)
        self.mapping[-1] = -1

    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        return self.mapping[loc]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.swa[0] if self.layers_mapping[layer_id][1] else self.full[0]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.swa[1] if self.layers_mapping[layer_id][1] else self.full[1]


def decode(module: types.ModuleType, table: torch.Tensor, layer_id: int, pool: Pool) -> torch.Tensor:
    backend = object.__new__(module.TorchNativeAttnBackend)
    backend.req_to_token_pool = SimpleNamespace(req_to_token=table)
    backend.token_to_kv_pool = pool
    backend.use_sliding_window_kv_pool = True
    layer = SimpleNamespace(
        layer_id=layer_id, qk_head_dim=DIM, v_head_dim=DIM, tp_q_head_num=HEADS, tp_k_head_num=HEADS,
        is_cross_attention=False, sliding_window_size=3 if layer_id == 0 else -1, scaling=None,
    )  # fmt: skip
    batch = SimpleNamespace(
        req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([10]), encoder_lens=None, out_cache_loc=None
    )
    q = torch.randn(1, HEADS * DIM, generator=torch.Generator().manual_seed(1))
    return backend.forward_decode(q, None, None, layer, batch, save_kv_cache=False)


@pytest.mark.needs_sglang
@SERVER_RELEASE
def test_sliding_window_layer_reads_swa_slots() -> None:
    module = fresh_module(cpu_swa.TARGET_MODULE)
    original = module.TorchNativeAttnBackend.forward_decode
    pool = Pool()
    table = torch.arange(30, 40).unsqueeze(0)  # full slots of one request
    expected = decode(module, pool.mapping[table], 0, pool)  # the rows already in SWA space
    with pytest.raises(IndexError):  # SGLang's own backend indexes the SWA buffer with full slots
        decode(module, table, 0, pool)

    assert sorted(cpu_swa.patch_module(module)) == ["forward_decode", "forward_extend"]
    assert cpu_swa.patch_module(module) == []  # idempotent
    assert module.TorchNativeAttnBackend.forward_decode.__wrapped__ is original
    torch.testing.assert_close(decode(module, table, 0, pool), expected, rtol=0, atol=0)
    # a full-attention layer reads the full pool with the untranslated rows, as before
    full = decode(module, table, 1, pool)
    module.TorchNativeAttnBackend.forward_decode = original
    torch.testing.assert_close(full, decode(module, table, 1, pool), rtol=0, atol=0)
