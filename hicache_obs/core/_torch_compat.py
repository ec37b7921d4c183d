"""The private torch names this package relies on, named once.

torch keeps a few things it has no public name for in ``torch._C``. Every module of
the package takes them from here, so a torch release that moves one breaks this file
alone, and ``grep torch_compat`` lists every place that depends on them.

- :data:`plain_tensor_calls`: a context manager under which a tensor subclass's
  ``__torch_function__`` is skipped (``torch._C.DisableTorchFunctionSubclass``). The
  ``sim`` runtime's device tensor class costs microseconds a call through its
  override; inside this block its methods run as plain ``torch.Tensor``'s.
- :data:`no_torch_function`: a context manager under which every
  ``__torch_function__`` mode and override is skipped (``torch._C.DisableTorchFunction``),
  for reading a tensor the caller handed over without running the caller's hooks.
- :data:`true_is_cpu`: ``true_is_cpu(t)`` says whether ``t``'s storage is on the CPU, read
  past whatever a subclass's ``is_cpu`` or ``device`` property answers
  (``torch._C.TensorBase.is_cpu``'s getter).
- :data:`to_dlpack`: ``to_dlpack(t)`` is a DLPack ``"dltensor"`` capsule of ``t``
  (``torch._C._to_dlpack``: the C function under ``Tensor.__dlpack__``, without its Python
  checks, stream handling and torch function dispatch), or ``None`` where torch lacks it.
- :data:`is_zero_tensor`: ``is_zero_tensor(t)`` says whether ``t`` is a zero tensor, one
  whose storage claims its bytes but has none (``torch._efficientzerotensor``;
  ``Tensor._is_zerotensor``).
- :data:`TensorBase`: the C base class of ``torch.Tensor``; its methods (``record_stream``
  among them) are what a call on a tensor reaches when ``torch.Tensor`` does not override it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._C import DisableTorchFunction, DisableTorchFunctionSubclass, TensorBase

__all__ = ["plain_tensor_calls", "no_torch_function", "true_is_cpu", "to_dlpack", "is_zero_tensor", "TensorBase"]

plain_tensor_calls = DisableTorchFunctionSubclass
no_torch_function = DisableTorchFunction
# mypy types TensorBase.is_cpu as a bool, not as the attribute descriptor it is
true_is_cpu: Callable[[torch.Tensor], bool] = TensorBase.is_cpu.__get__  # type: ignore[attr-defined]
to_dlpack: Callable[[torch.Tensor], Any] | None
try:
    from torch._C import _to_dlpack as to_dlpack
except ImportError:  # a torch without it: callers ask the tensor itself
    to_dlpack = None
# the method itself, read from the class's namespace (a torch release that renames it fails here, at import)
is_zero_tensor: Callable[[torch.Tensor], bool] = TensorBase.__dict__["_is_zerotensor"]
