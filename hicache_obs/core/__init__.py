"""The torch side: model specs, controllers, operations, write policies and runtimes.

The public names are listed in ``__all__``; the modules behind them (``_controller``,
``_pools``, ``_runtime`` and the rest) are private.
"""

from .._moved import package_getattr
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

#: names that left ``__all__``: still read from here for one release, with a warning
__getattr__ = package_getattr(__name__, {
    "ANCHOR": "_controller", "Ack": "_controller", "CpuRuntime": "_runtime", "CudaRuntime": "_runtime",
    "DeviceEvent": "_runtime", "Runtime": "_runtime", "DevicePool": "_pools", "HostPool": "_pools",
    "SlotAllocator": "_pools", "host_size": "_pools", "SimRuntime": "_sim", "SimTensor": "_sim",
    "merge_ops": "_operations",
})  # fmt: skip
