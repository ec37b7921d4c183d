"""Moved to :mod:`hicache_obs.integrations.sglang._tensor_facts`; this path still works, with a ``DeprecationWarning``, for one
release."""

from typing import TYPE_CHECKING

from hicache_obs._moved import forward

if TYPE_CHECKING:
    from hicache_obs.integrations.sglang._tensor_facts import *  # noqa: F403

forward(__name__)
