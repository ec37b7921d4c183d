"""The SGLang adapter as it runs on a GPU, on the CPU harness.

On a GPU every device pool's allocator keeps its free lists in device memory, where a read
would sync, so the adapter leaves the device tiers unseen
(:attr:`~hicache_obs.integrations.sglang.Instrumentation.unseen_slot_tiers`): no slot of
theirs is read, and their frees are only compared with the tensors of ops in flight. The CPU
harness's CUDA stand-ins are CPU tensors, so there the adapter reads the device tiers' slots
as on a CPU deployment. :func:`instrument_as_on_a_gpu` instruments a controller with the
device tiers left unseen, as on a GPU: what the bench's profiles measure charges the
controller's thread for. Test and bench support.
"""

from __future__ import annotations

from typing import Any

from hicache_obs._profiles import resolve_profile
from hicache_obs.events._log import EventLog
from hicache_obs.integrations.sglang._adapter import Instrumentation

__all__ = ["GpuViewInstrumentation", "instrument_as_on_a_gpu"]


class GpuViewInstrumentation(Instrumentation):
    """The adapter with every device pool's free lists taken as device memory."""

    @staticmethod
    def _lists_in_device_memory(obj: Any) -> bool:
        return True


def instrument_as_on_a_gpu(
    controller: Any, *, log: EventLog, profile: str, audit_sample: float | None = None
) -> GpuViewInstrumentation:
    """:func:`~hicache_obs.integrations.sglang.instrument`, with the device tiers unseen as on a GPU."""
    return GpuViewInstrumentation.attach(controller, log=log, profile=resolve_profile(profile, audit_sample))
