"""``hicache-obs inspect`` and ``hicache-obs export`` on demo logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hicache_obs.events._replay import replay
from hicache_obs.events._schema import TransferSubmitted


@pytest.fixture(autouse=True)
def _eighty_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")


def _fits(text: str) -> None:
    assert max(len(line) for line in text.splitlines()) <= 80


def test_tree_shows_moves_records_and_violations(cli: Any, faulty_demo: tuple[dict[str, Any], Path]) -> None:
    code, text, _ = cli("inspect", str(faulty_demo[1]))
    assert code == 0
    for fragment in (
        "op 0 d2h completed",
        "indices moved cpu -> sim:0",
        "NOT recorded on hicache-write",
        "transfer on hicache-",
        "unrecorded_index mamba/",
    ):
        assert fragment in text
    _fits(text)


def test_json_ops_match_the_submitted_transfers(cli: Any, clean_demo: tuple[dict[str, Any], Path]) -> None:
    out = clean_demo[1]
    code, text, _ = cli("inspect", str(out), "--json")
    assert code == 0
    ops = json.loads(text)["ops"]
    submitted = [ev for ev in replay(out).events if isinstance(ev, TransferSubmitted)]
    assert [o["op"] for o in ops] == [ev.op for ev in submitted]
    assert all(o["status"] == "completed" and o["violations"] == [] for o in ops)
    loads = [o for o in ops if o["direction"] == "h2d"]
    assert loads and all(o["layer_durations_ns"] for o in loads)
    merged = [o for o in ops if o["merged_ops"]]
    assert merged, "the demo merges queued loads"
    for o in ops:
        for t in (t for p in o["pools"].values() for t in p["tensors"]):
            assert t["recorded"] or not t["needs_record"]


def test_filters(cli: Any, faulty_demo: tuple[dict[str, Any], Path]) -> None:
    out = str(faulty_demo[1])
    _, text, _ = cli("inspect", out, "--json")
    ops = json.loads(text)["ops"]
    merged = next(o for o in ops if o["merged_ops"])
    source = merged["merged_ops"][0]
    code, text, _ = cli("inspect", out, "--op", str(source), "--json")
    assert code == 0
    assert [o["op"] for o in json.loads(text)["ops"]] == [merged["op"]]

    _, text, _ = cli("inspect", out, "--pool", "kv", "--json")
    kv = json.loads(text)["ops"]
    assert kv and all(list(o["pools"]) == ["kv"] and o["violations"] == [] for o in kv)

    _, text, _ = cli("inspect", out, "--violations-only", "--pool", "mamba", "--json")
    bad = json.loads(text)["ops"]
    assert bad and all(o["violations"] and list(o["pools"]) == ["mamba"] for o in bad)

    _, text, _ = cli("inspect", out, "--limit", "2", "--json")
    assert len(json.loads(text)["ops"]) == 2
    code, text, _ = cli("inspect", out, "--op", "999999")
    assert code == 0 and "no matching operations" in text


def test_timeline(cli: Any, faulty_demo: tuple[dict[str, Any], Path]) -> None:
    out = str(faulty_demo[1])
    code, text, _ = cli("inspect", out, "--timeline", "--op", "0")
    assert code == 0
    for fragment in (
        "queued d2h",
        "moved kv host",
        "submitted on hicache-write",
        "completed in",
        "VIOLATION unrecorded_index",
    ):
        assert fragment in text
    _fits(text)
    _, text, _ = cli("inspect", out, "--timeline", "--json")
    lines = json.loads(text)["timeline"]
    assert [ln["t_ms"] for ln in lines] == sorted(ln["t_ms"] for ln in lines)
    assert {ln["type"] for ln in lines} >= {
        "OperationQueued",
        "TransferSubmitted",
        "TransferCompleted",
        "AuditViolation",
    }


def test_chrome_trace_is_valid_trace_json(cli: Any, tmp_path: Path, faulty_demo: tuple[dict[str, Any], Path]) -> None:
    out = faulty_demo[1]
    target = tmp_path / "t.json"
    code, _, err = cli("export", str(out), "--chrome-trace", str(target))
    assert code == 0, err
    for path in (target, out / "trace.json"):  # the exported one and the demo's own
        doc = json.loads(path.read_text())
        events = doc["traceEvents"]
        assert isinstance(events, list) and events
        assert all({"ph", "ts", "pid", "tid"} <= set(e) for e in events)
        assert any(e["ph"] == "X" for e in events)


def test_otlp_json_has_one_span_per_operation(
    cli: Any, tmp_path: Path, clean_demo: tuple[dict[str, Any], Path]
) -> None:
    s, out = clean_demo
    target = tmp_path / "spans.json"
    code, _, _ = cli("export", str(out), "--otlp-json", str(target))
    assert code == 0
    doc = json.loads(target.read_text())
    spans = [sp for r in doc["resourceSpans"] for ss in r["scopeSpans"] for sp in ss["spans"]]
    assert len(spans) == s["operations"]["d2h"] + s["operations"]["h2d"]
    assert {sp["name"] for sp in spans} == {"hicache.write", "hicache.load"}


def test_export_to_stdout_and_usage_errors(cli: Any, clean_demo: tuple[dict[str, Any], Path]) -> None:
    out = str(clean_demo[1])
    code, text, _ = cli("export", out, "--chrome-trace", "-")
    assert code == 0 and "traceEvents" in json.loads(text)
    code, text, err = cli("export", out)
    assert code == 2 and text == "" and err.startswith("hicache-obs: error:") and err.count("\n") == 1
    code, _, err = cli("export", out, "--chrome-trace", "-", "--otlp-json", "-")
    assert code == 2


def _with_outside_findings(tmp_path: Path) -> Path:
    """A clean demo-sized log plus two findings no op owns: a Mamba host free handed indices on
    the GPU, and a free SGLang refused of slots already free."""
    from hicache_obs.core import ModelSpec
    from hicache_obs.events._schema import FreeRefused, IndicesMisplaced, TensorRef
    from hicache_obs.events._store import JsonlStore
    from hicache_obs.testing import make_controller

    c = make_controller(ModelSpec.tiny_hybrid(), device_size=512, io_backend="kernel")
    kv = c.alloc_device(32)
    c.write(kv, node_id=1)
    while not c.poll_writes():
        pass
    c.log.emit(
        IndicesMisplaced,
        pool="mamba",
        tier="host",
        call="free",
        expected="cpu",
        tensor=TensorRef(pool="mamba", role="host", device="cuda:0", numel=2, dtype="int64", ptr=4096),
    )
    free = TensorRef(pool="kv", role="device", device="cpu", numel=2, dtype="int64", ptr=64, indices=((500, 2),))
    c.log.emit(FreeRefused, pool="kv", tier="device", call="free", tensor=free, error="AssertionError: Double-free")
    store = JsonlStore(tmp_path / "log", rank=0)
    store.handle_batch(list(c.log.events()))
    store.close()
    return tmp_path / "log"


def test_findings_no_op_owns_come_last_outside_any_op(cli: Any, tmp_path: Path) -> None:
    log = _with_outside_findings(tmp_path)
    code, text, _ = cli("inspect", str(log))
    assert code == 0
    tail = text[text.index("outside any op") :]
    assert "misplaced_indices mamba/host: host pool 'mamba': free() was handed 2" in " ".join(tail.split())
    assert "double_free kv/device" in tail
    assert text.index("op 0 d2h") < text.index("outside any op")
    code, text, _ = cli("inspect", str(log), "--json")
    loose = json.loads(text)["outside_ops"]
    assert [(f["rule"], f["pool"], f["role"]) for f in loose] == [
        ("misplaced_indices", "mamba", "host"),
        ("double_free", "kv", "device"),
    ]
    # the filters hold: another pool, or one op, shows none of them
    code, text, _ = cli("inspect", str(log), "--json", "--pool", "kv")
    assert [f["rule"] for f in json.loads(text)["outside_ops"]] == ["double_free"]
    code, text, _ = cli("inspect", str(log), "--json", "--op", "0")
    assert json.loads(text)["outside_ops"] == []
