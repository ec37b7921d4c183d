"""Our controller's profiles: ``metrics`` reads no slot value for its events and keeps every
metric and every stream rule; ``sampling`` carries the values of a share of the ops; the
names never change."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from metric_shapes import series_shapes

from hicache_obs.core import HybridCacheController, ModelSpec
from hicache_obs.errors import ConfigError
from hicache_obs.events import EventLog
from hicache_obs.events._audit import Auditor
from hicache_obs.events._schema import IndicesMoved, PoolsSampled, StreamRecorded, TransferSubmitted
from hicache_obs.exporters import metric_names as m
from hicache_obs.exporters._prometheus import PrometheusSink
from hicache_obs.lab.workload import Workload, controller_options
from hicache_obs.testing import make_controller

PROFILES = ("audit", "metrics", "sampling")


def _run(profile: str, runtime: str, fault: str | None = None, steps: int = 150) -> dict[str, Any]:
    spec = ModelSpec.tiny_hybrid()
    log = EventLog(capacity=None)
    auditor = Auditor().attach(log)
    sink = PrometheusSink(log=log)
    log.add_sink(sink)
    share = 0.25 if profile == "sampling" else None
    c = make_controller(
        spec, fault=fault, log=log, runtime=runtime, profile=profile, audit_sample=share, **controller_options(spec)
    )
    Workload(c, seed=7, fault=fault).run(steps)
    sampled = c.sampled
    c.close()
    log.flush()
    findings = Counter(f.rule for f in auditor.finish())
    return {"log": log, "sink": sink, "findings": findings, "sampled": sampled, "runtime": runtime}


def _tensors(events: list[Any]) -> list[Any]:
    out = []
    for e in events:
        if isinstance(e, TransferSubmitted):
            out += list(e.tensors)
        elif isinstance(e, (IndicesMoved, StreamRecorded)):
            out.append(e.tensor)
    return out


@pytest.fixture(scope="module", params=["sim", "cpu"])
def runs(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    return {p: _run(p, request.param) for p in PROFILES}


@pytest.mark.parametrize("profile", ["metrics", "sampling"])
def test_each_profile_keeps_every_metric_of_audit(runs: dict[str, Any], profile: str) -> None:
    audit_snap, snap = runs["audit"]["sink"].snapshot(), runs[profile]["sink"].snapshot()
    kept = sorted(set(audit_snap) - {m.AUDIT_SAMPLE_RATIO, m.EVENTS_TOTAL})
    assert {n: snap[n] for n in kept} == {n: audit_snap[n] for n in kept}
    # the same events, and one more: the share the profile audits
    events = dict(snap[m.EVENTS_TOTAL])
    assert events.pop(("PoolsSampled",)) == 1 + audit_snap[m.EVENTS_TOTAL].get(("PoolsSampled",), 0)
    assert events == {k: v for k, v in audit_snap[m.EVENTS_TOTAL].items() if k != ("PoolsSampled",)}
    ops = audit_snap[m.OPERATIONS_TOTAL]
    assert ops[("d2h", "completed")] > 10 and ops[("h2d", "completed")] > 10
    if runs["audit"]["runtime"] == "sim":  # a runtime with a device: index moves and stream records
        assert sum(audit_snap[m.INDEX_MOVES_TOTAL].values()) > 0 and sum(audit_snap[m.STREAM_RECORDS_TOTAL].values()) > 0
    expected_share = {"metrics": 0.0, "sampling": 0.25}[profile]
    assert snap[m.AUDIT_SAMPLE_RATIO] == {(): expected_share}
    assert audit_snap[m.AUDIT_SAMPLE_RATIO] == {(): 1.0}


def test_switching_profile_never_changes_a_metric_name_or_label(runs: dict[str, Any]) -> None:
    shapes = {p: series_shapes(runs[p]["sink"].registry) for p in PROFILES}
    assert shapes["metrics"] == shapes["audit"] == shapes["sampling"]


def test_metrics_reads_no_slot_value_and_sampling_a_share(runs: dict[str, Any]) -> None:
    with_values = {p: [t for t in _tensors(runs[p]["log"].events()) if t.indices is not None] for p in PROFILES}
    assert with_values["audit"], "the audit profile describes the slots its ops moved"
    assert with_values["metrics"] == []
    assert 0 < len(with_values["sampling"]) < len(with_values["audit"])
    taken, seen = runs["sampling"]["sampled"]
    assert seen > 40 and taken == -(-seen // 4)  # evenly: the first, then one in every four
    assert runs["metrics"]["sampled"] == (0, seen) and runs["audit"]["sampled"] == (0, 0)
    # each profile logs the same events, but one: the share it audits
    counts = {p: Counter(type(e).__name__ for e in runs[p]["log"].events()) for p in PROFILES}
    assert counts["metrics"] - counts["audit"] == Counter({PoolsSampled.__name__: 1})
    assert counts["sampling"] == counts["metrics"]


@pytest.mark.parametrize(
    ("fault", "runtime", "rule"),
    [
        ("unrecorded-pool-indices", "sim", "unrecorded_index"),
        ("unmoved-pool-indices", "sim", "index_not_on_device"),
        ("length-mismatch", "cpu", "length_mismatch"),
        ("double-free", "cpu", "double_free"),  # the frees are the bookkeeping's own events
    ],
)
def test_every_profile_finds_what_needs_no_slot_value(fault: str, runtime: str, rule: str) -> None:
    got = {p: _run(p, runtime, fault)["findings"] for p in PROFILES}
    assert got["audit"][rule] > 0 and set(got["audit"]) == {rule}
    assert got["metrics"] == got["sampling"] == got["audit"]


def test_a_use_after_free_needs_the_slot_values() -> None:
    got = {p: _run(p, "cpu", "use-after-free")["findings"] for p in PROFILES}
    assert set(got["audit"]) == {"slot_not_allocated"}
    assert got["metrics"] == Counter()  # listed in the docs: the slot rules need values
    assert 0 < got["sampling"]["slot_not_allocated"] < got["audit"]["slot_not_allocated"]


def test_a_bad_profile_is_refused_before_anything_is_made() -> None:
    spec = ModelSpec.tiny_hybrid()
    for kwargs, words in [
        ({"profile": "full"}, "'full'"),
        ({"profile": "audit", "audit_sample": 0.5}, "audit_sample 0.5"),
        ({"profile": "sampling", "audit_sample": 0}, "audit_sample 0"),
        ({"profile": "sampling", "audit_sample": 1.5}, "1.5"),
    ]:
        log = EventLog()
        with pytest.raises(ConfigError, match=words):
            HybridCacheController(spec, log=log, **kwargs)
        assert log.events() == [] and log.owner is None
