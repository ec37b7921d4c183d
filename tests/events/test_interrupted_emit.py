"""An emit interrupted after its seq was spent (a signal, an exception in a blocking
runner's wait) still leaves its event where the sinks read: no hole in the ring that a
later emit could publish past."""

from __future__ import annotations

import pytest

from hicache_obs.events import EventLog, ListSink
from hicache_obs.events._schema import PoolCreated


def _pool(log: EventLog, n: int) -> None:
    log.emit(PoolCreated, pool=f"p{n}", tier="device", capacity=16, page_size=1, slot_bytes=8, layout="layer_first")


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_an_emit_interrupted_in_a_blocking_wait_is_still_published(exc: type[BaseException]) -> None:
    log = EventLog()
    got = ListSink()
    runner = log.add_sink(got, policy="block")
    calls = [0]
    wait = runner.wait_for_room

    def interrupted() -> None:  # as a SIGTERM handler raising inside the wait would
        calls[0] += 1
        if calls[0] == 2:
            raise exc("interrupted")
        wait()

    runner.wait_for_room = interrupted
    _pool(log, 0)
    with pytest.raises(exc):
        _pool(log, 1)
    _pool(log, 2)
    log.close()
    assert [(ev.seq, ev.pool) for ev in got.events] == [(0, "p0"), (1, "p1"), (2, "p2")]
    st = runner.stats()
    assert (st["errors"], st["dropped"]) == (0, 0)
    assert log.published == 3
