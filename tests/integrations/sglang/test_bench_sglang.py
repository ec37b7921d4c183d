"""``hicache-obs bench``'s sglang section on a real SGLang release (few rounds; no timed asserts)."""

from __future__ import annotations

import math

import pytest
from sglang_env import RELEASE, release_tuple

from hicache_obs.errors import IntegrationError

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
    # the floor runs: the same hooks, about as many events (constant contents), nothing read
    assert math.isfinite(out["floor_per_op_us"]) and out["floor_ratio"] > 0
    assert abs(out["floor_events"] - out["events"]) <= 0.05 * out["events"], (out["floor_events"], out["events"])
    assert "; the same hooks emitting constant events, nothing read, " in _sglang_line(out)
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


def test_the_floor_wraps_what_the_adapter_wraps_and_reads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's floor runs: every hook of the adapter, one constant event each, no tensor
    read (a read would fail here and be counted); detach restores the controller."""
    import torch

    from hicache_obs.bench import _sglang_plan, sglang_workload
    from hicache_obs.core import ModelSpec
    from hicache_obs.events import EventLog
    from hicache_obs.integrations.sglang import describe, instrument, instrumentation_of
    from hicache_obs.integrations.sglang._floor import FloorInstrumentation, instrument_floor
    from hicache_obs.integrations.sglang.testing import build_controller

    spec = ModelSpec.tiny_hybrid()
    kernel = release_tuple() >= (0, 5, 11)  # 0.5.10's kernel path refuses the hybrid model's Mamba indices
    h = build_controller(spec, io_backend="kernel" if kernel else "direct", device_size=512)
    plan = _sglang_plan(4, spec.page_size)
    c = h.controller
    before = dict(c.__dict__)
    record_stream = torch.Tensor.record_stream
    with instrument(c, log=EventLog()) as real:  # what the adapter reports of the same workload
        sglang_workload(h, plan, 2)
    by_type: dict[str, int] = {}
    for ev in real.log.events():
        by_type[type(ev).__name__] = by_type.get(type(ev).__name__, 0) + 1

    def unreadable(t: torch.Tensor) -> None:
        raise RuntimeError("the floor read an index tensor")

    log = EventLog()
    floor = instrument_floor(c, log=log)  # attaching reads the pools' free lists, as the adapter's does
    assert isinstance(floor, FloorInstrumentation) and instrumentation_of(c) is floor
    with pytest.raises(IntegrationError, match="already instrumented"):
        instrument_floor(c, log=EventLog())
    monkeypatch.setattr(describe, "_facts", unreadable)
    monkeypatch.setattr(describe, "_TO_DLPACK", unreadable)
    monkeypatch.setattr(describe, "host_values", unreadable)
    sglang_workload(h, plan, 2)
    floor.detach()
    assert floor.errors == 0  # nothing was read (every read above raises)
    # constant contents: no op id of the controller's (SGLang's start above 0), no slots it holds
    assert {getattr(ev, "op", -1) for ev in log.events()} <= {0, -1}
    got: dict[str, int] = {}
    for ev in log.events():
        got[type(ev).__name__] = got.get(type(ev).__name__, 0) + 1
    # PoolCreated and the adopted slots are the adapter's reads at attach; the floor's hooks
    # report each step the adapter's do
    for name in ("OperationQueued", "OperationsMerged", "TransferSubmitted", "TransferCompleted"):
        assert got.get(name) == by_type.get(name) > 0, name
    for name in ("SlotsAllocated", "SlotsFreed"):
        assert got.get(name, 0) >= by_type.get(name, 0) > 0, name
    assert got.get("StreamRecorded", 0) >= by_type.get("StreamRecorded", 0)
    assert got.get("IndicesMoved", 0) >= by_type.get("IndicesMoved", 0)
    if kernel:  # the kernel path records the indices on the stream (the direct one records none)
        assert by_type.get("StreamRecorded", 0) > 0
    assert instrumentation_of(c) is None and set(c.__dict__) == set(before)
    assert torch.Tensor.record_stream is record_stream
    for name in ("write_queue", "load_queue", "ack_write_queue", "ack_load_queue"):
        assert type(getattr(c, name)) is list
