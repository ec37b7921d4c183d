"""What makes an index tensor unusable by the copies, found before anything is emitted.

The copies do not read an index tensor the way ``tolist()`` does. The native copy loop
gets run lists made from a numpy view of the storage; the ``sim`` runtime's deferred
copies capture the arena offset, shape and strides, and rebuild a plain tensor over the
raw bytes when the side stream runs; CUDA kernels read device memory. A tensor whose
values are not its storage read through its shape and strides (a negative-bit or
conjugate-bit view, a subclass that answers for its values, a zero tensor without
memory) validates with one set of values and is copied with another.

Every such tensor is refused with an :class:`~hicache_obs.errors.InvalidIndicesError`
that names the argument, the pool and what is wrong, before anything is allocated or
emitted; none is materialised (a silent copy would hide a caller's bug, and cost a
device allocation per op). Per kind:

- refused: a subclass of ``torch.Tensor`` other than the runtime's own device tensor
  class (``SimTensor`` on ``sim``), checked before any other metadata is read, since a
  subclass answers for its dtype and shape too; another ``SimRuntime``'s tensor (its
  offsets name another arena); a negative-bit view (``torch._neg_view``); a sparse or
  nested tensor; a tensor on neither the cpu nor the runtime's device (``meta``); a
  tensor overlapping itself (stride 0 over several entries, an ``expand()``); a storage
  smaller than the shape, stride and offset reach (a resized storage); a zero tensor
  (``torch._efficientzerotensor``, whose storage has no memory).
- impossible for int64 (refused by the dtype check): a conjugate bit, ``requires_grad``.
- accepted as given: a storage offset, a stride other than 1 (non-contiguous): every
  copy path (numpy views for the native loop, captured strides on ``sim``, torch's index
  kernels) reads them through their offset and stride, as the values say.
"""

from __future__ import annotations

from typing import Any

import torch

from ._torch_compat import is_zero_tensor, plain_tensor_calls

__all__ = ["subclass_problem", "tensor_problem"]


def subclass_problem(t: torch.Tensor, runtime: Any) -> str | None:
    """Why ``t``'s class makes it unusable, or None. First of all checks: a subclass may
    answer for any metadata, its dtype and shape included. Reads only ``type(t)``."""
    cls = type(t)
    if cls is torch.Tensor:
        return None
    device_type = getattr(runtime, "tensor_type", torch.Tensor)
    if cls is device_type:
        if runtime.is_device(t):
            return None
        return f"is a device tensor of {runtime.tensor_device(t)}, not of this runtime ({runtime.device})"
    return (
        f"must be a plain torch.Tensor, got an instance of {cls.__module__}.{cls.__qualname__}: "
        "a subclass's values need not be what its storage holds, and the copies read the storage"
    )


def tensor_problem(t: torch.Tensor, runtime: Any) -> str | None:
    """What makes ``t`` (of an accepted class, int64, 1-D) unusable as an index tensor on
    ``runtime``, or None. Reads only metadata: never the values, never a device sync."""
    if type(t) is torch.Tensor:
        return _flag_problem(t, runtime)
    with plain_tensor_calls():  # the device tensor class's __torch_function__ costs microseconds a call
        return _flag_problem(t, runtime)


def _flag_problem(t: torch.Tensor, runtime: Any) -> str | None:
    # a conjugate bit cannot be set on an integer tensor; an int64 tensor cannot require grad
    if t.layout != torch.strided or t.is_nested:
        return f"must be a dense (strided) tensor, got layout {t.layout}{' (nested)' if t.is_nested else ''}"
    if is_zero_tensor(t):  # its storage claims the bytes but has none
        return "is a zero tensor without storage (torch._efficientzerotensor); the copies read storage"
    if t.is_neg():
        return (
            "has its negative bit set (a torch._neg_view): its storage holds the negated values, "
            "which the copies would read; pass t.resolve_neg()"
        )
    if not t.is_cpu and not runtime.is_device(t):
        return f"must be on the cpu or on device {runtime.device}, got one on {t.device}"
    n = t.numel()
    if n:
        stride = t.stride(0)
        if stride == 0 and n > 1:
            return "overlaps itself in memory (stride 0, an expand()): its entries share one storage element"
        need = (t.storage_offset() + (n - 1) * stride + 1) * 8
        have = t.untyped_storage().nbytes()
        if have < need:
            return (
                f"has a storage of {have} bytes, smaller than the {need} its shape, stride and offset "
                "reach (its storage was resized)"
            )
    return None
