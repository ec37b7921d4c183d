"""Acks an SGLang controller's queue gives up all at once (``clear()``).

The radix tree's blocking write-back check (``writing_check(write_back=True)``) waits for
each ack's ``finish_event``, handles it, then clears the queue: those are completions. The
controller's own ``reset()`` clears its queues with copies in flight: those ops are
cancelled. A clear outside a reset of a copy still running is no completion either.
"""

from __future__ import annotations

from typing import Any

import pytest
from sglang_env import release_tuple

from hicache_obs.core import ModelSpec
from hicache_obs.events import EventLog
from hicache_obs.events._audit import Auditor, audit
from hicache_obs.events._schema import AuditViolation, TransferCompleted, TransferFailed, TransferSubmitted
from hicache_obs.events._state import CacheState, fold
from hicache_obs.exporters._prometheus import PrometheusSink
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang

# 0.5.10 does not record a write's Mamba indices on the stream (SGLang #22940, a true finding):
# its writes here back up the KV only
MAMBA_WRITES = release_tuple() >= (0, 5, 11)
RESET = "cancelled: ack queue cleared (controller reset)"


class _Observed:
    """A real hybrid controller instrumented into a log with the live auditor and a Prometheus sink."""

    def __init__(self, **kw: Any) -> None:
        from hicache_obs.lab.sglang.harness import build_controller

        self.h = build_controller(ModelSpec.tiny_hybrid(), io_backend="direct", **kw)
        self.c = self.h.controller
        self.log = EventLog()
        Auditor().attach(self.log)
        self.sink = PrometheusSink(log=self.log)
        self.log.add_sink(self.sink)
        self.inst = instrument(self.c, log=self.log)

    def write(self, nodes: int) -> list[tuple[Any, Any]]:
        """``nodes`` writes (KV, and a Mamba slot where the release records it), submitted."""
        out = []
        for i in range(nodes):
            mamba = self.h.alloc_mamba(1) if MAMBA_WRITES else None
            host, t = self.h.write(self.h.alloc_kv(32), mamba, node_id=i)
            assert host is not None
            out.append((host, t))
        self.c.start_writing()
        return out

    def events(self) -> list[Any]:
        self.log.flush()
        return [e for e in self.log.events() if not isinstance(e, AuditViolation)]

    def ops(self, cls: type, direction: str) -> list[int]:
        return [e.op for e in self.events() if isinstance(e, cls) and e.direction == direction]

    def operations(self, direction: str, status: str) -> float:
        value = self.sink.registry.get_sample_value(
            "hicache_operations_total", {"direction": direction, "status": status}
        )
        return value or 0.0

    def clean(self) -> CacheState:
        """No finding, no anomaly, no failed read; no op left in flight in the fold. The fold."""
        assert [e for e in self.log.events() if isinstance(e, AuditViolation)] == []
        assert audit(self.events()) == []
        state = fold(self.events())
        assert state.anomalies == []
        assert self.inst.errors == 0
        assert all(not q for q in state.acks.values()) and all(not q for q in state.queues.values())
        return state


def _writing_check_write_back(c: Any) -> None:
    """``writing_check(write_back=True)`` of SGLang's radix trees: submit what is queued, wait
    for every ack's copy, handle it, then clear the queue."""
    c.start_writing()
    for ack in c.ack_write_queue:
        ack.finish_event.synchronize()
    c.ack_write_queue.clear()


def test_a_write_back_check_completes_what_it_waited_for() -> None:
    o = _Observed(write_policy="write_back")
    o.write(3)
    submitted = o.ops(TransferSubmitted, "d2h")
    assert len(submitted) == 3 and len(o.c.ack_write_queue) == 3
    _writing_check_write_back(o.c)
    assert o.ops(TransferCompleted, "d2h") == submitted  # in the queue's (FIFO) order
    assert o.ops(TransferFailed, "d2h") == []
    state = o.clean()
    assert state.completed["d2h"] == 3 and state.failed["d2h"] == 0
    assert o.operations("d2h", "completed") == 3 and o.operations("d2h", "failed") == 0


def test_loads_waited_for_then_cleared_are_completions() -> None:
    o = _Observed(write_policy="write_back")
    written = o.write(2)
    _writing_check_write_back(o.c)
    for host, t in written:
        dev, _ = o.h.load(host, t.host_indices if t is not None else None)
        assert dev is not None
    o.c.start_loading()
    submitted = o.ops(TransferSubmitted, "h2d")
    for ack in o.c.ack_load_queue:
        ack.finish_event.synchronize()
    o.c.ack_load_queue.clear()
    assert submitted and o.ops(TransferCompleted, "h2d") == submitted
    assert o.ops(TransferFailed, "h2d") == []
    o.clean()


def test_a_reset_with_copies_in_flight_fails_them() -> None:
    """``reset()`` (``/flush_cache``) with writes and a load submitted and never reaped: each
    is a ``TransferFailed``, cancelled, though its copy finished; none is a completion."""
    o = _Observed()
    written = o.write(2)
    o.h.reap(wait=True)
    completed = o.ops(TransferCompleted, "d2h")
    for host, t in written:
        assert o.h.load(host, t.host_indices if t is not None else None)[0] is not None
    o.c.start_loading()
    loads = o.ops(TransferSubmitted, "h2d")
    o.write(2)
    in_flight = o.ops(TransferSubmitted, "d2h")[2:]
    assert len(o.c.ack_write_queue) == 2 and len(o.c.ack_load_queue) == 1
    assert all(ack.finish_event.query() for ack in (*o.c.ack_write_queue, *o.c.ack_load_queue))
    o.c.reset()
    failed = [e for e in o.events() if isinstance(e, TransferFailed)]
    assert [(e.op, e.direction) for e in failed] == [(op, "d2h") for op in in_flight] + [(op, "h2d") for op in loads]
    assert {e.error for e in failed} == {RESET}
    assert o.ops(TransferCompleted, "d2h") == completed and o.ops(TransferCompleted, "h2d") == []
    state = o.clean()
    assert state.failed == {"d2h": 2, "h2d": 1}
    assert o.operations("d2h", "failed") == 2 and o.operations("h2d", "failed") == 1


def test_a_reset_ends_the_ops_it_drops_from_its_queues() -> None:
    """``reset()`` also drops ops queued and never started (a load queued, not yet started):
    each ends cancelled, after the acks the reset cancelled, and no queue of the fold keeps it."""
    o = _Observed()
    written = o.write(1)
    o.h.reap(wait=True)
    host, t = written[0]
    assert o.h.load(host, t.host_indices if t is not None else None)[0] is not None
    o.c.start_loading()  # one load in flight
    assert o.h.load(host, t.host_indices if t is not None else None)[0] is not None  # one queued
    assert len(o.c.ack_load_queue) == 1 and len(o.c.load_queue) == 1
    o.c.reset()
    failed = [e for e in o.events() if isinstance(e, TransferFailed)]
    assert len(failed) == 2 and [e.direction for e in failed] == ["h2d", "h2d"]
    assert failed[0].error == RESET
    assert failed[1].error == "cancelled: the controller was reset before this op started"
    assert o.clean().failed == {"d2h": 0, "h2d": 2}


def test_a_clear_of_a_copy_still_running_is_no_completion() -> None:
    """Outside a reset, an ack whose ``finish_event`` has not completed (nobody waited for
    its copy) is cancelled by a clear; the acks before it whose copies finished complete."""
    o = _Observed()
    o.write(2)
    submitted = o.ops(TransferSubmitted, "d2h")
    o.c.ack_write_queue[1].finish_event.query = lambda: False  # that copy is still running
    o.c.ack_write_queue.clear()
    assert o.ops(TransferCompleted, "d2h") == submitted[:1]
    failed = [e for e in o.events() if isinstance(e, TransferFailed)]
    assert [e.op for e in failed] == submitted[1:]
    assert failed[0].error.startswith("cancelled: ") and "still running" in failed[0].error
    o.clean()
