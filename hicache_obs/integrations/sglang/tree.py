"""SGLang's own ``UnifiedRadixCache`` with HiCache on the CPU harness, driven as the scheduler
drives it (test support).

:func:`build_tree` builds the device pool and allocator with :mod:`.testing`'s pieces, then
the tree and its HiCache through SGLang's own construction path (``init_hicache``, which
builds the host pool group and the controller); the CPU stand-ins are applied to what
SGLang built (CPU streams, buffers registered for the copy stand-ins). :class:`TreeHarness`
serves one request per scheduler step with SGLang's calls: ``check_hicache_events``,
``match_prefix``, ``init_load_back``, ``ready_to_load_host_cache``, ``alloc_token_slots``
(which evicts through the tree), ``insert`` and the lock calls of a finished request.

Each token's KV rows hold values derived from the token's whole prefix, as a model's would,
so rows reached by any path (a device hit, a load back, a recompute) can be checked.
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

from ...core.spec import ModelSpec
from ...errors import ConfigError, IntegrationError
from .cpu_server import _NoHostRegistration
from .testing import (
    _PLAIN,
    SGLangHarness,
    _kv_device,
    _module,
    _register_buffers,
    _to_cuda_indices,
    _use_cpu_streams,
    prepare,
    sglang_version,
)

__all__ = ["Served", "TreeHarness", "build_tree", "has_unified_hicache"]

_URC = "sglang.srt.mem_cache.unified_radix_cache"
_BASE = "sglang.srt.mem_cache.base_prefix_cache"
_COMMON = "sglang.srt.mem_cache.common"
_COMPONENT_TYPES = (
    "sglang.srt.mem_cache.unified_cache_components",
    "sglang.srt.mem_cache.unified_cache.component_type",
)


def has_unified_hicache() -> bool:
    """Whether the installed SGLang has a ``UnifiedRadixCache`` with ``init_hicache``."""
    prepare("cpu")
    try:
        cls = importlib.import_module(_URC).UnifiedRadixCache
    except (ImportError, AttributeError):
        return False
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


def _component_types() -> Any:
    for name in _COMPONENT_TYPES:
        try:
            return importlib.import_module(name).ComponentType
        except (ImportError, AttributeError):
            continue
    raise IntegrationError(f"SGLang {sglang_version()}: no ComponentType in {' or '.join(_COMPONENT_TYPES)}")


def _prefix_rows(tokens: Sequence[int], start: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The KV rows of ``tokens[start:]``: each a function of the token's whole prefix."""
    h = hashlib.blake2b(digest_size=8)
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
    were loaded back from the host, and whether the rows it read held its prefix's values."""

    tokens: tuple[int, ...]
    indices: torch.Tensor
    device_hit: int
    loaded: int
    new: int
    data_ok: bool


@dataclass
class TreeHarness:
    """SGLang's tree with the controller SGLang built for it, its pools, and the scheduler's calls."""

    tree: Any
    harness: SGLangHarness
    api: SimpleNamespace
    served: list[Served] = field(default_factory=list)

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
        page = self.harness.spec.page_size
        if not tokens or len(tokens) % page:
            raise ConfigError(f"a request's length must be a positive multiple of page size {page}, got {len(tokens)}")
        self.step()
        key = api.RadixKey(array("q", tokens) if api.array_keys else list(tokens))
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
            )
            with self._locked(last_node):  # the prefill adder holds the device prefix meanwhile
                got, last_node = tree.init_load_back(
                    api.InitLoadBackParams(
                        best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req
                    )
                )
            if isinstance(got, torch.Tensor):
                loaded, prefix = len(got), torch.cat([prefix, got])
            else:  # a count, and the tree gives the path's device indices
                loaded, prefix = int(got), tree.path_device_indices(last_node)
        tree.ready_to_load_host_cache()
        lock = tree.inc_lock_ref(last_node)
        n_new = len(tokens) - len(prefix)
        new = api.alloc_token_slots(tree, n_new) if n_new else prefix[:0]
        data_ok = self._check(tokens, prefix)
        self._fill(tokens, len(prefix), new)
        indices = torch.cat([prefix, new])
        # cache_finished_req: insert what the request holds, then release its lock
        tree.insert(api.InsertParams(key=key, value=indices.to(torch.int64), prev_prefix_len=len(prefix)))
        tree.dec_lock_ref(last_node, self._dec_params(lock))
        s = Served(tuple(tokens), indices, device_hit, loaded, n_new, data_ok)
        self.served.append(s)
        return s

    # ------------------------------------------------------------------ helpers
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


def _api() -> SimpleNamespace:
    base = importlib.import_module(_BASE)
    urc = importlib.import_module(_URC)
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
        UnifiedRadixCache=urc,
    )
    missing = [f"{mod.__name__}.{n}" for n, mod in names.items() if getattr(mod, n, None) is None]
    if missing:
        raise IntegrationError(f"SGLang {sglang_version()}: no {', '.join(missing)}; cannot build the tree")
    api = SimpleNamespace(**{n: getattr(mod, n) for n, mod in names.items()}, ComponentType=_component_types())
    # 0.5.2x's RadixKey holds an array('q'); earlier ones a list
    token_ids = inspect.signature(api.RadixKey).parameters.get("token_ids")
    api.array_keys = token_ids is not None and "array" in str(token_ids.annotation)
    match_fields = getattr(base.MatchResult, "_fields", None) or [f.name for f in dataclasses.fields(base.MatchResult)]
    if "device_indices" not in match_fields:
        _required(api.UnifiedRadixCache, ("path_device_indices",), "UnifiedRadixCache (its match gives no indices)")
    _required(
        api.UnifiedRadixCache,
        (
            "init_hicache",
            "match_prefix",
            "insert",
            "evict",
            "inc_lock_ref",
            "dec_lock_ref",
            "init_load_back",
            "ready_to_load_host_cache",
            "check_hicache_events",
        ),
        "UnifiedRadixCache",
    )
    return api


def _server_args(spec: ModelSpec, io_backend: str, layout: str, write_policy: str, host_ratio: float) -> Any:
    """The server arguments ``init_hicache`` reads. Where ``ServerArgs`` is a dataclass whose
    constructor resolves a model (0.5.1x), its declared defaults with the HiCache settings;
    otherwise a real ``ServerArgs``, made the process's global (its runtime getters read that,
    as SGLang's own unit fixture sets it)."""
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
    if dataclasses.is_dataclass(cls):
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


def _cache_params(api: SimpleNamespace, allocator: Any, page_size: int) -> Any:
    cls = api.CacheInitParams
    params = inspect.signature(cls).parameters
    kw: dict[str, Any] = dict(
        disable=False,
        req_to_token_pool=None,  # only the request paths read it; the driver inserts directly
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        tree_components=(api.ComponentType.FULL,),
    )
    if "tree_core_backend" in params:
        kw["tree_core_backend"] = "python"  # SGLang's Python tree core (a Rust one may be selected by default)
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
    mp = importlib.import_module("sglang.srt.mem_cache.memory_pool")
    alloc_mod = importlib.import_module("sglang.srt.mem_cache.allocator")
    kv_pool, allocator = _kv_device(spec, device_size, mp, alloc_mod, "cpu")
    kv_pool.device = "cuda"
    _to_cuda_indices(allocator)
    params = _cache_params(api, allocator, spec.page_size)
    tree = api.UnifiedRadixCache(params)
    with _host_registration_stand_in():
        tree.init_hicache(_server_args(spec, io_backend, layout, write_policy, host_ratio), params)
    controller = getattr(tree, "cache_controller", None)
    if controller is None:
        raise IntegrationError(f"SGLang {sglang_version()}: init_hicache attached no cache_controller to the tree")
    _use_cpu_streams(controller)
    if load_back_threshold is not None:
        tree.load_back_threshold = load_back_threshold
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
