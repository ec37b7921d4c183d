"""``hicache-obs bench``'s sglang section on a real SGLang release (few rounds; no timed asserts)."""

from __future__ import annotations

import math

import pytest
from sglang_env import RELEASE, release_tuple

from hicache_obs.errors import IntegrationError

pytestmark = pytest.mark.needs_sglang


def test_sglang_section_measures_the_real_controller() -> None:
    from hicache_obs.lab.bench import bench_sglang
    from hicache_obs.lab.cli.bench import _sglang_line

    out = bench_sglang(nodes=8, batch=4, rounds=2, slices=1, timeout=280, profile_rounds=1)
    assert "error" not in out, out["error"] if "error" in out else None
    assert out["available"] is True and out["release"] == RELEASE
    keys = ("overhead_ratio", "per_op_overhead_us", "controller_cpu_ratio", "bare_per_op_us")
    for key in (*keys, "in_process_ratio", "in_process_per_op_us", "floor_ratio", "floor_per_op_us"):
        assert isinstance(out[key], float) and math.isfinite(out[key]), key
    assert out["overhead_ratio"] > 0 and out["controller_cpu_ratio"] > 0 and out["in_process_ratio"] > 0
    # the in-process runs instrumented the same workload: as many events as the sink host's
    assert out["in_process_events"] == out["events"] > 0
    # the floor runs: the same hooks, about as many events (constant contents), nothing read
    if out["io_backend"] == "kernel":
        assert out["floor_events"] == out["events"], (out["floor_events"], out["events"])  # see floor.py
    else:  # the floor reports one op-level move a submission, the adapter one per pool moved
        assert 0 < out["floor_events"] <= out["events"], (out["floor_events"], out["events"])
    assert out["floor_ratio"] > 0
    assert "; the hooks alone (constant events, nothing read) " in _sglang_line(out)
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
    _check_profiles(out["profiles"])


def _check_profiles(pr: dict) -> None:  # type: ignore[type-arg]
    """The measure per profile: SGLang's tree, copies on a worker thread, each profile's figures."""
    from hicache_obs.lab.cli.bench import _profiles_line
    from hicache_obs.lab.sglang.tree import hybrid_trees

    if not hybrid_trees():
        assert pr["available"] is False and "cannot build a hybrid Mamba tree" in pr["reason"]
        assert _profiles_line(pr).startswith("sglang profiles: not measured: ")
        return
    assert pr["available"] is True and pr["release"] == RELEASE and pr["rounds"] == 1
    assert pr["ops_per_run"] > 20 and pr["bare_cpu_per_op_us"] > 0
    assert pr["device_tiers"] == "unseen, as on a GPU"
    for name in ("metrics", "audit", "sampling"):
        p = pr[name]
        lo, hi = p["controller_cpu_ratio_spread"]
        assert 0 < lo <= p["controller_cpu_ratio"] <= hi and math.isfinite(p["per_op_us"])
        assert p["sink_host_cpu_us_per_event"] > 0
    # one event per submission and one per completion: at most two an operation
    assert 0 < pr["metrics"]["events_per_op"] <= 2.0 and 0 < pr["sampling"]["events_per_op"] <= 2.0
    assert pr["audit"]["events_per_op"] > 2 * pr["metrics"]["events_per_op"]
    # one round: its ratio is the median, and the paired difference is the two ratios' difference
    for name in ("metrics", "audit", "sampling"):
        assert pr[name]["controller_cpu_ratio_rounds"] == [pr[name]["controller_cpu_ratio"]]
    diff = pr["sampling"]["controller_cpu_ratio"] - pr["metrics"]["controller_cpu_ratio"]
    assert pr["sampling_minus_metrics"] == diff and pr["sampling_minus_metrics_spread"] == [diff, diff]
    assert "; sampling 0.01 minus metrics " in _profiles_line(pr)


def test_workload_leaves_every_pool_as_it_found_it() -> None:
    from hicache_obs.core import ModelSpec
    from hicache_obs.lab.bench import _sglang_check_idle, _sglang_free, _sglang_plan, sglang_workload
    from hicache_obs.lab.sglang.harness import build_controller

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
    """The bench's floor runs: every step the adapter reports, as many events of each type,
    constant contents, no tensor read; detach restores the controller and its pools.

    Every reading path of the adapter is a tripwire here (monkeypatched to raise, which a
    hook counts as an error): these are the reads the floor must leave out, not fakes."""
    import torch

    from hicache_obs.core import ModelSpec
    from hicache_obs.events import EventLog
    from hicache_obs.events._schema import SlotsAllocated, SlotsFreed
    from hicache_obs.integrations.sglang import _adapter as adapter
    from hicache_obs.integrations.sglang import _tensor_facts as facts
    from hicache_obs.integrations.sglang import instrument, instrumentation_of
    from hicache_obs.lab.bench import _sglang_plan, sglang_workload
    from hicache_obs.lab.sglang.floor import FloorInstrumentation, instrument_floor
    from hicache_obs.lab.sglang.harness import build_controller

    spec = ModelSpec.tiny_hybrid()
    kernel = release_tuple() >= (0, 5, 11)  # 0.5.10's kernel path refuses the hybrid model's Mamba indices
    h = build_controller(spec, io_backend="kernel" if kernel else "direct", device_size=512)
    plan = _sglang_plan(4, spec.page_size)
    c = h.controller
    wrapped = [c, *(p for p in (h.kv_host, h.mamba_host, h.kv_allocator, h.mamba_allocator) if p is not None)]
    before = [set(vars(o)) for o in wrapped]
    record_stream = torch.Tensor.record_stream

    def counts(events: list[object]) -> dict[str, int]:
        out: dict[str, int] = {}
        for ev in events:
            out[type(ev).__name__] = out.get(type(ev).__name__, 0) + 1
        return out

    with instrument(c, log=EventLog()) as real:  # what the adapter reports of the same workload
        start = real.log.published
        sglang_workload(h, plan, 2)
    by_type = counts(real.log.events()[start:])

    def unreadable(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the floor read an index tensor")

    log = EventLog()
    floor = instrument_floor(c, log=log)  # attaching reads the pools' free lists, as the adapter's does
    try:
        assert isinstance(floor, FloorInstrumentation) and instrumentation_of(c) is floor
        with pytest.raises(IntegrationError, match="already instrumented"):
            instrument_floor(c, log=EventLog())
        with pytest.raises(IntegrationError, match="log must be an EventLog, got dict"):
            instrument_floor(c, log={})  # type: ignore[arg-type]
        for name in ("_facts", "_TO_DLPACK", "host_values", "host_runs", "tensor_ref", "device_name"):
            monkeypatch.setattr(facts, name, unreadable)
        for name in ("tensor_ref", "device_name"):
            monkeypatch.setattr(adapter, name, unreadable)
        for name in ("_slots_by_pool", "_op_tensors", "_report_moves", "_submitted", "_merged"):
            monkeypatch.setattr(adapter.Instrumentation, name, unreadable)
        monkeypatch.setattr(adapter._FreeList, "read", unreadable)  # the free lists the slot hooks compare
        start = log.published
        sglang_workload(h, plan, 2)
        end = log.published
        h.kv_allocator.clear()  # a reset of the free lists (SGLang's flush): one constant event, nothing read
    finally:
        floor.detach()
    assert floor.errors == 0  # nothing was read (every read above raises, and a hook counts it)
    resets = log.events()[end:]
    assert [(type(ev).__name__, ev.indices) for ev in resets] == [("SlotsFreed", ((0, 1),))]  # type: ignore[attr-defined]
    events = log.events()[start:end]
    # constant contents: no op id of the controller's (SGLang's start above 0), no slots it holds
    assert {getattr(ev, "op", -1) for ev in events} <= {0, -1}
    assert {ev.indices for ev in events if isinstance(ev, (SlotsAllocated, SlotsFreed))} == {((0, 1),)}
    # each step the adapter reports, as many times
    assert counts(events) == by_type
    assert by_type["OperationQueued"] > 0 and by_type["SlotsAllocated"] > 0 and by_type["SlotsFreed"] > 0
    if kernel:  # the kernel path records the indices on the stream (the direct one records none)
        assert by_type["StreamRecorded"] > 0 and by_type["IndicesMoved"] > 0
    assert instrumentation_of(c) is None and torch.Tensor.record_stream is record_stream
    assert [set(vars(o)) for o in wrapped] == before  # no hook left on the controller or a pool
    for name in ("write_queue", "load_queue", "ack_write_queue", "ack_load_queue"):
        assert type(getattr(c, name)) is list


def test_floor_with_a_part_reads_that_part_with_the_adapters_own_hooks() -> None:
    """``floor_with(["slots"])``: the adapter's allocation and free hooks (their events carry
    the slots SGLang handed out), the floor's everywhere else (constant op ids)."""
    from hicache_obs.core import ModelSpec
    from hicache_obs.events import EventLog
    from hicache_obs.events._schema import SlotsAllocated, SlotsFreed
    from hicache_obs.lab.bench import _sglang_plan, sglang_workload
    from hicache_obs.lab.sglang.floor import PARTS, FloorInstrumentation, floor_with
    from hicache_obs.lab.sglang.harness import build_controller

    with pytest.raises(ValueError, match=r"unknown parts \['slot'\]"):
        floor_with(["slot"])
    assert floor_with([]).__mro__[1] is FloorInstrumentation and set(PARTS) >= {"slots", "copy", "submission"}
    spec = ModelSpec.tiny_hybrid()
    h = build_controller(spec, io_backend="direct", device_size=512)
    log = EventLog()
    inst = floor_with(["slots"]).attach(h.controller, log=log)
    try:
        start = log.published
        sglang_workload(h, _sglang_plan(4, spec.page_size), 2)
    finally:
        inst.detach()
    assert inst.errors == 0
    events = log.events()[start:]
    slots = [ev for ev in events if isinstance(ev, (SlotsAllocated, SlotsFreed))]
    # what was really allocated and freed (the floor's own is one slot, slot 0, every time)
    assert slots and any(ev.indices != ((0, 1),) for ev in slots)
    assert sum(n for ev in slots if isinstance(ev, SlotsAllocated) for _, n in ev.indices) > len(slots)
    assert {getattr(ev, "op", -1) for ev in events} <= {0, -1}  # the rest is the floor's
