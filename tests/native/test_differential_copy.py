"""The cpu runtime's compiled copy loop (``hicache_obs/_copy.c``) against the torch kernels
it accelerates (``hicache_obs/core/_transfer.py``, what the cpu runtime runs when ``copy``
is pure): on random geometries, layouts, dtypes and runs, every launch (backup, load of
all layers, load of one layer) leaves the planes bit for bit the same both ways."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_obs import _copy
from hicache_obs.core._runtime import CpuRuntime
from hicache_obs.core._transfer import launch_backup, launch_load_all, launch_load_layer

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float64]


@st.composite
def case(draw: st.DrawFn) -> dict[str, Any]:
    layers = draw(st.integers(1, 4))
    host_slots, dev_slots = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    item = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 8, 64]), min_size=0, max_size=2)))
    run = st.integers(1, min(host_slots, dev_slots)).flatmap(
        lambda n: st.tuples(st.integers(0, host_slots - n), st.integers(0, dev_slots - n), st.just(n))
    )
    return {
        "layers": layers,
        "host_slots": host_slots,
        "dev_slots": dev_slots,
        "item": item,
        "dtype": draw(st.sampled_from(DTYPES)),
        "layout": draw(st.sampled_from(["page_first", "layer_first"])),
        "planes": draw(st.sampled_from([("k", "v"), ("kv",)])),
        "kind": draw(st.sampled_from(["backup", "load_all", "load_layer"])),
        "layer": draw(st.integers(0, layers - 1)),
        "runs": tuple(draw(st.lists(run, min_size=1, max_size=5))),  # may overlap: applied in order
        "seed": draw(st.integers(0, 2**16)),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    # random bytes, viewed as the dtype: every bit pattern (NaNs included) must move as is
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def _run(c: dict[str, Any], native: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(c["seed"])
    layers, hs, ds, item = c["layers"], c["host_slots"], c["dev_slots"], c["item"]
    host_shape = (hs, layers, *item) if c["layout"] == "page_first" else (layers, hs, *item)
    hp = SimpleNamespace(layout=c["layout"], planes={n: _random(host_shape, c["dtype"], g) for n in c["planes"]})
    dp = SimpleNamespace(planes={n: _random((layers, ds, *item), c["dtype"], g) for n in c["planes"]})
    rt = CpuRuntime()
    rt.native_copies = native
    none = torch.empty(0, dtype=torch.int64)
    if c["kind"] == "backup":
        launch_backup(rt, hp, dp, none, none, c["runs"])  # type: ignore[arg-type]
    elif c["kind"] == "load_all":
        launch_load_all(rt, hp, dp, none, none, c["runs"])  # type: ignore[arg-type]
    else:
        launch_load_layer(rt, hp, dp, c["layer"], none, none, c["runs"])  # type: ignore[arg-type]
    return hp.planes, dp.planes


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case())
def test_the_copy_loop_and_the_torch_kernels_move_the_same_bits(c: dict[str, Any]) -> None:
    ch, cd = _run(c, _copy)
    th, td = _run(c, None)
    for name in c["planes"]:
        assert torch.equal(_bits(ch[name]), _bits(th[name])), ("host", name)
        assert torch.equal(_bits(cd[name]), _bits(td[name])), ("device", name)


def test_the_runs_change_the_planes_they_name() -> None:
    """Not a vacuous equality: a backup changes the host slots of its runs, and only those."""
    c = {
        "layers": 2,
        "host_slots": 8,
        "dev_slots": 8,
        "item": (4,),
        "dtype": torch.float16,
        "layout": "page_first",
        "planes": ("k",),
        "kind": "backup",
        "layer": 0,
        "runs": ((1, 5, 2),),
        "seed": 1,
    }
    for native in (_copy, None):
        host, dev = _run(c, native)
        fresh_host, _ = _run({**c, "runs": ((0, 0, 1),), "kind": "load_layer"}, native)  # host untouched
        assert torch.equal(_bits(host["k"][1:3]), _bits(dev["k"][:, 5:7].transpose(0, 1)))
        assert torch.equal(_bits(host["k"][3:]), _bits(fresh_host["k"][3:]))
        assert torch.equal(_bits(host["k"][:1]), _bits(fresh_host["k"][:1]))
