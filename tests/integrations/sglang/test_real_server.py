"""The real SGLang server (``python -m sglang.launch_server``) with HiCache, under
``hicache-obs instrument``, driven over HTTP with multi-turn traffic on shared prefixes.

Each server runs a tiny model made here on the CPU (``integrations.sglang.server``), and
each test checks what a user sees:

- **data**: requests served from host give the outputs (and logprobs, within
  :data:`LOGPROB_TOL`) of a recompute after ``/flush_cache``; with loads that copy nothing
  (the negative control) they do not;
- **silence**: no finding of any rule, no failed transfer, ``audit`` exits 0 on the rank
  folders;
- **exactness**: the project's metrics equal SGLang's own ``/metrics`` where both count the
  same thing, and the pool occupancy equals the allocators' real state (read in the server's
  process) after the traffic and after a flush.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sglang_env import RELEASE, SERVER_INSTALLED, SERVER_REQUIRED, release_tuple

from hicache_obs._profiles import Profile
from hicache_obs.lab.sglang.server import (
    SERVER_ARGS,
    Conversations,
    ServerConfig,
    ServerFailed,
    SGLangServer,
    free_port,
    make_model,
    metric_samples,
    prefix_reuse,
    recompute,
)

pytestmark = pytest.mark.needs_sglang

needs_server = pytest.mark.skipif(
    not SERVER_INSTALLED, reason="SGLang's server packages are not installed here (make sglang-server)"
)

CURRENT = release_tuple() >= (0, 5, 23)
"""The release every test here runs on; 0.5.10 and 0.5.11 serve Llama only (below)."""
current_only = pytest.mark.skipif(not CURRENT, reason="run on SGLang 0.5.23: its hybrid models, TP and the demo")

LOGPROB_TOL = 5e-3
"""Greedy logprobs of a request served from host against its recompute. The tokens must be
equal; the logprobs differ a little because the two prefills are split differently (cached
prefix plus new tokens, against all at once) and float32 sums in another order. Measured:
below 1e-4 on Llama, up to 1.0e-3 on LFM2 and 1.6e-3 on NemotronH, whose decode steps on
SGLang's CPU path drift from a plain recurrence by up to 1e-2 (the tokens agree)."""


def test_server_installed_where_required() -> None:
    if SERVER_REQUIRED:
        assert SERVER_INSTALLED, f"HICACHE_REQUIRE_SGLANG_SERVER=1 but SGLang {RELEASE}'s server packages are missing"


class _Models(dict):  # type: ignore[type-arg]
    """Each tiny model made once, on first use."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def __missing__(self, kind: str) -> Path:
        self[kind] = path = make_model(kind, self.folder / kind)
        return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _Models(tmp_path_factory.mktemp("models"))


def _value(text: str, name: str, **labels: str) -> float:
    return sum(v for _, v in metric_samples(text, name, **labels))


def _quiet(server: SGLangServer, port: int, timeout: float = 60.0) -> tuple[str, str]:
    """Both /metrics once every submitted transfer has completed and nothing changes for a while."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        ours, theirs = server.metrics(port), server.metrics()
        now = (
            [_value(ours, "hicache_operations_total", direction=d, status=s) for d in ("d2h", "h2d")
             for s in ("submitted", "completed", "failed")],
            _value(ours, "hicache_events_total"),
            _value(theirs, "sglang:hicache_backup_tokens_total"),
            _value(theirs, "sglang:load_back_tokens_total"),
        )  # fmt: skip
        settled = now[0][0] == now[0][1] + now[0][2] and now[0][3] == now[0][4] + now[0][5]
        if settled and now == last:
            return ours, theirs
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics never settled: {now}{server.log_tail()}")
        last = now
        time.sleep(0.75)


def _check_occupancy(server: SGLangServer, ours: str) -> dict[str, tuple[int, int]]:
    """Each pool's used slots in our metrics equal what SGLang's allocators hold; returns them."""
    seen: dict[str, tuple[int, int]] = {}
    for controller in server.allocator_state():
        assert "error" not in controller, controller
        for key, state in controller["pools"].items():
            pool, tier = key.split("/")
            capacity = _value(ours, "hicache_pool_capacity_slots", pool=pool, tier=tier)
            used = _value(ours, "hicache_pool_used_slots", pool=pool, tier=tier)
            padding = capacity - state["size"]  # device pools: the padding slot (or page) SGLang never hands out
            assert 0 <= padding <= 64, (key, capacity, state)
            real = state["size"] - state["available"]
            assert used - padding == real, (
                f"{key}: our metrics say {used - padding} slots in use, SGLang's allocator {real}"
            )
            seen[key] = (int(used - padding), real)
    return seen


def _check_exact(ours: str, theirs: str) -> None:
    """Our counters equal SGLang's where both count the same thing. 0.5.23 has every figure
    below; 0.5.10 and 0.5.11 count loads without a pool label and have no backup counter."""
    for direction, name in (("d2h", "sglang:hicache_backup_tokens_total"), ("h2d", "sglang:load_back_tokens_total")):
        samples = metric_samples(theirs, name)
        assert samples or (not CURRENT and direction == "d2h"), f"SGLang's /metrics has no {name}"
        for labels, value in samples:
            pool = labels.get("pool")
            mine = _value(ours, "hicache_transfer_slots_total", direction=direction, **({"pool": pool} if pool else {}))
            assert mine == value, f"{direction} {pool}: hicache_transfer_slots_total {mine} != {name} {value}"
    compared = 0
    for mine, name in (
        (_value(ours, "hicache_transfer_bytes_total", direction="d2h"), "sglang:hicache_backup_bytes_total"),
        (_value(ours, "hicache_pool_capacity_slots", pool="kv", tier="host"), "sglang:hicache_host_total_tokens"),
        (
            _value(ours, "hicache_pool_capacity_slots", pool="mamba", tier="host"),
            "sglang:hicache_host_mamba_total_states",
        ),
    ):
        if metric_samples(theirs, name):
            assert mine == _value(theirs, name), name
            compared += 1
    assert compared >= 2 or not CURRENT, "0.5.23 reports the backup bytes and the host pool's size"
    assert _value(ours, "hicache_operations_total", status="failed") == 0
    assert _value(ours, "hicache_audit_violations_total") == 0
    assert _value(theirs, "sglang:hicache_dropped_tokens_total") == 0


def _audit(out: Path) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, "-m", "hicache_obs", "audit", str(out), "--json"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(run.stdout)  # type: ignore[no-any-return]


# Llama: every pair of (write policy, io backend, layout, page size) values in at least one
# server. LFM2: each policy and backend at least once; SGLang's Mamba host pool takes
# page_first (kernel) or page_first_direct (direct) only, and its Mamba prefix cache on a CPU
# (the no_buffer strategy) asserts page size 1 ("no_buffer only supports page_size=1").
# Mellum (sliding-window and full-attention layers: SGLang's SWA pool): each policy, each backend,
# each layout. NemotronH (Mamba2 layers: SGLang's Mamba pool): write-through on the kernel backend,
# write-back on the direct one.
CONFIGS = [
    ("llama", "write_through", "kernel", "page_first", 1),
    ("llama", "write_through", "direct", "layer_first", 16),
    ("llama", "write_through_selective", "kernel", "layer_first", 16),
    ("llama", "write_through_selective", "direct", "page_first", 1),
    ("llama", "write_back", "kernel", "page_first", 16),
    ("llama", "write_back", "direct", "layer_first", 1),
    ("llama", "write_through", "direct", "page_first_direct", 16),
    ("lfm2", "write_through", "kernel", "page_first", 1),
    ("lfm2", "write_through_selective", "direct", "page_first_direct", 1),
    ("lfm2", "write_back", "kernel", "page_first", 1),
    ("mellum", "write_through", "kernel", "page_first", 1),
    ("mellum", "write_back", "direct", "layer_first", 16),
    ("mellum", "write_through_selective", "direct", "page_first_direct", 1),
    ("nemotron_h", "write_through", "kernel", "page_first", 1),
    ("nemotron_h", "write_back", "direct", "page_first_direct", 1),
]
# 0.5.10 and 0.5.11: Llama, one server per policy. Their transformers (5.3.0) has no MellumConfig
# and refuses the NemotronH layer names make_model writes; LFM2 was not tried on them.
EARLIER_CONFIGS = [CONFIGS[0], CONFIGS[2], CONFIGS[5]]
# Every server above runs the launcher's default profile (metrics). These run the other two on
# the hybrid models, with every operation audited in full: under sampling at a share of 1 each
# op's device index tensors are held (weakly) while it is in flight and every device free is
# compared with them; under audit every allocation and free is read and checked.
PROFILE_CONFIGS = [
    pytest.param(*CONFIGS[13], Profile("sampling", 1.0), id="nemotron_h-sampling-1"),
    pytest.param(*CONFIGS[9], Profile("audit", 1.0), id="lfm2-write_back-audit"),
    pytest.param(*CONFIGS[11], Profile("sampling", 1.0), id="mellum-write_back-sampling-1"),
]


@needs_server
@pytest.mark.parametrize(
    ("model", "policy", "backend", "layout", "page", "profile"),
    [pytest.param(*c, None, id="-".join(map(str, c))) for c in (CONFIGS if CURRENT else EARLIER_CONFIGS)]
    + (PROFILE_CONFIGS if CURRENT else []),
)
def test_served_from_host_exact_and_silent(
    models: dict[str, Path],
    tmp_path: Path,
    model: str,
    policy: str,
    backend: str,
    layout: str,
    page: int,
    profile: Profile | None,
) -> None:
    config = ServerConfig(
        models[model], io_backend=backend, layout=layout, write_policy=policy, page_size=page,
        max_mamba_cache_size=48 if model in ("lfm2", "nemotron_h") else None, extra=SERVER_ARGS.get(model, ()),
    )  # fmt: skip
    port = free_port()
    fault = tmp_path / "skip-loads"
    out = tmp_path / "obs"
    with SGLangServer(
        config, tmp_path / "server.log", python=sys.executable, instrument_out=out, metrics_port=port,
        profile=profile, fault_file=fault,
    ) as server:  # fmt: skip
        first = prefix_reuse(server, turns=range(2))
        from_host = [t for t in first if t.cached_host > 0]
        assert len(from_host) >= 5, [(t.cached_device, t.cached_host) for t in first]
        ours, theirs = _quiet(server, port)
        _check_exact(ours, theirs)
        pools = _check_occupancy(server, ours)
        side = {"lfm2": "mamba", "nemotron_h": "mamba", "mellum": "swa"}.get(model)
        if side is not None:  # the short-conv state (Mamba pool) or sliding-window KV (SWA pool) moved both ways
            assert f"{side}/device" in pools and f"{side}/host" in pools, pools
            for direction in ("d2h", "h2d"):
                assert _value(ours, "hicache_transfer_slots_total", pool=side, direction=direction) > 0

        again = recompute(server, from_host)
        for served, fresh in zip(from_host, again):
            assert fresh.cached_tokens == 0
            assert served.output_ids == fresh.output_ids
            assert max(abs(a - b) for a, b in zip(served.logprobs, fresh.logprobs)) <= LOGPROB_TOL

        server.flush_cache()
        ours, theirs = _quiet(server, port)
        used = _check_occupancy(server, ours)
        assert used["kv/host"] == (0, 0)
        _check_exact(ours, theirs)

        # the negative control: the same traffic with loads that bring nothing back
        talk = Conversations()
        talk.turn(server, 0)
        _quiet(server, port)
        fault.touch()
        broken = [t for t in talk.turn(server, 1) if t.cached_host > 0]
        fault.unlink()
        assert len(broken) >= 5
        changed = [a for a, b in zip(broken, recompute(server, broken)) if a.output_ids != b.output_ids]
        assert len(changed) >= len(broken) // 2, "loads that copy nothing did not change the outputs"
        ours, _ = _quiet(server, port)
        events = _value(ours, "hicache_events_total")
    # the ranks ran the profile asked for: the share audited in full, and the launcher's line
    assert _value(ours, "hicache_audit_sample_ratio") == (0.0 if profile is None else profile.audit_sample)
    ran = "metrics" if profile is None else profile.name
    ran += f" {profile.audit_sample:g}" if profile is not None and profile.name == "sampling" else ""
    assert f"(rank 0, profile {ran})" in (tmp_path / "server.log").read_text()
    report = _audit(out)
    assert report["violations"] == []
    assert report["events"] == events


# ------------------------------------------------------------------ the views
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dashboards"))
from dashboard_checks import (  # noqa: E402  (the dashboard tests' helpers, in their own folder)
    committed_dashboards,
    panel_targets,
    require_binary,
    start_prometheus,
    stop_process,
)
from otlp_receiver import OtlpReceiver, span_attributes  # noqa: E402

JOB = "sglang-hicache"


def _prometheus_query(url: str, expr: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]  # type: ignore[no-any-return]


@needs_server
@current_only
def test_views_of_a_live_server(models: dict[str, Path], tmp_path: Path) -> None:
    """Every dashboard panel returns data from a real Prometheus scraping the instrumented
    server; spans reach an OTLP receiver; audit, inspect and export read the rank folders."""
    exe = require_binary("prometheus", "HICACHE_REQUIRE_PROMETHEUS")
    receiver = OtlpReceiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    port = free_port()
    out = tmp_path / "obs"
    server = SGLangServer(
        ServerConfig(models["lfm2"], max_mamba_cache_size=48), tmp_path / "server.log", instrument_out=out,
        metrics_port=port, otlp_endpoint=f"http://127.0.0.1:{receiver.server_address[1]}",
    )  # fmt: skip
    try:
        with server:
            proc, url, prom_log = start_prometheus(exe, tmp_path / "prometheus", f"127.0.0.1:{port}", JOB)
            try:
                deadline = time.monotonic() + 60
                while not _prometheus_query(url, f'up{{job="{JOB}"}} == 1'):  # scraping before the traffic
                    assert time.monotonic() < deadline, prom_log.read_text()[-3000:]
                    time.sleep(0.5)
                talk = Conversations()
                moved = f'sum(increase(hicache_transfer_duration_seconds_count{{job="{JOB}"}}[1m])) > 0'
                for n in range(6):  # until the scrapes saw transfers complete (rates need two samples)
                    talk.turn(server, n)
                    time.sleep(2.0)
                    if n >= 2 and _prometheus_query(url, moved):
                        break
                assert _prometheus_query(url, moved), prom_log.read_text()[-3000:]
                empty = []
                for name, board in committed_dashboards().items():
                    for panel, target in panel_targets(board):
                        expr = (
                            target["expr"].replace("$__rate_interval", "1m").replace("$instance", ".*")
                            .replace("$job", JOB)
                        )  # fmt: skip
                        values = [float(r["value"][1]) for r in _prometheus_query(url, expr)]
                        if not any(math.isfinite(v) for v in values):
                            empty.append(f"{name} / {panel['title']} / {target['refId']}: {values}")
                assert not empty, "panels without data:\n" + "\n".join(empty)
                ours, _ = _quiet(server, port)
            finally:
                stop_process(proc)
    finally:
        receiver.shutdown()
        receiver.server_close()
    completed = {d: _value(ours, "hicache_operations_total", direction=d, status="completed") for d in ("d2h", "h2d")}
    assert completed["d2h"] > 0 and completed["h2d"] > 0, completed
    spans = [span_attributes(s) for s in receiver.spans]
    by_direction = {d: sum(a.get("hicache.direction") == d for a in spans) for d in ("d2h", "h2d")}
    assert by_direction == completed, (by_direction, completed)
    assert all(a.get("hicache.unrecorded_indices") == 0 for a in spans)
    assert {p for a in spans for p in a.get("hicache.pools", [])} == {"kv", "mamba"}
    report = _audit(out)
    assert report["violations"] == [] and report["events"] > 0
    inspect = subprocess.run(
        [sys.executable, "-m", "hicache_obs", "inspect", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert inspect.returncode == 0, inspect.stderr
    trace = tmp_path / "trace.json"
    export = subprocess.run(
        [sys.executable, "-m", "hicache_obs", "export", str(out), "--chrome-trace", str(trace)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert export.returncode == 0, export.stderr
    assert len(json.loads(trace.read_text())["traceEvents"]) > 0


# ------------------------------------------------------------------ tensor parallelism
@needs_server
@current_only
def test_two_tensor_parallel_ranks(models: dict[str, Path], tmp_path: Path) -> None:
    """``--tp-size 2`` on the CPU (gloo; SGLang binds each rank's threads to a core): one log
    folder and one /metrics per rank (BASE + rank), one merged audit. Rank 1's port is taken by
    another program: one clear line says so, and the rank carries on with its log."""
    base = free_port()
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", base + 1))
    except OSError:
        taken.close()
        pytest.skip(f"port {base + 1} is in use: cannot stage the taken-port case")
    taken.listen()
    out = tmp_path / "obs"
    server = SGLangServer(
        ServerConfig(models["llama"], tp_size=2), tmp_path / "server.log", instrument_out=out, metrics_port=base,
        env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
    )  # fmt: skip
    try:
        with server:
            turns = prefix_reuse(server, turns=range(2))
            from_host = [t for t in turns if t.cached_host > 0]
            assert len(from_host) >= 5
            assert [t.output_ids for t in from_host] == [t.output_ids for t in recompute(server, from_host)]
            ours, theirs = _quiet(server, base)
            state = server.allocator_state(processes=2)
            assert sorted(s["tp_rank"] for s in state) == [0, 1]
            rank0 = next(s for s in state if s["tp_rank"] == 0)
            used = _value(ours, "hicache_pool_used_slots", pool="kv", tier="host")
            assert used == rank0["pools"]["kv/host"]["size"] - rank0["pools"]["kv/host"]["available"]
            for direction, name in (
                ("d2h", "sglang:hicache_backup_tokens_total"),
                ("h2d", "sglang:load_back_tokens_total"),
            ):
                assert _value(ours, "hicache_transfer_slots_total", pool="kv", direction=direction) == _value(
                    theirs, name, pool="kv", tp_rank="0"
                )
    finally:
        taken.close()
    log = server.log_path.read_text(errors="replace")
    said = [line for line in log.splitlines() if "hicache-obs: rank 1: cannot serve /metrics" in line]
    assert len(said) == 1, said
    assert f"127.0.0.1:{base + 1}" in said[0]
    assert sorted(p.name for p in out.iterdir()) == ["rank-0", "rank-1"]
    report = _audit(out)
    assert report["violations"] == []
    from hicache_obs.events._replay import replay

    res = replay(out)
    assert res.ranks == [0, 1]
    submitted = {r: sum(type(e).__name__ == "TransferSubmitted" and e.rank == r for e in res.events) for r in (0, 1)}
    assert submitted[0] == submitted[1] > 0, submitted


# ------------------------------------------------------------------ the demo
@needs_server
@current_only
def test_demo_engine_sglang_runs_the_real_server(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_obs", "demo", "--engine", "sglang", "--steps", "40", "--json", "--out", str(out),
         "--profile", "audit"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads(proc.stdout)
    assert (s["engine"], s["model"], s["served_model"], s["runtime"]) == ("sglang", "tiny_hybrid", "lfm2", "cpu")
    # the ranks ran the profile the demo was given (the launcher's default is metrics)
    assert (s["profile"], s["audit_sample"]) == ("audit", 1.0)
    from hicache_obs.events._replay import replay

    kinds = {type(e).__name__ for e in replay(out / "rank-0").events}
    assert "SlotsAllocated" in kinds  # only audit records allocations
    assert s["requests"] == 40 and s["ranks"] == [0]
    assert s["violations"] == {}
    assert s["data_intact"] is True and s["checked_requests"] > 0 and s["host_hit_tokens"] > 0
    assert s["operations"]["d2h"] > 0 and s["operations"]["h2d"] > 0
    assert s["failed_operations"] == {"d2h": 0, "h2d": 0}
    assert s["slots"]["mamba"]["d2h"] > 0 and s["slots"]["mamba"]["h2d"] > 0
    report = _audit(out)
    assert report["events"] == s["events"] and report["violations"] == []
    assert json.loads(Path(s["files"]["trace"]).read_text())["traceEvents"]
    # the demo stopped its server: nothing still serves the model it made
    left = subprocess.run(["pgrep", "-f", str(out / "model")], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--runtime", "sim", "runs SGLang's server on this machine's CPU"),
        ("--fault", "double-free", "injects nothing"),
        ("--model", "tiny_moe", "invalid choice"),
    ],
)
def test_demo_engine_sglang_refuses_in_one_line(tmp_path: Path, option: str, value: str, says: str) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_obs", "demo", "--engine", "sglang", option, value, "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


# ------------------------------------------------------------------ failure
@needs_server
def test_a_server_that_fails_to_start_says_which_stage_with_its_log(models: dict[str, Path], tmp_path: Path) -> None:
    server = SGLangServer(
        ServerConfig(models["llama"], extra=("--hicache-mem-layout-typo", "x")), tmp_path / "server.log",
        start_timeout=120,
    )  # fmt: skip
    with pytest.raises(ServerFailed) as failed:
        with server:
            pytest.fail("a server with an unknown flag came up")
    message = str(failed.value)
    assert message.startswith("start (llama kernel page_first write_through page 1 tp 1): the server exited with")
    assert "--- server log tail ---" in message and "--hicache-mem-layout-typo" in message
    assert server.process is not None and server.process.poll() is not None  # stopped, by its pid
    gone = subprocess.run(["pgrep", "-g", str(server.process.pid)], capture_output=True, text=True)
    assert gone.stdout == "", gone.stdout
