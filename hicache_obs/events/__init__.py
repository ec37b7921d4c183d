"""Events: the schema, the log, sinks, the bookkeeping fold, the auditor and replay.

The public names are listed in ``__all__`` (every event type of the schema among them); the
modules behind them (``_schema``, ``_log``, ``_audit`` and the rest) are private.
"""

from .._moved import package_getattr
from ._audit import RULES, Auditor, Finding, audit, audited
from ._log import EventLog
from ._replay import replay
from ._schema import *  # noqa: F403
from ._schema import __all__ as _schema_all
from ._sinks import BatchSink, ListSink, Sink
from ._state import CacheState, fold
from ._store import open_store

__all__ = [
    *_schema_all,
    "EventLog",
    "Sink",
    "BatchSink",
    "ListSink",
    "fold",
    "CacheState",
    "Auditor",
    "Finding",
    "RULES",
    "audit",
    "audited",
    "replay",
    "open_store",
]

#: names that left ``__all__``: still read from here for one release, with a warning
__getattr__ = package_getattr(
    __name__, {"Subscriber": "_log", "SinkRunner": "_sinks", "OpState": "_state", "SlotTable": "_state"}
)
