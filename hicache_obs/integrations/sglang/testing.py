"""SGLang's real controllers on a CPU, for tests (:func:`build_controller`, :func:`prepare`): the
module lives in the lab, :mod:`hicache_obs.lab.sglang.harness`; this path reads every name of it."""

from typing import TYPE_CHECKING

from hicache_obs._moved import forward

if TYPE_CHECKING:
    from hicache_obs.lab.sglang.harness import *  # noqa: F403

forward(__name__)
