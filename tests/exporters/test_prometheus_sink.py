"""PrometheusSink: values scraped over HTTP equal what a real workload did; promtool accepts them."""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.error
import urllib.request

import prometheus_client
import pytest
from exporters_kit import parse_exposition, run_workload, scrape_text, value, values
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from hicache_obs.errors import ConfigError
from hicache_obs.events._audit import RULES
from hicache_obs.events._schema import EVENT_TYPES
from hicache_obs.exporters import metric_names as m
from hicache_obs.exporters._prometheus import PrometheusSink, start_metrics_server

POOLS = ("kv", "mamba", "swa")


@pytest.fixture
def served(controller):
    """``served(spec, fault=None, **sink_kw)`` -> (controller, sink, url); servers stop after the test."""
    servers = []

    def make(spec="tiny_hybrid", fault=None, **sink_kw):
        c = controller(spec, fault=fault)
        sink = PrometheusSink(log=c.log, **sink_kw)
        c.log.add_sink(sink)
        server, port = start_metrics_server(sink.registry)
        servers.append(server)
        return c, sink, f"http://127.0.0.1:{port}/metrics"

    yield make
    for s in servers:
        s.stop()


@pytest.mark.parametrize("spec", ["tiny", "tiny_hybrid"])
def test_scraped_values_equal_what_the_workload_did(served, spec):
    c, _, url = served(spec)
    exp = run_workload(c)
    assert exp.intact
    c.log.flush()
    s = parse_exposition(scrape_text(url))

    for d in ("d2h", "h2d"):
        assert value(s, m.OPERATIONS_TOTAL, direction=d, status="completed") == exp.ops[d]
        assert value(s, m.OPERATIONS_TOTAL, direction=d, status="submitted") == exp.ops[d]
        assert value(s, m.OPERATIONS_TOTAL, direction=d, status="failed") == 0
        assert value(s, m.TRANSFERS_IN_FLIGHT, direction=d) == 0
        assert value(s, m.TRANSFER_DURATION_SECONDS + "_count", direction=d) == exp.ops[d]
        assert value(s, m.TRANSFER_DURATION_SECONDS + "_bucket", direction=d, le="+Inf") == exp.ops[d]
        assert value(s, m.TRANSFER_DURATION_SECONDS + "_sum", direction=d) > 0
        assert value(s, m.QUEUE_WAIT_SECONDS + "_count", direction=d) == exp.ops[d]
        for pool in POOLS:
            assert value(s, m.TRANSFER_SLOTS_TOTAL, pool=pool, direction=d) == exp.slots.get((pool, d), 0), (pool, d)
            assert value(s, m.TRANSFER_BYTES_TOTAL, pool=pool, direction=d) == exp.bytes.get((pool, d), 0), (pool, d)
            for role in ("host", "device"):
                assert value(s, m.UNRECORDED_INDICES_TOTAL, pool=pool, role=role, direction=d) == 0
    for pool in POOLS:
        for tier in ("device", "host"):
            assert value(s, m.POOL_USED_SLOTS, pool=pool, tier=tier) == exp.used.get((pool, tier), 0), (pool, tier)
            assert value(s, m.EVICTED_SLOTS_TOTAL, pool=pool, tier=tier) == exp.evicted.get((pool, tier), 0)
            assert value(s, m.EVICTIONS_TOTAL, pool=pool, tier=tier) == exp.evictions.get((pool, tier), 0)
            assert value(s, m.ALLOCATION_FAILURES_TOTAL, pool=pool, tier=tier) == 0
        for rule in RULES:
            if rule != "incomplete_operation":
                assert value(s, m.AUDIT_VIOLATIONS_TOTAL, rule=rule, pool=pool) == 0
    for pool in c.spec.pool_names:
        assert value(s, m.POOL_CAPACITY_SLOTS, pool=pool, tier="device") == c.device_pool(pool).size
        assert value(s, m.POOL_CAPACITY_SLOTS, pool=pool, tier="host") == c.host_pool(pool).size

    # index moves and stream records: the kernel backend moves each host index tensor to the
    # device before the op, and records the host and device index tensors of every pool
    events = c.log.events()
    for pool in c.spec.pool_names:
        ops_with_pool = sum(1 for d in ("d2h", "h2d") if exp.slots.get((pool, d)))
        assert ops_with_pool
        moved = sum(1 for e in events if type(e).__name__ == "IndicesMoved" and e.pool == pool)
        assert value(s, m.INDEX_MOVES_TOTAL, pool=pool, role="host") == moved > 0
        assert value(s, m.INDEX_MOVES_TOTAL, pool=pool, role="device") == 0
        for role in ("host", "device"):
            assert value(s, m.STREAM_RECORDS_TOTAL, pool=pool, role=role) == moved
    assert sum(values(s, m.EVENTS_TOTAL)) == len(c.log)
    for t in EVENT_TYPES:
        assert (m.EVENTS_TOTAL, frozenset({("type", t)})) in s
    assert value(s, m.EVENTS_DROPPED_TOTAL, sink="prometheus") == 0
    assert value(s, m.EXPORTER_ERRORS_TOTAL, sink="prometheus") == 0


def test_unrecorded_pool_indices_fault_counts_mamba_and_never_kv(served):
    c, _, url = served("tiny_hybrid", fault="unrecorded-pool-indices")
    exp = run_workload(c)
    c.log.flush()
    s = parse_exposition(scrape_text(url))
    mamba = values(s, m.UNRECORDED_INDICES_TOTAL, pool="mamba")
    kv = values(s, m.UNRECORDED_INDICES_TOTAL, pool="kv")
    assert sum(mamba) > 0
    assert len(kv) == 4 and set(kv) == {0}
    # one host and one device index tensor per op that carried a mamba part
    mamba_ops = {d: sum(1 for op in exp.op_ids[d] if op in exp.mamba_ops) for d in ("d2h", "h2d")}
    for d in ("d2h", "h2d"):
        for role in ("host", "device"):
            assert value(s, m.UNRECORDED_INDICES_TOTAL, pool="mamba", role=role, direction=d) == mamba_ops[d]
    assert value(s, m.AUDIT_VIOLATIONS_TOTAL, rule="unrecorded_index", pool="mamba") == sum(mamba)
    assert value(s, m.AUDIT_VIOLATIONS_TOTAL, rule="unrecorded_index", pool="kv") == 0


def test_every_metric_has_exactly_its_design_labels(served):
    c, _, url = served("tiny_hybrid", fault="unrecorded-pool-indices")
    run_workload(c, rounds=1)
    c.log.flush()
    families = {f.name: f for f in text_string_to_metric_families(scrape_text(url))}
    for name, (kind, labels) in m.ALL_METRICS.items():
        fam_name = name.removesuffix("_total") if kind == m.COUNTER else name
        assert fam_name in families, f"{name} missing from the exposition"
        fam = families[fam_name]
        assert fam.type == kind, name
        assert fam.samples, f"{name} has no series"
        for sample in fam.samples:
            assert set(sample.labels) - {"le"} == set(labels), (name, sample.labels)
    assert all(n.startswith("hicache_") for n in m.ALL_METRICS)
    assert all(n.endswith("_total") for n, (k, _) in m.ALL_METRICS.items() if k == m.COUNTER)
    assert set(m.DESIGN_METRICS) <= set(m.ALL_METRICS)


def test_promtool_accepts_the_exposition(served):
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("HICACHE_REQUIRE_PROMTOOL") == "1":
            pytest.fail("promtool is not on PATH and HICACHE_REQUIRE_PROMTOOL=1")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    c, _, url = served("tiny_hybrid", fault="unrecorded-pool-indices")
    run_workload(c, rounds=2)
    c.log.flush()
    text = scrape_text(url)
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (res.stdout + res.stderr).strip(), res.stdout + res.stderr


def test_server_serves_only_metrics_on_loopback_and_stops():
    sink = PrometheusSink()
    server, port = start_metrics_server(sink.registry)
    try:
        assert port != 0 and server.server_address[0] == "127.0.0.1"
        base = f"http://127.0.0.1:{port}"
        assert "hicache_operations_total" in scrape_text(base + "/metrics?x=1")
        for path in ("/", "/metrics/", "/favicon.ico", "/other"):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(base + path, timeout=10)
            assert info.value.code == 404, path
        req = urllib.request.Request(base + "/metrics", headers={"Accept": "application/openmetrics-text"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            assert resp.read().decode().rstrip().endswith("# EOF")
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    server.stop()  # idempotent


def test_fresh_registry_per_sink_and_the_global_one_untouched():
    before = {n for n in prometheus_client.REGISTRY._names_to_collectors}
    a, b = PrometheusSink(), PrometheusSink()
    assert a.registry is not b.registry
    assert not any(n.startswith("hicache_") for n in prometheus_client.REGISTRY._names_to_collectors)
    assert {n for n in prometheus_client.REGISTRY._names_to_collectors} == before
    reg = CollectorRegistry()
    PrometheusSink(reg)
    with pytest.raises(ValueError, match="Duplicated"):
        PrometheusSink(reg)


def test_buckets_are_configurable_and_checked(controller):
    c = controller("tiny")
    sink = PrometheusSink(duration_buckets=[0.5, 30.0], queue_wait_buckets=[1.0])
    c.log.add_sink(sink)
    run_workload(c, rounds=1)
    c.log.flush()
    s = parse_exposition(prometheus_client.generate_latest(sink.registry).decode())
    assert value(s, m.TRANSFER_DURATION_SECONDS + "_bucket", direction="d2h", le="30.0") == 2
    assert len(values(s, m.TRANSFER_DURATION_SECONDS + "_bucket", direction="d2h")) == 3
    assert len(values(s, m.QUEUE_WAIT_SECONDS + "_bucket", direction="h2d")) == 2
    for bad in ([], [1.0, 0.5], [float("inf")], [0.1, 0.1]):
        with pytest.raises(ConfigError):
            PrometheusSink(duration_buckets=bad)


def test_one_registry_per_rank_served_on_its_own_port(controller):
    """The multi-process recipe: one sink, registry and port per rank; ranks never mix."""
    servers = []
    try:
        urls = []
        for rank, rounds in ((0, 1), (1, 2)):
            c = controller("tiny", rank=rank)
            sink = PrometheusSink(log=c.log)
            c.log.add_sink(sink)
            run_workload(c, rounds=rounds)
            c.log.flush()
            server, port = start_metrics_server(sink.registry, port=0)
            servers.append(server)
            urls.append(f"http://127.0.0.1:{port}/metrics")
        s0, s1 = (parse_exposition(scrape_text(u)) for u in urls)
        assert value(s0, m.OPERATIONS_TOTAL, direction="h2d", status="completed") == 1
        assert value(s1, m.OPERATIONS_TOTAL, direction="h2d", status="completed") == 2
    finally:
        for s in servers:
            s.stop()


def test_allocation_failures_and_in_flight_transfers(controller):
    c = controller("tiny", device_size=64)
    sink = PrometheusSink()
    c.log.add_sink(sink)
    assert c.alloc_device(128) is None
    kv = c.alloc_device(32)
    host = c.write(kv, node_id=1)
    c.poll_writes()
    c.evict_device(kv)
    dev = c.load(host, node_id=1)
    assert dev is not None
    c.start_loading()  # submitted, not reaped yet
    c.log.flush()
    snap = sink.snapshot()
    assert snap[m.ALLOCATION_FAILURES_TOTAL][("kv", "device")] == 1
    assert snap[m.TRANSFERS_IN_FLIGHT][("h2d",)] == 1
    assert snap[m.OPERATIONS_TOTAL][("h2d", "submitted")] == 1
    assert snap[m.OPERATIONS_TOTAL][("h2d", "completed")] == 0
    c.poll_loads()
    c.log.flush()
    snap = sink.snapshot()
    assert snap[m.TRANSFERS_IN_FLIGHT][("h2d",)] == 0
    assert snap[m.OPERATIONS_TOTAL][("h2d", "completed")] == 1


def test_one_batch_and_one_event_at_a_time_give_the_same_values(controller):
    """Batch boundaries anywhere (or none: ``handle``) give the same values, and the right ones."""
    c = controller("tiny_hybrid")
    exp = run_workload(c)
    events = c.log.events()
    assert any(getattr(e, "reason", None) == "evict" for e in events)
    batched, single = PrometheusSink(), PrometheusSink()
    for i in range(0, len(events), 97):  # batch boundaries anywhere
        batched.handle_batch(events[i : i + 97])
    for ev in events:
        single.handle(ev)
    snap = batched.snapshot()
    assert snap == single.snapshot()
    assert sum(snap[m.EVENTS_TOTAL].values()) == len(events)
    for (pool, tier), n in exp.used.items():
        assert snap[m.POOL_USED_SLOTS][(pool, tier)] == n
    for (pool, tier), n in exp.evicted.items():
        assert snap[m.EVICTED_SLOTS_TOTAL][(pool, tier)] == n
