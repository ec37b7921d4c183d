"""Moved to :mod:`hicache_obs.events._sinks`; this path still works, with a ``DeprecationWarning``, for one
release."""

from hicache_obs._moved import forward

forward(__name__)
