"""The live sinks' settling (``exporters/_fields.Settling``): a finished op waits for the
violations the live auditor appends right after its completion."""

from __future__ import annotations

from hicache_obs.events.lifecycle import Step
from hicache_obs.events.schema import AuditViolation, SlotsFreed, TransferCompleted, TransferSubmitted
from hicache_obs.exporters._fields import Settling, export_status


def _sub(seq: int, op: int, rank: int = 0) -> TransferSubmitted:
    return TransferSubmitted(seq=seq, ts_ns=10 * seq, rank=rank, op=op, direction="d2h", stream="hicache-write",
                             io_backend="direct", layout="lf", tensors=(), slots_by_pool=(("kv", 4),),
                             bytes_by_pool=(("kv", 32),))  # fmt: skip


def _done(seq: int, op: int, rank: int = 0) -> TransferCompleted:
    return TransferCompleted(seq=seq, ts_ns=10 * seq, rank=rank, op=op, direction="d2h", duration_ns=0)


def _viol(seq: int, op: int, rank: int = 0) -> AuditViolation:
    return AuditViolation(seq=seq, ts_ns=10 * seq, rank=rank, op=op, rule="unrecorded_index", pool="kv",
                          role="host", detail="x")  # fmt: skip


def test_a_finished_op_takes_its_late_violations_and_settles_at_the_next_event_of_its_rank() -> None:
    s = Settling()
    s.apply(_sub(0, 1))
    got, settled = s.apply(_done(1, 1))
    assert got is not None and got[0] is Step.FINISHED and settled == []
    rec = got[1]
    assert rec is not None and export_status(rec) == "completed"
    # another rank's event settles nothing of rank 0
    assert s.apply(_sub(2, 5, rank=1))[1] == []
    late = _viol(3, 1)
    assert s.apply(late) == ((Step.VIOLATION, rec), [])
    assert rec.violations == [late] and rec.unrecorded_indices == 1
    # an allocation or free of the rank settles it
    freed = SlotsFreed(seq=4, ts_ns=40, pool="kv", tier="host", indices=((0, 4),))
    assert s.apply(freed) == (None, [rec])
    assert s.pending == {}
    # a violation after the op settled is loose
    assert s.apply(_viol(5, 1)) == ((Step.VIOLATION, None), [])


def test_settle_all_hands_over_every_finished_op_and_unfinished_ones_stay() -> None:
    s = Settling(detail=False)
    for ev in (_sub(0, 1), _sub(1, 2), _sub(2, 3, rank=1), _done(3, 1), _done(4, 3, rank=1)):
        s.apply(ev)
    assert sorted(r.key for r in s.settle_all()) == [(0, 1), (1, 3)]
    assert s.settle_all() == [] and s.pending == {}
    assert [(r.key, export_status(r)) for r in s.unfinished()] == [((0, 2), "in_flight")]
