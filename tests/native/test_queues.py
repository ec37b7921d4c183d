"""``OpQueue`` / ``AckQueue`` / ``Stamp`` / ``AckNote``: the SGLang adapter's queues.

The controller's write, load and ack queues are swapped for these lists: the compiled types
(``hicache_obs/_slots.c``) and their pure twins (``hicache_obs/events/_slots_py.py``) must
hold what a plain list holds after any sequence of list operations, and report the same
items to their callbacks in the same order.
"""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_obs import _slots as c_slots
from hicache_obs.events import _slots_py as py_slots

IMPLS = [pytest.param(c_slots, id="c"), pytest.param(py_slots, id="py")]

_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 99)),
        st.tuples(st.just("pop"), st.sampled_from([None, 0, -1, 1, 5])),
        st.tuples(st.just("remove"), st.integers(0, 99)),
        st.tuples(st.just("del"), st.sampled_from([0, -1, slice(0, 2), slice(None), slice(1, None, 2)])),
        st.tuples(st.just("clear"), st.none()),
        st.tuples(st.just("extend"), st.lists(st.integers(0, 99), max_size=3)),
        st.tuples(st.just("insert"), st.integers(0, 99)),
        st.tuples(st.just("set"), st.integers(0, 99)),
    ),
    max_size=30,
)


def _apply(q: list[Any], step: tuple[str, Any]) -> Any:
    """One list operation; its result, or the type of what it raised."""
    name, arg = step
    try:
        if name == "append":
            return q.append(arg)
        if name == "pop":
            return q.pop() if arg is None else q.pop(arg)
        if name == "remove":
            return q.remove(arg)
        if name == "del":
            del q[arg]
            return None
        if name == "clear":
            return q.clear()
        if name == "extend":
            return q.extend(arg)
        if name == "insert":
            return q.insert(0, arg)
        q[0] = arg
        return None
    except (IndexError, ValueError) as exc:
        return type(exc)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=300, deadline=None)
@given(start=st.lists(st.integers(0, 99), max_size=5), steps=_STEPS)
def test_an_ack_queue_is_a_list_that_reports_what_it_took(impl: Any, start: list[int], steps: Any) -> None:
    log: list[tuple[str, Any]] = []
    q = impl.AckQueue(start, lambda a: log.append(("appended", a)), lambda a: log.append(("taken", a)),
                      lambda a: log.append(("cleared", a)))  # fmt: skip
    plain = list(start)
    want: list[tuple[str, Any]] = []
    for step in steps:
        before = list(plain)
        got_plain = _apply(plain, step)
        assert _apply(q, step) == got_plain
        name = step[0]
        if name == "append":
            want.append(("appended", step[1]))
        elif name in ("pop", "remove", "del") and got_plain not in (IndexError, ValueError):
            arg = step[1]
            if name == "pop":
                gone = [got_plain]
            elif name == "remove":
                gone = [arg]
            else:
                gone = before[arg] if isinstance(arg, slice) else [before[arg]]
            want += [("taken", a) for a in gone]
        elif name == "clear":
            want += [("cleared", a) for a in before]
    assert list(q) == plain and isinstance(q, list)
    assert log == want


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=200, deadline=None)
@given(start=st.lists(st.integers(0, 99), max_size=5), steps=_STEPS)
def test_an_op_queue_reports_appends_and_what_a_clear_took(impl: Any, start: list[int], steps: Any) -> None:
    log: list[tuple[str, Any]] = []
    q = impl.OpQueue(start, lambda op: log.append(("queued", op)), lambda ops: log.append(("cleared", ops)))
    plain = list(start)
    want: list[tuple[str, Any]] = []
    for step in steps:
        before = list(plain)
        assert _apply(q, step) == _apply(plain, step)
        if step[0] == "append":
            want.append(("queued", step[1]))
        elif step[0] == "clear" and before:
            want.append(("cleared", before))
    assert list(q) == plain and log == want


@pytest.mark.parametrize("impl", IMPLS)
def test_a_callbacks_error_is_raised_after_the_list_changed(impl: Any) -> None:
    def refuse(*args: Any) -> None:
        raise RuntimeError("the callback failed")

    q = impl.AckQueue([1, 2], refuse, refuse, refuse)
    for call, left in ((lambda: q.append(3), [1, 2, 3]), (q.pop, [1, 2]), (lambda: q.remove(1), [2]), (q.clear, [])):
        with pytest.raises(RuntimeError, match="the callback failed"):
            call()
        assert list(q) == left
    ops = impl.OpQueue([1], refuse, refuse)
    with pytest.raises(RuntimeError, match="the callback failed"):
        ops.clear()
    assert list(ops) == []
    with pytest.raises(TypeError, match="callbacks are callables"):
        impl.OpQueue([], None, refuse)
    with pytest.raises(TypeError, match="callbacks are callables"):
        impl.AckQueue([], refuse, refuse, 3)
    with pytest.raises(TypeError, match="cannot copy"):
        pickle.dumps(ops)
    with pytest.raises(TypeError, match="cannot copy"):
        copy.deepcopy(q)


@pytest.mark.parametrize("impl", IMPLS)
def test_stamp_notes_when_and_ack_note_adds_acks_of_its_direction(impl: Any) -> None:
    times: dict[int, int] = {}
    ticks = iter(range(100, 200))
    stamp = impl.Stamp(times, lambda: next(ticks))
    a, b = object(), object()
    stamp(a)
    stamp(b)
    assert times == {id(a): 100, id(b): 101}
    with pytest.raises(TypeError, match="times is a dict"):
        impl.Stamp([], lambda: 0)
    failed: list[str] = []
    current = SimpleNamespace(sub=None)
    note = impl.AckNote(current, "d2h", failed.append)
    note("ack0")  # outside a submission
    current.sub = SimpleNamespace(direction="d2h", acks=[])
    note("ack1")
    current.sub, write = SimpleNamespace(direction="h2d", acks=[]), current.sub
    note("ack2")  # a load's submission: not this queue's
    assert write.acks == ["ack1"] and current.sub.acks == [] and failed == []
    current.sub = SimpleNamespace(direction="d2h")  # no acks to add to: counted, not raised
    note("ack3")
    assert failed == ["note an ack of a submission"]
    with pytest.raises(TypeError, match="failed is a callable"):
        impl.AckNote(current, "d2h", None)


class _End:
    durable: Any = None


@pytest.mark.parametrize("impl", IMPLS)
def test_ack_taken_completes_its_op_and_hands_the_rest_to_the_fallback(impl: Any) -> None:
    events: list[tuple[Any, dict[str, Any]]] = []
    fallen: list[Any] = []
    failed: list[str] = []
    synced: list[int] = []
    pending: dict[int, Any] = {}
    held: dict[int, Any] = {}
    end = _End()

    def emit(cls: Any, **fields: Any) -> None:
        events.append((cls, fields))

    taken = impl.AckTaken(fallen.append, (pending, held, end, emit, "Done", failed.append, lambda: synced.append(1)))
    plain, timed, other = SimpleNamespace(), SimpleNamespace(timing_enabled=True), SimpleNamespace()
    pending.update({id(plain): (7, "d2h"), id(timed): (8, "h2d")})
    taken(other)  # no op awaits it
    taken(plain)
    assert events == [("Done", {"op": 7, "direction": "d2h", "duration_ns": 0})] and id(plain) not in pending
    taken(timed)  # its copy's time is the fallback's to read
    assert fallen == [timed] and id(timed) in pending and len(events) == 1
    pending[id(plain)] = (9, "d2h")
    held[9] = "device tensors"
    taken(plain)  # an op holding tensors: the fallback's
    assert fallen == [timed, plain] and id(plain) in pending
    held.clear()
    end.durable = ("count", "flush")
    taken(plain)
    assert events[-1][1]["op"] == 9 and synced == [1] and failed == []

    def refuse(cls: Any, **fields: Any) -> None:
        raise RuntimeError("the log is closed")

    broken = impl.AckTaken(fallen.append, (pending, held, _End(), refuse, "Done", failed.append, print))
    pending[id(plain)] = (10, "d2h")
    broken(plain)
    assert failed == ["record a TransferCompleted event"] and id(plain) not in pending
    with pytest.raises(TypeError, match="fallback is a callable and setup a tuple of 7"):
        impl.AckTaken(print, (pending,))
    with pytest.raises(TypeError, match="pending dict"):
        impl.AckTaken(print, ([], held, end, emit, "Done", print, print))


@pytest.mark.parametrize("impl", IMPLS)
def test_queue_cleared_passes_over_the_usual_clear_only(impl: Any) -> None:
    fallen: list[Any] = []
    resetting = SimpleNamespace(depth=0)
    queued_at: dict[int, int] = {}
    current = SimpleNamespace(sub=None)
    cleared = impl.QueueCleared(fallen.append, ("d2h", resetting, queued_at, current))
    ops = [SimpleNamespace(id=1), SimpleNamespace(id=2)]
    cleared(ops)  # no queue time noted: nothing to forget
    assert fallen == []
    queued_at[id(ops[0])] = 5
    current.sub = SimpleNamespace(direction="d2h", queued_ops=list(ops))
    cleared(list(ops))  # the submission that merged exactly these
    assert fallen == []
    for case in ([ops[0]], [ops[1], ops[0]]):  # another set, another order
        cleared(case)
    current.sub = SimpleNamespace(direction="h2d", queued_ops=list(ops))
    cleared(list(ops))  # a load's submission clearing the write queue
    current.sub = None
    cleared(list(ops))
    resetting.depth = 1
    queued_at.clear()
    cleared(list(ops))  # inside a reset: always the fallback's
    assert [len(c) for c in fallen] == [1, 2, 2, 2, 2]
    with pytest.raises(TypeError, match="setup a tuple of 4"):
        impl.QueueCleared(print, ("d2h",))
