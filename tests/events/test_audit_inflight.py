"""The auditor's use-after-free check against in-flight transfers, event by event.

The auditor tells by bisection over each in-flight op's sorted runs whether a free
touches one of them, and only then runs the exact check that names the slots; these
tests pin what that must get right: overlapping ops, completion and failure, an op
id submitted again, hundreds of ops on one slot, runs out of range, and the replay
path.
"""

from __future__ import annotations

import pytest
from event_workloads import EventList

from hicache_obs.events._audit import Auditor, Finding
from hicache_obs.events._replay import replay


def _uaf(findings: list[Finding]) -> list[tuple[int, int]]:
    """(op, seq) of every use-after-free finding."""
    return [(f.op, f.seq) for f in findings if f.rule == "slot_not_allocated" and "use after free" in f.detail]


def _all_ways(log: EventList) -> list[tuple[int, int]]:
    """Findings of the live-style auditor, the replay fold, and event-by-event handling: all equal."""
    plain = Auditor().feed(log.events).finish()
    folder = Auditor(fold_state=True).feed(log.events)
    folded = folder.finish()
    one_by_one = Auditor(fold_state=True)
    for ev in log.events:
        one_by_one.handle(ev)
    res = replay(log.events, audit=True)
    assert res.findings is not None
    keys = [(*f.key(), f.seq, f.detail) for f in plain]
    assert keys == [(*f.key(), f.seq, f.detail) for f in folded]
    assert keys == [(*f.key(), f.seq, f.detail) for f in one_by_one.finish()]
    assert keys == [(*f.key(), f.seq, f.detail) for f in res.findings]
    assert folder.states[0].snapshot() == one_by_one.states[0].snapshot() == res.state.snapshot()
    return _uaf(plain)


def test_free_of_a_slot_in_flight_is_found_and_not_after_completion() -> None:
    log = EventList().pool()
    log.alloc((0, 64))
    log.submit(1, (10, 4), (40, 2))
    log.free((0, 8))  # not used by op 1
    used = len(log.events)
    log.free((41, 1))  # used
    log.done(1)
    log.free((10, 4))  # op 1 is over
    assert _all_ways(log) == [(1, used)]


def test_overlapping_ops_each_hold_the_slot_until_their_own_completion() -> None:
    log = EventList().pool()
    log.alloc((0, 64))
    log.submit(1, (0, 8))
    log.submit(2, (4, 8))
    log.done(1)
    used = len(log.events)
    log.free((5, 1))  # op 2 still reads slot 5
    log.failed(2)
    log.free((6, 1))  # nobody does any more
    assert _all_ways(log) == [(2, used)]


def test_an_op_id_submitted_again_replaces_its_earlier_use() -> None:
    log = EventList().pool()
    log.alloc((0, 64))
    log.submit(1, (0, 4))
    log.submit(1, (20, 4))
    log.done(1)
    log.free((0, 4), (20, 4))  # op 1 is over (both of its submissions)
    assert _all_ways(log) == []


def test_more_than_255_transfers_on_one_slot_are_counted_exactly() -> None:
    log = EventList().pool()
    log.alloc((0, 16))
    for op in range(300):
        log.submit(op, (3, 2))
    for op in range(299):
        log.done(op)
    log.free((4, 1))  # op 299 still uses slot 4
    seq_in_flight = len(log.events) - 1
    log.done(299)
    log.free((3, 1))
    assert _all_ways(log) == [(299, seq_in_flight)]


@pytest.mark.parametrize("runs", [((-3, 5),), ((1020, 10),), ((2000, 1),)])
def test_runs_outside_the_pool_do_not_break_the_count(runs: tuple[tuple[int, int], ...]) -> None:
    log = EventList().pool(capacity=1024)
    log.alloc((0, 8), (1016, 8))
    log.submit(1, *runs)
    low = len(log.events)
    log.free((0, 1))  # in use only by the run that starts below 0 (slots -3..1)
    high = len(log.events)
    log.free((1022, 1))  # in use only by the run 1020..1029
    log.done(1)
    log.free((1, 1), (1023, 1))
    expected = {((-3, 5),): [(1, low)], ((1020, 10),): [(1, high)], ((2000, 1),): []}[runs]
    assert _all_ways(log) == expected
