"""The buggy caller: what the workload does wrong for the fault modes whose bug is the caller's.

The ``double-free`` and ``use-after-free`` faults (see :data:`hicache_obs.testing.FAULTS`)
only remove the controller's guard; the bug itself is in the caller, and the workload
plays it when it evicts a node's host copy:

- ``double-free``: it frees the evicted host copy a second time;
- ``use-after-free``: it keeps the node and the host indices it just freed (the node is
  *stale*) and loads them back later; after that load it forgets them.

Every other fault is the controller's own and changes nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CALLER_FAULTS", "CallerBugs"]

#: The faults the workload plays the buggy caller for.
CALLER_FAULTS = ("double-free", "use-after-free")


@dataclass(frozen=True, slots=True)
class CallerBugs:
    """The caller bugs to play; all off for a correct caller."""

    frees_twice: bool = False  # double-free: an evicted host copy is freed again
    keeps_freed: bool = False  # use-after-free: the node keeps the host indices it freed

    @classmethod
    def of(cls, fault: str | None) -> CallerBugs:
        """The bugs of ``fault`` (a name of :data:`hicache_obs.testing.FAULTS`, or None)."""
        return cls(frees_twice=fault == "double-free", keeps_freed=fault == "use-after-free")
