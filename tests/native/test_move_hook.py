"""``move_hook``: the SGLang adapter's hook of the controller's op-level move.

The first move inside a submission notes its op and keeps, as the submission's moves, the
index tensors the move put on another device, each described once; the compiled hook
(``hicache_obs/_slots.c``) and its pure twin (``hicache_obs/events/_slots_py.py``) must do the
same, count a step of their own that fails, and leave SGLang's move and its result as they came.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hicache_obs import _slots as c_slots
from hicache_obs.events import _slots_py as py_slots
from hicache_obs.events._schema import Moved, TensorRef
from hicache_obs.integrations.sglang import _tensor_facts as facts

IMPLS = [pytest.param(c_slots, id="c"), pytest.param(py_slots, id="py")]


class _OnDevice(torch.Tensor):
    """A CPU tensor that reports CUDA device 0, as a GPU's index tensor does."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


class _Current:
    sub: Any = None


class _Recorder:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.merged: list[Any] = []
        self.reported: list[tuple[Any, Any, Any]] = []
        self.valued: list[tuple[Any, str, str]] = []

    def tensor_ref(self, t: Any, pool: str, role: str) -> str:
        self.valued.append((t, pool, role))
        return f"values of {pool}/{role}"


def _setup(rec: _Recorder, *, full: bool = False) -> tuple[Any, ...]:
    return (
        full,
        rec.merged.append,
        lambda sub, before, after: rec.reported.append((sub, before, after)),
        rec.failed.append,
        facts.NO_TORCH_FUNCTION,
        "kv",
        torch.Tensor,
        {},
        str,
        facts.META_NAMES,
        facts.device_name,
        Moved,
        TensorRef,
        facts.tensor_meta,
        rec.tensor_ref,
    )


def _sub(**fields: Any) -> SimpleNamespace:
    base: dict[str, Any] = {"op": None, "merged_emitted": False, "moves": [], "refs": {}, "sampled": False}
    base.update(fields)
    return SimpleNamespace(**base)


class _Move:
    """The controller's ``_move_write_operation``: the op's indices, the host ones now on the device."""

    def __init__(self, result: Any = None) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.result = result

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(((op, *args), kwargs))
        if self.result is not None:
            return self.result
        return op.host_indices.as_subclass(_OnDevice).clone(), op.device_indices


def _op() -> SimpleNamespace:
    return SimpleNamespace(id=4, host_indices=torch.arange(3), device_indices=torch.arange(3).as_subclass(_OnDevice))


@pytest.mark.parametrize("impl", IMPLS)
def test_the_first_move_of_a_submission_keeps_what_went_to_another_device(impl: Any) -> None:
    rec, move, current = _Recorder(), _Move(), _Current()
    fallback_calls: list[Any] = []
    hook = impl.move_hook(move, current, lambda *a, **k: fallback_calls.append((a, k)), _setup(rec))
    assert hook.__wrapped__ is move
    op = _op()
    hook(op, "stream")  # outside a submission
    sub = current.sub = _sub()
    host, device = hook(op, "stream", sync=False)
    assert device is op.device_indices
    assert move.calls[-1] == ((op, "stream"), {"sync": False})
    assert sub.op is op and sub.merged_emitted is True and rec.merged == []
    want_ref = facts.tensor_meta(host, "kv", "host")
    assert sub.moves == [Moved("kv", "host", "cpu", "cuda:0", want_ref)]  # the device indices stayed
    assert sub.refs == {(id(host), "kv", "host"): want_ref}
    hook(_op())  # an inner move: the op is set
    assert len(sub.moves) == 1 and sub.op is op and len(move.calls) == 3
    hook(op=op)  # the op by name: the fallback's
    assert fallback_calls == [((), {"op": op})]
    assert rec.failed == [] and rec.valued == []


@pytest.mark.parametrize("impl", IMPLS)
def test_a_sampled_submission_describes_with_values_once_and_full_reports(impl: Any) -> None:
    rec, current = _Recorder(), _Current()
    op = _op()
    moved = op.host_indices.as_subclass(_OnDevice)
    hook = impl.move_hook(_Move((moved, op.device_indices)), current, print, _setup(rec))
    known = "described before"
    sub = current.sub = _sub(sampled=True, refs={(id(moved), "kv", "host"): known})
    hook(op)
    assert sub.moves == [Moved("kv", "host", "cpu", "cuda:0", known)] and rec.valued == []  # made once
    sub = current.sub = _sub(sampled=True)
    hook(op)
    assert sub.moves == [Moved("kv", "host", "cpu", "cuda:0", "values of kv/host")]  # type: ignore[arg-type]
    assert rec.valued == [(moved, "kv", "host")]
    full = impl.move_hook(_Move(), current, print, _setup(rec, full=True))
    sub = current.sub = _sub()
    full(op)
    assert rec.merged == [sub] and sub.merged_emitted is False and sub.moves == []
    ((who, before, after),) = rec.reported
    assert who is sub and set(before) == set(after) == {("kv", "host"), ("kv", "device")}
    assert before[("kv", "host")] is op.host_indices and after[("kv", "device")] is op.device_indices


@pytest.mark.parametrize("impl", IMPLS)
def test_a_move_with_transfers_in_its_result_compares_them(impl: Any) -> None:
    rec, current = _Recorder(), _Current()
    mamba = SimpleNamespace(name="mamba", host_indices=torch.arange(2), device_indices=None)
    op = _op()
    op.pool_transfers = [mamba]
    moved = SimpleNamespace(name="mamba", host_indices=torch.arange(2).as_subclass(_OnDevice), device_indices=None)
    hook = impl.move_hook(_Move((op.host_indices, op.device_indices, [moved])), current, print, _setup(rec))
    sub = current.sub = _sub()
    hook(op)
    ref = facts.tensor_meta(moved.host_indices, "mamba", "host")
    assert sub.moves == [Moved("mamba", "host", "cpu", "cuda:0", ref)] and rec.failed == []


@pytest.mark.parametrize("impl", IMPLS)
def test_a_step_that_fails_is_counted_and_the_move_is_as_it_came(impl: Any) -> None:
    rec, current = _Recorder(), _Current()
    move = _Move(result=("host", "device"))
    hook = impl.move_hook(move, current, print, _setup(rec))
    sub = current.sub = _sub()
    bare = SimpleNamespace(id=1)  # no indices to read
    assert hook(bare, 2) == ("host", "device")
    assert rec.failed == ["describe an index move"] and sub.op is bare and sub.moves == []
    assert move.calls[-1] == ((bare, 2), {})
    rec.failed.clear()
    odd = impl.move_hook(_Move(result=42), current, print, _setup(rec))
    current.sub = _sub()
    assert odd(_op()) == 42  # a result that is not (host, device): SGLang's, as it came
    assert rec.failed == ["describe an index move"]

    class Broken(Exception):
        pass

    def raising(op: Any) -> Any:
        raise Broken("the move failed")

    rec.failed.clear()
    current.sub = _sub()
    with pytest.raises(Broken, match="the move failed"):
        impl.move_hook(raising, current, print, _setup(rec))(_op())
    assert rec.failed == []


@pytest.mark.parametrize("impl", IMPLS)
def test_a_setup_of_the_wrong_shape_is_refused(impl: Any) -> None:
    good = _setup(_Recorder())
    cases = [
        ((print, _Current(), None, good), "are callables"),
        ((print, _Current(), print, good[:-1]), "setup is a tuple of 15"),
        ((print, _Current(), print, (*good[:3], None, *good[4:])), "item 3 is a callable"),
        ((print, _Current(), print, (*good[:7], [], *good[8:])), "pool_names is a dict"),
        ((print, _Current(), print, (*good[:9], ({}, {}), *good[10:])), "names is"),
    ]
    for args, text in cases:
        with pytest.raises(TypeError, match=text):
            impl.move_hook(*args)
