"""Runtimes: the controller's only way to touch streams, events and device memory.

Operations of every :class:`Runtime`:

- ``stream(name)`` -> a side stream; ``current_stream()``; ``use(stream)`` context
- ``event(enable_timing)`` -> :class:`DeviceEvent` (``record``, ``query``,
  ``synchronize``, ``wait``, ``elapsed_ns``)
- ``record_stream(tensor, stream)``: keep ``tensor``'s memory until ``stream``'s
  work queued so far has run
- ``is_device(tensor)``, ``to_device(tensor, non_blocking)``, ``to_host(tensor)``
- ``empty(shape, dtype)``: a long-lived device buffer (pool storage)
- ``launch(fn, *tensors)``: run ``fn(*tensors)`` as work on the current stream
- ``synchronize()``; ``drain()``
- ``tensor_type`` (optional, ``torch.Tensor`` when absent): the class of the runtime's
  device tensors; an index tensor of any other subclass is refused
- ``observers``: a :class:`CallObservers` the runtime reports its served calls to: a
  record it made (``record_stream``) and an index tensor it copied to another device
  (``to_device``/``to_host``). The controller's ``StreamRecorded`` and ``IndicesMoved``
  events come from these reports, never from its own account.

Three implementations: ``cpu`` (synchronous, nothing is a device tensor),
``sim`` (a CPU model of CUDA streams and the caching allocator, in
:mod:`hicache_obs.core._sim`) and ``cuda``.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from .. import _native
from ..errors import ConfigError, RuntimeUnavailableError

__all__ = [
    "CallObservers",
    "Stream",
    "DeviceEvent",
    "Runtime",
    "CpuRuntime",
    "CudaRuntime",
    "make_runtime",
    "RUNTIME_NAMES",
]

RUNTIME_NAMES = ("cpu", "sim", "cuda")


class Stream(Protocol):
    name: str


@runtime_checkable
class DeviceEvent(Protocol):
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def elapsed_ns(self, end: DeviceEvent) -> int | None: ...


class CallObservers:
    """Callbacks a runtime runs for calls it served.

    ``records``: ``fn(tensor, stream)`` after ``record_stream`` really recorded ``tensor``
    on ``stream``; ``moves``: ``fn(src, dst)`` after ``to_device``/``to_host`` copied ``src``
    to the new tensor ``dst``. :meth:`add` returns the callable that removes them.
    """

    __slots__ = ("records", "moves", "_lock")

    def __init__(self) -> None:
        self.records: tuple[Callable[[torch.Tensor, Any], None], ...] = ()
        self.moves: tuple[Callable[[torch.Tensor, torch.Tensor], None], ...] = ()
        self._lock = threading.Lock()

    def add(
        self,
        *,
        record: Callable[[torch.Tensor, Any], None] | None = None,
        move: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> Callable[[], None]:
        with self._lock:
            if record is not None:
                self.records = (*self.records, record)
            if move is not None:
                self.moves = (*self.moves, move)

        def remove() -> None:
            with self._lock:
                if record is not None and record in self.records:
                    self.records = tuple(f for f in self.records if f is not record)
                if move is not None and move in self.moves:
                    self.moves = tuple(f for f in self.moves if f is not move)

        return remove

    def moved(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """Report a copy (if it made a new tensor) and return ``dst``."""
        if dst is not src:
            for fn in self.moves:
                fn(src, dst)
        return dst

    def recorded(self, tensor: torch.Tensor, stream: Any) -> None:
        for fn in self.records:
            fn(tensor, stream)


class Runtime(Protocol):
    name: str
    device: str  # "cpu", "sim:0", "cuda:0": how events name this runtime's device
    has_device: bool  # False when there is no separate device memory (cpu)
    observers: CallObservers

    def stream(self, name: str) -> Any: ...
    def current_stream(self) -> Any: ...
    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...
    def event(self, enable_timing: bool = False) -> DeviceEvent: ...
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...
    def is_device(self, tensor: torch.Tensor) -> bool: ...
    def to_device(self, tensor: torch.Tensor, non_blocking: bool = False) -> torch.Tensor: ...
    def to_host(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def pin(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def launch(self, fn: Callable[..., None], *tensors: Any) -> None: ...
    def synchronize(self) -> None: ...
    def drain(self) -> None: ...
    def values_readable(self, tensor: torch.Tensor) -> bool: ...
    def tensor_device(self, tensor: torch.Tensor) -> str: ...


# --------------------------------------------------------------------------- cpu


class _CpuStream:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<cpu stream {self.name}>"


class _CpuEvent:
    """Always complete: the cpu runtime runs everything at once."""

    __slots__ = ("t_ns",)

    def __init__(self) -> None:
        self.t_ns: int | None = None

    def record(self, stream: Any = None) -> None:
        self.t_ns = time.perf_counter_ns()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def elapsed_ns(self, end: DeviceEvent) -> int | None:
        t1 = getattr(end, "t_ns", None)
        if self.t_ns is None or t1 is None:
            return None
        return max(0, t1 - self.t_ns)


def native_copy_loop() -> Any:
    """The compiled copy loop (``hicache_obs._copy``) the cpu runtime runs its copies with.

    Raises :class:`~hicache_obs.errors.RuntimeUnavailableError` when the extension was
    not built (a source tree used without ``pip install``): never a silent fallback.
    """
    try:
        return importlib.import_module("hicache_obs._copy")
    except ImportError as exc:
        raise RuntimeUnavailableError(
            f"the cpu runtime's copy loop hicache_obs._copy is not built ({exc}); install the package "
            "(`make test`, or `pip install -e .` with a C compiler), or use runtime 'sim'"
        ) from None


class CpuRuntime:
    """Synchronous runtime: streams are names, events are always complete.

    Copies of whole runs go through the compiled loop ``hicache_obs._copy``
    (``native_copies``) where :mod:`hicache_obs._native` chose it; otherwise
    ``native_copies`` is ``None`` and the cpu runtime copies with the torch kernels of
    :mod:`hicache_obs.core._transfer`, as the other runtimes do.
    """

    name = "cpu"
    device = "cpu"
    has_device = False
    tensor_type = torch.Tensor

    def __init__(self) -> None:
        self.observers = CallObservers()
        self._main = _CpuStream("main")
        self._tls = threading.local()  # the current stream is per thread
        self.native_copies: Any = _native.copy  # None: the torch kernels

    def stream(self, name: str) -> _CpuStream:
        return _CpuStream(name)

    def current_stream(self) -> Any:
        return getattr(self._tls, "stream", self._main)

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[Any]:
        prev = self.current_stream()
        self._tls.stream = stream
        try:
            yield stream
        finally:
            self._tls.stream = prev

    def event(self, enable_timing: bool = False) -> _CpuEvent:
        return _CpuEvent()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        return None  # nothing is a device tensor: no record to make, nothing to report

    def is_device(self, tensor: torch.Tensor) -> bool:
        return False

    def to_device(self, tensor: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        return tensor

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def launch(self, fn: Callable[..., None], *tensors: Any) -> None:
        fn(*tensors)

    def synchronize(self) -> None:
        return None

    def drain(self) -> None:
        return None

    def values_readable(self, tensor: torch.Tensor) -> bool:
        return True

    def tensor_device(self, tensor: torch.Tensor) -> str:
        return "cpu"


# -------------------------------------------------------------------------- cuda


class _CudaEvent:
    __slots__ = ("_ev",)

    def __init__(self, enable_timing: bool) -> None:
        self._ev = torch.cuda.Event(enable_timing=enable_timing)

    @property
    def raw(self) -> torch.cuda.Event:
        """The ``torch.cuda.Event`` this wraps."""
        return self._ev

    def record(self, stream: Any = None) -> None:
        self._ev.record(getattr(stream, "stream", stream))

    def query(self) -> bool:
        return bool(self._ev.query())

    def synchronize(self) -> None:
        self._ev.synchronize()

    def wait(self, stream: Any = None) -> None:
        self._ev.wait(getattr(stream, "stream", stream))

    def elapsed_ns(self, end: DeviceEvent) -> int | None:
        try:
            return int(self._ev.elapsed_time(end.raw) * 1e6)  # type: ignore[attr-defined]
        except (RuntimeError, AttributeError):
            return None


class _NamedCudaStream(torch.cuda.Stream):
    """A CUDA stream that carries the name events report (``hicache-write``, ...)."""

    def __new__(cls, name: str, device: Any = None, priority: int = 0) -> _NamedCudaStream:
        self = super().__new__(cls, device=device, priority=priority)
        self.name = name
        return self

    def __init__(self, name: str, device: Any = None, priority: int = 0) -> None:
        pass  # set up in __new__, as torch.cuda.Stream does


class _StreamName:
    """The current stream as torch returns it, with a name beside it."""

    __slots__ = ("name", "stream")

    def __init__(self, stream: Any, name: str) -> None:
        self.stream = stream
        self.name = name


class CudaRuntime:
    """Real CUDA streams, events and ``Tensor.record_stream``."""

    name = "cuda"
    has_device = True
    tensor_type = torch.Tensor

    def __init__(self, device: int | str = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeUnavailableError(
                "runtime 'cuda' was asked for but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); use runtime 'sim' to model CUDA on a CPU"
            )
        self._device = torch.device(device if isinstance(device, str) else f"cuda:{device}")
        self.device = str(self._device)
        self.observers = CallObservers()

    def stream(self, name: str) -> Any:
        return _NamedCudaStream(name, device=self._device)

    def current_stream(self) -> Any:
        s = torch.cuda.current_stream(self._device)
        return s if isinstance(s, _NamedCudaStream) else _StreamName(s, "main")

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(getattr(stream, "stream", stream))

    def event(self, enable_timing: bool = False) -> _CudaEvent:
        return _CudaEvent(enable_timing)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.is_cuda:
            tensor.record_stream(getattr(stream, "stream", stream))
            self.observers.recorded(tensor, stream)

    def is_device(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_cuda)

    def to_device(self, tensor: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        return self.observers.moved(tensor, tensor.to(self._device, non_blocking=non_blocking))

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.observers.moved(tensor, tensor.cpu())

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self._device)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def launch(self, fn: Callable[..., None], *tensors: Any) -> None:
        fn(*tensors)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)

    def drain(self) -> None:
        self.synchronize()

    def values_readable(self, tensor: torch.Tensor) -> bool:
        return not tensor.is_cuda

    def tensor_device(self, tensor: torch.Tensor) -> str:
        return str(tensor.device)


def make_runtime(name: str | Runtime, **kwargs: Any) -> Runtime:
    """Build a runtime by name (``cpu``, ``sim``, ``cuda``) or pass one through."""
    if not isinstance(name, str):
        return name
    if name == "cpu":
        return CpuRuntime()
    if name == "sim":
        from ._sim import SimRuntime

        return SimRuntime(**kwargs)
    if name == "cuda":
        return CudaRuntime(**kwargs)
    raise ConfigError(f"unknown runtime {name!r}; expected one of {', '.join(RUNTIME_NAMES)}")
