"""Moved to :mod:`hicache_obs.lab.bench`; this path still works, with a ``DeprecationWarning``, for one
release."""

from typing import TYPE_CHECKING

from hicache_obs._moved import forward

if TYPE_CHECKING:
    from hicache_obs.lab.bench import *  # noqa: F403

forward(__name__)
