"""Logs of every readable format version replay; the committed v1 log gives the golden outputs.

``tests/data/logs/v1/`` is a log written before segments had a header (format version 1):
``hicache-obs demo --steps 40 --fault unrecorded-pool-indices``. Its ``audit --json``,
``inspect --json`` and ``export`` outputs are pinned under ``tests/data/logs/golden/v1/``
(regenerate with ``HICACHE_REGENERATE_GOLDENS=1``, see ``tests/exporters/test_golden.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from goldens import FIXTURE, REPO, check_fixture_outputs

from hicache_obs.errors import LogFormatError, UnsupportedLogVersionError
from hicache_obs.events._replay import TornLine, read_file, read_segments, replay
from hicache_obs.events._schema import LOG_FORMAT
from hicache_obs.events._store import JsonlStore, segment_header

V1 = FIXTURE


def test_v1_fixture_replays(cli, tmp_path: Path) -> None:
    audit, inspected = check_fixture_outputs(cli, 1, tmp_path)
    assert audit["events"] == 1166 and audit["torn_lines"] == []
    assert {v["rule"] for v in audit["violations"]} == {"unrecorded_index"}
    assert len(inspected["ops"]) == 39


# ------------------------------------------------------------------ the reader
def _fixture_lines() -> list[bytes]:
    return (REPO / V1 / "events-0-00000.jsonl").read_bytes().splitlines(keepends=True)


def _header(**fields: object) -> bytes:
    doc: dict[str, object] = {"format": LOG_FORMAT, "version": 1, "rank": 0, "segment": 0}
    doc.update(fields)
    return json.dumps({k: v for k, v in doc.items() if v is not _DROP}, separators=(",", ":")).encode() + b"\n"


_DROP = object()


def _segment(folder: Path, data: bytes, name: str = "events-0-00000.jsonl") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(data)
    return path


def test_a_log_without_header_is_version_1_and_with_one_reads_the_same(tmp_path: Path) -> None:
    plain = replay(REPO / V1, audit=True)
    assert plain.versions == {str(REPO / V1 / "events-0-00000.jsonl"): 1}
    path = _segment(tmp_path / "v1h", _header() + b"".join(_fixture_lines()))
    for keep in (True, False):
        headed = replay(path.parent, audit=True, keep_events=keep)
        assert headed.versions == {str(path): 1}
        assert headed.n_events == 1166 and headed.torn_lines == []
        assert headed.findings == plain.findings
        assert headed.state.snapshot() == plain.state.snapshot()
    assert read_segments([path]).events == plain.events


def _refused(err: str, path: Path) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one line
    assert f"{path}: log format version 99 is newer than this hicache-obs (reads versions 1-5)" in err, err


def test_a_newer_version_is_refused_with_exit_2_naming_file_and_versions(cli, tmp_path: Path) -> None:
    path = _segment(tmp_path / "v99", _header(version=99) + b"".join(_fixture_lines()))
    for argv in (("audit", "--json"), ("inspect",), ("export", "--chrome-trace", str(tmp_path / "t.json"))):
        code, out, err = cli(argv[0], str(path.parent), *argv[1:])
        assert (code, out) == (2, ""), (argv, err)
        _refused(err, path)
    assert not (tmp_path / "t.json").exists()
    for keep in (True, False):
        with pytest.raises(UnsupportedLogVersionError) as info:
            replay(path.parent, audit=True, keep_events=keep)
        assert isinstance(info.value, LogFormatError)
        # a message about the file, not a line of it: no line number, as the message has none
        assert (info.value.file, info.value.line, info.value.version) == (str(path), None, 99)
    # the console script's own exit status
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_obs", "audit", str(path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2 and proc.stdout == ""
    _refused(proc.stderr, path)


def test_a_newer_later_segment_is_refused_too(tmp_path: Path) -> None:
    lines = _fixture_lines()
    _segment(tmp_path, b"".join(lines[:500]))  # version 1, no header
    second = _segment(tmp_path, _header(version=6, segment=1) + b"".join(lines[500:]), "events-0-00001.jsonl")
    for keep in (True, False):
        with pytest.raises(UnsupportedLogVersionError, match=f"{second}: log format version 6 is newer"):
            replay(tmp_path, keep_events=keep)


def test_a_header_only_segment_is_an_empty_log(cli, tmp_path: Path) -> None:
    path = _segment(tmp_path / "h", _header())
    assert read_file(path) == ([], None)
    res = replay(path)
    assert res.events == [] and res.torn_lines == [] and res.versions == {str(path): 1}
    empty = _segment(tmp_path / "e", b"")
    assert [cli("audit", str(p), "--json")[0] for p in (path, empty)] == [0, 0]
    # a store stopped right after opening a segment: the segments before it are the log
    lines = _fixture_lines()
    _segment(tmp_path / "r", _header() + b"".join(lines))
    _segment(tmp_path / "r", _header(segment=1), "events-0-00001.jsonl")
    assert replay(tmp_path / "r", keep_events=False).n_events == 1166


def test_a_torn_header_is_a_torn_last_line(cli, tmp_path: Path) -> None:
    path = _segment(tmp_path / "t", _header()[:30])
    assert read_file(path) == ([], TornLine(str(path), 1))
    for keep in (True, False):
        res = replay(path, keep_events=keep)
        assert res.n_events == 0 and res.torn_lines == [TornLine(str(path), 1)]
    code, _, err = cli("audit", str(path))
    assert code == 0 and f"{path}:1: torn last line skipped" in err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"format": "hicache-obs/metrics"}, "format \"hicache-obs/metrics\" is not 'hicache-obs/events'"),
        ({"format": 1}, "format 1 is not 'hicache-obs/events'"),
        ({"version": "1"}, 'version "1" is not an integer >= 1'),
        ({"version": 1.0}, "version 1.0 is not an integer >= 1"),
        ({"version": True}, "version true is not an integer >= 1"),
        ({"version": 0}, "version 0 is not an integer >= 1"),
        ({"version": None}, "version null is not an integer >= 1"),
        ({"version": _DROP}, "no 'version' field"),
        ({"rank": "0"}, 'rank "0" is not an integer >= 0'),
        ({"rank": -1}, "rank -1 is not an integer >= 0"),
        ({"rank": _DROP}, "no 'rank' field"),
        ({"segment": [0]}, "segment [0] is not an integer >= 0"),
        ({"segment": _DROP}, "no 'segment' field"),
    ],
)
def test_a_malformed_header_names_the_field_and_value(
    cli, tmp_path: Path, fields: dict[str, object], message: str
) -> None:
    path = _segment(tmp_path / "m", _header(**fields) + b"".join(_fixture_lines()[:10]))
    for keep in (True, False):
        with pytest.raises(LogFormatError) as info:
            replay(path, keep_events=keep)
        assert type(info.value) is LogFormatError
        assert str(info.value) == f"{path}:1: segment header: {message}"
        assert (info.value.file, info.value.line) == (str(path), 1)
    code, _, err = cli("audit", str(path))
    assert code == 2 and f"{path}:1: segment header: {message}" in err


def test_line_numbers_in_errors_count_the_header(tmp_path: Path) -> None:
    lines = _fixture_lines()
    broken = [*lines[:2], b'{"type":"SlotsFreed","seq":2}\n', *lines[3:]]
    plain = _segment(tmp_path / "plain", b"".join(broken))
    headed = _segment(tmp_path / "headed", _header() + b"".join(broken))
    for path, line in ((plain, 3), (headed, 4)):
        for keep in (True, False):
            with pytest.raises(LogFormatError) as info:
                replay(path, keep_events=keep)
            assert str(info.value).startswith(f"{path}:{line}: ") and info.value.line == line
    # a header anywhere but line 1 (two segments joined into one file) is named as such
    joined = _segment(tmp_path / "joined", _header() + b"".join(lines[:5]) + _header(segment=1) + b"".join(lines[5:]))
    with pytest.raises(LogFormatError, match=rf"{joined}:7: a segment header, which is only read as line 1"):
        replay(joined)


# ------------------------------------------------------------------ the writer
def _segments(folder: Path) -> list[tuple[int, int, bytes, list[bytes]]]:
    """(rank, n, header line, event lines) of every segment in ``folder``, by name."""
    out = []
    for p in sorted(folder.glob("events-*.jsonl")):
        _, rank, n = p.stem.split("-")
        header, *events = p.read_bytes().splitlines(keepends=True)
        out.append((int(rank), int(n), header, events))
    return out


@pytest.mark.parametrize("max_bytes", [16 << 10, 100])  # several events a segment; one (each is larger)
def test_every_segment_a_store_writes_starts_with_its_header(tmp_path: Path, max_bytes: int) -> None:
    events = read_segments([REPO / V1]).events
    for rank in (0, 3):
        store = JsonlStore(tmp_path / f"r{rank}", rank=rank, max_bytes=max_bytes)
        store.handle_batch([msgspec.structs.replace(e, rank=rank) for e in events[:300]])
        store.close()
        segs = _segments(tmp_path / f"r{rank}")
        assert len(segs) > 3 and [s[1] for s in segs] == list(range(len(segs)))
        for r, n, header, lines in segs:
            assert r == rank and header == segment_header(rank, n)
            assert json.loads(header) == {"format": "hicache-obs/events", "version": 5, "rank": rank, "segment": n}
            assert lines, "no segment is a header alone"
            if max_bytes == 100:
                assert len(lines) == 1
            else:
                assert len(header) + sum(map(len, lines)) <= max_bytes
        assert sum(len(s[3]) for s in segs) == 300 and store.events_written == 300
        assert store.bytes_written == sum(p.stat().st_size for p in store.paths)
        res = replay(tmp_path / f"r{rank}")
        assert [e.seq for e in res.events] == list(range(300)) and set(res.versions.values()) == {5}
    # a second store in the folder goes on numbering: its first header names its own segment
    again = JsonlStore(tmp_path / "r0", max_bytes=max_bytes)
    again.handle_batch(events[:1])
    again.close()
    assert again.paths[0].read_bytes().splitlines(keepends=True)[0] == segment_header(0, len(segs))


def test_a_segment_is_readable_while_written(tmp_path: Path) -> None:
    events = read_segments([REPO / V1]).events
    store = JsonlStore(tmp_path)
    try:
        store.handle_batch(events[:100])
        (path,) = store.paths
        assert path.read_bytes().startswith(segment_header(0, 0))
        assert [e.seq for e in replay(tmp_path).events] == list(range(100))
        store.handle_batch(events[100:250])
        assert replay(tmp_path, keep_events=False).n_events == 250
    finally:
        store.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_header_that_cannot_be_written_loses_only_that_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = read_segments([REPO / V1]).events
    store = JsonlStore(tmp_path, max_bytes=2048)
    store.handle_batch(events[:5])
    real_open = os.open
    full = [True]

    def open_full(path: object, flags: int, mode: int = 0o777) -> int:
        if full[0] and str(path).endswith(".jsonl"):
            full[0] = False
            real_open(path, flags, mode)  # the file is made, as by a real open, then the disk is full
            return real_open("/dev/full", os.O_WRONLY)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", open_full)
    with pytest.raises(OSError, match="No space left"):
        store.handle_batch(events[5:40])  # rotates into a segment whose header fails
    monkeypatch.undo()
    assert store.write_errors == 1 and 0 < store.events_lost < 35
    store.close()
    # the segment whose header failed is left empty; what was written before it reads back
    assert len(store.paths) >= 2 and store.paths[-1].read_bytes() == b""
    res = replay(tmp_path)
    assert [e.seq for e in res.events] == list(range(40 - store.events_lost)) and res.torn_lines == []


def test_the_sink_host_childs_store_writes_headers(tmp_path: Path) -> None:
    from event_workloads import run_workload

    from hicache_obs.core import ModelSpec
    from hicache_obs.events import EventLog
    from hicache_obs.exporters.sinkhost import add_sink_host
    from hicache_obs.testing import make_controller

    log = EventLog(rank=2)
    add_sink_host(log, [{"sink": "jsonl", "dir": str(tmp_path), "rank": 2, "max_bytes": 4096}])
    c = make_controller(ModelSpec.tiny(), log=log, device_size=512)
    run_workload(c, rounds=4)
    c.close()
    log.close()
    segs = _segments(tmp_path)
    assert len(segs) > 1
    assert [s[2] for s in segs] == [segment_header(2, n) for _, n, _, _ in segs]
    assert replay(tmp_path).events == log.events()
