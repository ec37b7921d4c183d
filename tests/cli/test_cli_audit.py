"""``hicache-obs audit``: exit codes, the ``--json`` document, unreadable and torn input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from hicache_obs.events._audit import audit
from hicache_obs.events._replay import replay

JSON_KEYS = {"files", "events", "torn_lines", "violations"}
VIOLATION_KEYS = {"rule", "pool", "role", "op", "rank", "detail"}


def _one_line_error(err: str) -> None:
    assert err.startswith("hicache-obs: error: ")
    assert err.count("\n") == 1
    assert "Traceback" not in err


def test_clean_log_exits_0(cli: Any, clean_demo: tuple[dict[str, Any], Path]) -> None:
    s, out = clean_demo
    code, text, err = cli("audit", str(out))
    assert code == 0, err
    assert "no violations" in text and f"{s['events']} events" in text
    code, text, _ = cli("audit", str(out), "--json")
    assert code == 0
    doc = json.loads(text)
    assert set(doc) == JSON_KEYS
    assert doc["files"] == [str(out / "events-0-00000.jsonl")]
    assert doc["events"] == s["events"]
    assert doc["torn_lines"] == [] and doc["violations"] == []


def test_faulty_log_exits_1_with_grouped_findings(cli: Any, faulty_demo: tuple[dict[str, Any], Path]) -> None:
    s, out = faulty_demo
    code, text, _ = cli("audit", str(out), "--json")
    assert code == 1
    doc = json.loads(text)
    assert doc["violations"]
    assert all(set(v) == VIOLATION_KEYS for v in doc["violations"])
    assert {(v["rule"], v["pool"]) for v in doc["violations"]} == {("unrecorded_index", "mamba")}
    # recomputed from the other events: the live AuditViolation events are not counted twice
    assert len(doc["violations"]) == sum(s["violations"]["unrecorded_index"].values())
    code, text, _ = cli("audit", str(out))
    assert code == 1
    assert "unrecorded_index pool mamba" in text and "ops " in text
    code, verbose, _ = cli("audit", str(out), "-v")
    assert code == 1 and verbose.count("record_stream") >= len(doc["violations"])


def test_torn_last_line_is_a_warning(cli: Any, tmp_path: Path, faulty_demo: tuple[dict[str, Any], Path]) -> None:
    src = faulty_demo[1] / "events-0-00000.jsonl"
    data = src.read_bytes()
    lines = data.count(b"\n")
    torn = tmp_path / "events-0-00000.jsonl"
    torn.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 1] + data[-40:-20])  # half a last line
    expected = 1 if audit(replay(tmp_path).events) else 0
    code, text, err = cli("audit", str(tmp_path), "--json")
    assert code == expected
    doc = json.loads(text)
    assert doc["torn_lines"] == [{"file": str(torn), "line": lines}]
    assert doc["events"] == lines - 2  # neither the header nor the torn line
    assert f"{torn}:{lines}: torn last line skipped" in err and "Traceback" not in err


def test_torn_clean_log_follows_its_findings(cli: Any, tmp_path: Path, clean_demo: tuple[dict[str, Any], Path]) -> None:
    data = (clean_demo[1] / "events-0-00000.jsonl").read_bytes()
    (tmp_path / "events-0-00000.jsonl").write_bytes(data[:-5])  # the last line loses its end
    code, text, _ = cli("audit", str(tmp_path), "--json")
    doc = json.loads(text)
    assert len(doc["torn_lines"]) == 1
    assert code == (1 if doc["violations"] else 0)
    assert all(v["rule"] == "incomplete_operation" for v in doc["violations"])


def test_binary_garbage_exits_2(cli: Any, tmp_path: Path) -> None:
    bad = tmp_path / "garbage.jsonl"
    bad.write_bytes(bytes(range(256)) * 8)  # holds newlines: not just a torn line
    code, text, err = cli("audit", str(bad))
    assert code == 2 and text == ""
    _one_line_error(err)
    assert "garbage.jsonl:1" in err


def test_empty_file_is_a_clean_empty_log(cli: Any, tmp_path: Path) -> None:
    empty = tmp_path / "events.jsonl"
    empty.write_bytes(b"")
    code, text, _ = cli("audit", str(empty), "--json")
    assert code == 0
    assert json.loads(text) == {"files": [str(empty)], "events": 0, "torn_lines": [], "violations": []}
    code, text, _ = cli("audit", str(empty))
    assert code == 0 and "no events" in text


def test_missing_file_and_empty_folder_exit_2(cli: Any, tmp_path: Path) -> None:
    code, text, err = cli("audit", str(tmp_path / "nope.jsonl"))
    assert code == 2 and text == ""
    _one_line_error(err)
    assert "nope.jsonl" in err
    code, _, err = cli("audit", str(tmp_path))
    assert code == 2
    _one_line_error(err)


def test_two_logs_of_the_same_rank_are_rejected(
    cli: Any, tmp_path: Path, clean_demo: tuple[dict[str, Any], Path], faulty_demo: tuple[dict[str, Any], Path]
) -> None:
    code, _, err = cli("audit", str(clean_demo[1]), str(faulty_demo[1]))
    assert code == 2
    _one_line_error(err)
    assert "duplicate seq" in err


def test_several_ranks_are_audited_together(cli: Any, tmp_path: Path, faulty_demo: tuple[dict[str, Any], Path]) -> None:
    import msgspec

    from hicache_obs.events._schema import AnyEvent

    src = faulty_demo[1] / "events-0-00000.jsonl"
    enc = msgspec.json.Encoder()
    dec = msgspec.json.Decoder(AnyEvent)
    rank1 = tmp_path / "events-1-00000.jsonl"
    rank1.write_bytes(
        b"".join(
            enc.encode(msgspec.structs.replace(dec.decode(line), rank=1)) + b"\n"
            for line in src.read_bytes().splitlines()[1:]  # rank 1's copy has no header (version 1)
        )
    )
    shutil.copy(src, tmp_path / src.name)
    code, text, _ = cli("audit", str(tmp_path), "--json")
    assert code == 1
    doc = json.loads(text)
    assert len(doc["files"]) == 2
    assert {v["rank"] for v in doc["violations"]} == {0, 1}
    assert len(doc["violations"]) == 2 * sum(faulty_demo[0]["violations"]["unrecorded_index"].values())
