"""The profiles on SGLang's real controllers: ``metrics`` keeps the dashboards' metrics at one
event per submission, ``sampling`` audits a share of the ops in full, names never change."""

from __future__ import annotations

from typing import Any

import pytest
from metric_shapes import series_shapes
from sglang_env import release_tuple

from hicache_obs.core import ModelSpec
from hicache_obs.errors import ConfigError
from hicache_obs.events import EventLog
from hicache_obs.events._audit import Auditor, audit
from hicache_obs.events._schema import (
    AuditViolation,
    OperationQueued,
    OpsSubmitted,
    PoolsSampled,
    SlotsAllocated,
    expanded,
)
from hicache_obs.exporters import metric_names as m
from hicache_obs.exporters._prometheus import PrometheusSink
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang

PROFILES = ("audit", "metrics", "sampling")
#: what the metrics profile does not keep: the events it does not log, the share it audits
NOT_KEPT = {m.EVENTS_TOTAL, m.AUDIT_SAMPLE_RATIO}


def _harness() -> Any:
    from hicache_obs.lab.sglang.harness import build_controller

    spec = ModelSpec.tiny_hybrid()
    return build_controller(spec, io_backend="direct", layout="page_first_direct", device_size=4 * spec.page_size * 16)


def _run(h: Any, profile: str, share: float | None = None) -> tuple[Any, EventLog, PrometheusSink, Auditor]:
    """The bench's serving workload (writes, evictions, loads, frees) on one controller."""
    from hicache_obs.lab.bench import _sglang_plan, sglang_workload

    log = EventLog()
    auditor = Auditor().attach(log)
    sink = PrometheusSink(log=log)
    log.add_sink(sink)
    inst = instrument(h.controller, log=log, profile=profile, audit_sample=share)
    sglang_workload(h, _sglang_plan(16, h.spec.page_size), 8)
    inst.detach()
    log.flush()
    return inst, log, sink, auditor


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Any, EventLog, PrometheusSink, Auditor]]:
    h = _harness()
    try:
        return {p: _run(h, p, 0.25 if p == "sampling" else None) for p in PROFILES}
    finally:
        h.close()


def _histogram_counts(sink: PrometheusSink) -> dict[str, float]:
    out = {}
    for name in (m.TRANSFER_DURATION_SECONDS, m.QUEUE_WAIT_SECONDS):
        for d in ("d2h", "h2d"):
            out[f"{name}/{d}"] = sink.registry.get_sample_value(f"{name}_count", {"direction": d}) or 0
    return out


@pytest.mark.parametrize("profile", ["metrics", "sampling"])
def test_each_profile_keeps_the_audit_profiles_metrics(runs: dict[str, Any], profile: str) -> None:
    audit_snap, snap = runs["audit"][2].snapshot(), runs[profile][2].snapshot()
    kept = sorted(set(audit_snap) - NOT_KEPT)
    assert {n: snap[n] for n in kept} == {n: audit_snap[n] for n in kept}
    assert _histogram_counts(runs[profile][2]) == _histogram_counts(runs["audit"][2])
    # what the dashboards read moved: the workload is not empty
    ops = audit_snap[m.OPERATIONS_TOTAL]
    assert ops[("d2h", "completed")] == 16 and ops[("h2d", "completed")] == 2
    assert sum(audit_snap[m.TRANSFER_BYTES_TOTAL].values()) > 0
    assert sum(audit_snap[m.POOL_CAPACITY_SLOTS].values()) > 0


def test_switching_profile_never_changes_a_metric_name_or_label(runs: dict[str, Any]) -> None:
    shapes = {p: series_shapes(runs[p][2].registry) for p in PROFILES}
    names = {p: {n for n, _ in s} for p, s in shapes.items()}
    assert names["metrics"] == names["audit"] == names["sampling"]
    assert {n for n in names["audit"] if n.startswith("hicache_")} >= {
        n for n in m.ALL_METRICS if m.ALL_METRICS[n][0] != m.HISTOGRAM and n not in (m.EVENTS_DROPPED_TOTAL,
                                                                                       m.EXPORTER_ERRORS_TOTAL)
    }  # fmt: skip
    assert shapes["metrics"] == shapes["audit"] == shapes["sampling"]


def test_metrics_logs_at_most_two_events_an_operation_and_no_slot(runs: dict[str, Any]) -> None:
    for profile in ("metrics", "sampling"):
        _, log, _, _ = runs[profile]
        events = log.events()
        ops = sum(len(e.queued) for e in events if isinstance(e, OpsSubmitted))
        assert ops == 32  # 16 writes, 16 loads (in 18 submissions: the loads merge by batch)
        assert len(events) / ops <= 2.0, [type(e).__name__ for e in events]
        assert not any(isinstance(e, SlotsAllocated) for e in events)
        # the queued ops come back as OperationQueued, with the times they were queued (before submission)
        queued = [e for e in expanded(events) if isinstance(e, OperationQueued)]
        assert len(queued) == 32
        subs = [e for e in events if isinstance(e, OpsSubmitted)]
        assert all(0 < q[3] <= e.ts_ns for e in subs for q in e.queued)
        # each op's own time, taken at its append (the loads are queued one by one, then merged)
        merged = [[q[3] for q in e.queued] for e in subs if len(e.queued) > 1]
        assert merged and all(times == sorted(set(times)) for times in merged), merged
        assert sorted(q.ts_ns for q in queued) == sorted(q[3] for e in subs for q in e.queued)
    audit_events = runs["audit"][1].events()
    assert len(audit_events) / 32 > 4  # what the metrics profile saves


def test_metrics_reads_no_slot_value(runs: dict[str, Any]) -> None:
    _, log, _, _ = runs["metrics"]
    subs = [e for e in log.events() if isinstance(e, OpsSubmitted)]
    assert subs and all(t.indices is None for e in subs for t in e.tensors)
    assert not any(e.sampled for e in subs)
    sampled = [e for e in log.events() if isinstance(e, PoolsSampled)]
    assert sampled[-1].audit_sample == 0.0
    assert runs["metrics"][2].snapshot()[m.AUDIT_SAMPLE_RATIO][()] == 0.0
    assert runs["audit"][2].snapshot()[m.AUDIT_SAMPLE_RATIO][()] == 1.0


def test_sampling_counts_what_it_sampled(runs: dict[str, Any]) -> None:
    inst, log, sink, _ = runs["sampling"]
    subs = [e for e in log.events() if isinstance(e, OpsSubmitted)]
    taken, seen = inst.sampled
    assert seen == len(subs) == 18
    assert taken == 5  # a share of 0.25: the 1st, 5th, 9th, 13th and 17th submission
    assert [i for i, e in enumerate(subs) if e.sampled] == [0, 4, 8, 12, 16]
    # a sampled op's CPU tensors hold their values (a device tensor's are never read), the others none
    for e in subs:
        assert all((t.indices is not None) == e.sampled for t in e.tensors if t.numel and t.device == "cpu"), e
    assert any(t.indices is not None for e in subs if e.sampled for t in e.tensors)
    assert sink.snapshot()[m.AUDIT_SAMPLE_RATIO][()] == 0.25


def _found(findings: list[Any]) -> list[tuple[str, str, str]]:
    return sorted((f.rule, f.pool, f.role) for f in findings)


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_finds_what_audit_finds_on_the_workload(runs: dict[str, Any], profile: str) -> None:
    """Clean where the release is (0.5.11 on); 0.5.10's unrecorded Mamba indices in each profile."""
    inst, log, _, auditor = runs[profile]
    assert inst.errors == 0
    assert _found(auditor.findings) == _found(runs["audit"][3].findings)
    assert _found(audit([e for e in log.events() if not isinstance(e, AuditViolation)])) == _found(auditor.findings)
    if release_tuple() >= (0, 5, 11):
        assert auditor.findings == []
    else:
        assert {(f.rule, f.pool) for f in auditor.findings} == {("unrecorded_index", "mamba")}


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_a_sampled_op_whose_indices_are_freed_in_flight_is_a_use_after_free(io_backend: str) -> None:
    from hicache_obs.lab.sglang.harness import build_controller

    h = build_controller(ModelSpec.tiny(), io_backend=io_backend)
    log = EventLog()
    auditor = Auditor().attach(log)
    instrument(h.controller, log=log, profile="sampling", audit_sample=1.0)
    page = h.spec.page_size
    kv = h.alloc_kv(2 * page)
    host, _ = h.write(kv, node_id=3)
    assert host is not None
    h.controller.start_writing()
    h.kv_allocator.free(kv)  # the write's ack is not taken yet: the op is in flight
    h.reap(wait=True)
    log.flush()
    assert [(f.rule, f.pool, f.role) for f in auditor.findings] == [("slot_not_allocated", "kv", "device")]
    offline = audit([e for e in log.events() if not isinstance(e, AuditViolation)])
    assert [(f.rule, f.op) for f in offline] == [(f.rule, f.op) for f in auditor.findings]
    # the same free after the ack is no finding
    h2 = build_controller(ModelSpec.tiny(), io_backend=io_backend)
    log2 = EventLog()
    auditor2 = Auditor().attach(log2)
    instrument(h2.controller, log=log2, profile="sampling", audit_sample=1.0)
    kv2 = h2.alloc_kv(2 * page)
    h2.write(kv2, node_id=3)
    h2.controller.start_writing()
    h2.reap(wait=True)
    h2.kv_allocator.free(kv2)
    log2.flush()
    assert auditor2.findings == []


def test_a_bad_profile_or_share_is_refused_before_anything_changes() -> None:
    h = _harness()
    try:
        free = h.controller.start_writing
        for kw, text in (
            ({"profile": "full"}, "profile must be one of metrics, audit, sampling; got 'full'"),
            ({"profile": "sampling", "audit_sample": 1.5}, "audit_sample must be a number from 0 to 1, got 1.5"),
            ({"profile": "audit", "audit_sample": 0.1}, "audit_sample 0.1: the audit profile audits every operation"),
            ({"profile": "sampling", "audit_sample": 0}, "audit_sample 0: the sampling profile needs a share"),
        ):
            with pytest.raises(ConfigError) as info:
                instrument(h.controller, **kw)
            assert text in str(info.value)
            assert h.controller.start_writing == free  # nothing was wrapped
    finally:
        h.close()


def test_the_launchers_metrics_read_the_allocators_at_each_scrape() -> None:
    """Under ``metrics`` no allocation is logged: ``read_pools_from`` gives occupancy as the
    allocators hold it when read, as the audit profile's events give it."""
    h = _harness()
    try:
        page = h.spec.page_size
        got = {}
        for profile in ("audit", "metrics"):
            log = EventLog()
            sink = PrometheusSink(log=log)
            log.add_sink(sink)
            inst = instrument(h.controller, log=log, profile=profile)
            if profile == "metrics":
                sink.read_pools_from(inst.pool_usage)
            kv = h.alloc_kv(3 * page)  # no submission: nothing a metrics log carries
            log.flush()
            got[profile] = sink.snapshot()[m.POOL_USED_SLOTS][("kv", "device")]
            h.kv_allocator.free(kv)
            log.flush()
            got[profile + " freed"] = sink.snapshot()[m.POOL_USED_SLOTS][("kv", "device")]
            inst.detach()
            log.close()
        assert got["metrics"] == got["audit"] and got["metrics freed"] == got["audit freed"]
        assert got["audit"] - got["audit freed"] == 3 * page
        assert sink.pool_read_errors == 0
    finally:
        h.close()


def test_a_metrics_log_reads_back_in_every_command(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """The store keeps each submission as one event; audit, inspect and export read it as the
    events it stands for."""
    import json

    from hicache_obs.cli import main
    from hicache_obs.events._replay import replay
    from hicache_obs.events._store import open_store

    h = _harness()
    try:
        log = EventLog()
        open_store(log, tmp_path / "log")
        with instrument(h.controller, log=log, profile="metrics"):
            from hicache_obs.lab.bench import _sglang_plan, sglang_workload

            sglang_workload(h, _sglang_plan(4, h.spec.page_size), 2)
        log.close()
    finally:
        h.close()
    lines = [json.loads(x) for f in sorted((tmp_path / "log").iterdir()) for x in f.read_text().splitlines()[1:]]
    assert {ln["type"] for ln in lines} == {"OpsSubmitted", "TransferCompleted", "PoolsSampled"}
    res = replay(tmp_path / "log", audit=True)
    assert sum(type(e).__name__ == "TransferSubmitted" for e in res.events) == sum(
        ln["type"] == "OpsSubmitted" for ln in lines
    )
    assert res.n_events == len(lines)
    expect = 0 if release_tuple() >= (0, 5, 11) else 1
    assert main(["audit", str(tmp_path / "log")]) == expect
    assert main(["inspect", str(tmp_path / "log"), "--json"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "log"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert "unrecorded_index" in json.dumps(shown) if expect else "unrecorded_index" not in json.dumps(shown)
    assert main(["export", str(tmp_path / "log"), "--chrome-trace", str(tmp_path / "t.json")]) == 0
    trace = json.loads((tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "transfer"]
    assert len(spans) == sum(ln["type"] == "OpsSubmitted" for ln in lines) == 6  # one per merged op
