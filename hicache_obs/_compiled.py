"""The compiled parts the event log and the slot tables stand on, imported in one place.

``hicache_obs._logcore`` (``EventLog.emit``, the replay's seq check) and
``hicache_obs._slots`` (slot tables, run-length encoding) are built by ``pip install``
(``setup.py``). A package installed without them fails here, at import, with a
:class:`~hicache_obs.errors.ConfigError` that says how to build them: there is no
slower pure-Python path to fall back to silently.
"""

from __future__ import annotations

from .errors import ConfigError

try:
    from . import _logcore
except ImportError as _exc:
    raise ConfigError(
        f"hicache_obs._logcore (the event log's append path) is not built ({_exc}); install the package "
        "with a C compiler present (make venv, or pip install -e .)"
    ) from None
try:
    from . import _slots
except ImportError as _exc:
    raise ConfigError(
        f"hicache_obs._slots (the slot maps) is not built ({_exc}); install the package "
        "with a C compiler present (make venv, or pip install -e .)"
    ) from None

LogCore = _logcore.LogCore
gap_free_run = _logcore.gap_free_run
SlotMap = _slots.SlotMap
runs_of = _slots.runs_of
pair_runs_of = _slots.pair_runs_of
side_runs = _slots.side_runs

__all__ = ["LogCore", "SlotMap", "gap_free_run", "pair_runs_of", "runs_of", "side_runs"]
