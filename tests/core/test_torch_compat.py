"""The private torch names the package takes from ``core.torch_compat`` do what it says."""

from __future__ import annotations

from typing import Any

import torch

from hicache_obs.core._torch_compat import TensorBase, no_torch_function, plain_tensor_calls, true_is_cpu


class _Loud(torch.Tensor):
    """A subclass that says it is on CUDA and counts the calls its override sees."""

    calls = 0

    @property  # type: ignore[misc]
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    @property  # type: ignore[misc]
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 3)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_true_is_cpu_reads_the_storage_past_a_subclass_device_property() -> None:
    t = torch.arange(3).as_subclass(_Loud)
    assert t.device == torch.device("cuda", 3) and t.is_cpu is False
    assert true_is_cpu(t) is True


def test_the_two_blocks_skip_a_subclass_override() -> None:
    t = torch.arange(3).as_subclass(_Loud)
    _Loud.calls = 0
    t.sum()
    assert _Loud.calls == 1
    with plain_tensor_calls():
        assert t.sum().item() == 3
    with no_torch_function():
        assert t.sum().item() == 3
    assert _Loud.calls == 1, "neither block ran the override"
    assert torch.Tensor.__mro__[1] is TensorBase and hasattr(TensorBase, "record_stream")
