"""``dlpack_facts``: an index tensor's size, address and value runs from its DLPack capsule.

The compiled function (``hicache_obs/_slots.c``) and its pure twin
(``hicache_obs/events/_slots_py.py``) must agree with each other and with the tensor's own
answers (``numel()``, ``data_ptr()``, its values through numpy) on random tensors: every
integer dtype, views, transposes, expands, empty and 0-d tensors, floats and bools. The SGLang
adapter's ``tensor_ref`` and ``host_runs`` read through it, and must give what the tensor's
own methods give. Hostile capsules are probed in a child interpreter, so a crash is a failed
test, not a dead run.
"""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_kit import run_lines

from hicache_obs import _slots as c_slots
from hicache_obs.core._torch_compat import to_dlpack
from hicache_obs.events import _slots_py as py_slots
from hicache_obs.events._schema import TensorRef

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float32]
INTS = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}

pytestmark = pytest.mark.skipif(to_dlpack is None, reason="this torch has no torch._C._to_dlpack")


@st.composite
def tensors(draw: Any) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(0, 40))
    if dtype is torch.bool:
        base = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool)
    elif dtype is torch.float32:
        base = torch.tensor(draw(st.lists(st.floats(-1e6, 1e6), min_size=n, max_size=n)), dtype=dtype)
    else:
        info = torch.iinfo(dtype)
        # mostly runs of consecutive values (what index tensors hold), sometimes anything
        start = draw(st.integers(info.min, info.max - n))
        values = [start + i for i in range(n)]
        for i in draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=4)) if n else []:
            values[i] = draw(st.integers(info.min, info.max))
        base = torch.tensor(values, dtype=dtype)
    shape = draw(st.sampled_from(["flat", "step", "offset", "matrix", "transposed", "scalar", "expand"]))
    if shape == "step" and n:
        return base[:: draw(st.integers(1, 4))]
    if shape == "offset" and n > 2:
        return base[draw(st.integers(1, n - 1)) :]
    if shape == "matrix" and n and n % 2 == 0:
        return base.reshape(2, n // 2)
    if shape == "transposed" and n and n % 2 == 0:
        return base.reshape(2, n // 2).t()
    if shape == "scalar" and n:
        return base[0].clone()
    if shape == "expand" and n:
        return base[:1].expand(draw(st.integers(1, 5)))
    return base


def outcome(fn: Any, *args: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn(*args))
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        return ("raised", type(exc).__name__, str(exc))


@SETTINGS
@given(tensors())
def test_both_agree_with_each_other_and_with_the_tensor(t: torch.Tensor) -> None:
    got_c = c_slots.dlpack_facts(to_dlpack(t))
    got_py = py_slots.dlpack_facts(to_dlpack(t))
    assert got_c == got_py
    device_type, device_id, numel, _code, _bits, ptr, runs = got_c
    assert (device_type, device_id) == (1, 0)  # DLPack's CPU
    assert numel == t.numel()
    assert ptr == (t.data_ptr() if t.numel() else 0)
    if runs is not None:
        assert t.dtype in INTS  # floats and bools are left to the tensor's own methods
        assert runs == c_slots.runs_of(t.reshape(-1).numpy().astype(np.int64))
    elif t.dtype in INTS:
        assert t.numel() > 1 and t.dim() >= 1  # only a layout no single stride walks
        assert not t.is_contiguous() or 0 in t.stride()


@SETTINGS
@given(tensors())
def test_tensor_ref_and_host_runs_are_what_the_tensors_own_methods_say(t: torch.Tensor) -> None:
    from hicache_obs.integrations.sglang import _tensor_facts as facts

    fast = facts.tensor_ref(t, "kv", "host")
    fast_runs = facts.host_runs(t)
    saved = facts._TO_DLPACK
    facts._TO_DLPACK = None  # the path without DLPack: the tensor's own methods
    try:
        slow = facts.tensor_ref(t, "kv", "host")
        slow_runs = facts.host_runs(t)
    finally:
        facts._TO_DLPACK = saved
    assert isinstance(fast, TensorRef)
    assert fast == slow
    assert fast_runs == slow_runs


PRELUDE = """
import ctypes, torch
from hicache_obs import _slots
from hicache_obs.events import _slots_py
new = ctypes.pythonapi.PyCapsule_New
new.restype = ctypes.py_object
new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
"""


def test_hostile_capsules_are_type_errors_in_both() -> None:
    body = """
    used = torch._C._to_dlpack(torch.arange(3))
    torch.from_dlpack(used)  # consumed: renamed "used_dltensor"
    buf = ctypes.create_string_buffer(64)
    other = new(ctypes.addressof(buf), b"not_dltensor", None)
    for mod in (_slots, _slots_py):
        for bad in (5, None, b"dltensor", used, other):
            show(mod.dlpack_facts, bad)
    """
    lines = run_lines(PRELUDE + textwrap.dedent(body))
    names = ["int", "NoneType", "bytes", "PyCapsule", "PyCapsule"]
    want = [f'TypeError dlpack_facts: an unconsumed "dltensor" capsule is needed, got {n}' for n in names]
    assert lines == want + want


def test_a_tensor_with_no_memory_behind_it_has_no_runs_in_both() -> None:
    """A wrapper subclass (``_make_wrapper_subclass``) has no storage: its capsule's data
    pointer is null. Its values are not read (they used to be: a crash in C, stray memory in
    the twin), and the adapter's read of them fails as a clean, countable error."""
    body = """
    class NoStorage(torch.Tensor):
        @staticmethod
        def __new__(cls, n):
            return torch.Tensor._make_wrapper_subclass(cls, (n,), dtype=torch.int64)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(f"NoStorage has no {func}")

    t = NoStorage(4)
    for mod in (_slots, _slots_py):
        kind, dev, numel, code, bits, ptr, runs = mod.dlpack_facts(torch._C._to_dlpack(t))
        print(kind, numel, code, bits, runs)
    from hicache_obs.integrations.sglang import _tensor_facts as facts
    show(facts.host_runs, t)
    """
    lines = run_lines(PRELUDE + textwrap.dedent(body))
    assert lines[:2] == ["1 4 0 64 None"] * 2
    assert len(lines) == 3 and lines[2].startswith("NotImplementedError NoStorage has no "), lines
