"""Pools: device and host tensors per pool name, and their slot allocators.

A pool stores, per plane (``k``/``v`` for KV and SWA, ``conv``/``ssm`` for
Mamba), one tensor over the pool's own layers. Device planes are
``(layers, slots, *item)``. Host planes follow the layout: ``layer_first``
``(layers, slots, *item)`` or ``page_first`` ``(slots, layers, *item)``, which
keeps one slot (and so one page) contiguous across layers.

Allocators hand out whole pages from a FIFO free list and return None when
short. Their state is the event-folded :class:`~hicache_obs.events._state.SlotTable`:
an allocation is decided from that table and takes effect when its
``SlotsAllocated`` event is applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import (
    ConfigError,
    DoubleFreeError,
    InvalidIndicesError,
    PageSizeError,
    SlotNotAllocatedError,
    UnknownPoolError,
)
from ..events._schema import AllocationFailed, PoolCreated, SlotsAllocated, SlotsFreed, runs_from_list
from ..events._state import SlotTable
from ._runtime import Runtime
from ._spec import ModelSpec

__all__ = [
    "LAYOUTS",
    "SlotAllocator",
    "DevicePool",
    "HostPool",
    "device_sizes",
    "host_size",
    "make_pools",
    "indices_list",
]

LAYOUTS = ("layer_first", "page_first", "page_first_direct")

Emit = Callable[..., Any]


def indices_list(runtime: Runtime, t: torch.Tensor) -> list[int]:
    """Index values as a Python list (reads device memory: not for the hot path on cuda)."""
    return runtime.to_host(t).tolist()  # type: ignore[no-any-return]


def device_sizes(spec: ModelSpec, device_size: int, pool_sizes: dict[str, int]) -> dict[str, int]:
    """The device slots of each of ``spec``'s pools: ``device_size`` for KV and SWA, one slot
    per page (at least 8) for Mamba, unless ``pool_sizes`` names the pool."""
    unknown = set(pool_sizes) - set(spec.pool_names)
    if unknown:
        raise UnknownPoolError(
            f"pool_sizes names pools {sorted(unknown)} that model {spec.name!r} lacks; pools: {spec.pool_names}"
        )
    sizes = {"kv": device_size}
    if "mamba" in spec.pool_names:
        sizes["mamba"] = max(8, device_size // spec.page_size)
    if "swa" in spec.pool_names:
        sizes["swa"] = device_size
    sizes.update(pool_sizes)
    for name, n in sizes.items():
        ps = 1 if name == "mamba" else spec.page_size
        if n <= 0 or n % ps:
            raise ConfigError(f"device size of pool {name!r} must be a positive multiple of {ps}, got {n}")
    return sizes


def make_pools(
    spec: ModelSpec,
    sizes: dict[str, int],
    *,
    host_ratio: float,
    host_bytes: int | None,
    layout: str,
    runtime: Runtime,
    emit: Emit,
    table: Callable[[str, str], SlotTable],
) -> tuple[dict[str, DevicePool], dict[str, HostPool]]:
    """The device and host pool of each of ``spec``'s pools, ``sizes`` device slots each
    (:func:`device_sizes`) and a host of ``host_ratio`` times that, or ``host_bytes`` in all;
    each pool's ``PoolCreated`` (device, then host) is ``emit``-ted before its allocator,
    whose state is ``table(pool, tier)``, is made."""
    ratio = host_ratio
    if host_bytes is not None:
        total = sum(sizes[p] * spec.slot_bytes(p) for p in spec.pool_names)
        ratio = host_bytes / total
    device_pools: dict[str, DevicePool] = {}
    host_pools: dict[str, HostPool] = {}
    for name in spec.pool_names:
        ps = 1 if name == "mamba" else spec.page_size
        dev = DevicePool(name, spec, sizes[name], ps, runtime)
        host_layout = "page_first" if layout == "page_first_direct" else layout
        hsize = host_size(sizes[name], 1 if name == "mamba" else spec.page_size, ratio=ratio)
        host = HostPool(name, spec, hsize, ps, host_layout, runtime)
        for pool, tier, cap, sb, lay in (
            (dev, "device", dev.size, dev.slot_bytes, "layer_first"),
            (host, "host", host.size, host.slot_bytes, layout),
        ):
            emit(PoolCreated, pool=name, tier=tier, capacity=cap, page_size=ps, slot_bytes=sb, layout=lay)
            pool.allocator = SlotAllocator(name, tier, table(name, tier), emit, runtime)
        device_pools[name] = dev
        host_pools[name] = host
    return device_pools, host_pools


def host_size(device_slots: int, page_size: int, *, ratio: float) -> int:
    """Host slots for ``ratio * device`` rounded down to whole pages plus one spare page."""
    n = int(device_slots * ratio)
    return (n // page_size) * page_size + page_size


class SlotAllocator:
    """Page-granular allocator of one pool on one tier, driven by events."""

    def __init__(self, pool: str, tier: str, table: SlotTable, emit: Emit, runtime: Runtime) -> None:
        self.pool = pool
        self.tier = tier
        self.table = table
        self._emit = emit
        self._runtime = runtime

    @property
    def page_size(self) -> int:
        return self.table.page_size

    @property
    def capacity(self) -> int:
        return self.table.capacity

    def available(self) -> int:
        return self.table.available

    def alloc(self, n: int, *, op: int = -1) -> torch.Tensor | None:
        """Allocate ``n`` slots (a multiple of the page size) as a CPU int64 tensor, or None."""
        ps = self.table.page_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidIndicesError(f"pool {self.pool!r} ({self.tier}): alloc size must be an int >= 0, got {n!r}")
        if n % ps:
            raise PageSizeError(
                f"pool {self.pool!r} ({self.tier}): alloc of {n} slots is not a multiple of page size {ps}"
            )
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        if n > self.table.available:
            self._emit(AllocationFailed, pool=self.pool, tier=self.tier, requested=n, available=self.table.available)
            return None
        pages = self.table.peek(n // ps)
        page_runs = runs_from_list(pages)
        runs = page_runs if ps == 1 else tuple((p * ps, k * ps) for p, k in page_runs)
        self._emit(SlotsAllocated, pool=self.pool, tier=self.tier, indices=runs, op=op)
        if len(runs) == 1:
            return torch.arange(runs[0][0], runs[0][0] + n, dtype=torch.int64)
        if ps == 1:
            return torch.tensor(pages, dtype=torch.int64)
        base = torch.tensor(pages, dtype=torch.int64).mul_(ps).unsqueeze(1)
        return (base + torch.arange(ps, dtype=torch.int64)).reshape(-1)

    def check_allocated(self, values: list[int], arg: str) -> None:
        """Raise unless every value is an allocated slot of this pool and tier."""
        bad = self.table.unallocated(runs_from_list(values)) if values else []
        if bad:
            raise SlotNotAllocatedError(
                f"{arg} for pool {self.pool!r} ({self.tier}): slots {bad[:8]} are not allocated "
                f"(capacity {self.table.capacity})"
            )

    def free(self, values: list[int], *, reason: str = "free", op: int = -1, arg: str = "indices") -> int:
        """Free slots; raises on a double free or an out-of-range slot (state unchanged)."""
        if not values:
            return 0
        runs = runs_from_list(values)
        if len(set(values)) != len(values):
            dup = sorted({v for v in values if values.count(v) > 1})[:8]
            raise DoubleFreeError(f"{arg} for pool {self.pool!r} ({self.tier}): slots {dup} freed twice in one call")
        bad = self.table.unallocated(runs)
        if bad:
            out = [b for b in bad if not 0 <= b < self.table.capacity]
            if out:
                raise SlotNotAllocatedError(
                    f"{arg} for pool {self.pool!r} ({self.tier}): slots {out[:8]} out of range "
                    f"0..{self.table.capacity - 1}"
                )
            raise DoubleFreeError(
                f"{arg} for pool {self.pool!r} ({self.tier}): double free of slots {bad[:8]} (already free)"
            )
        self._emit(SlotsFreed, pool=self.pool, tier=self.tier, indices=runs, reason=reason, op=op)
        return len(values)


class DevicePool:
    """Device-resident planes of one pool: ``(layers, slots, *item)`` each."""

    tier = "device"

    def __init__(self, name: str, spec: ModelSpec, size: int, page_size: int, runtime: Runtime) -> None:
        self.name = name
        self.spec = spec
        self.size = size
        self.page_size = page_size
        self.runtime = runtime
        self.layer_ids = spec.layer_ids(name)
        self.layer_index = {g: i for i, g in enumerate(self.layer_ids)}
        self.plane_specs = spec.planes(name)
        n_layers = len(self.layer_ids)
        self.planes: dict[str, torch.Tensor] = {
            p.name: runtime.empty((n_layers, size, *p.item_shape), p.dtype) for p in self.plane_specs
        }
        self.slot_bytes = spec.slot_bytes(name)
        self.allocator: SlotAllocator | None = None
        self.layout = "layer_first"

    def write_slots(self, indices: torch.Tensor, data: dict[str, torch.Tensor]) -> None:
        """Write ``data[plane]`` of shape ``(layers, n, *item)`` into the slots (main stream)."""
        idx = self.runtime.to_host(indices)
        for name, plane in self.planes.items():
            src = data[name]
            self.runtime.launch(_index_put_dim1, plane, idx, src)

    def read_slots(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """A host copy of the slots' data per plane, ``(layers, n, *item)``."""
        idx = self.runtime.to_host(indices)
        return {
            name: self.runtime.to_host(plane).index_select(1, idx) if not self.runtime.is_device(plane)
            else _host_gather(self.runtime, plane, idx)
            for name, plane in self.planes.items()
        }


def _index_put_dim1(plane: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    # idx and src are host tensors; on cuda the plane is not
    plane.index_copy_(1, idx.to(plane.device), src.to(device=plane.device, dtype=plane.dtype))


def _host_gather(runtime: Runtime, plane: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    out: list[torch.Tensor] = []

    def gather(p: torch.Tensor, i: torch.Tensor) -> None:
        out.append(p.index_select(1, i.to(p.device)).to("cpu", copy=True))

    runtime.launch(gather, plane, idx)  # on the main stream: runs now
    return out[0]


class HostPool:
    """Host planes of one pool in the chosen layout; pinned on cuda."""

    tier = "host"

    def __init__(self, name: str, spec: ModelSpec, size: int, page_size: int, layout: str, runtime: Runtime) -> None:
        self.name = name
        self.spec = spec
        self.size = size
        self.page_size = page_size
        self.layout = layout
        self.layer_ids = spec.layer_ids(name)
        self.layer_index = {g: i for i, g in enumerate(self.layer_ids)}
        self.plane_specs = spec.planes(name)
        n_layers = len(self.layer_ids)
        self.planes: dict[str, torch.Tensor] = {}
        for p in self.plane_specs:
            shape = (n_layers, size, *p.item_shape) if layout == "layer_first" else (size, n_layers, *p.item_shape)
            self.planes[p.name] = runtime.pin(torch.zeros(shape, dtype=p.dtype))
        self.slot_bytes = spec.slot_bytes(name)
        self.allocator: SlotAllocator | None = None

    def read_slots(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """The slots' data per plane as ``(layers, n, *item)``, whatever the layout."""
        idx = indices.to(torch.int64)
        out = {}
        for name, plane in self.planes.items():
            if self.layout == "layer_first":
                out[name] = plane.index_select(1, idx).clone()
            else:
                out[name] = plane.index_select(0, idx).transpose(0, 1).contiguous()
        return out
