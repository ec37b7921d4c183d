"""The paged allocator's slot kernels on a CPU (:mod:`hicache_obs.lab.sglang.cpu_alloc`),
on SGLang's own allocator module: every slot they hand out, against a reference that walks
the tokens one by one (a new page at each page boundary, the next slot otherwise)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from sglang_env import fresh_module

from hicache_obs.lab.sglang import cpu_alloc

pytestmark = pytest.mark.needs_sglang


def reference(prefix: list[int], seq: list[int], last: list[int], free: list[int], page: int) -> list[int]:
    out, k = [], 0
    for p, s, slot in zip(prefix, seq, last):
        for pos in range(p, s):
            if pos % page == 0:
                slot, k = free[k] * page, k + 1
            else:
                slot += 1
            out.append(slot)
    return out


def _tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_the_kernels_hand_out_the_slots_sglang_would() -> None:
    module = fresh_module(cpu_alloc.TARGET_MODULE)
    spec = importlib.util.find_spec(cpu_alloc.TARGET_MODULE)
    if spec is not None and spec.submodule_search_locations is not None:  # 0.5.23: a package that falls back itself
        assert not hasattr(module, "alloc_extend_kernel")
        cpu_alloc.patch_module(module)
        assert not hasattr(module, "alloc_extend_kernel")  # left alone
        return
    cpu_alloc.patch_module(module)
    cpu_alloc.patch_module(module)  # idempotent
    rng = random.Random(0)
    for _ in range(300):
        page, bs = rng.choice([2, 4, 16]), rng.randint(1, 5)
        free = list(range(1, 200))
        rng.shuffle(free)
        prefix = [rng.randint(0, 40) for _ in range(bs)]
        seq = [p + rng.randint(1, 60) for p in prefix]
        last = [(rng.randint(200, 300) * page + (p - 1) % page) if p > 0 else -1 for p in prefix]
        out = torch.empty(sum(s - p for p, s in zip(prefix, seq)), dtype=torch.int64)
        module.alloc_extend_kernel[(bs,)](_tensor(prefix), _tensor(seq), _tensor(last), _tensor(free), out, 8, page)
        assert out.tolist() == reference(prefix, seq, last, free, page), (page, prefix, seq)
        seq = [rng.randint(1, 100) for _ in range(bs)]  # decode: one token each
        last = [rng.randint(200, 300) * page + (s - 2) % page for s in seq]
        out = torch.empty(bs, dtype=torch.int64)
        module.alloc_decode_kernel[(bs,)](_tensor(seq), _tensor(last), _tensor(free), out, 8, page)
        assert out.tolist() == reference([s - 1 for s in seq], seq, last, free, page), (page, seq)
