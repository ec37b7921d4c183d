"""How the SGLang adapter reads the slots a free hands an allocator (``_FreeList._given``),
on a stand-in allocator: page ids read once in C, without a copy of their values."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from hicache_obs.integrations.sglang import _adapter as adapter


class _PageAllocator:
    """What the adapter reads of a page allocator: its free pages and its page size."""

    def __init__(self, page_size: int, pages: int) -> None:
        self.page_size = page_size
        self.free_pages = torch.arange(1, pages, dtype=torch.int64)


def _copied_runs(free_list: Any, kind: str, values: list[int]) -> Any:
    """The runs the values name, from a copy of them (what the adapter did before)."""
    units = np.asarray(values, dtype=np.int64)
    if kind == "slots":
        units = np.unique(units // free_list.page)
    return free_list.slot_runs(units)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "pages", [[3], [3, 4, 5, 9], [9, 3, 4], [7, 7], list(range(20)), [0, 2, 4, 6]], ids=lambda p: str(p)[:20]
)
def test_page_ids_given_to_a_free_are_read_as_their_slots_without_copying_them(
    monkeypatch: pytest.MonkeyPatch, page_size: int, pages: list[int]
) -> None:
    watch = adapter._FreeList(_PageAllocator(page_size, 64), capacity=64 * page_size)
    expected = _copied_runs(watch, "pages", pages)

    def copied(part: Any) -> Any:
        raise AssertionError("the page ids were copied out of their tensor")

    monkeypatch.setattr(adapter, "_values", copied)
    got = watch._given("pages", (torch.tensor(pages, dtype=torch.int64),), {})
    assert [tuple(r) for r in got] == [tuple(r) for r in expected]
    assert sum(n for _, n in got) == len(pages) * page_size  # each page's slots, as many as it frees
    assert [tuple(r) for r in watch._given("pages", (), {"page_ids": torch.tensor(pages, dtype=torch.int32)})] == [
        tuple(r) for r in expected
    ]


def test_slots_given_to_a_page_free_still_name_each_page_once() -> None:
    watch = adapter._FreeList(_PageAllocator(16, 64), capacity=64 * 16)
    slots = [32, 33, 47, 48]  # pages 2 and 3, not whole
    got = watch._given("slots", (torch.tensor(slots),), {})
    assert [tuple(r) for r in got] == [(32, 32)] == [tuple(r) for r in _copied_runs(watch, "slots", slots)]
    whole = list(range(32, 64))  # pages 2 and 3 whole: read in place
    assert [tuple(r) for r in watch._given("slots", (torch.tensor(whole),), {})] == [(32, 32)]
    assert watch._given("pages", (), {}) is None  # no tensor given
