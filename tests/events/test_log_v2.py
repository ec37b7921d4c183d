"""The committed log of the current format version (2) replays, and its order is the one
every reader wants: each verdict right before the event that revealed it.

``tests/data/logs/v2/`` is ``hicache-obs demo --steps 30 --fault unrecorded-pool-indices``
written with the live auditor as a stage of the log. Its ``audit --json``, ``inspect
--json`` and ``export`` outputs are pinned under ``tests/data/logs/golden/v2/``
(``HICACHE_REGENERATE_GOLDENS=1`` rewrites them).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import msgspec
from goldens import FIXTURE_V2, REPO, check_fixture_outputs

from hicache_obs.events import AuditViolation
from hicache_obs.events._audit import audit, audited
from hicache_obs.events._replay import read_segments, replay
from hicache_obs.events._schema import LOG_FORMAT_VERSION, READABLE_VERSIONS, TransferCompleted
from hicache_obs.exporters._structlog_sink import StructlogSink

SEGMENT = REPO / FIXTURE_V2 / "events-0-00000.jsonl"


def test_the_fixture_is_version_2_which_stays_readable() -> None:
    # versions 3 and 4 are version 2 with more event types (IndicesFreed; IndicesMisplaced and
    # FreeRefused): every version 2 log is one
    assert LOG_FORMAT_VERSION == 5 and READABLE_VERSIONS == (1, 2, 3, 4, 5)
    header = json.loads(SEGMENT.read_bytes().split(b"\n", 1)[0])
    assert header == {"format": "hicache-obs/events", "version": 2, "rank": 0, "segment": 0}
    assert replay(REPO / FIXTURE_V2).versions == {str(SEGMENT): 2}


def test_current_version_fixture_replays(cli, tmp_path: Path) -> None:
    found, _ = check_fixture_outputs(cli, 2, tmp_path)
    assert found["events"] == 807 and found["torn_lines"] == []
    assert {v["rule"] for v in found["violations"]} == {"unrecorded_index"}


def _no_seq(ev: object) -> dict[str, object]:
    d = msgspec.structs.asdict(ev)  # type: ignore[arg-type]
    d.pop("seq")
    return {"type": type(ev).__name__, **d}


def test_its_verdicts_are_where_audited_puts_them_and_name_the_seqs_logged() -> None:
    events = read_segments([SEGMENT]).events
    logged = [e for e in events if type(e) is AuditViolation]
    assert len(logged) == 50
    # the offline stream of the log is the log itself (seqs aside: audited() gives a verdict
    # the revealing event's seq; the live log spent a seq of its own on it)
    assert [_no_seq(e) for e in audited(events)] == [_no_seq(e) for e in events]
    # each unrecorded_index verdict comes before its op's completion, with its time
    by_seq = {e.seq: e for e in events}
    for f in audit(events):
        revealing = by_seq[f.seq]
        assert type(revealing) is TransferCompleted and revealing.op == f.op
        before = by_seq[f.seq - 1]
        assert type(before) is AuditViolation and before.op == f.op and before.ts_ns == revealing.ts_ns


def _lines(events: list) -> str:
    buf = io.StringIO()
    sink = StructlogSink(file=buf)
    for i in range(0, len(events), 7):
        sink.handle_batch(events[i : i + 7])
    sink.close()
    return buf.getvalue()


def test_a_live_sink_reads_it_as_stored() -> None:
    events = read_segments([SEGMENT]).events
    lines = _lines(events)
    assert lines == _lines(list(audited(events)))
    ops = [json.loads(x) for x in lines.splitlines() if '"hicache.transfer_completed"' in x]
    assert sum(o["unrecorded_indices"] for o in ops) == 50
