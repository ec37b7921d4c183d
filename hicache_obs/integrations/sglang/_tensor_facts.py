"""What an index tensor SGLang handed over is: device, size, values, as a ``TensorRef``.

Every read here runs with torch function dispatch off (``NO_TORCH_FUNCTION``): these are
facts about the tensor, and a process-wide torch function mode (a tracer, a debugging
mode, the CPU harness's CUDA stand-in) would otherwise run in Python for each of them.
Values are read only where the storage is host memory: a device tensor's values would
cost a sync, so they are never read.

Each read runs between SGLang's copies, with cold caches, where one torch call costs
several times what it does in a loop. So size, dtype, address and the runs of the values
come from one call: a DLPack capsule of the tensor (``torch_compat.to_dlpack``), read by
:func:`~hicache_obs._native.dlpack_facts`. Where torch cannot export the tensor, or its
host values are not integers one stride walks, the tensor's own methods answer instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..._native import dlpack_facts, runs_of, value_ref
from ...core._torch_compat import no_torch_function, to_dlpack, true_is_cpu
from ...events._schema import TensorRef

__all__ = ["META_NAMES", "NO_TORCH_FUNCTION", "device_name", "host_runs", "host_values", "tensor_meta", "tensor_ref"]

NO_TORCH_FUNCTION = no_torch_function
_TRUE_IS_CPU = true_is_cpu  # the storage's device, whatever a subclass reports
_TO_DLPACK = to_dlpack
_DTYPES = {torch.int64: "int64", torch.int32: "int32"}
_DL_DTYPES = {(0, 64): "int64", (0, 32): "int32"}  # DLPack (type code, bits): the index dtypes
_DL_HOST = (1, 3)  # DLPack device types whose memory the host reads: CPU, CUDA host (pinned)
_INT64 = np.dtype(np.int64)
_CUDA_NAMES: dict[torch.device, str] = {}
#: what :func:`~hicache_obs._native.use_refs` reads most tensors with, as :func:`tensor_meta`
#: does: the dtype names, the device names :func:`device_name` has made, the device class
META_NAMES = (_DTYPES, _CUDA_NAMES, torch.device)


def device_name(t: torch.Tensor) -> str:
    """``cuda:N``, ``cpu`` or torch's name of the tensor's device, as the tensor reports it."""
    if t.is_cuda:
        dev = t.device
        name = _CUDA_NAMES.get(dev) if type(dev) is torch.device else None
        if name is None:
            kind, index = getattr(dev, "type", None), getattr(dev, "index", None)
            if isinstance(dev, str):  # a device reported by its name
                try:
                    parsed = torch.device(dev)
                    kind, index = parsed.type, parsed.index
                except (RuntimeError, ValueError):
                    pass
            name = f"cuda:{index or 0}" if kind == "cuda" else "cuda:0"
            if type(dev) is torch.device and len(_CUDA_NAMES) < 64:
                _CUDA_NAMES[dev] = name
        return name
    if t.is_cpu:
        return "cpu"
    return str(t.device)


def _facts(t: torch.Tensor) -> tuple[int, int, int, int, int, int, Any] | None:
    """``dlpack_facts`` of ``t``, or None where torch cannot export it (no ``_to_dlpack``,
    a sparse or otherwise unexportable tensor): the caller then asks the tensor."""
    if _TO_DLPACK is None:
        return None
    try:
        cap = _TO_DLPACK(t)
    except (RuntimeError, TypeError, BufferError, ValueError):
        return None
    return dlpack_facts(cap)


def host_values(t: torch.Tensor) -> Any:
    """The values of an index tensor whose storage is host memory (no sync), as a 1-D int64
    array, else None: a view of the same memory (strided where the tensor is) where numpy can
    take one, else a converted copy."""
    if not _TRUE_IS_CPU(t):
        return None
    with NO_TORCH_FUNCTION():
        try:
            values = t.numpy()
        except (RuntimeError, TypeError):  # it requires grad, or a neg or conj view
            values = t.detach().resolve_neg().resolve_conj().numpy()
    if values.dtype != _INT64 or values.ndim != 1:
        values = values.reshape(-1).astype(_INT64, copy=False)
    return values


def _runs(t: torch.Tensor, facts: tuple[int, int, int, int, int, int, Any] | None) -> Any:
    """The runs of ``t``'s values from its ``facts``; the tensor's own methods answer where
    DLPack could not export it, or its host values are not integers one stride walks."""
    if facts is not None and (facts[6] is not None or facts[0] not in _DL_HOST):
        return facts[6]
    values = host_values(t)
    return None if values is None else runs_of(values)


def host_runs(t: torch.Tensor) -> Any:
    """The runs of an index tensor's values (``()`` for an empty one), or None for device
    values a read would sync for (a GPU).

    The adapter's most frequent read (every allocation and free), so :func:`_facts` and
    :func:`_runs` are written out here: one function, and torch function dispatch is
    turned off only where the fallback needs it (the DLPack export never dispatches)."""
    if _TO_DLPACK is not None:
        try:
            cap = _TO_DLPACK(t)
        except (RuntimeError, TypeError, BufferError, ValueError):
            cap = None
        if cap is not None:
            facts = dlpack_facts(cap)
            if facts[6] is not None or facts[0] not in _DL_HOST:
                return facts[6]
    values = host_values(t)  # which turns dispatch off itself
    return None if values is None else runs_of(values)


def tensor_meta(t: torch.Tensor, pool: str, role: str) -> TensorRef:
    """The ``TensorRef`` of an index tensor without its values: where it lives, its size, type
    and address, read from the tensor (call with torch function dispatch off)."""
    numel = t.numel()
    return TensorRef(
        pool=pool,
        role=role,  # type: ignore[arg-type]
        device=device_name(t),
        numel=numel,
        dtype=_DTYPES.get(t.dtype) or str(t.dtype).removeprefix("torch."),
        ptr=t.data_ptr() if numel else 0,
    )


def tensor_ref(t: torch.Tensor, pool: str, role: str, dev: str | None = None, values: bool = True) -> TensorRef:
    """The ``TensorRef`` of an index tensor (``dev``: its device name, where the caller has it
    already). Values are in it where ``values`` is set and the tensor reports the CPU and is
    not empty. The common tensor is read in C (:func:`~hicache_obs._native.value_ref`), any
    other by :func:`_tensor_ref`."""
    with NO_TORCH_FUNCTION():
        return value_ref(t, pool, role, dev, values, TensorRef, META_NAMES, _TO_DLPACK, _tensor_ref)  # type: ignore[no-any-return]


def _tensor_ref(t: torch.Tensor, pool: str, role: str, dev: str | None, values: bool) -> TensorRef:
    """:func:`tensor_ref` read the tensor's own way where DLPack does not say it all (called
    with torch function dispatch off)."""
    if dev is None:
        dev = device_name(t)
    facts = _facts(t)
    if facts is None:
        numel = t.numel()
        ptr = t.data_ptr() if numel else 0
        dtype = _DTYPES.get(t.dtype) or str(t.dtype).removeprefix("torch.")
    else:
        numel, ptr = facts[2], facts[5]
        dtype = _DL_DTYPES.get((facts[3], facts[4])) or str(t.dtype).removeprefix("torch.")
    runs = _runs(t, facts) if values and dev == "cpu" and numel else None
    return TensorRef(
        pool=pool,
        role=role,  # type: ignore[arg-type]
        device=dev,
        numel=numel,
        dtype=dtype,
        ptr=ptr,
        indices=runs or None,
    )
