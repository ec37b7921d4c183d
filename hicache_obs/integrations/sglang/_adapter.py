"""Attach the event log to one live SGLang HiCache controller, without editing SGLang.

Everything the adapter reports it observed at a boundary of the real controller:

- ``write_queue`` / ``load_queue`` become list subclasses: an ``append`` is an
  ``OperationQueued``;
- ``start_writing`` / ``start_loading`` are wrapped on the instance: the call is one
  submission (``OperationsMerged``, ``IndicesMoved``, ``TransferSubmitted``,
  ``StreamRecorded``; ``TransferFailed`` when it raises);
- the op-level index move (``_move_write_operation``/``_move_op_indices`` from 0.5.2x,
  ``move_hybrid_indices`` from 0.5.11, ``move_indices(op)`` in 0.5.10) gives the merged
  op and the tensors before and after the move;
- each host pool's copy methods (``backup_from_device_all_layer[_physical]``,
  ``load_to_device_per_layer[_physical]``) give the index tensors each pool's copy
  really received: those are the submission's tensors;
- ``torch.Tensor.record_stream`` is observed process-wide while any controller is
  instrumented (calls from other code pass straight through): a ``StreamRecorded`` is
  emitted only for a record really made, for that tensor and that stream;
- ``ack_write_queue`` / ``ack_load_queue`` become list subclasses: an ack taken out
  (``pop``, ``del``) is a ``TransferCompleted``; so is an ack ``clear()`` takes whose
  ``finish_event`` has completed (the radix tree's blocking write-back check waits for
  each ack, then clears the queue); ``clear()`` inside the controller's ``reset()``
  (wrapped on the instance), or of a copy still running, fails the op (cancelled);
- every allocator method that changes a free list itself (``alloc``, ``_do_alloc``,
  ``alloc_extend``, ``alloc_decode``, ``free``, ``free_page_ids``, ``_release_page_ids``,
  ``clear``, ``restore_state``, the merges of freed pages), on each device allocator and
  host pool, gives ``SlotsAllocated`` / ``SlotsFreed`` of the slots that really left or
  rejoined its free lists in the call (:class:`_FreeList`): a Mamba allocation group's
  batch when it is taken, a deferred free when its group ends, a page allocator's whole
  pages, a ``clear()``'s every slot in use. Where the free lists are in device memory (a
  GPU) the tier is left out instead (``unseen_slot_tiers``). Bound methods of those calls
  that SGLang took before instrumenting (a tree component's ``allocator.free``) are found
  where they are held and hooked there too (:func:`_captured_methods`).

Features are detected on the instance, never by version string; a controller that
lacks one of the required boundaries is refused before anything is changed.
"""

from __future__ import annotations

import gc
import inspect
import logging
import operator
import threading
import time
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from ..._native import (
    AckNote,
    AckQueue,
    AckTaken,
    FinishHook,
    OpQueue,
    QueueCleared,
    Stamp,
    Submission,
    copy_hook,
    device_changes,
    device_of,
    meta_ref,
    move_hook,
    op_tensors,
    place_observers,
    read_free_lists,
    received,
    recorded,
    remove_observers,
    runs_of,
    slot_guard,
    slots_by_pool,
    start_hook,
    submission_event,
    use_refs,
)
from ..._profiles import Profile, Sampler, resolve_profile
from ...core._spec import ANCHOR
from ...errors import IntegrationError
from ...events._log import EventLog
from ...events._schema import (
    D2H,
    H2D,
    FreeRefused,
    IndicesFreed,
    IndicesMisplaced,
    IndicesMoved,
    Moved,
    OperationQueued,
    OperationsMerged,
    OpsSubmitted,
    PoolCreated,
    PoolsSampled,
    SlotsAllocated,
    SlotsFreed,
    StreamRecorded,
    TensorRef,
    TransferCompleted,
    TransferFailed,
    TransferSubmitted,
)
from . import _tensor_facts as facts
from ._record_stream import RECORDS, current
from ._tensor_facts import NO_TORCH_FUNCTION, device_name, tensor_meta, tensor_ref

__all__ = ["Instrumentation", "instrument", "instrumentation_of"]

_log = logging.getLogger("hicache_obs.integrations.sglang")
# controller -> its instrumentation, weakly both ways: the wrappers on the controller keep the
# instrumentation alive exactly as long as the controller
_registry: weakref.WeakKeyDictionary[Any, weakref.ref[Instrumentation]] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


#: id(name) -> (name, its string): SGLang names pools by enum members, whose ``value`` is a
#: Python-level descriptor; each op reads the names of its pool transfers twice or more
_POOL_NAMES: dict[int, tuple[Any, str]] = {}
_NAMES = facts.META_NAMES


def _pool_name(name: Any) -> str:
    hit = _POOL_NAMES.get(id(name))
    if hit is not None and hit[0] is name:
        return hit[1]
    text = str(getattr(name, "value", name))
    if len(_POOL_NAMES) < 256:  # the entry holds ``name``: its id is not reused while cached
        _POOL_NAMES[id(name)] = (name, text)
    return text


class _Resetting(threading.local):
    """Per thread: ``depth`` of the controller's ``reset()`` calls running on it (a class
    default: no failed lookup); ``dropped``, the (direction, ops) its queues' ``clear()`` took."""

    depth: int = 0
    dropped: list[tuple[str, list[Any]]]  # set by the outermost reset()


# ----------------------------------------------------- conversions inside a copy
class _ConversionWatch:
    """While one pool's copy runs: ``.to()``/``.cuda()`` of the index tensors it received.

    SGLang's Mamba host pool moves CPU host indices to the device itself, inside the
    transfer's stream (the new tensor belongs to that stream). The watch puts a ``to`` and
    a ``cuda`` on each received tensor object itself (an instance attribute, which a
    method call finds before the class's method) for the length of the copy call, on this
    thread only, and takes them off again; no other torch call passes through it, so a
    copy costs the same whatever it does inside. Only a description of each new tensor is
    kept, never the tensor; a description that fails goes to ``failed`` (the
    instrumentation's count), never into SGLang's call."""

    METHODS = ("to", "cuda")

    def __init__(
        self,
        pool: str,
        watched: dict[int, tuple[str, torch.Tensor]],
        failed: Callable[[str], None],
        known: frozenset[str] = frozenset(),
        values: bool = True,
    ) -> None:
        self.pool = pool
        self.values = values  # describe a moved tensor with its values (else its metadata only)
        self.watched = watched  # id(tensor) -> (role, tensor)
        # roles whose move this op reported (a copy per layer moves each layer), and those this
        # watch saw (a subclass's torch-function dispatch calls the method a second time)
        self.known = set(known)
        self._failed = failed
        self.moves: list[tuple[str, str, str, TensorRef]] = []
        self.thread = threading.get_ident()
        self._placed: list[tuple[torch.Tensor, str]] = []

    def describe(self, src: torch.Tensor, out: torch.Tensor, role: str) -> None:
        """``src.to()``/``src.cuda()`` returned ``out`` (another tensor, on this thread, for a
        role not known yet: :func:`~hicache_obs._native.conversion_observer` checked): kept
        where it is on another device, its description made here."""
        try:
            with NO_TORCH_FUNCTION():
                before, after = device_of(src, _NAMES, device_name), device_of(out, _NAMES, device_name)
                if after != before:
                    ref = (
                        tensor_ref(out, self.pool, role, after)
                        if self.values
                        else meta_ref(out, self.pool, role, TensorRef, _NAMES, tensor_meta)
                    )
                    self.moves.append((role, before, after, ref))
                    self.known.add(role)
        except Exception:
            self._failed("describe an index tensor a copy moved")

    def __enter__(self) -> _ConversionWatch:
        place_observers(self.watched, self.METHODS, torch.Tensor, self, self._placed)
        return self

    def __exit__(self, *exc: Any) -> None:
        remove_observers(self._placed)


# ------------------------------------------------------------------ submissions
class _Submission(Submission):
    """What one ``start_writing``/``start_loading`` call did, as observed
    (:class:`~hicache_obs._native.Submission`): the merged ops (``queued``, ``queued_ops``),
    the op its move took (``op``), the index tensors its copies received (``uses``, ``copied``)
    and those a copy moved itself (``side_moves``: (pool, role, src device, dst device, new
    tensor)), the ``record_stream`` calls (``records``: (tensor, stream), as made), its acks,
    the pools whose copy took CPU host indices by design (``host_indices_on_cpu``: a staged
    write-back kernel), whether the full audit picked it (``sampled``), the op-level moves
    (``moves``) and each tensor's description (``refs``: (id(tensor), pool, role) -> TensorRef,
    made once)."""

    __slots__ = ()

    def ref(self, t: torch.Tensor, pool: str, role: str) -> TensorRef:
        """``t``'s description in this submission (its values where ``sampled``), made once."""
        key = (id(t), pool, role)
        got = self.refs.get(key)
        if got is None:
            got = self.refs[key] = (
                tensor_ref(t, pool, role) if self.sampled else meta_ref(t, pool, role, TensorRef, _NAMES, tensor_meta)
            )
        return got


class _EndState:
    """What a submission's end reads and updates besides the submission (``metrics``,
    ``sampling``; :class:`~hicache_obs._native.FinishHook`): when a submission last carried the
    pools' occupancy, what :func:`~hicache_obs._native.submission_event` reads (made again
    when a sidecar pool joins), and the findings' sync :meth:`Instrumentation.make_findings_durable`
    asked for."""

    __slots__ = ("durable", "event_setup", "pools_at")

    def __init__(self, event_setup: tuple[Any, ...]) -> None:
        self.pools_at = -POOLS_EVERY_NS
        self.event_setup = event_setup
        self.durable: tuple[Callable[[], int], Callable[[], None]] | None = None


@dataclass(slots=True)
class _Held:
    """A device index tensor an in-flight op received, held weakly (an op must not keep its
    tensors alive: that would hide a missing record), with the memory it spans: while it is
    alive, no other tensor's storage can be there."""

    pool: str
    ref: weakref.ref[torch.Tensor]
    lo: int
    hi: int


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a tensor's elements occupy, ``[lo, hi)`` (metadata only: no values read)."""
    size = t.element_size()
    lo = hi = t.data_ptr()
    for n, stride in zip(t.shape, t.stride()):
        if n > 1:
            reach = (n - 1) * stride * size
            if reach < 0:
                lo += reach
            else:
                hi += reach
    return lo, hi + size


@dataclass
class _PoolHooks:
    """Where one pool's copies and allocations can be observed."""

    name: str
    host: Any  # the host pool: copies, and host slot allocation
    device: Any  # the device allocator: capacity and free list
    # (object, alloc attribute, free attribute): the allocator itself, and the entry's bound
    # methods when the controller calls those (captured before instrumenting)
    device_hooks: list[tuple[Any, str, str]]


@dataclass
class _Shape:
    """The boundaries found on one controller."""

    streams: dict[str, tuple[Any, str]]  # direction -> (owner, attribute)
    move: list[str]  # op-level move method names
    move_takes_op: bool
    pools: list[_PoolHooks]
    copy: dict[str, str]  # direction -> host pool method name
    io_backend: str
    layout: str
    # host pool group entries that move with the anchor's slots (no device allocator of their
    # own: a draft model's KV), by pool name -> host pool
    sidecars: dict[str, Any] = field(default_factory=dict)


def _detect(c: Any) -> _Shape:
    missing: list[str] = []
    for name in ("write_queue", "load_queue", "ack_write_queue", "ack_load_queue"):
        if not isinstance(getattr(c, name, None), list):
            missing.append(f"{name} (a list)")
    for name in ("start_writing", "start_loading", "mem_pool_host", "mem_pool_device_allocator", "io_backend"):
        if getattr(c, name, None) is None:
            missing.append(name)
    engine = getattr(c, "l2_transfer_engine", None)
    if engine is not None and hasattr(engine, "device_to_host_stream"):
        streams = {D2H: (engine, "device_to_host_stream"), H2D: (engine, "host_to_device_stream")}
        copy = _PHYSICAL_COPY
    elif hasattr(c, "write_stream") and hasattr(c, "load_stream"):
        streams = {D2H: (c, "write_stream"), H2D: (c, "load_stream")}
        copy = _PLAIN_COPY
    else:
        missing.append("write_stream/load_stream or l2_transfer_engine.device_to_host_stream/host_to_device_stream")
        streams, copy = {}, {}
    if callable(getattr(c, "_move_write_operation", None)) and callable(getattr(c, "_move_op_indices", None)):
        move, takes_op = ["_move_write_operation", "_move_op_indices"], True
    elif callable(getattr(c, "move_hybrid_indices", None)):
        move, takes_op = ["move_hybrid_indices"], True
    elif callable(getattr(c, "move_indices", None)):
        params = [p for p in inspect.signature(c.move_indices).parameters.values() if p.default is p.empty]
        # move_indices(op) (0.5.10), or move_indices(host, device): the merged op is then
        # read off the queue (one op) or is the one the merge just made (the newest id)
        move, takes_op = ["move_indices"], len(params) == 1
        if len(params) not in (1, 2):
            missing.append("an index move (_move_op_indices, move_hybrid_indices or move_indices)")
    else:
        move, takes_op = [], False
        missing.append("move_indices")
    host = getattr(c, "mem_pool_host", None)
    pools: list[_PoolHooks] = []
    sidecars: dict[str, Any] = {}
    allocator = getattr(c, "mem_pool_device_allocator", None)
    allocator = getattr(allocator, "full_attn_allocator", allocator)
    entries = getattr(host, "entries", None)
    if entries is not None:
        anchor: Any = getattr(host, "anchor_entry", None)
        entry: Any
        for entry in entries:
            name = _pool_name(entry.name)
            if entry is anchor:
                pools.append(_PoolHooks(name, entry.host_pool, allocator, [(allocator, "alloc", "free")]))
            elif getattr(entry, "device_alloc_fn", None) is not None:
                owner = getattr(entry.device_alloc_fn, "__self__", None)
                hooks = [(entry, "device_alloc_fn", "device_free_fn")]
                if owner is not None and getattr(entry.device_free_fn, "__self__", None) is owner:
                    hooks.insert(0, (owner, "alloc", "free"))
                pools.append(
                    _PoolHooks(name, entry.host_pool, owner if owner is not None else entry.device_pool, hooks)
                )
            elif _is_sidecar(entry):
                sidecars[name] = entry.host_pool
            else:
                pools.append(
                    _PoolHooks(name, entry.host_pool, entry.device_pool, [(entry.device_pool, "alloc", "free")])
                )
    elif host is not None:
        pools.append(_PoolHooks(ANCHOR, host, allocator, [(allocator, "alloc", "free")]))
    if (
        copy is _PHYSICAL_COPY
        and pools
        and not any(callable(getattr(p.host, m, None)) for p in pools for m in _PHYSICAL_COPY.values())
    ):
        copy = _PLAIN_COPY  # an L2 transfer engine over host pools that copy by the older names
    for p in pools:
        for meth in copy.values():
            if not callable(getattr(p.host, meth, None)):
                missing.append(f"{type(p.host).__name__}.{meth} (pool {p.name!r})")
        for obj, a, f, what in [(p.host, "alloc", "free", "host")] + [(*h, "device") for h in p.device_hooks]:
            if not (callable(getattr(obj, a, None)) and callable(getattr(obj, f, None))):
                missing.append(f"{a}/{f} of pool {p.name!r} ({what}: {type(obj).__name__})")
    draft = getattr(c, "mem_pool_host_draft", None)
    if getattr(c, "has_draft", False) and draft is not None:  # 0.5.12, 0.5.13: set_draft_kv_pool
        sidecars[DRAFT] = draft
    for name, pool in sidecars.items():
        if not all(callable(getattr(pool, m, None)) for m in _copy_names(pool, copy).values()):
            missing.append(f"the copy methods of pool {name!r} ({type(pool).__name__})")
    if missing:
        raise IntegrationError(
            f"cannot instrument {type(c).__module__}.{type(c).__name__}: it lacks " + "; ".join(missing)
        )
    return _Shape(streams, move, takes_op, pools, copy, str(c.io_backend), str(getattr(host, "layout", "")), sidecars)


#: A host pool's copy methods by direction: under the L2 transfer engine (0.5.2x), and the older names.
_PHYSICAL_COPY = {D2H: "backup_from_device_all_layer_physical", H2D: "load_to_device_per_layer_physical"}
_PLAIN_COPY = {D2H: "backup_from_device_all_layer", H2D: "load_to_device_per_layer"}


#: The pool name of a draft model's KV registered with ``set_draft_kv_pool`` (SGLang 0.5.12, 0.5.13).
DRAFT = "draft"


def _is_sidecar(entry: Any) -> bool:
    """A host pool group entry that moves with the anchor's slots: its device side has no
    allocator of its own (SGLang 0.5.23's draft KV entry, filled from the KV indices)."""
    device = getattr(entry, "device_pool", None)
    return getattr(entry, "device_alloc_fn", None) is None and not (
        callable(getattr(device, "alloc", None)) and callable(getattr(device, "free", None))
    )


def _copy_names(pool: Any, copy: dict[str, str]) -> dict[str, str]:
    """The copy methods of a host pool by direction: the controller's names where the pool has
    them, else the plain ones (a base-class draft copy)."""
    if all(callable(getattr(pool, m, None)) for m in copy.values()):
        return copy
    return _PLAIN_COPY


def _slot_calls(allocator: Any) -> list[str]:
    """The calls of :data:`_SLOT_CALLS` that ``allocator`` has."""
    return [name for name in _SLOT_CALLS if callable(getattr(allocator, name, None))]


def _captured_methods(
    allocators: list[tuple[Any, list[str], set[int]]],
) -> list[tuple[list[tuple[Any, Any, str]], list[tuple[str, str]]]]:
    """Where bound methods ``allocator.<name>`` were kept before instrumenting, for each
    ``(allocator, names, handled)``: SGLang's tree components keep ``allocator.free`` from
    when they were built, so a hook put on the allocator afterwards would never see those
    calls. For each allocator: ``(holder, key, name)`` for every place the adapter can
    rebind (a dict entry, an instance attribute, a list item, a closure cell with key None;
    ``handled``: ids of dicts hooked another way), and ``(name, holder type)`` for every
    place it cannot (a tuple, a slot, a C object). Two passes over the heap in all."""
    funcs: dict[int, dict[Any, str]] = {}
    for allocator, names, _ in allocators:
        table = funcs.setdefault(id(allocator), {})
        for name in names:
            f = inspect.getattr_static(type(allocator), name, None)
            f = getattr(f, "__func__", f)
            if f is not None:
                table[f] = name
    out: list[tuple[list[tuple[Any, Any, str]], list[tuple[str, str]]]] = [([], []) for _ in allocators]
    if not allocators:
        return out
    methods = [
        r
        for r in gc.get_referrers(*[a for a, _, _ in allocators])
        if type(r) is types.MethodType and r.__func__ in funcs.get(id(r.__self__), ())
    ]
    if not methods:
        return out
    ids: dict[int, Any] = {id(m): m for m in methods}
    slot = {id(a): i for i, (a, _, _) in enumerate(allocators)}

    def one(v: Any) -> bool:
        return ids.get(id(v), ids) is v

    def put(m: Any, holder: Any, key: Any) -> None:
        i = slot[id(m.__self__)]
        if key is not None and isinstance(holder, dict) and id(holder) in allocators[i][2]:
            return  # an entry the adapter hooks by its attribute
        out[i][0].append((holder, key, funcs[id(m.__self__)][m.__func__]))

    for holder in gc.get_referrers(*methods):
        if holder is methods or holder is ids or isinstance(holder, (types.FrameType, types.FunctionType)):
            continue  # this function's own tables, or a running call's local
        if isinstance(holder, dict):
            for k, v in list(holder.items()):
                if one(v):
                    put(v, holder, k)
        elif isinstance(holder, list):
            for k, v in enumerate(holder):
                if one(v):
                    put(v, holder, k)
        elif isinstance(holder, types.CellType):
            put(holder.cell_contents, holder, None)
        elif isinstance(getattr(holder, "__dict__", None), dict) and any(one(v) for v in vars(holder).values()):
            d = vars(holder)  # an instance whose attributes live in the object (no dict of its own yet)
            for k, v in list(d.items()):
                if one(v):
                    put(v, d, k)
        else:
            for m in methods:
                if _holds(holder, m):
                    out[slot[id(m.__self__)]][1].append((funcs[id(m.__self__)][m.__func__], type(holder).__name__))
    return out


def _holds(holder: Any, method: Any) -> bool:
    return any(r is method for r in gc.get_referents(holder))


def _capacity(obj: Any, tier: str) -> tuple[int, int]:
    """(capacity in slots, page size) of an allocator or host pool."""
    page = int(getattr(obj, "page_size", 1) or 1)
    size = getattr(obj, "size", None)
    if not isinstance(size, int):
        raise IntegrationError(f"{type(obj).__name__} has no integer 'size' to size pool tables from")
    if tier == "device" and hasattr(obj, "free_pages"):
        return size + page, page  # pages 1..n: page 0 is the padding slot
    return (size + 1 if tier == "device" else size), page


#: An allocator's free lists, as SGLang's allocators name them: the list allocations take
#: from first, then the lists frees wait in (a list of tensors has its allocator's count of
#: what it holds), by whether they hold pages or slots.
_FREE_LIST_NAMES: tuple[tuple[bool, tuple[tuple[str, str | None], ...]], ...] = (
    (True, (("free_pages", None), ("release_pages", None), ("staged_pages", "num_staged_pages"))),
    (False, (("free_slots", None), ("release_slots", "num_release_slots"))),
)

#: The allocator methods that change a free list themselves (the others reach one through
#: these), by what their call says of the slots: ``out`` the slots it returns, ``take`` none
#: (an extend or decode allocation returns tokens, some in pages it had already), ``slots``
#: / ``pages`` the slots or pages it is given; ``reset`` the free lists are compared.
_SLOT_CALLS: dict[str, str] = {
    "alloc": "out",
    "_do_alloc": "out",
    "alloc_extend": "take",
    "alloc_decode": "take",
    "free": "slots",
    "free_page_ids": "pages",
    "_release_page_ids": "pages",
    "clear": "reset",
    "restore_state": "reset",
    "merge_and_sort_free": "reset",
    "_merge_release_slots": "reset",
}

_RLOCK = type(threading.RLock())
_NO_RUNS: tuple[tuple[int, int], ...] = ()


def _free_lists(obj: Any) -> tuple[bool, list[Any]] | None:
    """An allocator's free lists: (whether they hold pages, their parts: tensors or lists) for
    the lists it keeps (:data:`_FREE_LIST_NAMES`); None if it keeps none we know."""
    for is_pages, names in _FREE_LIST_NAMES:
        if not hasattr(obj, names[0][0]):
            continue
        parts: list[Any] = []
        for name, _ in names:
            v = getattr(obj, name, None)
            parts.extend(v if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor) else [v])
        return is_pages, [p for p in parts if p is not None]
    return None


def _free_lists_on_device(obj: Any) -> bool:
    """Whether an allocator keeps its free lists in device memory (a GPU): then the index
    tensors it hands out are there too, and reading their values would sync."""
    found = _free_lists(obj)
    return found is not None and any(isinstance(p, torch.Tensor) and facts.host_values(p) is None for p in found[1])


def _free_lists_elsewhere(obj: Any) -> bool:
    """Whether an allocator names a free list but holds none (``None``): a composite that
    hands out slots from allocators of its own (SGLang's SWA allocator, whose lists are its
    full and SWA allocators')."""
    return any(hasattr(obj, names[0][0]) and getattr(obj, names[0][0]) is None for _, names in _FREE_LIST_NAMES)


def _list_device(obj: Any) -> str | None:
    """The device of an allocator's first free list, as its tensor reports it: where the
    indices its free and allocation calls take belong (None: no tensor to tell)."""
    found = _free_lists(obj)
    part = next((p for p in found[1] if isinstance(p, torch.Tensor)), None) if found else None
    if part is None:
        return None
    with NO_TORCH_FUNCTION():
        return device_name(part)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


def _handed_indices(kind: str, original: Callable[..., Any]) -> Callable[..., Any] | None:
    """How to find the index tensor a slot call is handed: a free's indices (its first
    tensor), an allocation's ``last_loc`` (the slot each request ends at); None for calls
    handed none (an allocation by count, a reset). An allocation's lengths are not indices:
    SGLang passes some on the CPU by design (``seq_lens_cpu``)."""
    if kind in ("slots", "pages"):
        return _first_tensor
    if kind != "take":
        return None
    try:
        names = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return None
    if "last_loc" not in names:
        return None
    at = names.index("last_loc")

    def last_loc(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return kwargs.get("last_loc", args[at] if len(args) > at else None)

    return last_loc


def _values(part: Any) -> Any:
    """A free list part's values as a 1-D int64 array (a tensor in host memory, or a list)."""
    if isinstance(part, torch.Tensor):
        values = facts.host_values(part)
        if values is None:
            raise IntegrationError("an allocator's free list is in device memory: its slots cannot be read")
        return values
    return np.asarray(part, dtype=np.int64).reshape(-1)


class _FreeList:
    """One allocator's free lists, read around each call that can change them: what the call
    took off them or put back is what its events say, whatever the call returned.

    SGLang's allocators rebind their free lists (a slice when they allocate, a concatenation
    when they free) and only append to a list of freed parts, so a read keeps references and
    lengths, never values: :meth:`read` is a few attribute reads. :meth:`settle` compares two
    reads: where the free count did not change and nothing was rebound, the call changed
    nothing (an allocation out of a Mamba group's batch, a free deferred to its group's end);
    else the call's own evidence is taken where its count is what left or rejoined the lists
    (an allocation's result, a free's slots, or the pages of a page allocator's free), or
    what the front of the first list lost (it is a slice of what it was); else the free
    lists before and after are compared slot by slot (a ``clear()``, a merge).

    Calls are serialized on the allocator's own reentrant lock where it has one (SGLang's
    host pools), else on one of the watch's, so that a read before and after a call sees
    that call only; :attr:`depth` marks the outermost of nested calls, the one reported."""

    __slots__ = ("depth", "head", "lock", "obj", "page", "rest", "units")

    def __init__(self, obj: Any, capacity: int) -> None:
        found = next(((pages, names) for pages, names in _FREE_LIST_NAMES if hasattr(obj, names[0][0])), None)
        if found is None:
            raise IntegrationError(
                f"{type(obj).__name__} keeps no free list the adapter knows (free_pages or free_slots): "
                "its slots in use cannot be read"
            )
        is_pages, names = found
        self.obj = obj
        self.page = int(getattr(obj, "page_size", 1) or 1) if is_pages else 1
        self.units = -(-capacity // self.page)  # pages (or slots) the allocator can hold
        self.head = names[0][0]
        self.rest = tuple((name, counter) for name, counter in names[1:] if hasattr(obj, name))  # set up front
        lock = getattr(obj, "lock", None)
        self.lock: Any = lock if isinstance(lock, _RLOCK) else threading.RLock()
        self.depth = 0

    def read(self) -> tuple[Any, tuple[Any, ...], int]:
        """(the first list, the others: a tensor, ``(list, its length)`` or None, how many
        pages or slots they hold; :func:`~hicache_obs._native.read_free_lists`). Read with
        torch function dispatch off."""
        return read_free_lists(self.obj, self.head, self.rest, torch.Tensor)  # type: ignore[no-any-return]

    @staticmethod
    def _same_rest(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
        """Whether two reads' other lists are the same objects (a list of parts: as long)."""
        for x, y in zip(a, b):
            if x is not y and not (type(x) is type(y) is tuple and x[0] is y[0] and x[1] == y[1]):
                return False
        return True

    @staticmethod
    def _front_taken(was: Any, now: Any, n: int) -> bool:
        """Whether ``now`` is ``was`` without its first ``n`` values: a view of the same memory
        (``was`` is alive, so nothing else can be there) or, all of it taken, empty."""
        if not (isinstance(was, torch.Tensor) and isinstance(now, torch.Tensor)) or was.numel() - now.numel() != n:
            return False
        if not now.numel():
            return True
        step = was.element_size()
        return now.stride() == was.stride() == (1,) and now.data_ptr() == was.data_ptr() + step * n

    def mask(self, state: tuple[Any, tuple[Any, ...], int]) -> np.ndarray:
        """Which pages (or slots) the free lists of ``state`` hold."""
        free = np.zeros(self.units, dtype=bool)
        head, rest, _ = state
        parts = [head]
        for part in rest:
            if type(part) is tuple:
                parts.extend(part[0][: part[1]])
            elif part is not None:
                parts.append(part)
        for part in parts:
            values = _values(part)
            free[values[(values >= 0) & (values < self.units)]] = True
        return free

    def slot_runs(self, units: Any) -> Any:
        """Slot runs of an array of pages (or slots)."""
        return self._slots_of(runs_of(np.ascontiguousarray(units, dtype=np.int64)))

    def _slots_of(self, runs: Any) -> Any:
        """The slot runs of runs of pages (or slots)."""
        p = self.page
        return runs if p == 1 else tuple((s * p, n * p) for s, n in runs)

    def _given(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The slots a free's index tensors name, as its allocator frees them (a page
        allocator frees each page of the slots it is given once), or None."""
        given = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not given:
            return None
        p = self.page
        if len(given) == 1:
            runs = facts.host_runs(given[0])
            if runs is not None:
                if kind == "pages":  # page ids: the slots of each page
                    return self._slots_of(runs)
                if p == 1 or all(s % p == 0 and n % p == 0 for s, n in runs):
                    return runs  # slots, or whole pages (the caller checks they are as many as freed)
        values = np.concatenate([_values(t).reshape(-1) for t in given])
        if kind == "slots":
            values = np.unique(values // p)
        return self.slot_runs(values)

    def settle(
        self,
        before: tuple[Any, tuple[Any, ...], int],
        after: tuple[Any, tuple[Any, ...], int],
        kind: str,
        out: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, Any]:
        """(slots taken off the free lists, slots put back) between two reads."""
        delta = after[2] - before[2]
        if delta == 0:
            if before[0] is after[0] and self._same_rest(before[1], after[1]):
                return _NO_RUNS, _NO_RUNS  # nothing changed
        elif delta < 0:
            if kind == "out" and isinstance(out, torch.Tensor):
                runs = facts.host_runs(out)
                if runs is not None and sum(n for _, n in runs) == -delta * self.page:
                    return runs, _NO_RUNS
            if self._front_taken(before[0], after[0], -delta) and self._same_rest(before[1], after[1]):
                return self.slot_runs(_values(before[0])[:-delta]), _NO_RUNS  # in the order taken
        elif kind in ("slots", "pages"):
            runs = self._given(kind, args, kwargs)
            if runs is not None and sum(n for _, n in runs) == delta * self.page:
                return _NO_RUNS, runs
        was, now = self.mask(before), self.mask(after)
        return self.slot_runs(np.flatnonzero(was & ~now)), self.slot_runs(np.flatnonzero(now & ~was))


# ------------------------------------------------------------- instrumentation
_I = TypeVar("_I", bound="Instrumentation")

#: How often (ns) a submission carries the pools' occupancy under ``metrics`` and ``sampling``.
POOLS_EVERY_NS = 50_000_000


class Instrumentation:
    """One instrumented SGLang controller: its event ``log`` and ``detach()``."""

    _compiled_end = True  # metrics and sampling end a submission with FinishHook (see _finisher)

    def __init__(self, controller: Any, log: EventLog, shape: _Shape, profile: Profile | None = None) -> None:
        self.controller = controller
        self.log = log
        self.rank = log.rank
        self._shape = shape
        self.profile = profile if profile is not None else resolve_profile("audit")
        self._full = self.profile.full
        self._sampler = Sampler(self.profile.audit_sample if not self._full else 0.0)
        # metrics and sampling: id(op) -> when it was queued; (pool, tier, free lists, capacity) read for occupancy
        self._queued_at: dict[int, int] = {}
        self._usage: list[tuple[str, str, _FreeList, int]] = []
        self._blind: list[tuple[Any, list[Any]]] = []  # device pools whose frees meet the held tensors
        self._armed: list[Callable[[], None]] | None = None  # sampling: the free hooks in place, their undo
        self._lock = threading.RLock()
        self._undo: list[Callable[[], None]] = []
        self._pending: dict[int, tuple[int, str]] = {}  # id(ack) -> (its op, the op's direction)
        self._stream_names: dict[int, str] = {}
        self._slot_bytes: dict[str, int] = {}
        self._unseen: set[tuple[str, str]] = set()
        self._watches: dict[tuple[str, str], _FreeList] = {}  # (pool, tier) -> its allocator's free lists
        self._resetting = _Resetting()  # depth: inside the controller's reset() on this thread
        self._detached = False
        self._errors = 0
        self._finalizer: weakref.finalize | None = None  # releases the record_stream observer if never detached
        # op in flight -> its device index tensors whose values the log does not hold (never
        # read: no sync), weakly, with the memory they span: a free handed one of them is the
        # evidence of a use after free (IndicesFreed)
        self._held: dict[int, list[_Held]] = {}
        self._durable_seen = 0
        self._sidecars: dict[str, Any] = {}  # pool -> host pool: moves with the anchor's slots
        self._sidecar_pools: tuple[tuple[str, str], ...] = ()  # each op's sidecar_pools: (pool, ANCHOR), by name
        dev = str(getattr(controller, "device", "cpu"))
        self._device = (dev if ":" in dev else f"{dev}:0") if dev.startswith(("cuda", "xpu")) else dev
        self._end = _EndState(self._make_event_setup())

    @staticmethod
    def _lists_in_device_memory(obj: Any) -> bool:
        """Whether a device pool's allocator keeps its free lists in device memory (a GPU's),
        where a read would sync: its tier is then left unseen (:attr:`unseen_slot_tiers`)."""
        return _free_lists_on_device(obj)

    def _make_event_setup(self) -> tuple[Any, ...]:
        """What :func:`~hicache_obs._native.submission_event` reads besides the submission
        (made again when a sidecar pool joins: every op names it)."""
        return (
            self._shape.streams,
            self._stream_names,
            self._shape.io_backend,
            self._shape.layout,
            self._device,
            self._sidecar_pools,
            self.profile.audit_sample,
            self._slot_bytes,
            self._queued_at,
            ANCHOR,
            _POOL_NAMES,
            _pool_name,
            Moved,
            H2D,
        )

    # ------------------------------------------------------------- public
    @property
    def errors(self) -> int:
        """Events that could not be appended to the log (logged; the controller carried on)."""
        return self._errors

    def _emit(self, cls: Any, **fields: Any) -> None:
        """Append an event; a failure is counted and logged, never raised into SGLang."""
        try:
            self.log.emit(cls, **fields)
        except Exception:
            self._failed(f"record a {cls.__name__} event")

    def _failed(self, what: str) -> None:
        """Count an observation that failed (in an ``except`` block); log the first and every 10,000th."""
        self._errors += 1
        if self._errors == 1 or self._errors % 10000 == 0:
            _log.exception("hicache-obs could not %s (%d errors so far)", what, self._errors)

    def make_findings_durable(self, count: Callable[[], int], flush: Callable[[], None]) -> None:
        """After each observed call that revealed a finding (``count()``, the findings so far,
        grew), ``flush()`` runs before the call returns into SGLang: the launcher writes the
        log to its files then, so a finding is on disk before SGLang's own assertion (which
        may follow at once) ends the process."""
        self._durable_seen = count()
        self._end.durable = (count, flush)

    def _sync_findings(self) -> None:
        durable = self._end.durable
        if durable is None:
            return
        try:
            n = durable[0]()
            if n != self._durable_seen:
                self._durable_seen = n
                durable[1]()
        except Exception:
            self._failed("write the log after a finding")

    @property
    def detached(self) -> bool:
        return self._detached

    @property
    def sampled(self) -> tuple[int, int]:
        """(submissions picked for the full audit, submissions seen) under ``sampling``."""
        return self._sampler.taken, self._sampler.seen

    def pool_usage(self) -> tuple[tuple[str, str, int, int], ...]:
        """(pool, tier, slots in use, capacity) of each pool tier whose allocator keeps its free
        lists in host memory, read from the allocators now (their counts: no value is read)."""
        out = []
        with NO_TORCH_FUNCTION():
            for pool, tier, watch, cap in self._usage:
                used = (watch.units - watch.read()[2]) * watch.page
                out.append((pool, tier, min(max(used, 0), cap), cap))
        return tuple(out)

    def sample_pools(self) -> None:
        """Log a ``PoolsSampled`` of :meth:`pool_usage` (``metrics`` and ``sampling``; the
        ``audit`` profile logs every allocation instead). A submission carries one at most every 50 ms (``POOLS_EVERY_NS``)."""
        if self._full or not self._usage or self._detached:
            return
        try:
            self.log.emit(PoolsSampled, pools=self.pool_usage(), audit_sample=self.profile.audit_sample)
        except Exception:
            self._failed("record a PoolsSampled event")

    @property
    def unseen_slot_tiers(self) -> frozenset[tuple[str, str]]:
        """The ``(pool, tier)`` whose slots this instrumentation does not record: a device
        tier whose allocator keeps its free lists on a GPU (reading an index tensor there
        would sync), or keeps none itself (a composite handing out its sub-allocators'
        slots, which the adapter cannot tell apart). No ``PoolCreated``, ``SlotsAllocated``
        or ``SlotsFreed`` is reported for them, so the slot rules and the occupancy
        metrics leave them out."""
        return frozenset(self._unseen)

    def detach(self) -> None:
        """Restore the controller exactly as it was (``metrics``, ``sampling``: after a last
        ``PoolsSampled``). Idempotent."""
        if not self._detached:
            self.sample_pools()
        with _registry_lock:
            if self._detached:
                return
            self._detached = True
            self._disarm()
            for undo in reversed(self._undo):
                undo()
            self._undo.clear()
            _registry.pop(self.controller, None)
        if self._finalizer is not None and self._finalizer.detach() is not None:
            RECORDS.release()

    def __enter__(self) -> Instrumentation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ------------------------------------------------------------- wiring
    @classmethod
    def attach(
        cls: type[_I],
        controller: Any,
        *,
        log: EventLog | None = None,
        rank: int | None = None,
        profile: Profile | None = None,
    ) -> _I:
        """Instrument ``controller`` as an instance of this class (what :func:`instrument`
        does once it checked its arguments): refused with
        :class:`~hicache_obs.errors.IntegrationError`, nothing changed, where the controller
        is instrumented already or of a shape the adapter does not know; ``log`` is a new
        :class:`EventLog` for the controller's TP rank (or ``rank``) unless given."""
        with _registry_lock:
            if controller in _registry:
                raise IntegrationError(f"this {type(controller).__name__} is already instrumented; detach() it first")
            shape = _detect(controller)
            if log is None:
                log = EventLog(rank=_rank_of(controller) if rank is None else rank)
            inst = cls.attach_to(controller, log, shape, profile)
            _registry[controller] = weakref.ref(inst)
        inst.hold_record_stream_observer()
        return inst

    @classmethod
    def attach_to(cls: type[_I], controller: Any, log: EventLog, shape: _Shape, profile: Profile | None = None) -> _I:
        """Instrument ``controller`` (of ``shape``) into ``log``; on any failure every change
        made so far is undone before the error propagates."""
        inst = cls(controller, log, shape, profile)
        try:
            inst._attach()
        except BaseException:
            for undo in reversed(inst._undo):
                undo()
            raise
        return inst

    def hold_record_stream_observer(self) -> None:
        """Hold the process-wide ``record_stream`` observer until :meth:`detach`, or until
        the controller is collected without one."""
        RECORDS.acquire()
        self._finalizer = weakref.finalize(self.controller, RECORDS.release)

    def _attach(self) -> None:
        c, shape = self.controller, self._shape
        for owner, attr in shape.streams.values():
            self._stream_names[id(getattr(owner, attr))] = attr
        for p in shape.pools:
            name = p.name
            self._slot_bytes[name] = int(getattr(p.host, "size_per_token", 0) or 0)
            for obj, tier in ((p.device, "device"), (p.host, "host")):
                if tier == "device" and (self._lists_in_device_memory(obj) or _free_lists_elsewhere(obj)):
                    self._unseen.add((name, tier))
                    continue
                cap, page = _capacity(obj, tier)
                try:
                    watch = _FreeList(obj, cap)
                except IntegrationError as exc:
                    raise IntegrationError(f"pool {name!r} ({tier}): {exc}") from None
                if not self._full:  # occupancy read from the free lists' counts, no allocation observed
                    self._usage.append((name, tier, watch, cap))
                    continue
                self._watches[(name, tier)] = watch
                self._emit(
                    PoolCreated,
                    pool=name,
                    tier=tier,
                    capacity=cap,
                    page_size=page,
                    slot_bytes=self._slot_bytes[name],
                    layout=shape.layout if tier == "host" else "layer_first",
                )
                self._adopt_allocations(watch, name, tier)
        # queues and acks
        # each hook guards itself (an error is counted, never raised into SGLang): a queue's
        # append is one call into the adapter
        for attr, direction in (("write_queue", D2H), ("load_queue", H2D)):
            on_append = partial(self._queued, direction) if self._full else Stamp(self._queued_at, time.time_ns)
            queue = OpQueue(getattr(c, attr), on_append, self._on_cleared(direction))
            self._swap_list(c, attr, queue)
        for attr, direction in (("ack_write_queue", D2H), ("ack_load_queue", H2D)):
            acks = AckQueue(
                getattr(c, attr),
                on_append=AckNote(current, direction, self._failed),
                on_taken=self._on_taken(direction),
                on_cleared=partial(self._ack_cleared, direction),
            )
            self._swap_list(c, attr, acks)
        if callable(getattr(c, "reset", None)):
            self._wrap(c, "reset", self._reset_wrapper)
        self._wrap(c, "start_writing", self._submission_wrapper(D2H))
        self._wrap(c, "start_loading", self._submission_wrapper(H2D))
        for name in shape.move:
            self._wrap(c, name, self._move_wrapper(shape.move_takes_op))
        for name, pool in shape.sidecars.items():
            self._add_sidecar(name, pool)
        if callable(getattr(c, "set_draft_kv_pool", None)):
            self._wrap(c, "set_draft_kv_pool", self._registration_wrapper)
        if callable(getattr(c, "register_host_pool_entry", None)):
            self._wrap(c, "register_host_pool_entry", self._registration_wrapper)
        for p in shape.pools:
            for meth in shape.copy.values():
                self._wrap(p.host, meth, self._copy_wrapper(p.name, p.host))
        watched = [(p.name, "host", [(p.host, "alloc", "free")]) for p in shape.pools] + [
            (p.name, "device", p.device_hooks) for p in shape.pools if (p.name, "device") not in self._unseen
        ]
        # a device tier whose slots are not read (free lists on a GPU) still has its frees
        # compared with the index tensors of the ops in flight; under ``sampling`` every device
        # tier's are (of the sampled ops), under ``metrics`` none
        blind = [
            p
            for p in shape.pools
            if (p.name, "device") in self._unseen or not self._full
            if callable(getattr(p.device, "free", None))
        ]
        if not self._full:
            watched = []
            if not self.profile.audit_sample:
                blind = []
        # one look for the bound methods SGLang took, before any hook exists: every one found
        # now is SGLang's
        wanted = []
        for pool, tier, hooks in watched:
            obj = self._watches[(pool, tier)].obj
            other = {id(vars(o)) for o, _, _ in hooks if o is not obj and hasattr(o, "__dict__")}
            wanted.append((obj, _slot_calls(obj), other))
        wanted += [(b.device, ["free"], set()) for b in blind]
        captured = _captured_methods(wanted)
        for (pool, tier, hooks), found in zip(watched, captured):
            self._watch_slots(pool, tier, hooks, found)
        self._blind = [(b, places) for b, (places, _) in zip(blind, captured[len(watched) :])]
        if self._full:
            self._hook_frees()
        # sampling: the frees are hooked only while a sampled op is in flight (_arm)

    def _hook_frees(self) -> None:
        """Compare each device free of the blind pools with the tensors of the ops in flight."""
        for b, places in self._blind:
            self._wrap(b.device, "free", self._held_free_wrapper(b.name))
            for obj, _, free_attr in b.device_hooks:
                if obj is not b.device:
                    self._wrap(obj, free_attr, self._held_free_wrapper(b.name))
            for holder, key, _ in places:
                self._rebind(holder, key, b.device.free)

    def _arm(self) -> None:
        """``sampling``: hook the device frees while a sampled op is in flight (a free costs
        nothing otherwise); :meth:`_disarm` when none is."""
        if self._armed is not None or not self._blind or self._detached:
            return
        kept, self._undo = self._undo, []
        try:
            self._hook_frees()
        finally:
            self._armed, self._undo = self._undo, kept

    def _disarm(self) -> None:
        armed, self._armed = self._armed, None
        for undo in reversed(armed or ()):
            undo()

    def _add_sidecar(self, name: str, pool: Any) -> None:
        """A pool that moves with the anchor's slots: its copies are uses of the op (wrapped
        once per pool object), and every op names it in ``sidecar_pools``."""
        if self._sidecars.get(name) is pool:
            return
        self._sidecars[name] = pool
        self._sidecar_pools = tuple((n, ANCHOR) for n in sorted(self._sidecars))
        self._end.event_setup = self._make_event_setup()
        for meth in _copy_names(pool, self._shape.copy).values():
            self._wrap(pool, meth, self._copy_wrapper(name, pool))

    def _registration_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``set_draft_kv_pool`` (0.5.12, 0.5.13) or ``register_host_pool_entry`` (0.5.2x):
        a pool registered after the controller was built (the scheduler adds a draft model's
        KV then); a sidecar among them is followed from its next op on."""

        def register(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            try:
                with self._lock:
                    self._follow_registered()
            except Exception:
                self._failed("follow a pool registered with the controller")
            return out

        register.__wrapped__ = original  # type: ignore[attr-defined]
        return register

    def _follow_registered(self) -> None:
        c = self.controller
        draft = getattr(c, "mem_pool_host_draft", None)
        if getattr(c, "has_draft", False) and draft is not None:
            self._add_sidecar(DRAFT, draft)
        anchor = getattr(c.mem_pool_host, "anchor_entry", None)
        for entry in getattr(c.mem_pool_host, "entries", None) or ():
            if entry is not anchor and _is_sidecar(entry):
                self._add_sidecar(_pool_name(entry.name), entry.host_pool)

    def _watch_slots(
        self,
        pool: str,
        tier: str,
        hooks: list[tuple[Any, str, str]],
        captured: tuple[list[tuple[Any, Any, str]], list[tuple[str, str]]],
    ) -> None:
        """Hook every call that changes the free lists of ``pool``'s allocator on ``tier``
        (:data:`_SLOT_CALLS`, those it has), the other objects' allocation and free
        attributes in ``hooks`` (a host pool group entry's bound methods of it), and the
        bound methods of it that SGLang took before (``captured``, :func:`_captured_methods`)."""
        watch = self._watches[(pool, tier)]
        allocator = watch.obj
        alloc, free = self._alloc_wrapper, self._free_wrapper
        make = {"out": alloc, "take": alloc, "slots": free, "pages": free, "reset": self._slots_wrapper}
        for name in _slot_calls(allocator):
            self._wrap_slots(allocator, name, make[_SLOT_CALLS[name]](pool, tier), watch)
        for obj, alloc_attr, free_attr in hooks:
            if obj is not allocator:
                self._wrap_slots(obj, alloc_attr, self._alloc_wrapper(pool, tier), watch)
                self._wrap_slots(obj, free_attr, self._free_wrapper(pool, tier), watch)
        found, blind = captured
        for holder, key, name in found:
            self._rebind(holder, key, getattr(allocator, name))
        if blind:
            _log.warning(
                "hicache-obs cannot see calls made through %s of pool %r (%s): held by %s, which it cannot rebind",
                ", ".join(sorted({f"{type(allocator).__name__}.{n}" for n, _ in blind})),
                pool,
                tier,
                ", ".join(sorted({h for _, h in blind})),
            )

    def _rebind(self, holder: Any, key: Any, hook: Callable[..., Any]) -> None:
        """Put ``hook`` where a bound method of an allocator, taken before instrumenting, is
        held (``holder[key]``, or a closure cell when ``key`` is None); undone on detach."""
        if key is None:
            original = holder.cell_contents
            holder.cell_contents = hook

            def undo() -> None:
                if holder.cell_contents is hook:
                    holder.cell_contents = original

        else:
            original = holder[key]
            holder[key] = hook

            def undo() -> None:
                try:
                    if holder[key] is hook:
                        holder[key] = original
                except (KeyError, IndexError):
                    pass

        self._undo.append(undo)

    def _adopt_allocations(self, watch: _FreeList, pool: str, tier: str) -> None:
        """Slots already in use when instrumenting (the padding slot, earlier requests)."""
        try:
            with NO_TORCH_FUNCTION():
                in_use = ~watch.mask(watch.read())
        except IntegrationError as exc:
            raise IntegrationError(f"pool {pool!r} ({tier}, {type(watch.obj).__name__}): {exc}") from None
        used = np.flatnonzero(in_use)
        if used.size:
            self._emit(SlotsAllocated, pool=pool, tier=tier, indices=watch.slot_runs(used))

    def _swap_list(self, obj: Any, attr: str, observed: list[Any]) -> None:
        setattr(obj, attr, observed)

        def undo() -> None:
            if getattr(obj, attr) is observed:
                setattr(obj, attr, list(observed))

        self._undo.append(undo)

    def _wrap(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self._set_hook(obj, name, make(getattr(obj, name)))

    def _wrap_slots(
        self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]], watch: _FreeList
    ) -> None:
        """:meth:`_wrap` for a call that can change ``watch``'s free lists: the hook runs for the
        outermost such call only (an allocation's own merge, a group's free inside its end
        pass straight through), one call at a time (``watch.lock``)."""
        original = getattr(obj, name)
        self._set_hook(obj, name, slot_guard(original, make(original), watch, watch.lock))

    def _set_hook(self, obj: Any, name: str, wrapper: Callable[..., Any]) -> None:
        had_own = name in getattr(obj, "__dict__", {})
        original = getattr(obj, name)
        setattr(obj, name, wrapper)

        def undo() -> None:
            if had_own:
                setattr(obj, name, original)
            else:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass

        self._undo.append(undo)

    # ----------------------------------------------------------- wrappers
    def _submission_wrapper(self, direction: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """The controller's start of its write or load queue
        (:func:`~hicache_obs._native.start_hook`): the queued ops as one submission, its
        events once the call returned or raised (:meth:`_finish`)."""
        sampler = None if self._full else self._sampler
        setup = (
            self.controller,
            "write_queue" if direction == D2H else "load_queue",
            _Submission,
            self,
            direction,
            sampler,
            self._finisher(),
        )

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            return start_hook(original, current, setup)

        return make

    def _on_cleared(self, direction: str) -> Callable[[list[Any]], None]:
        """A write or load queue's ``on_cleared``: :meth:`_queue_cleared`, or under ``metrics`` and
        ``sampling`` its compiled usual case (:class:`~hicache_obs._native.QueueCleared`)."""
        cleared = partial(self._queue_cleared, direction)
        if self._full:
            return cleared
        return QueueCleared(cleared, (direction, self._resetting, self._queued_at, current))

    def _on_taken(self, direction: str) -> Callable[[Any], None]:
        """An ack queue's ``on_taken``: :meth:`_ack_taken`, or under ``metrics`` and ``sampling``
        its compiled common case (:class:`~hicache_obs._native.AckTaken`: no op holding device
        tensors, an ack that does not time its copy)."""
        taken = partial(self._ack_taken, direction)
        if self._full:
            return taken
        setup = (self._pending, self._held, self._end, self.log.emit, TransferCompleted, self._failed, self._sync_findings)
        return AckTaken(taken, setup)

    def _finisher(self) -> Callable[[Any, Any, BaseException | None], None]:
        """What ends a submission: :meth:`_finish`, or under ``metrics`` and ``sampling`` its
        compiled common path (:class:`~hicache_obs._native.FinishHook`: an unsampled submission
        that moved its op and returned), :meth:`_finish` the rest. A subclass whose own
        :meth:`_finish` ends every submission (the harness's floor) sets ``_compiled_end`` False."""
        if self._full or not self._compiled_end:
            return self._finish
        setup = (
            self._end,
            self._failed,
            NO_TORCH_FUNCTION,
            TensorRef,
            _NAMES,
            tensor_meta,
            time.time_ns,
            self._usage,
            self.pool_usage,
            POOLS_EVERY_NS,
            self._pending,
            self._sync_findings,
            self.log.emit,
            OpsSubmitted,
        )
        return FinishHook(self._finish, setup)

    def _move_wrapper(self, takes_op: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """The controller's op-level move: the op a submission merged, and the index tensors the
        move put on another device. A move that takes the op runs through
        :func:`~hicache_obs._native.move_hook` (this method's ``move`` where the op comes by
        name); one that takes the anchor's (host, device) pair (``move_indices``) here."""
        setup = (
            self._full,
            self._merged,
            self._report_moves,
            self._failed,
            NO_TORCH_FUNCTION,
            ANCHOR,
            torch.Tensor,
            _POOL_NAMES,
            _pool_name,
            _NAMES,
            device_name,
            Moved,
            TensorRef,
            tensor_meta,
            tensor_ref,
        )

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def move(op: Any, *args: Any, **kwargs: Any) -> Any:
                sub = current.sub
                if sub is None or sub.op is not None:  # outside a submission, or an inner move
                    return original(op, *args, **kwargs)
                if not takes_op:  # move_indices(host, device): the anchor pair of the merged op
                    result = original(op, *args, **kwargs)
                    device = args[0] if args else kwargs["device_indices"]
                    try:
                        sub.op = _merged_view(sub, op, device)
                        self._merged(sub)
                        self._report_moves(
                            sub,
                            {(ANCHOR, "host"): op, (ANCHOR, "device"): device},
                            self._op_tensors(result[0], result[1], None),
                        )
                    except Exception:
                        self._failed("describe an index move")
                    return result
                sub.op = op
                self._merged(sub)
                before = self._op_tensors(op.host_indices, op.device_indices, getattr(op, "pool_transfers", None))
                result = original(op, *args, **kwargs)
                try:
                    host, device = result[0], result[1]
                    transfers = result[2] if len(result) > 2 else getattr(op, "pool_transfers", None)
                    self._report_moves(sub, before, self._op_tensors(host, device, transfers))
                except Exception:
                    self._failed("describe an index move")
                return result

            move.__wrapped__ = original  # type: ignore[attr-defined]
            return move_hook(original, current, move, setup) if takes_op else move

        return make

    def _report_moves(
        self, sub: _Submission, before: dict[tuple[str, str], torch.Tensor], after: dict[tuple[str, str], torch.Tensor]
    ) -> None:
        op = sub.op
        with NO_TORCH_FUNCTION():
            for key, was, now, dst in device_changes(before, after, _NAMES, device_name):
                pool, role = key
                if not self._full:  # carried by the submission's one event
                    sub.moves.append(Moved(pool, role, was, now, sub.ref(dst, pool, role)))  # type: ignore[arg-type]
                    continue
                self._emit(
                    IndicesMoved,
                    op=int(op.id),
                    pool=pool,
                    role=role,
                    src_device=was,
                    dst_device=now,
                    tensor=tensor_ref(dst, pool, role, now),
                )

    def _copy_wrapper(self, pool: str, host_pool: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A host pool's copy (:func:`~hicache_obs._native.copy_hook`): the first call of a
        submission with each pair of index tensors notes them as the op's uses; where one is
        off the device and the io backend is ``kernel``, the copy runs under a
        :class:`_ConversionWatch`, and the first move of each role this pool's copies make in
        the op is kept (a load copies per layer, and each layer's copy converts the same
        indices again). On a ``page_first`` host layout a write's copy may be staged: SGLang's
        host pools then copy with a kernel that addresses host pages from the CPU (device
        pages to a device staging buffer first) when ``can_use_write_back_jit`` is set, read
        at the copy call, and the controller keeps the host indices on the CPU
        (``_move_write_operation``): the pool is noted in the submission's
        ``host_indices_on_cpu``. A failed step of this is counted, never raised into the
        copy."""
        kernel = self._shape.io_backend == "kernel"  # a direct copy reads host indices as they are
        staged = host_pool if kernel and self._shape.layout == "page_first" else None
        setup = (
            _ConversionWatch,
            self._failed,
            torch.Tensor,
            NO_TORCH_FUNCTION,
            _ConversionWatch.METHODS,
            received,
            kernel,
            staged,
            self._full,
            D2H,
        )

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def copy(device_pool: Any, host_indices: Any, device_indices: Any, *args: Any, **kwargs: Any) -> Any:
                # a call with the index tensors by name: bound, and the hook's again
                return hook(device_pool, host_indices, device_indices, *args, **kwargs)

            hook = copy_hook(original, current, pool, copy, setup)
            return hook

        return make

    # Allocations and frees are the adapter's most frequent steps, and they run between
    # copies, with cold caches: each is one call into the adapter, two reads of the
    # allocator's free lists (references and counts), one DLPack read of the index tensor
    # (:func:`facts.host_runs`) and the event. A call that left the free lists as they
    # were gives no event; one that cannot be read is counted and logged.
    def _slots_wrapper(self, pool: str, tier: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A call that can change the free lists of ``pool``'s allocator on ``tier``: its
        ``SlotsFreed`` / ``SlotsAllocated`` are the slots that really rejoined or left them
        (:meth:`_FreeList.settle`). Installed by :meth:`_wrap_slots` (outermost calls only)."""
        log, failed, watch, held = self.log, self._failed, self._watches[(pool, tier)], self._held
        expected = _list_device(watch.obj)

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            call = getattr(original, "__name__", "")
            kind = _SLOT_CALLS.get(call, "reset")
            check = kind == "slots" and tier == "device"
            handed = _handed_indices(kind, original) if expected is not None else None

            def slots(*args: Any, **kwargs: Any) -> Any:
                if check and held:
                    self._check_held(pool, tier, args, kwargs)
                if handed is not None:
                    self._check_device(pool, tier, call, expected or "", handed(args, kwargs))
                try:
                    with NO_TORCH_FUNCTION():
                        before = watch.read()
                except Exception:
                    failed("read an allocator's free lists")
                    return original(*args, **kwargs)
                out = error = None
                try:
                    out = original(*args, **kwargs)
                    return out
                except BaseException as exc:
                    error = exc
                    raise
                finally:  # also what a call that raised changed before it did
                    try:
                        with NO_TORCH_FUNCTION():
                            taken, returned = watch.settle(before, watch.read(), kind, out, args, kwargs)
                        if returned:
                            log.emit(SlotsFreed, pool=pool, tier=tier, indices=returned)
                        if taken:
                            log.emit(SlotsAllocated, pool=pool, tier=tier, indices=taken)
                        if error is not None and kind == "slots" and not returned and not taken:
                            self._refused(pool, tier, call, args, kwargs, error)
                    except Exception:
                        failed("record the slots an allocator call took or returned")
                    if self._end.durable is not None:
                        self._sync_findings()

            slots.__wrapped__ = original  # type: ignore[attr-defined]
            return slots

        return make

    def _held_free_wrapper(self, pool: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A device free whose slots are not read: only compared with the tensors of the ops in
        flight (:meth:`_check_held`)."""
        held = self._held

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            call = getattr(original, "__name__", "free")
            owner = getattr(original, "__self__", None)
            expected = _list_device(owner) if owner is not None and self._full else None

            def free(*args: Any, **kwargs: Any) -> Any:
                if held:
                    self._check_held(pool, "device", args, kwargs)
                if expected is not None:
                    self._check_device(pool, "device", call, expected, _first_tensor(args, kwargs))
                return original(*args, **kwargs)

            free.__wrapped__ = original  # type: ignore[attr-defined]
            return free

        return make

    def _alloc_wrapper(self, pool: str, tier: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """An allocation (``alloc``, ``_do_alloc``, ``alloc_extend``, ``alloc_decode``): see
        :meth:`_slots_wrapper`."""
        return self._slots_wrapper(pool, tier)

    def _free_wrapper(self, pool: str, tier: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A free (``free``, ``free_page_ids``, ``_release_page_ids``): see :meth:`_slots_wrapper`."""
        return self._slots_wrapper(pool, tier)

    def _reset_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The controller's ``reset()``: the acks its queues' ``clear()`` take meanwhile (on
        this thread) are cancelled ops, whatever their copies did; so are the ops it drops
        from its write and load queues, ended when it returns (after those acks, in the
        order the fold reaps them)."""
        local = self._resetting

        def reset(*args: Any, **kwargs: Any) -> Any:
            depth = local.depth
            if not depth:
                local.dropped = []  # (direction, ops) its queues' clear() took
            local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                local.depth = depth
                if not depth:
                    dropped, local.dropped = local.dropped, []
                    for direction, ops in dropped:
                        self._end_dropped(direction, ops)

        reset.__wrapped__ = original  # type: ignore[attr-defined]
        return reset

    # ------------------------------------------------------------- events
    @staticmethod
    def _op_tensors(host: Any, device: Any, transfers: Any) -> dict[tuple[str, str], torch.Tensor]:
        """``{(pool, role): tensor}`` of an op (:func:`~hicache_obs._native.op_tensors`)."""
        return op_tensors(host, device, transfers, ANCHOR, torch.Tensor, _POOL_NAMES, _pool_name)

    @staticmethod
    def _slots_by_pool(op: Any) -> tuple[tuple[str, int], ...]:
        """``((pool, slots), ...)`` an op moves (:func:`~hicache_obs._native.slots_by_pool`)."""
        return slots_by_pool(op, ANCHOR, _POOL_NAMES, _pool_name)  # type: ignore[no-any-return]

    def _queued(self, direction: str, op: Any) -> None:
        """A write or load queue's append (its hook: guards itself)."""
        try:
            with NO_TORCH_FUNCTION():
                node_ids = getattr(op, "node_ids", None) or [-1]
                self.log.emit(
                    OperationQueued,
                    op=int(op.id),
                    direction=direction,
                    node_id=int(node_ids[0]),
                    priority=int(op.priority if op.priority is not None else op.id),
                    slots_by_pool=self._slots_by_pool(op),
                )
        except Exception:
            self._failed("record an OperationQueued event")

    def _queue_cleared(self, direction: str, ops: list[Any]) -> None:
        """Ops a queue's ``clear()`` took: inside the controller's ``reset()``, ops that will never
        start (ended once the reset returns, after the acks it cancels: :meth:`_end_dropped`);
        elsewhere the submission that merged them has reported them."""
        if self._resetting.depth:
            self._resetting.dropped.append((direction, ops))
        queued_at = self._queued_at
        if queued_at:
            # the submission merging them clears its queue before its event takes their times
            sub = current.sub
            taken: Any = ()
            if sub is not None and sub.direction == direction:
                mine = sub.queued_ops
                if len(mine) == len(ops) and all(map(operator.is_, mine, ops)):
                    return  # the ops it merged, as it found them (the usual clear)
                taken = {id(q) for q in mine}
            for op in ops:
                if id(op) not in taken:
                    queued_at.pop(id(op), None)

    def _end_dropped(self, direction: str, ops: list[Any]) -> None:
        """End queued ops a reset dropped as the library's own controller ends a queued op it
        cancels: merged alone, submitted with no tensor, failed (guards itself)."""
        owner, attr = self._shape.streams[direction]
        try:
            stream = self._stream_name(getattr(owner, attr))
            for op in ops:
                with NO_TORCH_FUNCTION():
                    op_id, slots = int(op.id), self._slots_by_pool(op)
                    node_ids = tuple(int(n) for n in getattr(op, "node_ids", ()) or ())
                log = self.log
                log.emit(OperationsMerged, op=op_id, merged_ops=(op_id,), direction=direction, node_ids=node_ids)
                log.emit(
                    TransferSubmitted,
                    op=op_id,
                    direction=direction,
                    stream=stream,
                    io_backend=self._shape.io_backend,
                    layout=self._shape.layout,
                    tensors=(),
                    slots_by_pool=slots,
                    bytes_by_pool=tuple((p, n * self._slot_bytes.get(p, 0)) for p, n in slots),
                    device=self._device,
                )
                error = "cancelled: the controller was reset before this op started"
                log.emit(TransferFailed, op=op_id, direction=direction, error=error)
        except Exception:
            self._failed("record the ops a controller reset dropped")

    def _merged(self, sub: _Submission) -> None:
        """The submission's ``OperationsMerged``, once (guards itself)."""
        if sub.merged_emitted:
            return
        sub.merged_emitted = True
        if not self._full:
            return  # carried by the submission's one event
        try:
            op = sub.op
            op_id = int(op.id) if op is not None else sub.queued[0]
            node_ids = tuple(int(n) for n in getattr(op, "node_ids", ()) or ()) if op is not None else ()
            self.log.emit(OperationsMerged, op=op_id, merged_ops=sub.queued, direction=sub.direction, node_ids=node_ids)
        except Exception:
            self._failed("record an OperationsMerged event")

    def _stream_name(self, stream: Any) -> str:
        return self._stream_names.get(id(stream)) or f"stream@{id(stream):x}"

    def _finish(self, sub: _Submission, result: Any, error: BaseException | None) -> None:
        """A submission's events, once its call returned or raised (guards itself)."""
        if sub.op is None and error is None:
            if not (sub.uses or sub.acks):
                return  # nothing was merged (an empty queue raced us)
            try:  # copies ran with no op-level move (0.5.17's staged write-back skips it)
                sub.op = _unmoved_view(sub)
            except Exception:
                self._failed("describe a submission without a move")
                return
        try:
            with NO_TORCH_FUNCTION():
                self._submitted(sub, result, error)
        except Exception:
            self._failed("describe a submission")
        self._sync_findings()

    def _submitted(self, sub: _Submission, result: Any, error: BaseException | None) -> None:
        if not self._full:
            self._submitted_one(sub, result, error)
            return
        self._merged(sub)
        op = sub.op
        op_id = int(op.id) if op is not None else sub.queued[0]
        owner, attr = self._shape.streams[sub.direction]
        stream = getattr(owner, attr)
        stream_name = self._stream_name(stream)
        refs = [tensor_ref(t, pool, role) for (pool, role), t in sub.uses.items()]
        log = self.log
        for pool, role, src, dst, ref in sub.side_moves:
            try:
                log.emit(
                    IndicesMoved,
                    op=op_id,
                    pool=pool,
                    role=role,
                    src_device=src,
                    dst_device=dst,
                    tensor=ref,
                    stream=stream_name,
                )
            except Exception:
                self._failed("record an IndicesMoved event")
        # also for a failed launch: the fold then sees it submitted, then failed
        self._emit(TransferSubmitted, **self._transfer_fields(sub, op_id, stream_name, refs, result))
        if error is None:
            self._hold(sub, op_id, refs)
        for i, name in self._recorded(sub, refs, stream, stream_name):
            ref = refs[i]
            try:
                log.emit(StreamRecorded, op=op_id, pool=ref.pool, role=ref.role, stream=name, tensor=ref)
            except Exception:
                self._failed("record a StreamRecorded event")
        self._settle_acks(sub, op_id, error)

    def _transfer_fields(
        self, sub: _Submission, op_id: int, stream_name: str, refs: list[TensorRef], result: Any
    ) -> dict[str, Any]:
        """What a ``TransferSubmitted`` (or an ``OpsSubmitted``) says of the submission."""
        op = sub.op
        slots = self._slots_by_pool(op) if op is not None else ()
        slot_bytes = self._slot_bytes
        return {
            "op": op_id,
            "direction": sub.direction,
            "stream": stream_name,
            "io_backend": self._shape.io_backend,
            "layout": self._shape.layout,
            "tensors": tuple(refs),
            "slots_by_pool": slots,
            "bytes_by_pool": tuple([(p, n * slot_bytes.get(p, 0)) for p, n in slots]) if slots else (),
            "producer_id": int(result) if sub.direction == H2D and isinstance(result, int) else -1,
            "device": self._device,
            "host_indices_on_cpu": tuple(sub.host_indices_on_cpu),
            "sidecar_pools": self._sidecar_pools,
        }

    def _recorded(
        self, sub: _Submission, refs: list[TensorRef], stream: Any, stream_name: str
    ) -> list[tuple[int, str]]:
        """Each ``record_stream`` the submission made on a tensor its copies received: (the
        tensor's place in ``refs``, in ``sub.uses`` order, the stream's name). A tensor several
        pools' copies received (a draft pool copies with the KV indices) is recorded for each;
        a record on another tensor object with the same memory counts for it
        (:func:`~hicache_obs._native.recorded`)."""
        return recorded(list(sub.uses.values()), refs, sub.records, stream, stream_name, self._stream_names)

    def _submitted_one(self, sub: _Submission, result: Any, error: BaseException | None) -> None:
        """A submission as one ``OpsSubmitted`` (``metrics``, ``sampling``): the merged ops as
        queued, the moves, the records, the copies' tensors (their values where ``sampled``)
        and the pools' occupancy (:func:`~hicache_obs._native.submission_event`)."""
        op = sub.op
        op_id = int(op.id) if op is not None else sub.queued[0]
        values = sub.sampled
        if values:
            refs = [sub.ref(t, pool, role) for (pool, role), t in sub.uses.items()]
        else:  # as sub.ref: each tensor's metadata, made once
            refs = use_refs(sub.uses, sub.refs, TensorRef, _NAMES, tensor_meta)
        now = time.time_ns()
        # occupancy rides along at most every POOLS_EVERY_NS (the launcher's /metrics reads the
        # allocators at each scrape; detach() logs a last one)
        pools: tuple[tuple[str, str, int, int], ...] = ()
        end = self._end
        if self._usage and now - end.pools_at >= POOLS_EVERY_NS:
            end.pools_at = now
            pools = self.pool_usage()
        try:
            submission_event(self.log.emit, OpsSubmitted, sub, op_id, refs, result, now, pools, end.event_setup)
        except Exception:
            self._failed("record an OpsSubmitted event")
        if error is None and values:
            self._hold(sub, op_id, refs, every=True)
        self._settle_acks(sub, op_id, error)

    def _hold(self, sub: _Submission, op_id: int, refs: list[TensorRef], every: bool = False) -> None:
        """Keep, weakly, the device index tensors of a submitted op whose values its
        ``TransferSubmitted`` lacks: those the copies received, and those of the queued ops
        merged into it (the tree's own tensors, before a merge concatenated them); ``every``:
        also those whose values it holds (a sampled op: no allocation is observed)."""
        blind = {r.pool for r in refs if r.role == "device" and (every or r.indices is None) and r.numel}
        if not blind or not sub.acks:
            return
        held: list[_Held] = []
        seen: set[int] = set()
        tensors = [(pool, t) for (pool, role), t in sub.uses.items() if role == "device"]
        for queued in sub.queued_ops:
            found = self._op_tensors(
                getattr(queued, "host_indices", None),
                getattr(queued, "device_indices", None),
                getattr(queued, "pool_transfers", None),
            )
            tensors += [(pool, t) for (pool, role), t in found.items() if role == "device"]
        for pool, t in tensors:
            if pool in blind and id(t) not in seen and t.numel():
                seen.add(id(t))
                held.append(_Held(pool, weakref.ref(t), *_span(t)))
        if held:
            self._held[op_id] = held
            if not self._full:
                self._arm()

    def _check_held(self, pool: str, tier: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before a free runs: an ``IndicesFreed`` where the tensor it was handed holds the
        indices (shares the memory) of device index tensors in-flight ops received (guards
        itself: a failure is counted, never raised into SGLang)."""
        try:
            freed = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if freed is None or not freed.numel():
                return
            with NO_TORCH_FUNCTION():
                lo, hi = _span(freed)
                ops = tuple(
                    op
                    for op, held in self._held.items()
                    if any(h.pool == pool and h.lo < hi and lo < h.hi and h.ref() is not None for h in held)
                )
                if not ops:
                    return
                self._emit(IndicesFreed, pool=pool, tier=tier, ops=ops, tensor=tensor_ref(freed, pool, "device"))
        except Exception:
            self._failed("compare a free with the tensors of ops in flight")
            return
        self._sync_findings()

    def _check_device(self, pool: str, tier: str, call: str, expected: str, t: Any) -> None:
        """Before a free or allocation runs: an ``IndicesMisplaced`` where the index tensor it
        was handed is not on ``expected``, the device of the pool's free lists (reads the
        tensor's device, never its values; guards itself)."""
        if not isinstance(t, torch.Tensor):
            return
        try:
            with NO_TORCH_FUNCTION():
                dev = device_name(t)
                if dev == expected:
                    return
                ref = tensor_ref(t, pool, "host" if tier == "host" else "device", dev)
            self._emit(IndicesMisplaced, pool=pool, tier=tier, call=call, expected=expected, tensor=ref)
        except Exception:
            self._failed("compare the device of a free's indices with its pool's")
            return
        self._sync_findings()

    def _refused(
        self, pool: str, tier: str, call: str, args: tuple[Any, ...], kwargs: dict[str, Any], error: BaseException
    ) -> None:
        """A free that raised and changed nothing: a ``FreeRefused`` with what it was handed
        (its values where they are on the CPU) and what it raised."""
        t = _first_tensor(args, kwargs)
        if t is None:
            return
        with NO_TORCH_FUNCTION():
            ref = tensor_ref(t, pool, "host" if tier == "host" else "device")
        text = f"{type(error).__name__}: {error}"
        self.log.emit(
            FreeRefused, pool=pool, tier=tier, call=call, tensor=ref, error=text if len(text) <= 200 else text[:199] + "…"
        )

    def _settle_acks(self, sub: _Submission, op_id: int, error: BaseException | None) -> None:
        """A submission's acks await their op's completion; a submission that raised is a
        ``TransferFailed`` instead (its acks are never taken as completions)."""
        if error is not None:
            for ack in sub.acks:
                self._pending.pop(id(ack), None)
            self._emit(TransferFailed, op=op_id, direction=sub.direction, error=f"{type(error).__name__}: {error}")
            return
        pending, waiting = (op_id, sub.direction), self._pending
        for ack in sub.acks:
            waiting[id(ack)] = pending

    # the ack queues' hooks (each guards itself; an append: AckNote)
    def _ack_taken(self, direction: str, ack: Any) -> None:
        p = self._pending.pop(id(ack), None)
        if p is None:
            return
        op, op_direction = p
        if self._held:
            self._held.pop(op, None)
            if not self._held and self._armed is not None:
                self._disarm()
        try:
            duration = 0
            if getattr(ack, "timing_enabled", False):
                start, finish = getattr(ack, "start_event", None), getattr(ack, "finish_event", None)
                if start is not None and finish is not None:
                    try:
                        with NO_TORCH_FUNCTION():
                            duration = int(start.elapsed_time(finish) * 1e6)
                    except (RuntimeError, ValueError, TypeError, NotImplementedError):
                        duration = 0
            self.log.emit(TransferCompleted, op=op, direction=op_direction, duration_ns=max(0, duration))
        except Exception:
            self._failed("record a TransferCompleted event")
        if self._end.durable is not None:
            self._sync_findings()

    def _ack_cleared(self, direction: str, ack: Any) -> None:
        """An ack a queue's ``clear()`` took: a completion where its copy finished (the radix
        tree's blocking write-back check synchronizes each ack's ``finish_event``, then
        clears the queue), outside the controller's ``reset()``; else a cancelled op."""
        if id(ack) not in self._pending:
            return
        if self._resetting.depth:
            self._ack_cancelled(direction, "ack queue cleared (controller reset)", ack)
        elif _copy_finished(ack):
            self._ack_taken(direction, ack)
        else:
            self._ack_cancelled(direction, "ack queue cleared while the copy was still running", ack)

    def _ack_cancelled(self, direction: str, why: str, ack: Any) -> None:
        p = self._pending.pop(id(ack), None)
        if p is not None:
            op, op_direction = p
            self._held.pop(op, None)
            if not self._held and self._armed is not None:
                self._disarm()
            self._emit(TransferFailed, op=op, direction=op_direction, error=f"cancelled: {why}")


def _copy_finished(ack: Any) -> bool:
    """Whether an ack's ``finish_event`` has completed (``query()``, which never blocks); False
    where it has none or cannot say."""
    query = getattr(getattr(ack, "finish_event", None), "query", None)
    if not callable(query):
        return False
    try:
        with NO_TORCH_FUNCTION():
            return query() is True
    except Exception:
        return False


@dataclass
class _OpView:
    """The merged op of a release whose move takes (host, device): what the adapter reads of it."""

    id: int
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    node_ids: list[int]
    priority: int
    pool_transfers: Any = None


def _merged_view(sub: _Submission, host: torch.Tensor, device: torch.Tensor) -> _OpView:
    ops = sub.queued_ops
    if len(ops) == 1:
        op_id = int(ops[0].id)
    else:  # merge_ops made a new op just now: SGLang's op ids come from one class counter
        counter = getattr(type(ops[0]), "counter", None)
        if not isinstance(counter, int):
            raise IntegrationError(f"{type(ops[0]).__name__} has no integer 'counter': the merged op's id is unknown")
        op_id = counter - 1
    node_ids = [n for op in ops for n in getattr(op, "node_ids", [])]
    return _OpView(op_id, host, device, node_ids, min(int(op.priority) for op in ops))


def _unmoved_view(sub: _Submission) -> _OpView:
    """The merged op of a submission whose indices no move touched: its id as
    :func:`_merged_view` finds it, the queued ops' indices (one op's, or their concatenation, as
    ``merge_ops`` makes it) and all their pool transfers (what the slot counts read)."""
    ops = sub.queued_ops
    if len(ops) == 1:
        host, device = ops[0].host_indices, ops[0].device_indices
    else:
        host = torch.cat([op.host_indices for op in ops])
        device = torch.cat([op.device_indices for op in ops])
    view = _merged_view(sub, host, device)
    view.pool_transfers = [t for op in ops for t in (getattr(op, "pool_transfers", None) or ())]
    return view


def _rank_of(controller: Any) -> int:
    group = getattr(controller, "tp_group", None)
    if group is None:
        return 0
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank(group=group))
    except (RuntimeError, ValueError):
        pass
    return 0


def instrument(
    controller: Any,
    *,
    log: EventLog | None = None,
    rank: int | None = None,
    profile: str | Profile = "audit",
    audit_sample: float | None = None,
) -> Instrumentation:
    """Instrument one live SGLang ``HiCacheController`` / ``HybridCacheController``.

    Returns an :class:`Instrumentation` with ``.log`` (``log``, or a new
    :class:`EventLog` for the controller's TP rank) and ``.detach()``; it is also a
    context manager. ``profile``: ``audit`` (every event, every rule), ``metrics`` (one
    event per submission, no slot value read, no allocation observed) or ``sampling``
    (``metrics``, and the full evidence of ``audit_sample`` of the operations; default
    0.01); see :mod:`hicache_obs._profiles`. Raises :class:`~hicache_obs.errors.ConfigError`
    for a bad profile or share, :class:`~hicache_obs.errors.IntegrationError` for an object
    that is not such a controller, one already instrumented, or one of a shape the
    adapter does not know (the message names what is missing); nothing is changed then.
    """
    chosen = resolve_profile(profile, audit_sample)
    if controller is None or isinstance(controller, (str, bytes, int, float, list, dict, tuple)):
        raise IntegrationError(f"instrument() needs an SGLang HiCache controller, got {type(controller).__name__}")
    if log is not None and not isinstance(log, EventLog):
        raise IntegrationError(f"log must be an EventLog or None, got {type(log).__name__}")
    return Instrumentation.attach(controller, log=log, rank=rank, profile=chosen)


def instrumentation_of(controller: Any) -> Instrumentation | None:
    """The live instrumentation of ``controller``, if any."""
    with _registry_lock:
        ref = _registry.get(controller)
    return ref() if ref is not None else None
