"""Moved to :mod:`hicache_obs.exporters.sinkhost._specs`; this path still works, with a ``DeprecationWarning``, for one
release."""

from typing import TYPE_CHECKING

from hicache_obs._moved import forward

if TYPE_CHECKING:
    from hicache_obs.exporters.sinkhost._specs import *  # noqa: F403

forward(__name__)
