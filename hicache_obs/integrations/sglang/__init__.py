"""Instrument SGLang's own HiCache controllers: drop-in, no source edits.

``instrument(controller)`` attaches an event log to one live SGLang
``HiCacheController`` or ``HybridCacheController`` (releases 0.5.10 to 0.5.23, by
feature detection); ``detach()`` restores it. Everything it reports comes from calls
it observed at the controller's boundaries (see :mod:`.adapter`).
``hicache_obs.lab.sglang.harness`` builds real SGLang controllers on a CPU.
SGLang itself is never imported here: the adapter works on the instance it is given.
The adapter (and torch) is imported on first use of its names, so that
``hicache-obs instrument``, which only sets up the command it runs, starts without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import IntegrationError

if TYPE_CHECKING:
    from ._adapter import Instrumentation, instrument, instrumentation_of

__all__ = ["Instrumentation", "IntegrationError", "instrument", "instrumentation_of", "SUPPORTED_RELEASES"]

#: The SGLang releases the tests pin and run on (the adapter detects features, not versions).
SUPPORTED_RELEASES = ("0.5.10", "0.5.11", "0.5.12", "0.5.13", "0.5.23")

_ADAPTER_NAMES = frozenset({"Instrumentation", "instrument", "instrumentation_of"})


def __getattr__(name: str) -> Any:
    if name in _ADAPTER_NAMES:
        from . import _adapter

        value = getattr(_adapter, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
