"""Files, terminals and signals: what the CLI writes where, what it prints, how it stops.

- output paths (``hicache_obs._files.write_text``, used by ``export`` and the demo's
  ``trace.json``): a FIFO and a character device are written in place, never replaced; a
  symlink is written through and kept; a dangling symlink, a folder are refused before any
  work; ``/dev/stdout`` writes to the descriptor (``>>`` keeps what was there);
- text from a log (pool and stream names, errors, details) reaches the terminal escaped,
  through the real CLI in a subprocess: no markup error, no ESC/OSC 8/C1/bidi character;
- SIGTERM of a running ``demo`` unwinds as SIGINT does: exit 143/130, the durable log holds
  every event emitted (the count the demo prints), gap-free, no operation left open;
  SIGINT/SIGTERM during start-up: exit 130/143, no traceback;
- SIGKILL loses at most ``STORE_MAX_QUEUE`` + one batch, shown with a store slowed down
  so the producer runs into the bound.
"""

from __future__ import annotations

import contextlib
import io
import json
import mmap
import os
import re
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hicache_obs._files import OutputPathError, write_text
from hicache_obs.cli import main
from hicache_obs.cli._common import escape_text
from hicache_obs.events._audit import audit
from hicache_obs.events._replay import replay
from hicache_obs.lab.cli.demo import STORE_MAX_QUEUE

PY = sys.executable
ENV = {**os.environ, "COLUMNS": "200", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
# the text of one escape each: OSC 8 hyperlink, clear screen, CSI as C1, bidi override and
# isolate, BEL, backspace, CR, NUL; and markup that is a closing tag, a link, a style
HOSTILE = (
    "[/x][link=http://evil.example/]a[/link][bold red]b"
    "\x1b]8;;http://evil.example/\x07click\x1b]8;;\x07\x1b[2J\x9b31m\u202eevil\u2066\r\x08\x00"
)
BAD_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def demo_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "d"
    code, _, err = _run(["demo", "--steps", "20", "--fault", "unrecorded-pool-indices", "--out", str(out), "--json"])
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def hostile_log(demo_log: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's log with the Mamba pool and the write stream renamed to HOSTILE, and one
    completion turned into a failure whose error text is HOSTILE."""
    dst = tmp_path_factory.mktemp("hostile") / "events-0-00000.jsonl"
    lines = []
    failed = False
    for line in (demo_log / "events-0-00000.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if not failed and ev.get("type") == "TransferCompleted":  # line 1 is the segment header
            ev = {k: ev[k] for k in ("seq", "ts_ns", "rank", "op", "direction")}
            ev.update(type="TransferFailed", error=HOSTILE)
            failed = True
        text = json.dumps(ev)
        lines.append(text.replace('"mamba"', json.dumps(HOSTILE)).replace('"hicache-write"', json.dumps(HOSTILE)))
    assert failed
    dst.write_text("\n".join(lines) + "\n")
    return dst


# The CLI in a subprocess, one process per command: a driver imports the CLI once, then forks
# a child per command whose stdout/stderr are files (real descriptors, as under a shell), so
# torch is imported once rather than once per command.
DRIVER = r"""
import json, os, sys
from hicache_obs.cli import build_parser, main
build_parser()  # the imports, once
results = []
for case in json.load(open(sys.argv[1])):
    out = os.open(case["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    err = os.open(case["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pid = os.fork()
    if pid == 0:
        os.dup2(out, 1); os.dup2(err, 2)
        os.environ.update(case["env"])
        sys.stdout = open(1, "w", closefd=False); sys.stderr = open(2, "w", closefd=False)
        code = main(case["argv"])
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    os.close(out); os.close(err)
    results.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(results))
"""
COLOUR = {"FORCE_COLOR": "1", "TERM": "xterm-256color"}


def _cli_in_subprocess(tmp: Path, cases: list[tuple[list[str], dict[str, str]]]) -> list[tuple[int, str, str]]:
    spec = [
        {"argv": argv, "env": env, "stdout": str(tmp / f"{i}.out"), "stderr": str(tmp / f"{i}.err")}
        for i, (argv, env) in enumerate(cases)
    ]
    (tmp / "cases.json").write_text(json.dumps(spec))
    res = subprocess.run(
        [PY, "-c", DRIVER, str(tmp / "cases.json")], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert res.returncode == 0, res.stderr
    codes = json.loads(res.stdout)
    return [
        (code, Path(c["stdout"]).read_text() if Path(c["stdout"]).exists() else "", Path(c["stderr"]).read_text())
        for code, c in zip(codes, spec, strict=True)
    ]


@pytest.fixture(scope="module")
def cli_runs(hostile_log: Path, demo_log: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("cli")
    bad = tmp / "events-0-00000.jsonl"
    bad.write_text('{"type": "PoolCreated\x1b]8;;http://evil.example/\x07", "seq": 0}\n')
    (tmp / "5.out").write_text("before\n")  # case 5's stdout, opened for append: `... >> 5.out`
    names = ["audit-v", "inspect-tree", "inspect-timeline", "inspect-in-colour", "error-line", "dev-stdout"]
    cases = [
        (["audit", "-v", str(hostile_log)], {}),
        (["inspect", str(hostile_log)], {}),
        (["inspect", "--timeline", str(hostile_log)], {}),
        (["inspect", "--violations-only", str(hostile_log)], COLOUR),
        (["audit", str(bad)], {}),
        (["export", str(demo_log), "--chrome-trace", "/dev/stdout"], {}),
    ]
    runs = _cli_in_subprocess(tmp, cases)
    return {"runs": dict(zip(names, runs, strict=True)), "tmp": tmp}


# ---------------------------------------------------------------- escaping
def test_escape_text_makes_every_control_visible_and_markup_literal() -> None:
    from rich.console import Console

    shown = escape_text(HOSTILE)
    assert not BAD_CHARS.search(shown) and "\x1b" not in shown
    assert "\\x1b]8;;http://evil.example/\\x07click" in shown and "\\u202e" in shown and "\\x9b" in shown
    buf = io.StringIO()
    Console(file=buf, width=400, highlight=False).print(f"[bold]pool[/] {shown}")
    printed = buf.getvalue()
    assert printed.startswith("pool [/x][link=http://evil.example/]a[/link][bold red]b\\x1b]8;;"), printed
    assert escape_text("kv") == "kv" and escape_text("é 中") == "é 中"
    assert escape_text("a\\", markup=False) == "a\\" and escape_text("\ud800", markup=False) == "\\ud800"


@pytest.mark.parametrize(
    ("name", "code"),
    [("audit-v", 1), ("inspect-tree", 0), ("inspect-timeline", 0), ("inspect-in-colour", 0)],
)
def test_hostile_names_and_errors_reach_the_terminal_escaped(cli_runs: dict[str, Any], name: str, code: int) -> None:
    rc, stdout, stderr = cli_runs["runs"][name]
    assert rc == code, stderr
    assert "Traceback" not in stderr and "MarkupError" not in stderr, stderr
    text = stdout + stderr
    if name == "inspect-in-colour":  # rich styles its own output: only SGR sequences (ESC [ ... m) may remain
        assert "\x1b[" in text
        text = re.sub("\x1b\\[[0-9;]*m", "", text)
    assert not BAD_CHARS.search(text), repr(BAD_CHARS.search(text))
    assert "\x1b]8;;" not in text and "\x1b" not in text
    flat = text.replace("\n", "").replace(" ", "")
    assert "[/x][link=http://evil.example/]a[/link][bold" in flat  # markup shown as written
    assert "\\x1b]8;;http://evil.example/\\x07click" in flat


def test_error_lines_escape_what_they_quote(cli_runs: dict[str, Any]) -> None:
    rc, _, stderr = cli_runs["runs"]["error-line"]
    assert rc == 2 and stderr.startswith("hicache-obs: error: cannot read log:"), stderr
    assert "\x1b" not in stderr and "Traceback" not in stderr


# ------------------------------------------------------------------- files
def test_a_fifo_is_written_in_place_and_stays_a_fifo(demo_log: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    code, _, err = _run(["export", str(demo_log), "--chrome-trace", str(fifo)])
    reader.join(30)
    assert code == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert json.loads(got[0])["traceEvents"]
    assert not [p for p in tmp_path.iterdir() if p != fifo]  # no temp file left beside it


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_character_device_is_written_in_place_not_replaced(demo_log: Path, tmp_path: Path) -> None:
    null = tmp_path / "null"  # a private /dev/null: the real one is never put at risk
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    before = os.lstat(null)
    for option in ("--chrome-trace", "--otlp-json"):
        code, _, err = _run(["export", str(demo_log), option, str(null)])
        assert code == 0, err
    after = os.lstat(null)
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev and after.st_ino == before.st_ino


def test_dev_null_itself_is_left_a_character_device(demo_log: Path) -> None:
    code, _, err = _run(["export", str(demo_log), "--chrome-trace", "/dev/null"])
    assert code == 0, err
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)


def test_a_symlink_is_written_through_and_kept(demo_log: Path, tmp_path: Path) -> None:
    real = tmp_path / "elsewhere" / "spans.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "spans.json"
    link.symlink_to(real)
    code, _, err = _run(["export", str(demo_log), "--otlp-json", str(link)])
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert json.loads(real.read_text())["resourceSpans"]
    assert stat.S_IMODE(real.stat().st_mode) == 0o644


def test_a_dangling_symlink_and_a_folder_are_refused_before_the_log_is_read(tmp_path: Path) -> None:
    dangling = tmp_path / "t.json"
    dangling.symlink_to(tmp_path / "nowhere" / "t.json")
    missing_log = tmp_path / "no-such-log"  # never reached: the target is checked first
    code, _, err = _run(["export", str(missing_log), "--chrome-trace", str(dangling)])
    assert code == 2 and f"--chrome-trace cannot write {dangling}: it is a symlink to" in err, err
    assert not (tmp_path / "nowhere").exists() and dangling.is_symlink()
    code, _, err = _run(["export", str(missing_log), "--otlp-json", str(tmp_path)])
    assert code == 2 and f"--otlp-json cannot write {tmp_path}: it is a folder, not a file" in err, err
    with pytest.raises(OutputPathError, match="is a folder"):
        write_text(tmp_path, "x")


def test_dev_stdout_writes_to_the_descriptor_and_keeps_an_append(cli_runs: dict[str, Any]) -> None:
    rc, stdout, stderr = cli_runs["runs"]["dev-stdout"]  # stdout: a file opened for append holding "before"
    assert rc == 0, stderr
    assert stderr.startswith("wrote /dev/stdout (Chrome trace, "), stderr
    head, body = stdout.split("\n", 1)
    assert head == "before" and json.loads(body)["traceEvents"]


def test_the_demo_writes_its_trace_through_a_symlink_and_checks_out_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "d"
    out.mkdir()
    real = tmp_path / "kept-trace.json"
    real.write_text("an earlier trace")
    (out / "trace.json").symlink_to(real)
    code, _, err = _run(["demo", "--steps", "3", "--out", str(out), "--json"])
    assert code == 0, err
    assert (out / "trace.json").is_symlink() and json.loads(real.read_text())["traceEvents"]

    from hicache_obs.lab.workload import Workload

    def never(*a: Any, **k: Any) -> Any:
        raise AssertionError("the workload ran before the output folder was checked")

    monkeypatch.setattr(Workload, "run", never)
    code, _, err = _run(["demo", "--out", "/proc/self"])
    assert code == 2 and err.startswith("hicache-obs: error: --out /proc/self: cannot write there:"), err
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "trace.json").mkdir()
    code, _, err = _run(["demo", "--out", str(tmp_path / "e")])
    assert code == 2 and "trace.json: it is a folder, not a file" in err, err


def test_device_tokens_beyond_memory_is_one_line_not_a_torch_traceback(tmp_path: Path) -> None:
    code, _, err = _run(["demo", "--device-tokens", "100000000000", "--out", str(tmp_path / "d")])
    assert code == 2, err
    assert re.fullmatch(
        r"hicache-obs: error: --device-tokens 100000000000: the pools of model tiny_hybrid need [\d.]+ GiB "
        r"\(device and host tiers\), more than the [\d.]+ GiB of memory available\n",
        err,
    ), err
    assert not (tmp_path / "d").exists()


# ----------------------------------------------------------------- signals
def _start_demo(out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PY, "-m", "hicache_obs", "demo", "--steps", "1000000", "--out", str(out), "--json", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def _wait_until(proc: subprocess.Popen[str], cond: Any, what: str) -> None:
    deadline = time.monotonic() + 120  # ends a hung test only
    while not cond():
        assert proc.poll() is None, f"the demo exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("sig", "code", "word"), [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")]
)
def test_sigterm_mid_workload_flushes_and_closes_like_sigint(tmp_path: Path, sig: int, code: int, word: str) -> None:
    out = tmp_path / "d"
    proc = _start_demo(out)
    try:
        seg = out / "events-0-00000.jsonl"
        _wait_until(proc, lambda: seg.exists() and seg.stat().st_size > 200_000, "the workload to run")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert "Traceback" not in err, err
    m = re.search(rf"hicache-obs: {word}: (\d+) of (\d+) events written to ", err)
    assert m and m.group(1) == m.group(2), err
    assert err.rstrip().endswith(f"hicache-obs: error: {word}"), err
    res = replay(out)
    assert not res.torn_lines
    assert [e.seq for e in res.events] == list(range(int(m.group(2))))  # every event emitted, in order
    # the controller was closed as on a normal exit: every submitted operation finished
    assert not [f for f in audit(res.events) if f.rule == "incomplete_operation"]


@pytest.mark.parametrize(
    ("sig", "code", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_a_signal_during_start_up_exits_with_its_code_and_no_traceback(
    tmp_path: Path, sig: int, code: int, word: str
) -> None:
    proc = _start_demo(tmp_path / "d")
    try:

        def torch_loading() -> bool:  # libtorch is mapped: the imports are under way
            with contextlib.suppress(OSError):
                return "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
            return False

        _wait_until(proc, torch_loading, "torch to be imported")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert "Traceback" not in err and err.rstrip().endswith(f"hicache-obs: error: {word}"), err


IN_A_FINALIZER = r"""
import sys, time
from hicache_obs import cli

class Slow:
    def __del__(self):  # the signal lands while a finalizer runs: Python drops what it raises
        print("in-finalizer", flush=True)
        time.sleep(3)

def command(argv):
    Slow()
    print("after-finalizer", flush=True)
    while True:
        time.sleep(0.01)

cli._main = command
sys.exit(cli.main([]))
"""


@pytest.mark.parametrize(
    ("sig", "code", "word"), [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_signal_inside_a_finalizer_still_stops_the_command(sig: int, code: int, word: str) -> None:
    proc = subprocess.Popen(
        [PY, "-c", IN_A_FINALIZER], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "in-finalizer"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert "after-finalizer" in out  # the finalizer ended; the signal was handled after it
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.rstrip().endswith(f"hicache-obs: error: {word}"), err


KILLED_WRITER = r"""
import mmap, struct, sys, time
from hicache_obs.lab.cli.demo import STORE_MAX_QUEUE
from hicache_obs.events import EventLog
from hicache_obs.events._schema import SlotsFreed
from hicache_obs.events._store import JsonlStore, open_store

real = JsonlStore.handle_batch
def slow(self, events):  # a slow disk: 20 ms a batch, so the producer runs into the bound
    time.sleep(0.02)
    real(self, events)
JsonlStore.handle_batch = slow

with open(sys.argv[2], "r+b") as fh:
    shared = mmap.mmap(fh.fileno(), 8)
log = EventLog(capacity=1000)
runner = open_store(log, sys.argv[1], max_queue=STORE_MAX_QUEUE)
print(runner.max_queue, runner.batch_size, flush=True)
n = 0
while True:
    log.emit(SlotsFreed, pool="kv", tier="device", indices=((n, 1),))
    n += 1
    shared[:8] = struct.pack("q", n)  # after emit returned: n events were published
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_loses_at_most_the_stores_queue_bound(tmp_path: Path) -> None:
    counter = tmp_path / "emitted"
    counter.write_bytes(b"\0" * 8)
    proc = subprocess.Popen(
        [PY, "-c", KILLED_WRITER, str(tmp_path / "log"), str(counter)], stdout=subprocess.PIPE, text=True, env=ENV
    )
    try:
        assert proc.stdout is not None
        max_queue, batch = map(int, proc.stdout.readline().split())
        with open(counter, "rb") as fh:
            shared = mmap.mmap(fh.fileno(), 8, access=mmap.ACCESS_READ)
            emitted = lambda: struct.unpack("q", shared[:8])[0]  # noqa: E731
            _wait_until(proc, lambda: emitted() > 5 * (max_queue + batch), "the producer to run into the bound")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            n = emitted()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert max_queue == STORE_MAX_QUEUE
    res = replay(tmp_path / "log")
    on_disk = len(res.events)
    assert [e.seq for e in res.events] == list(range(on_disk))
    lost = n - on_disk
    print(f"emitted {n}, on disk {on_disk}, lost {lost} (bound {max_queue + batch})")
    assert 0 <= lost <= max_queue + batch, (n, on_disk)


def test_a_signal_while_the_log_closes_waits_until_it_is_closed() -> None:
    from hicache_obs.cli import Terminated, deferred_interrupts

    steps: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGTERM)  # delivered at once: the handler runs in this thread
            time.sleep(0.05)
            steps.append("closed")  # what the signal would have cut short
    assert steps == ["closed"] and signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            steps.append("closed again")
    assert steps == ["closed", "closed again"]
