"""``inspect`` shows the rules' verdicts, whether the log holds its own violations or not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def _stripped(log: Path, target: Path) -> Path:
    """``log`` as it would be recorded without an auditor: no ``AuditViolation``, seqs gap-free."""
    import msgspec

    from hicache_obs.events import AuditViolation
    from hicache_obs.events._replay import replay
    from hicache_obs.events._store import segment_header

    kept = [e for e in replay(log).events if not isinstance(e, AuditViolation)]
    target.mkdir()
    lines = [msgspec.json.encode(msgspec.structs.replace(e, seq=i)) + b"\n" for i, e in enumerate(kept)]
    (target / "events-0-00000.jsonl").write_bytes(segment_header(0, 0) + b"".join(lines))
    return target


def _without_seq(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in ln.items() if k != "seq"} for ln in lines]


@pytest.mark.parametrize(
    "argv",
    [("--timeline", "--json"), ("--timeline", "--op", "0", "--json"), ("--json",), ("--timeline",), ()],
    ids=lambda a: " ".join(a) or "tree",
)
def test_a_log_without_its_violations_inspects_the_same(
    cli: Any, tmp_path: Path, faulty_demo: tuple[dict[str, Any], Path], argv: tuple[str, ...]
) -> None:
    log = faulty_demo[1]
    bare = _stripped(log, tmp_path / "bare")
    code, logged, _ = cli("inspect", str(log), *argv)
    assert code == 0
    code, plain, _ = cli("inspect", str(bare), *argv)
    assert code == 0
    if "--json" not in argv:
        assert logged == plain
        assert "unrecorded_index mamba/" in logged
        return
    a, b = json.loads(logged), json.loads(plain)
    assert a["events"] > b["events"]  # the counts are the log's own
    key = "timeline" if "--timeline" in argv else "ops"
    if key == "timeline":  # the seqs differ: the stripped log numbers its events without the violations
        assert _without_seq(a[key]) == _without_seq(b[key])
    else:
        assert a[key] == b[key]
    if key == "timeline":
        shown = [ln for ln in a[key] if ln["type"] == "AuditViolation"]
        assert shown and all(ln["text"].startswith("VIOLATION unrecorded_index mamba/") for ln in shown)


def test_timeline_shows_each_verdict_after_the_completion_that_revealed_it(
    cli: Any, faulty_demo: tuple[dict[str, Any], Path]
) -> None:
    code, text, _ = cli("inspect", str(faulty_demo[1]), "--timeline", "--json")
    assert code == 0
    lines = json.loads(text)["timeline"]
    verdicts = [i for i, ln in enumerate(lines) if ln["type"] == "AuditViolation"]
    assert verdicts
    for i in verdicts:
        j = i
        while lines[j]["type"] == "AuditViolation":
            j -= 1
        done = lines[j]
        assert done["type"] == "TransferCompleted"
        assert (lines[i]["seq"], lines[i]["t_ms"], lines[i]["op"]) == (done["seq"], done["t_ms"], done["op"])


def test_timeline_shows_end_of_log_findings_last(cli: Any, tmp_path: Path) -> None:
    from hicache_obs.core import ModelSpec
    from hicache_obs.events._audit import Auditor
    from hicache_obs.events._store import open_store
    from hicache_obs.testing import make_controller

    c = make_controller(ModelSpec.tiny(), device_size=512)
    store = open_store(c.log, tmp_path / "log")
    auditor = Auditor().attach(c.log)
    c.write(c.alloc_device(32), node_id=1)  # never polled
    auditor.finish()  # logs incomplete_operation after the last event
    store.close()
    code, text, _ = cli("inspect", str(tmp_path / "log"), "--timeline", "--json")
    assert code == 0
    lines = json.loads(text)["timeline"]
    assert lines[-1]["type"] == "AuditViolation" and lines[-1]["text"] == "VIOLATION incomplete_operation */*"
    assert lines[-1]["seq"] == -1
    # at the log's last event (the second stream record), not at the time the live auditor logged it
    assert lines[-2]["type"] == "StreamRecorded" and lines[-1]["t_ms"] == lines[-2]["t_ms"]
    assert [ln["type"] for ln in lines].count("AuditViolation") == 1
