"""Event types: immutable, typed, past-tense records of every state change.

Every event carries the header ``seq`` (gap-free per log, from 0), ``ts_ns``
(``time.time_ns()``) and ``rank``. Events are msgspec structs, frozen and tagged:
encoded as JSON each is one object whose ``type`` field names the class.
Events hold tuples, never lists or tensors: a :class:`TensorRef` describes an
index tensor (where it lives, how long, its address) without keeping it alive.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .._native import runs_of as _runs_of

__all__ = [
    "Runs",
    "TensorRef",
    "Event",
    "PoolCreated",
    "SlotsAllocated",
    "SlotsFreed",
    "AllocationFailed",
    "OperationQueued",
    "OperationsMerged",
    "IndicesMoved",
    "StreamRecorded",
    "TransferSubmitted",
    "TransferCompleted",
    "TransferFailed",
    "IndicesFreed",
    "IndicesMisplaced",
    "FreeRefused",
    "AuditViolation",
    "AnyEvent",
    "EVENT_TYPES",
    "D2H",
    "H2D",
    "DIRECTIONS",
    "TIERS",
    "ROLES",
    "runs_from_list",
    "expand_runs",
    "runs_len",
    "OpsSubmitted",
    "PoolsSampled",
    "Moved",
    "expand",
    "expanded",
    "LOG_FORMAT",
    "LOG_FORMAT_VERSION",
    "READABLE_VERSIONS",
]

#: The ``format`` of a segment header, the first line of every segment a store writes:
#: ``{"format":"hicache-obs/events","version":N,"rank":R,"segment":K}``.
LOG_FORMAT = "hicache-obs/events"
#: The log format version written. Version 1: one event per line, in seq order per rank;
#: a segment without a header is version 1 (every log written before headers). Version 2:
#: the same, with each ``AuditViolation`` right before the event that revealed it (with
#: that event's ``ts_ns``), the end-of-log ones after every event (version 1 logged them
#: after the revealing event). Version 3: version 2, with one more event type a reader of
#: version 2 does not know (``IndicesFreed``). Version 4: version 3, with two more
#: (``IndicesMisplaced``, ``FreeRefused``). Version 5: version 4, with two more
#: (``OpsSubmitted``, ``PoolsSampled``). See docs/events.md, "Compatibility".
LOG_FORMAT_VERSION = 5
#: The versions this reader reads; a segment of a newer version is refused
#: (:class:`~hicache_obs.errors.UnsupportedLogVersionError`). See docs/events.md, "Compatibility".
READABLE_VERSIONS: tuple[int, ...] = (1, 2, 3, 4, 5)

#: Largest pool this schema accepts (slots); bounds what a hostile log can make a reader allocate.
MAX_CAPACITY = 1 << 28

NonNeg = Annotated[int, Meta(ge=0)]
Slot = Annotated[int, Meta(ge=0, lt=MAX_CAPACITY)]
Count = Annotated[int, Meta(ge=0, le=MAX_CAPACITY)]
Direction = Literal["d2h", "h2d"]
Tier = Literal["device", "host"]
Role = Literal["host", "device"]
Share = Annotated[float, Meta(ge=0.0, le=1.0)]

#: A run-length list of slot indices: ``((start, length), ...)``.
Runs = tuple[tuple[Slot, Count], ...]

D2H = "d2h"  # write: device -> host backup
H2D = "h2d"  # load: host -> device
DIRECTIONS = (D2H, H2D)
TIERS = ("device", "host")
ROLES = ("host", "device")


class TensorRef(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Where an index tensor lives and what it holds, without holding it.

    ``indices`` is set only when the values were on the CPU already; reading a
    device tensor's values would force a sync, so device refs carry ``None``.
    """

    pool: str
    role: Role
    device: str
    numel: NonNeg
    dtype: str
    ptr: NonNeg
    indices: Runs | None = None


class Event(msgspec.Struct, frozen=True, tag=True, kw_only=True, gc=False):
    """Base of every event: the header fields."""

    seq: NonNeg
    ts_ns: NonNeg
    rank: NonNeg = 0


class PoolCreated(Event, frozen=True, kw_only=True):
    pool: str
    tier: Tier
    capacity: Count
    page_size: Annotated[int, Meta(ge=1, le=MAX_CAPACITY)]
    slot_bytes: NonNeg
    layout: str


class SlotsAllocated(Event, frozen=True, kw_only=True):
    pool: str
    tier: Tier
    indices: Runs
    op: int = -1


class SlotsFreed(Event, frozen=True, kw_only=True):
    pool: str
    tier: Tier
    indices: Runs
    reason: str = "free"  # free | evict | rollback | failed
    op: int = -1


class AllocationFailed(Event, frozen=True, kw_only=True):
    pool: str
    tier: Tier
    requested: int
    available: int


class OperationQueued(Event, frozen=True, kw_only=True):
    op: int
    direction: Direction
    node_id: int
    priority: int
    slots_by_pool: tuple[tuple[str, int], ...]


class OperationsMerged(Event, frozen=True, kw_only=True):
    op: int
    merged_ops: tuple[int, ...]
    direction: Direction
    node_ids: tuple[int, ...] = ()


class IndicesMoved(Event, frozen=True, kw_only=True):
    op: int
    pool: str
    role: Role
    src_device: str
    dst_device: str
    tensor: TensorRef
    # set when a pool's copy converted the indices itself, on this (the transfer's) stream:
    # the new tensor was allocated on that stream, so it needs no record_stream there
    stream: str = ""


class StreamRecorded(Event, frozen=True, kw_only=True):
    op: int
    pool: str
    role: Role
    stream: str
    tensor: TensorRef


class TransferSubmitted(Event, frozen=True, kw_only=True):
    op: int
    direction: Direction
    stream: str
    io_backend: str
    layout: str
    tensors: tuple[TensorRef, ...]
    slots_by_pool: tuple[tuple[str, int], ...]
    bytes_by_pool: tuple[tuple[str, int], ...]
    producer_id: int = -1
    device: str = ""  # the runtime's device ("cpu", "sim:0", "cuda:0")
    # pools whose copy of this op takes its host indices on the CPU by design (SGLang's staged
    # write-back kernels address host pages from the CPU), as the host pool said at the copy call
    host_indices_on_cpu: tuple[str, ...] = ()
    # pools the controller registers to move with another pool's slots, as (pool, the pool
    # whose slots it shares): a draft model's KV moves with the target's; an op that moves the
    # second must move the first (rule ``pool_omitted``)
    sidecar_pools: tuple[tuple[str, str], ...] = ()


class Moved(msgspec.Struct, frozen=True, gc=False):
    """One index move of an :class:`OpsSubmitted`: what its ``IndicesMoved`` holds."""

    pool: str
    role: Role
    src_device: str
    dst_device: str
    tensor: TensorRef
    stream: str = ""


class OpsSubmitted(Event, frozen=True, kw_only=True):
    """One submission as a single event (the ``metrics`` and ``sampling`` profiles): the ops
    merged into ``op`` with when each was queued, the index moves, the ``record_stream`` calls
    and the transfer itself. Readers see it as the events it stands for (:func:`expand`):
    an ``OperationQueued`` per queued op (with its own ``ts_ns``), ``OperationsMerged``, an
    ``IndicesMoved`` per move, ``TransferSubmitted`` and a ``StreamRecorded`` per record, all
    with this event's ``seq``. ``tensors`` hold index values only where ``sampled``."""

    op: int
    direction: Direction
    stream: str
    io_backend: str
    layout: str
    #: each merged op as queued: (op, node_id, priority, ts_ns), in queue order
    queued: tuple[tuple[int, int, int, NonNeg], ...]
    node_ids: tuple[int, ...] = ()
    tensors: tuple[TensorRef, ...] = ()
    slots_by_pool: tuple[tuple[str, int], ...] = ()
    bytes_by_pool: tuple[tuple[str, int], ...] = ()
    moves: tuple[Moved, ...] = ()
    #: each ``record_stream`` on one of ``tensors``: (its index in ``tensors``, the stream)
    records: tuple[tuple[NonNeg, str], ...] = ()
    producer_id: int = -1
    device: str = ""
    host_indices_on_cpu: tuple[str, ...] = ()
    sidecar_pools: tuple[tuple[str, str], ...] = ()
    #: this op was picked for the full audit (``sampling``): ``tensors`` hold their values
    sampled: bool = False
    #: the pools' occupancy as the submission started: a ``PoolsSampled`` (pool, tier, used, capacity)
    pools: tuple[tuple[str, Tier, Count, Count], ...] = ()
    audit_sample: Share = 0.0


class PoolsSampled(Event, frozen=True, kw_only=True):
    """Slots in use per pool and tier, read from the allocators (the ``metrics`` and
    ``sampling`` profiles, which record no allocation): (pool, tier, used, capacity)."""

    pools: tuple[tuple[str, Tier, Count, Count], ...]
    #: the share of operations the profile audits in full (0: ``metrics``)
    audit_sample: Share = 0.0


class TransferCompleted(Event, frozen=True, kw_only=True):
    op: int
    direction: Direction
    duration_ns: NonNeg
    layer_durations_ns: tuple[int, ...] | None = None


class TransferFailed(Event, frozen=True, kw_only=True):
    op: int
    direction: Direction
    error: str


class IndicesFreed(Event, frozen=True, kw_only=True):
    """An index tensor handed to a pool's free while the ops in ``ops``, in flight, still use
    it: ``tensor`` is the very tensor (or a view of the storage) one of their copies or
    queued operations received, for ``pool`` on ``tier``. The evidence of a use after free
    where the slot values are on the device and not read (no sync): who frees the memory an
    op holds, not which slots. Reported before the free runs."""

    pool: str
    tier: Tier
    ops: tuple[int, ...]
    tensor: TensorRef


class IndicesMisplaced(Event, frozen=True, kw_only=True):
    """An index tensor handed to a pool's free or allocation (``call``: its method) on a
    device other than ``expected``, the device the pool's indices live on: host indices on
    a GPU, device indices on the CPU (SGLang #23427 handed a host pool's free the indices a
    transfer had moved to the GPU). Read from the tensor's device, never its values.
    Reported before the call runs."""

    pool: str
    tier: Tier
    call: str
    expected: str
    tensor: TensorRef


class FreeRefused(Event, frozen=True, kw_only=True):
    """A pool's free (``call``) raised and left its free lists as they were: what it was
    handed (``tensor``, with its values where they were on the CPU) and what it raised
    (``error``), so that a check of the engine's own (a double-free assertion) does not
    take the evidence with it."""

    pool: str
    tier: Tier
    call: str
    tensor: TensorRef
    error: str


class AuditViolation(Event, frozen=True, kw_only=True):
    op: int
    rule: str
    pool: str
    role: str
    detail: str
    stream: str = ""
    direction: str = ""


AnyEvent = (
    PoolCreated
    | SlotsAllocated
    | SlotsFreed
    | AllocationFailed
    | OperationQueued
    | OperationsMerged
    | IndicesMoved
    | StreamRecorded
    | TransferSubmitted
    | TransferCompleted
    | TransferFailed
    | IndicesFreed
    | IndicesMisplaced
    | FreeRefused
    | AuditViolation
    | OpsSubmitted
    | PoolsSampled
)

EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in (
        PoolCreated,
        SlotsAllocated,
        SlotsFreed,
        AllocationFailed,
        OperationQueued,
        OperationsMerged,
        IndicesMoved,
        StreamRecorded,
        TransferSubmitted,
        TransferCompleted,
        TransferFailed,
        IndicesFreed,
        IndicesMisplaced,
        FreeRefused,
        AuditViolation,
        OpsSubmitted,
        PoolsSampled,
    )
}


def expand(ev: OpsSubmitted) -> list[Event]:
    """The events an :class:`OpsSubmitted` stands for, in the order the ``audit`` profile logs
    them, each with its ``seq`` and rank (the queued ops with the ``ts_ns`` they were queued at)."""
    seq, ts, rank, op, direction = ev.seq, ev.ts_ns, ev.rank, ev.op, ev.direction
    out: list[Event] = [
        OperationQueued(
            seq=seq, ts_ns=q_ts, rank=rank, op=q_op, direction=direction, node_id=node, priority=prio, slots_by_pool=()
        )
        for q_op, node, prio, q_ts in ev.queued
    ]
    out.append(
        OperationsMerged(
            seq=seq,
            ts_ns=ts,
            rank=rank,
            op=op,
            merged_ops=tuple(q[0] for q in ev.queued) or (op,),
            direction=direction,
            node_ids=ev.node_ids,
        )
    )
    for m in ev.moves:
        out.append(
            IndicesMoved(
                seq=seq,
                ts_ns=ts,
                rank=rank,
                op=op,
                pool=m.pool,
                role=m.role,
                src_device=m.src_device,
                dst_device=m.dst_device,
                tensor=m.tensor,
                stream=m.stream,
            )
        )
    out.append(
        TransferSubmitted(
            seq=seq,
            ts_ns=ts,
            rank=rank,
            op=op,
            direction=direction,
            stream=ev.stream,
            io_backend=ev.io_backend,
            layout=ev.layout,
            tensors=ev.tensors,
            slots_by_pool=ev.slots_by_pool,
            bytes_by_pool=ev.bytes_by_pool,
            producer_id=ev.producer_id,
            device=ev.device,
            host_indices_on_cpu=ev.host_indices_on_cpu,
            sidecar_pools=ev.sidecar_pools,
        )
    )
    tensors = ev.tensors
    for i, stream in ev.records:
        if i < len(tensors):
            t = tensors[i]
            out.append(
                StreamRecorded(seq=seq, ts_ns=ts, rank=rank, op=op, pool=t.pool, role=t.role, stream=stream, tensor=t)
            )
    if ev.pools:
        out.append(PoolsSampled(seq=seq, ts_ns=ts, rank=rank, pools=ev.pools, audit_sample=ev.audit_sample))
    return out


def expanded(events: Iterable[Event]) -> list[Event]:
    """``events`` with each :class:`OpsSubmitted` replaced by the events it stands for (a list
    that holds none is returned as it is)."""
    events = events if isinstance(events, list) else list(events)
    if not any(type(ev) is OpsSubmitted for ev in events):
        return events
    out: list[Event] = []
    for ev in events:
        if type(ev) is OpsSubmitted:
            out += expand(ev)
        else:
            out.append(ev)
    return out


def runs_from_list(values: Any) -> Runs:
    """Run-length encode ints: ``[3,4,5,9]`` -> ``((3,3),(9,1))``.

    ``values``: a sequence of ints, or a 1-D integer buffer (a numpy view of an index
    tensor, read in place). Compiled: ``hicache_obs._slots.runs_of``.
    """
    return _runs_of(values)


def expand_runs(runs: Runs) -> list[int]:
    """Inverse of :func:`runs_from_list`."""
    out: list[int] = []
    for start, length in runs:
        out.extend(range(start, start + length))
    return out


def runs_len(runs: Runs) -> int:
    """How many slots a run list names."""
    return sum(length for _, length in runs)
