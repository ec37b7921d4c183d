"""``slot_guard``: what the SGLang adapter puts as an allocator call that can change its free
lists. The compiled hook (``hicache_obs/_slots.c``) and its pure twin
(``hicache_obs/events/_slots_py.py``) must behave the same: the outermost call is the hook's,
with the watch's depth set for its length and the lock held; a call inside it is the
allocator's own; what either raises goes through as it was, the depth reset and the lock
released.
"""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from hicache_obs import _slots as c_slots
from hicache_obs.events import _slots_py as py_slots

IMPLS = [pytest.param(c_slots, id="c"), pytest.param(py_slots, id="py")]


def _held_elsewhere(lock: Any) -> bool:
    """Whether another thread holds ``lock`` (this one cannot take it at once)."""
    got: list[bool] = []

    def try_it() -> None:
        got.append(lock.acquire(blocking=False))
        if got[0]:
            lock.release()  # an RLock is released by the thread that took it

    t = threading.Thread(target=try_it)
    t.start()
    t.join()
    return not got[0]


@pytest.mark.parametrize("impl", IMPLS)
def test_the_outermost_call_is_the_hooks_and_a_nested_one_the_allocators(impl: Any) -> None:
    watch, lock = SimpleNamespace(depth=0), threading.RLock()
    seen: list[tuple[str, Any, Any, int, bool]] = []

    def original(*args: Any, **kwargs: Any) -> str:
        seen.append(("original", args, kwargs, watch.depth, _held_elsewhere(lock)))
        return "from original"

    def hook(*args: Any, **kwargs: Any) -> str:
        seen.append(("hook", args, kwargs, watch.depth, _held_elsewhere(lock)))
        assert guard(7, size=2) == "from original"  # the allocator's own call inside it
        return "from hook"

    guard = impl.slot_guard(original, hook, watch, lock)
    assert guard(1, 2, page=3) == "from hook"
    assert seen == [("hook", (1, 2), {"page": 3}, 1, True), ("original", (7,), {"size": 2}, 1, True)]
    assert watch.depth == 0 and not _held_elsewhere(lock)
    assert guard.__wrapped__ is original


class _Boom(Exception):
    pass


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nested", [False, True])
def test_what_a_call_raises_goes_through_with_the_depth_reset_and_the_lock_released(impl: Any, nested: bool) -> None:
    watch, lock = SimpleNamespace(depth=0), threading.RLock()
    boom = _Boom("allocator failed")

    def original(*args: Any) -> None:
        raise boom

    def hook(*args: Any) -> None:
        if nested:
            guard()
        raise boom

    guard = impl.slot_guard(original, hook, watch, lock)
    with pytest.raises(_Boom) as info:
        guard()
    assert info.value is boom and info.value.__context__ is None
    assert watch.depth == 0 and not _held_elsewhere(lock)


class _Swallowing:
    """A lock whose ``__exit__`` swallows what was raised (as ``contextlib.suppress``)."""

    def __init__(self) -> None:
        self.exits: list[Any] = []

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        self.exits.append(exc[0])
        return True


@pytest.mark.parametrize("impl", IMPLS)
def test_a_lock_that_swallows_the_error_makes_the_call_give_none(impl: Any) -> None:
    lock, watch = _Swallowing(), SimpleNamespace(depth=0)

    def hook() -> None:
        raise _Boom("swallowed")

    assert impl.slot_guard(hook, hook, watch, lock)() is None
    assert impl.slot_guard(lambda: 5, lambda: 6, watch, lock)() == 6
    assert lock.exits == [_Boom, None] and watch.depth == 0


class _FailingExit:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        raise RuntimeError("exit failed")


@pytest.mark.parametrize("impl", IMPLS)
def test_an_error_of_the_locks_exit_is_raised_in_the_context_of_the_calls(impl: Any) -> None:
    watch = SimpleNamespace(depth=0)
    boom = _Boom("allocator failed")

    def hook() -> None:
        raise boom

    with pytest.raises(RuntimeError, match="exit failed") as info:
        impl.slot_guard(hook, hook, watch, _FailingExit())()
    assert info.value.__context__ is boom
    with pytest.raises(RuntimeError, match="exit failed") as info:
        impl.slot_guard(hook, lambda: 1, watch, _FailingExit())()
    assert info.value.__context__ is None


class _NoDepthReset:
    """A watch whose depth can be set to 1 but not back to 0."""

    def __init__(self) -> None:
        self.__dict__["depth"] = 0

    def __setattr__(self, name: str, value: Any) -> None:
        if value == 0:
            raise AttributeError("depth is stuck")
        self.__dict__[name] = value


@pytest.mark.parametrize("impl", IMPLS)
def test_a_depth_that_cannot_be_reset_is_an_error_after_the_hooks(impl: Any) -> None:
    lock = threading.RLock()
    boom = _Boom("allocator failed")

    def failing() -> None:
        raise boom

    with pytest.raises(AttributeError, match="stuck") as info:
        impl.slot_guard(failing, lambda: 1, _NoDepthReset(), lock)()
    assert info.value.__context__ is None and not _held_elsewhere(lock)
    with pytest.raises(AttributeError, match="stuck") as info:
        impl.slot_guard(failing, failing, _NoDepthReset(), lock)()
    assert info.value.__context__ is boom and not _held_elsewhere(lock)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_hook_that_is_not_callable_is_refused(impl: Any) -> None:
    with pytest.raises(TypeError, match=r"SlotGuard\(\): original \(the allocator's call\) and hook are callables"):
        impl.slot_guard(len, None, SimpleNamespace(depth=0), threading.RLock())


def test_the_compiled_guard_passes_the_callers_exception_context_through() -> None:
    """Called inside an ``except`` block, an error keeps the context Python would give it."""
    watch, lock = SimpleNamespace(depth=0), threading.RLock()
    boom = _Boom("allocator failed")

    def hook() -> None:
        raise boom

    for impl in (c_slots, py_slots):
        boom.__context__ = None
        try:
            raise KeyError("being handled")
        except KeyError:
            handled = sys.exc_info()[1]
            with pytest.raises(_Boom):
                impl.slot_guard(hook, hook, watch, lock)()
        assert boom.__context__ is handled, impl.__name__
