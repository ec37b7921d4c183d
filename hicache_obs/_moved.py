"""Import paths of modules that moved: the lab's, to :mod:`hicache_obs.lab`, and the product
modules behind the front door, now private (``_``-modules) whose public names their packages
export.

Each old path is a short module that calls :func:`forward`: importing it warns
(``DeprecationWarning``, naming the new path) and every name of the new module is readable
from it, ``from old import *`` included. Where the new module is a package, the old path's
submodules forward too (``hicache_obs.workload.driver``). Names that left a package's
``__all__`` still read from the package, with the same warning (:func:`package_getattr`).
All of them are kept for one release, but for the paths of :data:`KEPT`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

#: old import path -> where the module is now
MOVED: dict[str, str] = {
    "hicache_obs.bench": "hicache_obs.lab.bench",
    "hicache_obs.workload": "hicache_obs.lab.workload",
    "hicache_obs.cli.demo": "hicache_obs.lab.cli.demo",
    "hicache_obs.cli.bench": "hicache_obs.lab.cli.bench",
    "hicache_obs.integrations.sglang.testing": "hicache_obs.lab.sglang.harness",
    "hicache_obs.integrations.sglang.kernels": "hicache_obs.lab.sglang.kernels",
    "hicache_obs.integrations.sglang.engine": "hicache_obs.lab.sglang.engine",
    "hicache_obs.integrations.sglang.tree": "hicache_obs.lab.sglang.tree",
    "hicache_obs.integrations.sglang.floor": "hicache_obs.lab.sglang.floor",
    "hicache_obs.integrations.sglang.deferred": "hicache_obs.lab.sglang.deferred",
    "hicache_obs.integrations.sglang.server": "hicache_obs.lab.sglang.server",
    "hicache_obs.integrations.sglang.cpu_server": "hicache_obs.lab.sglang.cpu_server",
    "hicache_obs.integrations.sglang.cpu_alloc": "hicache_obs.lab.sglang.cpu_alloc",
    "hicache_obs.integrations.sglang.cpu_conv": "hicache_obs.lab.sglang.cpu_conv",
    "hicache_obs.integrations.sglang.cpu_mamba2": "hicache_obs.lab.sglang.cpu_mamba2",
    "hicache_obs.integrations.sglang.cpu_swa": "hicache_obs.lab.sglang.cpu_swa",
    "hicache_obs.integrations.sglang.server_demo": "hicache_obs.lab.sglang.server_demo",
    # the modules behind the front door, private now
    "hicache_obs.cli.audit": "hicache_obs.cli._audit",
    "hicache_obs.cli.export": "hicache_obs.cli._export",
    "hicache_obs.cli.inspect": "hicache_obs.cli._inspect",
    "hicache_obs.cli.instrument": "hicache_obs.cli._instrument",
    "hicache_obs.core.acks": "hicache_obs.core._acks",
    "hicache_obs.core.admission": "hicache_obs.core._admission",
    "hicache_obs.core.allocation": "hicache_obs.core._allocation",
    "hicache_obs.core.closing": "hicache_obs.core._closing",
    "hicache_obs.core.controller": "hicache_obs.core._controller",
    "hicache_obs.core.describe": "hicache_obs.core._describe",
    "hicache_obs.core.hybrid": "hicache_obs.core._hybrid",
    "hicache_obs.core.index_moves": "hicache_obs.core._index_moves",
    "hicache_obs.core.layers": "hicache_obs.core._layers",
    "hicache_obs.core.operations": "hicache_obs.core._operations",
    "hicache_obs.core.policy": "hicache_obs.core._policy",
    "hicache_obs.core.pools": "hicache_obs.core._pools",
    "hicache_obs.core.reports": "hicache_obs.core._reports",
    "hicache_obs.core.runtime": "hicache_obs.core._runtime",
    "hicache_obs.core.sim": "hicache_obs.core._sim",
    "hicache_obs.core.spec": "hicache_obs.core._spec",
    "hicache_obs.core.submission": "hicache_obs.core._submission",
    "hicache_obs.core.tensors": "hicache_obs.core._tensors",
    "hicache_obs.core.torch_compat": "hicache_obs.core._torch_compat",
    "hicache_obs.core.transfer": "hicache_obs.core._transfer",
    "hicache_obs.core.validation": "hicache_obs.core._validation",
    "hicache_obs.events.audit": "hicache_obs.events._audit",
    "hicache_obs.events.lifecycle": "hicache_obs.events._lifecycle",
    "hicache_obs.events.log": "hicache_obs.events._log",
    "hicache_obs.events.projections": "hicache_obs.events._projections",
    "hicache_obs.events.replay": "hicache_obs.events._replay",
    "hicache_obs.events.schema": "hicache_obs.events._schema",
    "hicache_obs.events.sinks": "hicache_obs.events._sinks",
    "hicache_obs.events.state": "hicache_obs.events._state",
    "hicache_obs.events.store": "hicache_obs.events._store",
    "hicache_obs.exporters.chrome_trace": "hicache_obs.exporters._chrome_trace",
    "hicache_obs.exporters.metrics_server": "hicache_obs.exporters._metrics_server",
    "hicache_obs.exporters.otel": "hicache_obs.exporters._otel",
    "hicache_obs.exporters.prometheus": "hicache_obs.exporters._prometheus",
    "hicache_obs.exporters.sinkhost.child": "hicache_obs.exporters.sinkhost._child",
    "hicache_obs.exporters.sinkhost.client": "hicache_obs.exporters.sinkhost._client",
    "hicache_obs.exporters.sinkhost.feeder": "hicache_obs.exporters.sinkhost._feeder",
    "hicache_obs.exporters.sinkhost.specs": "hicache_obs.exporters.sinkhost._specs",
    "hicache_obs.exporters.sinkhost.wire": "hicache_obs.exporters.sinkhost._wire",
    "hicache_obs.exporters.structlog_sink": "hicache_obs.exporters._structlog_sink",
    "hicache_obs.integrations.sglang.adapter": "hicache_obs.integrations.sglang._adapter",
    "hicache_obs.integrations.sglang.describe": "hicache_obs.integrations.sglang._tensor_facts",
    "hicache_obs.integrations.sglang.launcher": "hicache_obs.integrations.sglang._launcher",
    "hicache_obs.integrations.sglang.record_stream": "hicache_obs.integrations.sglang._record_stream",
    "hicache_obs.profiles": "hicache_obs._profiles",
}

#: old paths that stay, without a warning: users know the SGLang test support by this one
KEPT = frozenset({"hicache_obs.integrations.sglang.testing"})


def _warn(old: str, new: str, stacklevel: int) -> None:
    """The one warning of every old path; ``stacklevel`` as the caller would give it."""
    message = f"{old} moved to {new}; the old import path is kept for one release"
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def _new_path(old: str) -> str | None:
    """Where ``old`` is now: a moved module, or a submodule of a moved package."""
    if old in MOVED:
        return MOVED[old]
    parent = old.rpartition(".")[0]
    while parent:
        if parent in MOVED:
            return f"{MOVED[parent]}.{old[len(parent) + 1:]}"
        parent = parent.rpartition(".")[0]
    return None


def _attribute(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def _bind(shim: ModuleType, old: str, target: ModuleType) -> None:
    child = old.rpartition(".")[2]
    function = getattr(target, child, None)
    if callable(function) and not isinstance(function, ModuleType):
        # the package also exports a function of the old module's name (``events.replay``);
        # the import system binds this module there, so it calls, pickles and reads like it
        shim.__class__ = type(
            "CallableForward",
            (ModuleType,),
            {
                "__call__": staticmethod(function),
                "__reduce_ex__": lambda self, protocol: (_attribute, (target.__name__, child)),
            },
        )
        shim.__wrapped__ = function  # type: ignore[attr-defined]
    names = getattr(target, "__all__", None)
    public = list(names) if names is not None else [n for n in vars(target) if not n.startswith("_")]

    def read(name: str) -> Any:
        return getattr(target, name)

    listing: Callable[[], list[str]] = lambda: sorted(dir(target))  # noqa: E731
    for attr, value in (("__all__", public), ("__getattr__", read), ("__dir__", listing)):
        setattr(shim, attr, value)
    if hasattr(target, "__path__"):
        shim.__path__ = []  # a package: its submodules come from the finder below
        if not any(isinstance(f, _Submodules) for f in sys.meta_path):
            sys.meta_path.append(_Submodules())


def forward(old: str) -> None:
    """Make the module ``old`` (being imported) read every name from its new module."""
    new = MOVED[old]
    if old not in KEPT:
        _warn(old, new, stacklevel=3)  # this function, the old module's body, the importing line
    _bind(sys.modules[old], old, importlib.import_module(new))


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``old.sub`` of a moved package: a module that forwards to ``new.sub``, never a second copy."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = None if fullname in MOVED else _new_path(fullname)
        if new is None or importlib.util.find_spec(new) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        new = _new_path(module.__name__)
        assert new is not None
        _warn(module.__name__, new, stacklevel=2)
        _bind(module, module.__name__, importlib.import_module(new))


def package_getattr(package: str, left: dict[str, str]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` for the names that left its ``__all__`` (``name`` -> its
    private module) and for its old submodule paths: each read warns, then answers."""

    def read(name: str) -> Any:
        if name in left:
            where = f"{package}.{left[name]}"
            _warn(f"{package}.{name}", f"{where}.{name}", stacklevel=2)
            return getattr(importlib.import_module(where), name)
        if f"{package}.{name}" in MOVED:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return read
