"""The cache controllers: :class:`HiCacheController` and :class:`HybridCacheController`.

They move cache state between device pools and pinned host pools through a write
queue and a load queue, each started on its own side stream, the way SGLang's
HiCache does. Every state change is an event
appended to ``controller.log``; the bookkeeping (``controller.state``) is the fold
of those events.

Thread-safety: every public method takes the controller's lock, so calls from
several threads are serialised; events are appended under the log's lock with
gap-free ``seq``.

This module is the facade: the lock, the queues, the public methods and the hot path of
a submission (``_submit``). Each concept has a module of its own: input and configuration
checks (:mod:`.validation`), pool sizes and pools (:mod:`.pools`), the admission of a
write or load (:mod:`.admission`), multi-pool allocation and alias resolution
(:mod:`.allocation`), index normalisation (:mod:`.index_moves`), tensor descriptions
(:mod:`.describe`), index pairs, copy launches and every ``TransferSubmitted``
(:mod:`.submission`), the runtime's reports of stream records and index moves
(:mod:`.reports`), transfers in flight and their FIFO reaping (:mod:`.acks`), the ending
of every op at close (:mod:`.closing`), and :class:`HybridCacheController`
(:mod:`.hybrid`, re-exported here).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from .._profiles import Profile, Sampler, resolve_profile
from ..errors import ConfigError, ControllerClosedError, HiCacheError, UnknownPoolError
from ..events._log import EventLog
from ..events._schema import D2H, H2D, OperationQueued, OperationsMerged, PoolsSampled
from ..events._state import CacheState
from ._acks import Ack, Given, InFlightCopy, reap
from ._admission import Admission
from ._allocation import PoolAllocations
from ._closing import end_every_op
from ._describe import submission_refs
from ._index_moves import IndexNormaliser
from ._layers import LayerDoneCounter
from ._operations import CacheOperation, PoolTransfer, merge_ops
from ._policy import WritePolicy
from ._pools import DevicePool, HostPool, SlotAllocator, device_sizes, make_pools
from ._reports import RuntimeReports
from ._runtime import DeviceEvent, Runtime, make_runtime
from ._spec import ANCHOR, ModelSpec
from ._submission import IndexPair, Launcher, Submissions, bytes_by_pool, index_pairs, slots_by_pool
from ._transfer import CopyFault
from ._validation import check_index_pair, check_index_tensor, check_options

__all__ = ["Ack", "HiCacheController", "HybridCacheController", "ANCHOR", "EVENT_DETAILS"]

#: ``event_detail`` values: every event, or only those the bookkeeping fold needs.
EVENT_DETAILS = ("full", "bookkeeping")
_log = logging.getLogger("hicache_obs.controller")


class HiCacheController:
    """Device <-> host cache controller for a plain (KV-only) model.

    ``write(device_indices)`` allocates host slots, queues and starts the backup;
    ``load(host_indices)`` allocates device slots and queues; ``start_loading()``
    submits the queued loads layer by layer. ``poll_writes()``/``poll_loads()``
    reap finished operations in FIFO order.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        runtime: str | Runtime = "sim",
        device_size: int = 4096,
        host_ratio: float = 2.0,
        host_bytes: int | None = None,
        pool_sizes: dict[str, int] | None = None,
        layout: str = "layer_first",
        io_backend: str = "kernel",
        write_policy: str | WritePolicy = "write_through",
        write_through_threshold: int = 2,
        log: EventLog | None = None,
        rank: int = 0,
        enable_timing: bool = True,
        event_detail: str = "full",
        profile: str | Profile = "audit",
        audit_sample: float | None = None,
    ) -> None:
        check_options(
            spec,
            io_backend=io_backend,
            layout=layout,
            device_size=device_size,
            host_ratio=host_ratio,
            host_bytes=host_bytes,
            plain=type(self) is HiCacheController,
        )
        self.spec = spec
        self.runtime: Runtime = make_runtime(runtime)
        self.io_backend = io_backend
        self.layout = layout
        self.write_policy = (
            write_policy
            if isinstance(write_policy, WritePolicy)
            else WritePolicy(write_policy, write_through_threshold)
        )
        if event_detail not in EVENT_DETAILS:
            raise ConfigError(f"event_detail must be one of {', '.join(EVENT_DETAILS)}, got {event_detail!r}")
        #: how much evidence the events carry (:mod:`hicache_obs._profiles`): ``audit`` reads the
        #: slot values of every op's index tensors, ``metrics`` none, ``sampling`` those of a share
        self.profile = resolve_profile(profile, audit_sample)
        self._sampler = None if self.profile.full else Sampler(self.profile.audit_sample)
        self._values_of = (-2, False)  # (op, whether its tensors carry their values)
        self._owns_log = log is None
        self.log = log if log is not None else EventLog(rank=rank)
        self.log.bind_owner(self)  # one open controller per log (a ConfigError otherwise)
        self.rank = self.log.rank
        self.state = CacheState()
        self._unsubscribe_state = self.log.subscribe(self._fold, first=True)
        self.enable_timing = enable_timing
        # "bookkeeping": only the events the state fold needs (no index moves, no stream
        # records, no tensor descriptions): the baseline the bench measures against
        self.event_detail = event_detail
        self._detail = event_detail == "full"
        #: the index normalisation; its ``expected`` is the move the runtime reports next
        self._moves = IndexNormaliser(self.runtime, io_backend, layout, read_runs=self._detail, values=self._values)
        #: the runtime's reports of this controller's stream records and index moves
        self._reports = RuntimeReports(self.runtime, self.log, self._moves, self._values)
        observers = getattr(self.runtime, "observers", None)
        if observers is None:
            raise ConfigError(
                f"runtime {getattr(self.runtime, 'name', type(self.runtime).__name__)!r} has no 'observers' "
                "(CallObservers): stream records and index moves are reported by the runtime"
            )
        self._unobserve = (
            observers.add(record=self._reports.recorded, move=self._reports.moved) if self._detail else (lambda: None)
        )
        self._lock = threading.RLock()
        self._closed = False
        self._next_id = 0
        self._ops: dict[int, CacheOperation] = {}
        #: the slots allocated for each op, until it is reaped (close frees a failed op's)
        self._allocations = PoolAllocations(self._alloc)
        self._acks: dict[str, deque[InFlightCopy]] = {D2H: deque(), H2D: deque()}
        self._admission = Admission(spec, self.runtime, self._allocations, self._validate, self._pool, self._new_id)

        self.device_pools, self.host_pools = make_pools(
            spec,
            device_sizes(spec, device_size, pool_sizes or {}),
            host_ratio=host_ratio,
            host_bytes=host_bytes,
            layout=layout,
            runtime=self.runtime,
            emit=self._emit,
            table=self.state.table,
        )
        if not self.profile.full:  # the share audited in full, for dashboards (hicache_audit_sample_ratio)
            self._emit(PoolsSampled, pools=(), audit_sample=self.profile.audit_sample)
        self.write_stream = self.runtime.stream("hicache-write")
        self.load_stream = self.runtime.stream("hicache-load")
        self.layer_done_counter = LayerDoneCounter(self.runtime, spec.num_layers, enable_timing=enable_timing)
        self._launcher = Launcher(self.runtime, io_backend, self.host_pools, self.device_pools, spec.num_layers)
        self._submissions = Submissions(self._emit, self.runtime, spec, io_backend, layout, enable_timing)

    # ---------------------------------------------------------------- helpers
    def _emit(self, cls: Any, **fields: Any) -> Any:
        """Append an event and fold it at once, also when the log is busy delivering
        another event (a controller call from inside a subscriber)."""
        ev = self.log.emit(cls, **fields)
        if ev.seq > self.state.last_seq:
            self.state.apply(ev)
        return ev

    def _fold(self, ev: Any) -> None:
        if ev.seq > self.state.last_seq:  # not folded by _emit already
            self.state.apply(ev)

    def _values(self, op: int) -> bool:
        """Whether ``op``'s tensor descriptions carry their slot values: always under ``audit``,
        never under ``metrics``; under ``sampling`` the sampler decides once per op (its index
        moves come first, then its submission and stream records, under the controller's lock)."""
        if self._sampler is None:
            return True
        last, taken = self._values_of
        if op != last or op < 0:
            taken = self._sampler.take()
            self._values_of = (op, taken)
        return taken

    @property
    def sampled(self) -> tuple[int, int]:
        """(ops whose tensors carried their values, ops seen) under ``metrics`` and ``sampling``;
        (0, 0) under ``audit``, which reads every op's."""
        s = self._sampler
        return (0, 0) if s is None else (s.taken, s.seen)

    def _check_open(self) -> None:
        if self._closed:
            raise ControllerClosedError("the controller is closed; create a new one")

    def _new_id(self) -> int:
        i = self._next_id
        self._next_id += 1
        return i

    def _pool(self, pool: str, tier: str) -> DevicePool | HostPool:
        if not isinstance(pool, str):
            raise UnknownPoolError(f"pool name must be a str, got {type(pool).__name__} {pool!r}")
        pools: dict[str, Any] = self.device_pools if tier == "device" else self.host_pools
        try:
            return pools[pool]  # type: ignore[no-any-return]
        except KeyError:
            raise UnknownPoolError(
                f"unknown pool {pool!r}; model {self.spec.name!r} has pools {', '.join(self.spec.pool_names)}"
            ) from None

    def _alloc(self, pool: str, tier: str) -> SlotAllocator:
        a = self._pool(pool, tier).allocator
        assert a is not None
        return a

    def _validate(
        self,
        t: object,
        *,
        arg: str,
        pool: str,
        tier: str,
        allow_empty: bool = False,
        must_be_allocated: bool = True,
    ) -> list[int] | None:
        """Check an index tensor; returns its values when they can be read without a sync
        (:func:`~hicache_obs.core._validation.check_index_tensor`)."""
        return check_index_tensor(
            t,
            arg=arg,
            pool=pool,
            tier=tier,
            runtime=self.runtime,
            allocator=self._alloc,
            allow_empty=allow_empty,
            must_be_allocated=must_be_allocated,
        )

    # ------------------------------------------------------------- public API
    def alloc_device(self, n: int, pool: str = ANCHOR) -> torch.Tensor | None:
        """Allocate ``n`` device slots of ``pool`` for the engine's own use (prefill)."""
        with self._lock:
            self._check_open()
            t = self._alloc(pool, "device").alloc(n)
            return None if t is None else self.runtime.to_device(t)

    def free_device(self, device_indices: torch.Tensor, pool: str = ANCHOR, *, reason: str = "free") -> int:
        """Free device slots (eviction of a node from the device). Returns the count."""
        with self._lock:
            self._check_open()
            # allocation is checked by the allocator's free, which tells a double free apart
            values = self._validate(
                device_indices, arg="device_indices", pool=pool, tier="device", allow_empty=True, must_be_allocated=False
            )
            if values is None:
                values = self.runtime.to_host(device_indices).tolist()
            return self._alloc(pool, "device").free(values, reason=reason, arg="device_indices")

    def evict_device(self, device_indices: torch.Tensor, pool: str = ANCHOR) -> int:
        """Free device slots of an evicted node (its host copy, if any, stays)."""
        return self.free_device(device_indices, pool, reason="evict")

    def evict_host(self, host_indices: torch.Tensor, pool: str = ANCHOR) -> int:
        """Free host slots of nodes no longer kept on the host. Returns the count."""
        with self._lock:
            self._check_open()
            values = self._validate(
                host_indices, arg="host_indices", pool=pool, tier="host", allow_empty=True, must_be_allocated=False
            )
            assert values is not None
            return self._alloc(pool, "host").free(values, reason="evict", arg="host_indices")

    def write(self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1) -> torch.Tensor | None:
        """Back up device slots: allocate host slots, queue, start. Host indices or None."""
        res = self._write(device_indices, priority, node_id, None)
        return None if res is None else res[0]

    def load(self, host_indices: torch.Tensor, priority: int | None = None, node_id: int = -1) -> torch.Tensor | None:
        """Queue a load of host slots into newly allocated device slots. Device indices or None."""
        res = self._load(host_indices, priority, node_id, None)
        return None if res is None else res[0]

    # ------------------------------------------------------------ write / load
    def _write(
        self,
        device_indices: torch.Tensor,
        priority: int | None,
        node_id: int,
        pool_transfers: Sequence[PoolTransfer] | None,
    ) -> tuple[torch.Tensor, tuple[PoolTransfer, ...] | None] | None:
        with self._lock:
            self._check_open()
            op = self._admission.admit(D2H, device_indices, priority, node_id, pool_transfers)
            if op is None:
                return None
            self._queue(op, D2H)
            self.start_writing()
            return op.host_indices, op.pool_transfers

    def _load(
        self,
        host_indices: torch.Tensor,
        priority: int | None,
        node_id: int,
        pool_transfers: Sequence[PoolTransfer] | None,
    ) -> tuple[torch.Tensor, tuple[PoolTransfer, ...] | None] | None:
        with self._lock:
            self._check_open()
            op = self._admission.admit(H2D, host_indices, priority, node_id, pool_transfers)
            if op is None:
                return None
            self._queue(op, H2D)
            return op.device_indices, op.pool_transfers

    def _queue(self, op: CacheOperation, direction: str) -> None:
        self._ops[op.id] = op
        self._emit(
            OperationQueued,
            op=op.id,
            direction=direction,
            node_id=op.node_ids[0] if op.node_ids else -1,
            priority=int(op.priority if op.priority is not None else op.id),
            slots_by_pool=slots_by_pool(op),
        )

    def _take_queue(self, direction: str) -> CacheOperation | None:
        ids = list(self.state.queues[direction])
        if not ids:
            return None
        ops = [self._ops.pop(i) for i in ids]
        merged = merge_ops(ops, new_id=self._new_id() if len(ops) > 1 else None)
        if len(ops) > 1:
            self._allocations.merge(merged.id, ids)
        self._emit(
            OperationsMerged, op=merged.id, merged_ops=tuple(ids), direction=direction, node_ids=tuple(merged.node_ids)
        )
        return merged

    # ------------------------------------------------------------ index moves
    def move_indices(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, *, op: int = -1, pool: str = ANCHOR
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise an index pair for the io backend; returns new tensors, emits ``IndicesMoved``.

        ``kernel``: host indices are copied to the device (non-blocking).
        ``direct`` + ``layer_first``: device indices to the CPU; host indices sorted and
        device indices permuted alike (pairs stay together).
        ``direct`` + ``page_first``/``page_first_direct``: device indices to the CPU.
        """
        with self._lock:
            self._check_open()
            self._pool(pool, "device")
            check_index_pair(host_indices, device_indices, pool=pool, runtime=self.runtime)
            return self._moves.normalise(host_indices, device_indices, op, pool)

    def _move_op(self, op: CacheOperation) -> CacheOperation:
        host, device = self.move_indices(op.host_indices, op.device_indices, op=op.id)
        return op.replace(host_indices=host, device_indices=device)

    def _record_transfer_indices_on_stream(
        self,
        stream: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        pool_transfers: tuple[PoolTransfer, ...] | None,
        *,
        op: int = -1,
    ) -> None:
        """Record every device index tensor of the anchor and of every pool on ``stream``."""
        self._record_pair(stream, ANCHOR, host_indices, device_indices, op)
        for t in pool_transfers or ():
            if t.host_indices is not None and t.device_indices is not None:
                self._record_pair(stream, t.pool, t.host_indices, t.device_indices, op)

    def _record_pair(self, stream: Any, pool: str, host: torch.Tensor, device: torch.Tensor, op: int) -> None:
        self._reports.record_pair(stream, pool, host, device, op)

    # ----------------------------------------------------------- submission
    def _submit(self, op: CacheOperation, direction: str, stream: Any, producer_id: int) -> InFlightCopy:
        """Submit a moved op. Whatever fails from here on is this op's failure: an ack with
        its error, reaped in FIFO order as a ``TransferFailed``, never an exception."""
        rt = self.runtime
        # kept in _allocations until the ack holds it: an exception that escapes the submission
        # (a KeyboardInterrupt) leaves the op to close(), which then still has its slots
        given = self._allocations.given(op.id)
        try:
            pairs = index_pairs(op, rt)
            slots = slots_by_pool(op)
            sizes = bytes_by_pool(self.spec, slots)
            refs = submission_refs(rt, op, pairs, values=self._values(op.id)) if self._detail else []
            start = rt.event(self.enable_timing)
            start.record()  # after the index moves: the side stream is ordered after them
            finish = rt.event(self.enable_timing)
        except Exception as exc:  # nothing launched yet
            _log.warning("transfer of op %d (%s) failed before submission: %s: %s", op.id, direction, type(exc).__name__, exc)
            return self._fail_unsubmitted(
                op.id, direction, tuple(op.node_ids), self._slots_or_none(op), stream, producer_id, exc,
                self._allocations.pop(op.id),
            )
        self._submissions.submitted(op.id, direction, stream, refs, slots, sizes, producer_id)
        begin = rt.event(self.enable_timing)  # when the side stream starts this op's work
        fault = CopyFault()
        ack = InFlightCopy(
            op.id, direction, tuple(op.node_ids), begin, finish, None, slots, sizes, producer_id,
            fault=fault, given=given,
        )
        if refs:  # the stream records below describe the same tensors: they reuse these
            self._reports.refs = {
                key: ref
                for p, rh, rd in zip(pairs, refs[0::2], refs[1::2])
                for key, ref in (((id(p.host), p.pool, "host"), rh), ((id(p.device), p.pool, "device"), rd))
            }
        try:
            with rt.use(stream):
                start.wait(stream)
                begin.record(stream)
                if direction == D2H:
                    self._launch_write(pairs, fault)
                else:
                    ack.layer_events = self._launch_load(pairs, producer_id, fault)
                finish.record(stream)
                self._record_transfer_indices_on_stream(
                    stream, op.host_indices, op.device_indices, op.pool_transfers, op=op.id
                )
        except Exception as exc:  # a refused launch is a failed transfer, reaped in FIFO order
            if isinstance(exc, HiCacheError):
                _log.warning("transfer of op %d (%s) failed at submission: %s", op.id, direction, exc)
            else:
                _log.exception("transfer of op %d (%s) failed at submission", op.id, direction)
            ack.error = f"{type(exc).__name__}: {exc}"
            ack.finish = self._finish_after_refusal(stream, op)
        finally:
            self._reports.refs = {}  # keyed by id(): valid only during this submission
        self._track(ack)
        self._allocations.pop(op.id)
        return ack

    def _track(self, ack: InFlightCopy) -> None:
        """Queue a submitted op's ack for reaping; a tracked load's finish is its producer's."""
        if ack.direction == H2D and ack.producer_id >= 0:
            self.layer_done_counter.set_finish_event(ack.producer_id, ack.finish)
        self._acks[ack.direction].append(ack)

    def _finish_after_refusal(self, stream: Any, op: CacheOperation) -> DeviceEvent:
        """The finish event of a launch that raised part-way: after whatever of it the side
        stream already holds (the op is reaped, and its slots handed back, only when that
        ran), with its index tensors recorded there for that work."""
        rt = self.runtime
        finish = rt.event(self.enable_timing)
        try:
            finish.record(stream)
            self._record_transfer_indices_on_stream(
                stream, op.host_indices, op.device_indices, op.pool_transfers, op=op.id
            )
        except Exception:
            _log.exception("op %d: the side stream refused the failed launch's finish event; it is reaped now", op.id)
            finish = rt.event(self.enable_timing)
            finish.record()
        return finish

    def _slots_or_none(self, op: CacheOperation) -> tuple[tuple[str, int], ...]:
        try:
            return slots_by_pool(op)
        except Exception:
            return ()

    def _fail_unsubmitted(
        self,
        op_id: int,
        direction: str,
        node_ids: tuple[int, ...],
        slots: tuple[tuple[str, int], ...],
        stream: Any,
        producer_id: int,
        exc: BaseException,
        given: Given,
    ) -> InFlightCopy:
        """End an op that launched nothing (:meth:`Submissions.end_unlaunched`) and queue its ack."""
        ack = self._submissions.end_unlaunched(op_id, direction, node_ids, slots, stream, producer_id, exc, given)
        self._track(ack)
        return ack

    def _launch_write(self, pairs: list[IndexPair], fault: CopyFault) -> None:
        self._launcher.write(pairs, fault)

    def _launch_load(self, pairs: list[IndexPair], producer_id: int, fault: CopyFault) -> list[DeviceEvent]:
        layer_event: Callable[[int], DeviceEvent]
        if producer_id >= 0:
            layer_event = partial(self.layer_done_counter.layer_event, producer_id)
        else:
            layer_event = self._untracked_layer_event
        return self._launcher.load(pairs, fault, layer_event, self.load_stream)

    def _untracked_layer_event(self, layer: int) -> DeviceEvent:
        """A layer's event of a load no layer-done counter waits for."""
        return self.runtime.event(self.enable_timing)

    def _start(self, direction: str, stream: Any, producer_id: int) -> None:
        op = self._take_queue(direction)
        assert op is not None
        try:
            moved = self._move_op(op)
        except Exception as exc:  # merged, never submitted: end it as a failed transfer
            _log.warning("transfer of op %d (%s) failed at its index move: %s: %s", op.id, direction, type(exc).__name__, exc)
            self._fail_unsubmitted(
                op.id, direction, tuple(op.node_ids), self._slots_or_none(op), stream, producer_id, exc,
                self._allocations.pop(op.id),
            )
            return
        del op
        self._submit(moved, direction, stream, producer_id)

    def start_writing(self) -> None:
        """Merge the write queue, move indices and back everything up on the write stream."""
        with self._lock:
            self._check_open()
            if self.state.queues[D2H]:
                self._start(D2H, self.write_stream, -1)

    def start_loading(self) -> int:
        """Submit the queued loads layer by layer; returns the producer id, or -1 if none queued."""
        with self._lock:
            self._check_open()
            if not self.state.queues[H2D]:
                return -1
            producer_id = self.layer_done_counter.update_producer()
            self._start(H2D, self.load_stream, producer_id)
            return producer_id

    # ----------------------------------------------------------------- acks
    def poll_writes(self) -> list[Ack]:
        """Reap finished writes in FIFO order, stopping at the first unfinished one."""
        return self._poll(D2H)

    def poll_loads(self) -> list[Ack]:
        """Reap finished loads in FIFO order, stopping at the first unfinished one."""
        return self._poll(H2D)

    def _poll(self, direction: str) -> list[Ack]:
        with self._lock:
            self._check_open()
            return reap(self._acks[direction], self._emit)

    def in_flight(self, direction: str) -> int:
        return self.state.in_flight(direction)

    # ---------------------------------------------------------- life cycle
    @property
    def closed(self) -> bool:
        return self._closed

    def synchronize(self) -> None:
        """Wait for all side-stream work (does not reap acks)."""
        with self._lock:
            self.runtime.synchronize()

    def close(self) -> None:
        """Finish in-flight work, end every op, and refuse further calls. Idempotent.

        Ops in flight are reaped (completed, or failed); ops still queued, never started,
        are cancelled: each gets its ``TransferSubmitted`` without tensors and a
        ``TransferFailed`` whose error starts with ``ControllerClosedError``. Every op that
        ends failed here has the slots allocated for it freed (``reason="failed"``): no one
        can free them after close.
        """
        with self._lock:
            if self._closed:
                return
            self.runtime.synchronize()  # may raise: then the controller stays open, nothing changed
            out = end_every_op(
                self.state,
                self._ops,
                self._acks,
                {D2H: self.write_stream, H2D: self.load_stream},
                self._allocations,
                self._emit,
                self._submissions.end_unlaunched,
            )
            self._allocations.clear()
            self._ops.clear()
            self._closed = True
            self._unsubscribe_state()
            self._unobserve()
            if self._owns_log:
                self.log.close()
            if out:
                _log.debug("close() ended %d ops: %s", len(out), [(a.op_id, a.ok) for a in out])

    def __enter__(self) -> HiCacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------- data access
    def device_pool(self, pool: str = ANCHOR) -> DevicePool:
        return self._pool(pool, "device")  # type: ignore[return-value]

    def host_pool(self, pool: str = ANCHOR) -> HostPool:
        return self._pool(pool, "host")  # type: ignore[return-value]


# the hybrid controller is a HiCacheController: its module imports this one, and it is
# importable from here too (``hicache_obs.core`` imports this module first)
from ._hybrid import HybridCacheController  # noqa: E402
