"""The log's public operations that sinks, feeders and the controller use instead of its
internals: ``read``, the feeder handle, ``bind_owner``/``owner``."""

from __future__ import annotations

import pytest

from hicache_obs.events import AllocationFailed, EventLog


def _emit_n(log: EventLog, n: int) -> None:
    for i in range(n):
        log.emit(AllocationFailed, pool="kv", tier="host", requested=i, available=0)


# ---------------------------------------------------------------------- read
def test_read_returns_the_range_of_events_in_order() -> None:
    log = EventLog(ring_size=1 << 12)
    _emit_n(log, 50)
    got = log.read(10, 20)
    assert [ev.seq for ev in got] == list(range(10, 20))
    assert [ev.requested for ev in got] == list(range(10, 20))  # type: ignore[attr-defined]
    assert got == log.events()[10:20]  # the same objects the log retained
    assert log.read(7, 7) == []
    assert [ev.seq for ev in log.read(0, 50)] == list(range(50))


def test_read_leaves_out_what_the_ring_lapped() -> None:
    log = EventLog(ring_size=1 << 12)
    _emit_n(log, (1 << 12) + 100)  # seqs 0..99 were overwritten by 4096..4195
    assert [ev.seq for ev in log.read(0, 200)] == list(range(100, 200))
    assert log.read(0, 100) == []
    whole = log.read(log.published - (1 << 12) - 5, log.published)  # 5 more than the ring holds
    assert [ev.seq for ev in whole] == list(range(100, log.published))


@pytest.mark.parametrize(
    ("start", "end"),
    [(5, 3), (-1, 2), (0, 11), (11, 11)],
)
def test_read_outside_what_is_published_is_refused_with_the_range(start: int, end: int) -> None:
    log = EventLog()
    _emit_n(log, 10)
    with pytest.raises(ValueError) as info:
        log.read(start, end)
    assert str(info.value) == (
        f"read({start}, {end}): the range must satisfy 0 <= start <= end <= published (10)"
    )
