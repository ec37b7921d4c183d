"""The cuda runtime's event wrapper: ``raw`` is the ``torch.cuda.Event`` it wraps, and
``elapsed_ns`` reads the end event's. ``torch.cuda.Event`` cannot be built without CUDA, so a
stand-in of its timing interface replaces it here (the cuda runtime tests run the real one)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache_obs.core._runtime import _CudaEvent
from hicache_obs.core._sim import SimRuntime


class _TimedEvent:
    """The part of ``torch.cuda.Event`` the wrapper uses for timing."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing

    def elapsed_time(self, end: Any) -> float:
        if not isinstance(end, _TimedEvent):  # as torch's: the end must be a CUDA event
            raise TypeError(f"elapsed_time() needs a CUDA event, got {type(end).__name__}")
        return 1.5  # milliseconds


def test_elapsed_ns_reads_the_raw_end_event_and_answers_none_for_another_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _TimedEvent)
    start, end = _CudaEvent(True), _CudaEvent(True)
    assert isinstance(start.raw, _TimedEvent) and start.raw is not end.raw and start.raw.enable_timing
    assert start.elapsed_ns(end) == 1_500_000
    assert start.elapsed_ns(SimRuntime().event(True)) is None  # no ``raw``: not a CUDA event
    with pytest.raises(AttributeError):
        start.raw = end.raw  # type: ignore[misc]  # read-only
