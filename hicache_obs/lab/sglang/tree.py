"""SGLang's own ``UnifiedRadixCache`` with HiCache on the CPU harness, driven as the scheduler
drives it (test support).

:func:`build_tree` builds the device pool and allocator with :mod:`.harness`'s pieces, then
the tree and its HiCache through SGLang's own construction path (``init_hicache``, which
builds the host pool group and the controller); the CPU stand-ins are applied to what
SGLang built (CPU streams, buffers registered for the copy stand-ins). :class:`TreeHarness`
serves one request per scheduler step with SGLang's calls: ``check_hicache_events``,
``match_prefix``, ``init_load_back``, ``ready_to_load_host_cache``, ``alloc_token_slots``
(which evicts through the tree), ``insert`` and the lock calls of a finished request.

Each token's KV rows hold values derived from the token's whole prefix, as a model's would,
so rows reached by any path (a device hit, a load back, a recompute) can be checked.

:meth:`TreeHarness.add_draft` gives a built tree a draft model's KV pool (speculative
decoding) registered as the release's scheduler registers it, after the tree built its
controller: with the controller's ``set_draft_kv_pool`` (0.5.11 to 0.5.13: the scheduler's
``maybe_register_hicache_draft``), or as a sidecar pool of the tree
(``UnifiedRadixCache.register_sidecar_pool``, 0.5.2x), which then names the draft's transfer
in each of its ops. The draft's rows are filled and checked like the KV rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from hicache_obs.core._spec import ModelSpec
from hicache_obs.errors import ConfigError, IntegrationError
from hicache_obs.lab.sglang.cpu_server import _NoHostRegistration
from hicache_obs.lab.sglang.harness import (
    _PLAIN,
    SGLangHarness,
    _kv_allocator,
    _kv_device,
    _kw,
    _mamba_params,
    _mha_device_pool,
    _module,
    _register_buffers,
    _register_pool_buffers,
    _to_cuda_indices,
    _use_cpu_streams,
    prepare,
    sglang_version,
)

__all__ = [
    "HYBRID_TREES",
    "HybridServed",
    "HybridTreeHarness",
    "SWAServed",
    "SWATreeHarness",
    "Served",
    "TreeHarness",
    "build_hybrid_tree",
    "build_swa_tree",
    "build_tree",
    "has_unified_hicache",
    "hybrid_trees",
    "swa_tree_missing",
]

_URC = "sglang.srt.mem_cache.unified_radix_cache"
_BASE = "sglang.srt.mem_cache.base_prefix_cache"
_COMMON = "sglang.srt.mem_cache.common"
_ASSEMBLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
_COMPONENT_TYPES = (
    "sglang.srt.mem_cache.unified_cache_components",
    "sglang.srt.mem_cache.unified_cache.component_type",
)


def has_unified_hicache() -> bool:
    """Whether the installed SGLang has a ``UnifiedRadixCache`` with ``init_hicache``."""
    prepare("cpu")
    cls = getattr(_module(_URC), "UnifiedRadixCache", None)
    return callable(getattr(cls, "init_hicache", None))


@contextmanager
def _host_registration_stand_in() -> Iterator[None]:
    """``torch.cuda.cudart()`` while SGLang builds its host pools here: host memory needs no
    registration without a GPU (the CPU server's stand-in, for the length of the block)."""
    real = torch.cuda.cudart
    torch.cuda.cudart = lambda: _NoHostRegistration  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.cudart = real  # type: ignore[assignment]


def _required(obj: Any, names: Sequence[str], what: str) -> None:
    missing = [n for n in names if not callable(getattr(obj, n, None))]
    if missing:
        raise IntegrationError(f"SGLang {sglang_version()}: {what} has no {', '.join(missing)}; cannot drive it")


def _component_types_or_none() -> Any:
    """The unified tree's ``ComponentType`` from whichever of :data:`_COMPONENT_TYPES` this
    release has, or None."""
    return next((m.ComponentType for m in map(_module, _COMPONENT_TYPES) if hasattr(m, "ComponentType")), None)


def _component_types() -> Any:
    found = _component_types_or_none()
    if found is None:
        raise IntegrationError(f"SGLang {sglang_version()}: no ComponentType in {' or '.join(_COMPONENT_TYPES)}")
    return found


def _prefix_rows(tokens: Sequence[int], start: int, shape: tuple[int, ...], salt: bytes = b"") -> torch.Tensor:
    """The KV rows of ``tokens[start:]``: each a function of the token's whole prefix (and of
    ``salt``: another model's rows, a draft's, differ from the target's)."""
    h = hashlib.blake2b(salt, digest_size=8)
    for t in tokens[:start]:
        h.update(int(t).to_bytes(8, "little", signed=True))
    rows = []
    for t in tokens[start:]:
        h.update(int(t).to_bytes(8, "little", signed=True))
        g = torch.Generator().manual_seed(int.from_bytes(h.digest(), "little") & (2**63 - 1))
        rows.append(torch.randn(shape, generator=g))
    return torch.stack(rows, dim=1) if rows else torch.empty(shape[0], 0, *shape[1:])


@dataclass
class Served:
    """What one request got: its device indices, how many tokens hit on the device, how many
    were loaded back from the host, and whether the rows it read held its prefix's values
    (``draft_ok``: the draft model's rows; None without a draft)."""

    tokens: tuple[int, ...]
    indices: torch.Tensor
    device_hit: int
    loaded: int
    new: int
    data_ok: bool
    draft_ok: bool | None = None


@dataclass
class TreeHarness:
    """SGLang's tree with the controller SGLang built for it, its pools, and the scheduler's calls."""

    tree: Any
    harness: SGLangHarness
    api: SimpleNamespace
    served: list[Served] = field(default_factory=list)
    draft: Any = None  # the draft model's device KV pool (add_draft)

    @property
    def controller(self) -> Any:
        return self.tree.cache_controller

    @property
    def allocator(self) -> Any:
        return self.harness.kv_allocator

    # ------------------------------------------------------------ scheduler calls
    def step(self) -> None:
        """The scheduler's per-step poll of finished writes and loads."""
        self.tree.check_hicache_events()

    def serve(self, tokens: Sequence[int]) -> Served:
        """One scheduler step for one request of ``tokens`` (page-aligned), prefilled and
        finished at once: poll events, match, load back a host hit, allocate (evicting
        through the tree), write its KV, insert it and release its lock."""
        api, tree = self.api, self.tree
        key = self._begin(tokens)
        match = tree.match_prefix(api.MatchPrefixParams(key=key))
        last_node = match.last_device_node
        prefix = self._device_prefix(match)
        device_hit = len(prefix)
        loaded = 0
        if match.host_hit_length > 0:
            req = SimpleNamespace(  # what a KV-only load back reads of a Req
                rid=f"req-{len(self.served)}",
                last_node=last_node,
                swa_host_hit_length=0,
                mamba_host_hit_length=0,
                kv=SimpleNamespace(mamba_pool_idx=None),
                mamba_pool_idx=None,  # 0.5.18 reads it off the Req itself
            )
            loaded, prefix, last_node = self._load_back(match, req, last_node, prefix)
        self._forward_layers(tree.ready_to_load_host_cache())
        lock = tree.inc_lock_ref(last_node)
        n_new = len(tokens) - len(prefix)
        new = api.alloc_token_slots(tree, n_new) if n_new else prefix[:0]
        data_ok, draft_ok = self._check(tokens, prefix), self._check_draft(tokens, prefix)
        self._fill(tokens, len(prefix), new)
        self._fill_draft(tokens, len(prefix), new)
        indices = torch.cat([prefix, new])
        # cache_finished_req: insert what the request holds, then release its lock
        tree.insert(api.InsertParams(key=key, value=indices.to(torch.int64), prev_prefix_len=len(prefix)))
        tree.dec_lock_ref(last_node, self._dec_params(lock))
        s = Served(tuple(tokens), indices, device_hit, loaded, n_new, data_ok, draft_ok)
        self.served.append(s)
        return s

    def without_data(self) -> None:
        """Serve from now on without writing or checking any row: the scheduler's calls into the
        tree and its controller alone (what a measure of their cost runs). ``data_ok`` and the
        other checks of what is served are None then."""

        def skip(*args: Any, **kwargs: Any) -> None:
            return None

        for name in ("_fill", "_check", "_fill_draft", "_check_draft", "_fill_mamba", "_check_mamba"):
            setattr(self, name, skip)

    # ------------------------------------------------------------------ helpers
    def _begin(self, tokens: Sequence[int]) -> Any:
        """A step's first calls for a request of ``tokens`` (page-aligned): poll finished
        writes and loads; then the request's radix key."""
        page = self.harness.spec.page_size
        if not tokens or len(tokens) % page:
            raise ConfigError(f"a request's length must be a positive multiple of page size {page}, got {len(tokens)}")
        self.step()
        return self.api.RadixKey(array("q", tokens) if self.api.array_keys else list(tokens))

    def _load_back_params(self, match: Any, req: Any) -> Any:
        values = dict(
            last_host_node=getattr(match, "last_host_node", None),  # 0.5.10, 0.5.11
            best_match_node=getattr(match, "best_match_node", None),
            host_hit_length=match.host_hit_length,
            req=req,
        )
        return self.api.InitLoadBackParams(**{k: v for k, v in values.items() if k in self.api.load_back_fields})

    def _load_back(self, match: Any, req: Any, last_node: Any, prefix: torch.Tensor) -> tuple[int, torch.Tensor, Any]:
        """``init_load_back`` of a host hit while the device prefix is held, as the prefill
        adder does: (tokens loaded back, the request's device prefix with them, its last node)."""
        with self._locked(last_node):
            got, last_node = self.tree.init_load_back(self._load_back_params(match, req))
        if isinstance(got, torch.Tensor):
            return len(got), torch.cat([prefix, got]), last_node
        # a count, and the tree gives the path's device indices
        return int(got), self.tree.path_device_indices(last_node), last_node

    def _forward_layers(self, producer: Any) -> None:
        """Read each layer's KV through the device pool as the model does, each read waiting
        on the load back's layer counter (a load still running has not written it yet)."""
        if producer is None or producer < 0:
            return
        self.controller.layer_done_counter.set_consumer(producer)
        kv = self.allocator.get_kvcache()
        for layer in range(self.harness.spec.num_layers):
            kv.get_key_buffer(layer)

    def _device_prefix(self, match: Any) -> torch.Tensor:
        """The matched prefix's device indices: the match's own, or (trees whose match carries
        only a length) the path's."""
        indices = getattr(match, "device_indices", None)
        if indices is not None:
            return indices  # type: ignore[no-any-return]
        path = self.tree.path_device_indices(match.last_device_node)
        return path[: match.device_prefix_len]  # type: ignore[no-any-return]

    @contextmanager
    def _locked(self, node: Any) -> Iterator[None]:
        lock = self.tree.inc_lock_ref(node)
        try:
            yield
        finally:
            self.tree.dec_lock_ref(node, self._dec_params(lock))

    @staticmethod
    def _dec_params(lock: Any) -> Any:
        to_params = getattr(lock, "to_dec_params", None)
        return to_params() if callable(to_params) else None

    def _kv_layers(self) -> list[torch.Tensor]:
        pool = self.harness.kv_pool
        return [*pool.k_buffer, *pool.v_buffer]  # read_kv's order

    def _row_shape(self) -> tuple[int, ...]:
        layers = self._kv_layers()
        return (len(layers), *layers[0].shape[1:])

    def _fill(self, tokens: Sequence[int], start: int, indices: torch.Tensor) -> None:
        if not len(indices):
            return
        rows = _prefix_rows(tokens, start, self._row_shape())
        with _PLAIN():
            idx = indices.detach().clone().as_subclass(torch.Tensor).to(torch.int64)
            for i, buf in enumerate(self._kv_layers()):
                buf[idx] = rows[i].to(buf.dtype)

    def _check(self, tokens: Sequence[int], indices: torch.Tensor) -> bool:
        """Whether the device rows at ``indices`` hold the values of ``tokens``' first rows."""
        if not len(indices):
            return True
        layers = self._kv_layers()
        want = _prefix_rows(tokens[: len(indices)], 0, self._row_shape()).to(layers[0].dtype).float()
        return bool(torch.equal(self.harness.read_kv(indices), want))

    # ------------------------------------------------------ a draft model
    def add_draft(self) -> Any:
        """A one-layer draft model's KV pool (speculative decoding), the size of the target's
        device KV pool and sharing its indices, registered as the release's scheduler registers
        it once the tree built its controller: where SGLang builds draft sidecars
        (``build_hicache_draft_sidecars``, 0.5.2x), as a sidecar pool of the tree
        (``register_sidecar_pool``: the tree names the draft's transfer in each op); else with
        the controller's ``set_draft_kv_pool`` and a host pool of its own
        (:meth:`SGLangHarness.add_draft`, as ``maybe_register_hicache_draft`` does on 0.5.11 to
        0.5.13, whose trees' ``register_sidecar_pool`` serves their own component pools only).
        From then on each request's draft rows are filled like its KV rows and checked where it
        reads them (:attr:`Served.draft_ok`). Returns the draft device pool.

        Raises :class:`~hicache_obs.errors.IntegrationError` where neither the tree nor its
        controller takes a draft, :class:`~hicache_obs.errors.ConfigError` for a second draft.
        """
        if self.draft is not None:
            raise ConfigError("this tree has a draft KV pool already")
        build = getattr(_module(_ASSEMBLER), "build_hicache_draft_sidecars", None)
        if callable(build):
            _required(self.tree, ("register_sidecar_pool",), f"{type(self.tree).__name__} (a draft sidecar)")
            draft = self._add_draft_sidecar(build)
        elif callable(getattr(self.controller, "set_draft_kv_pool", None)):
            draft = self.harness.add_draft()  # the scheduler's host pool, then set_draft_kv_pool
        else:
            raise IntegrationError(
                f"SGLang {sglang_version()}: neither {_ASSEMBLER}.build_hicache_draft_sidecars nor "
                f"{type(self.controller).__name__}.set_draft_kv_pool: the tree takes no draft KV pool"
            )
        self.draft = draft
        return draft

    def _add_draft_sidecar(self, build: Any) -> Any:
        """The draft as the tree's sidecar pool: SGLang's own specs and host pool group entries
        for it (``build``: ``build_hicache_draft_sidecars``, as the scheduler's
        ``maybe_register_hicache_draft`` builds them), registered through the tree
        (``register_sidecar_pool``, which hands each entry to the controller's
        ``register_host_pool_entry``)."""
        draft = self._draft_device_pool()
        with _host_registration_stand_in():
            more = {}
            if "server_args" in inspect.signature(build).parameters:  # 0.5.18 takes them
                more["server_args"] = importlib.import_module("sglang.srt.server_args").get_global_server_args()
            specs, entries = build(draft_device_pools=(draft,), tree_cache=self.tree, **more)
        if not specs:
            raise IntegrationError(f"SGLang {sglang_version()}: build_hicache_draft_sidecars built no draft sidecar")
        draft.device = "cuda"
        _register_pool_buffers(draft, *(entry.host_pool for entry in entries))
        register_all = getattr(self.tree, "register_hicache_draft_pools", None)
        if callable(register_all):  # 0.5.18: the entries to the controller, the specs to the tree
            register_all(specs, entries)
        else:
            for spec, entry in zip(specs, entries, strict=True):
                self.tree.register_sidecar_pool(spec, entry)
        self.harness.extras["draft"] = draft
        return draft

    def _draft_device_pool(self) -> Any:
        """A one-layer draft model's device KV pool, the target's size and page (the draft
        worker's, sharing the target's allocator and so its indices)."""
        return _mha_device_pool(self.harness.spec, self.harness.kv_pool.size, 1, "cpu")

    def _draft_layers(self) -> list[torch.Tensor]:
        return self.harness.draft_layers()

    def _draft_row_shape(self) -> tuple[int, ...]:
        layers = self._draft_layers()
        return (len(layers), *layers[0].shape[1:])

    def _fill_draft(self, tokens: Sequence[int], start: int, indices: torch.Tensor) -> None:
        """The draft model's rows for ``tokens[start:]`` at the KV indices the request got."""
        if self.draft is None or not len(indices):
            return
        rows = _prefix_rows(tokens, start, self._draft_row_shape(), _DRAFT_SALT)
        with _PLAIN():
            idx = indices.detach().clone().as_subclass(torch.Tensor).to(torch.int64)
            for i, buf in enumerate(self._draft_layers()):
                buf[idx] = rows[i].to(buf.dtype)

    def _check_draft(self, tokens: Sequence[int], indices: torch.Tensor) -> bool | None:
        """Whether the draft rows at ``indices`` hold ``tokens``' first draft rows; None without
        a draft."""
        if self.draft is None:
            return None
        if not len(indices):
            return True
        layers = self._draft_layers()
        want = _prefix_rows(tokens[: len(indices)], 0, self._draft_row_shape(), _DRAFT_SALT)
        with _PLAIN():
            idx = indices.detach().clone().as_subclass(torch.Tensor).to(torch.int64)
            got = torch.stack([buf[idx].float() for buf in layers])
        return bool(torch.equal(got, want.to(layers[0].dtype).float()))


_DRAFT_SALT = b"draft"


_SCHEDULER_CALLS = (
    "match_prefix",
    "insert",
    "evict",
    "inc_lock_ref",
    "dec_lock_ref",
    "init_load_back",
    "ready_to_load_host_cache",
    "check_hicache_events",
)


def _api(tree: str = "UnifiedRadixCache", module: str = _URC) -> SimpleNamespace:
    """SGLang's names the driver calls, with the tree class ``tree`` of ``module`` (``api.Tree``)."""
    base = importlib.import_module(_BASE)
    tree_module = importlib.import_module(module)
    # alloc_token_slots moved from mem_cache/common.py to mem_cache/allocation.py
    common = next(
        (m for m in map(_module, ("sglang.srt.mem_cache.allocation", _COMMON)) if hasattr(m, "alloc_token_slots")),
        importlib.import_module(_COMMON),
    )
    radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    cip = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
    names = dict(
        MatchPrefixParams=base,
        InsertParams=base,
        InitLoadBackParams=base,
        EvictParams=base,
        RadixKey=radix,
        alloc_token_slots=common,
        CacheInitParams=cip,
        **{tree: tree_module},
    )
    missing = [f"{mod.__name__}.{n}" for n, mod in names.items() if getattr(mod, n, None) is None]
    if missing:
        raise IntegrationError(f"SGLang {sglang_version()}: no {', '.join(missing)}; cannot build the tree")
    api = SimpleNamespace(**{n: getattr(mod, n) for n, mod in names.items()})
    api.Tree = getattr(api, tree)
    # the component trees' (UnifiedRadixCache's) ComponentType; HiMambaRadixCache has none
    api.ComponentType = _component_types() if tree == "UnifiedRadixCache" else None
    # 0.5.2x's RadixKey holds an array('q'); earlier ones a list
    token_ids = inspect.signature(api.RadixKey).parameters.get("token_ids")
    api.array_keys = token_ids is not None and "array" in str(token_ids.annotation)
    match_fields = getattr(base.MatchResult, "_fields", None) or [f.name for f in dataclasses.fields(base.MatchResult)]
    if "device_indices" not in match_fields:
        _required(api.Tree, ("path_device_indices",), f"{tree} (its match gives no indices)")
    _required(api.Tree, ("init_hicache",) * (tree == "UnifiedRadixCache") + _SCHEDULER_CALLS, tree)
    api.load_back_fields = {f.name for f in dataclasses.fields(api.InitLoadBackParams)}
    return api


def _controller_of(tree: Any, built_by: str, load_back_threshold: int | None) -> Any:
    """The controller SGLang built for ``tree``, on the CPU harness's streams."""
    controller = getattr(tree, "cache_controller", None)
    if controller is None:
        raise IntegrationError(f"SGLang {sglang_version()}: {built_by} attached no cache_controller to the tree")
    _use_cpu_streams(controller)
    if load_back_threshold is not None:
        tree.load_back_threshold = load_back_threshold
    return controller


def _server_args(spec: ModelSpec, io_backend: str, layout: str, write_policy: str, host_ratio: float) -> Any:
    """The server arguments ``init_hicache`` reads. Where ``ServerArgs`` is a dataclass and no
    runtime context publishes it (0.5.12, 0.5.13), its declared defaults with the HiCache
    settings; otherwise a real ``ServerArgs``, made the process's global (its runtime getters
    read that, as SGLang's own unit fixture sets it; 0.5.18's through its runtime context)."""
    mod = importlib.import_module("sglang.srt.server_args")
    hicache = dict(
        hicache_io_backend=io_backend,
        hicache_mem_layout=layout,
        hicache_write_policy=write_policy,
        hicache_ratio=host_ratio,
        hicache_size=0,
        hicache_storage_backend=None,
    )
    cls = mod.ServerArgs
    published = _module("sglang.srt.runtime_context") is not None  # settings read from a published context
    if dataclasses.is_dataclass(cls) and not published:
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
        return SimpleNamespace(**{**values, **hicache})
    set_global = getattr(mod, "set_global_server_args_for_scheduler", None)
    if set_global is None:
        raise IntegrationError(f"SGLang {sglang_version()}: ServerArgs is no dataclass and has no global setter")
    args = cls(model_path="dummy", page_size=spec.page_size, **hicache)
    set_global(args)
    return args


def _cache_params(
    api: SimpleNamespace,
    allocator: Any,
    page_size: int,
    *,
    req_to_token_pool: Any = None,
    components: tuple[Any, ...] | None = None,
    **optional: Any,
) -> Any:
    """SGLang's ``CacheInitParams``. ``components`` None: a tree without components (the
    ``HiMambaRadixCache``); ``optional``: fields set only where the release has them."""
    cls = api.CacheInitParams
    params = inspect.signature(cls).parameters
    kw: dict[str, Any] = dict(
        disable=False,
        # a KV-only tree's request paths read it only; the driver inserts directly
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
    )
    if components is not None:
        kw["tree_components"] = components
    if "tree_core_backend" in params:
        kw["tree_core_backend"] = "python"  # SGLang's Python tree core (a Rust one may be selected by default)
    kw.update({k: v for k, v in optional.items() if k in params})
    missing = [k for k in kw if k not in params]
    if missing:
        raise IntegrationError(f"SGLang {sglang_version()}: CacheInitParams takes no {', '.join(missing)}")
    return cls(**kw)


def _kv_host(tree: Any, controller: Any) -> Any:
    """The KV host pool SGLang built: the tree's ``full_kv_pool_host``, else the KV entry of
    the controller's host pool group."""
    pool = getattr(tree, "full_kv_pool_host", None)
    if pool is None:
        group = controller.mem_pool_host
        get_pool = getattr(group, "get_pool", None)
        pool = (
            get_pool(importlib.import_module("sglang.srt.mem_cache.hicache_storage").PoolName.KV) if get_pool else group
        )
    if getattr(pool, "layout", None) is None:
        raise IntegrationError(f"SGLang {sglang_version()}: no KV host pool found on the tree or its controller")
    return pool


def build_tree(
    spec: ModelSpec,
    *,
    io_backend: str = "direct",
    layout: str = "page_first_direct",
    write_policy: str = "write_back",
    device_size: int = 128,
    host_ratio: float = 2.0,
    load_back_threshold: int | None = 0,
) -> TreeHarness:
    """SGLang's ``UnifiedRadixCache`` (KV only) with HiCache for ``spec`` on the CPU harness.

    ``load_back_threshold`` overrides the tree's minimum load back (as SGLang's own unit
    fixture does: a small tree's hits are below the default); None keeps SGLang's.
    Raises :class:`~hicache_obs.errors.IntegrationError` where the release has no such tree
    or its tree lacks a call the driver makes.
    """
    if io_backend not in ("kernel", "direct"):
        raise ConfigError(f"io_backend must be 'kernel' or 'direct', got {io_backend!r}")
    if spec.mamba_layer_ids or spec.swa_layer_ids:
        raise ConfigError(f"model {spec.name!r}: the tree harness builds KV-only models")
    if device_size <= 0 or device_size % spec.page_size:
        raise ConfigError(f"device_size must be a positive multiple of page size {spec.page_size}, got {device_size}")
    prepare("cpu")
    api = _api()
    alloc_mod = importlib.import_module("sglang.srt.mem_cache.allocator")
    kv_pool, allocator = _kv_device(spec, device_size, alloc_mod, "cpu")
    kv_pool.device = "cuda"
    _to_cuda_indices(allocator)
    params = _cache_params(api, allocator, spec.page_size, components=(api.ComponentType.FULL,))
    tree = api.UnifiedRadixCache(params)
    with _host_registration_stand_in():
        tree.init_hicache(_server_args(spec, io_backend, layout, write_policy, host_ratio), params)
    controller = _controller_of(tree, "init_hicache", load_back_threshold)
    kv_host = _kv_host(tree, controller)
    h = SGLangHarness(
        spec,
        controller,
        kv_pool,
        allocator,
        kv_host,
        io_backend=io_backend,
        layout=kv_host.layout,
        release=sglang_version() or "",
    )
    _register_buffers(h)
    return TreeHarness(tree, h, api)


# ------------------------------------------------------------------ hybrid (KV + Mamba)
_HI_MAMBA = "sglang.srt.mem_cache.hi_mamba_radix_cache"
HYBRID_TREES = ("unified", "hi_mamba")
"""The trees :func:`build_hybrid_tree` builds: ``UnifiedRadixCache`` with a Mamba component
(``init_hicache``), ``HiMambaRadixCache``."""


def hybrid_trees() -> tuple[str, ...]:
    """The hybrid Mamba trees with HiCache the installed SGLang has, the scheduler's choice first."""
    prepare("cpu")
    found = []
    assembler = _module(_ASSEMBLER)
    if (
        has_unified_hicache()
        and hasattr(_component_types_or_none(), "MAMBA")
        and callable(getattr(assembler, "attach_hybrid_pool_to_unified_cache", None))
    ):
        found.append("unified")
    if isinstance(getattr(_module(_HI_MAMBA), "HiMambaRadixCache", None), type):
        found.append("hi_mamba")
    return tuple(found)


class _Req:
    """What the hybrid trees read of a ``Req`` while it is matched, loaded back and cached:
    its Mamba slot and copy-on-write source, on the request (0.5.1x) or on ``req.kv`` (0.5.2x)."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.kv = self
        self.mamba_pool_idx: torch.Tensor | None = None
        self.mamba_cow_src_index: torch.Tensor | None = None
        self.mamba_needs_clear = False
        self.mamba_ping_pong_track_buffer = None
        self.last_node: Any = None
        self.lock = None
        self.extra_key = None
        self.session = None  # no streaming session
        self.swa_host_hit_length = 0
        self.mamba_host_hit_length = 0

    @property
    def holds_mamba(self) -> bool:
        return self.mamba_pool_idx is not None


def _prefix_state(tokens: Sequence[int], shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """The Mamba state after ``tokens``, one tensor per state buffer: a function of the whole prefix."""
    h = hashlib.blake2b(digest_size=8)
    for t in tokens:
        h.update(int(t).to_bytes(8, "little", signed=True))
    seed = int.from_bytes(h.digest(), "little") & (2**62 - 1)
    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed + i)) for i, shape in enumerate(shapes)]


@dataclass
class HybridServed(Served):
    """A hybrid request: also whether the Mamba state it started from was its prefix's."""

    mamba_loaded: bool = False
    mamba_ok: bool = True


@dataclass
class HybridTreeHarness(TreeHarness):
    """SGLang's hybrid Mamba tree with HiCache, its pools, and the scheduler's calls."""

    kind: str = "unified"
    req_to_token_pool: Any = None

    @property
    def mamba_allocator(self) -> Any:
        return self.harness.mamba_allocator

    def serve(self, tokens: Sequence[int]) -> HybridServed:
        """One scheduler step for one request of ``tokens`` (page-aligned), prefilled and
        finished at once: poll events, match (copying the prefix's Mamba state into the
        request's slot), load back a host hit (KV and Mamba) and read it layer by layer as
        the forward pass does, allocate (evicting through the tree), write its KV and final
        Mamba state, insert it with its Mamba slot and release its lock."""
        api, tree = self.api, self.tree
        key = self._begin(tokens)
        req = _Req(f"req-{len(self.served)}")
        match = tree.match_prefix(api.MatchPrefixParams(key=key, cow_mamba=True, req=req))
        last_node = req.last_node = match.last_device_node
        prefix = self._device_prefix(match)
        device_hit, loaded, mamba_loaded = len(prefix), 0, False
        if match.host_hit_length > 0 or getattr(match, "mamba_host_hit_length", 0) > 0:
            req.mamba_host_hit_length = getattr(match, "mamba_host_hit_length", 0)
            held = req.mamba_pool_idx
            loaded, prefix, last_node = self._load_back(match, req, last_node, prefix)
            mamba_loaded = req.mamba_pool_idx is not None and req.mamba_pool_idx is not held
        self._forward_layers(tree.ready_to_load_host_cache())
        lock = tree.inc_lock_ref(last_node)
        if req.mamba_pool_idx is None:  # alloc_req_slots: the request's own Mamba slot
            req.mamba_pool_idx = self._alloc_mamba()[0]
        if req.mamba_cow_src_index is not None:  # the forward batch's deferred copy-on-write
            self.harness.mamba_pool.copy_from(req.mamba_cow_src_index, req.mamba_pool_idx.unsqueeze(0))
            req.mamba_cow_src_index = None
        n_new = len(tokens) - len(prefix)
        new = api.alloc_token_slots(tree, n_new) if n_new else prefix[:0]
        data_ok, draft_ok = self._check(tokens, prefix), self._check_draft(tokens, prefix)
        mamba_ok = not len(prefix) or self._check_mamba(tokens[: len(prefix)], req.mamba_pool_idx)
        self._fill(tokens, len(prefix), new)
        self._fill_draft(tokens, len(prefix), new)
        self._fill_mamba(tokens, req.mamba_pool_idx)
        indices = torch.cat([prefix, new])
        # cache_finished_req: insert with the request's Mamba slot; the tree keeps it unless the
        # node has a state already
        result = tree.insert(
            api.InsertParams(
                key=key,
                value=indices.to(torch.int64),
                mamba_value=req.mamba_pool_idx.unsqueeze(-1).clone(),
                prev_prefix_len=len(prefix),
            )
        )
        if getattr(result, "mamba_exist", False):
            self.mamba_allocator.free(req.mamba_pool_idx.unsqueeze(0))
        req.mamba_pool_idx = None
        tree.dec_lock_ref(last_node, self._dec_params(lock))
        s = HybridServed(
            tuple(tokens),
            indices,
            device_hit,
            loaded,
            n_new,
            data_ok,
            draft_ok,
            mamba_loaded=mamba_loaded,
            mamba_ok=mamba_ok,
        )
        self.served.append(s)
        return s

    # ------------------------------------------------------------------ helpers
    def _forward_layers(self, producer: int) -> None:
        """Read each layer's KV or Mamba state through the device pools as the model does, each
        read waiting on the load back's layer counter."""
        if producer is None or producer < 0:
            return
        self.controller.layer_done_counter.set_consumer(producer)
        kv = self.allocator.get_kvcache()
        spec = self.harness.spec
        for layer in range(spec.num_layers):
            if layer in spec.mamba_layer_ids:
                self.req_to_token_pool.mamba2_layer_cache(layer)
            else:
                kv.get_key_buffer(layer)

    def _alloc_mamba(self) -> torch.Tensor:
        slot = self.mamba_allocator.alloc(1)
        if slot is None:  # the scheduler evicts Mamba states through the tree first
            self.tree.evict(self.api.EvictParams(num_tokens=0, mamba_num=1))
            slot = self.mamba_allocator.alloc(1)
        if slot is None:
            raise ConfigError("the Mamba device pool has no free slot, the tree evicting none")
        return slot  # type: ignore[no-any-return]

    def _state_buffers(self) -> list[torch.Tensor]:
        cache = self.harness.mamba_pool.mamba_cache
        return [cache.temporal, *cache.conv]  # read_mamba's order

    def _fill_mamba(self, tokens: Sequence[int], slot: torch.Tensor) -> None:
        bufs = self._state_buffers()
        with _PLAIN():
            idx = slot.detach().reshape(1).clone().as_subclass(torch.Tensor).to(torch.int64)
            for buf, value in zip(bufs, _prefix_state(tokens, [b[:, 0].shape for b in bufs])):
                buf[:, idx] = value.unsqueeze(1).to(buf.dtype)

    def _check_mamba(self, tokens: Sequence[int], slot: torch.Tensor) -> bool:
        """Whether the Mamba slot holds the state after ``tokens``."""
        bufs = self._state_buffers()
        got = self.harness.read_mamba(slot.reshape(1))
        want = _prefix_state(tokens, [b[:, 0].shape for b in bufs])
        return all(torch.equal(g[:, 0], w.to(b.dtype).float()) for g, w, b in zip(got, want, bufs))


def _hybrid_device(spec: ModelSpec, device_size: int, mamba_slots: int, max_reqs: int) -> tuple[Any, Any, Any]:
    """SGLang's device pools for a hybrid Mamba model as its model runner builds them: the
    request pool with the Mamba pool, the hybrid KV pool over it, and the KV allocator."""
    mp = importlib.import_module("sglang.srt.mem_cache.memory_pool")
    alloc_mod = importlib.import_module("sglang.srt.mem_cache.allocator")
    mu = importlib.import_module("sglang.srt.configs.mamba_utils")
    missing = [n for n in ("HybridReqToTokenPool", "HybridLinearKVPool") if not hasattr(mp, n)]
    if missing:
        raise IntegrationError(f"SGLang {sglang_version()}: no {', '.join(missing)} in {mp.__name__}")
    req_pool = mp.HybridReqToTokenPool(
        **_kw(
            mp.HybridReqToTokenPool.__init__,
            size=max_reqs,
            mamba_size=mamba_slots,
            mamba_spec_state_size=max_reqs,
            max_context_len=device_size,
            device="cpu",
            enable_memory_saver=False,
            cache_params=_mamba_params(spec, mu),
            mamba_layer_ids=list(spec.mamba_layer_ids),
            # page_size > 1 needs the extra buffer (MambaRadixCache asserts it); the driver
            # inserts each request's own state slot, so its ping-pong buffers stay unused
            enable_mamba_extra_buffer=spec.page_size > 1,
            speculative_num_draft_tokens=None,
        )
    )
    kv_pool = mp.HybridLinearKVPool(
        **_kw(
            mp.HybridLinearKVPool.__init__,
            size=device_size,
            dtype=spec.dtype,
            page_size=spec.page_size,
            head_num=spec.num_kv_heads,
            head_dim=spec.head_dim,
            full_attention_layer_ids=list(spec.kv_layer_ids),
            enable_kvcache_transpose=False,
            device="cpu",
            mamba_pool=req_pool.mamba_pool,
            enable_memory_saver=False,
        )
    )
    return req_pool, kv_pool, _kv_allocator(spec, device_size, alloc_mod, kv_pool, "cpu")


def _mamba_chunk_size(args: Any, spec: ModelSpec) -> None:
    """The Mamba cache chunk a hybrid tree's match reads off the global server arguments
    (``ServerArgs.mamba_cache_chunk_size`` resolves a model's config otherwise), as SGLang's
    own unit fixture presets it; the arguments are made the process's global."""
    mod = importlib.import_module("sglang.srt.server_args")
    chunk = max(int(getattr(mod, "FLA_CHUNK_SIZE", 64)), spec.page_size)
    if isinstance(args, SimpleNamespace):
        args.mamba_cache_chunk_size = chunk
    else:  # the property's cache, where SGLang's fixture presets it: no public setter
        vars(args)["_mamba_cache_chunk_size"] = chunk
    set_global = getattr(mod, "set_global_server_args_for_scheduler", None)
    if set_global is not None:
        set_global(args)


def build_hybrid_tree(
    spec: ModelSpec | None = None,
    *,
    io_backend: str = "direct",
    layout: str = "page_first_direct",
    write_policy: str = "write_through",
    device_size: int = 128,
    host_ratio: float = 2.0,
    mamba_slots: int | None = None,
    max_reqs: int = 8,
    tree: str | None = None,
    load_back_threshold: int | None = 0,
) -> HybridTreeHarness:
    """SGLang's hybrid Mamba tree with HiCache for ``spec`` (default ``tiny_hybrid``) on the CPU
    harness, built through SGLang's own path: ``UnifiedRadixCache`` with a Mamba component and
    ``init_hicache`` (``tree="unified"``), or ``HiMambaRadixCache`` (``"hi_mamba"``); None: the
    first of :func:`hybrid_trees`. ``mamba_slots``: the Mamba device pool (default one per page
    of ``device_size``). ``load_back_threshold`` as in :func:`build_tree`.

    Raises :class:`~hicache_obs.errors.IntegrationError` where the release has no such tree or
    lacks a part or call the driver needs.
    """
    spec = spec or ModelSpec.tiny_hybrid()
    if io_backend not in ("kernel", "direct"):
        raise ConfigError(f"io_backend must be 'kernel' or 'direct', got {io_backend!r}")
    if not spec.mamba_layer_ids or spec.swa_layer_ids:
        raise ConfigError(f"model {spec.name!r}: the hybrid tree harness builds KV + Mamba models")
    if device_size <= 0 or device_size % spec.page_size:
        raise ConfigError(f"device_size must be a positive multiple of page size {spec.page_size}, got {device_size}")
    if tree is not None and tree not in HYBRID_TREES:
        raise ConfigError(f"tree must be one of {', '.join(HYBRID_TREES)}, got {tree!r}")
    available = hybrid_trees()
    kind = tree or next(iter(available), None)
    if kind not in available:
        missing = {
            "unified": "UnifiedRadixCache with init_hicache, a Mamba component and attach_hybrid_pool_to_unified_cache",
            "hi_mamba": f"{_HI_MAMBA}.HiMambaRadixCache",
        }
        what = " nor ".join(missing.values()) if kind is None else missing[kind]
        raise IntegrationError(f"SGLang {sglang_version()} has no {what}: cannot build a hybrid Mamba tree")
    api = _api("UnifiedRadixCache", _URC) if kind == "unified" else _api("HiMambaRadixCache", _HI_MAMBA)
    req_pool, kv_pool, allocator = _hybrid_device(
        spec, device_size, mamba_slots or device_size // spec.page_size, max_reqs
    )
    mamba_pool = req_pool.mamba_pool
    mamba_allocator = getattr(req_pool, "mamba_allocator", None) or mamba_pool  # own allocator from 0.5.13
    for obj in (kv_pool, kv_pool.full_kv_pool, mamba_pool, req_pool):
        obj.device = "cuda"
    _to_cuda_indices(allocator, mamba_allocator)
    components = (api.ComponentType.FULL, api.ComponentType.MAMBA) if kind == "unified" else None
    params = _cache_params(
        api,
        allocator,
        spec.page_size,
        req_to_token_pool=req_pool,
        components=components,
        enable_mamba_extra_buffer=req_pool.enable_mamba_extra_buffer,
    )
    args = _server_args(spec, io_backend, layout, write_policy, host_ratio)
    _mamba_chunk_size(args, spec)
    with _host_registration_stand_in():
        if kind == "unified":
            cache = api.Tree(params)
            cache.init_hicache(args, params)
        else:
            cache = api.Tree(params=params, server_args=args)
    controller = _controller_of(cache, f"the {kind} tree", load_back_threshold)
    kv_host = _kv_host(cache, controller)
    h = SGLangHarness(
        spec,
        controller,
        kv_pool.full_kv_pool,
        allocator,
        kv_host,
        mamba_pool=mamba_pool,
        mamba_allocator=mamba_allocator,
        mamba_host=_mamba_host(cache, controller),
        io_backend=io_backend,
        layout=kv_host.layout,
        release=sglang_version() or "",
    )
    _register_buffers(h)
    return HybridTreeHarness(cache, h, api, kind=kind, req_to_token_pool=req_pool)


def _mamba_host(tree: Any, controller: Any) -> Any:
    """The Mamba host pool SGLang built: the tree's, else the Mamba entry of the host pool group."""
    pool = getattr(tree, "mamba_pool_host", None)
    if pool is None:
        group = controller.mem_pool_host
        names = importlib.import_module("sglang.srt.mem_cache.hicache_storage").PoolName
        get_pool = getattr(group, "get_pool", None)
        pool = get_pool(names.MAMBA) if get_pool else None
    if pool is None:
        raise IntegrationError(f"SGLang {sglang_version()}: no Mamba host pool found on the tree or its controller")
    return pool


# ------------------------------------------------------------ SWA (KV + sliding-window KV)
_SWA_POOL = "sglang.srt.mem_cache.swa_memory_pool"
# SWATokenToKVPoolAllocator moved from swa_memory_pool.py (0.5.12) to allocator/swa.py (0.5.13)
_SWA_ALLOCATOR = ("sglang.srt.mem_cache.allocator.swa", _SWA_POOL)


def swa_tree_missing() -> str | None:
    """What the installed SGLang lacks to build an SWA tree with HiCache (``UnifiedRadixCache``
    with ``init_hicache``, an SWA component, SGLang's SWA pool and allocator, and the
    assembler's ``attach_hybrid_pool_to_unified_cache`` that builds its host pools); None
    where it has all of them."""
    prepare("cpu")
    if not has_unified_hicache():
        return f"no {_URC}.UnifiedRadixCache with init_hicache"
    if not hasattr(_component_types_or_none(), "SWA"):
        return f"no ComponentType.SWA in {' or '.join(_COMPONENT_TYPES)}"
    if not callable(getattr(_module(_ASSEMBLER), "attach_hybrid_pool_to_unified_cache", None)):
        return f"no {_ASSEMBLER}.attach_hybrid_pool_to_unified_cache"
    if not isinstance(getattr(_module(_SWA_POOL), "SWAKVPool", None), type):
        return f"no {_SWA_POOL}.SWAKVPool"
    if _swa_allocator_cls() is None:
        return f"no SWATokenToKVPoolAllocator in {' or '.join(_SWA_ALLOCATOR)}"
    return None


def _swa_allocator_cls() -> Any:
    for name in _SWA_ALLOCATOR:
        cls = getattr(_module(name), "SWATokenToKVPoolAllocator", None)
        if isinstance(cls, type):
            return cls
    return None


@dataclass
class SWAServed(Served):
    """An SWA request: also whether the sliding-window rows it read (the last window of its
    prefix, the only ones an SWA layer reads) held its prefix's values."""

    swa_ok: bool = True
    swa_host_hit: int = 0  # the match's SWA host hit (0.5.13 and later report one)


@dataclass
class SWATreeHarness(TreeHarness):
    """SGLang's ``UnifiedRadixCache`` with full and SWA components and HiCache, its pools, and
    the scheduler's calls. The device KV pool is SGLang's ``SWAKVPool``: the full layers'
    pool (:attr:`SGLangHarness.kv_pool`, checked like a KV-only tree's) and the SWA layers'
    pool (:attr:`swa_pool`), whose slots the allocator maps from the full ones
    (``full_to_swa_index_mapping``)."""

    swa_pool: Any = None
    window: int = 0

    def serve(self, tokens: Sequence[int]) -> SWAServed:
        """One scheduler step for one request of ``tokens`` (page-aligned), prefilled and
        finished at once: poll events, match, load back a host hit (full KV and the window's
        SWA KV) and read it layer by layer as the forward pass does, allocate full and SWA
        slots (evicting through the tree), write its KV, insert it and release its lock."""
        api, tree = self.api, self.tree
        key = self._begin(tokens)
        match = tree.match_prefix(api.MatchPrefixParams(key=key))
        last_node = match.last_device_node
        prefix = self._device_prefix(match)
        device_hit, loaded = len(prefix), 0
        swa_hit = int(getattr(match, "swa_host_hit_length", 0))
        req = SimpleNamespace(  # what an SWA load back reads and writes of a Req
            rid=f"req-{len(self.served)}",
            last_node=last_node,
            swa_host_hit_length=swa_hit,
            mamba_host_hit_length=0,
            kv=_req_kv(),
            mamba_pool_idx=None,
        )
        if match.host_hit_length > 0 or swa_hit > 0:
            loaded, prefix, last_node = self._load_back(match, req, last_node, prefix)
        self._forward_layers(tree.ready_to_load_host_cache())
        lock = tree.inc_lock_ref(last_node)
        n_new = len(tokens) - len(prefix)
        new = self._alloc(n_new) if n_new else prefix[:0]
        data_ok = self._check(tokens, prefix)
        swa_ok = self._check_swa(tokens, prefix)
        self._fill(tokens, len(prefix), new)
        self._fill_swa(tokens, len(prefix), new)
        indices = torch.cat([prefix, new])
        # cache_finished_req: insert what the request holds (its SWA rows from the window the
        # load back left it: the evicted seqlen), then release its lock
        insert = api.InsertParams(key=key, value=indices.to(torch.int64), prev_prefix_len=len(prefix))
        evicted = self._swa_evicted(req)
        if hasattr(insert, "set_evicted_seqlen"):
            insert.set_evicted_seqlen(self._swa_type(), evicted)
        elif hasattr(insert, "swa_evicted_seqlen"):
            insert.swa_evicted_seqlen = evicted
        tree.insert(insert)
        tree.dec_lock_ref(last_node, self._dec_params(lock))
        s = SWAServed(
            tuple(tokens), indices, device_hit, loaded, n_new, data_ok, None, swa_ok=swa_ok, swa_host_hit=swa_hit
        )
        self.served.append(s)
        return s

    # ------------------------------------------------------------------ helpers
    def _swa_type(self) -> Any:
        return self.api.ComponentType.SWA

    def _swa_evicted(self, req: Any) -> int:
        get = getattr(req.kv, "get_evicted_seqlen", None)
        return int(get(self._swa_type())) if callable(get) else 0

    def _alloc(self, n: int) -> torch.Tensor:
        """``n`` (page-aligned) full slots with SWA peers, evicting through the tree first as
        the scheduler does (``evict_from_tree_cache``). At page size 1 the allocator's own
        ``alloc``; above it (whose ``alloc`` asserts page size 1 and whose ``alloc_extend``
        runs a GPU kernel) the pages of both sub-allocators, mapped as ``alloc_extend`` maps
        them (SGLang's own unit fixture allocates the same way)."""
        evict = getattr(_module(_COMMON), "evict_from_tree_cache", None)
        if not callable(evict):
            raise IntegrationError(f"SGLang {sglang_version()}: no {_COMMON}.evict_from_tree_cache")
        evict(self.tree, n)
        allocator = self.allocator
        if self.harness.spec.page_size == 1:
            out = allocator.alloc(n)
        else:
            if n > allocator.full_attn_allocator.available_size() or n > allocator.swa_attn_allocator.available_size():
                out = None
            else:
                full = allocator.full_attn_allocator.alloc(n)
                swa = allocator.swa_attn_allocator.alloc(n)
                set_mapping = getattr(allocator, "set_full_to_swa_mapping", None)
                if callable(set_mapping):
                    set_mapping(full, swa)
                else:
                    allocator.full_to_swa_index_mapping[full] = swa.to(torch.int64)
                out = full
        if out is None:
            raise ConfigError(
                f"the SWA device pools have no {n} free slots (full {allocator.full_available_size()}, "
                f"SWA {allocator.swa_available_size()}), the tree evicting none"
            )
        return out  # type: ignore[no-any-return]

    def _forward_layers(self, producer: int) -> None:
        """Read each layer's KV through the SWA device pool as the model does, each read
        waiting on the load back's layer counter."""
        if producer is None or producer < 0:
            return
        self.controller.layer_done_counter.set_consumer(producer)
        kv = self.allocator.get_kvcache()
        for layer in range(self.harness.spec.num_layers):
            kv.get_key_buffer(layer)

    def _swa_layers(self) -> list[torch.Tensor]:
        return [*self.swa_pool.k_buffer, *self.swa_pool.v_buffer]

    def _swa_row_shape(self) -> tuple[int, ...]:
        layers = self._swa_layers()
        return (len(layers), *layers[0].shape[1:])

    def _swa_slots(self, indices: torch.Tensor) -> torch.Tensor:
        with _PLAIN():
            idx = indices.detach().clone().as_subclass(torch.Tensor).to(torch.int64)
            mapping = self.allocator.full_to_swa_index_mapping.detach().as_subclass(torch.Tensor)
            return mapping[idx].clone()

    def _fill_swa(self, tokens: Sequence[int], start: int, indices: torch.Tensor) -> None:
        if not len(indices):
            return
        rows = _prefix_rows(tokens, start, self._swa_row_shape(), _SWA_SALT)
        slots = self._swa_slots(indices)
        with _PLAIN():
            for i, buf in enumerate(self._swa_layers()):
                buf[slots] = rows[i].to(buf.dtype)

    def _check_swa(self, tokens: Sequence[int], indices: torch.Tensor) -> bool:
        """Whether the SWA rows of the prefix's last window (the rows an SWA layer reads; those
        before it may be gone) hold the values of ``tokens``' rows there."""
        n = len(indices)
        if not n:
            return True
        start = max(0, n - self.window)
        slots = self._swa_slots(indices[start:])
        if bool((slots <= 0).any()):  # no SWA peer mapped (slot 0 is SGLang's padding slot)
            return False
        layers = self._swa_layers()
        want = _prefix_rows(tokens[:n], start, self._swa_row_shape(), _SWA_SALT).to(layers[0].dtype).float()
        with _PLAIN():
            got = torch.stack([buf[slots].float() for buf in layers])
        return bool(torch.equal(got, want))


_SWA_SALT = b"swa"


def _req_kv() -> Any:
    """A request's ``kv`` record: SGLang's ``ReqKvInfo`` where the release has one (0.5.2x: the
    SWA load back records the window's start on it), else what a KV-only load back reads."""
    info = getattr(_module("sglang.srt.managers.schedule_batch"), "ReqKvInfo", None)
    if not isinstance(info, type):
        return SimpleNamespace(mamba_pool_idx=None)
    return info(**_kw(info, kv_allocated_len=0, swa_evicted_seqlen=0))  # 0.5.1x: required fields


def _get_and_clear_swa_pages(
    full_page_representatives: torch.Tensor,
    mapping: torch.Tensor,
    page_size: int,
    check_page_mappings: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Torch ops for SGLang's Triton ``get_and_clear_swa_pages``
    (``sglang/kernels/ops/memory/allocator.py``, 0.5.2x), which the SWA allocator calls on
    CUDA index tensors to free SWA pages: each full page's SWA page and whether it had one
    (and, checked, whether the page's slots all map into it), its mapping cleared."""
    reps = full_page_representatives.to(torch.int64)
    swa_reps = mapping[reps]
    starts = reps // page_size * page_size
    offsets = (starts[:, None] + torch.arange(page_size, dtype=torch.int64)[None, :]).reshape(-1)
    valid = None
    if check_page_mappings:
        page_mapping = mapping[offsets].reshape(-1, page_size)
        same_page = page_mapping // page_size == swa_reps[:, None] // page_size
        valid = (swa_reps > 0) & (((page_mapping > 0) & ~same_page).sum(dim=1) == 0)
    swa_pages, peers_mapped = swa_reps // page_size, swa_reps > 0
    mapping[offsets] = 0
    return swa_pages, peers_mapped, valid


def _swa_kernel_stand_ins() -> None:
    """The SWA allocator's Triton kernel, where the release's allocator calls one, replaced
    by :func:`_get_and_clear_swa_pages` (Triton has no CPU driver)."""
    for name in _SWA_ALLOCATOR:
        mod = _module(name)
        if mod is not None and callable(getattr(mod, "get_and_clear_swa_pages", None)):
            mod.get_and_clear_swa_pages = _get_and_clear_swa_pages


def _named(fn: Any, **candidates: Any) -> dict[str, Any]:
    """The candidates ``fn`` names (not those its ``**kwargs`` would pass on: ``SWAKVPool``
    hands those to its inner pools, which take fewer on 0.5.2x)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in candidates.items() if k in params and params[k].kind is not params[k].VAR_KEYWORD}


def _swa_device(spec: ModelSpec, device_size: int, swa_size: int) -> tuple[Any, Any]:
    """SGLang's ``SWAKVPool`` (full and SWA layers' pools) and its ``SWATokenToKVPoolAllocator``,
    as the model runner builds them for a sliding-window model."""
    pool_cls = _module(_SWA_POOL).SWAKVPool
    kv_pool = pool_cls(
        **_named(
            pool_cls.__init__,
            size=device_size,
            size_swa=swa_size,
            page_size=spec.page_size,
            dtype=spec.dtype,
            head_num=spec.num_kv_heads,
            head_dim=spec.head_dim,
            swa_attention_layer_ids=list(spec.swa_layer_ids),
            full_attention_layer_ids=[i for i in range(spec.num_layers) if i not in spec.swa_layer_ids],
            enable_kvcache_transpose=False,
            device="cpu",
            enable_memory_saver=False,
        )
    )
    alloc_cls = _swa_allocator_cls()
    allocator = alloc_cls(
        **_kw(
            alloc_cls.__init__,
            size=device_size,
            size_swa=swa_size,
            page_size=spec.page_size,
            dtype=spec.dtype,
            device="cpu",
            kvcache=kv_pool,
            need_sort=False,
        )
    )
    return kv_pool, allocator


def _swa_host(tree: Any, controller: Any) -> Any:
    """The SWA host pool SGLang built: the tree's, else the SWA entry of the host pool group."""
    pool = getattr(tree, "swa_kv_pool_host", None)
    if pool is None:
        get_pool = getattr(controller.mem_pool_host, "get_pool", None)
        names = importlib.import_module("sglang.srt.mem_cache.hicache_storage").PoolName
        pool = get_pool(names.SWA) if get_pool else None
    if pool is None:
        raise IntegrationError(f"SGLang {sglang_version()}: no SWA host pool found on the tree or its controller")
    return pool


def build_swa_tree(
    spec: ModelSpec | None = None,
    *,
    io_backend: str = "direct",
    layout: str = "page_first_direct",
    write_policy: str = "write_through",
    device_size: int = 128,
    swa_size: int | None = None,
    host_ratio: float = 2.0,
    load_back_threshold: int | None = 0,
) -> SWATreeHarness:
    """SGLang's ``UnifiedRadixCache`` with full and SWA components and HiCache for ``spec``
    (default ``tiny_swa``) on the CPU harness, built through SGLang's own path (``SWAKVPool``,
    ``SWATokenToKVPoolAllocator``, ``init_hicache``, whose assembler builds the KV and SWA
    host pools and the ``HybridCacheController``). ``swa_size``: the SWA device pool (default
    ``device_size``). ``load_back_threshold`` as in :func:`build_tree`.

    Raises :class:`~hicache_obs.errors.IntegrationError` where the release lacks a part
    (:func:`swa_tree_missing` says which) or a call the driver makes.
    """
    spec = spec or ModelSpec.tiny_swa()
    if io_backend not in ("kernel", "direct"):
        raise ConfigError(f"io_backend must be 'kernel' or 'direct', got {io_backend!r}")
    if not spec.swa_layer_ids or spec.mamba_layer_ids or not spec.swa_window:
        raise ConfigError(f"model {spec.name!r}: the SWA tree harness builds KV + sliding-window KV models")
    swa_size = device_size if swa_size is None else swa_size
    for name, size in (("device_size", device_size), ("swa_size", swa_size)):
        if size <= 0 or size % spec.page_size:
            raise ConfigError(f"{name} must be a positive multiple of page size {spec.page_size}, got {size}")
    missing = swa_tree_missing()
    if missing is not None:
        raise IntegrationError(f"SGLang {sglang_version()} has {missing}: cannot build an SWA tree")
    api = _api()
    _swa_kernel_stand_ins()
    kv_pool, allocator = _swa_device(spec, device_size, swa_size)
    for obj in (kv_pool, kv_pool.full_kv_pool, kv_pool.swa_kv_pool):
        obj.device = "cuda"
    _to_cuda_indices(allocator.full_attn_allocator, allocator.swa_attn_allocator)
    allocator.device = "cuda"
    params = _cache_params(
        api,
        allocator,
        spec.page_size,
        components=(api.ComponentType.FULL, api.ComponentType.SWA),
        sliding_window_size=spec.swa_window,
    )
    if getattr(params, "sliding_window_size", None) != spec.swa_window:
        raise IntegrationError(f"SGLang {sglang_version()}: CacheInitParams takes no sliding_window_size")
    args = _server_args(spec, io_backend, layout, write_policy, host_ratio)
    with _host_registration_stand_in():
        tree = api.UnifiedRadixCache(params)
        tree.init_hicache(args, params)
    controller = _controller_of(tree, "init_hicache", load_back_threshold)
    kv_host = _kv_host(tree, controller)
    swa_host = _swa_host(tree, controller)
    h = SGLangHarness(
        spec,
        controller,
        kv_pool.full_kv_pool,
        allocator,
        kv_host,
        io_backend=io_backend,
        layout=kv_host.layout,
        release=sglang_version() or "",
    )
    h.extras.update(swa_pool=kv_pool.swa_kv_pool, swa_host=swa_host)
    _register_buffers(h)
    _register_pool_buffers(kv_pool.swa_kv_pool, swa_host)
    return SWATreeHarness(tree, h, api, swa_pool=kv_pool.swa_kv_pool, window=spec.swa_window)
