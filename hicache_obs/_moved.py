"""Import paths of modules that moved: the lab's, to :mod:`hicache_obs.lab`, and the product
modules behind the front door, now private (``_``-modules) whose public names their packages
export.

Each old path is a short module that calls :func:`forward`: importing it warns
(``DeprecationWarning``, naming the new path) and every name of the new module is
readable from it, ``from old import *`` included. They are kept for one release.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

#: old import path -> where the module is now
MOVED: dict[str, str] = {
    "hicache_obs.bench": "hicache_obs.lab.bench",
    "hicache_obs.testing": "hicache_obs.lab.testing",
    "hicache_obs.workload": "hicache_obs.lab.workload",
    "hicache_obs.cli.demo": "hicache_obs.lab.cli.demo",
    "hicache_obs.cli.bench": "hicache_obs.lab.cli.bench",
    "hicache_obs.integrations.sglang.testing": "hicache_obs.lab.sglang.testing",
    "hicache_obs.integrations.sglang.kernels": "hicache_obs.lab.sglang.kernels",
    "hicache_obs.integrations.sglang.engine": "hicache_obs.lab.sglang.engine",
    "hicache_obs.integrations.sglang.tree": "hicache_obs.lab.sglang.tree",
    "hicache_obs.integrations.sglang.floor": "hicache_obs.lab.sglang.floor",
    "hicache_obs.integrations.sglang.deferred": "hicache_obs.lab.sglang.deferred",
    "hicache_obs.integrations.sglang.server": "hicache_obs.lab.sglang.server",
    "hicache_obs.integrations.sglang.cpu_server": "hicache_obs.lab.sglang.cpu_server",
    # modules behind the front door: their names are read from the packages now
    "hicache_obs.cli.audit": "hicache_obs.cli._audit",
    "hicache_obs.cli.export": "hicache_obs.cli._export",
    "hicache_obs.cli.inspect": "hicache_obs.cli._inspect",
    "hicache_obs.cli.instrument": "hicache_obs.cli._instrument",
    "hicache_obs.core.controller": "hicache_obs.core._controller",
    "hicache_obs.core.layers": "hicache_obs.core._layers",
    "hicache_obs.core.operations": "hicache_obs.core._operations",
    "hicache_obs.core.policy": "hicache_obs.core._policy",
    "hicache_obs.core.pools": "hicache_obs.core._pools",
    "hicache_obs.core.runtime": "hicache_obs.core._runtime",
    "hicache_obs.core.sim": "hicache_obs.core._sim",
    "hicache_obs.core.spec": "hicache_obs.core._spec",
    "hicache_obs.core.tensors": "hicache_obs.core._tensors",
    "hicache_obs.core.transfer": "hicache_obs.core._transfer",
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
    "hicache_obs.exporters.otel": "hicache_obs.exporters._otel",
    "hicache_obs.exporters.metrics_server": "hicache_obs.exporters._metrics_server",
    "hicache_obs.exporters.prometheus": "hicache_obs.exporters._prometheus",
    "hicache_obs.exporters.structlog_sink": "hicache_obs.exporters._structlog_sink",
    "hicache_obs.integrations.sglang.adapter": "hicache_obs.integrations.sglang._adapter",
    "hicache_obs.integrations.sglang.launcher": "hicache_obs.integrations.sglang._launcher",
}


def forward(old: str) -> None:
    """Make the module ``old`` (being imported) read every name from its new module."""
    new = MOVED[old]
    warnings.warn(
        f"{old} moved to {new}; the old import path is kept for one release",
        DeprecationWarning,
        stacklevel=3,
    )
    target = importlib.import_module(new)
    shim = sys.modules[old]
    parent, _, child = old.rpartition(".")
    same = getattr(sys.modules.get(parent), child, None)
    if callable(same) and not isinstance(same, ModuleType):
        # the package exports a function of the old module's name (``events.replay``): the import
        # system is about to bind this module there, so it must still call like the function
        shim.__class__ = type("CallableForward", (ModuleType,), {"__call__": staticmethod(same)})
    names = getattr(target, "__all__", None)
    public = list(names) if names is not None else [n for n in vars(target) if not n.startswith("_")]

    def read(name: str) -> Any:
        return getattr(target, name)

    listing: Callable[[], list[str]] = lambda: sorted(dir(target))  # noqa: E731
    for attr, value in (("__all__", public), ("__getattr__", read), ("__dir__", listing)):
        setattr(shim, attr, value)
