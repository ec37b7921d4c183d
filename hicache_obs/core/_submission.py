"""Submission: what a merged, moved op hands the copies, the launches, and its one event.

:func:`index_pairs` lists an op's :class:`IndexPair` (the anchor's first), each with the
runs of its values where the host can read them: the events and the copies share them.
:func:`slots_by_pool` and :func:`bytes_by_pool` are the sizes its events carry.
:class:`Launcher` starts an op's copies on the current stream: :meth:`Launcher.write`
backs up every pool; :meth:`Launcher.load` loads layer by layer, recording each layer's
event after its data. :class:`Submissions` builds every op's ``TransferSubmitted`` (the
one place it is built), for an op whose copies are launched and for an op ended with
nothing launched (:meth:`Submissions.end_unlaunched`: an index move or the submission's
set-up refused it, or ``close()`` cancelled it), whose ack then carries the error. The
controller queues each op's ack and records its index tensors on the stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnresolvedTransferError
from ..events._schema import TensorRef, TransferSubmitted
from ._acks import Given, InFlightCopy
from ._operations import CacheOperation
from ._pools import DevicePool, HostPool
from ._runtime import DeviceEvent, Runtime
from ._spec import ANCHOR, ModelSpec
from ._transfer import (
    CopyFault,
    Runs3,
    check_kernel_indices,
    host_pair_runs,
    launch_backup,
    launch_load_all,
    launch_load_layer,
    runs_for_copy,
)

__all__ = ["IndexPair", "Launcher", "Submissions", "bytes_by_pool", "index_pairs", "slots_by_pool"]

#: (pool, slots) per pool, the anchor's first
SlotsByPool = tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class IndexPair:
    """One pool's index tensors of a submission, and their ``pair_runs`` when both tensors'
    values are on the CPU (read once: the events and the copies share them), else None."""

    pool: str
    host: torch.Tensor
    device: torch.Tensor
    runs: Runs3 | None = None


def index_pairs(op: CacheOperation, runtime: Runtime) -> list[IndexPair]:
    """The op's index pairs, the anchor's first, each with its runs where they are readable."""
    sides = [(ANCHOR, op.host_indices, op.device_indices)]
    for t in op.pool_transfers or ():
        if t.host_indices is None or t.device_indices is None:
            raise UnresolvedTransferError(
                f"pool transfer {t.pool!r} of op {op.id} reached submission with "
                f"{'host' if t.host_indices is None else 'device'}_indices None"
            )
        sides.append((t.pool, t.host_indices, t.device_indices))
    return [IndexPair(pool, h, d, host_pair_runs(runtime, h, d)) for pool, h, d in sides]


def slots_by_pool(op: CacheOperation) -> SlotsByPool:
    """The slots the op moves per pool, the anchor's first (an alias not resolved yet moves as
    many as its source)."""
    slots = {ANCHOR: op.host_indices.numel()}
    for t in op.pool_transfers or ():
        idx = t.host_indices if t.host_indices is not None else t.device_indices
        if idx is not None:
            n = idx.numel()
        else:  # an alias not resolved yet: it moves as many slots as its source
            n = op.host_indices.numel() if t.indices_from_pool == ANCHOR else 0
        slots[t.pool] = slots.get(t.pool, 0) + n
    return tuple(slots.items())


def bytes_by_pool(spec: ModelSpec, slots: SlotsByPool) -> SlotsByPool:
    """The bytes those slots hold, per pool."""
    return tuple((p, n * spec.slot_bytes(p)) for p, n in slots)


class Launcher:
    """Starts the copies of one controller's submissions on the current stream.

    ``native``: the runtime copies runs in native code (``native_copies``), which takes
    runs of any length (see ``transfer.runs_for_copy``)."""

    __slots__ = ("runtime", "io_backend", "native", "host_pools", "device_pools", "num_layers")

    def __init__(
        self,
        runtime: Runtime,
        io_backend: str,
        host_pools: Mapping[str, HostPool],
        device_pools: Mapping[str, DevicePool],
        num_layers: int,
    ) -> None:
        self.runtime = runtime
        self.io_backend = io_backend
        self.native = getattr(runtime, "native_copies", None) is not None
        self.host_pools = host_pools
        self.device_pools = device_pools
        self.num_layers = num_layers

    def write(self, pairs: list[IndexPair], fault: CopyFault) -> None:
        """Back up every pair with slots. With the ``kernel`` backend every pool is checked
        before any copy is launched: a copy queued before a later pool's check failed would
        run with index tensors nobody recorded."""
        rt = self.runtime
        pairs = [p for p in pairs if p.host.numel()]
        if self.io_backend == "kernel":
            for p in pairs:
                check_kernel_indices(rt, p.pool, p.host, p.device)
        io, native = self.io_backend, self.native
        for p in pairs:
            launch_backup(
                rt, self.host_pools[p.pool], self.device_pools[p.pool], p.host, p.device,
                runs_for_copy(io, native, p.host, p.runs), fault,
            )  # fmt: skip

    def load(
        self, pairs: list[IndexPair], fault: CopyFault, layer_event: Callable[[int], DeviceEvent], stream: Any
    ) -> list[DeviceEvent]:
        """Load every pair layer by layer; after each layer, ``layer_event(layer)`` is recorded
        on ``stream``. Those events, one per layer."""
        rt = self.runtime
        io, native = self.io_backend, self.native
        plan = []
        for p in pairs:
            if io == "kernel":
                check_kernel_indices(rt, p.pool, p.host, p.device)
            plan.append((
                self.host_pools[p.pool], self.device_pools[p.pool], p.host, p.device,
                runs_for_copy(io, native, p.host, p.runs),
            ))  # fmt: skip
        events = []
        if not rt.has_device:
            # nothing can overlap a synchronous copy: move every layer in one pass, then
            # mark the layers done (each layer's event still follows its data)
            for hp, dp, h, d, runs in plan:
                if h.numel():
                    launch_load_all(rt, hp, dp, h, d, runs, fault)
        for layer in range(self.num_layers):
            for hp, dp, h, d, runs in plan:
                local = dp.layer_index.get(layer)
                if local is not None and h.numel() and rt.has_device:
                    launch_load_layer(rt, hp, dp, local, h, d, runs, fault)
            ev = layer_event(layer)
            ev.record(stream)
            events.append(ev)
        return events


class Submissions:
    """One controller's ``TransferSubmitted`` events, built here only (``emit`` appends and
    folds an event), and the ending of an op that launched nothing."""

    __slots__ = ("emit", "runtime", "spec", "io_backend", "layout", "enable_timing")

    def __init__(
        self,
        emit: Callable[..., Any],
        runtime: Runtime,
        spec: ModelSpec,
        io_backend: str,
        layout: str,
        enable_timing: bool,
    ) -> None:
        self.emit = emit
        self.runtime = runtime
        self.spec = spec
        self.io_backend = io_backend
        self.layout = layout
        self.enable_timing = enable_timing

    def submitted(
        self,
        op: int,
        direction: str,
        stream: Any,
        tensors: Sequence[TensorRef],
        slots: SlotsByPool,
        sizes: SlotsByPool,
        producer_id: int,
    ) -> None:
        """The op's ``TransferSubmitted`` on ``stream``: ``tensors`` describe what its copies
        were handed (none for an op that launched nothing)."""
        self.emit(
            TransferSubmitted,
            op=op,
            direction=direction,
            stream=stream.name,
            io_backend=self.io_backend,
            layout=self.layout,
            tensors=tuple(tensors),
            slots_by_pool=slots,
            bytes_by_pool=sizes,
            producer_id=producer_id,
            device=self.runtime.device,
        )

    def end_unlaunched(
        self,
        op: int,
        direction: str,
        node_ids: tuple[int, ...],
        slots: SlotsByPool,
        stream: Any,
        producer_id: int,
        exc: BaseException,
        given: Given,
    ) -> InFlightCopy:
        """End an op that launched nothing: a ``TransferSubmitted`` without tensors (no copy
        received any) and the ack to queue, carrying ``exc``: reaped in FIFO order as the
        op's ``TransferFailed`` (``given``: the slots allocated for it)."""
        rt = self.runtime
        sizes = bytes_by_pool(self.spec, slots)
        self.submitted(op, direction, stream, (), slots, sizes, producer_id)
        finish = rt.event(self.enable_timing)
        finish.record()  # on the main stream: nothing of this op was queued anywhere
        return InFlightCopy(
            op, direction, node_ids, finish, finish, None, slots, sizes, producer_id,
            error=f"{type(exc).__name__}: {exc}", given=given,
        )  # fmt: skip
