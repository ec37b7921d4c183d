"""Transfers in flight and their reaping: :class:`InFlightCopy`, :func:`reap`, :class:`Ack`.

A controller keeps one :class:`InFlightCopy` per submitted op, per direction, in FIFO
order. :func:`reap` asks the oldest whether it is done (:meth:`InFlightCopy.settle`); a
failure of its copies, or of the runtime's answer about it, becomes its ``error``. It
emits the op's ``TransferCompleted`` or ``TransferFailed`` and hands the caller the op's
:class:`Ack` (``poll_writes`` / ``poll_loads``), and stops at the first op not done: a
failed op is reaped in its place in the FIFO, never ahead of an older one.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..events._schema import TransferCompleted, TransferFailed
from ._runtime import DeviceEvent
from ._transfer import CopyFault

__all__ = ["Ack", "Given", "InFlightCopy", "elapsed_ns", "reap"]

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


def reap(
    queue: deque[InFlightCopy],
    emit: Callable[..., Any],
    *,
    closing: bool = False,
    free_failed: Callable[[int, Given], None] | None = None,
) -> list[Ack]:
    """Reap ``queue`` (one direction's copies, oldest first) in FIFO order, up to the first
    op not done: a failure of the op's copies, or of the runtime's answer about the op, is
    that op's ``TransferFailed``, anything else its ``TransferCompleted`` (each ``emit``-ted).
    ``closing``: reap every op (the runtime was synchronised), and give a failed op's slots
    back with ``free_failed(op, given)`` unless its copies may still write (``settle``)."""
    out: list[Ack] = []
    while queue:
        a = queue[0]
        done, stuck = a.settle(closing=closing)
        if not done:
            break
        queue.popleft()
        if a.error is not None:
            emit(TransferFailed, op=a.op_id, direction=a.direction, error=a.error)
            out.append(a.ack())
            if closing and not stuck and free_failed is not None:
                free_failed(a.op_id, a.given)
            continue
        dur, layers = a.durations()
        emit(
            TransferCompleted,
            op=a.op_id,
            direction=a.direction,
            duration_ns=dur if dur is not None else 0,
            layer_durations_ns=layers,
        )
        out.append(a.ack(dur, layers))
    return out
