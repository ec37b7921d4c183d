"""hicache-obs: a hierarchical KV-cache controller whose every state change is an event.

``hicache_obs.core`` moves cache state between device and host pools;
``hicache_obs.events`` holds the event schema, the log and the bookkeeping fold;
``hicache_obs.exporters`` turns events into metrics, spans, logs and traces.
"""

from .errors import HiCacheError

__version__ = "0.1.0"

__all__ = ["HiCacheError", "__version__"]
