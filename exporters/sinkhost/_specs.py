"""The sinks a sink host can run, and the check of their specs (in the parent, before any process starts)."""

from __future__ import annotations

import json
from typing import Any

from hicache_obs.errors import ConfigError

__all__ = ["SINK_KINDS", "check_specs"]

#: The sinks a host can run, with the keys each one takes.
SINK_KINDS: dict[str, frozenset[str]] = {
    "audit": frozenset(),
    "prometheus": frozenset({"port", "addr", "pools"}),
    "structlog": frozenset({"file", "level"}),
    "otel": frozenset({"endpoint", "exporter", "service_name"}),
    "jsonl": frozenset({"dir", "max_bytes", "fsync", "rank"}),
}


def check_specs(sinks: Any) -> list[dict[str, Any]]:
    if not isinstance(sinks, (list, tuple)) or not sinks:
        raise ConfigError(f"a sink host needs a non-empty list of sink specs, got {sinks!r}")
    out = []
    seen: set[str] = set()
    for i, spec in enumerate(sinks):
        if not isinstance(spec, dict) or not isinstance(spec.get("sink"), str):
            raise ConfigError(f"sink spec {i} must be a dict with a 'sink' name, got {spec!r}")
        kind = spec["sink"]
        if kind not in SINK_KINDS:
            raise ConfigError(f"sink spec {i}: unknown sink {kind!r}; known: {', '.join(SINK_KINDS)}")
        if kind in seen:
            raise ConfigError(f"sink spec {i}: a host runs one {kind!r} sink, given twice")
        seen.add(kind)
        extra = set(spec) - {"sink"} - SINK_KINDS[kind]
        if extra:
            raise ConfigError(
                f"sink spec {i} ({kind}): unknown keys {sorted(extra)}; it takes {sorted(SINK_KINDS[kind])}"
            )
        if kind == "jsonl" and not isinstance(spec.get("dir"), str):
            raise ConfigError(f"sink spec {i} (jsonl): 'dir' must be a path string, got {spec.get('dir')!r}")
        if kind == "otel" and spec.get("exporter", "otlp") not in ("otlp", "memory"):
            raise ConfigError(f"sink spec {i} (otel): exporter must be 'otlp' or 'memory', got {spec['exporter']!r}")
        try:
            json.dumps(spec)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"sink spec {i} ({kind}) is not JSON-able: {exc}") from None
        out.append(dict(spec))
    return out
