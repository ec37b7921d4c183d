"""``start_hook`` and ``Submission``: the SGLang adapter's start of a submission.

The compiled hook and type (``hicache_obs/_slots.c``) and their pure twins
(``hicache_obs/events/_slots_py.py``) must give the same submission, keep it as
``current.sub`` for the length of the controller's call only, hand it to ``finish`` however
the call ended, and leave the call's result or error as they came.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hicache_obs import _slots as c_slots
from hicache_obs.events import _slots_py as py_slots

IMPLS = [pytest.param(c_slots, id="c"), pytest.param(py_slots, id="py")]


class _Current:
    sub: Any = None


class _Sampler:
    def __init__(self, picks: list[bool]) -> None:
        self.picks = picks

    def take(self) -> bool:
        return self.picks.pop(0)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_submission_starts_empty_and_each_has_its_own_containers(impl: Any) -> None:
    ops = [SimpleNamespace(id=1)]
    a = impl.Submission("inst", "d2h", (1,), ops)
    b = impl.Submission("inst", "h2d", (2,))
    assert (a.inst, a.direction, a.queued, a.queued_ops) == ("inst", "d2h", (1,), ops) and a.queued_ops is ops
    assert b.queued_ops == [] and b.direction == "h2d"
    assert (a.op, a.merged_emitted, a.sampled) == (None, False, False)
    fresh = ("uses", "records", "acks", "side_moves", "host_indices_on_cpu", "moves", "copied", "refs")
    assert [getattr(a, f) for f in fresh] == [{}, [], [], [], [], [], set(), {}]
    assert all(getattr(a, f) is not getattr(b, f) for f in fresh)
    a.op, a.sampled = "op", True
    a.acks.append("ack")
    assert (a.op, a.sampled, a.acks, b.acks) == ("op", True, ["ack"], [])

    class Sub(impl.Submission):  # type: ignore[name-defined,misc]
        __slots__ = ()

        def ref(self) -> str:
            return f"{self.direction} sub"

    assert Sub(None, "d2h", ()).ref() == "d2h sub"
    with pytest.raises(TypeError):
        impl.Submission("inst", "d2h")
    with pytest.raises(AttributeError):
        a.elsewhere = 1


@pytest.mark.parametrize("impl", IMPLS)
def test_a_start_is_one_submission_for_the_length_of_the_call(impl: Any) -> None:
    current, finished, seen = _Current(), [], []
    ops = [SimpleNamespace(id=4), SimpleNamespace(id=True)]
    controller = SimpleNamespace(write_queue=list(ops))

    def start_writing(*args: Any, **kwargs: Any) -> str:
        seen.append((current.sub, args, kwargs))
        if len(seen) == 1:  # re-entered: the controller's own call, no second submission
            assert hook("again") == "started" and seen[1][0] is seen[0][0]
        return "started"

    setup = (controller, "write_queue", impl.Submission, "inst", "d2h", _Sampler([True]),
             lambda sub, result, error: finished.append((sub, result, error)))  # fmt: skip
    hook = impl.start_hook(start_writing, current, setup)
    assert hook.__wrapped__ is start_writing
    assert hook(7, priority=1) == "started"
    (sub, args, kwargs), (_, again, _) = seen
    assert (args, kwargs, again) == ((7,), {"priority": 1}, ("again",)) and current.sub is None
    assert type(sub) is impl.Submission and sub.queued == (4, 1) and all(type(i) is int for i in sub.queued)
    assert sub.queued_ops == ops and sub.queued_ops is not controller.write_queue  # the ops as queued
    assert (sub.inst, sub.direction, sub.sampled) == ("inst", "d2h", True)
    assert finished == [(sub, "started", None)]
    controller.write_queue.clear()
    assert hook() == "started" and len(finished) == 1  # nothing queued: the controller's own call
    unsampled = impl.start_hook(lambda: current.sub, current, (*setup[:5], None, setup[6]))
    controller.write_queue.append(SimpleNamespace(id=9))
    got = unsampled()
    assert got.sampled is False and finished[-1] == (got, got, None)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_error_of_the_call_is_finished_then_raised(impl: Any) -> None:
    current, finished = _Current(), []
    controller = SimpleNamespace(load_queue=[SimpleNamespace(id=3)])

    def start_loading() -> None:
        raise RuntimeError("CUDA error: out of memory")

    setup = (controller, "load_queue", impl.Submission, "inst", "h2d", None,
             lambda sub, result, error: finished.append((sub, result, error)))  # fmt: skip
    with pytest.raises(RuntimeError, match="out of memory") as raised:
        impl.start_hook(start_loading, current, setup)()
    ((sub, result, error),) = finished
    assert error is raised.value and result is None and sub.queued == (3,) and current.sub is None

    def failing_finish(sub: Any, result: Any, error: Any) -> None:
        raise ValueError("finish failed")

    with pytest.raises(ValueError, match="finish failed") as second:
        impl.start_hook(start_loading, current, (*setup[:6], failing_finish))()
    assert isinstance(second.value.__context__, RuntimeError) and current.sub is None
    with pytest.raises(AttributeError, match="id"):  # an op without an id: not a submission
        controller.load_queue = [object()]
        impl.start_hook(start_loading, current, setup)()
    assert current.sub is None


@pytest.mark.parametrize("impl", IMPLS)
def test_a_setup_of_the_wrong_shape_is_refused(impl: Any) -> None:
    good = (SimpleNamespace(), "write_queue", impl.Submission, None, "d2h", None, print)
    cases = [
        ((None, _Current(), good), "is a callable"),
        ((print, _Current(), good[:-1]), "setup is"),
        ((print, _Current(), (good[0], 3, *good[2:])), "setup is"),
        ((print, _Current(), (*good[:6], None)), "setup is"),
    ]
    for args, text in cases:
        with pytest.raises(TypeError, match=text):
            impl.start_hook(*args)
