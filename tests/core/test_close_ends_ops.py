"""``close()`` ends every op: in flight, queued, or merged and never submitted.

Queued ops are cancelled (a ``TransferSubmitted`` without tensors, then a
``TransferFailed`` whose error starts with ``ControllerClosedError: cancelled``), ops in
flight are reaped (completed, or failed when their copy failed), and every op that
ends failed at close has the slots allocated for it freed (``reason="failed"``). After
close the fold of the log has no op left open, equals the state, and the audit of the
log is clean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_lying_tensors import _alloc, _bits, _doomed_copies, _fill, _free_node, _load, _read_host, _same, _write

from hicache_obs.core import HiCacheController, HybridCacheController, ModelSpec, PoolTransfer
from hicache_obs.core._sim import SimEvent, SimRuntime
from hicache_obs.events._audit import audit
from hicache_obs.events._replay import replay
from hicache_obs.events._schema import (
    D2H,
    H2D,
    SlotsFreed,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
    expand_runs,
)
from hicache_obs.exporters._prometheus import PrometheusSink

RUNTIMES = ["cpu", "sim"]
SPECS = ["tiny", "tiny_hybrid"]


@pytest.fixture
def controllers() -> Iterator[Callable[..., HiCacheController]]:
    made: list[HiCacheController] = []

    def make(runtime: Any, spec: str) -> HiCacheController:
        s = ModelSpec.preset(spec)
        cls = HybridCacheController if s.is_hybrid else HiCacheController
        c = cls(s, runtime=runtime, device_size=64)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _nothing_open(c: HiCacheController) -> None:
    """After close: no op open in the live state nor in the fold of the log; same state;
    no anomaly; a clean audit (no incomplete_operation, no slot finding)."""
    events = c.log.events()
    res = replay(events)
    assert res.state.snapshot() == c.state.snapshot()
    assert res.state.anomalies == []
    assert c.state.ops == {}
    assert all(not q for q in c.state.queues.values())
    assert all(not a for a in c.state.acks.values())
    assert audit(events) == []
    sink = PrometheusSink()
    sink.handle_batch(list(events))
    snap = sink.snapshot()
    assert snap["hicache_transfers_in_flight"][(D2H,)] == 0 and snap["hicache_transfers_in_flight"][(H2D,)] == 0
    for d in (D2H, H2D):
        ops = snap["hicache_operations_total"]
        assert ops[(d, "submitted")] == ops[(d, "completed")] + ops[(d, "failed")]


def _backed_up(c: HiCacheController, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` nodes written to the host, reaped, and evicted from the device."""
    hosts = []
    for i in range(n):
        node = _alloc(c)
        _fill(c, node, seed=i)
        hosts.append(_write(c, node, node_id=10 + i))
        c.synchronize()
        assert [a.ok for a in c.poll_writes()] == [True]
        _free_node(c, node, "device")
    return hosts


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_close_cancels_loads_that_were_queued_and_never_started(
    controllers: Callable[..., HiCacheController], runtime: str, spec: str
) -> None:
    c = controllers(runtime, spec)
    hosts = _backed_up(c, 2)
    device_used = {k: t.used for k, t in c.state.tables.items() if k[1] == "device"}
    devs = [_load(c, h, node_id=20 + i) for i, h in enumerate(hosts)]
    queued = list(c.state.queues[H2D])
    assert len(queued) == 2
    c.close()
    _nothing_open(c)
    events = c.log.events()
    failed = {e.op: e for e in events if isinstance(e, TransferFailed)}
    assert sorted(failed) == sorted(queued)  # each op ended on its own
    assert all(e.direction == H2D and e.error.startswith("ControllerClosedError: cancelled") for e in failed.values())
    subs = {e.op: e for e in events if isinstance(e, TransferSubmitted) and e.op in failed}
    assert all(s.tensors == () for s in subs.values())  # no copy received anything
    assert not [e for e in events if isinstance(e, TransferCompleted) and e.direction == H2D]
    # the device slots allocated for the cancelled loads are freed, by op, and only those
    freed: dict[int, dict[str, list[int]]] = {}
    for e in events:
        if isinstance(e, SlotsFreed) and e.reason == "failed":
            assert e.tier == "device"
            freed.setdefault(e.op, {})[e.pool] = list(expand_runs(e.indices))
    assert freed == {
        op: {p: c.runtime.to_host(t).tolist() for p, t in dev.items()} for op, dev in zip(queued, devs)
    }
    assert {k: t.used for k, t in c.state.tables.items() if k[1] == "device"} == device_used


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_close_reaps_writes_in_flight_and_keeps_their_data(
    controllers: Callable[..., HiCacheController], runtime: str, spec: str
) -> None:
    c = controllers(runtime, spec)
    node = _alloc(c)
    data = _fill(c, node, seed=5)
    if isinstance(c.runtime, SimRuntime):
        with c.runtime.paused():
            host = _write(c, node, node_id=1)
        assert c.runtime.pending_work() > 0  # still queued on the write stream
    else:
        host = _write(c, node, node_id=1)
    assert c.in_flight(D2H) == 1
    c.close()
    _nothing_open(c)
    done = [e for e in c.log.events() if isinstance(e, TransferCompleted)]
    assert [e.direction for e in done] == [D2H]
    assert _same(_bits(data), _read_host(c, host))
    assert not [e for e in c.log.events() if isinstance(e, SlotsFreed) and e.reason == "failed"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_close_fails_a_write_whose_copy_failed_and_frees_its_host_slots(
    controllers: Callable[..., HiCacheController], runtime: str, spec: str
) -> None:
    c = controllers(runtime, spec)
    node = _alloc(c)
    _fill(c, node, seed=6)
    host_used = {k: t.used for k, t in c.state.tables.items() if k[1] == "host"}
    with _doomed_copies(c):
        host = _write(c, node, node_id=1)
    c.close()
    _nothing_open(c)
    failed = [e for e in c.log.events() if isinstance(e, TransferFailed)]
    assert len(failed) == 1 and "injected copy failure" in failed[0].error
    freed = {
        e.pool: list(expand_runs(e.indices))
        for e in c.log.events()
        if isinstance(e, SlotsFreed) and e.reason == "failed" and e.op == failed[0].op
    }
    assert freed == {p: t.tolist() for p, t in host.items()}
    assert {k: t.used for k, t in c.state.tables.items() if k[1] == "host"} == host_used


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_close_ends_an_op_left_merged_by_an_escaped_exception(
    controllers: Callable[..., HiCacheController], runtime: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt is not a failed transfer: it propagates and leaves the op
    merged; close still ends it."""
    c = controllers(runtime, "tiny")
    (host,) = _backed_up(c, 1)
    _load(c, host, node_id=3)

    def interrupt(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(c, "_move_op", interrupt)
    with pytest.raises(KeyboardInterrupt):
        c.start_loading()
    monkeypatch.undo()
    assert [s.status for s in c.state.ops.values()] == ["merged"]
    c.close()
    _nothing_open(c)
    (failed,) = [e for e in c.log.events() if isinstance(e, TransferFailed)]
    assert failed.error.startswith("ControllerClosedError: the op was merged and never submitted")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_close_ends_an_op_submitted_whose_ack_an_escaped_exception_lost(
    controllers: Callable[..., HiCacheController], runtime: str, spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt after the op's TransferSubmitted and before its ack was queued
    (a SIGTERM of the demo can land there): close still ends it, and frees its slots."""
    c = controllers(runtime, spec)
    (host,) = _backed_up(c, 1)
    _load(c, host, node_id=3)

    def interrupt(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(c, "_launch_load", interrupt)
    with pytest.raises(KeyboardInterrupt):
        c.start_loading()
    monkeypatch.undo()
    assert [s.status for s in c.state.ops.values()] == ["submitted"]
    c.close()
    _nothing_open(c)
    (failed,) = [e for e in c.log.events() if isinstance(e, TransferFailed)]
    assert failed.error.startswith("ControllerClosedError: the op was submitted and its ack never queued")
    freed = [e for e in c.log.events() if isinstance(e, SlotsFreed) and e.reason == "failed"]
    assert {e.op for e in freed} == {failed.op} and {e.tier for e in freed} == {"device"}


def test_close_inside_paused_raises_and_changes_nothing(controllers: Callable[..., HiCacheController]) -> None:
    """close() must wait for work in flight; when it cannot, it says so and stays open."""
    c = controllers("sim", "tiny")
    node = _alloc(c)
    rt = c.runtime
    assert isinstance(rt, SimRuntime)
    with rt.paused():
        _write(c, node, node_id=1)
        n = len(c.log)
        with pytest.raises(RuntimeError, match="paused"):
            c.close()
        assert not c.closed and len(c.log) == n
    c.close()
    assert c.closed
    _nothing_open(c)


def test_a_hybrid_load_cancelled_at_close_frees_every_pools_slots(
    controllers: Callable[..., HiCacheController],
) -> None:
    c = controllers("sim", "tiny_hybrid")
    (host,) = _backed_up(c, 1)
    res = c.load(host["kv"], node_id=4, pool_transfers=[PoolTransfer("mamba", host_indices=host["mamba"])])
    assert res is not None
    c.close()
    _nothing_open(c)
    pools = {e.pool for e in c.log.events() if isinstance(e, SlotsFreed) and e.reason == "failed"}
    assert pools == {"kv", "mamba"}


class _NeverDone(SimEvent):
    __slots__ = ()

    def query(self) -> bool:
        return False


class _StuckSim(SimRuntime):
    """A sim runtime whose events made while armed never report done, even after synchronize()."""

    armed = False

    def event(self, enable_timing: bool = False) -> SimEvent:
        return _NeverDone(self, enable_timing) if self.armed else super().event(enable_timing)


def test_close_fails_an_op_the_runtime_never_finishes_and_keeps_its_slots(
    controllers: Callable[..., HiCacheController],
) -> None:
    """Its copies may still write: its host slots stay allocated (a leak, not a use after free)."""
    rt = _StuckSim()
    c = controllers(rt, "tiny")
    node = _alloc(c)
    rt.armed = True
    host = _write(c, node, node_id=1)
    rt.armed = False
    assert c.poll_writes() == []
    c.close()
    _nothing_open(c)
    (failed,) = [e for e in c.log.events() if isinstance(e, TransferFailed)]
    assert "still unfinished at close()" in failed.error
    assert not [e for e in c.log.events() if isinstance(e, SlotsFreed) and e.reason == "failed"]
    assert c.state.table("kv", "host").used == host["kv"].numel()
