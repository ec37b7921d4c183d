"""What ``hicache-obs instrument -- COMMAND`` does inside COMMAND and the processes it spawns.

The command puts ``_boot/`` first on ``PYTHONPATH``; its ``sitecustomize`` calls
:func:`install_import_hook` in every Python process that inherits the environment.
The hook waits for SGLang's controller modules to be imported and wraps the
controller classes' ``__init__``; nothing else happens in a process that creates no
controller. Each controller, when its outermost ``__init__`` returns, gets a pipeline
of its own:

- an :class:`~hicache_obs.events._log.EventLog` for its TP rank, written under
  ``$HICACHE_OBS_OUT/rank-N/`` (one folder per rank; ``hicache-obs audit`` merges them);
- the live auditor;
- ``/metrics`` on ``$HICACHE_OBS_METRICS_HOST:$HICACHE_OBS_METRICS_PORT + N`` (host
  ``127.0.0.1`` unless set; the first controller of each process; a port already taken, or a
  host that is not an IP address, is one line on stderr and the run goes on without it);
- OpenTelemetry spans when ``HICACHE_OBS_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``
  is set;
- the profile ``HICACHE_OBS_PROFILE`` names (default ``metrics``), with the share
  ``HICACHE_OBS_AUDIT_SAMPLE`` gives ``sampling`` (:mod:`hicache_obs._profiles`).

``HICACHE_OBS_RANK`` overrides the rank read from the controller's ``tp_group``.
Everything is flushed and closed at interpreter exit.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import ipaddress
import os
import sys
import threading
import weakref
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

__all__ = ["ENV", "TARGETS", "install_import_hook", "instrument_new_controller", "pipelines"]

#: Environment variables the command sets for COMMAND.
ENV = {
    "enable": "HICACHE_OBS_INSTRUMENT",
    "metrics_port": "HICACHE_OBS_METRICS_PORT",
    "metrics_host": "HICACHE_OBS_METRICS_HOST",
    "out": "HICACHE_OBS_OUT",
    "otlp_endpoint": "HICACHE_OBS_OTLP_ENDPOINT",
    "rank": "HICACHE_OBS_RANK",
}
#: Module -> controller classes whose instances are instrumented.
TARGETS = {
    "sglang.srt.managers.cache_controller": ("HiCacheController",),
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller": ("HybridCacheController",),
}
_lock = threading.Lock()
_pipelines: list[_Pipeline] = []
_served_ports: set[int] = set()


def pipelines() -> list[Any]:
    """The pipelines started in this process (one per instrumented controller)."""
    with _lock:
        return list(_pipelines)


def metrics_address(host: str, port: int) -> str:
    """``host:port`` for the /metrics server (``[host]:port`` for IPv6); ``ValueError`` naming
    the value unless ``host`` is an IP address (the server binds it as given: ``0.0.0.0`` or
    ``::`` for every interface)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"metrics host {host!r} is not an IP address (127.0.0.1, 0.0.0.0, ::1, ...)") from None
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _say(msg: str) -> None:
    print(f"hicache-obs: {msg}", file=sys.stderr, flush=True)


class _Pipeline:
    def __init__(self, controller: Any) -> None:
        from ..._profiles import profile_from_env
        from ...events._audit import Auditor
        from ...events._log import EventLog
        from ...events._store import open_store
        from ._adapter import _rank_of, instrument

        self.profile = profile_from_env()  # a bad value: this controller is not instrumented (one line)
        rank_env = os.environ.get(ENV["rank"])
        self.rank = int(rank_env) if rank_env not in (None, "") else _rank_of(controller)
        # the rank's folder has every event: none is kept in memory besides the sinks' ring,
        # so a scheduler that serves for days holds a bounded number of them
        self.log = EventLog(rank=self.rank, capacity=0)
        out = Path(os.environ.get(ENV["out"]) or "hicache-obs-sglang")
        with _lock:
            n = sum(p.rank == self.rank for p in _pipelines)
        self.folder = out / (f"rank-{self.rank}" if n == 0 else f"rank-{self.rank}.{n}")
        self.store = open_store(self.log, self.folder)
        self.auditor = Auditor().attach(self.log)
        self.metrics_url: str | None = None
        self._server: Any = None
        self._sink: Any = None
        self._start_metrics()
        self._start_otel()
        self.instrumentation = instrument(controller, log=self.log, profile=self.profile)
        if self._sink is not None and not self.profile.full:  # no allocation logged: occupancy read at scrape
            self._sink.read_pools_from(self.instrumentation.pool_usage, rank=self.rank)
        # a finding reaches the files before the call that revealed it returns into SGLang
        # (whose own assertion may end the process right after, without running atexit)
        auditor, store = self.auditor, self.store
        self.instrumentation.make_findings_durable(lambda: len(auditor.findings), lambda: store.flush(10.0))

    def _start_metrics(self) -> None:
        base = os.environ.get(ENV["metrics_port"])
        if not base:
            return
        port = int(base) + self.rank
        with _lock:
            if port in _served_ports:
                _say(f"rank {self.rank}: port {port} already serves this process's first controller; "
                     "this controller is logged only")
                return
            _served_ports.add(port)
        from prometheus_client import CollectorRegistry

        from hicache_obs.exporters._metrics_server import start_metrics_server
        from hicache_obs.exporters._prometheus import PrometheusSink

        host = os.environ.get(ENV["metrics_host"]) or "127.0.0.1"
        try:
            where = metrics_address(host, port)
        except ValueError as exc:
            _say(f"rank {self.rank}: cannot serve /metrics: {exc}")
            return
        registry = CollectorRegistry()
        self._sink = PrometheusSink(registry, log=self.log)
        self.log.add_sink(self._sink)
        try:
            self._server, bound = start_metrics_server(registry, port=port, addr=host)
        except OSError as exc:
            _say(f"rank {self.rank}: cannot serve /metrics on {where}: {exc.strerror or exc}")
            return
        self.metrics_url = f"http://{metrics_address(host, bound)}/metrics"

    def _start_otel(self) -> None:
        endpoint = os.environ.get(ENV["otlp_endpoint"]) or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if not endpoint:
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        from hicache_obs.exporters._otel import OtelSpanSink

        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        self.log.add_sink(OtelSpanSink(service_name="sglang-hicache", exporter=OTLPSpanExporter(endpoint=url)))

    def close(self) -> None:
        self.auditor.finish()
        self.log.close()
        stop = getattr(self._server, "stop", None) or getattr(self._server, "shutdown", None)
        if stop is not None:
            stop()


def instrument_new_controller(controller: Any) -> Any:
    """Start a pipeline for a controller that has just been built; never raises into SGLang."""
    try:
        p = _Pipeline(controller)
    except Exception as exc:  # telemetry must not take the engine down: say so, go on
        _say(f"could not instrument {type(controller).__name__}: {type(exc).__name__}: {exc}")
        return None
    with _lock:
        first = not _pipelines
        _pipelines.append(p)
    if first:
        atexit.register(_close_all)
    where = f", /metrics at {p.metrics_url}" if p.metrics_url else ""
    profile = p.profile.name + (f" {p.profile.audit_sample:g}" if p.profile.name == "sampling" else "")
    _say(f"instrumented {type(controller).__name__} (rank {p.rank}, profile {profile}): log in {p.folder}{where}")
    return p


def _close_all() -> None:
    with _lock:
        ps = list(_pipelines)
    for p in ps:
        try:
            p.close()
        except Exception as exc:
            _say(f"rank {p.rank}: closing the log failed: {type(exc).__name__}: {exc}")


_DEPTH = "_hicache_obs_init_depth"
# the __init__ wrappers _patch_class put on classes (weakly: a class that goes takes its own)
_patched_inits: weakref.WeakSet[Callable[..., None]] = weakref.WeakSet()


def _patch_class(cls: type) -> None:
    original = cls.__dict__.get("__init__")
    if original is None or original in _patched_inits:
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        depth = self.__dict__.get(_DEPTH, 0)
        self.__dict__[_DEPTH] = depth + 1
        try:
            original(self, *args, **kwargs)
        finally:
            if depth:
                self.__dict__[_DEPTH] = depth
            else:
                self.__dict__.pop(_DEPTH, None)
        if depth == 0:  # the outermost __init__ (a subclass's) has finished
            instrument_new_controller(self)

    _patched_inits.add(__init__)
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    __init__.__doc__ = original.__doc__
    cls.__init__ = __init__  # type: ignore[misc]


def _patch_module(module: Any) -> None:
    for name in TARGETS.get(module.__name__, ()):
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            _patch_class(cls)


def find_spec_after(finder: Any, name: str, path: Any, target: Any = None) -> Any:
    """The spec the finders after ``finder`` on ``sys.meta_path`` give for ``name`` (another
    import hook that wraps the same module keeps working, whichever comes first)."""
    finders = list(sys.meta_path)
    rest = finders[finders.index(finder) + 1 :] if finder in finders else finders
    for other in rest:
        find = getattr(other, "find_spec", None)
        if find is None:
            continue
        spec = find(name, path, target)
        if spec is not None:
            return spec
    return importlib.machinery.PathFinder.find_spec(name, path)


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after each module named in ``targets`` has executed; the
    module itself is found by the finders after this one."""

    def __init__(self, targets: Collection[str], patch: Callable[[Any], None]) -> None:
        self.targets = frozenset(targets)
        self.patch = patch

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def,override]
        if name not in self.targets:
            return None
        spec = find_spec_after(self, name, path, target)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module
        patch = self.patch

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]  # this spec's own loader
        return spec


def install_import_hook() -> None:
    """Instrument every SGLang HiCache controller this process creates from now on. Idempotent."""
    if not any(isinstance(f, PatchAfterImport) and f.patch is _patch_module for f in sys.meta_path):
        sys.meta_path.insert(0, PatchAfterImport(TARGETS, _patch_module))
    for name in TARGETS:  # already imported (sitecustomize ran late): patch in place
        module = sys.modules.get(name)
        if module is not None:
            _patch_module(module)
