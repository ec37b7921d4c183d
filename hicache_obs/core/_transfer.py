"""The copy kernels of the io backends, launched through a runtime.

Each launch may take a :class:`CopyFault`: its copies then never raise, wherever they
run; the first failure is stored for the op's ack.

``kernel``: both index tensors on the device, int64, equal length; gathers and
scatters by index (a device kernel on cuda). ``direct``: index values on the CPU;
consecutive slot pairs are grouped into runs and copied as whole slices, so a
page of the ``page_first`` layout moves as one contiguous block.
"""

from __future__ import annotations

import math
from array import array
from itertools import chain
from typing import Any

import torch

from .._native import pair_runs_of
from ..errors import IndexNotOnDeviceError, InvalidIndicesError, LengthMismatchError
from ._pools import DevicePool, HostPool
from ._runtime import Runtime

__all__ = [
    "IO_BACKENDS",
    "CopyFault",
    "check_kernel_indices",
    "pair_runs",
    "tensor_pair_runs",
    "host_pair_runs",
    "runs_for_copy",
    "plan_runs",
    "launch_backup",
    "launch_load_layer",
    "launch_load_all",
]

IO_BACKENDS = ("kernel", "direct")

Runs3 = tuple[tuple[int, int, int], ...]


def check_kernel_indices(runtime: Runtime, pool: str, host: torch.Tensor, device: torch.Tensor) -> None:
    """The checks the device copy kernels make before they launch (SGLang #24121)."""
    for role, t in (("host", host), ("device", device)):
        if runtime.has_device and not runtime.is_device(t):
            raise IndexNotOnDeviceError(
                f"Destination indices must be a device tensor: pool {pool!r} {role} indices are on "
                f"{runtime.tensor_device(t)}, io backend 'kernel' needs {runtime.device}"
            )
        if t.dtype != torch.int64:
            raise InvalidIndicesError(f"pool {pool!r} {role} indices must be int64 for the kernel, got {t.dtype}")
    if host.numel() != device.numel():
        raise LengthMismatchError(
            f"pool {pool!r}: host indices have {host.numel()} entries, device indices {device.numel()}"
        )


def pair_runs(host: Any, device: Any) -> Runs3:
    """Group index pairs into runs ``(host_start, device_start, length)`` consecutive on both
    sides (as ``zip``, up to the shorter side). Lists of ints or 1-D integer buffers;
    compiled: ``hicache_obs._slots.pair_runs_of``."""
    return pair_runs_of(host, device)  # type: ignore[return-value]


def tensor_pair_runs(host: torch.Tensor, device: torch.Tensor) -> Runs3:
    """:func:`pair_runs` of two CPU index tensors, read in place through numpy views."""
    return pair_runs_of(host.numpy(), device.numpy())  # type: ignore[return-value]  # int64: no grad


def host_pair_runs(runtime: Runtime, host: torch.Tensor, device: torch.Tensor) -> Runs3 | None:
    """:func:`tensor_pair_runs` of a pair of index tensors whose values are on the CPU, or
    ``None`` when either is one of ``runtime``'s device tensors (the host never reads those)."""
    if runtime.is_device(host) or runtime.is_device(device):
        return None
    return tensor_pair_runs(host, device)


def runs_for_copy(io_backend: str, native: bool, host: torch.Tensor, runs: Runs3 | None) -> Runs3 | None:
    """The runs a copy takes (``runs``: the pair's :func:`host_pair_runs`), or ``None`` for the
    index kernels. ``direct`` and the native loop (``native``: the runtime has ``native_copies``)
    take runs of any length; ``kernel`` on torch's copies takes them only when they are few (at
    most a quarter of the slots): fragmented runs are slower as slices than as one index kernel."""
    if runs is None:
        return None
    if io_backend == "direct" or native or len(runs) * 4 <= host.numel():
        return runs
    return None


def plan_runs(io_backend: str, host: torch.Tensor, device: torch.Tensor, runtime: Runtime) -> Runs3 | None:
    """The runs the controller's copy of this index pair takes on ``runtime`` with ``io_backend``:
    :func:`runs_for_copy` of its :func:`host_pair_runs`. The controller makes the two steps apart,
    since its events describe the pair by the runs of the first."""
    native = getattr(runtime, "native_copies", None) is not None
    return runs_for_copy(io_backend, native, host, host_pair_runs(runtime, host, device))


class CopyFault:
    """The first exception one op's copies raised, wherever they ran.

    The launch functions wrap each copy in a guard that stores its exception here instead
    of raising it: on a runtime that defers work (``sim``, a side stream) the copy runs
    inside whatever later call drains the stream, and its failure belongs to the op, not
    to that call. Once a copy failed, the op's remaining copies are skipped.
    """

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    def guard(self, fn: Any) -> Any:
        return _Guarded(fn, self)


class _Guarded:
    """``fn`` run under a :class:`CopyFault`; ``fail`` lets a runtime report an error it hit
    while preparing the call (the ``sim`` runtime rebuilding captured tensors)."""

    __slots__ = ("fn", "fault")

    def __init__(self, fn: Any, fault: CopyFault) -> None:
        self.fn = fn
        self.fault = fault

    def __call__(self, *args: Any) -> None:
        if self.fault.error is not None:
            return  # an earlier copy of this op failed: its data is not trusted anyway
        try:
            self.fn(*args)
        except Exception as exc:
            self.fault.fail(exc)

    def fail(self, exc: BaseException) -> None:
        self.fault.fail(exc)


# ------------------------------------------------------------------ kernels
# torch's index ops want self, index and source on one device; on cuda the host
# planes are (pinned) CPU memory, so gather/scatter on each side's own device and
# let `.to` move the data between them. Under sim and cpu every `.to` is a no-op.
# Gathers and scatters go layer by layer: torch's index ops on a non-leading dimension
# of a 4-D tensor take a generic path that is several times slower.
def _d2h_index_lf(host: torch.Tensor, dev: torch.Tensor, hidx: torch.Tensor, didx: torch.Tensor) -> None:
    h = hidx.to(host.device)
    for layer in range(dev.shape[0]):
        host[layer].index_copy_(0, h, dev[layer].index_select(0, didx).to(host.device))


def _d2h_index_pf(host: torch.Tensor, dev: torch.Tensor, hidx: torch.Tensor, didx: torch.Tensor) -> None:
    h = hidx.to(host.device)
    for layer in range(dev.shape[0]):
        host.select(1, layer).index_copy_(0, h, dev[layer].index_select(0, didx).to(host.device))


def _h2d_index_lf(host: torch.Tensor, dev: torch.Tensor, hidx: torch.Tensor, didx: torch.Tensor, layer: int) -> None:
    dev[layer].index_copy_(0, didx, host[layer].index_select(0, hidx.to(host.device)).to(dev.device))


def _h2d_index_pf(host: torch.Tensor, dev: torch.Tensor, hidx: torch.Tensor, didx: torch.Tensor, layer: int) -> None:
    dev[layer].index_copy_(0, didx, host.select(1, layer).index_select(0, hidx.to(host.device)).to(dev.device))


def _d2h_runs_lf(host: torch.Tensor, dev: torch.Tensor, runs: Runs3) -> None:
    for h, d, n in runs:
        host.narrow(1, h, n).copy_(dev.narrow(1, d, n))


def _d2h_runs_pf(host: torch.Tensor, dev: torch.Tensor, runs: Runs3) -> None:
    for h, d, n in runs:
        host.narrow(0, h, n).copy_(dev.narrow(1, d, n).transpose(0, 1))


def _h2d_runs_lf(host: torch.Tensor, dev: torch.Tensor, runs: Runs3, layer: int) -> None:
    for h, d, n in runs:
        dev[layer].narrow(0, d, n).copy_(host[layer].narrow(0, h, n))


def _h2d_runs_pf(host: torch.Tensor, dev: torch.Tensor, runs: Runs3, layer: int) -> None:
    for h, d, n in runs:
        dev[layer].narrow(0, d, n).copy_(host.narrow(0, h, n).select(1, layer))


def _h2d_runs_all_lf(host: torch.Tensor, dev: torch.Tensor, runs: Runs3) -> None:
    for h, d, n in runs:
        dev.narrow(1, d, n).copy_(host.narrow(1, h, n))


def _h2d_runs_all_pf(host: torch.Tensor, dev: torch.Tensor, runs: Runs3) -> None:
    for h, d, n in runs:
        dev.narrow(1, d, n).copy_(host.narrow(0, h, n).transpose(0, 1))


def _h2d_index_all_lf(host: torch.Tensor, dev: torch.Tensor, hidx: torch.Tensor, didx: torch.Tensor) -> None:
    for layer in range(dev.shape[0]):
        _h2d_index_lf(host, dev, hidx, didx, layer)


def _h2d_index_all_pf(host: torch.Tensor, dev: torch.Tensor, hidx: torch.Tensor, didx: torch.Tensor) -> None:
    for layer in range(dev.shape[0]):
        _h2d_index_pf(host, dev, hidx, didx, layer)


# kernels by (direction, runs or index, layout), each as (layer_first, page_first)
_KERNELS: dict[tuple[str, bool], tuple[Any, Any]] = {
    ("d2h", True): (_d2h_runs_lf, _d2h_runs_pf),
    ("d2h", False): (_d2h_index_lf, _d2h_index_pf),
    ("h2d_all", True): (_h2d_runs_all_lf, _h2d_runs_all_pf),
    ("h2d_all", False): (_h2d_index_all_lf, _h2d_index_all_pf),
    ("h2d_layer", True): (_h2d_runs_lf, _h2d_runs_pf),
    ("h2d_layer", False): (_h2d_index_lf, _h2d_index_pf),
}


# ------------------------------------------------------------ native loop
def _geometry(plane: torch.Tensor, page_first: bool) -> tuple[int, int, int, int, int]:
    """(layers, slots, bytes of one slot of one layer, slot stride, layer stride) of a plane."""
    if not plane.is_contiguous():
        raise ValueError(f"the native copy loop needs contiguous planes, got strides {plane.stride()}")
    es = plane.element_size()
    slot_dim, layer_dim = (0, 1) if page_first else (1, 0)
    chunk = es * math.prod(plane.shape[2:])
    return (
        plane.shape[layer_dim],
        plane.shape[slot_dim],
        chunk,
        plane.stride(slot_dim) * es,
        plane.stride(layer_dim) * es,
    )


def _native_launch(
    kind: str,
    runtime: Runtime,
    host_pool: HostPool,
    device_pool: DevicePool,
    runs: Runs3,
    fault: CopyFault | None,
    *layer: int,
) -> None:
    """Every plane of a pool through the native loop: host <- device for ``d2h``, else device <- host."""
    copy_runs = runtime.native_copies.copy_runs  # type: ignore[attr-defined]
    if fault is not None:
        copy_runs = fault.guard(copy_runs)
    packed = array("q", chain.from_iterable(runs))  # (host, device, length) triples
    to_host = kind == "d2h"
    pf = host_pool.layout == "page_first"
    for name, hplane in host_pool.planes.items():
        dplane = device_pool.planes[name]
        hl, hs, hc, hss, hls = _geometry(hplane, pf)
        dl, ds, dc, dss, dls = _geometry(dplane, False)
        if (hl, hc) != (dl, dc):
            raise ValueError(f"plane {name!r}: host has {hl} layers of {hc} B, device {dl} of {dc} B")
        hptr, dptr, layers = hplane.data_ptr(), dplane.data_ptr(), hl
        if layer:  # one (pool-local) layer
            hptr, dptr, layers = hptr + layer[0] * hls, dptr + layer[0] * dls, 1
        if to_host:
            runtime.launch(copy_runs, hptr, dptr, packed, False, layers, hc, hs, hss, hls, ds, dss, dls)
        else:
            runtime.launch(copy_runs, dptr, hptr, packed, True, layers, hc, ds, dss, dls, hs, hss, hls)


def _launch(
    kind: str,
    runtime: Runtime,
    host_pool: HostPool,
    device_pool: DevicePool,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    runs: Runs3 | None,
    fault: CopyFault | None,
    *layer: int,
) -> None:
    if runs is not None and getattr(runtime, "native_copies", None) is not None:
        _native_launch(kind, runtime, host_pool, device_pool, runs, fault, *layer)
        return
    lf, pf = _KERNELS[(kind, runs is not None)]
    fn = lf if host_pool.layout == "layer_first" else pf
    if fault is not None:
        fn = fault.guard(fn)
    for name, hplane in host_pool.planes.items():
        dplane = device_pool.planes[name]
        if runs is not None:
            runtime.launch(fn, hplane, dplane, runs, *layer)
        else:
            runtime.launch(fn, hplane, dplane, host_idx, dev_idx, *layer)


def launch_backup(
    runtime: Runtime,
    host_pool: HostPool,
    device_pool: DevicePool,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    runs: Runs3 | None,
    fault: CopyFault | None = None,
) -> None:
    """Device -> host, all layers of every plane, on the current stream."""
    _launch("d2h", runtime, host_pool, device_pool, host_idx, dev_idx, runs, fault)


def launch_load_all(
    runtime: Runtime,
    host_pool: HostPool,
    device_pool: DevicePool,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    runs: Runs3 | None,
    fault: CopyFault | None = None,
) -> None:
    """Host -> device, every layer at once: for runtimes where nothing overlaps the copy."""
    _launch("h2d_all", runtime, host_pool, device_pool, host_idx, dev_idx, runs, fault)


def launch_load_layer(
    runtime: Runtime,
    host_pool: HostPool,
    device_pool: DevicePool,
    layer: int,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    runs: Runs3 | None,
    fault: CopyFault | None = None,
) -> None:
    """Host -> device, one (pool-local) layer of every plane, on the current stream."""
    _launch("h2d_layer", runtime, host_pool, device_pool, host_idx, dev_idx, runs, fault, layer)
