"""SGLang's real HiCache controller behind the controller API the demo workload drives.

``hicache-obs demo --engine sglang-controller`` runs :class:`~hicache_obs.lab.workload.Workload`
unchanged on SGLang's own pools and controller (built on this machine's CPU, or with
``--runtime cuda`` on its GPU, by
:func:`~hicache_obs.lab.sglang.harness.build_controller`), instrumented by
:func:`~hicache_obs.integrations.sglang.instrument`. :class:`SGLangEngine` implements
exactly the part of :class:`~hicache_obs.core.HiCacheController` the workload uses,
and every value it hands back comes from SGLang's objects or from the instrumentation
log, nothing is computed in their place:

- allocation, eviction, ``write``, ``load``, ``start_loading``: SGLang's allocators,
  host pools and controller methods, called as SGLang's radix cache calls them;
- ``poll_writes``/``poll_loads``: finished acks popped off SGLang's ack queues in FIFO
  order (the radix cache's reaping); each becomes an :class:`~hicache_obs.core._controller.Ack`
  whose op id, duration and sizes are those of the ``TransferCompleted`` and
  ``TransferSubmitted`` events the adapter reported for it;
- ``state``: the fold (:class:`~hicache_obs.events._state.CacheState`) of the
  instrumentation log, subscribed before :func:`instrument` so ``PoolCreated`` is in it;
  a device tier the adapter does not record (on a GPU) answers its free slots from
  SGLang's allocator (``available_size``);
- ``device_pool(p)``/``host_pool(p)``: reads and writes of SGLang's own buffers
  (``k_buffer``/``v_buffer``, the Mamba ``temporal``/``conv`` states, the host pools'
  ``kv_buffer``/``temporal_buffer``/``conv_buffer`` in their layout).

A submission SGLang raises in (0.5.10's kernel backend refuses the Mamba host indices
it never moved to the device: "Destination indices must be a CUDA tensor", SGLang
bug #24121) is what the adapter reports as ``TransferFailed``; the engine returns it
as a failed ack, as :class:`~hicache_obs.core.HiCacheController` does for a copy that
failed, so the run goes on and the failure is counted. The slots SGLang allocated for
a write that raised are taken from the log's ``SlotsAllocated`` events (SGLang returns
nothing then) so the workload can free them.

The engine injects no faults: SGLang's code runs as released. The pre-#22940 bugs are
seen by running a release that has them (0.5.10).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from hicache_obs.core._controller import ANCHOR, Ack, HiCacheController, HybridCacheController
from hicache_obs.core._operations import PoolTransfer
from hicache_obs.core._policy import WritePolicy
from hicache_obs.core._runtime import Runtime
from hicache_obs.core._spec import ModelSpec, PlaneSpec
from hicache_obs.core._torch_compat import plain_tensor_calls
from hicache_obs.errors import ConfigError, IntegrationError
from hicache_obs.events._lifecycle import OpRecord
from hicache_obs.events._log import EventLog
from hicache_obs.events._schema import (
    D2H,
    H2D,
    Event,
    SlotsAllocated,
    TransferCompleted,
    TransferFailed,
    expand_runs,
)
from hicache_obs.events._state import CacheState
from hicache_obs.integrations.sglang._adapter import Instrumentation, instrument
from hicache_obs.lab.sglang.harness import LayoutRefused, SGLangHarness, build_controller, prepare, sglang_version

__all__ = [
    "ENGINE_RUNTIME",
    "ENGINE_RUNTIMES",
    "ENGINE_MODELS",
    "SGLangEngine",
    "SGLangHybridEngine",
    "build_engine",
    "check_options",
    "default_layout",
    "require_sglang",
]

#: The runtime the engine runs on by default: SGLang's pools in this machine's memory, copies synchronous.
ENGINE_RUNTIME = "cpu"
#: The runtimes the engine runs on: ``cuda`` puts SGLang's device pools on the GPU, with its own streams.
ENGINE_RUNTIMES = ("cpu", "cuda")
#: The models the SGLang harness builds (KV, KV + Mamba).
ENGINE_MODELS = ("tiny", "tiny_hybrid")

_PLAIN = plain_tensor_calls


# ---------------------------------------------------------------- options
def check_options(
    *, model: str, runtime: str | None, fault: str | None, io_backend: str = "kernel", layout: str | None = None
) -> None:
    """Refuse the demo options the engine cannot honour; the message names the option and value."""
    if model not in ENGINE_MODELS:
        raise ConfigError(
            f"--model {model}: the sglang engine builds SGLang's KV and KV + Mamba pools "
            f"({', '.join(ENGINE_MODELS)}), not this model"
        )
    if runtime is not None and runtime not in ENGINE_RUNTIMES:
        raise ConfigError(
            f"--runtime {runtime}: the sglang engine runs SGLang's pools in host memory "
            f"(runtime cpu) or on a GPU (runtime cuda), no other runtime"
        )
    if runtime == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--runtime cuda: no CUDA device here (torch.cuda.is_available() is False)")
    if layout == "page_first_direct" and io_backend != "direct":
        raise ConfigError(
            f"--layout {layout}: SGLang copies it with --io-backend direct only (its server switches "
            f"{io_backend} to direct), got --io-backend {io_backend}"
        )
    if fault is not None:
        raise ConfigError(
            f"--fault {fault}: the sglang engine runs SGLang's code as released and injects nothing; "
            "the pre-#22940 bugs are in SGLang 0.5.10: run the demo with that release's python"
        )


def require_sglang() -> str:
    """The installed SGLang release; :class:`IntegrationError` (one line) without one."""
    release = sglang_version()
    if release is None:
        raise IntegrationError(
            f"--engine sglang-controller: SGLang is not installed for {sys.executable} "
            "(make sglang builds the tested releases in .sglang/<release>/)"
        )
    return release


@contextmanager
def _quiet_import() -> Iterator[None]:
    # SGLang's quantization modules warn at import that they need CUDA: not this run's concern
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def default_layout(runtime: str | None = None) -> str:
    """The host layout the installed SGLang release defaults to (``ServerArgs.hicache_mem_layout``);
    prepares SGLang for ``runtime`` (default: as prepared, else ``cpu``) to read it."""
    with _quiet_import():
        prepare(runtime)
        server_args = importlib.import_module("sglang.srt.server_args").ServerArgs
    value = _class_default(server_args, "hicache_mem_layout")
    if not isinstance(value, str):
        raise IntegrationError("cannot read SGLang's default host layout (ServerArgs.hicache_mem_layout)")
    return value


def _class_default(cls: Any, name: str) -> Any:
    """A field default of a dataclass or a msgspec struct (0.5.23's ServerArgs is one)."""
    fields = getattr(cls, "__struct_fields__", None)
    if fields is not None:
        defaults = cls.__struct_defaults__
        i = list(fields).index(name) - (len(fields) - len(defaults))
        return defaults[i] if i >= 0 else None
    value = getattr(cls, name, None)
    return value if isinstance(value, str) else None


# ------------------------------------------------------------- data access
def _slots(indices: torch.Tensor) -> torch.Tensor:
    """The values of an index tensor as a plain int64 CPU tensor (a CUDA stand-in's too)."""
    with _PLAIN():
        return indices.detach().cpu().as_subclass(torch.Tensor).to(torch.int64)


class _DevicePlanes:
    """One of SGLang's device pools as the workload reads and writes it: ``(layers, n, *item)``."""

    tier = "device"

    def __init__(self, name: str, layer_ids: tuple[int, ...], planes: dict[str, list[torch.Tensor]]) -> None:
        self.name = name
        self.layer_ids = layer_ids
        self._planes = planes  # plane -> one SGLang buffer per layer, (slots, *item)
        for plane, layers in planes.items():
            if len(layers) != len(layer_ids):
                raise IntegrationError(
                    f"pool {name!r} plane {plane!r}: SGLang holds {len(layers)} layers, the model {len(layer_ids)}"
                )
        self.plane_specs = tuple(
            PlaneSpec(plane, tuple(layers[0].shape[1:]), layers[0].dtype) for plane, layers in planes.items()
        )

    def write_slots(self, indices: torch.Tensor, data: dict[str, torch.Tensor]) -> None:
        idx = _slots(indices)
        with _PLAIN():
            for plane, layers in self._planes.items():
                src = data[plane]
                for i, buf in enumerate(layers):
                    buf[idx] = src[i].to(buf.device, buf.dtype)

    def read_slots(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        idx = _slots(indices)
        with _PLAIN():
            return {plane: torch.stack([buf[idx] for buf in layers]).cpu() for plane, layers in self._planes.items()}


class _HostPlanes:
    """One of SGLang's host pools, read in its layout as ``(layers, n, *item)``.

    ``axes`` says how SGLang laid a plane out: ``layer`` ``(layers, slots, *item)``
    (layer_first), ``slot`` ``(slots, layers, *item)`` (the KV pool's page_first),
    ``page`` ``(pages, layers, page_size, *item)`` (the KV pool's page_first_direct; the
    Mamba pool's page layouts with pages of one slot)."""

    tier = "host"

    def __init__(self, name: str, layout: str, planes: dict[str, torch.Tensor], axes: str, page_size: int) -> None:
        self.name = name
        self.layout = layout
        self._planes = planes
        self._axes = axes
        self._page_size = page_size

    def read_slots(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        idx = _slots(indices)
        ps = self._page_size
        out = {}
        with _PLAIN():
            for plane, buf in self._planes.items():
                if self._axes == "layer":
                    got = buf[:, idx]
                elif self._axes == "slot":
                    got = buf[idx].transpose(0, 1)
                else:  # two index tensors around a slice: the indexed axis comes first
                    got = buf[idx // ps, :, idx % ps].transpose(0, 1)
                out[plane] = got.contiguous()
        return out


_KV_HOST_AXES = {"layer_first": "layer", "page_first": "slot", "page_first_direct": "page"}
_MAMBA_HOST_AXES = {"layer_first": "layer", "page_first": "page", "page_first_direct": "page"}


def _host_axes(table: dict[str, str], pool: str, layout: str) -> str:
    try:
        return table[layout]
    except KeyError:
        raise IntegrationError(f"pool {pool!r}: the engine cannot read SGLang's host layout {layout!r}") from None


def _kv_planes(h: SGLangHarness) -> tuple[_DevicePlanes, _HostPlanes]:
    dev = _DevicePlanes(ANCHOR, h.spec.kv_layer_ids, {"k": list(h.kv_pool.k_buffer), "v": list(h.kv_pool.v_buffer)})
    layout = str(h.kv_host.layout)
    buf = h.kv_host.kv_buffer  # (2, ...): k and v
    axes = _host_axes(_KV_HOST_AXES, ANCHOR, layout)
    return dev, _HostPlanes(ANCHOR, layout, {"k": buf[0], "v": buf[1]}, axes, int(h.kv_host.page_size))


def _mamba_planes(h: SGLangHarness) -> tuple[_DevicePlanes, _HostPlanes]:
    cache = h.mamba_pool.mamba_cache
    convs = list(cache.conv)
    names = ["conv"] if len(convs) == 1 else [f"conv{i}" for i in range(len(convs))]
    planes = {n: list(c.unbind(0)) for n, c in zip(names, convs)}
    planes["ssm"] = list(cache.temporal.unbind(0))  # SGLang's temporal state
    dev = _DevicePlanes("mamba", h.spec.mamba_layer_ids, planes)
    host = h.mamba_host
    layout = str(host.layout)
    bufs = dict(zip(names, host.conv_buffer))
    bufs["ssm"] = host.temporal_buffer
    return dev, _HostPlanes("mamba", layout, bufs, _host_axes(_MAMBA_HOST_AXES, "mamba", layout), 1)


class _Indices:
    """What the workload needs of a runtime: the values of an index tensor, on the host.

    ``name`` is where SGLang's device pools are; the workload's own data stays on the
    host (``device``), the pools' reads come back to it."""

    device = "cpu"
    has_device = False

    def __init__(self, name: str) -> None:
        self.name = name

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return _slots(tensor)


class _FreeSlots:
    """A device tier the instrumentation does not see (SGLang's allocator on a GPU), as the
    workload asks it: its free slots, from the allocator (``available_size``, no sync)."""

    def __init__(self, allocator: Any) -> None:
        self._allocator = allocator

    @property
    def available(self) -> int:
        return int(self._allocator.available_size())


@dataclass
class _EngineState(CacheState):
    """The fold of the instrumentation log; a tier it has no slots of (:attr:`~hicache_obs.
    integrations.sglang.adapter.Instrumentation.unseen_slot_tiers`) answers from SGLang's allocator."""

    unseen: dict[tuple[str, str], _FreeSlots] = field(default_factory=dict, repr=False, compare=False)

    def table(self, pool: str, tier: str) -> Any:
        view = self.unseen.get((pool, tier))
        return view if view is not None else super().table(pool, tier)


# ------------------------------------------------------------------ engine
class SGLangEngine(HiCacheController):
    """SGLang's real controller (plain KV model) behind the controller API the workload uses.

    Not a :class:`HiCacheController` of this library: it subclasses it only so the
    workload (which asks ``isinstance`` to tell hybrid controllers apart) drives it
    unchanged; none of the base class's state exists, every method the workload calls
    is implemented here on SGLang's objects (see the module docstring).
    """

    def __init__(self, harness: SGLangHarness, *, log: EventLog, write_policy: str = "write_through") -> None:
        # the base __init__ builds this library's pools: deliberately not called
        self.harness = harness
        self.spec = harness.spec
        self.io_backend = harness.io_backend
        self.layout = harness.layout
        self.release = harness.release
        self.write_policy = WritePolicy(write_policy)
        self.log = log
        self.rank = log.rank
        self.runtime = cast(Runtime, _Indices(harness.device))
        self._closed = False
        self._engine_state = _EngineState()
        self.state = self._engine_state
        # op -> its lifecycle record, taken as the op finished in an SGLang call this engine
        # observes (the fold forgets a finished op): what its Ack says
        self._finished: dict[int, OpRecord] = {}
        self._capture: list[Event] | None = None  # events of the SGLang call in progress
        self._failed: dict[str, list[tuple[int, Ack]]] = {D2H: [], H2D: []}  # (seq, ack) not reaped yet
        self._unsubscribe: Callable[[], None] | None = log.subscribe(self._on_event, first=True)
        try:
            self.instrumentation: Instrumentation = instrument(harness.controller, log=log)
        except BaseException:
            self._unsubscribe()
            raise
        try:
            self._pools_of(harness)
        except BaseException:
            self.instrumentation.detach()
            self._unsubscribe()
            raise

    def _pools_of(self, harness: SGLangHarness) -> None:
        kv_dev, kv_host = _kv_planes(harness)
        self._device: dict[str, _DevicePlanes] = {ANCHOR: kv_dev}
        self._host: dict[str, _HostPlanes] = {ANCHOR: kv_host}
        self._device_alloc: dict[str, Any] = {ANCHOR: harness.kv_allocator}
        self._host_alloc: dict[str, Any] = {ANCHOR: harness.kv_host}
        if harness.mamba_pool is not None:
            m_dev, m_host = _mamba_planes(harness)
            self._device["mamba"], self._host["mamba"] = m_dev, m_host
            self._device_alloc["mamba"], self._host_alloc["mamba"] = harness.mamba_allocator, harness.mamba_host
        if set(self._device) != set(self.spec.pool_names):
            raise IntegrationError(
                f"SGLang's pools {sorted(self._device)} are not model {self.spec.name!r}'s {list(self.spec.pool_names)}"
            )
        for pool, tier in self.instrumentation.unseen_slot_tiers:
            self._engine_state.unseen[(pool, tier)] = _FreeSlots(self._device_alloc[pool])

    # ------------------------------------------------------------ the log
    def _on_event(self, ev: Event) -> None:
        if self._capture is not None and isinstance(ev, (TransferCompleted, TransferFailed)):
            rec = self.state.ops.get(ev.op)
            if rec is not None:
                self._finished[ev.op] = rec
        if ev.seq > self.state.last_seq:
            self.state.apply(ev)
        if self._capture is not None:
            self._capture.append(ev)

    @contextmanager
    def _observing(self) -> Iterator[list[Event]]:
        """Collect the events the adapter reports during one SGLang call."""
        outer, self._capture = self._capture, []
        try:
            yield self._capture
        finally:
            self._capture = outer

    def _ack(self, op: int, direction: str, node_ids: Sequence[int], done: Event) -> Ack:
        rec = self._finished.pop(op, None)
        slots: tuple[tuple[str, int], ...] = ()
        nbytes: tuple[tuple[str, int], ...] = ()
        producer = -1
        if rec is not None and rec.submit is not None:
            slots, nbytes, producer = rec.submit.slots_by_pool, rec.submit.bytes_by_pool, rec.submit.producer_id
        elif rec is not None:  # failed before its submission: what it was queued (and merged) with
            slots = rec.slots_by_pool
        nodes = tuple(int(n) for n in node_ids)
        if isinstance(done, TransferCompleted):
            return Ack(
                op, direction, nodes, True, None, done.duration_ns, done.layer_durations_ns, slots, nbytes, producer
            )
        assert isinstance(done, TransferFailed)
        return Ack(op, direction, nodes, False, done.error, None, None, slots, nbytes, producer)

    def _submission_failed(
        self, events: list[Event], direction: str, exc: BaseException, node_ids: Sequence[int]
    ) -> int:
        """Turn the ``TransferFailed`` the adapter reported for a raising submission into a failed
        ack for the next poll; re-raises ``exc`` when the adapter reported none (not a transfer)."""
        failed = [e for e in events if isinstance(e, TransferFailed) and e.direction == direction]
        if not failed:
            raise exc
        for ev in failed:
            rec = self._finished.get(ev.op)
            nodes = rec.node_ids if rec is not None and rec.node_ids else node_ids
            self._failed[direction].append((ev.seq, self._ack(ev.op, direction, nodes, ev)))
        return len(failed)

    # ------------------------------------------------------------ checks
    def _check_open(self) -> None:
        if self._closed:
            raise IntegrationError("the SGLang engine is closed")

    def _pools(self, pool: str) -> None:
        if pool not in self._device:
            raise ConfigError(f"unknown pool {pool!r}; SGLang's pools here: {', '.join(self._device)}")

    def _sidecar(self, transfers: Sequence[PoolTransfer] | None, side: str) -> torch.Tensor | None:
        """The Mamba indices of the workload's pool transfers (the only sidecar SGLang builds here)."""
        if not transfers:
            return None
        out = None
        for t in transfers:
            if t.pool != "mamba" or t.indices_from_pool is not None:
                raise ConfigError(f"pool transfer {t.pool!r}: the SGLang engine moves the mamba pool only")
            out = getattr(t, side)
            if out is None:
                raise ConfigError(f"pool transfer 'mamba': {side} is None")
        return out

    # -------------------------------------------------------- allocation
    def alloc_device(self, n: int, pool: str = ANCHOR) -> torch.Tensor | None:
        self._check_open()
        self._pools(pool)
        return self._device_alloc[pool].alloc(n)  # type: ignore[no-any-return]

    def free_device(self, device_indices: torch.Tensor, pool: str = ANCHOR, *, reason: str = "free") -> int:
        self._check_open()
        self._pools(pool)
        self._device_alloc[pool].free(device_indices)
        return int(device_indices.numel())

    def evict_device(self, device_indices: torch.Tensor, pool: str = ANCHOR) -> int:
        return self.free_device(device_indices, pool, reason="evict")

    def evict_host(self, host_indices: torch.Tensor, pool: str = ANCHOR) -> int:
        self._check_open()
        self._pools(pool)
        self._host_alloc[pool].free(host_indices)
        return int(host_indices.numel())

    # ---------------------------------------------------- writes and loads
    def _sglang_write(
        self, device_indices: torch.Tensor, priority: int | None, node_id: int, mamba: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        h = self.harness
        t = h.mamba_transfer(device_indices=mamba) if mamba is not None else None
        extra = {"extra_pools": [t]} if t is not None else {}
        with self._observing() as events:
            try:
                host = h.controller.write(device_indices, priority=priority, node_id=node_id, **extra)
            except Exception as exc:
                self._submission_failed(events, D2H, exc, (node_id,))
                # SGLang returns nothing from a write that raised: its host slots are in the log
                host = self._allocated(events, ANCHOR, "host")
        if host is None:
            return None
        mamba_host = None
        if t is not None:
            mamba_host = t.host_indices if t.host_indices is not None else self._allocated(events, "mamba", "host")
        return host, mamba_host

    @staticmethod
    def _allocated(events: list[Event], pool: str, tier: str) -> torch.Tensor:
        values = [
            v
            for e in events
            if isinstance(e, SlotsAllocated) and e.pool == pool and e.tier == tier
            for v in expand_runs(e.indices)
        ]
        return torch.tensor(values, dtype=torch.int64)

    def write(
        self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1
    ) -> torch.Tensor | None:
        self._check_open()
        res = self._sglang_write(device_indices, priority, node_id, None)
        return None if res is None else res[0]

    def _sglang_load(
        self, host_indices: torch.Tensor, priority: int | None, node_id: int, mamba: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        h = self.harness
        t = h.mamba_transfer(host_indices=mamba) if mamba is not None else None
        extra = {"extra_pools": [t]} if t is not None else {}
        dev = h.controller.load(host_indices, priority=priority, node_id=node_id, **extra)
        if dev is None:
            return None
        return dev, (t.device_indices if t is not None else None)

    def load(self, host_indices: torch.Tensor, priority: int | None = None, node_id: int = -1) -> torch.Tensor | None:
        self._check_open()
        res = self._sglang_load(host_indices, priority, node_id, None)
        return None if res is None else res[0]

    def start_writing(self) -> None:
        self._check_open()
        with self._observing() as events:
            try:
                self.harness.controller.start_writing()
            except Exception as exc:
                self._submission_failed(events, D2H, exc, ())

    def start_loading(self) -> int:
        self._check_open()
        with self._observing() as events:
            try:
                return int(self.harness.controller.start_loading())
            except Exception as exc:
                self._submission_failed(events, H2D, exc, ())
                return -1

    # --------------------------------------------------------------- acks
    def poll_writes(self) -> list[Ack]:
        return self._poll(D2H)

    def poll_loads(self) -> list[Ack]:
        return self._poll(H2D)

    def _poll(self, direction: str) -> list[Ack]:
        """Pop SGLang's finished acks in FIFO order (as its radix cache does), with the failures."""
        self._check_open()
        c = self.harness.controller
        queue = c.ack_write_queue if direction == D2H else c.ack_load_queue
        reaped: list[tuple[int, Ack]] = []
        while len(queue) and queue[0].finish_event.query():
            with self._observing() as events:
                ack = queue.pop(0)  # the adapter reports the op's TransferCompleted here
            ack.finish_event.synchronize()
            done = [e for e in events if isinstance(e, TransferCompleted) and e.direction == direction]
            if len(done) != 1:
                raise IntegrationError(
                    f"an ack taken off SGLang's {direction} queue was reported as {len(done)} completions, not 1"
                )
            reaped.append((done[0].seq, self._ack(done[0].op, direction, ack.node_ids, done[0])))
        reaped += self._failed[direction]
        self._failed[direction] = []
        return [a for _, a in sorted(reaped, key=lambda p: p[0])]

    def in_flight(self, direction: str) -> int:
        c = self.harness.controller
        return len(c.ack_write_queue if direction == D2H else c.ack_load_queue)

    # ---------------------------------------------------------- life cycle
    def synchronize(self) -> None:
        """Wait for every transfer SGLang has in flight (does not reap acks)."""
        c = self.harness.controller
        for queue in (c.ack_write_queue, c.ack_load_queue):
            for ack in list(queue):
                ack.finish_event.synchronize()

    def close(self) -> None:
        """Wait for and reap what is in flight, detach the adapter and close the harness
        (:meth:`~hicache_obs.lab.sglang.harness.SGLangHarness.close`). Idempotent."""
        if self._closed:
            return
        try:
            self.synchronize()
            self.poll_writes()
            self.poll_loads()
        finally:
            self._closed = True
            try:
                self.instrumentation.detach()
                if self._unsubscribe is not None:
                    self._unsubscribe()
                    self._unsubscribe = None
            finally:
                self.harness.close()

    # ---------------------------------------------------------- data access
    def device_pool(self, pool: str = ANCHOR) -> _DevicePlanes:  # type: ignore[override]
        self._pools(pool)
        return self._device[pool]

    def host_pool(self, pool: str = ANCHOR) -> _HostPlanes:  # type: ignore[override]
        self._pools(pool)
        return self._host[pool]


class SGLangHybridEngine(SGLangEngine, HybridCacheController):
    """:class:`SGLangEngine` for SGLang's ``HybridCacheController`` (KV + Mamba)."""

    def write(  # type: ignore[override]
        self,
        device_indices: torch.Tensor,
        priority: int | None = None,
        node_id: int = -1,
        pool_transfers: Sequence[PoolTransfer] | None = None,
    ) -> tuple[torch.Tensor, tuple[PoolTransfer, ...] | None] | None:
        self._check_open()
        mamba = self._sidecar(pool_transfers, "device_indices")
        res = self._sglang_write(device_indices, priority, node_id, mamba)
        if res is None:
            return None
        host, mamba_host = res
        if mamba is None:
            return host, None
        return host, (PoolTransfer("mamba", host_indices=mamba_host, device_indices=mamba),)

    def load(  # type: ignore[override]
        self,
        host_indices: torch.Tensor,
        priority: int | None = None,
        node_id: int = -1,
        pool_transfers: Sequence[PoolTransfer] | None = None,
    ) -> tuple[torch.Tensor, tuple[PoolTransfer, ...] | None] | None:
        self._check_open()
        mamba = self._sidecar(pool_transfers, "host_indices")
        res = self._sglang_load(host_indices, priority, node_id, mamba)
        if res is None:
            return None
        dev, mamba_dev = res
        if mamba is None:
            return dev, None
        return dev, (PoolTransfer("mamba", host_indices=mamba, device_indices=mamba_dev),)


# ----------------------------------------------------------------- build
def build_harness(
    spec: ModelSpec,
    *,
    io_backend: str,
    layout: str,
    write_policy: str,
    device_tokens: int,
    host_ratio: float = 2.0,
    runtime: str = ENGINE_RUNTIME,
) -> SGLangHarness:
    """SGLang's pools and controller for ``spec``; a one-line :class:`ConfigError` when SGLang refuses
    them (a :class:`~.harness.LayoutRefused` where its Mamba host pool refuses the layout)."""
    release = require_sglang()
    try:
        with _quiet_import():
            return build_controller(
                spec,
                io_backend=io_backend,
                layout=layout,
                device_size=device_tokens,
                host_ratio=host_ratio,
                write_policy=write_policy,
                device=runtime,
            )
    except LayoutRefused as refused:  # SGLang's own check, as the harness names it
        exc: BaseException = refused.__cause__ or refused
        kind: type[ConfigError] = LayoutRefused
    except (ConfigError, IntegrationError):
        raise
    except Exception as other:  # SGLang's own checks (an assert on the layout, a ValueError)
        exc, kind = other, ConfigError
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    raise kind(
        f"SGLang {release} refuses --model {spec.name} --io-backend {io_backend} --layout {layout}: {detail}"
    ) from None


def build_engine(harness: SGLangHarness, *, log: EventLog, write_policy: str = "write_through") -> SGLangEngine:
    """Instrument ``harness``'s controller onto ``log`` and wrap it for the workload."""
    cls = SGLangHybridEngine if harness.mamba_pool is not None else SGLangEngine
    return cls(harness, log=log, write_policy=write_policy)
