"""The checks a controller runs on what a caller hands it, before anything is allocated.

Each raises the project's error for bad input (naming the argument, the pool and the
value) and changes nothing: :func:`check_options` for a new controller's configuration,
:func:`check_index_tensor` for one index tensor of one pool
and tier, :func:`check_transfers` for a request's sidecar pool transfers,
:func:`check_request` for its priority and node id, :func:`check_index_pair` for the pair
handed to ``move_indices``. The controller calls them under its
lock; they read the pools only through the callables they are given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import (
    ConfigError,
    InvalidIndicesError,
    PageSizeError,
    SlotNotAllocatedError,
    UnknownBackendError,
    UnknownLayoutError,
    UnknownPoolError,
    UnresolvedTransferError,
)
from ..events._schema import D2H
from ._operations import PoolTransfer
from ._pools import LAYOUTS, SlotAllocator
from ._runtime import Runtime
from ._spec import ANCHOR, ModelSpec
from ._tensors import subclass_problem, tensor_problem
from ._transfer import IO_BACKENDS

__all__ = ["check_index_pair", "check_index_tensor", "check_options", "check_request", "check_transfers"]


def check_options(
    spec: ModelSpec,
    *,
    io_backend: str,
    layout: str,
    device_size: int,
    host_ratio: float,
    host_bytes: int | None,
    plain: bool,
) -> None:
    """A controller's io backend, host layout and sizes; ``plain``: the controller is a
    :class:`~hicache_obs.core._controller.HiCacheController`, which refuses a hybrid model."""
    if io_backend not in IO_BACKENDS:
        raise UnknownBackendError(f"unknown io backend {io_backend!r}; expected one of {', '.join(IO_BACKENDS)}")
    if layout not in LAYOUTS:
        raise UnknownLayoutError(f"unknown host layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if io_backend == "kernel" and layout == "page_first_direct":
        raise UnknownLayoutError("host layout 'page_first_direct' needs io backend 'direct', got 'kernel'")
    if plain and spec.is_hybrid:
        raise ConfigError(f"model {spec.name!r} is hybrid (pools {', '.join(spec.pool_names)}); use HybridCacheController")
    if device_size <= 0 or device_size % spec.page_size:
        raise ConfigError(f"device_size must be a positive multiple of page size {spec.page_size}, got {device_size}")
    if host_bytes is None and host_ratio <= 0:
        raise ConfigError(f"host_ratio must be > 0, got {host_ratio}")
    if host_bytes is not None and host_bytes <= 0:
        raise ConfigError(f"host_bytes must be > 0, got {host_bytes}")


def check_index_tensor(
    t: object,
    *,
    arg: str,
    pool: str,
    tier: str,
    runtime: Runtime,
    allocator: Callable[[str, str], SlotAllocator],
    allow_empty: bool = False,
    must_be_allocated: bool = True,
) -> list[int] | None:
    """Check ``t`` as the ``arg`` of ``pool``'s ``tier`` (``allocator(pool, tier)`` is its
    slot allocator): a 1-D int64 tensor of whole pages, on the tier's device, with slots in
    range, no duplicates and (``must_be_allocated``) all allocated. Returns its values when
    they can be read without a sync, else None."""
    if not isinstance(t, torch.Tensor):
        raise InvalidIndicesError(f"{arg} for pool {pool!r} must be a torch.Tensor, got {type(t).__name__}")
    problem = subclass_problem(t, runtime)
    if problem is not None:
        raise InvalidIndicesError(f"{arg} for pool {pool!r} {problem}")
    if t.dtype != torch.int64:
        raise InvalidIndicesError(f"{arg} for pool {pool!r} must be int64, got {t.dtype}")
    if t.dim() != 1:
        raise InvalidIndicesError(f"{arg} for pool {pool!r} must be 1-D, got shape {tuple(t.shape)}")
    problem = tensor_problem(t, runtime)
    if problem is not None:
        raise InvalidIndicesError(f"{arg} for pool {pool!r} {problem}")
    rt = runtime
    on_dev = rt.is_device(t)
    if tier == "host" and on_dev:
        raise InvalidIndicesError(f"{arg} for pool {pool!r} must be a cpu tensor, got one on {rt.tensor_device(t)}")
    if tier == "device" and rt.has_device and not on_dev:
        raise InvalidIndicesError(
            f"{arg} for pool {pool!r} must be on device {rt.device}, got one on {rt.tensor_device(t)}"
        )
    n = t.numel()
    if n == 0 and not allow_empty:
        raise InvalidIndicesError(f"{arg} for pool {pool!r} is empty")
    alloc = allocator(pool, tier)
    if n % alloc.page_size:
        raise PageSizeError(
            f"{arg} for pool {pool!r} ({tier}) has {n} entries, not a multiple of page size {alloc.page_size}"
        )
    if not rt.values_readable(t):
        return None
    values: list[int] = rt.to_host(t).tolist()
    cap = alloc.capacity
    out = [v for v in values if not 0 <= v < cap]
    if out:
        raise SlotNotAllocatedError(f"{arg} for pool {pool!r} ({tier}): slots {out[:8]} out of range 0..{cap - 1}")
    if len(set(values)) != n:
        seen: set[int] = set()
        dup = [v for v in values if v in seen or seen.add(v)]  # type: ignore[func-returns-value]
        raise InvalidIndicesError(f"{arg} for pool {pool!r} has duplicate slots {sorted(set(dup))[:8]}")
    if must_be_allocated:
        alloc.check_allocated(values, arg)
    return values


def check_transfers(
    pool_transfers: Sequence[PoolTransfer] | None,
    direction: str,
    spec: ModelSpec,
    pool_of: Callable[[str, str], Any],
) -> tuple[PoolTransfer, ...] | None:
    """Check a request's sidecar pool transfers (``pool_of(pool, tier)`` is a pool, for the
    sizes of pools that share indices); the transfers as a tuple, or None for none."""
    if pool_transfers is None:
        return None
    if not isinstance(pool_transfers, (list, tuple)):
        raise InvalidIndicesError(
            f"pool_transfers must be a list or tuple of PoolTransfer or None, got {type(pool_transfers).__name__}"
        )
    out = []
    for t in pool_transfers:
        if not isinstance(t, PoolTransfer):
            raise InvalidIndicesError(f"pool_transfers entries must be PoolTransfer, got {type(t).__name__}")
        if t.pool not in spec.pool_names or t.pool == ANCHOR:
            raise UnknownPoolError(
                f"pool transfer names pool {t.pool!r}; sidecar pools of model {spec.name!r}: "
                f"{', '.join(p for p in spec.pool_names if p != ANCHOR) or 'none'}"
            )
        if t.indices_from_pool is not None:
            if t.indices_from_pool not in spec.pool_names or t.indices_from_pool == t.pool:
                raise UnknownPoolError(
                    f"pool transfer {t.pool!r}: indices_from_pool {t.indices_from_pool!r} is not another pool"
                )
            owners = {ANCHOR} | {
                o.pool for o in pool_transfers if isinstance(o, PoolTransfer) and o.indices_from_pool is None
            }
            if t.indices_from_pool not in owners:
                raise UnresolvedTransferError(
                    f"pool transfer {t.pool!r} reuses pool {t.indices_from_pool!r}, which this request "
                    "does not move; reuse 'kv' or a pool with its own transfer here"
                )
            if t.host_indices is not None or t.device_indices is not None:
                raise InvalidIndicesError(
                    f"pool transfer {t.pool!r} reuses pool {t.indices_from_pool!r}'s indices and must not carry its own"
                )
            for tier in ("device", "host"):
                src_pool, dst_pool = pool_of(t.indices_from_pool, tier), pool_of(t.pool, tier)
                if src_pool.page_size != dst_pool.page_size or src_pool.size != dst_pool.size:
                    raise PageSizeError(
                        f"pool transfer {t.pool!r} cannot reuse the indices of pool {t.indices_from_pool!r}: "
                        f"their {tier} pools differ (page size {dst_pool.page_size} vs {src_pool.page_size}, "
                        f"{dst_pool.size} vs {src_pool.size} slots)"
                    )
            out.append(t)
            continue
        src = t.device_indices if direction == D2H else t.host_indices
        if src is None:
            side = "device_indices" if direction == D2H else "host_indices"
            raise UnresolvedTransferError(
                f"pool transfer {t.pool!r}: {side} is None; a {'write' if direction == D2H else 'load'} "
                f"needs the {side} resolved before it is queued"
            )
        out.append(t)
    if len({(t.pool, t.indices_from_pool) for t in out}) != len(out):
        raise InvalidIndicesError("pool_transfers names the same pool twice")
    return tuple(out)


def check_request(priority: object, node_id: object) -> None:
    """A request's ``node_id`` is an int and its ``priority`` an int or None."""
    if isinstance(node_id, bool) or not isinstance(node_id, int):
        raise InvalidIndicesError(f"node_id must be an int, got {type(node_id).__name__} {node_id!r}")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise InvalidIndicesError(f"priority must be an int or None, got {type(priority).__name__} {priority!r}")


def check_index_pair(
    host_indices: torch.Tensor, device_indices: torch.Tensor, *, pool: str, runtime: Runtime
) -> None:
    """An index pair handed to ``move_indices``: two 1-D int64 tensors the runtime can read,
    the device side on the runtime's device (lengths are the normaliser's check)."""
    for arg, t in (("host_indices", host_indices), ("device_indices", device_indices)):
        if not isinstance(t, torch.Tensor):
            raise InvalidIndicesError(f"{arg} for pool {pool!r} must be a torch.Tensor, got {type(t).__name__}")
        problem = subclass_problem(t, runtime)
        if problem is None and (t.dtype != torch.int64 or t.dim() != 1):
            problem = f"must be a 1-D int64 tensor, got {t.dtype} of shape {tuple(t.shape)}"
        if problem is None:
            problem = tensor_problem(t, runtime)
        if problem is not None:
            raise InvalidIndicesError(f"{arg} for pool {pool!r} {problem}")
    if runtime.has_device and not runtime.is_device(device_indices):
        raise InvalidIndicesError(
            f"device_indices for pool {pool!r} must be on device {runtime.device}, "
            f"got one on {runtime.tensor_device(device_indices)}"
        )
