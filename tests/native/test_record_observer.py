"""``record_observer``: what the SGLang adapter puts as ``torch.Tensor.record_stream``.

The compiled observer (``hicache_obs/_slots.c``) and its pure twin
(``hicache_obs/events/_slots_py.py``) must behave the same: a record made during a
submission is appended to it once, after it was made; outside a submission, while a record
is being made (torch-function dispatch calling again), or when the record raises, nothing
is appended and the call is torch's own; the flag comes down whatever happened; it binds as
a method and names torch's method as ``__wrapped__``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from hicache_obs import _slots as c_slots
from hicache_obs.events import _slots_py as py_slots

IMPLS = [pytest.param(c_slots, id="c"), pytest.param(py_slots, id="py")]


class _PerThread(threading.local):
    sub: Any = None


class _Sub:
    def __init__(self) -> None:
        self.records: list[tuple[Any, Any]] = []


def _original(calls: list[tuple[Any, ...]], impl: Any, fail: bool = False, again: Any = None) -> Any:
    depth = [0]

    def record_stream(tensor: Any, stream: Any) -> None:
        """torch's record_stream."""
        calls.append((tensor, stream, impl.recording()))
        if again is not None and not depth[0]:  # torch-function dispatch calls the observer once again
            depth[0] += 1
            try:
                again[0](tensor, stream)
            finally:
                depth[0] -= 1
        if fail:
            raise RuntimeError("the record failed")

    return record_stream


@pytest.mark.parametrize("impl", IMPLS)
def test_records_made_in_a_submission_are_appended_once(impl: Any) -> None:
    current, calls = _PerThread(), []
    again: list[Any] = []
    observer = impl.record_observer(_original(calls, impl, again=again), current)
    again.append(observer)
    t, s = object(), object()
    assert observer(t, s) is None  # no submission: torch's call only (and the dispatch's)
    assert calls == [(t, s, False), (t, s, False)]
    sub = current.sub = _Sub()
    calls.clear()
    observer(t, s)
    observer(t, stream=s)  # the same call
    assert calls == [(t, s, True), (t, s, True)] * 2
    assert sub.records == [(t, s), (t, s)] and impl.recording() is False


@pytest.mark.parametrize("impl", IMPLS)
def test_a_failed_record_is_not_appended(impl: Any) -> None:
    current, calls = _PerThread(), []
    observer = impl.record_observer(_original(calls, impl, fail=True), current)
    sub = current.sub = _Sub()
    with pytest.raises(RuntimeError, match="the record failed"):
        observer(object(), object())
    assert sub.records == [] and impl.recording() is False and len(calls) == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_it_binds_as_torch_method_does(impl: Any) -> None:
    current, calls = _PerThread(), []
    original = _original(calls, impl)

    class Tensor:
        pass

    observer = impl.record_observer(original, current)
    Tensor.record_stream = observer  # type: ignore[attr-defined]
    t, s = Tensor(), object()
    sub = current.sub = _Sub()
    t.record_stream(s)  # type: ignore[attr-defined]
    Tensor.record_stream(t, s)  # type: ignore[attr-defined]
    assert sub.records == [(t, s), (t, s)]
    assert observer.__wrapped__ is original and observer.__doc__ == original.__doc__


@pytest.mark.parametrize("impl", IMPLS)
def test_records_of_other_threads_are_not_this_submission(impl: Any) -> None:
    current, calls = _PerThread(), []
    observer = impl.record_observer(_original(calls, impl), current)
    sub = current.sub = _Sub()
    other = threading.Thread(target=observer, args=(object(), object()))
    other.start()
    other.join()
    assert sub.records == [] and len(calls) == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_original_must_be_callable(impl: Any) -> None:
    with pytest.raises(TypeError, match="original is torch's record_stream"):
        impl.record_observer(None, _PerThread())


@pytest.mark.parametrize("impl", IMPLS)
def test_records_go_through_the_submissions_own_append(impl: Any) -> None:
    from collections import deque

    current, calls = _PerThread(), []
    observer = impl.record_observer(_original(calls, impl), current)
    sub = current.sub = _Sub()
    sub.records = deque()  # type: ignore[assignment]
    t, s = object(), object()
    observer(t, s)
    assert list(sub.records) == [(t, s)]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_record_on_another_thread_is_not_inside_this_one(impl: Any) -> None:
    """The flag is per thread: a submission on another thread, recording while this thread is
    inside a record, still gets its record."""
    current = _PerThread()
    theirs: list[Any] = []

    def other_thread() -> None:
        sub = current.sub = _Sub()
        observer(object(), object())
        theirs.append((impl.recording(), sub.records))

    spawned: list[Any] = []

    def record_stream(tensor: Any, stream: Any) -> None:
        if impl.recording() and not spawned:
            spawned.append(True)
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()

    observer = impl.record_observer(record_stream, current)
    sub = current.sub = _Sub()
    observer(object(), object())
    assert len(sub.records) == 1 and impl.recording() is False
    ((was_recording, records),) = theirs
    assert was_recording is False and len(records) == 1
