"""The cpu runtime's compiled copy loop (``hicache_obs._copy``), against torch's own copies."""

from __future__ import annotations

import importlib
from array import array
from itertools import chain
from typing import Any

import pytest
import torch

from hicache_obs import _native
from hicache_obs.core import HiCacheController, ModelSpec
from hicache_obs.core._runtime import native_copy_loop
from hicache_obs.errors import RuntimeUnavailableError

copy_runs = native_copy_loop().copy_runs


def _geometry(t: torch.Tensor, slot_dim: int) -> tuple[int, int, int]:
    es = t.element_size()
    return t.shape[slot_dim], t.stride(slot_dim) * es, t.stride(1 - slot_dim) * es


@pytest.mark.parametrize("item", [(8, 128), (3, 4), (1,)], ids=["2KiB", "24B", "2B"])
@pytest.mark.parametrize("host_page_first", [True, False], ids=["page_first", "layer_first"])
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_every_run_moves_exactly_its_slots(item: tuple[int, ...], host_page_first: bool, to_host: bool) -> None:
    layers, slots = 4, 96
    g = torch.Generator().manual_seed(1)
    dev = torch.randn((layers, slots, *item), generator=g).to(torch.float16)
    host_shape = (slots, layers, *item) if host_page_first else (layers, slots, *item)
    host = torch.randn(host_shape, generator=g).to(torch.float16)
    dev0, host0 = dev.clone(), host.clone()
    runs = ((0, 5, 3), (10, 40, 16), (3, 90, 1), (50, 0, 2), (70, 60, 26))  # (host, device, length)
    hs, hss, hls = _geometry(host, 0 if host_page_first else 1)
    ds, dss, dls = _geometry(dev, 1)
    chunk = dev[0, 0].numel() * 2
    packed = array("q", chain.from_iterable(runs))
    host_view = host if host_page_first else host.transpose(0, 1)  # [slot, layer, ...] either way
    if to_host:
        copy_runs(host.data_ptr(), dev.data_ptr(), packed, False, layers, chunk, hs, hss, hls, ds, dss, dls)
        expect = host0.clone()
        expect_view = expect if host_page_first else expect.transpose(0, 1)
        for h, d, n in runs:
            expect_view[h : h + n] = dev0[:, d : d + n].transpose(0, 1)
        assert torch.equal(host.view(torch.int16), expect.view(torch.int16))
        assert torch.equal(dev.view(torch.int16), dev0.view(torch.int16))
    else:
        copy_runs(dev.data_ptr(), host.data_ptr(), packed, True, layers, chunk, ds, dss, dls, hs, hss, hls)
        expect = dev0.clone()
        for h, d, n in runs:
            expect[:, d : d + n] = host_view[h : h + n].transpose(0, 1)
        assert torch.equal(dev.view(torch.int16), expect.view(torch.int16))
        assert torch.equal(host.view(torch.int16), host0.view(torch.int16))


def test_an_unaligned_destination_is_still_exact() -> None:
    """A chunk whose address is not 16-byte aligned takes memcpy, not the streaming stores."""
    buf = torch.zeros(2 * 64 * 128 + 8, dtype=torch.uint8)
    dst = buf[8:].view(torch.int16).view(2, 64, 64)  # 8 bytes past an aligned start
    src = torch.arange(2 * 64 * 64, dtype=torch.int16).view(2, 64, 64)
    copy_runs(
        dst.data_ptr(), src.data_ptr(), array("q", [1, 7, 20]), False, 2, 128, 64, 128, 64 * 128, 64, 128, 64 * 128
    )
    assert torch.equal(dst[:, 1:21], src[:, 7:27])
    assert int(dst[:, :1].abs().sum()) == 0 and int(dst[:, 21:].abs().sum()) == 0 and int(buf[:8].sum()) == 0


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ([0, 0, 65], "run 0 (dst 0, src 0, length 65) is outside the planes (64 and 64 slots)"),
        ([60, 0, 4, 61, 0, 4], "run 1 (dst 61, src 0, length 4) is outside"),
        ([-1, 0, 1], "run 0 (dst -1, src 0, length 1) is outside"),
        ([0, 0, 0], "length 0) is outside"),
        ([0, 0], "runs must be int64 triples, got 16 bytes"),
    ],
)
def test_runs_outside_the_planes_touch_nothing(runs: list[int], message: str) -> None:
    dst = torch.zeros(2, 64, 64, dtype=torch.int16)
    src = torch.ones(2, 64, 64, dtype=torch.int16)
    with pytest.raises(ValueError) as info:
        copy_runs(dst.data_ptr(), src.data_ptr(), array("q", runs), False, 2, 128, 64, 128, 64 * 128, 64, 128, 64 * 128)
    assert message in str(info.value)
    assert int(dst.abs().sum()) == 0


def test_bad_geometry_is_refused() -> None:
    t = torch.zeros(64, dtype=torch.int16)
    with pytest.raises(ValueError, match="bad geometry: layers 0"):
        copy_runs(t.data_ptr(), t.data_ptr(), array("q", [0, 0, 1]), False, 0, 2, 64, 2, 128, 64, 2, 128)
    with pytest.raises(ValueError, match="bad geometry"):
        copy_runs(0, t.data_ptr(), array("q", [0, 0, 1]), False, 1, 2, 64, 2, 128, 64, 2, 128)


def test_a_missing_extension_is_a_clear_error_not_a_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def missing(name: str, *a: Any) -> Any:
        if name == "hicache_obs._copy":
            raise ImportError("No module named 'hicache_obs._copy'")
        return real(name, *a)

    monkeypatch.setattr(importlib, "import_module", missing)
    # the cpu runtime itself then copies with torch (tests/native/test_switch.py)
    with pytest.raises(RuntimeUnavailableError, match=r"copy loop hicache_obs\._copy is not built"):
        native_copy_loop()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_the_cpu_controller_moves_fragmented_nodes_bit_exactly(layout: str, page_size: int) -> None:
    """Every other page taken by another node: runs of one page, through the native loop."""
    spec = ModelSpec(name="t", num_layers=3, num_kv_heads=2, head_dim=32, page_size=page_size)
    c = HiCacheController(spec, runtime="cpu", device_size=256, layout=layout, host_ratio=1.0)
    # the compiled loop, or the torch kernels where copy runs pure (HICACHE_OBS_NO_EXTENSIONS)
    assert c.runtime.native_copies is (native_copy_loop() if _native.IMPLEMENTATIONS["copy"] == "c" else None)
    a = c.alloc_device(256)
    assert a is not None
    keep, other = a.view(-1, page_size)[0::2].reshape(-1), a.view(-1, page_size)[1::2].reshape(-1)
    dp = c.device_pool()
    g = torch.Generator().manual_seed(3)
    for plane in dp.planes.values():
        plane.copy_(torch.randn(plane.shape, generator=g).to(plane.dtype))
    before = {k: p[:, keep].clone() for k, p in dp.planes.items()}
    host = c.write(keep)
    c.poll_writes()
    for plane in dp.planes.values():
        plane[:, keep] = 0
        plane[:, other] = 7
    c.free_device(keep)
    back = c.load(host)
    c.start_loading()
    c.poll_loads()
    assert back is not None
    for k, p in dp.planes.items():
        assert torch.equal(p[:, back].view(torch.int16), before[k].view(torch.int16)), k
        assert bool((p[:, other] == 7).all()), "a slot outside the op was written"
    c.close()


def test_tensor_pair_runs_equal_the_list_version() -> None:
    """Long index tensors are grouped with numpy; the runs must be those of the Python loop."""
    from hicache_obs.core._transfer import pair_runs, tensor_pair_runs

    g = torch.Generator().manual_seed(5)
    for trial in range(200):
        n = 1 + trial * 3
        host = torch.randperm(4 * n, generator=g)[:n] if trial % 3 == 0 else torch.arange(7, 7 + n)
        device = torch.arange(n) * (2 if trial % 4 == 0 else 1) if trial % 2 else torch.randperm(4 * n, generator=g)[:n]
        if trial % 7 == 0:  # page-structured: runs of 16 on one side, broken on the other
            device = torch.tensor([(i // 16) * 32 + i % 16 for i in range(n)])
        assert tensor_pair_runs(host, device) == pair_runs(host.tolist(), device.tolist()), trial
