"""Import paths the lab's modules had before they moved to :mod:`hicache_obs.lab`.

Each old path is a short module that calls :func:`forward`: importing it warns
(``DeprecationWarning``, naming the new path) and every name of the new module is
readable from it, ``from old import *`` included. They are kept for one release.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
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
    names = getattr(target, "__all__", None)
    public = list(names) if names is not None else [n for n in vars(target) if not n.startswith("_")]

    def read(name: str) -> Any:
        return getattr(target, name)

    listing: Callable[[], list[str]] = lambda: sorted(dir(target))  # noqa: E731
    for attr, value in (("__all__", public), ("__getattr__", read), ("__dir__", listing)):
        setattr(shim, attr, value)
