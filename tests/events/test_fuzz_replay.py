"""Hostile logs: the reader gives a clear error or a reported skip, never anything else."""

from __future__ import annotations

import re
import tracemalloc
from pathlib import Path

import pytest
from event_workloads import run_workload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hicache_obs.events._replay as replay_mod
from hicache_obs.core import ModelSpec
from hicache_obs.errors import LogFormatError, SequenceError
from hicache_obs.events import Event, EventLog
from hicache_obs.events._audit import audit
from hicache_obs.events._replay import MAX_LINE_BYTES, read_file, replay
from hicache_obs.events._store import open_store
from hicache_obs.testing import make_controller

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def valid_log(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    d = tmp_path_factory.mktemp("valid")
    log = EventLog()
    runner = open_store(log, d, max_bytes=1 << 30)
    c = make_controller(ModelSpec.tiny_hybrid(), log=log, device_size=512)
    run_workload(c, rounds=2)
    c.close()
    log.close()
    return runner.sink.paths[0].read_bytes()


def _read(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "events-0-00000.jsonl"
    path.write_bytes(data)
    try:
        res = replay(path)
    except (LogFormatError, SequenceError) as exc:
        msg = str(exc)
        assert msg and "\n" not in msg
        if isinstance(exc, LogFormatError) and exc.line is not None:
            assert msg.startswith(f"{path}:{exc.line}: ")
        return
    assert all(isinstance(e, Event) for e in res.events)
    audit(res.events)  # the auditor copes with whatever validated


@FUZZ
@given(data=st.binary(max_size=2048))
def test_arbitrary_bytes(tmp_path: Path, data: bytes) -> None:
    _read(tmp_path, data)


@FUZZ
@given(cut=st.integers(min_value=0), flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 7)), max_size=4))
def test_truncated_and_bit_flipped_logs(tmp_path: Path, valid_log: bytes, cut: int, flips: list[tuple[int, int]]) -> None:
    data = bytearray(valid_log[: cut % (len(valid_log) + 1)])
    for pos, bit in flips:
        if data:
            data[pos % len(data)] ^= 1 << bit
    _read(tmp_path, bytes(data))


_JUNK = st.one_of(
    st.just(b'"x"'),
    st.just(b"null"),
    st.just(b"99999999999999999999999999999"),
    st.just(b"-1e999"),
    st.just(b"[" * 5000 + b"]" * 5000),
    st.just(b'{"a":' * 3000 + b"1" + b"}" * 3000),
    st.just(b'"\xff\xfe\xc3\x28"'),
    st.just(b"[[0, -5]]"),
    st.just(b"true"),
)


@FUZZ
@given(line_no=st.integers(min_value=0), junk=_JUNK, data=st.data())
def test_wrong_types_huge_numbers_deep_nesting_bad_utf8(tmp_path: Path, valid_log: bytes, line_no: int, junk: bytes, data) -> None:
    lines = valid_log.splitlines(keepends=True)
    i = line_no % len(lines)
    fields = re.findall(rb'"([a-z_]+)":', lines[i])
    field = data.draw(st.sampled_from(fields))
    lines[i] = re.sub(rb'("' + field + rb'":)(\[[^\]]*\]|"[^"]*"|[^,}]*)', lambda m: m.group(1) + junk, lines[i], count=1)
    _read(tmp_path, b"".join(lines))


def test_a_100_mb_single_line_is_rejected_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    block = b"7" * (1 << 20)
    with open(path, "wb") as fh:
        fh.write(b'{"type":"SlotsFreed","seq":0,"ts_ns":1,"pool":"')
        for _ in range(100):
            fh.write(block)
        fh.write(b'","tier":"host","indices":[]}\n')
    assert path.stat().st_size > 100 << 20
    tracemalloc.start()
    try:
        with pytest.raises(LogFormatError, match=rf"huge.jsonl:1: line longer than {MAX_LINE_BYTES} bytes"):
            read_file(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # bounded by a chunk plus the line limit (a few copies), far below the 100 MiB line
    assert peak < 80 << 20, f"reading used {peak >> 20} MiB"


def test_a_100_mb_torn_last_line_is_reported_not_decoded(tmp_path: Path, valid_log: bytes) -> None:
    path = tmp_path / "events-0-00000.jsonl"
    with open(path, "wb") as fh:
        fh.write(valid_log)
        fh.write(b'{"type":"SlotsFreed"' + b" " * (100 << 20))
    events, torn = read_file(path)
    assert torn is not None and torn.line == valid_log.count(b"\n") + 1
    assert len(events) == valid_log.count(b"\n") - 1  # every line but the header is an event


def test_the_read_path_has_no_pickle_or_eval() -> None:
    import hicache_obs.events._schema as schema_mod
    import hicache_obs.events._store as store_mod

    for mod in (replay_mod, store_mod, schema_mod):
        src = Path(mod.__file__).read_text()
        for bad in ("pickle", "eval(", "exec(", "marshal", "yaml.load"):
            assert bad not in src, f"{bad} in {mod.__name__}"
