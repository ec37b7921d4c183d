"""Real SGLang HiCache controllers on a machine without a GPU, or on one (test support).

:func:`build_controller` assembles SGLang's own device pools, allocators, host pools,
host pool group and controller classes for a :class:`~hicache_obs.core.ModelSpec`,
with the few stand-ins a CPU needs and nothing of SGLang's code changed:

- **CUDA index tensors.** :class:`CudaStandIn` is a CPU tensor whose ``is_cuda`` is
  true and whose ``device`` reads ``cuda:0``; ``.cpu()`` returns a new plain tensor and
  ``record_stream`` is accepted. A torch function mode (:func:`prepare`) turns
  ``.to("cuda")`` and ``device="cuda"`` into such tensors, so SGLang's own index moves
  (``host_indices.to(self.device, non_blocking=True)``) really happen. The device pools'
  data buffers stay plain CPU tensors; only index tensors are stand-ins.
- **Streams.** The controller's two side streams become ``torch.Stream("cpu")``, which
  ``Tensor.record_stream`` accepts (``torch.cpu.Stream`` is refused by the argument
  parser); events are ``torch.cpu.Event`` as SGLang's device module gives them.
- **Copy kernels.** :mod:`~hicache_obs.lab.sglang.kernels` supplies torch
  implementations of the ``sgl_kernel.kvcacheio`` ops with the real kernels' checks.
- **torchvision.** SGLang's config package imports ``torchvision.transforms``; a
  torchvision built for the CPU torch is not on PyPI. An import-only stand-in is put
  on the import path after ``transformers`` has cached that torchvision is absent.

Copies are synchronous here: the harness shows what SGLang's code does with its index
tensors (the evidence the adapter reports), not CUDA timing.

On a GPU (``build_controller(..., device="cuda")``) none of the stand-ins above is
used but the copy kernels that do not import (sgl-kernel's ``kvcacheio`` where it is
not installed; :func:`kernel_sources` says which ops are real), and the sgl-kernel
names SGLang imports at import time there (:data:`SGL_KERNEL_IMPORTS`, placeholders
that raise if called). A process is prepared for one device (:func:`prepare`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import threading
import types
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hicache_obs.core._spec import ModelSpec
from hicache_obs.core._torch_compat import TensorBase, plain_tensor_calls
from hicache_obs.errors import ConfigError, IntegrationError
from hicache_obs.lab.sglang.kernels.installation import STAND_IN_FLAG

__all__ = [
    "DEVICES",
    "SGL_KERNEL_IMPORTS",
    "CudaStandIn",
    "LayoutRefused",
    "SGLangHarness",
    "build_controller",
    "kernel_sources",
    "mamba_host_layouts",
    "prepare",
    "sglang_version",
]

_CUDA = torch.device("cuda", 0)
_CPU = torch.device("cpu")
_PLAIN = plain_tensor_calls
_prepared = threading.Lock()
_state: dict[str, Any] = {}


# ------------------------------------------------------------------ CUDA stand-in
class CudaStandIn(torch.Tensor):
    """A CPU tensor standing in for a CUDA index tensor.

    It reports its device through plain class attributes, which a read finds without a
    Python call, as a CUDA tensor's ``is_cuda`` and ``device`` are read in C: a property
    here would make each read of them (SGLang's and the adapter's) cost many times what it
    costs on a GPU."""

    is_cuda = True  # type: ignore[assignment]
    device = _CUDA  # type: ignore[assignment]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def,override]
        kwargs = kwargs or {}
        if func is torch.Tensor.record_stream or func is TensorBase.record_stream:
            return None  # the CPU stream has nothing to hold the memory for
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and _target(args[1:], kwargs) == "cpu"):
            with _PLAIN():
                src = args[0]
                out = (
                    src.clone() if func is torch.Tensor.cpu else func(src, *_cpu_args(args[1:]), **_cpu_kwargs(kwargs))
                )
                return out if out is not src else out.clone()
        if func is torch.Tensor.numpy:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first")
        return super().__torch_function__(func, types, args, kwargs)


def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return isinstance(d, str) and d.startswith("cuda")


def _target(args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """Where a ``Tensor.to`` call goes: ``"cuda"``, ``"cpu"`` or None (dtype only)."""
    d = kwargs.get("device")
    if d is None:
        for a in args:
            if isinstance(a, (str, torch.device)):
                d = a
                break
            if isinstance(a, torch.Tensor):
                d = a.device
                break
    if d is None:
        return None
    return "cuda" if _is_cuda_device(d) else "cpu"


def _cpu_args(args: Sequence[Any]) -> list[Any]:
    return [_CPU if isinstance(a, (str, torch.device)) and not isinstance(a, torch.dtype) else a for a in args]


def _cpu_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    if "device" in kwargs:
        kwargs = dict(kwargs)
        kwargs["device"] = _CPU
    return kwargs


def _stand_in(out: Any) -> Any:
    if isinstance(out, torch.Tensor) and not isinstance(out, CudaStandIn):
        return out.as_subclass(CudaStandIn)
    if isinstance(out, (tuple, list)):
        return type(out)(_stand_in(o) for o in out)
    return out


class _CudaMode(TorchFunctionMode):
    """Routes ``device="cuda"`` and ``.to("cuda")`` to :class:`CudaStandIn` tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def,override]
        kwargs = kwargs or {}
        if func is torch.Tensor.to or func is torch.Tensor.cuda:
            src = args[0]
            target = "cuda" if func is torch.Tensor.cuda else _target(args[1:], kwargs)
            if target == "cuda":
                rest = (
                    [a for a in args[1:] if not isinstance(a, (str, torch.device))] if func is torch.Tensor.to else []
                )
                kw = {k: v for k, v in kwargs.items() if k != "device"}
                if isinstance(src, CudaStandIn):
                    return func(src, *rest, **kw) if rest or kw.get("dtype") is not None else src
                with _PLAIN():
                    out = src.to(*rest, **kw) if rest or kw else src
                    out = out.clone() if out is src else out
                return _stand_in(out)
            return func(*args, **kwargs)
        d = kwargs.get("device")
        if d is not None and _is_cuda_device(d):
            return _stand_in(func(*args, **_cpu_kwargs(kwargs)))
        return func(*args, **kwargs)


# ------------------------------------------------------------ torchvision stand-in
class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import-only ``torchvision``: every submodule exists, every name is a placeholder class."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def,override]
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def,override]
        m = types.ModuleType(spec.name)
        m.__path__ = []  # type: ignore[attr-defined]

        def __getattr__(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            value = type(attr, (), {"__module__": spec.name})
            setattr(m, attr, value)
            return value

        m.__getattr__ = __getattr__  # type: ignore[attr-defined, method-assign]
        return m

    def exec_module(self, module):  # type: ignore[no-untyped-def,override]
        return None


def _install_torchvision_stand_in() -> None:
    try:
        import torchvision  # noqa: F401

        return  # a real one (a CUDA build pair): use it
    except Exception:
        sys.modules.pop("torchvision", None)
    try:
        import transformers.utils.import_utils as iu

        iu.is_torchvision_available()  # cached now: transformers keeps torchvision absent
    except ImportError:
        pass
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.append(_StubFinder())
    _bind_auto_image_processor()


def _bind_auto_image_processor() -> None:
    """Without torchvision, transformers 5.4 to 5.18 export ``AutoImageProcessor`` as a
    placeholder that raises on any attribute, and SGLang's config package calls
    ``AutoImageProcessor.register`` at import (0.5.13 pins transformers 5.8.1). The real class,
    whose ``register`` needs no torchvision, is bound in its place."""
    try:
        real = importlib.import_module("transformers.models.auto.image_processing_auto").AutoImageProcessor
    except (ImportError, AttributeError):
        return
    package = sys.modules.get("transformers")  # importing a submodule may replace the lazy package
    exported = getattr(package, "AutoImageProcessor", None)
    if type(exported).__name__ == "DummyObject" and type(real).__name__ != "DummyObject":
        package.AutoImageProcessor = real  # type: ignore[union-attr]


# ----------------------------------------------------------------------- prepare
def sglang_version() -> str | None:
    """The installed SGLang release, or None."""
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return None


DEVICES = ("cpu", "cuda")
"""Where :func:`build_controller` puts SGLang's device pools."""


def prepare(device: str | None = None) -> None:
    """Make SGLang's HiCache modules importable and runnable here, for ``device``. Idempotent.

    ``cpu`` (the default where nothing is prepared yet) installs the CUDA stand-ins
    this module describes; ``cuda`` uses the GPU as it is and installs only the copy
    kernels that do not import (sgl-kernel's ``kvcacheio``; see :func:`kernel_sources`).
    One process is prepared for one of them: the CPU's torch function mode would turn
    the GPU harness's CUDA tensors into stand-ins. ``None``: whichever is prepared.

    Raises :class:`~hicache_obs.errors.IntegrationError` where SGLang is not installed or
    the process is prepared for the other device, :class:`~hicache_obs.errors.ConfigError`
    for an unknown device or ``cuda`` without a CUDA device.
    """
    with _prepared:
        ready = _state.get("ready")
        if device is None:
            device = ready or "cpu"
        if device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
        if ready == device:
            return
        if ready is not None:
            raise IntegrationError(
                f"this process prepared SGLang for device {ready!r}; a {device!r} harness needs a process of its own"
            )
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' needs a CUDA device: torch.cuda.is_available() is False here")
        if sglang_version() is None:
            raise IntegrationError("SGLang is not installed here (make sglang installs the tested releases)")
        from hicache_obs.lab.sglang import kernels

        _install_torchvision_stand_in()
        installation = kernels.install()
        if device == "cpu":
            mode = _CudaMode()
            mode.__enter__()  # process-wide for this thread: test support only
            _state["mode"] = mode
            _install_current_stream_stand_in()
        else:
            _name_missing_ops(installation)
        # import what the builders use here, in a shallow frame: an SGLang module keeps a
        # reference to the frames that first imported it (and so to their locals)
        for name in _MODULES:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        _bind_kernels()
        _state["ready"] = device


_blocks = threading.local()  # .streams: the streams of the torch.cpu.stream blocks this thread is in


def _install_current_stream_stand_in() -> None:
    """``torch.cuda.current_stream`` without CUDA: SGLang 0.5.17's host pool group records the
    host indices it moved on ``torch.cuda.current_stream(device)`` itself, inside the copy's
    ``device_module.stream(...)`` block (``torch.cpu.stream`` here). The stand-in returns the
    stream of the innermost such block on this thread, the very object the controller holds
    (the adapter knows its streams by object), or the CPU's current stream outside one."""
    if torch.cuda.is_available() or _state.get("current_stream"):
        return
    block = torch.cpu.stream

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        stack = _blocks.__dict__.setdefault("streams", [])
        stack.append(s)
        try:
            with block(s):
                yield
        finally:
            stack.pop()

    def current_stream(device: Any = None) -> Any:
        stack = getattr(_blocks, "streams", None)
        return stack[-1] if stack else torch.cpu.current_stream()

    torch.cpu.stream = stream  # type: ignore[assignment]
    torch.cuda.current_stream = current_stream  # type: ignore[assignment]
    _state["current_stream"] = True


#: What SGLang's HiCache modules import of sgl-kernel beyond ``kvcacheio`` at import time on a
#: GPU, outside a ``try``/``except ImportError`` (which must keep seeing the ImportError):
#: module -> names. None of them is called by the HiCache copies.
SGL_KERNEL_IMPORTS: dict[str, frozenset[str]] = {
    "sgl_kernel": frozenset(
        {
            "fp8_blockwise_scaled_mm",
            "fp8_scaled_mm",
            "gelu_and_mul",
            "gptq_gemm",
            "gptq_shuffle",
            "int8_scaled_mm",
            "moe_align_block_size",
            "moe_sum",
            "moe_sum_reduce",
            "qserve_w4a8_per_chn_gemm",
            "qserve_w4a8_per_group_gemm",
            "sgl_per_token_group_quant_fp8",
            "sgl_per_token_group_quant_int8",
            "sgl_per_token_quant_fp8",
            "silu_and_mul",
        }
    ),
    "sgl_kernel.quantization": frozenset(
        {
            "ggml_dequantize",
            "ggml_moe_a8",
            "ggml_moe_a8_vec",
            "ggml_moe_get_block_size",
            "ggml_mul_mat_a8",
            "ggml_mul_mat_vec_a8",
        }
    ),
}


def _placeholder_module(name: str, names: frozenset[str]) -> types.ModuleType:
    """A ``sgl_kernel`` stand-in module whose ``names`` are placeholder ops that raise, naming
    themselves, when called; any other name is missing (an ImportError to ``from ... import``)."""
    module = types.ModuleType(name, "hicache-obs placeholder: this part of sgl-kernel is not installed here")
    module.__path__ = []  # type: ignore[attr-defined]

    def __getattr__(attr: str) -> Any:
        if attr not in names:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise IntegrationError(
                f"{name}.{attr} is not installed here: hicache-obs stands in for sgl_kernel.kvcacheio only"
            )

        unavailable.__name__ = unavailable.__qualname__ = attr
        unavailable.__module__ = name
        return unavailable

    module.__getattr__ = __getattr__  # type: ignore[attr-defined, method-assign]
    return module


class _SglKernelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The submodules of :data:`SGL_KERNEL_IMPORTS`, where ``sgl_kernel`` is the stand-in package."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def,override]
        parent = sys.modules.get("sgl_kernel")
        if name in SGL_KERNEL_IMPORTS and name != "sgl_kernel" and getattr(parent, STAND_IN_FLAG, False):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def,override]
        return _placeholder_module(spec.name, SGL_KERNEL_IMPORTS[spec.name])

    def exec_module(self, module):  # type: ignore[no-untyped-def,override]
        return None


def _name_missing_ops(installation: Any) -> None:
    """On a GPU, SGLang's modules import more of sgl-kernel than ``kvcacheio`` at import time
    (:data:`SGL_KERNEL_IMPORTS`). Where the stand-in ``sgl_kernel`` package is in place, those
    names and submodules are placeholders that raise, naming themselves, if ever called."""
    package = installation.stand_ins.get("sgl_kernel")
    if package is None:
        return
    package.__getattr__ = _placeholder_module(  # type: ignore[attr-defined, method-assign]
        "sgl_kernel", SGL_KERNEL_IMPORTS["sgl_kernel"]
    ).__getattr__
    if not any(isinstance(f, _SglKernelFinder) for f in sys.meta_path):
        sys.meta_path.append(_SglKernelFinder())


def kernel_sources() -> dict[str, str]:
    """The copy ops SGLang's prepared host pool modules call: op name -> ``"stand-in"`` (this
    package's torch implementation) or the module of the real one (``sgl_kernel.kvcacheio``,
    0.5.23's JIT ``sglang.kernels.ops.mamba.transfer_mamba``)."""
    from hicache_obs.lab.sglang import kernels

    out: dict[str, str] = {}
    for name in _POOL_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        for op, value in vars(module).items():
            if op in kernels.OPS and callable(value):
                out[op] = "stand-in" if value is kernels.OPS[op] else str(getattr(value, "__module__", "?"))
    return dict(sorted(out.items()))


_MODULES = (
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.allocator.mamba",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.pool_host.group",
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.configs.mamba_utils",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
)


_POOL_MODULES = (
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.mem_cache.pool_host._kvcacheio",
)


def _bind_kernels() -> None:
    from hicache_obs.lab.sglang import kernels

    for name in _POOL_MODULES:
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
        kernels.bind(mod)


def _kw(fn: Any, **candidates: Any) -> dict[str, Any]:
    """The candidates that ``fn`` accepts (constructors differ between releases)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return candidates
    return {k: v for k, v in candidates.items() if k in params}


# ---------------------------------------------------------------------- harness
@dataclass
class SGLangHarness:
    """A real SGLang controller with its pools, and helpers to put data in and read it back."""

    spec: ModelSpec
    controller: Any
    kv_pool: Any
    kv_allocator: Any
    kv_host: Any
    mamba_pool: Any = None
    mamba_allocator: Any = None
    mamba_host: Any = None
    pool_transfer: Any = None  # SGLang's PoolTransfer class
    pool_name: Any = None  # SGLang's PoolName enum
    io_backend: str = "kernel"
    layout: str = "page_first"
    release: str = ""
    device: str = "cpu"
    extras: dict[str, Any] = field(default_factory=dict)

    # --------------------------------------------------------- allocation
    def alloc_kv(self, n: int) -> torch.Tensor:
        t = self.kv_allocator.alloc(n)
        if t is None:
            raise ConfigError(f"the KV device pool has no {n} free slots")
        return t  # type: ignore[no-any-return]

    def alloc_mamba(self, n: int = 1) -> torch.Tensor:
        if self.mamba_allocator is None:
            raise ConfigError(f"model {self.spec.name!r} has no mamba pool")
        t = self.mamba_allocator.alloc(n)
        if t is None:
            raise ConfigError(f"the Mamba device pool has no {n} free slots")
        return t  # type: ignore[no-any-return]

    def mamba_transfer(self, *, host_indices: Any = None, device_indices: Any = None) -> Any:
        return self.pool_transfer(name=self.pool_name.MAMBA, host_indices=host_indices, device_indices=device_indices)

    # ------------------------------------------------------------- data
    def _kv_layers(self) -> list[torch.Tensor]:
        return list(self.kv_pool.k_buffer) + list(self.kv_pool.v_buffer)

    def _mamba_layers(self) -> list[torch.Tensor]:
        cache = self.mamba_pool.mamba_cache
        return [cache.temporal, *cache.conv]

    @staticmethod
    def _plain(indices: torch.Tensor) -> torch.Tensor:
        with _PLAIN():
            return indices.detach().clone().as_subclass(torch.Tensor).to(torch.int64)

    def fill_kv(self, indices: torch.Tensor, seed: int) -> None:
        """Write distinct values into the device KV rows at ``indices`` (every layer, k and v)."""
        idx = self._plain(indices)
        g = torch.Generator().manual_seed(seed)
        with _PLAIN():
            for buf in self._kv_layers():
                buf[idx] = torch.randn(buf[idx].shape, generator=g).to(buf.device, buf.dtype)

    def read_kv(self, indices: torch.Tensor) -> torch.Tensor:
        idx = self._plain(indices)
        with _PLAIN():
            return torch.stack([buf[idx].float().cpu() for buf in self._kv_layers()])

    def clear_kv(self, indices: torch.Tensor) -> None:
        idx = self._plain(indices)
        with _PLAIN():
            for buf in self._kv_layers():
                buf[idx] = 0

    def fill_mamba(self, indices: torch.Tensor, seed: int) -> None:
        idx = self._plain(indices)
        g = torch.Generator().manual_seed(seed)
        with _PLAIN():
            for buf in self._mamba_layers():  # [layers, slots, ...]
                buf[:, idx] = torch.randn(buf[:, idx].shape, generator=g).to(buf.device, buf.dtype)

    def read_mamba(self, indices: torch.Tensor) -> list[torch.Tensor]:
        idx = self._plain(indices)
        with _PLAIN():
            return [buf[:, idx].float().cpu() for buf in self._mamba_layers()]

    def clear_mamba(self, indices: torch.Tensor) -> None:
        idx = self._plain(indices)
        with _PLAIN():
            for buf in self._mamba_layers():
                buf[:, idx] = 0

    def close(self) -> None:
        """Give back what SGLang's host pools hold outside Python: on a GPU, the host memory they
        registered with CUDA (their ``destroy()``, which 0.5.2x's host pools have; 0.5.10's and
        0.5.11's have none, and their registration stays). A harness whose pools are dropped
        without it leaves that memory registered, and a later pool that the allocator puts at
        the same address fails to register it (CUDA error 712). Idempotent; the harness is not
        to be used after it. Nothing to give back on the CPU harness."""
        if self.device != "cuda":
            return
        # 0.5.10 and 0.5.11's host pools have no destroy(): their registration stays
        for pool in (self.kv_host, self.mamba_host):
            destroy = getattr(pool, "destroy", None)
            if callable(destroy):
                destroy()

    # ------------------------------------------------------ a draft model
    def add_draft(self) -> Any:
        """A one-layer draft model's KV pool (speculative decoding), registered with the
        controller as the release's scheduler does: ``set_draft_kv_pool`` with a host pool of
        its own (0.5.12, 0.5.13), or a ``DRAFT`` host pool group entry that takes the KV
        indices (0.5.2x's sidecar; :meth:`write` and :meth:`load` then name it in each op, as
        the tree does). Returns the draft device pool."""
        spec, c = self.spec, self.controller
        draft = _mha_device_pool(spec, self.kv_pool.size, 1, self.device)
        primary = c.mem_pool_host
        by_registration = callable(getattr(c, "set_draft_kv_pool", None))
        if not (by_registration or callable(getattr(c, "register_host_pool_entry", None))):
            raise IntegrationError(f"SGLang {sglang_version()}: the controller takes no draft KV pool")
        # as the release's scheduler builds it (maybe_register_hicache_draft), or its
        # build_full_draft_pools for a sidecar
        sidecar = (
            {}
            if by_registration
            else dict(
                pool_label="draft",
                host_token_capacity=primary.logical_size,
                device_capacity_tokens=draft.size,
                start_layer=getattr(draft, "start_layer", None),
                end_layer=getattr(draft, "end_layer", None),
            )
        )
        host = _host_pool(
            _mha_host_cls(draft),
            draft,
            (primary.size if by_registration else primary.logical_size) / draft.size,
            0,
            spec.page_size,
            self.layout,
            pin_memory=self.device == "cuda",
            **sidecar,
        )
        if by_registration:
            register: Any = lambda: c.set_draft_kv_pool(draft, host)  # noqa: E731
        else:
            asm = importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler")
            entry = asm.build_pool_entry(
                **_kw(
                    asm.build_pool_entry,
                    name=self.pool_name.DRAFT,
                    host_pool=host,
                    device_pool=draft,
                    layer_mapping={i: i for i in range(draft.layer_num)},
                    transfer_layer_num=host.layer_num,  # up to 0.5.20
                    transfer_layer_id_max=host.layer_num,  # 0.5.21 on
                )
            )
            self.extras["draft_transfer"] = True
            register = lambda: c.register_host_pool_entry(entry)  # noqa: E731
        if self.device == "cpu":
            draft.device = "cuda"
        _register_pool_buffers(draft, host)
        register()
        self.extras["draft"] = draft
        return draft

    def draft_layers(self) -> list[torch.Tensor]:
        draft = self.extras["draft"]
        return list(draft.k_buffer) + list(draft.v_buffer)

    def _extra_pools(self, mamba: Any, *, omit_draft: bool) -> list[Any]:
        pools = [] if mamba is None else [mamba]
        if self.extras.get("draft_transfer") and not omit_draft:
            pools.append(self.pool_transfer(name=self.pool_name.DRAFT, indices_from_pool=self.pool_name.KV))
        return pools

    # --------------------------------------------------------- driving
    def write(
        self, kv: torch.Tensor, mamba: torch.Tensor | None = None, *, node_id: int = -1, omit_draft: bool = False
    ) -> tuple[Any, Any]:
        """``controller.write`` of ``kv`` (and one Mamba transfer; the draft pool's, where it
        is a sidecar, unless ``omit_draft``); returns (host KV indices, Mamba transfer)."""
        t = None if mamba is None else self.mamba_transfer(device_indices=mamba)
        extra = self._extra_pools(t, omit_draft=omit_draft)
        if not extra:
            return self.controller.write(kv, node_id=node_id), None
        return self.controller.write(kv, node_id=node_id, extra_pools=extra), t

    def load(
        self, host: torch.Tensor, mamba_host: torch.Tensor | None = None, *, node_id: int = -1, omit_draft: bool = False
    ) -> tuple[Any, Any]:
        """``controller.load`` (queued); returns (device KV indices, Mamba transfer)."""
        t = None if mamba_host is None else self.mamba_transfer(host_indices=mamba_host)
        extra = self._extra_pools(t, omit_draft=omit_draft)
        if not extra:
            return self.controller.load(host, node_id=node_id), None
        return self.controller.load(host, node_id=node_id, extra_pools=extra), t

    def reap(self, *, wait: bool = False) -> int:
        """Take every finished ack off both ack queues, in FIFO order, as the radix cache does;
        with ``wait``, every ack, each once its copy finished (on a GPU copies run on)."""
        n = 0
        for q in (self.controller.ack_write_queue, self.controller.ack_load_queue):
            while len(q) and (wait or q[0].finish_event.query()):
                ack = q.pop(0)
                ack.finish_event.synchronize()
                n += 1
        return n


def build_controller(
    spec: ModelSpec,
    *,
    io_backend: str = "kernel",
    layout: str = "page_first",
    device_size: int = 512,
    host_ratio: float = 2.0,
    write_policy: str = "write_through",
    device: str = "cpu",
) -> SGLangHarness:
    """A real SGLang controller for ``spec`` (``tiny``, ``tiny_hybrid``) on a CPU or a GPU.

    ``layout`` is the host layout (``page_first``, ``layer_first``, ``page_first_direct``);
    the direct backend turns ``page_first`` into ``page_first_direct`` as SGLang's radix
    cache does. ``device`` ``cpu`` builds the harness this module describes; ``cuda``
    puts the device pools on the GPU, with SGLang's own CUDA streams and events and
    pinned host pools, and copies with the real kernels where they import (stand-ins
    run on the GPU otherwise: :func:`kernel_sources` says which). One process builds
    for one device (:func:`prepare`). Raises :class:`~hicache_obs.errors.IntegrationError`
    without SGLang.
    """
    if io_backend not in ("kernel", "direct"):
        raise ConfigError(f"io_backend must be 'kernel' or 'direct', got {io_backend!r}")
    if layout not in ("page_first", "layer_first", "page_first_direct"):
        raise ConfigError(f"layout must be page_first, layer_first or page_first_direct, got {layout!r}")
    if spec.swa_layer_ids:
        raise ConfigError(
            f"model {spec.name!r}: build_controller builds KV and KV + Mamba models; SGLang builds the "
            "SWA host pools only through its tree's init_hicache: use tree.build_swa_tree"
        )
    if device_size <= 0 or device_size % spec.page_size:
        raise ConfigError(f"device_size must be a positive multiple of page size {spec.page_size}, got {device_size}")
    if io_backend == "direct" and layout == "page_first":
        layout = "page_first_direct"
    prepare(device)  # refuses an unknown device first
    release = sglang_version() or ""
    try:
        h = _build(spec, io_backend, layout, device_size, host_ratio, write_policy, device)
    except (ValueError, AssertionError) as exc:
        if spec.mamba_layer_ids and _raised_by_mamba_host_pool(exc):
            raise LayoutRefused(f"SGLang {release}'s MambaPoolHost refuses layout {layout!r}: {exc}") from exc
        raise
    h.release = release
    h.device = device
    if device == "cpu":
        _use_cpu_streams(h.controller)
    _register_buffers(h)
    return h


class LayoutRefused(ConfigError):
    """The installed release's Mamba host pool refuses the host layout asked for (SGLang's own
    check, raised as it builds the pool): the message names the release, the layout and what
    SGLang said; ``__cause__`` is SGLang's exception."""


def _raised_by_mamba_host_pool(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while SGLang's ``MambaPoolHost`` built itself."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "__init__" and type(frame.f_locals.get("self")).__name__ == "MambaPoolHost":
            return True
        tb = tb.tb_next
    return False


_MAMBA_LAYOUTS: dict[str, tuple[str, ...]] = {}


def mamba_host_layouts() -> tuple[str, ...]:
    """The host layouts the installed release's Mamba host pool takes, found by building one
    of each (cached): SGLang refuses the others when it builds the pool (0.5.14 to 0.5.17 take
    ``page_first_direct`` only, 0.5.2x the page layouts): :class:`LayoutRefused`. Anything
    else propagates."""
    release = sglang_version() or ""
    found = _MAMBA_LAYOUTS.get(release)
    if found is None:
        ok = []
        for layout, io_backend in (
            ("page_first", "kernel"),
            ("layer_first", "kernel"),
            ("page_first_direct", "direct"),
        ):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    build_controller(ModelSpec.tiny_hybrid(), io_backend=io_backend, layout=layout, device_size=64)
            except LayoutRefused:
                continue
            ok.append(layout)
        found = _MAMBA_LAYOUTS[release] = tuple(ok)
    return found


def _tensors_of(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor a pool object holds (attributes, lists, dataclass fields), for the kernels'
    pointer tables."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 3 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors_of(o, depth + 1)]
    fields = getattr(obj, "__dataclass_fields__", None) or getattr(obj, "__struct_fields__", None)
    if fields is not None:
        return [t for f in fields for t in _tensors_of(getattr(obj, f, None), depth + 1)]
    if depth == 0 and hasattr(obj, "__dict__"):
        return [t for v in vars(obj).values() for t in _tensors_of(v, depth + 1)]
    return []


def _register_buffers(h: SGLangHarness) -> None:
    _register_pool_buffers(h.kv_pool, h.kv_host, h.mamba_pool, h.mamba_host)


def _register_pool_buffers(*pools: Any) -> None:
    """The data buffers of ``pools`` (None skipped), for the copy stand-ins' pointer tables."""
    from hicache_obs.lab.sglang import kernels

    for obj in pools:
        if obj is None:
            continue
        for t in _tensors_of(obj):
            if (t.numel() and t.dtype not in (torch.int64, torch.uint64)) or t.dim() > 1:  # data, not index lists
                kernels.register_buffers(t)
        cache = getattr(obj, "mamba_cache", None)
        if cache is not None:
            kernels.register_buffers(*_tensors_of(cache, 1))


def _use_cpu_streams(c: Any) -> None:
    engine = getattr(c, "l2_transfer_engine", None)
    if engine is not None and hasattr(engine, "device_to_host_stream"):
        engine.device_to_host_stream = torch.Stream("cpu")
        engine.host_to_device_stream = torch.Stream("cpu")
    else:
        c.write_stream = torch.Stream("cpu")
        c.load_stream = torch.Stream("cpu")


def _mamba_params(spec: ModelSpec, mod: Any) -> Any:
    """SGLang's ``Mamba2CacheParams`` for the spec's conv and temporal state shapes."""
    conv_dim, win = spec.mamba_conv_shape
    shape_cls = mod.Mamba2StateShape
    fields = {f for f in getattr(shape_cls, "__dataclass_fields__", {})}
    heads, head_dim, state = spec.mamba_ssm_shape
    candidates = dict(
        conv=[(conv_dim, win)],
        temporal=(heads, head_dim, state),
        intermediate_size=heads * head_dim,
        conv_dim=conv_dim,
        ssm_state_size=state,
        num_heads=heads,
        head_dim=head_dim,
        state_size=state,
        conv_kernel=win + 1,
    )
    shape = shape_cls(**{k: v for k, v in candidates.items() if k in fields})
    dtype = mod.Mamba2StateDType(conv=spec.mamba_dtype, temporal=spec.mamba_dtype)
    return mod.Mamba2CacheParams(shape=shape, layers=list(spec.mamba_layer_ids), dtype=dtype)


def _layer_maps(spec: ModelSpec) -> tuple[dict[int, int], dict[int, int], int]:
    kv = {g: i for i, g in enumerate(spec.kv_layer_ids)}
    mamba = {g: i for i, g in enumerate(spec.mamba_layer_ids)}
    return kv, mamba, spec.num_layers


def _mha_device_pool(spec: ModelSpec, size: int, layer_num: int, device: str) -> Any:
    """SGLang's ``MHATokenToKVPool`` of ``size`` slots and ``layer_num`` layers, with the spec's
    heads, dtype and page (the target model's KV, or a draft model's)."""
    mp = importlib.import_module("sglang.srt.mem_cache.memory_pool")
    return mp.MHATokenToKVPool(
        **_kw(
            mp.MHATokenToKVPool.__init__,
            size=size,
            page_size=spec.page_size,
            dtype=spec.dtype,
            head_num=spec.num_kv_heads,
            head_dim=spec.head_dim,
            layer_num=layer_num,
            device=device,
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
    )


def _kv_device(spec: ModelSpec, device_size: int, alloc_mod: Any, device: str) -> tuple[Any, Any]:
    kv_pool = _mha_device_pool(spec, device_size, len(spec.kv_layer_ids), device)
    return kv_pool, _kv_allocator(spec, device_size, alloc_mod, kv_pool, device)


def _kv_allocator(spec: ModelSpec, device_size: int, alloc_mod: Any, kv_pool: Any, device: str) -> Any:
    """SGLang's token (page size 1) or paged allocator over ``kv_pool``."""
    if spec.page_size == 1:
        allocator = alloc_mod.TokenToKVPoolAllocator(device_size, spec.dtype, device, kv_pool, False)
    else:
        allocator = alloc_mod.PagedTokenToKVPoolAllocator(
            **_kw(
                alloc_mod.PagedTokenToKVPoolAllocator.__init__,
                size=device_size,
                page_size=spec.page_size,
                dtype=spec.dtype,
                device=device,
                kvcache=kv_pool,
                need_sort=False,
            )
        )
    return allocator


def _to_cuda_indices(*objs: Any) -> None:
    """Device allocators hand out "CUDA" index tensors from here on."""
    for obj in objs:
        if obj is None:
            continue
        obj.device = "cuda"
        obj.clear()


def _module(name: str) -> Any:
    """SGLang's module ``name``, or None where this release has no such module.

    Raises :class:`~hicache_obs.errors.IntegrationError` where the module is there but does
    not import, naming what it lacks: a package missing from this Python is not a release
    without the feature.
    """
    try:
        found = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # its parent is missing, or is a module, not a package
        return None
    if found is None:
        return None
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise IntegrationError(
            f"SGLang {sglang_version()} has {name} but it does not import in {sys.prefix}: {exc}"
            " (a package SGLang needs is not installed there)"
        ) from exc


def _find_class(names: Sequence[str], cls: str) -> Any:
    """Class ``cls`` from the first of the modules ``names`` that defines it: SGLang moved its
    host pool classes between releases, not all at once."""
    for name in names:
        module = _module(name)
        if module is not None and isinstance(getattr(module, cls, None), type):
            return getattr(module, cls)
    raise IntegrationError(f"SGLang {sglang_version()}: no {cls} in {' or '.join(names)}; this harness cannot build it")


_MPH = "sglang.srt.mem_cache.memory_pool_host"
_POOL_HOST = "sglang.srt.mem_cache.pool_host"


def _takes_device_pool(cls: Any) -> bool:
    """Whether a host pool class is built from the device pool (0.5.10 to 0.5.13, and the
    releases whose ``pool_host`` package still does so) or from its buffer description."""
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    return bool(params) and params[0] == "device_pool"


def _build(
    spec: ModelSpec, io_backend: str, layout: str, device_size: int, host_ratio: float, write_policy: str, device: str
) -> SGLangHarness:
    """SGLang's pools, host pools, host pool group and controller for ``spec``.

    Each part is found where the installed release has it, one feature at a time: the host
    pool classes in ``mem_cache/pool_host/`` or ``mem_cache/memory_pool_host.py``, built
    from the device pool or from its buffer description; the Mamba free list in an
    allocator of its own (``allocator/mamba.py``) or in the pool; the host pool group's
    entries through ``build_pool_entry`` or as ``PoolEntry`` objects. A part that is
    nowhere is an :class:`~hicache_obs.errors.IntegrationError` naming it."""
    mp = importlib.import_module("sglang.srt.mem_cache.memory_pool")
    alloc_mod = importlib.import_module("sglang.srt.mem_cache.allocator")
    storage = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    cc = importlib.import_module("sglang.srt.managers.cache_controller")
    kv_pool, allocator = _kv_device(spec, device_size, alloc_mod, device)
    mamba_pool = mamba_allocator = None
    if spec.mamba_layer_ids:
        mu = importlib.import_module("sglang.srt.configs.mamba_utils")
        mamba_size = max(8, device_size // spec.page_size)
        mamba_pool = mp.MambaPool(
            **_kw(
                mp.MambaPool.__init__,
                size=mamba_size,
                spec_state_size=mamba_size,
                cache_params=_mamba_params(spec, mu),
                mamba_layer_ids=list(range(len(spec.mamba_layer_ids))),
                device=device,
            )
        )
        # from 0.5.13 the Mamba free list is an allocator of its own; earlier, the pool's
        slot_mod = _module("sglang.srt.mem_cache.allocator.mamba")
        slot_cls = getattr(slot_mod, "MambaSlotAllocator", None)
        mamba_allocator = slot_cls(mamba_size, device) if slot_cls is not None else mamba_pool
    kv_host, mamba_host = _host_pools(spec, kv_pool, mamba_pool, layout, host_ratio, device == "cuda")
    h = SGLangHarness(spec, None, kv_pool, allocator, kv_host, io_backend=io_backend, layout=layout)
    h.pool_transfer, h.pool_name = storage.PoolTransfer, storage.PoolName
    h.mamba_pool, h.mamba_allocator, h.mamba_host = mamba_pool, mamba_allocator, mamba_host
    if device == "cpu":
        kv_pool.device = "cuda"
        if mamba_pool is not None:
            mamba_pool.device = "cuda"
        _to_cuda_indices(allocator, mamba_allocator)
    event = threading.Event()
    if mamba_pool is None:
        h.controller = cc.HiCacheController(
            allocator, kv_host, spec.page_size, None, event, write_policy=write_policy, io_backend=io_backend
        )
        return h
    hcc = importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")
    h.controller = hcc.HybridCacheController(
        allocator,
        _entries(h, storage.PoolName),
        spec.page_size,
        None,
        event,
        **_kw(
            hcc.HybridCacheController.__init__,
            write_policy=write_policy,
            io_backend=io_backend,
            transfer_layer_num=spec.num_layers,  # 0.5.10 to 0.5.13
            transfer_layer_id_max=spec.num_layers,  # 0.5.2x
        ),
    )
    return h


def _host_pools(
    spec: ModelSpec, kv_pool: Any, mamba_pool: Any, layout: str, host_ratio: float, pin: bool
) -> tuple[Any, Any]:
    kv_host = _host_pool(
        _mha_host_cls(kv_pool),
        kv_pool,
        host_ratio,
        0,
        spec.page_size,
        layout,
        pin_memory=pin,
        device_capacity_tokens=kv_pool.size,
        start_layer=getattr(kv_pool, "start_layer", None),
        end_layer=getattr(kv_pool, "end_layer", None),
        write_back_staging=getattr(kv_pool, "hicache_write_back_staging", None),
    )
    if mamba_pool is None:
        return kv_host, None
    mamba_cls = _find_class((f"{_POOL_HOST}.mamba", _MPH), "MambaPoolHost")
    mamba_host = _host_pool(
        mamba_cls, mamba_pool, host_ratio, 0, device_capacity=mamba_pool.size, pin_memory=pin, layout=layout
    )
    return kv_host, mamba_host


def _mha_host_cls(device_pool: Any) -> Any:
    """The MHA host pool class for ``device_pool``, as the release picks it."""
    mha = _module(f"{_POOL_HOST}.mha")
    if mha is not None and hasattr(mha, "get_mha_host_pool_cls"):
        pick = mha.get_mha_host_pool_cls  # given the device pool, or (later) its buffer description
        takes_pool = next(iter(inspect.signature(pick).parameters), "") == "device_pool"
        return pick(device_pool if takes_pool else device_pool.get_device_pool_infos()[0].buffer_info)
    return _find_class((f"{_POOL_HOST}.mha", _MPH), "MHATokenToKVPoolHost")


def _host_pool(cls: Any, device_pool: Any, *args: Any, **candidates: Any) -> Any:
    """A host pool of ``cls``, built from ``device_pool`` or from its buffer description,
    whichever the class takes, with the keyword ``candidates`` it accepts."""
    first = device_pool if _takes_device_pool(cls) else device_pool.get_device_pool_infos()[0].buffer_info
    return cls(first, *args, **_kw(cls.__init__, **{k: v for k, v in candidates.items() if v is not None}))


def _entries(h: SGLangHarness, names: Any) -> Any:
    """The host pool group: KV (the anchor) and Mamba, with their global layer maps."""
    kv_map, mamba_map, n = _layer_maps(h.spec)
    group_cls = _find_class((f"{_POOL_HOST}.group", _MPH), "HostPoolGroup")
    own_allocator = h.mamba_allocator is not h.mamba_pool
    parts = [
        dict(name=names.KV, host_pool=h.kv_host, device_pool=h.kv_pool, layer_map=kv_map, anchor=True),
        dict(
            name=names.MAMBA,
            host_pool=h.mamba_host,
            device_pool=h.mamba_pool,
            layer_map=mamba_map,
            anchor=False,
            alloc=h.mamba_allocator.alloc if own_allocator else None,
            free=h.mamba_allocator.free if own_allocator else None,
        ),
    ]
    asm = _module("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler")
    build = getattr(asm, "build_pool_entry", None)
    entries = []
    for part in parts:
        extra = {k: v for k, v in (("device_alloc_fn", part.get("alloc")), ("device_free_fn", part.get("free"))) if v}
        if build is not None:
            entries.append(
                build(
                    **_kw(
                        build,
                        name=part["name"],
                        host_pool=part["host_pool"],
                        device_pool=part["device_pool"],
                        layer_mapping=part["layer_map"],
                        transfer_layer_num=n,
                        transfer_layer_id_max=n,
                        is_anchor=part["anchor"],
                        **extra,
                    )
                )
            )
            continue
        entry_cls = _find_class((f"{_POOL_HOST}.group", _MPH), "PoolEntry")
        fields = getattr(entry_cls, "__dataclass_fields__", {})
        if extra and not all(k in fields for k in extra):
            raise IntegrationError(f"SGLang {sglang_version()}: PoolEntry takes no device_alloc_fn/device_free_fn")
        entries.append(
            entry_cls(
                name=part["name"],
                host_pool=part["host_pool"],
                device_pool=part["device_pool"],
                layer_mapper=lambda i, m=part["layer_map"]: m.get(i) if 0 <= i < n else None,
                is_primary_index_anchor=part["anchor"],
                **extra,
            )
        )
    return group_cls(entries)
