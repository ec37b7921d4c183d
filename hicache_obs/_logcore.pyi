# The event log's append path (hicache_obs/_logcore.c); EventLog subclasses LogCore.
# gap_free_run is the seq check a replay makes of every segment.
from typing import Any, TypeVar

_E = TypeVar("_E")

class LogCore:
    rank: Any
    published: int
    _seq: int
    _dispatching: bool
    def emit(self, cls: type[_E], /, **fields: Any) -> _E: ...
    def _publish(self, event: Any, /) -> None: ...
    def _bind(
        self, *, ring: list[Any], events: Any, subscribers: list[Any], blocking: list[Any], pending: Any, lock: Any
    ) -> None: ...

def gap_free_run(events: list[Any], /) -> tuple[int, int] | None: ...
