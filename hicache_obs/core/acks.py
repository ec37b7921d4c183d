"""A transfer in flight and what reaping it gives: :class:`InFlightCopy`, :class:`Ack`.

A controller keeps one :class:`InFlightCopy` per submitted op, per direction, in FIFO
order. Reaping asks the oldest whether it is done (:meth:`InFlightCopy.settle`); a
failure of its copies, or of the runtime's answer about it, becomes its ``error``. The
controller then emits ``TransferCompleted`` or ``TransferFailed`` and hands the caller
the op's :class:`Ack` (``poll_writes`` / ``poll_loads``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .runtime import DeviceEvent
from .transfer import CopyFault

__all__ = ["Ack", "Given", "InFlightCopy", "elapsed_ns"]

_log = logging.getLogger("hicache_obs.controller")

#: the slots the controller allocated for an op: (pool, tier, CPU int64 slots) per pool
Given = tuple[tuple[str, str, torch.Tensor], ...]


@dataclass(frozen=True)
class Ack:
    """A reaped operation: what :meth:`HiCacheController.poll_writes`/``poll_loads`` return."""

    op_id: int
    direction: str
    node_ids: tuple[int, ...]
    ok: bool
    error: str | None
    duration_ns: int | None
    layer_durations_ns: tuple[int, ...] | None
    slots_by_pool: tuple[tuple[str, int], ...]
    bytes_by_pool: tuple[tuple[str, int], ...]
    producer_id: int = -1


def elapsed_ns(start: DeviceEvent, end: DeviceEvent) -> int | None:
    """Device time from ``start`` to ``end``; None where the runtime cannot say (no timing is
    a value, not a failed transfer)."""
    try:
        return start.elapsed_ns(end)
    except Exception:
        _log.exception("a runtime event failed to report its elapsed time")
        return None


@dataclass
class InFlightCopy:
    """One submitted op's copies: their device events and what the ack will carry."""

    op_id: int
    direction: str
    node_ids: tuple[int, ...]
    start: DeviceEvent
    finish: DeviceEvent
    layer_events: list[DeviceEvent] | None
    slots_by_pool: tuple[tuple[str, int], ...]
    bytes_by_pool: tuple[tuple[str, int], ...]
    producer_id: int
    error: str | None = None
    fault: CopyFault | None = None  # what the op's copies raised, wherever they ran
    given: Given = ()  # (pool, tier, slots) allocated for the op

    def settle(self, *, closing: bool) -> tuple[bool, bool]:
        """``(done, stuck)``: whether it can be reaped now, and whether it is reaped only
        because the controller is closing while the runtime still calls it unfinished
        (after ``synchronize()``: its copies may yet write, so its slots are not given back).
        A runtime that fails to answer, or copies that raised, set ``error``."""
        stuck = False
        try:
            done = self.finish.query()
        except Exception as exc:
            _log.warning(
                "op %d (%s): the runtime failed to answer for its transfer: %s", self.op_id, self.direction, exc
            )
            self.error = self.error or f"{type(exc).__name__}: {exc}"
            done = True
        if not done:
            if not closing:
                return False, False
            self.error = self.error or "RuntimeError: still unfinished at close(), after the runtime's synchronize()"
            stuck = True
        if self.error is None and self.fault is not None and self.fault.error is not None:
            e = self.fault.error
            self.error = f"{type(e).__name__}: {e}"
            _log.warning("transfer of op %d (%s) failed on its stream: %s", self.op_id, self.direction, self.error)
        return True, stuck

    def durations(self) -> tuple[int | None, tuple[int, ...] | None]:
        """The transfer's device time, and each layer's (None unless every layer has one)."""
        dur = elapsed_ns(self.start, self.finish)
        layers = None
        if self.layer_events is not None:
            ls = [elapsed_ns(self.start, e) for e in self.layer_events]
            layers = tuple(x for x in ls if x is not None) if all(x is not None for x in ls) else None
        return dur, layers

    def ack(self, duration_ns: int | None = None, layer_durations_ns: tuple[int, ...] | None = None) -> Ack:
        """The caller's :class:`Ack`: failed where ``error`` is set (no durations then)."""
        if self.error is not None:
            return Ack(
                self.op_id, self.direction, self.node_ids, False, self.error, None, None,
                self.slots_by_pool, self.bytes_by_pool, self.producer_id,
            )  # fmt: skip
        return Ack(
            self.op_id, self.direction, self.node_ids, True, None, duration_ns, layer_durations_ns,
            self.slots_by_pool, self.bytes_by_pool, self.producer_id,
        )  # fmt: skip
