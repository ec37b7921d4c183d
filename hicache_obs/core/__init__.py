"""The torch side: runtimes, model specs, pools, operations and controllers."""

from .controller import ANCHOR, Ack, HiCacheController
from .hybrid import HybridCacheController
from .layers import LayerDoneCounter
from .operations import CacheOperation, PoolTransfer, merge_ops
from .policy import WRITE_POLICIES, WritePolicy
from .pools import LAYOUTS, DevicePool, HostPool, SlotAllocator, host_size
from .runtime import RUNTIME_NAMES, CpuRuntime, CudaRuntime, DeviceEvent, Runtime, make_runtime
from .sim import SimRuntime, SimTensor
from .spec import MODEL_PRESETS, ModelSpec, PlaneSpec
from .transfer import IO_BACKENDS

__all__ = [
    "ANCHOR",
    "Ack",
    "CacheOperation",
    "CpuRuntime",
    "CudaRuntime",
    "DeviceEvent",
    "DevicePool",
    "HiCacheController",
    "HostPool",
    "HybridCacheController",
    "IO_BACKENDS",
    "LAYOUTS",
    "LayerDoneCounter",
    "MODEL_PRESETS",
    "ModelSpec",
    "PlaneSpec",
    "PoolTransfer",
    "RUNTIME_NAMES",
    "Runtime",
    "SimRuntime",
    "SimTensor",
    "SlotAllocator",
    "WRITE_POLICIES",
    "WritePolicy",
    "host_size",
    "make_runtime",
    "merge_ops",
]
