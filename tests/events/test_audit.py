"""The auditor: each rule triggered by a real faulty controller, silent on the real one."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch
from event_workloads import fill, hybrid_round_trip, run_workload

from hicache_obs.core import ModelSpec, PoolTransfer
from hicache_obs.events import AuditViolation, TransferSubmitted
from hicache_obs.events._audit import RULES, Auditor, Finding, audit
from hicache_obs.events._schema import FreeRefused, IndicesMisplaced, PoolCreated, TensorRef
from hicache_obs.testing import make_controller


def _audited(fault: str | None, spec: ModelSpec | None = None, **kw):
    c = make_controller(spec, fault=fault, device_size=512, **kw)
    auditor = Auditor().attach(c.log)
    return c, auditor


def _pairs(findings: list[Finding]) -> set[tuple[str, str, str]]:
    return {(f.rule, f.pool, f.role) for f in findings}


def _hybrid_round_trip(c, **kw) -> None:
    hybrid_round_trip(c, with_data=True, **kw)


@pytest.mark.parametrize("backend", ["kernel", "direct"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("spec", [ModelSpec.tiny(), ModelSpec.tiny_hybrid(), ModelSpec.tiny_swa()], ids=lambda s: s.name)
def test_real_controller_is_clean(spec: ModelSpec, backend: str, layout: str) -> None:
    c, auditor = _audited(None, spec, io_backend=backend, layout=layout)
    run_workload(c, rounds=4)
    c.close()
    assert auditor.finish() == []
    assert audit(c.log.events()) == []
    assert not [e for e in c.log.events() if isinstance(e, AuditViolation)]


def test_unrecorded_pool_indices_flags_mamba_host_and_device_never_kv() -> None:
    c, auditor = _audited("unrecorded-pool-indices", io_backend="kernel")
    _hybrid_round_trip(c)
    found = auditor.finish()
    assert _pairs(found) == {("unrecorded_index", "mamba", "device"), ("unrecorded_index", "mamba", "host")}
    assert {f.direction for f in found} == {"d2h", "h2d"}
    assert {f.stream for f in found} == {"hicache-write", "hicache-load"}
    for f in found:
        assert "without record_stream" in f.detail and f.stream in f.detail
    violations = [e for e in c.log.events() if isinstance(e, AuditViolation)]
    assert len(violations) == len(found) == 4
    assert all(v.pool == "mamba" for v in violations)


def test_unmoved_pool_indices_flags_the_pools_host_indices() -> None:
    c, auditor = _audited("unmoved-pool-indices", io_backend="kernel")
    _hybrid_round_trip(c)
    found = auditor.finish()
    assert ("index_not_on_device", "mamba", "host") in _pairs(found)
    assert not [f for f in found if f.pool == "kv"]
    assert all(f.rule == "index_not_on_device" for f in found)
    # the kernel refused the CPU indices: both transfers failed, as SGLang's kernel raises
    failed = [e for e in c.log.events() if type(e).__name__ == "TransferFailed"]
    assert len(failed) == 2 and "Destination indices must be a device tensor" in failed[0].error


def test_host_indices_not_moved_flags_kv_host() -> None:
    c, auditor = _audited("host-indices-not-moved", ModelSpec.tiny(), io_backend="kernel")
    run_workload(c, rounds=1)
    assert _pairs(auditor.finish()) == {("index_not_on_device", "kv", "host")}


def test_length_mismatch() -> None:
    c, auditor = _audited("length-mismatch", ModelSpec.tiny(), io_backend="kernel")
    run_workload(c, rounds=1)
    found = auditor.finish()
    assert ("length_mismatch", "kv", "*") in _pairs(found)
    assert "32 host indices vs 31 device indices" in next(f for f in found if f.rule == "length_mismatch").detail


def test_use_after_free_is_slot_not_allocated() -> None:
    c, auditor = _audited("use-after-free", io_backend="kernel")
    _hybrid_round_trip(c, evict_host_first=True)
    found = auditor.finish()
    assert ("slot_not_allocated", "kv", "host") in _pairs(found)
    assert {f.rule for f in found} == {"slot_not_allocated"}
    f = next(f for f in found if f.pool == "kv")
    assert "host slots [0, 1, 2" in f.detail


def test_double_free() -> None:
    c, auditor = _audited("double-free", io_backend="kernel")
    _hybrid_round_trip(c, evict_host_first=True, double_evict=True)
    found = auditor.finish()
    assert _pairs(found) == {("double_free", "kv", "host")}
    assert "already free" in found[0].detail


def test_incomplete_operation_at_log_end() -> None:
    c, auditor = _audited(None, ModelSpec.tiny())
    kv = c.alloc_device(32)
    c.write(kv, node_id=1)  # submitted, never polled: the process "died" here
    found = audit(c.log.events())
    assert [(f.rule, f.op) for f in found] == [("incomplete_operation", 0)]
    assert "never completed" in found[0].detail
    assert auditor.finish() == found


@pytest.mark.parametrize(
    "fault", ["unrecorded-pool-indices", "unmoved-pool-indices", "host-indices-not-moved", "length-mismatch", "use-after-free"]
)
def test_live_and_offline_audits_agree(fault: str) -> None:
    c, auditor = _audited(fault, io_backend="kernel")
    _hybrid_round_trip(c, evict_host_first=(fault == "use-after-free"))
    run_workload(c, rounds=2) if fault != "use-after-free" else None
    live = auditor.finish()
    offline = audit(c.log.events())
    assert live, "the fault must produce findings"
    assert [f.key() for f in live] == [f.key() for f in offline]
    assert [f.detail for f in live] == [f.detail for f in offline]


def test_every_rule_is_covered_by_a_fault() -> None:
    seen: set[str] = set()
    for fault, kw in [
        ("unrecorded-pool-indices", {}),
        ("unmoved-pool-indices", {}),
        ("length-mismatch", {}),
        ("use-after-free", {"evict_host_first": True}),
        ("double-free", {"evict_host_first": True, "double_evict": True}),
    ]:
        c, auditor = _audited(fault)
        _hybrid_round_trip(c, **kw)
        seen |= {f.rule for f in auditor.finish()}
    c, _ = _audited(None)
    c.write(c.alloc_device(32), node_id=0, pool_transfers=[])
    seen |= {f.rule for f in audit(c.log.events())}
    # this controller registers no pool that moves with another's slots; SGLang's does (a draft
    # model's KV: tests/integrations/sglang/test_draft_pools.py): the same ops, saying it had one
    c, _ = _audited(None)
    _hybrid_round_trip(c)
    events = [
        msgspec.structs.replace(e, sidecar_pools=(("draft", "kv"),)) if isinstance(e, TransferSubmitted) else e
        for e in c.log.events()
        if not isinstance(e, AuditViolation)
    ]
    omitted = [f for f in audit(events) if f.rule == "pool_omitted"]
    assert {(f.pool, f.direction) for f in omitted} == {("draft", "d2h"), ("draft", "h2d")}
    seen |= {f.rule for f in omitted}
    # nor does it take indices of another device in a free (it refuses them); SGLang's pools do
    # (tests/integrations/sglang/test_misplaced_indices.py): the adapter's evidence, as it logs it
    misplaced = [f for f in audit([*events, _misplaced(len(events))]) if f.rule == "misplaced_indices"]
    assert [(f.pool, f.role, f.op) for f in misplaced] == [("mamba", "host", -1)]
    seen |= {f.rule for f in misplaced}
    assert seen == set(RULES)


def _misplaced(seq: int) -> IndicesMisplaced:
    ref = TensorRef(pool="mamba", role="host", device="cuda:0", numel=2, dtype="int64", ptr=4096)
    return IndicesMisplaced(seq=seq, ts_ns=seq, pool="mamba", tier="host", call="free", expected="cpu", tensor=ref)


def test_misplaced_indices_names_the_call_and_both_devices() -> None:
    (f,) = audit([_misplaced(0)])
    assert f.rule == "misplaced_indices" and f.op == -1 and f.seq == 0
    assert f.detail == "host pool 'mamba': free() was handed 2 indices on cuda:0, where the pool's indices live on cpu"


def test_a_refused_free_of_free_slots_is_a_double_free_and_of_allocated_ones_nothing() -> None:
    c, _ = _audited(None)
    kv = c.alloc_device(16)
    events = [e for e in c.log.events() if not isinstance(e, AuditViolation)]
    n = len(events)

    def refused(seq: int, start: int) -> FreeRefused:
        ref = TensorRef(pool="kv", role="device", device="cpu", numel=2, dtype="int64", ptr=64, indices=((start, 2),))
        return FreeRefused(
            seq=seq, ts_ns=seq, pool="kv", tier="device", call="free", tensor=ref, error="AssertionError: Double-free"
        )

    first = int(kv[0])
    created = next(e for e in events if isinstance(e, PoolCreated) and (e.pool, e.tier) == ("kv", "device"))
    free_start = created.capacity - 2  # never allocated
    found = audit([*events, refused(n, first), refused(n + 1, free_start)])
    assert [(f.rule, f.pool, f.role, f.seq) for f in found] == [("double_free", "kv", "device", n + 1)]
    assert found[0].detail.endswith("already free, and refused them (AssertionError: Double-free)")


def test_unrecorded_fault_corrupts_data_that_the_real_controller_keeps() -> None:
    def scenario(fault: str | None) -> bool:
        c = make_controller(fault=fault, device_size=512, io_backend="kernel")
        kv = c.alloc_device(32)
        mb = c.alloc_device(2, pool="mamba")
        want = fill(c, "mamba", mb, 5)
        host, tr = c.write(kv, node_id=1, pool_transfers=[PoolTransfer("mamba", device_indices=mb)])
        c.poll_writes()
        c.evict_device(kv)
        c.evict_device(mb, pool="mamba")
        del kv, mb
        _dev, tr2 = c.load(host, node_id=1, pool_transfers=[PoolTransfer("mamba", host_indices=tr[0].host_indices)])
        c.start_loading()
        # allocation pressure: new index tensors of the same size take the freed blocks
        pressure = [c.runtime.to_device(torch.full((2,), 7, dtype=torch.int64)) for _ in range(4)]
        c.poll_loads()
        got = c.device_pool("mamba").read_slots(tr2[0].device_indices)
        del pressure
        return all(torch.equal(got[k], want[k]) for k in want)

    assert scenario(None) is True
    assert scenario("unrecorded-pool-indices") is False


@pytest.mark.parametrize(
    "fault", [None, "unrecorded-pool-indices", "unmoved-pool-indices", "use-after-free", "double-free"]
)
def test_replay_with_audit_folds_once_and_agrees_with_both(fault: str | None) -> None:
    from hicache_obs.events._replay import replay

    c, auditor = _audited(fault, io_backend="kernel")
    _hybrid_round_trip(c, evict_host_first=fault in ("use-after-free", "double-free"), double_evict=fault == "double-free")
    kv = c.alloc_device(32)
    c.write(kv, node_id=99, pool_transfers=[PoolTransfer("mamba", device_indices=c.alloc_device(1, pool="mamba"))])
    live = auditor.finish()  # the last write is still in flight: incomplete at log end
    res = replay(c.log.events(), audit=True)
    plain = replay(c.log.events())
    assert res.findings is not None
    assert sorted(f.key() for f in res.findings) == sorted(f.key() for f in live)
    assert [f.detail for f in res.findings] == [f.detail for f in audit(c.log.events())]
    assert "incomplete_operation" in {f.rule for f in res.findings}
    assert res.state.snapshot() == plain.state.snapshot() == c.state.snapshot()


def test_freeing_slots_a_transfer_in_flight_still_uses_is_a_use_after_free() -> None:
    c, auditor = _audited(None, ModelSpec.tiny(), io_backend="kernel")
    kv = c.alloc_device(32)
    with c.runtime.paused():  # the backup is queued on the write stream, not run yet
        host = c.write(kv, node_id=3)
        c.evict_host(host)
    c.poll_writes()
    found = auditor.finish()
    assert [(f.rule, f.pool, f.role, f.op) for f in found] == [("slot_not_allocated", "kv", "host", 0)]
    assert "still uses them (use after free)" in found[0].detail
    assert [f.key() for f in audit(c.log.events())] == [f.key() for f in found]


def test_a_live_auditor_logs_incomplete_operations_at_finish() -> None:
    c, auditor = _audited(None, ModelSpec.tiny())
    c.write(c.alloc_device(32), node_id=1)  # never polled
    found = auditor.finish()
    logged = [e for e in c.log.events() if isinstance(e, AuditViolation)]
    assert [(f.rule, f.op) for f in found] == [("incomplete_operation", 0)]
    assert [(e.rule, e.op, e.pool) for e in logged] == [("incomplete_operation", 0, "*")]
    assert auditor.finish() == found and len([e for e in c.log.events() if isinstance(e, AuditViolation)]) == 1


def _kernel_write(*refs: tuple[str, str, str], **fields: Any) -> list[Any]:
    from hicache_obs.events._schema import TensorRef, TransferSubmitted

    tensors = tuple(
        TensorRef(pool=p, role=r, device=d, numel=4, dtype="int64", ptr=64 + i)  # type: ignore[arg-type]
        for i, (p, r, d) in enumerate(refs)
    )
    return [
        TransferSubmitted(
            seq=0, ts_ns=0, op=0, direction="d2h", stream="device_to_host_stream", io_backend="kernel",
            layout="page_first", tensors=tensors, slots_by_pool=(("kv", 4),), bytes_by_pool=(("kv", 0),),
            device="cuda:0", **fields,
        )
    ]  # fmt: skip


def test_host_indices_a_staged_write_back_takes_on_the_cpu_are_not_off_device() -> None:
    def rules(events: list[Any]) -> set[tuple[str, str, str]]:
        return {p for p in _pairs(audit(events)) if p[0] == "index_not_on_device"}

    write = (("kv", "host", "cpu"), ("kv", "device", "cuda:0"))
    assert rules(_kernel_write(*write)) == {("index_not_on_device", "kv", "host")}
    # SGLang's staged write-back kernels address host pages from the CPU: the pool said so at its copy
    assert rules(_kernel_write(*write, host_indices_on_cpu=("kv",))) == set()
    # another pool's word does not cover kv, and device indices off the device stay a finding
    assert rules(_kernel_write(*write, host_indices_on_cpu=("mamba",))) == {("index_not_on_device", "kv", "host")}
    off = (("kv", "host", "cpu"), ("kv", "device", "cpu"))
    assert rules(_kernel_write(*off, host_indices_on_cpu=("kv",))) == {("index_not_on_device", "kv", "device")}
