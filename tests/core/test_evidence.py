"""Stream records and index moves are what the runtime reports, not what the controller says.

The controller's ``StreamRecorded`` and ``IndicesMoved`` come from the runtime's
:class:`~hicache_obs.core._runtime.CallObservers`: a controller that asks for a record the
runtime never makes is not believed, and the audit sees the tensor as unrecorded.
"""

from __future__ import annotations

import pytest
import torch

from hicache_obs.core import HybridCacheController, ModelSpec, PoolTransfer
from hicache_obs.core._sim import SimRuntime
from hicache_obs.errors import ConfigError
from hicache_obs.events import EventLog, IndicesMoved, StreamRecorded
from hicache_obs.events._audit import audit


class _ForgetfulSim(SimRuntime):
    """A runtime whose record_stream makes no record (a broken or mocked runtime)."""

    def record_stream(self, tensor: torch.Tensor, stream: object) -> None:
        return None


def _round_trip(c: HybridCacheController) -> None:
    kv = c.alloc_device(32)
    mamba = c.alloc_device(1, pool="mamba")
    host, transfers = c.write(kv, node_id=1, pool_transfers=[PoolTransfer("mamba", device_indices=mamba)])
    c.synchronize()
    assert [a.ok for a in c.poll_writes()] == [True]
    c.evict_device(kv)
    c.evict_device(mamba, pool="mamba")
    c.load(host, node_id=1, pool_transfers=[PoolTransfer("mamba", host_indices=transfers[0].host_indices)])
    c.start_loading()
    c.synchronize()
    assert [a.ok for a in c.poll_loads()] == [True]


def test_records_the_runtime_made_are_events() -> None:
    c = HybridCacheController(ModelSpec.tiny_hybrid(), runtime="sim", device_size=256)
    _round_trip(c)
    ev = c.log.events()
    recs = {(e.pool, e.role) for e in ev if isinstance(e, StreamRecorded)}
    assert {("kv", "host"), ("kv", "device"), ("mamba", "host"), ("mamba", "device")} <= recs
    moves = {(e.pool, e.role, e.src_device, e.dst_device) for e in ev if isinstance(e, IndicesMoved)}
    assert ("kv", "host", "cpu", "sim:0") in moves and ("mamba", "host", "cpu", "sim:0") in moves
    assert audit(ev) == []
    c.close()


def test_a_record_never_made_is_not_claimed() -> None:
    c = HybridCacheController(ModelSpec.tiny_hybrid(), runtime=_ForgetfulSim(), device_size=256)
    _round_trip(c)
    ev = c.log.events()
    assert not any(isinstance(e, StreamRecorded) for e in ev)
    found = {(f.rule, f.pool, f.role) for f in audit(ev)}
    assert {("unrecorded_index", p, r) for p in ("kv", "mamba") for r in ("host", "device")} <= found
    c.close()


def test_a_shared_runtime_reports_to_each_controller_its_own_calls() -> None:
    rt = SimRuntime()
    a = HybridCacheController(ModelSpec.tiny_hybrid(), runtime=rt, device_size=256, log=EventLog(rank=0))
    b = HybridCacheController(ModelSpec.tiny_hybrid(), runtime=rt, device_size=256, log=EventLog(rank=1))
    _round_trip(a)
    assert not any(isinstance(e, (StreamRecorded, IndicesMoved)) for e in b.log.events())
    n = sum(isinstance(e, StreamRecorded) for e in a.log.events())
    _round_trip(b)
    assert sum(isinstance(e, StreamRecorded) for e in a.log.events()) == n
    assert sum(isinstance(e, StreamRecorded) for e in b.log.events()) == n
    a.close()
    b.close()
    assert rt.observers.records == () and rt.observers.moves == ()  # close() stops listening


def test_a_runtime_without_observers_is_refused() -> None:
    rt = SimRuntime()
    rt.observers = None  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="observers"):
        HybridCacheController(ModelSpec.tiny_hybrid(), runtime=rt, device_size=256)
