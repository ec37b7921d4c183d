"""``hicache-obs instrument -- COMMAND``: controllers built in spawned processes are instrumented."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from otlp_receiver import OtlpReceiver, span_attributes
from prometheus_client.parser import text_string_to_metric_families
from sglang_env import hybrid_backend, release_tuple

from hicache_obs.events._replay import replay

pytestmark = pytest.mark.needs_sglang

# two scheduler-like processes (ranks 0 and 1), spawned as SGLang spawns its schedulers
CHILD = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys, time
    from pathlib import Path

    def rank_main(rank, writes, backend, folder):
        from hicache_obs.core import ModelSpec
        from hicache_obs.lab.sglang.harness import build_controller
        h = build_controller(ModelSpec.tiny_hybrid(), io_backend=backend)
        for i in range(writes):
            kv = h.alloc_kv(32)
            h.write(kv, h.alloc_mamba(1), node_id=i)
        h.reap()
        from hicache_obs.integrations.sglang._launcher import pipelines
        log = pipelines()[0].log  # events kept in memory, and every one appended so far
        Path(folder, f"ready-{rank}").write_text(f"{len(log.events())} {len(log)}")
        deadline = time.time() + 60
        while not Path(folder, "stop").exists() and time.time() < deadline:
            time.sleep(0.05)

    if __name__ == "__main__":
        folder, backend = sys.argv[1], sys.argv[2]
        ctx = mp.get_context("spawn")
        procs = []
        for rank, writes in ((0, 2), (1, 3)):
            os.environ["HICACHE_OBS_RANK"] = str(rank)
            p = ctx.Process(target=rank_main, args=(rank, writes, backend, folder))
            p.start()
            procs.append(p)
        for p in procs:
            p.join(90)
        sys.exit(max(p.exitcode or 0 for p in procs))
    """
)


def _free_base() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _completed_writes(url: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "hicache_operations_total" and s.labels == {"direction": "d2h", "status": "completed"}:
                return s.value
    raise AssertionError(f"{url} has no hicache_operations_total{{direction=d2h,status=completed}}")


def test_launcher_instruments_spawned_processes(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "logs"
    script = tmp_path / "serve.py"
    script.write_text(CHILD)
    base = _free_base()
    backend = hybrid_backend()[0] if release_tuple() >= (0, 5, 11) else "direct"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache_obs", "instrument", "--metrics-port", str(base), "--out", str(out),
         "--", sys.executable, str(script), str(work), backend],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.time() + 120
        while not all((work / f"ready-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.time() < deadline, "the ranks never became ready"
            time.sleep(0.1)
        # a real scrape of each rank's /metrics, on BASE + rank; the sinks run on their own
        # thread, so a scrape may come before they took the last events: poll, bounded
        for port, writes in ((base, 2), (base + 1, 3)):
            url = f"http://127.0.0.1:{port}/metrics"
            deadline = time.time() + 20
            while _completed_writes(url) != writes and time.time() < deadline:
                time.sleep(0.1)
            assert _completed_writes(url) == writes
    finally:
        (work / "stop").write_text("")
        output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output
    assert "instrumented HybridCacheController (rank 0, profile metrics)" in output and "(rank 1, profile metrics)" in output
    # one folder per rank, and none for the parent process, which built no controller
    assert sorted(p.name for p in out.iterdir()) == ["rank-0", "rank-1"]
    res = replay(out, audit=True)
    assert res.ranks == [0, 1]
    submitted = {r: sum(type(e).__name__ == "TransferSubmitted" and e.rank == r for e in res.events) for r in (0, 1)}
    assert submitted == {0: 2, 1: 3}
    # the files hold every event; the scheduler's process keeps none of them in memory
    for r in (0, 1):
        kept, appended = map(int, (work / f"ready-{r}").read_text().split())
        assert kept == 0 and 0 < appended <= sum(e.rank == r for e in res.events), (kept, appended)
    if release_tuple() >= (0, 5, 11):
        assert res.findings == []
    else:
        assert {(f.rule, f.pool) for f in res.findings} == {("unrecorded_index", "mamba")}
    # the command's own audit reads the same folders
    audit = subprocess.run([sys.executable, "-m", "hicache_obs", "audit", str(out), "--json"], capture_output=True, text=True)
    assert audit.returncode == (0 if release_tuple() >= (0, 5, 11) else 1)
    assert json.loads(audit.stdout)["events"] == res.n_events


def test_launcher_leaves_other_programs_alone(tmp_path: Path) -> None:
    out = tmp_path / "logs"
    r = subprocess.run(
        [sys.executable, "-m", "hicache_obs", "instrument", "--out", str(out), "--",
         sys.executable, "-c", "import sys; print('ok', sys.argv[1:])", "a", "b"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok ['a', 'b']", r.stderr
    assert not out.exists()
    r = subprocess.run([sys.executable, "-m", "hicache_obs", "instrument", "--", "no-such-program-here"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 127 and "command not found" in r.stderr
    r = subprocess.run([sys.executable, "-m", "hicache_obs", "instrument"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no COMMAND" in r.stderr


# one controller, three writes reaped, then the process exits: its spans leave at exit
ONE_RANK = textwrap.dedent(
    """
    import sys
    from hicache_obs.core import ModelSpec
    from hicache_obs.lab.sglang.harness import build_controller
    h = build_controller(ModelSpec.tiny_hybrid(), io_backend=sys.argv[1])
    for i in range(3):
        h.write(h.alloc_kv(32), h.alloc_mamba(1), node_id=i)
    h.reap()
    """
)


def test_launcher_sends_spans_to_otlp(tmp_path: Path) -> None:
    receiver = OtlpReceiver()
    t = threading.Thread(target=receiver.serve_forever, daemon=True)
    t.start()
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK)
    backend = hybrid_backend()[0] if release_tuple() >= (0, 5, 11) else "direct"
    try:
        r = subprocess.run(
            [sys.executable, "-m", "hicache_obs", "instrument", "--out", str(tmp_path / "logs"),
             "--otlp-endpoint", f"http://127.0.0.1:{receiver.server_address[1]}",
             "--", sys.executable, str(script), backend],
            capture_output=True, text=True, timeout=180,
        )
    finally:
        receiver.shutdown()
        receiver.server_close()
    assert r.returncode == 0, r.stderr
    assert set(receiver.paths) == {"/v1/traces"}
    writes = [s for s in receiver.spans if span_attributes(s).get("hicache.direction") == "d2h"]
    assert len(writes) == 3, [(s.name, span_attributes(s)) for s in receiver.spans]
    unrecorded = [span_attributes(s).get("hicache.unrecorded_indices", 0) for s in writes]
    if release_tuple() >= (0, 5, 11):
        assert unrecorded == [0, 0, 0]
    else:  # the Mamba indices of every write went unrecorded on the side stream
        assert all(n > 0 for n in unrecorded), unrecorded
