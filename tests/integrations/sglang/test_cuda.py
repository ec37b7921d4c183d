"""SGLang's real controllers on a GPU: ``build_controller(device="cuda")`` and
``hicache-obs demo --engine sglang-controller --runtime cuda``.

A process is prepared for one device (the CPU harness's torch function mode would
turn CUDA tensors into stand-ins), and the rest of this suite prepares the CPU one:
the GPU runs go to a process of their own. The refusals run everywhere.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from audit_counts import violation_counts
from sglang_env import RELEASE, needs_mamba_layout, release_tuple

from hicache_obs.core._spec import ModelSpec
from hicache_obs.errors import ConfigError, IntegrationError
from hicache_obs.events._audit import audit
from hicache_obs.events._replay import replay
from hicache_obs.events._schema import StreamRecorded, TransferCompleted, TransferFailed, TransferSubmitted
from hicache_obs.lab.sglang import harness

FIXED = release_tuple() >= (0, 5, 11)
STEPS = "30"
SGLANG_STREAMS = {"device_to_host_stream", "host_to_device_stream", "write_stream", "load_stream"}


def _run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout)


_CUDA_ONLY = [False]


@pytest.fixture(autouse=True)
def _session_marks(request: pytest.FixtureRequest) -> None:
    _CUDA_ONLY[0] = request.config.option.markexpr == "cuda"


def _here() -> bool:
    """Whether the GPU runs can go in this process: it is prepared for the GPU already, or for
    nothing yet in a run of ``-m cuda`` alone (no CPU-harness test comes after). Else each goes
    to a process of its own, so this one stays as the other tests need it."""
    ready = harness._state.get("ready")
    return ready == "cuda" or (ready is None and _CUDA_ONLY[0])


def _python(code: str) -> str:
    """Run ``code`` here where the process can build GPU controllers, else in a new process; its stdout."""
    if _here():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, "<gpu check>", "exec"), {})
        return buf.getvalue()
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _demo_on_gpu(out: Path, *options: str) -> dict[str, Any]:
    argv = ["demo", "--engine", "sglang-controller", "--runtime", "cuda", "--steps", STEPS, "--json", "--out", str(out), *options]
    code = f"import sys; from hicache_obs.cli import main; rc = main({argv!r}); sys.stdout.flush(); assert rc == 0, rc"
    s: dict[str, Any] = json.loads(_python(code))
    assert s["runtime"] == "cuda"
    return s


# ------------------------------------------------------------------ everywhere
def test_an_unknown_device_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"device must be one of cpu, cuda, got 'tpu'"):
        harness.build_controller(ModelSpec.tiny(), device="tpu")
    with pytest.raises(ConfigError, match=r"device must be one of cpu, cuda, got 'gpu'"):
        harness.prepare("gpu")


def test_sgl_kernel_names_imported_on_a_gpu_are_placeholders_and_nothing_more() -> None:
    code = """
import importlib, json
from hicache_obs.errors import IntegrationError
from hicache_obs.lab.sglang import harness, kernels
inst = kernels.install()
if "sgl_kernel" not in inst.stand_ins:
    print(json.dumps({"real": True})); raise SystemExit(0)
harness._name_missing_ops(inst)
out = {"real": False}
from sgl_kernel import moe_sum_reduce
from sgl_kernel.quantization import ggml_dequantize
from sgl_kernel.kvcacheio import transfer_kv_direct  # the stand-in ops, as before
out["names"] = [moe_sum_reduce.__name__, ggml_dequantize.__module__ + "." + ggml_dequantize.__name__]
try:
    moe_sum_reduce(1, 2)
except IntegrationError as exc:
    out["called"] = str(exc)
for stmt in ("from sgl_kernel import not_a_kernel_name", "import sgl_kernel.scalar_type",
             "from sgl_kernel.kvcacheio import get_device_accessible_ptr"):
    try:
        exec(stmt)
        out[stmt] = "imported"
    except ImportError as exc:
        out[stmt] = type(exc).__name__
print(json.dumps(out))
"""
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    if r["real"]:
        pytest.skip("sgl-kernel is installed here: nothing stands in for it")
    assert r["names"] == ["moe_sum_reduce", "sgl_kernel.quantization.ggml_dequantize"]
    assert r["called"] == "sgl_kernel.moe_sum_reduce is not installed here: hicache-obs stands in for sgl_kernel.kvcacheio only"
    # what SGLang tries inside try/except ImportError keeps failing so: its fallbacks run
    assert r["from sgl_kernel import not_a_kernel_name"] == "ImportError"
    assert r["import sgl_kernel.scalar_type"] == "ModuleNotFoundError"
    assert r["from sgl_kernel.kvcacheio import get_device_accessible_ptr"] == "ImportError"


@pytest.mark.needs_sglang
def test_a_process_prepared_for_the_cpu_builds_no_gpu_controller() -> None:
    harness.prepare("cpu")
    with pytest.raises(IntegrationError, match=r"prepared SGLang for device 'cpu'; a 'cuda' harness needs a process"):
        harness.build_controller(ModelSpec.tiny_hybrid(), device="cuda")
    harness.prepare()  # None: as prepared
    assert harness.build_controller(ModelSpec.tiny()).device == "cpu"


@pytest.mark.needs_sglang
def test_the_cpu_harness_copies_with_the_stand_ins() -> None:
    harness.prepare("cpu")
    sources = harness.kernel_sources()
    assert sources and set(sources.values()) == {"stand-in"}, sources
    assert any(name.startswith("transfer_kv_") for name in sources)
    if release_tuple() >= (0, 5, 23):  # SGLang's JIT Mamba copies: bound in the Mamba host pool's module
        assert {"transfer_kv_mamba_lf_pf", "transfer_kv_mamba_pf_lf"} <= set(sources), sources


@pytest.mark.needs_sglang
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_one_line_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run("-m", "hicache_obs", "demo", "--engine", "sglang-controller", "--runtime", "cuda", "--out", str(out))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "hicache-obs: error: --runtime cuda: no CUDA device here (torch.cuda.is_available() is False)\n"
    assert not out.exists()
    code = "from hicache_obs.lab.sglang.harness import prepare; prepare('cuda')"
    proc = _run("-c", code)
    assert proc.returncode == 1
    assert "ConfigError: device 'cuda' needs a CUDA device: torch.cuda.is_available() is False here" in proc.stderr


# ------------------------------------------- the CPU harness as the adapter sees a GPU
@pytest.fixture
def device_values_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Index tensors that report CUDA have no readable values, as on a GPU (a read would sync)."""
    from hicache_obs.integrations.sglang import _tensor_facts as facts

    real = facts.host_values
    monkeypatch.setattr(facts, "host_values", lambda t: None if t.is_cuda else real(t))


def _demo_json(capsys: pytest.CaptureFixture[str], out: Path, *options: str) -> dict[str, Any]:
    from hicache_obs.cli import main

    capsys.readouterr()
    code = main(["demo", "--engine", "sglang-controller", "--steps", STEPS, "--json", "--out", str(out), *options])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(stdout)  # type: ignore[no-any-return]


@pytest.mark.needs_sglang
def test_device_slots_a_gpu_hides_are_left_out_not_misread(device_values_unreadable: None) -> None:
    from hicache_obs.events._log import EventLog
    from hicache_obs.events._schema import PoolCreated, SlotsAllocated, SlotsFreed
    from hicache_obs.integrations.sglang import instrument

    h = harness.build_controller(ModelSpec.tiny_hybrid(), io_backend="direct")
    log = EventLog()
    with instrument(h.controller, log=log) as inst:
        assert inst.unseen_slot_tiers == {("kv", "device"), ("mamba", "device")}
        kv = h.alloc_kv(h.spec.page_size)
        mamba = h.alloc_mamba(1)
        assert h.write(kv, mamba)[0] is not None
        h.controller.start_writing()
        assert h.reap() == 1
        h.kv_allocator.free(kv)
    events = log.events()
    tiers = {(e.pool, e.tier) for e in events if isinstance(e, (PoolCreated, SlotsAllocated, SlotsFreed))}
    assert tiers == {("kv", "host"), ("mamba", "host")}
    findings = violation_counts(audit(events))
    assert not any(rule.startswith("slot") for rule in findings), findings
    if FIXED:
        assert findings == {}


@pytest.mark.needs_sglang
def test_a_free_of_a_write_in_flight_is_seen_where_device_slots_are_hidden(device_values_unreadable: None) -> None:
    """As on a GPU: no device slot is read, and the use after free is seen from the tensor."""
    from hicache_obs.events._log import EventLog
    from hicache_obs.events._schema import IndicesFreed
    from hicache_obs.integrations.sglang import instrument

    h = harness.build_controller(ModelSpec.tiny(), io_backend="kernel")
    log = EventLog()
    with instrument(h.controller, log=log) as inst:
        assert ("kv", "device") in inst.unseen_slot_tiers
        kv = h.alloc_kv(2 * h.spec.page_size)
        assert h.write(kv)[0] is not None
        h.controller.start_writing()
        h.kv_allocator.free(kv)  # the write is in flight: its ack is not taken
        assert h.reap() == 1
        other = h.alloc_kv(h.spec.page_size)
        h.kv_allocator.free(other)  # no op uses it: nothing
    events = log.events()
    freed = [e for e in events if isinstance(e, IndicesFreed)]
    assert [(e.pool, e.tier, e.tensor.indices) for e in freed] == [("kv", "device", None)]
    assert [(f.rule, f.pool, f.role) for f in audit(events)] == [("slot_not_allocated", "kv", "device")]
    assert inst.errors == 0


@pytest.mark.needs_sglang
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_the_demo_drives_the_same_run_when_device_slots_are_hidden(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io_backend: str
) -> None:
    if io_backend == "kernel":
        needs_mamba_layout("page_first")  # the demo's hybrid model with the kernel backend
    seen = _demo_json(capsys, tmp_path / "seen", "--io-backend", io_backend)
    from hicache_obs.integrations.sglang import _tensor_facts as facts

    real = facts.host_values
    monkeypatch.setattr(facts, "host_values", lambda t: None if t.is_cuda else real(t))
    hidden = _demo_json(capsys, tmp_path / "hidden", "--io-backend", io_backend)
    # the engine asks SGLang's allocators for the free device slots: evictions, loads and
    # findings are those of the run that saw every slot
    for key in ("operations", "failed_operations", "evictions", "hit_rate", "violations", "data_intact"):
        assert hidden[key] == seen[key], key
    assert hidden["events"] < seen["events"]  # no device-tier slot events


@pytest.mark.needs_sglang
def test_a_write_whose_host_pool_takes_cpu_host_indices_says_so() -> None:
    from hicache_obs.events._log import EventLog
    from hicache_obs.integrations.sglang import instrument

    # the kernel backend of 0.5.10's hybrid controller refuses every write (SGLang #24121)
    h = harness.build_controller(ModelSpec.tiny_hybrid() if FIXED else ModelSpec.tiny())
    log = EventLog()
    with instrument(h.controller, log=log):
        kv = h.alloc_kv(h.spec.page_size)
        host, t = h.write(kv, h.alloc_mamba(1) if h.mamba_pool is not None else None)
        h.controller.start_writing()
        assert h.reap() == 1
        h.load(host, t.host_indices if t is not None else None)
        h.controller.start_loading()
        assert h.reap() == 1
    said = {e.direction: e.host_indices_on_cpu for e in log.events() if isinstance(e, TransferSubmitted)}
    # 0.5.23's host pools declare a staged write-back (can_use_write_back_jit): the Mamba pool's
    # always, the KV pool's where its CUDA kernel builds (a GPU); the releases before have none
    pools = (("kv", h.kv_host), ("mamba", h.mamba_host))
    staged = {name for name, pool in pools if getattr(pool, "can_use_write_back_jit", False)}
    if release_tuple() >= (0, 5, 23) or release_tuple() <= (0, 5, 13):
        assert said == {"d2h": tuple(sorted(staged)), "h2d": ()}, said
        assert staged == ({"mamba"} if release_tuple() >= (0, 5, 23) else set())
    else:  # 0.5.14 to 0.5.22: where the group's flag (all its pools') is off, the controller
        # moves the host indices to the device before the Mamba pool's copy sees them
        assert set(said["d2h"]) <= staged and said["h2d"] == (), said
    assert audit(log.events()) == []


# ------------------------------------------------------------------ on a GPU
@pytest.mark.cuda
@pytest.mark.needs_sglang
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.skipif(RELEASE is not None and not FIXED, reason="0.5.10 is the pre-#22940 code: see the 0.5.10 tests")
def test_fixed_release_on_a_gpu_is_clean_and_intact(tmp_path: Path, io_backend: str) -> None:
    out = tmp_path / "out"
    s = _demo_on_gpu(out, "--io-backend", io_backend)
    assert s["violations"] == {}
    assert s["data_intact"] is True and s["corrupted_slots"] == [] and s["checked_slots"] > 0
    assert s["operations"]["d2h"] > 0 and s["operations"]["h2d"] > 0
    assert s["failed_operations"] == {"d2h": 0, "h2d": 0}
    assert s["slots"]["mamba"]["d2h"] > 0 and s["slots"]["mamba"]["h2d"] > 0
    events = replay(out).events
    assert audit(events) == []
    subs = [e for e in events if isinstance(e, TransferSubmitted)]
    assert subs and {e.stream for e in subs} <= SGLANG_STREAMS
    records = [e for e in events if isinstance(e, StreamRecorded)]
    if io_backend == "direct":
        # the direct copies take every index on the CPU (SGLang moves device indices there):
        # nothing on a side stream to record, and SGLang records nothing
        assert all(t.device == "cpu" for e in subs for t in e.tensors)
        assert records == []
    else:
        # SGLang's own record_stream calls on CUDA tensors, onto its CUDA side streams
        assert records and {e.stream for e in records} <= SGLANG_STREAMS
        assert all(r.tensor.device.startswith("cuda") for r in records)
        # a write whose KV host indices stayed on the CPU went through the staged write-back
        for e in subs:
            if any(t.pool == "kv" and t.role == "host" and t.device == "cpu" for t in e.tensors):
                assert e.direction == "d2h" and "kv" in e.host_indices_on_cpu, e
    done = sum(isinstance(e, TransferCompleted) for e in events)
    assert done == s["operations"]["d2h"] + s["operations"]["h2d"]


@pytest.mark.cuda
@pytest.mark.needs_sglang
@pytest.mark.skipif(RELEASE is not None and FIXED, reason="the pre-#22940 findings are 0.5.10's")
def test_sglang_0_5_10_on_a_gpu_leaves_mamba_indices_unrecorded(tmp_path: Path) -> None:
    out = tmp_path / "out"
    s = _demo_on_gpu(out, "--io-backend", "direct")
    assert s["violations"].get("unrecorded_index", {}).get("mamba", 0) > 0, s["violations"]
    assert not any("kv" in pools for pools in s["violations"].values()), s["violations"]
    assert s["operations"]["d2h"] > 0 and s["operations"]["h2d"] > 0
    assert violation_counts(audit(replay(out).events)) == s["violations"]


@pytest.mark.cuda
@pytest.mark.needs_sglang
@pytest.mark.skipif(RELEASE is not None and FIXED, reason="the pre-#22940 findings are 0.5.10's")
def test_sglang_0_5_10_kernel_copies_on_a_gpu_refuse_the_host_indices(tmp_path: Path) -> None:
    out = tmp_path / "out"
    s = _demo_on_gpu(out)
    assert s["io_backend"] == "kernel"
    assert s["failed_operations"]["d2h"] > 0
    assert s["violations"].get("index_not_on_device", {}).get("mamba", 0) > 0, s["violations"]
    assert not any("kv" in pools for pools in s["violations"].values()), s["violations"]
    errors = {e.error for e in replay(out).events if isinstance(e, TransferFailed)}
    assert errors and all("Destination indices must be a CUDA tensor" in e for e in errors), errors


@pytest.mark.cuda
@pytest.mark.needs_sglang
def test_gpu_harness_round_trips_and_names_its_kernels() -> None:
    code = """
import json, torch
from hicache_obs.core._spec import ModelSpec
from hicache_obs.integrations.sglang import instrument
from hicache_obs.lab.sglang.harness import build_controller, kernel_sources
h = build_controller(ModelSpec.tiny(), device="cuda")
with instrument(h.controller) as inst:
    kv = h.alloc_kv(2 * h.spec.page_size)
    h.fill_kv(kv, seed=7)
    want = h.read_kv(kv)
    host = h.write(kv)[0]
    h.controller.start_writing()
    torch.cuda.synchronize()
    h.reap()
    h.clear_kv(kv)
    h.kv_allocator.free(kv)
    back = h.load(host)[0]
    h.controller.start_loading()
    torch.cuda.synchronize()
    h.reap()
    got = h.read_kv(back)
    kinds = sorted({type(e).__name__ for e in inst.log.events()})
pinned = bool(h.kv_host.kv_buffer.is_pinned())
h.close()  # gives back the host memory SGLang registered with CUDA
h.close()  # idempotent
print(json.dumps({"equal": bool(torch.equal(want, got)), "kv_device": str(h.kv_pool.k_buffer[0].device),
                  "pinned": pinned, "kernels": kernel_sources(), "kinds": kinds}))
"""
    r = json.loads(_python(code).strip().splitlines()[-1])
    assert r["equal"] is True
    assert r["kv_device"].startswith("cuda") and r["pinned"] is True
    assert r["kernels"] and all(v == "stand-in" or v.startswith(("sgl_kernel", "sglang")) for v in r["kernels"].values())
    assert {"TransferSubmitted", "TransferCompleted", "StreamRecorded", "SlotsAllocated"} <= set(r["kinds"])


IN_FLIGHT_FREE = """
import json
import torch
from hicache_obs.core._spec import ModelSpec
from hicache_obs.events import EventLog
from hicache_obs.events._audit import audit
from hicache_obs.events._schema import IndicesFreed, SlotsFreed
from hicache_obs.integrations.sglang import instrument
from hicache_obs.lab.sglang import harness

h = harness.build_controller(ModelSpec.tiny(), io_backend="kernel", device="cuda")
log = EventLog()
inst = instrument(h.controller, log=log)
kv = h.alloc_kv(2 * h.spec.page_size)
host = h.controller.write(kv, node_id=3)
h.controller.start_writing()
h.kv_allocator.free(kv)  # the write's ack is not taken: the op is in flight
h.reap(wait=True)
log.flush()
events = log.events()
freed = [e for e in events if isinstance(e, IndicesFreed)]
print(json.dumps({
    "unseen": sorted(map(list, inst.unseen_slot_tiers)),
    "findings": [[f.rule, f.pool, f.role, f.direction] for f in audit(events)],
    "indices_freed": [[e.pool, e.tier, e.tensor.device, e.tensor.indices is None] for e in freed],
    "device_slot_frees": sum(isinstance(e, SlotsFreed) and e.tier == "device" for e in events),
    "errors": inst.errors,
}))
h.close()
"""


@pytest.mark.cuda
@pytest.mark.needs_sglang
def test_a_free_of_a_write_in_flight_is_seen_on_a_gpu_without_reading_the_indices() -> None:
    """The device tier's slots are not read on a GPU (its free lists are there): the use after
    free is seen from the tensor the free was handed, the very one the write received."""
    r = json.loads(_python(IN_FLIGHT_FREE).strip().splitlines()[-1])
    assert ["kv", "device"] in r["unseen"] and r["device_slot_frees"] == 0
    assert r["findings"] == [["slot_not_allocated", "kv", "device", "d2h"]]
    assert r["indices_freed"] == [["kv", "device", "cuda:0", True]]
    assert r["errors"] == 0
