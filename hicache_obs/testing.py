"""Fakes and helpers that users and tests share.

- :func:`capture_events`: a context that collects the events a log emits
- :class:`InMemorySink`: a sink that keeps every event (for ``log.add_sink``)
- :func:`make_controller`: a controller on the ``sim`` runtime, optionally with a
  known bug injected (:data:`FAULTS`), to see what the auditor and the exporters
  make of it:

  ``unrecorded-pool-indices``  the pre-#22940 hybrid recording: only the anchor's
                               (KV) index tensors are ``record_stream``-ed
  ``unmoved-pool-indices``     the pre-#22940 hybrid move: only the anchor's indices
                               are moved (Mamba/SWA host indices stay on the CPU)
  ``host-indices-not-moved``   the kernel backend is handed CPU host indices
  ``double-free``              evictions free slots without checking they are allocated
  ``use-after-free``           loads accept host slots that were already evicted
  ``length-mismatch``          one pool's device indices lose their last entry when moved
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_obs.core._controller import ANCHOR, HiCacheController, HybridCacheController
from hicache_obs.core._operations import CacheOperation
from hicache_obs.core._spec import ModelSpec
from hicache_obs.errors import ConfigError
from hicache_obs.events._log import EventLog
from hicache_obs.events._schema import Event, SlotsFreed, runs_from_list
from hicache_obs.events._sinks import ListSink

__all__ = [
    "FAULTS",
    "Captured",
    "capture_events",
    "InMemorySink",
    "make_controller",
    "fault_class",
]

InMemorySink = ListSink


@dataclass
class Captured:
    """What :func:`capture_events` collected."""

    log: EventLog
    events: list[Event] = field(default_factory=list)

    def of_type(self, *types: type[Event]) -> list[Event]:
        return [e for e in self.events if isinstance(e, types)]

    def types(self) -> list[str]:
        return [type(e).__name__ for e in self.events]


@contextlib.contextmanager
def capture_events(log: EventLog | None = None) -> Iterator[Captured]:
    """Collect every event ``log`` (a new one if None) emits inside the block.

    >>> with capture_events() as cap:
    ...     c = make_controller(log=cap.log)
    """
    log = log if log is not None else EventLog()
    cap = Captured(log)
    unsubscribe = log.subscribe(cap.events.append)
    try:
        yield cap
    finally:
        unsubscribe()


# ------------------------------------------------------------------- faults
class _UnrecordedPoolIndices(HybridCacheController):
    """Pre-#22940: records only the anchor's index tensors on the transfer stream."""

    def _record_transfer_indices_on_stream(self, stream, host_indices, device_indices, pool_transfers, *, op=-1):  # type: ignore[no-untyped-def,override]
        self._record_pair(stream, ANCHOR, host_indices, device_indices, op)


class _UnmovedPoolIndices(_UnrecordedPoolIndices):
    """Pre-#22940: moves (and records) only the anchor's indices."""

    def move_hybrid_indices(self, op: CacheOperation) -> CacheOperation:
        host, device = self.move_indices(op.host_indices, op.device_indices, op=op.id)
        transfers = op.pool_transfers
        if transfers is not None:
            transfers = tuple(
                t.with_indices(host, device) if t.indices_from_pool is not None else t for t in transfers
            )
        return op.replace(host_indices=host, device_indices=device, pool_transfers=transfers)


class _HostIndicesNotMovedMixin:
    def move_indices(self, host_indices, device_indices, *, op=-1, pool=ANCHOR):  # type: ignore[no-untyped-def]
        return host_indices, device_indices


class _HostIndicesNotMoved(_HostIndicesNotMovedMixin, HybridCacheController):
    pass


class _HostIndicesNotMovedPlain(_HostIndicesNotMovedMixin, HiCacheController):
    pass


class _DoubleFreeMixin:
    def evict_host(self, host_indices: torch.Tensor, pool: str = ANCHOR) -> int:  # type: ignore[override]
        values = host_indices.tolist()
        self._emit(SlotsFreed, pool=pool, tier="host", indices=runs_from_list(values), reason="evict")  # type: ignore[attr-defined]
        return len(values)


class _DoubleFree(_DoubleFreeMixin, HybridCacheController):
    pass


class _DoubleFreePlain(_DoubleFreeMixin, HiCacheController):
    pass


class _UseAfterFreeMixin:
    def _validate(self, t, *, arg, pool, tier, allow_empty=False, must_be_allocated=True):  # type: ignore[no-untyped-def]
        return super()._validate(  # type: ignore[misc]
            t, arg=arg, pool=pool, tier=tier, allow_empty=allow_empty, must_be_allocated=(tier != "host")
        )


class _UseAfterFree(_UseAfterFreeMixin, HybridCacheController):
    pass


class _UseAfterFreePlain(_UseAfterFreeMixin, HiCacheController):
    pass


class _LengthMismatchMixin:
    def move_indices(self, host_indices, device_indices, *, op=-1, pool=ANCHOR):  # type: ignore[no-untyped-def]
        if host_indices.numel() != device_indices.numel():
            return host_indices, device_indices
        host, device = super().move_indices(host_indices, device_indices, op=op, pool=pool)  # type: ignore[misc]
        if pool == ANCHOR and device.numel() > 1:
            device = device[:-1]
        return host, device


class _LengthMismatch(_LengthMismatchMixin, HybridCacheController):
    pass


class _LengthMismatchPlain(_LengthMismatchMixin, HiCacheController):
    pass


FAULTS: dict[str, tuple[type[HiCacheController], type[HiCacheController] | None]] = {
    # name: (class for hybrid models, class for plain models or None if hybrid-only)
    "unrecorded-pool-indices": (_UnrecordedPoolIndices, None),
    "unmoved-pool-indices": (_UnmovedPoolIndices, None),
    "host-indices-not-moved": (_HostIndicesNotMoved, _HostIndicesNotMovedPlain),
    "double-free": (_DoubleFree, _DoubleFreePlain),
    "use-after-free": (_UseAfterFree, _UseAfterFreePlain),
    "length-mismatch": (_LengthMismatch, _LengthMismatchPlain),
}


def fault_class(fault: str | None, spec: ModelSpec) -> type[HiCacheController]:
    """The controller class that reproduces ``fault`` for ``spec`` (None: the real one)."""
    if fault is None:
        return HybridCacheController if spec.is_hybrid else HiCacheController
    try:
        hybrid_cls, plain_cls = FAULTS[fault]
    except KeyError:
        raise ConfigError(f"unknown fault {fault!r}; expected one of {', '.join(FAULTS)}") from None
    if spec.is_hybrid:
        return hybrid_cls
    if plain_cls is None:
        raise ConfigError(f"fault {fault!r} needs a hybrid model; {spec.name!r} has only the kv pool")
    return plain_cls


def make_controller(
    spec: ModelSpec | None = None, *, fault: str | None = None, runtime: Any = "sim", **kwargs: Any
) -> HiCacheController:
    """A controller for ``spec`` (default ``ModelSpec.tiny_hybrid()``) with ``fault`` injected."""
    spec = spec if spec is not None else ModelSpec.tiny_hybrid()
    cls = fault_class(fault, spec)
    return cls(spec, runtime=runtime, **kwargs)

