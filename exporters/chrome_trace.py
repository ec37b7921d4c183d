"""Moved to :mod:`hicache_obs.exporters._chrome_trace`; this path still works, with a ``DeprecationWarning``, for one
release."""

from hicache_obs._moved import forward

forward(__name__)
