"""A synthetic prefix-reuse serving workload that drives a cache controller like SGLang's radix cache.

Requests (from a seeded RNG) share prefixes taken from a small set of
"documents" (system prompts, few-shot blocks), each a chain of nodes of 16 to
128 tokens (whole pages), and end with a short unique suffix. Each step serves
one request: it matches the cached prefix, loads back what is only on the host,
prefills the rest while the loads are in flight, checks every slot a transfer
filled against what was written there, and writes nodes through per the
controller's write policy. Everything is deterministic for a seed.

One module per concept:

- :mod:`.driver`: :class:`Workload` (the steps, the write policy, loads and writes),
  :class:`WorkloadConfig`, :func:`controller_options`, :func:`run_workload`;
- :mod:`.radix`: the tree of cached prefixes (:class:`~.radix.RadixNode`);
- :mod:`.eviction`: LRU eviction of device leaves and host-only leaves;
- :mod:`.checker`: the bit-for-bit data check and :class:`Corruption`;
- :mod:`.faults`: the buggy caller of the ``double-free`` and ``use-after-free`` faults;
- :mod:`.stats`: :class:`WorkloadStats`, what a run counted.

>>> from hicache_obs.core import HybridCacheController, ModelSpec
>>> spec = ModelSpec.tiny_hybrid()
>>> c = HybridCacheController(spec, runtime="sim", **controller_options(spec))
>>> stats = run_workload(c, seed=0, steps=50)
>>> stats.data_intact, stats.hit_rate["miss"] < 1
(True, True)
"""

from __future__ import annotations

from hicache_obs.lab.workload.checker import MAX_LISTED_CORRUPTIONS, Corruption
from hicache_obs.lab.workload.driver import Workload, WorkloadConfig, controller_options, run_workload
from hicache_obs.lab.workload.stats import WorkloadStats

__all__ = [
    "WorkloadConfig",
    "WorkloadStats",
    "Corruption",
    "Workload",
    "controller_options",
    "run_workload",
    "MAX_LISTED_CORRUPTIONS",
]
