"""Per-layer load completion: :class:`LayerDoneCounter`.

A ring of three per-load event sets (overlap mode: the next batch's load may
start while the current one computes). ``update_producer()`` takes the next slot
and requires that slot's previous load to be finished; ``set_consumer(i)`` picks
the load a batch reads; ``wait_until(layer)`` makes the compute stream wait for
that layer's copy (nothing while no consumer is set).
"""

from __future__ import annotations

from typing import Any

from ..errors import ProducerSlotBusyError
from ._runtime import DeviceEvent, Runtime

__all__ = ["LayerDoneCounter"]


class LayerDoneCounter:
    def __init__(self, runtime: Runtime, num_layers: int, num_counters: int = 3, enable_timing: bool = False) -> None:
        self.runtime = runtime
        self.num_layers = num_layers
        self.num_counters = num_counters
        self.enable_timing = enable_timing
        self.events: list[list[DeviceEvent]] = [
            [runtime.event(enable_timing) for _ in range(num_layers)] for _ in range(num_counters)
        ]
        self.finish_events: list[DeviceEvent | None] = [None] * num_counters
        self.producer_index = -1
        self.consumer_index = -1

    def update_producer(self) -> int:
        """Advance to the next slot; raises if that slot's previous load is unfinished."""
        nxt = (self.producer_index + 1) % self.num_counters
        prev = self.finish_events[nxt]
        if prev is not None and not prev.query():
            raise ProducerSlotBusyError(
                f"LayerDoneCounter slot {nxt} reused while its previous load is still running "
                f"({self.num_counters} loads in flight); poll loads before starting another"
            )
        self.producer_index = nxt
        self.events[nxt] = [self.runtime.event(self.enable_timing) for _ in range(self.num_layers)]
        self.finish_events[nxt] = None
        return nxt

    def layer_event(self, producer: int, layer: int) -> DeviceEvent:
        return self.events[producer][layer]

    def set_finish_event(self, producer: int, event: DeviceEvent) -> None:
        self.finish_events[producer] = event

    def set_consumer(self, index: int) -> None:
        if not -1 <= index < self.num_counters:
            from ..errors import ConfigError

            raise ConfigError(f"consumer index {index} outside -1..{self.num_counters - 1}")
        self.consumer_index = index

    def wait_until(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait until ``layer`` of the consumer's load is done."""
        if self.consumer_index < 0:
            return
        if not 0 <= layer < self.num_layers:
            from ..errors import ConfigError

            raise ConfigError(f"layer {layer} outside 0..{self.num_layers - 1}")
        self.events[self.consumer_index][layer].wait(stream)

    def reset(self) -> None:
        self.consumer_index = -1
