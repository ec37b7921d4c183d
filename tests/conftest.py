"""Suite-wide pytest hooks and fixtures: tests marked ``cuda`` are skipped on machines
without CUDA; ``fast_switching`` makes thread races show within a run."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


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
