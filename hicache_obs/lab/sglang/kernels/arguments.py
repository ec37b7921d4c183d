"""Reading the ops' arguments as the launchers do: index tensors on the host, integers checked."""

from __future__ import annotations

import operator
from typing import Any

import torch


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values on the CPU as a flat plain tensor (also for a subclass whose ``is_cuda`` is True)."""
    host = t.detach().cpu()
    if type(host) is not torch.Tensor:
        host = host.as_subclass(torch.Tensor)
    return host.reshape(-1)


def as_int(value: Any, name: str) -> int:
    """``value`` as a Python int (anything with ``__index__``); a TypeError naming ``name`` otherwise."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
