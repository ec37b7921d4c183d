"""instrument() on SGLang's real controllers: the events, the audit findings, detach."""

from __future__ import annotations

import gc

import pytest
import torch
from sglang_env import RELEASE, REQUIRED, release_tuple

from hicache_obs.core import ModelSpec
from hicache_obs.errors import IntegrationError
from hicache_obs.events import EventLog
from hicache_obs.events._audit import audit
from hicache_obs.events._schema import (
    IndicesMoved,
    OperationQueued,
    OperationsMerged,
    StreamRecorded,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
    expanded,
)
from hicache_obs.events._state import fold
from hicache_obs.exporters._prometheus import PrometheusSink
from hicache_obs.integrations.sglang import instrument, instrumentation_of

pytestmark = pytest.mark.needs_sglang

# 0.5.11 and later move and record every pool's indices (PR #22940 and its follow-ups)
FIXED = release_tuple() >= (0, 5, 11)


def test_sglang_installed_where_required() -> None:
    assert RELEASE is not None or not REQUIRED


def _build(spec: ModelSpec | None = None, **kw):  # type: ignore[no-untyped-def]
    from hicache_obs.lab.sglang.harness import build_controller

    return build_controller(spec or ModelSpec.tiny_hybrid(), **kw)


def _workload(h, nodes: int = 4, tokens: int = 32):  # type: ignore[no-untyped-def]
    """Back up ``nodes`` prefixes (KV + one Mamba slot each), evict them, load them back.

    Returns [(kv device in, kv device out, written KV, written Mamba, loaded Mamba slot)]."""
    hybrid = h.mamba_pool is not None
    written = []
    for i in range(nodes):
        kv = h.alloc_kv(tokens)
        h.fill_kv(kv, seed=i)
        mamba = h.alloc_mamba(1) if hybrid else None
        if mamba is not None:
            h.fill_mamba(mamba, seed=100 + i)
        host, transfer = h.write(kv, mamba, node_id=i)
        assert host is not None
        written.append((kv, mamba, host, transfer, h.read_kv(kv), h.read_mamba(mamba) if hybrid else None))
    h.controller.start_writing()
    assert h.reap() == nodes
    out = []
    for i, (kv, mamba, host, transfer, kv_data, mamba_data) in enumerate(written):
        h.clear_kv(kv)
        h.kv_allocator.free(kv)
        if mamba is not None:
            h.clear_mamba(mamba)
            h.mamba_allocator.free(mamba)
        dev, t = h.load(host, transfer.host_indices if transfer is not None else None, node_id=i)
        assert dev is not None
        out.append((dev, t, kv_data, mamba_data))
    h.controller.start_loading()
    assert h.reap() == 1
    return out


def _data_intact(h, loaded) -> bool:  # type: ignore[no-untyped-def]
    for dev, t, kv_data, mamba_data in loaded:
        if not torch.equal(h.read_kv(dev), kv_data):
            return False
        if mamba_data is not None:
            got = h.read_mamba(t.device_indices)
            if not all(torch.equal(a, b) for a, b in zip(got, mamba_data)):
                return False
    return True


def _counts(findings):  # type: ignore[no-untyped-def]
    out: dict[tuple[str, str], int] = {}
    for f in findings:
        out[(f.rule, f.pool)] = out.get((f.rule, f.pool), 0) + 1
    return out


def _observed_log():  # type: ignore[no-untyped-def]
    """A log with the live auditor and a Prometheus sink, as the launcher wires them."""
    from hicache_obs.events._audit import Auditor

    log = EventLog()
    Auditor().attach(log)
    sink = PrometheusSink(log=log)
    log.add_sink(sink)
    return log, sink


def _unrecorded(sink, pool: str) -> float:  # type: ignore[no-untyped-def]
    return sum(
        sink.registry.get_sample_value("hicache_unrecorded_indices_total", {"pool": pool, "role": r, "direction": d})
        or 0
        for r in ("host", "device")
        for d in ("d2h", "h2d")
    )


# ------------------------------------------------------------------ the required results
@pytest.mark.parametrize("profile", ["audit", "metrics"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_hybrid_release_findings(io_backend: str, profile: str) -> None:
    """The #22940 class in each profile: ``metrics`` keeps the stream rules."""
    h = _build(io_backend=io_backend)
    log, sink = _observed_log()
    instrument(h.controller, log=log, profile=profile)
    failed = None
    try:
        loaded = _workload(h)
    except RuntimeError as exc:  # the real kernels refuse CPU indices: the op fails at launch
        failed, loaded = exc, None
    log.flush()
    events = [e for e in expanded(log.events()) if type(e).__name__ != "AuditViolation"]
    findings = audit(events)
    counts = _counts(findings)
    assert _counts(e for e in log.events() if type(e).__name__ == "AuditViolation") == counts  # live as offline
    mamba_unrecorded, kv_unrecorded = _unrecorded(sink, "mamba"), _unrecorded(sink, "kv")
    if FIXED:
        assert failed is None
        assert findings == [], findings
        assert _data_intact(h, loaded)
        assert mamba_unrecorded == 0 and kv_unrecorded == 0
        recorded = {(e.pool, e.role) for e in events if isinstance(e, StreamRecorded)}
        if io_backend == "kernel":
            assert ("mamba", "device") in recorded and ("kv", "device") in recorded
        else:  # direct: every index tensor is on the CPU by submission, nothing needs a record
            assert recorded == set()
            assert all(t.device == "cpu" for e in events if isinstance(e, TransferSubmitted) for t in e.tensors)
        return
    # 0.5.10: only the anchor's indices are moved and recorded
    assert kv_unrecorded == 0
    assert not any(pool == "kv" for rule, pool in counts if rule == "unrecorded_index")
    recorded = {(e.pool, e.role) for e in events if isinstance(e, StreamRecorded)}
    assert not any(pool == "mamba" for pool, _ in recorded)
    if io_backend == "direct":
        assert failed is None
        assert counts.get(("unrecorded_index", "mamba"), 0) > 0, counts
        assert mamba_unrecorded > 0
        assert _data_intact(h, loaded)  # direct copies read indices synchronously: no corruption here
    else:
        # the Mamba host indices were never moved to the device: the kernel refuses them
        assert failed is not None and "indices must be a CUDA tensor" in str(failed)
        assert counts.get(("index_not_on_device", "mamba"), 0) >= 1, counts
        assert any(isinstance(e, TransferFailed) for e in events)


def test_events_follow_the_controllers_calls() -> None:
    h = _build(io_backend="direct")
    inst = instrument(h.controller)
    _workload(h, nodes=3)
    ev = inst.log.events()
    queued = [e for e in ev if isinstance(e, OperationQueued)]
    assert [e.direction for e in queued] == ["d2h"] * 3 + ["h2d"] * 3
    assert [e.node_id for e in queued] == [0, 1, 2, 0, 1, 2]
    merged = [e for e in ev if isinstance(e, OperationsMerged)]
    # writes start at once (one op each); the three loads merge into one
    assert [len(m.merged_ops) for m in merged] == [1, 1, 1, 3]
    submitted = [e for e in ev if isinstance(e, TransferSubmitted)]
    assert [s.op for s in submitted] == [m.op for m in merged]
    completed = [e for e in ev if isinstance(e, TransferCompleted)]
    assert [c.op for c in completed] == [s.op for s in submitted]
    # the direct backend moves the anchor's device indices to the CPU
    moves = [e for e in ev if isinstance(e, IndicesMoved)]
    assert moves and all(m.role == "device" and m.dst_device == "cpu" for m in moves if m.pool == "kv")
    assert dict(submitted[-1].slots_by_pool)["kv"] == 3 * 32
    # replay of the log equals what the controller holds
    state = fold(ev)
    assert state.queues == {"d2h": [], "h2d": []} and all(not a for a in state.acks.values())
    host_used = state.table("kv", "host").used
    assert host_used == h.kv_host.size - h.kv_host.available_size()
    dev_used = state.table("kv", "device").used
    assert dev_used == state.table("kv", "device").capacity - h.kv_allocator.available_size()


def test_stream_records_come_from_real_calls() -> None:
    # 0.5.10's hybrid kernel path fails at launch (unmoved Mamba host indices): use KV only there
    h = _build() if FIXED else _build(ModelSpec.tiny())
    inst = instrument(h.controller)
    kv = h.alloc_kv(16)
    # a record_stream outside any submission is not an event
    kv.record_stream(torch.Stream("cpu"))
    before = len(inst.log.events())
    h.write(kv, h.alloc_mamba(1) if h.mamba_pool is not None else None)
    recs = [e for e in inst.log.events()[before:] if isinstance(e, StreamRecorded)]
    sub = next(e for e in inst.log.events()[before:] if isinstance(e, TransferSubmitted))
    assert recs, "the controller's own record_stream calls were not observed"
    used = {(t.pool, t.role): t.ptr for t in sub.tensors}
    for r in recs:
        assert r.op == sub.op and r.stream == sub.stream
        assert used[(r.pool, r.role)] == r.tensor.ptr  # a record of a tensor the copy received


# --------------------------------------------------------------------- attach and detach
def test_detach_restores_the_controller() -> None:
    gc.collect()
    gc.disable()  # an earlier test's controller collected midway would change the observer's count
    try:
        _detach_restores()
    finally:
        gc.enable()


def _detach_restores() -> None:
    from hicache_obs.integrations.sglang._record_stream import RECORDS

    users = RECORDS.users  # instrumentations of earlier tests not yet collected
    h = _build() if FIXED else _build(io_backend="direct")
    c = h.controller
    before = dict(c.__dict__)
    record_stream = torch.Tensor.record_stream
    with instrument(c) as inst:
        assert instrumentation_of(c) is inst
        assert type(c.write_queue) is not list
        assert "record_stream" in torch.Tensor.__dict__ and RECORDS.users == users + 1
        _workload(h, nodes=2)
        n = len(inst.log.events())
    assert instrumentation_of(c) is None
    assert torch.Tensor.record_stream is record_stream and RECORDS.users == users
    if users == 0:
        assert "record_stream" not in torch.Tensor.__dict__
    assert set(c.__dict__) == set(before)
    for name in ("write_queue", "load_queue", "ack_write_queue", "ack_load_queue"):
        assert type(getattr(c, name)) is list
    assert "start_writing" not in c.__dict__ and "start_loading" not in c.__dict__
    for pool in (h.kv_host, h.mamba_host):
        if pool is not None:
            assert "alloc" not in pool.__dict__ and "free" not in pool.__dict__
    # behaves as before, and reports nothing more
    loaded = _workload(h, nodes=2)
    assert _data_intact(h, loaded)
    assert len(inst.log.events()) == n


def test_two_controllers_stay_apart() -> None:
    a, b = _build(io_backend="direct"), _build(io_backend="direct")
    ia, ib = instrument(a.controller, log=EventLog(rank=0)), instrument(b.controller, log=EventLog(rank=1))
    try:
        na = len(ia.log.events())
        nb = len(ib.log.events())
        _workload(a, nodes=2)
        assert len(ib.log.events()) == nb
        grew = len(ia.log.events()) - na
        _workload(b, nodes=3)
        assert len(ia.log.events()) == na + grew
        assert sum(isinstance(e, TransferSubmitted) for e in ia.log.events()) == 3
        assert sum(isinstance(e, TransferSubmitted) for e in ib.log.events()) == 4
    finally:
        ia.detach()
        ib.detach()


def test_refuses_what_it_cannot_instrument() -> None:
    for bad in (None, 3, "controller"):
        with pytest.raises(IntegrationError, match="needs an SGLang HiCache controller"):
            instrument(bad)
    with pytest.raises(IntegrationError, match=r"write_queue \(a list\).*start_writing"):
        instrument(object())
    h = _build()
    c = h.controller
    with pytest.raises(IntegrationError, match="log must be an EventLog"):
        instrument(c, log=[])  # type: ignore[arg-type]
    # an unknown shape: the ack queue is not a list; nothing may be changed
    saved = c.ack_write_queue
    c.ack_write_queue = tuple(saved)
    with pytest.raises(IntegrationError, match="ack_write_queue"):
        instrument(c)
    assert type(c.write_queue) is list and "start_writing" not in c.__dict__
    c.ack_write_queue = saved
    inst = instrument(c)
    with pytest.raises(IntegrationError, match="already instrumented"):
        instrument(c)
    inst.detach()
    inst.detach()  # idempotent


def test_plain_controller() -> None:
    h = _build(ModelSpec.tiny())
    inst = instrument(h.controller)
    loaded = _workload(h, nodes=3)
    assert _data_intact(h, loaded)
    assert audit(inst.log.events()) == []
    pools = {t.pool for e in inst.log.events() if isinstance(e, TransferSubmitted) for t in e.tensors}
    assert pools == {"kv"}


def test_a_failing_log_never_breaks_the_controller() -> None:
    h = _build() if FIXED else _build(io_backend="direct")
    log = EventLog()
    inst = instrument(h.controller, log=log)

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the log refuses every event")

    log.emit = refuse  # type: ignore[method-assign]  # a broken sink chain, a full disk, ...
    loaded = _workload(h, nodes=2)  # SGLang carries on
    assert _data_intact(h, loaded)
    assert inst.errors > 0
    inst.detach()


def test_a_copy_hook_that_fails_is_counted_and_the_copy_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading what a pool's copy received runs inside SGLang's copy call: a failure there
    is counted, and the copy itself runs as it would bare (the data arrives)."""
    from hicache_obs.integrations.sglang import _adapter as adapter

    def unreadable(*args: object) -> None:
        raise RuntimeError("the copy's index tensors cannot be read")

    monkeypatch.setattr(adapter, "received", unreadable)  # what the copy hook calls
    h = _build() if FIXED else _build(io_backend="direct")
    inst = instrument(h.controller)
    loaded = _workload(h, nodes=2)
    assert _data_intact(h, loaded)
    pools = 2 if h.mamba_pool is not None else 1
    assert inst.errors >= 2 * pools  # at least each write's copy of each pool (loads copy per layer)
    # the submissions are still logged, with no use of any tensor (none could be read)
    submitted = [e for e in inst.log.events() if isinstance(e, TransferSubmitted)]
    assert submitted and all(e.tensors == () for e in submitted)
    inst.detach()


def test_the_adapter_reads_tensors_without_torch_function_dispatch() -> None:
    """The adapter's own reads of index tensors (sizes, devices, values) never run a torch
    function mode or a subclass's ``__torch_function__``: under a process-wide mode (a tracer,
    the harness's CUDA stand-in) each would run in Python. Only the calls SGLang makes
    through the adapter's wrappers (its ``record_stream``, a pool's own ``.to()``) pass."""
    import sys

    from torch.overrides import TorchFunctionMode

    from hicache_obs.integrations.sglang import _adapter as adapter
    from hicache_obs.integrations.sglang import _record_stream as record_stream
    from hicache_obs.integrations.sglang import _tensor_facts as facts

    ours = {adapter.__file__, facts.__file__, record_stream.__file__}
    callers: dict[str, int] = {}
    seen = [0]

    class Callers(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen[0] += 1
            frame = sys._getframe(1)
            if frame.f_code.co_filename in ours:
                callers[frame.f_code.co_name] = callers.get(frame.f_code.co_name, 0) + 1
            return func(*args, **(kwargs or {}))

    h = _build() if FIXED else _build(io_backend="direct")  # 0.5.10's kernel path refuses host Mamba indices
    inst = instrument(h.controller)
    with Callers():
        loaded = _workload(h, nodes=3)
    assert _data_intact(h, loaded)
    assert inst.errors == 0 and len(inst.log) > 0
    inst.detach()
    assert set(callers) <= {"record_stream", "call"}, callers
    assert seen[0] > 100  # the mode was on, and saw SGLang's own calls


def test_a_failing_description_never_breaks_the_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading an index tensor's values (allocations, frees, tensor descriptions) may fail
    on a tensor SGLang can use but the adapter cannot read: counted, never raised."""
    from hicache_obs.integrations.sglang import _tensor_facts as facts

    h = _build() if FIXED else _build(io_backend="direct")
    inst = instrument(h.controller)

    def unreadable(t: torch.Tensor) -> None:
        raise RuntimeError("these index values cannot be read")

    monkeypatch.setattr(facts, "_facts", unreadable)  # the one-call read (DLPack) of a description
    monkeypatch.setattr(facts, "_TO_DLPACK", unreadable)  # and of an allocation or free
    monkeypatch.setattr(facts, "host_values", unreadable)  # and the tensor's own methods
    loaded = _workload(h, nodes=2)  # SGLang carries on: allocs, frees, copies
    assert _data_intact(h, loaded)
    assert inst.errors > 0
    inst.detach()
