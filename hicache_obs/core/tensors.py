"""What makes an index tensor unusable by the copies, found before anything is emitted.

The copies do not read an index tensor the way ``tolist()`` does. The native copy loop
gets run lists made from a numpy view of the storage; the ``sim`` runtime's deferred
copies capture the arena offset, shape and strides, and rebuild a plain tensor over the
raw bytes when the side stream runs; CUDA kernels read device memory. A tensor whose
values are not its storage read through its shape and strides (a negative-bit or
conjugate-bit view, a subclass that answers for its storage, a zero tensor without
storage) validates with one set of values and is copied with another.

Every such tensor is refused with an :class:`~hicache_obs.errors.InvalidIndicesError`
that names the argument and what is wrong; none is materialised (a silent copy would
hide a caller's bug and cost a device allocation per op). Views with a storage offset
and strided (non-contiguous) 1-D views are accepted as given: every copy path reads
them through their offset and strides, as the values say.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tensor_problem"]

_PLAIN_CALLS = torch._C.DisableTorchFunctionSubclass
_is_functional = getattr(torch, "_is_functional_tensor", None)


def tensor_problem(t: torch.Tensor, runtime: Any) -> str | None:
    """What makes ``t`` unusable as an index tensor on ``runtime``, or None.

    Call it after the ``isinstance`` check; it reads only metadata (never the values,
    never a device sync), skipping any subclass's ``__torch_function__``.
    """
    device_type = getattr(runtime, "tensor_type", torch.Tensor)
    cls = type(t)
    if cls is device_type and cls is not torch.Tensor and not runtime.is_device(t):
        return f"is a device tensor of {runtime.tensor_device(t)}, not of this runtime ({runtime.device})"
    if cls is not torch.Tensor and cls is not device_type:
        return (
            f"must be a plain torch.Tensor, got an instance of {cls.__module__}.{cls.__qualname__}: "
            "a subclass's values need not be what its storage holds, and the copies read the storage"
        )
    with _PLAIN_CALLS():
        if t.layout != torch.strided:
            return f"must be a dense (strided) tensor, got layout {t.layout}"
        if t.is_nested:
            return "must be a dense tensor, got a nested tensor"
        if t._is_zerotensor():
            return "is a zero tensor without storage (torch._efficientzerotensor); the copies read storage"
        if _is_functional is not None and _is_functional(t):
            return "is a functional tensor (torch.func); pass the tensor it wraps"
        if t.is_neg():
            return (
                "has its negative bit set (a torch._neg_view): its storage holds the negated values, "
                "which the copies would read; pass t.resolve_neg()"
            )
        if t.is_conj():
            return "has its conjugate bit set: its storage is not its values; pass t.resolve_conj()"
        if t.requires_grad:
            return "requires grad; index tensors are plain data, pass t.detach()"
        if not runtime.is_device(t) and t.device.type != "cpu":
            return f"must be on the cpu or on device {runtime.device}, got one on {t.device}"
        n = t.numel()
        if n > 1 and any(s == 0 and k > 1 for s, k in zip(t.stride(), t.shape)):
            return (
                f"overlaps itself in memory (strides {tuple(t.stride())}, an expand()): "
                "its entries share storage elements"
            )
        if n:
            extent = t.storage_offset() + sum((k - 1) * s for k, s in zip(t.shape, t.stride())) + 1
            need = extent * t.element_size()
            have = t.untyped_storage().nbytes()
            if have < need:
                return (
                    f"has a storage of {have} bytes, smaller than the {need} its shape, strides and "
                    "offset reach (the storage was resized)"
                )
    return None
