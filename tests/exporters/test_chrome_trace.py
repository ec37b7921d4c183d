"""Chrome Trace Event JSON: valid, one track per stream, every op a slice, violations highlighted."""

from __future__ import annotations

import itertools
import json

from exporters_kit import run_workload

from hicache_obs.events._replay import replay
from hicache_obs.events._schema import AuditViolation, StreamRecorded, TransferSubmitted
from hicache_obs.exporters._chrome_trace import ChromeTraceSink, chrome_trace, write_chrome_trace

REQUIRED = ("name", "ph", "ts", "pid", "tid")


def _check_valid(doc: dict) -> list[dict]:
    assert set(doc) == {"traceEvents", "displayTimeUnit"} and doc["displayTimeUnit"] == "ms"
    evs = doc["traceEvents"]
    for e in evs:
        missing = [k for k in REQUIRED if k not in e]
        assert not missing, (missing, e)
        assert e["ph"] in ("X", "i", "M", "C"), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        if e["ph"] == "i":
            assert e["s"] == "t"
    assert min(e["ts"] for e in evs if e["ph"] != "M") == 0, "timestamps are relative to the first event"
    return evs


def _tracks(evs: list[dict]) -> dict[str, int]:
    return {e["args"]["name"]: e["tid"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}


def test_trace_of_a_faulty_workload(controller, tmp_path):
    c = controller("tiny_hybrid", fault="unrecorded-pool-indices")
    path = tmp_path / "out" / "trace.json"
    c.log.add_sink(ChromeTraceSink(path))
    exp = run_workload(c, rounds=2)
    c.close()  # the log closes its sinks: the trace is written
    doc = json.loads(path.read_text())
    evs = _check_valid(doc)

    tracks = _tracks(evs)
    assert {"controller", "hicache-write", "hicache-load", "audit"} <= set(tracks)
    assert len(set(tracks.values())) == len(tracks), "one tid per track"
    assert [e["args"]["name"] for e in evs if e["name"] == "process_name"] == ["hicache rank 0"]

    slices = [e for e in evs if e["ph"] == "X"]
    submitted = [e for e in c.log.events() if isinstance(e, TransferSubmitted)]
    assert sorted(s["args"]["op"] for s in slices) == sorted(e.op for e in submitted)
    assert sorted(s["args"]["op"] for s in slices) == sorted(exp.op_ids["d2h"] + exp.op_ids["h2d"])
    for s in slices:
        stream = "hicache-write" if s["args"]["direction"] == "d2h" else "hicache-load"
        assert s["tid"] == tracks[stream]
        assert {"op", "slots", "bytes", "pools", "unrecorded"} <= set(s["args"])
        if s["args"]["op"] in exp.mamba_ops:
            assert s["args"]["unrecorded"] == 2 and s["cname"] == "bad"
        else:
            assert s["args"]["unrecorded"] == 0 and "cname" not in s
    # slices on one stream track never overlap
    for tid in (tracks["hicache-write"], tracks["hicache-load"]):
        on = sorted((s for s in slices if s["tid"] == tid), key=lambda s: s["ts"])
        for a, b in itertools.pairwise(on):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6

    violations = [e for e in evs if e["ph"] == "i" and e.get("cname") == "terrible"]
    n = sum(1 for e in c.log.events() if isinstance(e, AuditViolation))
    assert len(violations) == n > 0
    assert all(v["tid"] == tracks["audit"] and v["args"]["pool"] == "mamba" for v in violations)
    records = [e for e in evs if e["ph"] == "i" and e.get("cat") == "stream_record"]
    assert len(records) == sum(1 for e in c.log.events() if isinstance(e, StreamRecorded))
    assert {r["tid"] for r in records} == {tracks["hicache-write"], tracks["hicache-load"]}
    moves = [e for e in evs if e["ph"] == "i" and e.get("cat") == "index_move"]
    assert moves and {m["tid"] for m in moves} == {tracks["controller"]}
    counters = [e for e in evs if e["ph"] == "C"]
    assert {e["name"] for e in counters} >= {"used slots kv/device", "used slots mamba/host"}


def test_trace_from_a_replayed_store_equals_the_live_one(controller, tmp_path):
    from hicache_obs.events._store import open_store

    c = controller("tiny")
    open_store(c.log, tmp_path / "log")
    run_workload(c, rounds=1)
    c.close()
    live = chrome_trace(c.log.events())
    res = replay(tmp_path / "log")
    assert chrome_trace(res.events) == live
    write_chrome_trace(res.events, tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(json.dumps(live))
    assert "hicache-write" in _tracks(_check_valid(live))


def test_empty_log():
    assert chrome_trace([]) == {"traceEvents": [], "displayTimeUnit": "ms"}


def test_incomplete_operation_is_a_slice_to_the_end(controller):
    c = controller("tiny")
    kv = c.alloc_device(32)
    host = c.write(kv, node_id=1)
    c.poll_writes()
    c.evict_device(kv)
    c.load(host, node_id=1)
    c.start_loading()
    evs = _check_valid(chrome_trace(c.log.events()))
    load = next(e for e in evs if e["ph"] == "X" and e["args"]["direction"] == "h2d")
    assert load["args"]["status"] == "in_flight" and load["cname"] == "yellow"
