"""``replay(..., keep_events=False)``: a log folded block by block as it is read, keeping
no event, gives the states, findings (in the same order), torn lines and errors of the
replay that reads it whole."""

from __future__ import annotations

from pathlib import Path

import pytest
from event_workloads import run_workload

from hicache_obs.core import PoolTransfer
from hicache_obs.errors import LogFormatError, SequenceError
from hicache_obs.events import EventLog
from hicache_obs.events import _replay as rp
from hicache_obs.events._store import JsonlStore
from hicache_obs.testing import make_controller

FAULTS = [None, "unrecorded-pool-indices", "use-after-free", "double-free"]


def _write_rank(folder: Path, rank: int, fault: str | None, *, max_bytes: int = 4096) -> int:
    log = EventLog(rank=rank)
    c = make_controller(fault=fault, device_size=512, log=log, io_backend="kernel")
    run_workload(c, rounds=3)
    if fault in ("use-after-free", "double-free"):
        kv = c.alloc_device(32)
        host, _ = c.write(kv, node_id=50, pool_transfers=[PoolTransfer("mamba", device_indices=c.alloc_device(1, pool="mamba"))])
        c.evict_host(host)  # while the write may still read it
        if fault == "double-free":
            c.poll_writes()
            c.evict_host(host)
    kv = c.alloc_device(16)
    c.write(kv, node_id=99, pool_transfers=[PoolTransfer("mamba", device_indices=c.alloc_device(1, pool="mamba"))])
    store = JsonlStore(folder, rank=rank, max_bytes=max_bytes)  # many small segments
    store.handle_batch(log.events())
    store.close()
    return len(log)


def _same(whole: rp.ReplayResult, streamed: rp.ReplayResult) -> None:
    assert streamed.events == [] and streamed.by_rank == {}
    assert streamed.findings == whole.findings  # the same findings, in the same order
    assert {r: s.snapshot() for r, s in streamed.states.items()} == {r: s.snapshot() for r, s in whole.states.items()}
    assert streamed.event_counts == whole.event_counts == {r: len(e) for r, e in whole.by_rank.items()}
    assert (streamed.files, streamed.torn_lines, streamed.ranks) == (whole.files, whole.torn_lines, whole.ranks)
    assert streamed.n_events == whole.n_events == len(whole.events)


@pytest.mark.parametrize("fault", FAULTS)
def test_streamed_replay_equals_the_whole_one(tmp_path: Path, fault: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    for rank in (0, 2, 11):  # "events-11-" sorts before "events-2-": files are not in rank order
        _write_rank(tmp_path, rank, fault)
    assert len(list(tmp_path.glob("*.jsonl"))) > 10
    whole = rp.replay(tmp_path, audit=True)
    plain = rp.replay(tmp_path)
    assert whole.findings is not None and (fault is None or whole.findings)
    assert "incomplete_operation" in {f.rule for f in whole.findings}
    monkeypatch.setattr(rp, "STREAM_BLOCK_BYTES", 1000)  # several blocks per segment
    monkeypatch.setattr(rp, "read_segments", _no_whole_read)  # the streamed path reads no log whole
    _same(whole, rp.replay(tmp_path, audit=True, keep_events=False))
    _same(plain, rp.replay(tmp_path, keep_events=False))


def _no_whole_read(*args: object, **kwargs: object) -> None:
    raise AssertionError("the log was read whole")


def test_a_torn_last_line_is_reported_and_the_rest_folded(tmp_path: Path) -> None:
    _write_rank(tmp_path, 0, None)
    last = sorted(tmp_path.glob("*.jsonl"))[-1]
    data = last.read_bytes()
    last.write_bytes(data[:-7])  # the last line loses its end
    _same(rp.replay(tmp_path, audit=True), rp.replay(tmp_path, audit=True, keep_events=False))
    assert rp.replay(tmp_path, keep_events=False).torn_lines == [rp.TornLine(str(last), data.count(b"\n"))]


def test_segments_out_of_order_fall_back_to_the_sorting_read(tmp_path: Path) -> None:
    _write_rank(tmp_path, 0, None)
    segs = sorted(tmp_path.glob("*.jsonl"))
    first, second = segs[0], segs[1]
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)  # seqs of the second segment come first
    second.write_bytes(a)
    _same(rp.replay(tmp_path, audit=True), rp.replay(tmp_path, audit=True, keep_events=False))


@pytest.mark.parametrize(
    ("damage", "error"),
    [
        ("gap", SequenceError),  # a segment missing in the middle
        ("garbage", LogFormatError),  # a malformed line in the middle
    ],
)
def test_errors_are_the_same_as_the_whole_replays(tmp_path: Path, damage: str, error: type[Exception]) -> None:
    _write_rank(tmp_path, 0, None)
    segs = sorted(tmp_path.glob("*.jsonl"))
    if damage == "gap":
        segs[len(segs) // 2].unlink()
    else:
        lines = segs[2].read_bytes().splitlines(keepends=True)
        lines[1] = b'{"type": "SlotsFreed", "seq": "x"}\n'
        segs[2].write_bytes(b"".join(lines))
    with pytest.raises(error) as whole:
        rp.replay(tmp_path, audit=True)
    with pytest.raises(error) as streamed:
        rp.replay(tmp_path, audit=True, keep_events=False)
    assert str(streamed.value) == str(whole.value)


def test_keep_events_false_for_events_in_memory(tmp_path: Path) -> None:
    log = EventLog()
    run_workload(make_controller(log=log), rounds=2)
    res = rp.replay(log, audit=True, keep_events=False)
    assert res.events == [] and res.event_counts == {0: len(log)} and res.findings == []
    assert res.state.snapshot() == rp.replay(log).state.snapshot()
