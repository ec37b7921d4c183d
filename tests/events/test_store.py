"""Durable JSONL store and replay: round trips, rotation, torn lines, corruption, ranks."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from event_workloads import run_workload

from hicache_obs.core import ModelSpec
from hicache_obs.errors import LogFormatError, SequenceError
from hicache_obs.events import EventLog, TransferCompleted
from hicache_obs.events._replay import read_file, replay
from hicache_obs.events._store import JsonlStore, open_store
from hicache_obs.testing import make_controller

SPECS = [ModelSpec.tiny(), ModelSpec.tiny_hybrid()]


def _store_workload(tmp_path: Path, spec: ModelSpec, max_bytes: int = 4096, rank: int = 0, rounds: int = 8):
    log = EventLog(rank=rank)
    runner = open_store(log, tmp_path, max_bytes=max_bytes)
    c = make_controller(spec, log=log, device_size=512)
    run_workload(c, rounds=rounds)
    c.close()
    log.close()
    return c, runner


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_round_trip_across_rotation(tmp_path: Path, spec: ModelSpec) -> None:
    c, runner = _store_workload(tmp_path, spec)
    paths = runner.sink.paths
    assert len(paths) > 3, "the workload must cross several rotation boundaries"
    for p in paths:
        assert p.stat().st_size <= 4096
    res = replay(tmp_path)
    assert res.events == c.log.events()
    assert res.state.snapshot() == c.state.snapshot()
    assert res.torn_lines == []
    assert runner.stats()["dropped"] == 0
    # line 1 is the segment header; every other line a JSON object whose first key is the type tag
    header, first = paths[0].read_bytes().splitlines()[:2]
    assert json.loads(header) == {"format": "hicache-obs/events", "version": 5, "rank": 0, "segment": 0}
    obj = json.loads(first)
    assert next(iter(obj)) == "type"
    assert obj["type"] == "PoolCreated"


def test_files_are_private_and_not_world_writable(tmp_path: Path) -> None:
    _, runner = _store_workload(tmp_path, ModelSpec.tiny(), rounds=1)
    for p in runner.sink.paths:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode & 0o077 == 0, oct(mode)


def test_a_second_store_never_overwrites_earlier_segments(tmp_path: Path) -> None:
    _, r1 = _store_workload(tmp_path, ModelSpec.tiny(), rounds=1)
    before = {p: p.read_bytes() for p in r1.sink.paths}
    store = JsonlStore(tmp_path)
    store.handle_batch(EventLog().events())
    store.close()
    for p, data in before.items():
        assert p.read_bytes() == data


def test_readable_by_another_process_while_written(tmp_path: Path) -> None:
    log = EventLog()
    runner = open_store(log, tmp_path)
    c = make_controller(ModelSpec.tiny(), log=log, device_size=512)
    run_workload(c, rounds=3)
    log.flush()
    n_live = len(log)
    code = (
        "import sys; from hicache_obs.events._replay import replay; "
        "r = replay(sys.argv[1]); print(len(r.events))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert int(out.stdout) == n_live
    run_workload(c, rounds=1)
    c.close()
    log.close()
    assert len(replay(tmp_path).events) == len(log) > n_live
    assert runner.stats()["dropped"] == 0


def test_torn_last_line_is_reported_and_skipped(tmp_path: Path) -> None:
    c, runner = _store_workload(tmp_path, ModelSpec.tiny(), max_bytes=1 << 30, rounds=2)
    (path,) = runner.sink.paths
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    res = replay(tmp_path)
    assert [(t.file, t.line) for t in res.torn_lines] == [(str(path), len(lines))]
    assert res.events == c.log.events()[:-1]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda ls: ls.__setitem__(3, b'{"type": "SlotsFreed", "seq": "x"}\n'), "Expected `int`, got `str`"),
        (lambda ls: ls.__setitem__(3, b"\xff\xfe garbage\n"), "line 4|:4:"),
        (lambda ls: ls.__setitem__(3, b'{"type": "NoSuchEvent", "seq": 3, "ts_ns": 1}\n'), "Invalid value 'NoSuchEvent'"),
        (lambda ls: ls.__setitem__(3, b"\n"), "empty line"),
        (lambda ls: ls.__setitem__(3, ls[3][:20] + b"\n"), ":4:"),
    ],
    ids=["wrong-type", "binary", "unknown-type", "empty-line", "truncated-middle"],
)
def test_corruption_before_the_end_names_file_and_line(tmp_path: Path, mutate, message: str) -> None:
    _, runner = _store_workload(tmp_path, ModelSpec.tiny(), max_bytes=1 << 30, rounds=2)
    (path,) = runner.sink.paths
    lines = path.read_bytes().splitlines(keepends=True)
    mutate(lines)
    path.write_bytes(b"".join(lines))
    with pytest.raises(LogFormatError) as info:
        replay(tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:4: ")
    assert info.value.file == str(path) and info.value.line == 4
    import re

    assert re.search(message, msg), msg


def test_sequence_gap_and_duplicate_are_named(tmp_path: Path) -> None:
    _, runner = _store_workload(tmp_path, ModelSpec.tiny(), max_bytes=1 << 30, rounds=2)
    (path,) = runner.sink.paths
    lines = path.read_bytes().splitlines(keepends=True)[1:]  # the events, without the header
    gap = tmp_path / "gap"
    gap.mkdir()
    (gap / "events-0-00000.jsonl").write_bytes(b"".join(lines[:5] + lines[6:]))
    with pytest.raises(SequenceError, match=r"sequence gap: seq 4 .* is followed by seq 6"):
        replay(gap)
    dup = tmp_path / "dup"
    dup.mkdir()
    (dup / "events-0-00000.jsonl").write_bytes(b"".join(lines[:6] + lines[5:]))
    with pytest.raises(SequenceError, match="duplicate seq 5"):
        replay(dup)
    late = tmp_path / "late"
    late.mkdir()
    (late / "events-0-00000.jsonl").write_bytes(b"".join(lines[2:]))
    with pytest.raises(SequenceError, match="starts at seq 2"):
        replay(late)


def test_segments_given_out_of_order_or_mixed_replay_the_same(tmp_path: Path) -> None:
    """Segments in order take the joined fast path; any other arrangement is sorted, to the same result."""
    c, runner = _store_workload(tmp_path / "log", ModelSpec.tiny_hybrid())
    paths = runner.sink.paths
    assert len(paths) > 3
    in_order = replay(paths)
    assert in_order.events == c.log.events()
    assert replay(list(reversed(paths))).events == in_order.events
    # one file with the lines of two segments swapped, and rank 1's copy interleaved
    mixed = tmp_path / "mixed.jsonl"
    lines = [ln for p in paths for ln in p.read_bytes().splitlines(keepends=True)[1:]]  # events, no headers
    half = len(lines) // 2
    dec, enc = msgspec.json.Decoder(), msgspec.json.Encoder()
    other = []
    for ln in lines:
        obj = dec.decode(ln)
        obj["rank"] = 1
        other.append(enc.encode(obj) + b"\n")
    mixed.write_bytes(b"".join(x for pair in zip(lines[half:] + lines[:half], other) for x in pair))
    res = replay(mixed)
    assert res.ranks == [0, 1]
    assert [e for e in res.events if e.rank == 0] == in_order.events
    assert res.states[0].snapshot() == res.states[1].snapshot() == c.state.snapshot()
    with pytest.raises(SequenceError, match="starts at seq"):  # a rank's first segment missing
        replay(paths[1:])


def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(LogFormatError, match="no such file"):
        replay(tmp_path / "nope.jsonl")
    with pytest.raises(LogFormatError, match="holds no events"):
        replay(tmp_path)


def test_empty_file_reads_as_no_events(tmp_path: Path) -> None:
    p = tmp_path / "empty.jsonl"
    p.write_bytes(b"")
    assert read_file(p) == ([], None)
    assert replay(p).events == []


def test_two_ranks_replay_into_one_ordered_history(tmp_path: Path) -> None:
    c0, _ = _store_workload(tmp_path / "r0", ModelSpec.tiny_hybrid(), rank=0, rounds=3)
    c1, _ = _store_workload(tmp_path / "r1", ModelSpec.tiny_hybrid(), rank=1, rounds=3)
    # interleave the times of the two ranks: rank 1 ran "during" rank 0
    src = sorted((tmp_path / "r1").glob("*.jsonl"))
    t0 = c0.log.events()[0].ts_ns
    span = c0.log.events()[-1].ts_ns - t0
    dec = msgspec.json.Decoder()
    for p in src:
        out = []
        for line in p.read_bytes().splitlines():
            obj = dec.decode(line)
            if "format" in obj:  # the segment header
                out.append(line + b"\n")
                continue
            obj["ts_ns"] = t0 + (obj["seq"] * span) // len(c1.log) + 1
            out.append(msgspec.json.encode(obj) + b"\n")
        p.write_bytes(b"".join(out))
    res = replay([tmp_path / "r0", tmp_path / "r1"])
    assert res.ranks == [0, 1]
    assert len(res.events) == len(c0.log) + len(c1.log)
    ts = [e.ts_ns for e in res.events]
    assert ts == sorted(ts)
    ranks = [e.rank for e in res.events]
    assert ranks != sorted(ranks), "the ranks must interleave"
    for r, c in ((0, c0), (1, c1)):
        assert [e.seq for e in res.events if e.rank == r] == list(range(len(c.log)))
        assert res.states[r].snapshot() == c.state.snapshot()
    assert sum(isinstance(e, TransferCompleted) for e in res.events) == 12


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_is_counted_and_earlier_events_survive(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = EventLog()
    runner = open_store(log, tmp_path, max_bytes=1 << 30)
    c = make_controller(ModelSpec.tiny(), log=log, device_size=512)
    run_workload(c, rounds=2)
    log.flush()
    written = len(log)
    store = runner.sink
    # the disk fills up under the store: every later write fails with ENOSPC
    os.close(store._fd)
    store._fd = os.open("/dev/full", os.O_WRONLY)
    run_workload(c, rounds=1)  # the controller keeps serving
    log.flush()
    c.close()
    log.close()
    st = runner.stats()
    assert st["errors"] >= 1
    assert st["dropped"] == len(log) - written
    assert store.events_lost == len(log) - written
    assert replay(store.paths[0]).events == log.events()[:written]
    assert "No space left on device" in caplog.text
