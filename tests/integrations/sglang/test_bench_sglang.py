"""``hicache-obs bench``'s sglang section on a real SGLang release (few rounds; no timed asserts)."""

from __future__ import annotations

import math

import pytest
from sglang_env import RELEASE

pytestmark = pytest.mark.needs_sglang


def test_sglang_section_measures_the_real_controller() -> None:
    from hicache_obs.bench import bench_sglang
    from hicache_obs.cli.bench import _sglang_line

    out = bench_sglang(nodes=8, batch=4, rounds=2, slices=1, timeout=280)
    assert "error" not in out, out["error"] if "error" in out else None
    assert out["available"] is True and out["release"] == RELEASE
    keys = ("overhead_ratio", "per_op_overhead_us", "controller_cpu_ratio", "bare_per_op_us")
    for key in (*keys, "in_process_ratio", "in_process_per_op_us"):
        assert isinstance(out[key], float) and math.isfinite(out[key]), key
    assert out["overhead_ratio"] > 0 and out["controller_cpu_ratio"] > 0 and out["in_process_ratio"] > 0
    # the in-process runs instrumented the same workload: as many events as the sink host's
    assert out["in_process_events"] == out["events"] > 0
    # each instrumented run ended in a flush the sink host answered, after handling events
    assert math.isfinite(out["flush_wait_per_op_us"]) and out["flush_wait_per_op_us"] > 0
    assert math.isfinite(out["sink_host_cpu_us_per_event"]) and out["sink_host_cpu_us_per_event"] > 0
    assert "; the wait for the sink host at each run's end " in _sglang_line(out)
    lo, hi = out["overhead_ratio_spread"]
    q1, q3 = out["overhead_ratio_iqr"]
    assert lo <= q1 <= out["overhead_ratio"] <= q3 <= hi
    assert out["rounds"] == 2 and out["slices_per_round"] == 1 and out["nodes"] == 8 and out["ops"] == 16
    assert out["events"] > 0
    assert out["model"] == "tiny_hybrid" and out["controller"] == "HybridCacheController"
    assert out["io_backend"] in ("kernel", "direct") and out["layout"] in ("page_first", "page_first_direct")
    assert out["sinks"] == ["audit", "prometheus", "structlog"] and out["sink_host"] is True
    if out["io_backend"] == "direct":  # only where the kernel path refuses the hybrid model
        assert any(r.startswith("kernel/") for r in out["backends_refused"])
    assert out["wall_s"] > 0
    assert _sglang_line(out).startswith(f"sglang {RELEASE} (tiny_hybrid, {out['io_backend']}/")
    assert "; into an in-process log with no sinks " in _sglang_line(out)


def test_workload_leaves_every_pool_as_it_found_it() -> None:
    from hicache_obs.bench import _sglang_check_idle, _sglang_free, _sglang_plan, sglang_workload
    from hicache_obs.core import ModelSpec
    from hicache_obs.integrations.sglang.testing import build_controller

    spec = ModelSpec.tiny_hybrid()
    h = build_controller(spec, io_backend="direct", device_size=256)
    free = _sglang_free(h)
    plan = _sglang_plan(6, spec.page_size)
    assert sglang_workload(h, plan, 2) == 12
    _sglang_check_idle(h, free, "test")
    h.kv_allocator.alloc(16)  # a leak is caught
    with pytest.raises(RuntimeError, match="left work behind"):
        _sglang_check_idle(h, free, "test")
