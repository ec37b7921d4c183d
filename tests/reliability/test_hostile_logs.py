"""Hostile logs: a few hundred bytes that ask for gigabytes, schema-valid logs built to take
quadratic time, and special files named like segments.

- memory: the audit of crafted logs runs in a child process whose peak RSS is measured
  (``ru_maxrss``) against the same child auditing a tiny clean log. The bound the docs
  state: the reader's own footprint, plus one byte per slot of the pools the log
  touches (eleven for the replay's bookkeeping with one-slot pages), plus a little;
  never a Python int per slot. The child runs under a 3 GiB address-space limit, so a
  regression ends in its MemoryError rather than in the machine's memory.
- caps: more than ``MAX_POOLS`` slot tables, more than ``MAX_TOTAL_CAPACITY`` slots, a
  capacity over ``MAX_CAPACITY``: exit 2 and one line naming the value and the cap.
- time: logs that cost O(n) per event before (merges of ops never queued, completions in
  reverse order, of ops on distinct or on the same slots, frees beside many ops in flight) are timed at n and 2n events, side by
  side, median of three: doubling may at most a little more than double the time.
- special files: a FIFO, a symlink to ``/dev/zero``, a folder named like a segment: exit
  2, refused before anything is read (a FIFO used to hang the audit).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from hicache_obs._native import IMPLEMENTATIONS
from hicache_obs.cli import main
from hicache_obs.events._audit import Auditor
from hicache_obs.events._schema import (
    MAX_CAPACITY,
    OperationQueued,
    OperationsMerged,
    PoolCreated,
    SlotsAllocated,
    SlotsFreed,
    TensorRef,
    TransferCompleted,
    TransferSubmitted,
)
from hicache_obs.events._state import MAX_POOLS, MAX_TOTAL_CAPACITY, fold
from hicache_obs.events._store import segment_name

MiB = 1 << 20
_enc = msgspec.json.Encoder()


class _Log:
    """Events of rank 0 with their seqs, written as one segment."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def add(self, cls: type, **fields: Any) -> None:
        self.events.append(cls(seq=len(self.events), ts_ns=1_000 + len(self.events), **fields))

    def write(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / segment_name(0, 0)).write_bytes(b"".join(_enc.encode(e) + b"\n" for e in self.events))
        return folder


def _pool(log: _Log, cap: int, tier: str = "device", pool: str = "kv") -> None:
    log.add(PoolCreated, pool=pool, tier=tier, capacity=cap, page_size=1, slot_bytes=8, layout="layer_first")


# the audit as hicache-obs audit runs it, in a child without the CLI's other imports;
# peak RSS in KiB, the findings, or the error's type and message
_CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from hicache_obs.events._replay import replay
out = {}
try:
    res = replay(sys.argv[1], audit=True, keep_events=False, states=sys.argv[2] == "states")
    out["findings"] = [[f.rule, f.detail] for f in res.findings]
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(out))
"""


def _child_audit(folder: Path, mode: str = "audit") -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), mode], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def baseline_kib(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    log = _Log()
    _pool(log, 64)
    log.add(SlotsAllocated, pool="kv", tier="device", indices=((0, 64),))
    log.add(SlotsFreed, pool="kv", tier="device", indices=((0, 64),))
    folder = log.write(tmp_path_factory.mktemp("tiny"))
    return {mode: _child_audit(folder, mode)["rss_kib"] for mode in ("audit", "states")}


def test_a_free_of_every_slot_of_a_fresh_2_26_pool_is_one_run_in_one_byte_per_slot(tmp_path, baseline_kib) -> None:
    cap = 1 << 26  # a few hundred bytes of log; 2**26 ints were 2.5 GB and more
    log = _Log()
    _pool(log, cap)
    log.add(SlotsFreed, pool="kv", tier="device", indices=((0, cap),))
    out = _child_audit(log.write(tmp_path))
    assert out.get("error") is None
    assert out["findings"] == [
        ["double_free", f"device pool 'kv': slots ((0, {cap}),) freed while already free (free)"]
    ]
    grown = (out["rss_kib"] - baseline_kib["audit"]) * 1024
    assert grown <= cap + 24 * MiB, f"peak RSS grew {grown / MiB:.0f} MiB for a {cap >> 20} Mi-slot pool"


@pytest.mark.skipif(
    IMPLEMENTATIONS["slots"] != "c",
    reason="the compiled slot maps' footprint: the pure twin keeps its freed pages in a dict (about 100 B a page)",
)
def test_two_pools_fully_allocated_and_freed_cost_a_byte_per_slot_audited_eleven_replayed(
    tmp_path, baseline_kib
) -> None:
    log = _Log()
    for tier, cap in (("device", 1 << 25), ("host", 1 << 24)):
        _pool(log, cap, tier)
        log.add(SlotsAllocated, pool="kv", tier=tier, indices=((0, cap),))
        log.add(SlotsFreed, pool="kv", tier=tier, indices=((0, cap),))
        log.add(SlotsFreed, pool="kv", tier=tier, indices=((0, cap),))  # and once more: a double free
    folder = log.write(tmp_path)
    slots = (1 << 25) + (1 << 24)
    out = _child_audit(folder)
    assert [rule for rule, _ in out["findings"]] == ["double_free", "double_free"]
    grown = (out["rss_kib"] - baseline_kib["audit"]) * 1024
    assert grown <= slots + 24 * MiB, f"audit: peak RSS grew {grown / MiB:.0f} MiB for {slots >> 20} Mi slots"
    # the replay's bookkeeping (free-page order, 10 bytes a slot) and its probe copy (1)
    replayed = _child_audit(folder, "states")
    assert replayed["findings"] == out["findings"]
    grown = (replayed["rss_kib"] - baseline_kib["states"]) * 1024
    assert grown <= 11 * slots + 24 * MiB, f"replay: peak RSS grew {grown / MiB:.0f} MiB for {slots >> 20} Mi slots"


# ------------------------------------------------------------------------ caps
def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_more_pools_than_max_pools_is_exit_2_with_one_line(tmp_path, capsys) -> None:
    log = _Log()
    for i in range(MAX_POOLS + 1):
        _pool(log, 1 << 20, pool=f"p{i}")
    code, out, err = _cli(capsys, "audit", str(log.write(tmp_path)))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and f"slot table {MAX_POOLS + 1}; a log may hold at most {MAX_POOLS} (MAX_POOLS)" in err
    assert f"PoolCreated 'p{MAX_POOLS}'/device" in err and f"seq {MAX_POOLS}" in err


def test_the_same_pool_created_again_replaces_its_table_and_counts_once(tmp_path, capsys) -> None:
    log = _Log()
    for _ in range(2 * MAX_POOLS):
        _pool(log, MAX_CAPACITY)
    code, out, err = _cli(capsys, "audit", str(log.write(tmp_path)))
    assert (code, err) == (0, "") and "no violations" in out


def test_pools_beyond_max_total_capacity_are_exit_2_with_one_line(tmp_path, capsys) -> None:
    log = _Log()
    n = MAX_TOTAL_CAPACITY // MAX_CAPACITY + 1
    for i in range(n):
        _pool(log, MAX_CAPACITY, pool=f"p{i}")
    code, out, err = _cli(capsys, "audit", str(log.write(tmp_path)))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"capacity {MAX_CAPACITY} brings the log's pools to {n * MAX_CAPACITY} slots" in err
    assert f"at most {MAX_TOTAL_CAPACITY} (MAX_TOTAL_CAPACITY)" in err


def test_a_capacity_over_max_capacity_is_exit_2_naming_the_line_and_the_cap(tmp_path, capsys) -> None:
    line = _enc.encode(
        PoolCreated(seq=0, ts_ns=1, pool="kv", tier="host", capacity=1, page_size=1, slot_bytes=8, layout="x")
    ).replace(b'"capacity":1', b'"capacity":%d' % (MAX_CAPACITY + 1))
    (tmp_path / segment_name(0, 0)).write_bytes(line + b"\n")
    code, _, err = _cli(capsys, "audit", str(tmp_path))
    assert code == 2 and err.count("\n") == 1
    assert f"{segment_name(0, 0)}:1:" in err and f"<= {MAX_CAPACITY}" in err and "capacity" in err


# --------------------------------------------------------------- special files
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
@pytest.mark.parametrize("given", ["folder", "file"])
def test_a_special_file_named_like_a_segment_is_refused_with_exit_2(tmp_path, capsys, kind, given) -> None:
    good = _Log()
    _pool(good, 8)
    good.write(tmp_path)  # a real segment first: the special one comes second
    special = tmp_path / segment_name(0, 1)
    if kind == "fifo":
        os.mkfifo(special)
    elif kind == "dev-zero":
        special.symlink_to("/dev/zero")
    else:
        special.mkdir()
    code, out, err = _cli(capsys, "audit", str(tmp_path if given == "folder" else special))
    what = {"fifo": "a FIFO", "dev-zero": "a character device", "folder": "a folder"}[kind]
    if kind == "folder" and given == "file":  # a folder given is a folder of segments: it holds none
        assert code == 2 and "folder holds no events*.jsonl segments" in err
        return
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"{special}: not a regular file ({what}); refused" in err


def test_a_symlink_to_a_regular_segment_is_read(tmp_path, capsys) -> None:
    log = _Log()
    _pool(log, 8)
    real = log.write(tmp_path / "real") / segment_name(0, 0)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / segment_name(0, 0)).symlink_to(real)
    code, out, err = _cli(capsys, "audit", str(tmp_path / "logs"))
    assert (code, err) == (0, "") and "1 events from 1 file(s)" in out


# ------------------------------------------------------------------------ time
def _ref(op: int, slot: int, length: int = 1) -> TensorRef:
    return TensorRef(
        pool="kv", role="host", device="cpu", numel=length, dtype="int64", ptr=8, indices=((slot, length),)
    )


def _submitted(log: _Log, op: int, slot: int, length: int = 1) -> None:
    log.add(
        TransferSubmitted,
        op=op,
        direction="d2h",
        stream="hicache-write",
        io_backend="direct",
        layout="layer_first",
        tensors=(_ref(op, slot, length),),
        slots_by_pool=(("kv", length),),
        bytes_by_pool=(("kv", 8 * length),),
        device="cpu",
    )


def _merges_of_unknown_ops(n: int) -> list[Any]:
    log = _Log()
    for op in range(n):
        log.add(OperationQueued, op=op, direction="d2h", node_id=op, priority=0, slots_by_pool=(("kv", 1),))
    for i in range(n):
        log.add(OperationsMerged, op=2 * n + i, merged_ops=(10 * n + i,), direction="d2h")
    for op in reversed(range(n)):  # and the queued ones merged one by one, from the back
        log.add(OperationsMerged, op=op, merged_ops=(op, 10 * n + op), direction="d2h")
    return log.events


def _completions_in_reverse(n: int) -> list[Any]:
    log = _Log()
    _pool(log, 2 * n, "host")
    log.add(SlotsAllocated, pool="kv", tier="host", indices=((0, 2 * n),))
    for op in range(n):
        _submitted(log, op, op)
    for op in reversed(range(n)):
        log.add(TransferCompleted, op=op, direction="d2h", duration_ns=1)
    return log.events


def _overlapping_completions_in_reverse(n: int) -> list[Any]:
    """Every op in flight on the same sixteen slots, completed last first: each completion
    leaves a run start that every other op in flight shares."""
    log = _Log()
    _pool(log, 32, "host")
    log.add(SlotsAllocated, pool="kv", tier="host", indices=((0, 32),))
    for op in range(n):
        _submitted(log, op, 0, 16)
    for op in reversed(range(n)):
        log.add(TransferCompleted, op=op, direction="d2h", duration_ns=1)
    return log.events


def _frees_beside_many_in_flight(n: int) -> list[Any]:
    log = _Log()
    _pool(log, 2 * n, "host")
    log.add(SlotsAllocated, pool="kv", tier="host", indices=((0, 2 * n),))
    for op in range(n):
        _submitted(log, op, op)
    for i in range(n):  # frees of slots no op in flight uses, then of each op's, last first
        log.add(SlotsFreed, pool="kv", tier="host", indices=((n + i, 1),))
    log.add(SlotsAllocated, pool="kv", tier="host", indices=((n, n),))
    for op in reversed(range(n)):
        log.add(SlotsFreed, pool="kv", tier="host", indices=((op, 1),))
    return log.events


def _audit_fold(events: list[Any]) -> None:
    Auditor(fold_state=True).feed(events).finish()


def _audit_live(events: list[Any]) -> None:
    Auditor().feed(events).finish()


def _ratio(build: Any, run: Any, n: int) -> tuple[float, list[float]]:
    """time(2n) / time(n), each the shortest of five runs side by side (a burst of load on a
    shared machine lengthens a run, never shortens one), with the five pairs' ratios; each
    time is of enough repeats to last 50 ms at n (timer and scheduling noise)."""
    small, large = build(n), build(2 * n)
    gc.collect()
    gc.disable()  # the collector's full passes scale with the whole heap (torch's too), not with the log
    try:
        repeats = 1
        while True:
            start = time.perf_counter()
            for _ in range(repeats):
                run(small)
            if time.perf_counter() - start >= 0.05:
                break
            repeats *= 2
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(5):  # side by side, so that a busy machine slows both alike
            for events, took in zip((small, large), times):
                start = time.perf_counter()
                for _ in range(repeats):
                    run(events)
                took.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return min(times[1]) / min(times[0]), [b / a for a, b in zip(*times)]


@pytest.mark.parametrize(
    ("build", "check"),
    [
        (_merges_of_unknown_ops, lambda st, n: not st.queues["d2h"] and len(st.ops) == 2 * n),
        (_completions_in_reverse, lambda st, n: not st.acks["d2h"] and st.completed["d2h"] == n),
        (_overlapping_completions_in_reverse, lambda st, n: not st.acks["d2h"] and st.completed["d2h"] == n),
        (_frees_beside_many_in_flight, lambda st, n: len(st.acks["d2h"]) == n),
    ],
    ids=[
        "merges-of-unknown-ops",
        "completions-in-reverse",
        "overlapping-completions-in-reverse",
        "frees-beside-many-in-flight",
    ],
)
@pytest.mark.parametrize("run", [_audit_fold, _audit_live], ids=["replay-audit", "audit"])
def test_doubling_an_adversarial_log_at_most_a_little_more_than_doubles_its_time(build, check, run) -> None:
    n = 4_000  # O(n) per event before (time(2n) / time(n) 3.4-4.5 at 2,000): 20-50 s for 40k ops
    assert check(fold(build(n)), n)
    ratio, ratios = _ratio(build, run, n)
    assert ratio <= 3.0, f"{build.__name__}: time(2n) / time(n) = {ratio:.2f} (pairs: {ratios})"


def test_the_frees_beside_many_in_flight_report_each_use_after_free_once() -> None:
    n = 100
    auditor = Auditor()
    found = auditor.feed(_frees_beside_many_in_flight(n)).finish()
    uaf = [f.op for f in found if "(use after free)" in f.detail]
    assert uaf == list(reversed(range(n)))
    assert [f.op for f in found if f.rule == "incomplete_operation"] == list(range(n))
