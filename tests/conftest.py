"""Suite-wide pytest hooks and fixtures: tests marked ``cuda`` are skipped on machines
without CUDA; ``fast_switching`` makes thread races show within a run.

A run started in the background by a shell without job control inherits SIGINT ignored, and so
would every command a test starts and then interrupts (``demo --serve`` stopped with SIGINT):
the suite puts Ctrl-C's default back, which those commands then inherit."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator

import pytest

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Let the interpreter switch threads every microsecond: races show in milliseconds, not hours."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
