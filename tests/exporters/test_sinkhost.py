"""SinkHost: the sinks run in a child process, fed the log's batches; nothing is lost."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from exporters_kit import parse_exposition, run_workload, scrape_text, value

from hicache_obs.errors import ConfigError
from hicache_obs.events import AuditViolation
from hicache_obs.events._audit import audit
from hicache_obs.events._replay import replay
from hicache_obs.exporters import metric_names as m
from hicache_obs.exporters.sinkhost import SinkHost, add_sink_host


def test_a_hosted_prometheus_serves_what_the_workload_did(controller: Any) -> None:
    c = controller("tiny_hybrid")
    runner = add_sink_host(c.log, [{"sink": "prometheus"}])
    host = runner.sink
    assert host.pid != os.getpid() and host.returncode is None
    exp = run_workload(c)
    assert exp.intact
    c.log.flush()
    s = parse_exposition(scrape_text(f"http://127.0.0.1:{host.metrics_port}/metrics"))
    for d in ("d2h", "h2d"):
        assert value(s, m.OPERATIONS_TOTAL, direction=d, status="completed") == exp.ops[d] > 0
    for (pool, tier), n in exp.used.items():
        assert value(s, m.POOL_USED_SLOTS, pool=pool, tier=tier) == n
    assert host.stats["events"] == len(c.log)
    c.log.close()
    assert host.wait(10) == 0
    assert runner.stats()["dropped"] == 0 and runner.stats()["errors"] == 0
    with pytest.raises(OSError):  # the child took its server with it
        scrape_text(f"http://127.0.0.1:{host.metrics_port}/metrics")


def test_hosted_lines_carry_the_hosted_spans_ids(controller: Any, tmp_path: Path) -> None:
    c = controller("tiny_hybrid")
    lines_file = tmp_path / "logs" / "lines.jsonl"
    runner = add_sink_host(
        c.log,
        [{"sink": "structlog", "file": str(lines_file)}, {"sink": "otel", "exporter": "memory"}],
    )
    exp = run_workload(c)
    c.log.close()
    ops = exp.ops["d2h"] + exp.ops["h2d"]
    stats = runner.sink.stats
    assert stats["spans_ended"] == stats["spans_exported"] == ops and stats["spans_dropped"] == 0
    lines = [json.loads(x) for x in lines_file.read_text().splitlines()]
    done = [x for x in lines if x["event"] == "hicache.transfer_completed"]
    assert len(done) == stats["lines_written"] - (len(lines) - len(done)) == ops
    assert all(len(x["trace_id"]) == 32 and len(x["span_id"]) == 16 for x in done)
    assert len({x["span_id"] for x in done}) == ops
    assert lines_file.stat().st_mode & 0o777 == 0o644


def test_a_hosted_store_replays_to_the_live_state(controller: Any, tmp_path: Path) -> None:
    c = controller("tiny_hybrid")
    runner = add_sink_host(c.log, [{"sink": "jsonl", "dir": str(tmp_path / "log")}])
    assert runner.policy == "block"  # a durable store is never dropped from
    run_workload(c)
    c.log.close()
    res = replay(tmp_path / "log")
    assert len(res.events) == len(c.log) == runner.sink.stats["events"]
    assert res.state.snapshot() == c.state.snapshot()


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([], "non-empty list of sink specs"),
        ([{"kind": "prometheus"}], "must be a dict with a 'sink' name"),
        ([{"sink": "statsd"}], "unknown sink 'statsd'; known: audit, prometheus, structlog, otel, jsonl"),
        ([{"sink": "prometheus", "prot": 9400}], "unknown keys ['prot']"),
        ([{"sink": "prometheus"}, {"sink": "prometheus"}], "a host runs one 'prometheus' sink, given twice"),
        ([{"sink": "jsonl"}], "'dir' must be a path string, got None"),
        ([{"sink": "otel", "exporter": "zipkin"}], "exporter must be 'otlp' or 'memory', got 'zipkin'"),
        ([{"sink": "structlog", "file": Path("x")}], "is not JSON-able"),
    ],
)
def test_bad_specs_are_config_errors_naming_what_is_wrong(specs: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        SinkHost(specs)
    assert message in str(info.value)


def test_a_child_that_cannot_build_its_sinks_fails_the_constructor() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as info:
            SinkHost([{"sink": "prometheus", "port": port}])
    assert "sink host could not start its sinks" in str(info.value) and "Address already in use" in str(info.value)


def test_a_killed_host_costs_counted_drops_never_the_controller(controller: Any) -> None:
    c = controller("tiny_hybrid")
    runner = add_sink_host(c.log, [{"sink": "prometheus"}])
    run_workload(c, rounds=1)
    c.log.flush()
    handled = runner.stats()["handled"]
    os.kill(runner.sink.pid, signal.SIGKILL)
    assert runner.sink.wait(10) == -signal.SIGKILL
    exp = run_workload(c, rounds=2)  # the controller carries on
    assert exp.intact
    c.log.close()
    st = runner.stats()
    assert st["errors"] >= 1 and st["handled"] == handled
    assert st["handled"] + st["dropped"] == st["offered"] == len(c.log)


def test_hostile_names_in_specs_are_used_literally(controller: Any, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    name = tmp_path / "$(touch PWNED) ; touch PWNED2 `touch PWNED3`.jsonl"
    c = controller("tiny")
    runner = add_sink_host(
        c.log, [{"sink": "structlog", "file": str(name)}, {"sink": "jsonl", "dir": str(tmp_path / "a b;c")}]
    )
    run_workload(c, rounds=1)
    c.log.close()
    assert runner.sink.wait(10) == 0
    assert name.exists() and name.read_text().count("\n") == runner.sink.stats["lines_written"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name.name, "a b;c"])


def test_the_auditor_in_the_host_reaches_every_hosted_sink(controller: Any, tmp_path: Path) -> None:
    """The pre-#22940 fault: the host's auditor finds what an inline one finds, and its sinks show it."""
    c = controller("tiny_hybrid", fault="unrecorded-pool-indices", audit=False)
    lines_file = tmp_path / "lines.jsonl"
    runner = add_sink_host(
        c.log,
        [
            {"sink": "audit"},
            {"sink": "prometheus"},
            {"sink": "structlog", "file": str(lines_file)},
            {"sink": "jsonl", "dir": str(tmp_path / "log")},
        ],
    )
    run_workload(c)
    c.write(c.alloc_device(16), node_id=99)  # never polled: incomplete at the end of the log
    c.log.flush()
    expected = audit(c.log.events())
    unrecorded: dict[str, int] = {}
    for f in expected:
        if f.rule == "unrecorded_index":
            unrecorded[f.pool] = unrecorded.get(f.pool, 0) + 1
    assert unrecorded.get("mamba", 0) > 0 and "kv" not in unrecorded
    s = parse_exposition(scrape_text(f"http://127.0.0.1:{runner.sink.metrics_port}/metrics"))
    for pool, n in unrecorded.items():
        assert (
            sum(v for (name, labels), v in s.items() if name == m.UNRECORDED_INDICES_TOTAL and ("pool", pool) in labels)
            == n
        )
    assert value(s, m.AUDIT_VIOLATIONS_TOTAL, rule="unrecorded_index", pool="kv") == 0
    assert not any(isinstance(e, AuditViolation) for e in c.log.events())  # the parent's log stays as it was
    c.log.close()
    stats = runner.sink.stats
    counts: dict[str, dict[str, int]] = {}
    for f in expected:
        counts.setdefault(f.rule, {}).setdefault(f.pool, 0)
        counts[f.rule][f.pool] += 1
    assert stats["violations"] == counts and "incomplete_operation" in counts
    lines = [json.loads(x) for x in lines_file.read_text().splitlines()]
    logged = [x for x in lines if x["event"] == "hicache.audit_violation"]
    assert len(logged) == len(expected)
    assert sum(x["unrecorded_indices"] for x in lines if x["event"] == "hicache.transfer_completed") == sum(
        unrecorded.values()
    )
    stored = replay(tmp_path / "log", audit=True)  # the store holds the log's own events, gap-free
    assert len(stored.events) == len(c.log)
    assert sorted(f.key() for f in stored.findings or []) == sorted(f.key() for f in expected)


def test_batches_and_flushes_from_two_threads_never_interleave(controller: Any) -> None:
    """The runner hands batches over on its worker and flushes from another thread."""
    import sys
    import threading

    c = controller("tiny_hybrid", audit=False)
    run_workload(c, rounds=1)
    events = c.log.events()
    host = SinkHost([{"sink": "prometheus"}])
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show
    flushes = []

    def flusher() -> None:
        for _ in range(100):
            host.flush()
            flushes.append(host.stats["events"])

    t = threading.Thread(target=flusher)
    t.start()
    for _ in range(100):
        for i in range(0, len(events), 7):
            host.handle_batch(events[i : i + 7])
    t.join()
    sys.setswitchinterval(switch)
    host.flush()
    assert host.stats["events"] == 100 * len(events) and host.stats["errors"] == {}
    assert flushes == sorted(flushes) and host.returncode is None
    host.close()
    assert host.wait(10) == 0


_EXIT_WITHOUT_CLOSE = """
import sys
from hicache_obs.events._log import EventLog
from hicache_obs.events._schema import AllocationFailed
from hicache_obs.exporters.sinkhost import add_sink_host

log = EventLog(rank=2)
add_sink_host(log, [{"sink": "jsonl", "dir": sys.argv[1]}])
for i in range(5000):
    log.emit(AllocationFailed, pool="kv", tier="host", requested=i, available=0)
# no close: the hosted store still gets every event at exit
"""


def test_a_hosted_store_is_named_after_the_rank_and_written_at_exit(tmp_path: Path) -> None:
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(tmp_path / "log")], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert [p.name for p in (tmp_path / "log").iterdir()] == ["events-2-00000.jsonl"]
    stored = replay(tmp_path / "log")
    assert len(stored.events) == 5000 and stored.events[-1].requested == 4999 and stored.ranks == [2]


def test_a_hosted_auditor_places_each_verdict_before_its_event_as_offline(controller: Any) -> None:
    """The host's auditor gives its sinks the stream ``audited()`` gives offline: each violation
    right before the event that revealed it, the end-of-log ones last, whatever the batches."""
    from hicache_obs.events._audit import audited
    from hicache_obs.exporters.sinkhost._child import HostAudit

    c = controller("tiny_hybrid", fault="unrecorded-pool-indices", audit=False)
    run_workload(c)
    c.write(c.alloc_device(16), node_id=99)  # never polled: incomplete at the end of the log
    events = c.log.events()
    want = list(audited(events))
    assert any(isinstance(e, AuditViolation) and e.rule == "unrecorded_index" for e in want)
    for size in (1, 7, len(events)):
        host = HostAudit()
        got: list[Any] = []
        for i in range(0, len(events), size):
            got += host.run(events[i : i + size])
        got += host.finish()
        assert got == want, size
    first = next(i for i, e in enumerate(want) if isinstance(e, AuditViolation))
    assert want[first].seq == want[first + 1].seq and want[first].ts_ns == want[first + 1].ts_ns


def test_a_parent_that_audits_and_a_hosted_auditor_count_each_violation_once(controller: Any, tmp_path: Path) -> None:
    """A parent log that holds its live auditor's violations, fed to a host that audits too:
    the host's verdicts replace the logged ones, so metrics and lines count each once."""
    c = controller("tiny_hybrid", fault="unrecorded-pool-indices", audit=True)
    lines_file = tmp_path / "lines.jsonl"
    runner = add_sink_host(
        c.log, [{"sink": "audit"}, {"sink": "prometheus"}, {"sink": "structlog", "file": str(lines_file)}]
    )
    run_workload(c)
    c.log.flush()
    logged = [e for e in c.log.events() if isinstance(e, AuditViolation)]
    assert logged and any(e.rule == "unrecorded_index" for e in logged)
    s = parse_exposition(scrape_text(f"http://127.0.0.1:{runner.sink.metrics_port}/metrics"))
    unrecorded: dict[str, int] = {}
    for e in logged:
        if e.rule == "unrecorded_index":
            unrecorded[e.pool] = unrecorded.get(e.pool, 0) + 1
    for pool, n in unrecorded.items():
        got = sum(v for (name, labels), v in s.items() if name == m.UNRECORDED_INDICES_TOTAL and ("pool", pool) in labels)
        assert got == n, (pool, got, n)
    c.log.close()
    lines = [json.loads(x) for x in lines_file.read_text().splitlines()]
    assert len([x for x in lines if x["event"] == "hicache.audit_violation"]) == len(logged)


# ------------------------------------------------ how the child reads its frames
def _frame(kind: bytes, payload: bytes) -> bytes:
    from hicache_obs.exporters.sinkhost._wire import HEADER

    return HEADER.pack(kind, len(payload)) + payload


def _allocation_failures(n: int) -> list[Any]:
    """``n`` events of a log: AllocationFailed with ``requested`` 0 .. n-1."""
    from hicache_obs.events._log import EventLog
    from hicache_obs.events._schema import AllocationFailed

    log = EventLog()
    for i in range(n):
        log.emit(AllocationFailed, pool="kv", tier="host", requested=i, available=0)
    return log.events()


def test_the_frame_reader_returns_whole_frames_however_the_pipe_splits_them() -> None:
    from hicache_obs.exporters.sinkhost._child import FrameReader
    from hicache_obs.exporters.sinkhost._wire import CLOSE, EVENTS, FLUSH

    frames = [(EVENTS, b"x" * 300), (FLUSH, b"17"), (EVENTS, b""), (CLOSE, b"")]
    data = b"".join(_frame(k, p) for k, p in frames)
    for step in (1, 2, 5, 6, 7, 64, len(data)):  # every split, a header split inside itself too
        r, w = os.pipe()
        try:
            reader = FrameReader(r)
            got = []
            for at in range(0, len(data), step):
                os.write(w, data[at : at + step])
                assert reader.fill()
                while (f := reader.next()) is not None:
                    got.append(f)
            assert got == frames and reader.partial == 0
            assert len(reader._buf) == 0  # all handled: nothing of the burst is kept
            assert not reader.fill() and not reader.eof  # nothing waits: no blocking, no end
            os.write(w, _frame(EVENTS, b"abc")[:6])  # a frame cut short by the writer's exit
            os.close(w)
            w = -1
            reader.fill()
            assert reader.eof and reader.next() is None and reader.partial == 6
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)


def test_the_frame_reader_holds_about_its_limit_whatever_the_pipe_holds() -> None:
    from hicache_obs.exporters.sinkhost._child import FrameReader
    from hicache_obs.exporters.sinkhost._wire import EVENTS

    frames = [(EVENTS, bytes([i]) * 300) for i in range(150)]  # 45 KB: the pipe holds them all
    r, w = os.pipe()
    try:
        os.write(w, b"".join(_frame(k, p) for k, p in frames))
        reader = FrameReader(r, limit=1000)
        got = []
        fills = 0
        while True:
            reader.fill()
            fills += 1
            assert reader.partial < 1000 + (1 << 20)  # the limit, and at most one read past it
            while (f := reader.next()) is not None:
                got.append(f)
            if not reader.full:
                break
        assert got == frames and not reader.eof
    finally:
        os.close(r)
        os.close(w)


def _memory_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    pytest.skip(f"/proc/{pid}/status has no {field}")


def test_a_host_that_fell_behind_reads_the_backlog_a_pipe_at_a_time() -> None:
    """A child stopped while the parent queued 16 MiB: it reads about a pipe's worth, handles
    it, reads on; its memory stays near what it was (it read the whole backlog first before)."""
    events = _allocation_failures(256)
    host = SinkHost([{"sink": "prometheus"}])
    frame = host.encode(events)
    n = (16 << 20) // len(frame)
    host.flush()
    before = _memory_kb(host.pid, "VmHWM")
    os.kill(host.pid, signal.SIGSTOP)
    try:
        for _ in range(n):
            host.push(frame, len(events), 1 << 30, None)
        assert host.queued_events > 0  # most of it waits in the parent: the pipe is full
    finally:
        os.kill(host.pid, signal.SIGCONT)
    host.flush(120)
    assert host.stats["events"] == n * len(events) and host.discarded_events == 0
    grew = _memory_kb(host.pid, "VmHWM") - before
    assert grew < 8 << 10, f"the child grew by {grew} kB reading a {len(frame) * n >> 10} kB backlog"
    host.close()
    assert host.wait(10) == 0


def test_a_blocked_push_and_a_flush_wait_for_the_pipe_together() -> None:
    """A producer waiting for room (policy block) while another thread's flush waits for the
    same pipe: both wait, neither fails (one poll object polled from two threads raises)."""
    import threading
    import time

    events = _allocation_failures(256)
    host = SinkHost([{"sink": "prometheus"}])
    frame = host.encode(events)
    os.kill(host.pid, signal.SIGSTOP)
    failures: list[BaseException] = []
    try:
        for _ in range(200):
            host.push(frame, len(events), 1 << 30, None)
        waiting = host.queued_events
        assert waiting > 0

        def flush() -> None:
            try:
                host.flush(30)
            except BaseException as exc:  # reported by the test
                failures.append(exc)

        t = threading.Thread(target=flush)
        t.start()
        time.sleep(0.2)  # the flush waits for room in the pipe
        host.push(frame, len(events), 1000, time.monotonic() + 0.3)  # waits 0.3 s, then drops the oldest
    finally:
        os.kill(host.pid, signal.SIGCONT)
    t.join(60)
    assert not failures and not t.is_alive()
    pushed = 201 * len(events)
    assert host.discarded_events > 0
    host.flush(30)
    assert host.stats["events"] + host.discarded_events == pushed == host.sent_events + host.discarded_events
    host.close()
    assert host.wait(10) == 0


def _sleeps_of(pid: int, seconds: float) -> list[tuple[int, tuple[int, ...], int]]:
    """What the process's main thread slept in, sampled for ``seconds``: (syscall number,
    the fds of a ``poll``, its timeout) per sample taken while it slept (x86-64 only)."""
    import platform
    import struct
    import time

    if platform.machine() != "x86_64":
        pytest.skip("reads x86-64 syscall numbers from /proc/PID/syscall")
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            call = Path(f"/proc/{pid}/syscall").read_text().split()
            if call[0] in ("running", "-1"):
                continue
            nr, fds, timeout = int(call[0]), (), -2
            if nr == 7:  # poll(struct pollfd *fds, nfds, int timeout)
                n = int(call[2], 16)
                with open(f"/proc/{pid}/mem", "rb") as f:
                    f.seek(int(call[1], 16))
                    raw = f.read(8 * n)
                fds = tuple(struct.unpack_from("<i", raw, 8 * i)[0] for i in range(n))
                timeout = struct.unpack("<i", struct.pack("<I", int(call[3], 16) & 0xFFFFFFFF))[0]
            out.append((nr, fds, timeout))
        except OSError as exc:
            pytest.skip(f"the child's /proc entries cannot be read here: {exc}")
        time.sleep(0.0005)
    return out


def test_a_host_between_batches_waits_on_its_wake_descriptor_not_on_the_frames_pipe(controller: Any) -> None:
    """A child asleep in a read of the frames' pipe is woken by every batch the producer
    writes (an interrupt to its CPU, paid in the producer's write). Between batches this one
    sleeps in ``poll`` on fd 4 alone, with a timeout (it reads the pipe on its own timer);
    after a quarter second without any it sleeps on the pipe too, with none, so an idle
    child costs nothing. It handles every batch either way."""
    import time

    from hicache_obs.exporters.sinkhost._child import BUSY_S, IDLE_S, SLEEP_AFTER_S

    c = controller("tiny_hybrid", audit=False)
    # the auditor alone: a child with no other Python thread (a metrics server's would take
    # the GIL now and then, and the main thread would be seen waiting for it)
    feeder = add_sink_host(c.log, [{"sink": "audit"}])
    host = feeder.sink
    run_workload(c, rounds=1)
    c.log.flush()
    between = _sleeps_of(host.pid, SLEEP_AFTER_S / 2)  # the batches have just come
    assert between, "the child was never seen asleep"
    assert {nr for nr, _, _ in between} == {7}, between  # x86-64: 7 is poll, 0 would be read
    assert {fds for _, fds, _ in between} == {(4,)}
    assert all(BUSY_S * 1000 <= t <= IDLE_S * 1000 for _, _, t in between), between
    time.sleep(1.5 * SLEEP_AFTER_S)  # nothing came for longer than that
    idle = _sleeps_of(host.pid, 0.1)
    assert idle and set(idle) == {(7, (4, 0), -1)}, idle  # the pipe and fd 4, no timeout
    before = host.stats["events"]
    run_workload(c, rounds=1)  # its first batch wakes the child
    c.log.flush()
    assert host.stats["events"] == len(c.log) > before
    c.log.close()
    assert host.wait(10) == 0 and feeder.stats()["dropped"] == 0


def test_a_child_started_without_a_wake_descriptor_reads_its_pipe_as_it_blocks(tmp_path: Path) -> None:
    """``python -m hicache_obs.exporters.sinkhost --reply-fd FD SPECS``, by hand: the same frames, the same replies."""
    import subprocess
    import sys

    import msgspec

    from hicache_obs.exporters.sinkhost._wire import CLOSE, EVENTS, FLUSH

    events = _allocation_failures(300)
    rep_r, rep_w = os.pipe()
    specs = json.dumps([{"sink": "jsonl", "dir": str(tmp_path / "log")}])
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache_obs.exporters.sinkhost", "--reply-fd", str(rep_w), specs],
        stdin=subprocess.PIPE,
        pass_fds=(rep_w,),
    )
    os.close(rep_w)
    replies = os.fdopen(rep_r, "rb")
    try:
        assert json.loads(replies.readline())["ready"] is True
        assert proc.stdin is not None
        enc = msgspec.msgpack.Encoder()
        proc.stdin.write(_frame(EVENTS, enc.encode(events[:100])) + _frame(EVENTS, enc.encode(events[100:])))
        proc.stdin.write(_frame(FLUSH, b"5"))
        proc.stdin.flush()
        flushed = json.loads(replies.readline())
        assert flushed["flushed"] == 5 and flushed["stats"]["events"] == 300 and flushed["stats"]["batches"] == 2
        proc.stdin.write(_frame(CLOSE, b""))
        proc.stdin.flush()
        assert json.loads(replies.readline())["closed"] is True
        assert proc.wait(30) == 0
    finally:
        replies.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [e.requested for e in replay(tmp_path / "log").events] == list(range(300))


def test_a_child_given_a_wake_descriptor_leaves_its_stdin_blocking_as_it_found_it() -> None:
    """It reads stdin without blocking; the file description is shared (a terminal's, when
    started by hand), so it puts the flag back before it exits."""
    import subprocess
    import sys
    import time

    from hicache_obs.exporters.sinkhost._wire import CLOSE

    in_r, in_w = os.pipe()
    rep_r, rep_w = os.pipe()
    wake_r, wake_w = os.pipe()
    argv = [sys.executable, "-m", "hicache_obs.exporters.sinkhost", "--reply-fd", str(rep_w), "--wake-fd", str(wake_r)]
    argv.append(json.dumps([{"sink": "audit"}]))
    proc = subprocess.Popen(
        argv,
        stdin=in_r,
        pass_fds=(rep_w, wake_r),
    )
    os.close(rep_w)
    os.close(wake_r)
    replies = os.fdopen(rep_r, "rb")
    try:
        assert json.loads(replies.readline())["ready"] is True
        deadline = time.monotonic() + 10
        while os.get_blocking(in_r) and time.monotonic() < deadline:  # it starts reading after "ready"
            time.sleep(0.001)
        assert not os.get_blocking(in_r)  # the child's reading mode, on the description we share
        os.write(in_w, _frame(CLOSE, b""))
        os.write(wake_w, b"w")
        assert json.loads(replies.readline())["closed"] is True
        assert proc.wait(30) == 0
        assert os.get_blocking(in_r)
    finally:
        replies.close()
        for fd in (in_r, in_w, wake_w):
            os.close(fd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_host_whose_parent_goes_away_without_close_still_stores_every_event(tmp_path: Path, capfd: Any) -> None:
    """The parent's ends of the pipes close (its exit) with no CLOSE frame: the child reads
    what the pipe held, closes its sinks and exits, even while its wake descriptor says nothing."""
    events = _allocation_failures(2000)
    host = SinkHost([{"sink": "jsonl", "dir": str(tmp_path / "log")}])
    for i in range(0, len(events), 256):
        host.push(host.encode(events[i : i + 256]), len(events[i : i + 256]), 100_000, None)
    assert host.queued_events == 0
    os.write(host.out_fd, host.encode(events[:3])[:20])  # a frame cut short by the exit
    # as at the parent's exit: every descriptor to the child closes, nothing else is said
    os.close(host.out_fd)
    os.close(host._wake_fd)  # the test stands in for the parent's exit
    os.close(host._reply_fd)
    assert host.wait(30) == 0
    assert [e.requested for e in replay(tmp_path / "log").events] == list(range(2000))
    assert "went away in the middle of a frame (20 bytes of it came)" in capfd.readouterr().err
