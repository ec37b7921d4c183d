"""``FinishHook``: the end of a submission under the SGLang adapter's one-event profiles.

The compiled hook (``hicache_obs/_slots.c``) and its pure twin
(``hicache_obs/events/_slots_py.py``) must log the same event, leave the acks awaiting
their op, carry the pools' occupancy only when it is due, hand what they do not describe
themselves to the fallback, and count (never raise) a failure of their own.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hicache_obs import _slots as c_slots
from hicache_obs.events import _slots_py as py_slots
from hicache_obs.events._schema import Moved, OpsSubmitted, TensorRef
from hicache_obs.integrations.sglang import _tensor_facts as facts

IMPLS = [pytest.param(c_slots, id="c"), pytest.param(py_slots, id="py")]
STREAM = object()


class _State:
    def __init__(self, event_setup: tuple[Any, ...]) -> None:
        self.pools_at = -50
        self.event_setup = event_setup
        self.durable: Any = None


class _Rig:
    """What a FinishHook is handed: the log's emit, the counts, the clock, the pools."""

    def __init__(self, impl: Any, usage: list[Any] | None = None) -> None:
        self.events: list[tuple[Any, dict[str, Any]]] = []
        self.failed: list[str] = []
        self.fallen: list[tuple[Any, Any, Any]] = []
        self.synced = 0
        self.ticks = iter(range(100, 10_000, 30))
        self.pending: dict[int, tuple[int, str]] = {}
        owner = SimpleNamespace(write_stream=STREAM, load_stream=STREAM)
        event_setup = (
            {"d2h": (owner, "write_stream"), "h2d": (owner, "load_stream")},
            {id(STREAM): "write_stream"},
            "kernel",
            "page_first",
            "cpu",
            (),
            0.0,
            {"kv": 16},
            {},
            "kv",
            {},
            str,
            Moved,
            "h2d",
        )
        self.state = _State(event_setup)
        setup = (
            self.state,
            self.failed.append,
            facts.NO_TORCH_FUNCTION,
            TensorRef,
            facts.META_NAMES,
            facts.tensor_meta,
            lambda: next(self.ticks),
            usage if usage is not None else [],
            lambda: (("kv", "device", 3, 64),),
            50,
            self.pending,
            self.sync,
            self.emit,
            OpsSubmitted,
        )
        self.hook = impl.FinishHook(lambda *a: self.fallen.append(a), setup)

    def emit(self, cls: Any, **fields: Any) -> Any:
        self.events.append((cls, fields))
        return cls

    def sync(self) -> None:
        self.synced += 1


def _sub(**fields: Any) -> SimpleNamespace:
    host = torch.arange(4)
    base: dict[str, Any] = {
        "direction": "d2h",
        "op": SimpleNamespace(id=7, host_indices=host),
        "queued_ops": [],
        "uses": {("kv", "host"): host},
        "refs": {},
        "records": [],
        "moves": [],
        "side_moves": [],
        "host_indices_on_cpu": [],
        "sampled": False,
        "acks": ["ack-a", "ack-b"],
    }
    base.update(fields)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_submission_is_one_event_and_its_acks_await_the_op(impl: Any) -> None:
    rig = _Rig(impl, usage=["the kv pool"])
    sub = _sub()
    assert rig.hook(sub, 5, None) is None
    ((cls, fields),) = rig.events
    assert cls is OpsSubmitted and fields["op"] == 7 and fields["stream"] == "write_stream"
    assert fields["tensors"] == (facts.tensor_meta(sub.uses[("kv", "host")], "kv", "host"),)
    assert fields["slots_by_pool"] == (("kv", 4),) and fields["bytes_by_pool"] == (("kv", 64),)
    assert fields["pools"] == (("kv", "device", 3, 64),) and rig.state.pools_at == 100  # due: carried, noted
    assert sub.refs == {(id(sub.uses[("kv", "host")]), "kv", "host"): fields["tensors"][0]}  # described once
    assert rig.pending == {id("ack-a"): (7, "d2h"), id("ack-b"): (7, "d2h")}
    rig.hook(_sub(acks=[]), 5, None)  # 30 ns later: not due again
    assert rig.events[1][1]["pools"] == () and rig.state.pools_at == 100
    rig.hook(_sub(acks=[]), 5, None)  # 60 ns after the last: due
    assert rig.events[2][1]["pools"] and rig.state.pools_at == 160
    assert rig.synced == 0 and rig.failed == [] and rig.fallen == []
    rig.state.durable = ("count", "flush")
    rig.hook(_sub(acks=[]), 5, None)
    assert rig.synced == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_no_pools_are_read_without_usage_and_the_rest_is_the_fallbacks(impl: Any) -> None:
    rig = _Rig(impl)
    rig.hook(_sub(), None, None)
    assert rig.events[0][1]["pools"] == () and rig.state.pools_at == -50
    error = RuntimeError("launch failed")
    for sub, error_of in ((_sub(), error), (_sub(op=None), None), (_sub(sampled=True), None)):
        rig.hook(sub, "result", error_of)
        assert rig.fallen[-1] == (sub, "result", error_of)
    assert len(rig.events) == 1 and len(rig.fallen) == 3


@pytest.mark.parametrize("impl", IMPLS)
def test_a_failure_is_counted_and_the_acks_await_only_after_an_event(impl: Any) -> None:
    def refuse(cls: Any, **fields: Any) -> None:
        raise RuntimeError("the log is closed")

    broken = _Rig(impl)
    hook = impl.FinishHook(broken.fallen.append, (*_setup_of(broken), refuse, OpsSubmitted))
    hook(_sub(), None, None)
    assert broken.failed == ["record an OpsSubmitted event"] and len(broken.pending) == 2  # the acks still await
    rig = _Rig(impl)
    unreadable = _sub(op=SimpleNamespace(host_indices=torch.arange(2)))  # no id: not described
    rig.hook(unreadable, None, None)
    assert rig.failed == ["describe a submission"] and rig.pending == {} and rig.events == []


def _setup_of(rig: _Rig) -> tuple[Any, ...]:
    return (
        rig.state,
        rig.failed.append,
        facts.NO_TORCH_FUNCTION,
        TensorRef,
        facts.META_NAMES,
        facts.tensor_meta,
        lambda: next(rig.ticks),
        [],
        lambda: (),
        50,
        rig.pending,
        rig.sync,
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_a_setup_of_the_wrong_shape_is_refused(impl: Any) -> None:
    rig = _Rig(impl)
    good = (*_setup_of(rig), rig.emit, OpsSubmitted)
    cases = [
        ((None, good), "fallback is a callable and setup a tuple of 14"),
        ((print, good[:-1]), "a tuple of 14"),
        ((print, (good[0], None, *good[2:])), "item 1 is a callable"),
        ((print, (*good[:4], ({}, {}), *good[5:])), "names is"),
        ((print, (*good[:10], [], *good[11:])), "pending is a dict"),
    ]
    for args, text in cases:
        with pytest.raises(TypeError, match=text):
            impl.FinishHook(*args)
