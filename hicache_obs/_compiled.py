"""Old name of :mod:`hicache_obs._native`, kept for the imports that still use it: the
same objects, chosen there (compiled, or the pure-Python twin)."""

from __future__ import annotations

from ._native import LogCore, SlotMap, gap_free_run, pair_runs_of, runs_of, side_runs

__all__ = ["LogCore", "SlotMap", "gap_free_run", "pair_runs_of", "runs_of", "side_runs"]
