"""``read_free_lists``: one read of an allocator's free lists, as the SGLang adapter keeps them.

The compiled function (``hicache_obs/_slots.c``) and its pure twin
(``hicache_obs/events/_slots_py.py``) must give the same state, by reference, and the same
errors, on the allocators' shapes: a tensor or a list of ints first, then lists of freed
parts with or without a counter, tensors, missing or None attributes.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_obs import _slots as c_slots
from hicache_obs.events import _slots_py as py_slots

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IMPLS = [pytest.param(c_slots, id="c"), pytest.param(py_slots, id="py")]
PAGES = (("release_pages", None), ("staged_pages", "num_staged_pages"))


def _same(a: Any, b: Any) -> bool:
    """Two reads hold the same objects (tensors and lists by identity) and counts."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (torch.Tensor, list)):
        return a is b
    return bool(a == b)


tensors = st.integers(0, 6).map(lambda n: torch.arange(n))
heads = st.one_of(tensors, st.lists(st.integers(0, 99), max_size=6), st.none(), st.just(()))
parts = st.one_of(st.none(), tensors, st.lists(tensors, max_size=4), st.just("absent"))
counters = st.one_of(st.none(), st.integers(0, 50), st.booleans(), st.just("absent"), st.just(2.5))


@SETTINGS
@given(head=heads, release=parts, staged=parts, counter=counters)
def test_c_and_pure_read_the_same_state(head: Any, release: Any, staged: Any, counter: Any) -> None:
    obj = SimpleNamespace(free_pages=head)
    for name, value in (("release_pages", release), ("staged_pages", staged), ("num_staged_pages", counter)):
        if not (isinstance(value, str) and value == "absent"):
            setattr(obj, name, value)
    got = c_slots.read_free_lists(obj, "free_pages", PAGES, torch.Tensor)
    want = py_slots.read_free_lists(obj, "free_pages", PAGES, torch.Tensor)
    assert _same(got, want), (got, want)
    first, rest, n = want
    if isinstance(head, torch.Tensor):
        assert first is head
    else:
        assert first == tuple(head or ())
    expected = len(first)
    for (name, counter_name), part in zip(PAGES, rest):
        value = getattr(obj, name, None)
        if isinstance(value, list):
            assert part == (value, len(value)) and part[0] is value
            held = getattr(obj, counter_name, None) if counter_name else None
            expected += held if isinstance(held, int) else sum(x.numel() for x in value)
        else:
            assert part is value
            expected += 0 if value is None else value.numel()
    assert n == expected and type(n) is int


@pytest.mark.parametrize("impl", IMPLS)
def test_a_list_of_ints_is_kept_by_value_and_tensors_by_reference(impl: Any) -> None:
    free = [3, 4, 5]
    parts = [torch.arange(2)]
    obj = SimpleNamespace(free_slots=free, release_slots=parts, num_release_slots=7)
    first, rest, n = impl.read_free_lists(obj, "free_slots", (("release_slots", "num_release_slots"),), torch.Tensor)
    free.append(6)  # the allocator changes its list in place after the read
    parts.append(torch.arange(5))
    assert first == (3, 4, 5) and rest[0][0] is parts and rest[0][1] == 1 and n == 3 + 7


class _Counted(list):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 99


@pytest.mark.parametrize("impl", IMPLS)
def test_a_list_subclass_keeps_its_own_length(impl: Any) -> None:
    parts = _Counted([torch.arange(3)])
    obj = SimpleNamespace(free_pages=torch.arange(1), release_pages=parts)
    _, rest, n = impl.read_free_lists(obj, "free_pages", (("release_pages", None),), torch.Tensor)
    assert rest == ((parts, 99),) and n == 1 + 3


class _Broken:
    def numel(self) -> int:
        raise RuntimeError("numel failed")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("obj", "rest", "error", "match"),
    [
        (SimpleNamespace(), (), AttributeError, "free_pages"),
        (SimpleNamespace(free_pages=torch.arange(2), release_pages=_Broken()), PAGES[:1], RuntimeError, "numel failed"),
        (SimpleNamespace(free_pages=None, release_pages=[_Broken()]), PAGES[:1], RuntimeError, "numel failed"),
        (SimpleNamespace(free_pages=None), [("release_pages", None)], TypeError, "rest is a tuple"),
        (SimpleNamespace(free_pages=None), (("release_pages",),), TypeError, "rest is a tuple"),
        (SimpleNamespace(free_pages=None, release_pages=[]), (("release_pages", 5),), TypeError, "attribute name"),
        (SimpleNamespace(free_pages=7), (), TypeError, "int"),
    ],
)
def test_what_cannot_be_read_raises_the_same_error(impl: Any, obj: Any, rest: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        impl.read_free_lists(obj, "free_pages", rest, torch.Tensor)
