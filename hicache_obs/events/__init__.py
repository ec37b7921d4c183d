"""Events: the schema, the in-memory log, sinks, and the bookkeeping fold."""

from .log import EventLog, Subscriber
from .schema import *  # noqa: F403
from .schema import __all__ as _schema_all
from .sinks import BatchSink, ListSink, Sink, SinkRunner
from .state import CacheState, OpState, SlotTable, fold

__all__ = [
    *_schema_all,
    "EventLog",
    "Subscriber",
    "Sink",
    "BatchSink",
    "ListSink",
    "SinkRunner",
    "CacheState",
    "OpState",
    "SlotTable",
    "fold",
]
