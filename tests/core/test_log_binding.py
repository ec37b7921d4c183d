"""A controller's bookkeeping is the fold of its own log: one open controller per log."""

from __future__ import annotations

import pytest

from hicache_obs.core import HiCacheController, ModelSpec
from hicache_obs.errors import ConfigError
from hicache_obs.events import EventLog, SlotsAllocated
from hicache_obs.events._state import fold


def test_a_second_open_controller_on_the_same_log_is_refused() -> None:
    log = EventLog()
    a = HiCacheController(ModelSpec.tiny(), runtime="cpu", device_size=256, log=log)
    n = len(log)
    with pytest.raises(ConfigError, match=r"already records an open HiCacheController.*its own log"):
        HiCacheController(ModelSpec.tiny(), runtime="cpu", device_size=256, log=log)
    assert len(log) == n  # the refused one emitted nothing
    first = a.alloc_device(16)
    second = a.alloc_device(16)
    assert first is not None and second is not None
    assert set(first.tolist()).isdisjoint(second.tolist())
    a.close()
    b = HiCacheController(ModelSpec.tiny(), runtime="cpu", device_size=256, log=log)  # a is closed: fine
    assert b.alloc_device(16) is not None
    assert a.state.table("kv", "device").used == 32  # the closed one stopped folding


def test_controller_calls_from_inside_a_subscriber_see_their_own_events() -> None:
    c = HiCacheController(ModelSpec.tiny(), runtime="sim", device_size=256)
    got: list[list[int]] = []

    def on_event(ev: object) -> None:
        if isinstance(ev, SlotsAllocated) and ev.op == -1 and len(got) < 2:
            for _ in range(2):
                t = c.alloc_device(16)
                assert t is not None
                got.append(c.runtime.to_host(t).tolist())

    c.log.subscribe(on_event)
    c.alloc_device(16)
    assert len(got) == 2 and set(got[0]).isdisjoint(got[1])
    assert fold(c.log.events()).snapshot() == c.state.snapshot()
    assert c.state.anomalies == []
