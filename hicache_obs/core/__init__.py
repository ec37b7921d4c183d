"""The torch side: model specs, controllers, operations, write policies and runtimes.

The public names are listed in ``__all__``; the modules behind them (``_controller``,
``_pools``, ``_runtime`` and the rest) are private.
"""

from ._controller import HiCacheController
from ._hybrid import HybridCacheController
from ._layers import LayerDoneCounter
from ._operations import CacheOperation, PoolTransfer
from ._policy import WRITE_POLICIES, WritePolicy
from ._pools import LAYOUTS
from ._runtime import RUNTIME_NAMES, make_runtime
from ._spec import MODEL_PRESETS, ModelSpec, PlaneSpec
from ._transfer import IO_BACKENDS

__all__ = [
    "HiCacheController",
    "HybridCacheController",
    "ModelSpec",
    "PlaneSpec",
    "MODEL_PRESETS",
    "PoolTransfer",
    "CacheOperation",
    "LayerDoneCounter",
    "WritePolicy",
    "WRITE_POLICIES",
    "LAYOUTS",
    "IO_BACKENDS",
    "RUNTIME_NAMES",
    "make_runtime",
]
