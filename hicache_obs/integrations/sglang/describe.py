"""What an index tensor SGLang handed over is: device, size, values, as a ``TensorRef``.

Every read here runs with torch function dispatch off (``NO_TORCH_FUNCTION``): these are
facts about the tensor, and a process-wide torch function mode (a tracer, a debugging
mode, the CPU harness's CUDA stand-in) would otherwise run in Python for each of them.
Values are read only where the storage is host memory: a device tensor's values would
cost a sync, so they are never read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..._native import runs_of
from ...core.torch_compat import no_torch_function, true_is_cpu
from ...events.schema import TensorRef

__all__ = ["NO_TORCH_FUNCTION", "device_name", "host_runs", "host_values", "tensor_ref"]

NO_TORCH_FUNCTION = no_torch_function
_TRUE_IS_CPU = true_is_cpu  # the storage's device, whatever a subclass reports
_DTYPES = {torch.int64: "int64", torch.int32: "int32"}
_INT64 = np.dtype(np.int64)


def device_name(t: torch.Tensor) -> str:
    """``cuda:N``, ``cpu`` or torch's name of the tensor's device, as the tensor reports it."""
    if t.is_cuda:
        dev = t.device
        return f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cuda:0"
    if t.is_cpu:
        return "cpu"
    return str(t.device)


def host_values(t: torch.Tensor) -> Any:
    """The values of an index tensor whose storage is host memory (no sync), as a 1-D int64
    array, else None. The usual index tensor takes two torch calls (its storage's device,
    one ``numpy()``: a view of the same memory, strided where the tensor is). Each runs
    between SGLang's copies, with cold caches, and costs several times what it does in a loop."""
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


def host_runs(t: torch.Tensor) -> Any:
    """The runs of an index tensor's values, or None for device values a read would sync for (a GPU)."""
    values = host_values(t)
    return None if values is None else runs_of(values)


def tensor_ref(t: torch.Tensor, pool: str, role: str, dev: str | None = None) -> TensorRef:
    """The ``TensorRef`` of an index tensor (``dev``: its device name, where the caller has it already)."""
    with NO_TORCH_FUNCTION():
        numel = t.numel()
        dtype = t.dtype
        ptr = t.data_ptr() if numel else 0
        if dev is None:
            dev = device_name(t)
        runs = host_runs(t) if dev == "cpu" and numel else None
    return TensorRef(
        pool=pool,
        role=role,  # type: ignore[arg-type]
        device=dev,
        numel=numel,
        dtype=_DTYPES.get(dtype) or str(dtype).removeprefix("torch."),
        ptr=ptr,
        indices=runs or None,
    )
