"""Write policies: when the radix cache backs a node up to the host.

- ``write_through``: after the first hit.
- ``write_through_selective``: once a node's hits reach ``threshold``.
- ``write_back``: only when the node is evicted from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["WRITE_POLICIES", "WritePolicy"]

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class WritePolicy:
    name: str = "write_through"
    threshold: int = 2

    def __post_init__(self) -> None:
        if self.name not in WRITE_POLICIES:
            raise ConfigError(f"unknown write policy {self.name!r}; expected one of {', '.join(WRITE_POLICIES)}")
        if self.threshold < 1:
            raise ConfigError(f"write policy threshold must be >= 1, got {self.threshold}")

    def should_write_on_hit(self, hits: int) -> bool:
        """Back up a device-only node now that it has ``hits`` hits?"""
        if self.name == "write_through":
            return hits >= 1
        if self.name == "write_through_selective":
            return hits >= self.threshold
        return False

    def should_write_on_evict(self) -> bool:
        """Back up a device-only node when it is evicted from the device?"""
        return self.name == "write_back"
