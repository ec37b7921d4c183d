"""SGLang's real server (``python -m sglang.launch_server``) on a machine without a GPU (test support).

SGLang 0.5.23 serves on a CPU (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``) a small
model with HiCache on, once a few things a CPU-only torch lacks are stood in for. What
:func:`install` puts in place, in each server process (the launcher, the tokenizer
manager, one scheduler per TP rank), is exactly this; everything else is SGLang's code:

==================================  =====================================================
stand-in                            why
==================================  =====================================================
``torchvision`` (import only)       SGLang's config package imports it; PyPI's wheels need
                                    CUDA libraries beside a CPU torch
``sgl_kernel`` ``*_cpu`` names      imported at import time under ``is_cpu()``; never
                                    called (the AMX backend stays off, fused ops run their
                                    ``forward_native``); raise, naming themselves, if called
``sgl_kernel.kvcacheio`` ops        the host pools' copy kernels, CUDA-only: torch
                                    implementations with sgl-kernel's checks (index tensors
                                    must be on the device pool's device, here the CPU)
``transfer_mamba`` ops (0.5.23)     the Mamba host pool's JIT copy kernels, CUDA-only
``torch.cuda.cudart()`` host        the host pools register pinned memory with the CUDA
registration                        runtime; on a CPU the memory is ordinary and the
                                    registration succeeds doing nothing
``torch.cpu.Stream.synchronize``    the transfer engine's error path calls it; a CPU stream
                                    has nothing to wait for
short convolution (LFM2)            ``causal_conv1d_fn``/``causal_conv1d_update`` are Triton
                                    kernels off CUDA: torch implementations
                                    (:mod:`.cpu_conv`), checked against a plain convolution
Mamba2 SSD scan (NemotronH)         ``mamba_chunk_scan_combined``/``selective_state_update``
                                    are Triton kernels, and ``mamba.py`` binds the short
                                    convolution only under ``is_cuda()``: torch
                                    implementations (:mod:`.cpu_mamba2`), checked against
                                    a plain per-token recurrence
``torch_native`` sliding-window     SGLang's ``torch_native`` backend reads a sliding-window
reads (Mellum, Laguna)              layer's SWA buffer with full-pool slots; its
                                    ``forward_extend``/``forward_decode`` translate them
                                    first for such layers, as the AMX backend does
                                    (:mod:`.cpu_swa`)
paged allocator slots (0.5.10,      ``--page-size`` above 1: the paged allocator launches
0.5.11)                             Triton kernels on any device (0.5.23 falls back to
                                    torch): torch implementations (:mod:`.cpu_alloc`)
==================================  =====================================================

The boot folder ``_cpu_boot/`` holds a ``sitecustomize`` that calls :func:`install` in
every Python process started with ``HICACHE_OBS_SGLANG_CPU=1`` and that folder on
``PYTHONPATH`` (:func:`server_environment` returns such an environment), except
``hicache-obs instrument`` (:func:`replaced_by_its_command`).
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import threading
import time
import types
import weakref
from pathlib import Path
from typing import Any

__all__ = ["BOOT_DIR", "ENABLE", "install", "replaced_by_its_command", "server_environment", "STAND_INS"]

ENABLE = "HICACHE_OBS_SGLANG_CPU"
"""The environment variable that switches :func:`install` on in the boot ``sitecustomize``."""

BOOT_DIR = str(Path(__file__).resolve().parent / "_cpu_boot")
"""The folder whose ``sitecustomize`` calls :func:`install`."""

STAND_INS = (
    ("torchvision", "import-only package; SGLang's config package imports it"),
    ("sgl_kernel *_cpu names", "imported under is_cpu() at import time, never called"),
    ("sgl_kernel.kvcacheio", "torch copies with sgl-kernel's checks; indices on the device pool's device"),
    ("sglang.kernels.ops.mamba.transfer_mamba", "torch copies of the Mamba host pool's JIT kernels"),
    ("torch.cuda.cudart host registration", "pinned-memory registration is a successful no-op"),
    ("torch.cpu.Stream.synchronize", "the transfer engine's error path calls it"),
    ("causal_conv1d_fn / causal_conv1d_update", "torch short convolution for LFM2 (Triton off CUDA)"),
    ("mamba_chunk_scan_combined / selective_state_update", "torch Mamba2 scan for MambaMixer2 (Triton off CUDA)"),
    ("TorchNativeAttnBackend sliding-window reads", "SWA layers read req_to_token translated full -> SWA"),
    ("alloc_extend_kernel / alloc_decode_kernel (0.5.10, 0.5.11)", "paged allocator slots in torch (Triton off CUDA)"),
)
"""Every stand-in :func:`install` puts in place, with why; all other code is SGLang's."""

_done = threading.Lock()
_state: dict[str, Any] = {}

# modules whose CUDA-guarded imports of the copy ops are filled in once they have run
_BIND_AFTER = frozenset(
    {
        "sglang.srt.mem_cache.memory_pool_host",
        "sglang.srt.mem_cache.pool_host.mha",
        "sglang.srt.mem_cache.pool_host.mla",
        "sglang.srt.mem_cache.pool_host.mamba",
        "sglang.srt.mem_cache.pool_host.common",
        "sglang.srt.mem_cache.pool_host._kvcacheio",
    }
)
# module -> function that patches it right after it has run
_AFTER: dict[str, Any] = {}


def replaced_by_its_command(argv: list[str]) -> bool:
    """Whether the process started as ``argv`` (``sys.orig_argv``) is ``hicache-obs instrument``
    (``python -m hicache_obs instrument`` or the ``hicache-obs`` script): it runs nothing of
    SGLang's and replaces itself with its COMMAND, whose processes boot with the stand-ins.
    Putting them in place there first (torch, transformers and SGLang's kernels imported)
    would add seconds to every instrumented server's start."""
    rest = argv[1:]
    if "-m" in rest:
        i = rest.index("-m")
        return rest[i + 1 : i + 3] == ["hicache_obs", "instrument"]
    return len(rest) >= 2 and os.path.basename(rest[0]) == "hicache-obs" and rest[1] == "instrument"


def server_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the CPU stand-ins switched on for every Python
    process started with it, and SGLang's CPU platform selected."""
    out = dict(os.environ if env is None else env)
    out[ENABLE] = "1"
    out["SGLANG_USE_CPU_ENGINE"] = "1"
    parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if BOOT_DIR not in parts:
        parts.append(BOOT_DIR)
    out["PYTHONPATH"] = os.pathsep.join(parts)
    return out


def _patch(module: types.ModuleType) -> None:
    from hicache_obs.lab.sglang import kernels

    if module.__name__ in _BIND_AFTER:
        kernels.bind(module)
    after = _AFTER.get(module.__name__)
    if after is not None:
        after(module)


def _placeholder(name: str) -> Any:
    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name} is not installed here (a CPU stand-in placeholder was called)")

    unavailable.__name__ = unavailable.__qualname__ = name
    unavailable.__module__ = "sgl_kernel"
    return unavailable


_CPU_SUBMODULES = frozenset({"mamba"})
"""``sgl_kernel`` submodules SGLang imports ``*_cpu`` names from under ``is_cpu()``."""
_CPU_TORCH_OPS = ("fused_gdn_gating_cpu", "fused_sigmoid_gating_delta_rule_update_cpu")
"""``torch.ops.sgl_kernel`` names SGLang looks up at import under ``is_cpu()`` (the gated
delta rule backends, which LFM2's short convolution does not use)."""


def _cpu_names_module(name: str) -> types.ModuleType:
    """A stand-in module whose ``*_cpu`` names are placeholders; any other name is missing."""
    module = types.ModuleType(name, "hicache-obs CPU stand-in: *_cpu placeholders only")
    module.__path__ = []  # type: ignore[attr-defined]

    def __getattr__(attr: str) -> Any:
        if attr.endswith("_cpu"):
            value = _placeholder(attr)
            setattr(module, attr, value)
            return value
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")

    module.__getattr__ = __getattr__  # type: ignore[attr-defined, method-assign]
    return module


class _CpuSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``sgl_kernel.<name>`` for :data:`_CPU_SUBMODULES`, where ``sgl_kernel`` is the stand-in."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def,override]
        package, _, sub = name.partition(".")
        if package == "sgl_kernel" and sub in _CPU_SUBMODULES:
            import importlib.machinery

            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def,override]
        return _cpu_names_module(spec.name)

    def exec_module(self, module):  # type: ignore[no-untyped-def,override]
        return None


def _define_cpu_torch_ops() -> None:
    """``torch.ops.sgl_kernel.<name>`` for :data:`_CPU_TORCH_OPS`: defined, raising if called."""
    import torch

    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    _state["torch_library"] = library  # the ops live as long as the library object
    for name in _CPU_TORCH_OPS:
        if hasattr(torch.ops.sgl_kernel, name):
            continue
        library.define(f"{name}(Tensor[] args) -> Tensor")

        def unavailable(args: Any, _name: str = name) -> Any:
            raise NotImplementedError(
                f"torch.ops.sgl_kernel.{_name} is not installed here (a CPU stand-in placeholder)"
            )

        library.impl(name, unavailable, "CompositeExplicitAutograd")


class _NoHostRegistration:
    """``torch.cuda.cudart()`` for host registration only: every call succeeds and does nothing."""

    @staticmethod
    def cudaHostRegister(ptr: int, size: int, flags: int) -> int:
        return 0

    @staticmethod
    def cudaHostUnregister(ptr: int) -> int:
        return 0

    @staticmethod
    def cudaGetErrorString(rc: int) -> str:
        return "no error"


_CONTROLLERS = {
    "sglang.srt.managers.cache_controller": "HiCacheController",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller": "HybridCacheController",
}


def _data_tensors(root: Any, limit: int = 10) -> list[tuple[Any, bool]]:
    """The pools' data buffers reachable from a controller, each with whether it is host
    memory: tensors (not index lists) held by SGLang's objects, their containers and
    dataclass fields, ``limit`` steps deep at most. A buffer is host memory when the nearest
    pool object holding it is a host pool (its class name has ``Host``)."""
    import torch

    out: list[tuple[Any, bool]] = []
    seen: set[int] = set()
    todo: list[tuple[Any, int, bool]] = [(root, 0, False)]
    while todo:
        obj, depth, host = todo.pop()
        if id(obj) in seen or depth > limit:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.numel() and (obj.dtype not in (torch.int32, torch.int64, torch.uint64) or obj.dim() > 1):
                out.append((obj, host))
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend((o, depth + 1, host) for o in obj)
        elif isinstance(obj, dict):
            todo.extend((o, depth + 1, host) for o in obj.values())
        elif type(obj).__module__.startswith("sglang.") and hasattr(obj, "__dict__"):
            name = type(obj).__name__
            inner = True if "Host" in name else False if "Pool" in name else host
            todo.extend((o, depth + 1, inner) for o in vars(obj).values())
    return out


_device_storages: set[int] = set()

FAULT_ENV = "HICACHE_OBS_SGLANG_CPU_SKIP_LOADS"
"""A file path: while that file exists, copies into device pool buffers (every load) move
nothing. The negative control of the data checks: a load that brought nothing back must
change what the server answers."""


def _skip_loads_gate(fault_file: str) -> Any:
    def gate(dst: Any) -> bool:
        return not (dst.untyped_storage().data_ptr() in _device_storages and os.path.exists(fault_file))

    return gate


_REGISTERS = "_hicache_obs_registers_buffers"


def _register_after_init(module: types.ModuleType) -> None:
    """The copy stand-ins resolve pointer tables in registered buffers: register each new
    controller's pool buffers when its outermost ``__init__`` returns."""
    cls = getattr(module, _CONTROLLERS[module.__name__], None)
    original = getattr(cls, "__init__", None)
    if cls is None or original is None or getattr(original, _REGISTERS, False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for arg in (*args, *kwargs.values()):  # the allocators behind each entry, before anything wraps them
            for entry in getattr(arg, "entries", None) or ():
                owner = getattr(getattr(entry, "device_alloc_fn", None), "__self__", None)
                if owner is not None and hasattr(owner, "available_size"):
                    _entry_allocators[id(entry)] = owner
        original(self, *args, **kwargs)
        from hicache_obs.lab.sglang import kernels

        _controllers[id(self)] = weakref.ref(self)
        folder = os.environ.get(STATE_ENV)
        if folder and not _state.get("answering"):  # the first controller of this process
            _state["answering"] = True
            threading.Thread(
                target=_answer_requests, args=(Path(folder),), name="hicache-obs-cpu-state", daemon=True
            ).start()
        buffers = _data_tensors(self)
        kernels.register_buffers(*(t for t, _ in buffers))  # idempotent: a subclass's __init__ registers again
        _device_storages.update(t.untyped_storage().data_ptr() for t, host in buffers if not host)

    setattr(__init__, _REGISTERS, True)
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]


_controllers: dict[int, weakref.ReferenceType[Any]] = {}
_entry_allocators: dict[int, Any] = {}  # id(pool entry) -> the device allocator its callbacks belong to

STATE_ENV = "HICACHE_OBS_SGLANG_CPU_STATE"
"""A folder: each server process with a controller answers a ``request-<name>`` file put
there with ``answer-<name>-<pid>.json``, its controllers' allocator state (see
:func:`allocator_state`), read by SGLang's own ``size`` and ``available_size()``."""


def _used(obj: Any) -> dict[str, int]:
    return {"size": int(obj.size), "available": int(obj.available_size())}


def allocator_state(controller: Any) -> dict[str, dict[str, int]]:
    """``"pool/tier"`` -> ``{"size", "available"}`` of each of ``controller``'s allocators, as
    SGLang itself counts them (independent of the events)."""
    out: dict[str, dict[str, int]] = {}
    device = controller.mem_pool_device_allocator
    out["kv/device"] = _used(getattr(device, "full_attn_allocator", device))
    host = controller.mem_pool_host
    entries = getattr(host, "entries", None)
    if entries is None:
        out["kv/host"] = _used(host)
        return out
    anchor = getattr(host, "anchor_entry", None)
    for entry in entries:
        name = str(getattr(entry.name, "value", entry.name)).lower()
        out[f"{name}/host"] = _used(entry.host_pool)
        if entry is anchor:
            continue
        target = _entry_allocators.get(id(entry), entry.device_pool)
        if hasattr(target, "available_size"):
            out[f"{name}/device"] = _used(target)
    return out


def _answer_requests(folder: Path) -> None:
    while True:
        for request in sorted(folder.glob("request-*")):
            name = request.name.removeprefix("request-")
            answer = folder / f"answer-{name}-{os.getpid()}.json"
            if answer.exists():
                continue
            states = []
            for ref in list(_controllers.values()):
                c = ref()
                if c is not None:
                    try:
                        states.append({"tp_rank": _tp_rank(c), "pools": allocator_state(c)})
                    except Exception as exc:  # the answer says why rather than hang the test
                        states.append({"error": f"{type(exc).__name__}: {exc}"})
            tmp = answer.with_suffix(".tmp")
            tmp.write_text(json.dumps(states))
            tmp.replace(answer)
        time.sleep(0.1)


def _tp_rank(c: Any) -> int:
    group = getattr(c, "tp_group", None)
    try:
        import torch.distributed as dist

        return int(dist.get_rank(group)) if group is not None and dist.is_initialized() else 0
    except Exception:
        return 0


def install() -> None:
    """Put every stand-in of :data:`STAND_INS` in place in this process. Idempotent."""
    with _done:
        if _state.get("installed"):
            return
        import torch

        from hicache_obs.lab.sglang import kernels
        from hicache_obs.lab.sglang.harness import _install_torchvision_stand_in
        from hicache_obs.lab.sglang.kernels import checks

        _install_torchvision_stand_in()
        kernels.install()
        package = sys.modules.get("sgl_kernel")
        if getattr(package, kernels.installation.STAND_IN_FLAG, False):
            package.__getattr__ = _cpu_names_module("sgl_kernel").__getattr__  # type: ignore[union-attr, method-assign]
            if not any(isinstance(f, _CpuSubmodules) for f in sys.meta_path):
                sys.meta_path.append(_CpuSubmodules())
            _define_cpu_torch_ops()
        checks.DEVICE_INDEX_TYPES = frozenset({"cuda", "cpu"})
        torch.cuda.cudart = _NoHostRegistration  # type: ignore[assignment]
        if not hasattr(torch.cpu.Stream, "synchronize"):
            torch.cpu.Stream.synchronize = lambda self: None  # type: ignore[attr-defined]
        fault_file = os.environ.get(FAULT_ENV)
        if fault_file:
            from hicache_obs.lab.sglang.kernels import memory

            memory.copy_gate = _skip_loads_gate(fault_file)
        from hicache_obs.lab.sglang.cpu_conv import TARGET_MODULES as conv_modules
        from hicache_obs.lab.sglang.cpu_conv import patch_module as conv_patch

        for name in conv_modules:  # the Triton module (lfm2.py imports from it too) and SGLang's wrappers
            _AFTER[name] = conv_patch
        from hicache_obs.lab.sglang.cpu_mamba2 import TARGET_MODULES as mamba2_modules
        from hicache_obs.lab.sglang.cpu_mamba2 import patch_module as mamba2_patch

        for name in mamba2_modules:  # MambaMixer2's module: the scan and (CUDA-only there) conv names
            _AFTER[name] = mamba2_patch
        from hicache_obs.lab.sglang.cpu_swa import TARGET_MODULE as swa_module
        from hicache_obs.lab.sglang.cpu_swa import patch_module as swa_patch

        _AFTER[swa_module] = swa_patch
        from hicache_obs.lab.sglang.cpu_alloc import TARGET_MODULE as alloc_module
        from hicache_obs.lab.sglang.cpu_alloc import patch_module as alloc_patch

        _AFTER[alloc_module] = alloc_patch  # 0.5.10/0.5.11 only: 0.5.23 falls back to torch itself
        for name in _CONTROLLERS:
            _AFTER[name] = _register_after_init
        from hicache_obs.integrations.sglang._launcher import PatchAfterImport

        if not any(isinstance(f, PatchAfterImport) and f.patch is _patch for f in sys.meta_path):
            sys.meta_path.insert(0, PatchAfterImport({*_BIND_AFTER, *_AFTER}, _patch))
        for name in (*_BIND_AFTER, *_AFTER):
            if name in sys.modules:
                _patch(sys.modules[name])
        _state["installed"] = True
