"""What a scrape exposes, without the values: each series' metric name and label names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest


def series_shapes(registry: CollectorRegistry) -> set[tuple[str, tuple[str, ...]]]:
    """(metric name, sorted label names) of every sample line ``registry`` exposes."""
    out = set()
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("#") or not line:
            continue
        name, _, rest = line.partition("{")
        labels = tuple(sorted(p.split("=")[0] for p in rest.rstrip("}0123456789.e+- ").split(",") if "=" in p))
        out.add((name.split(" ")[0], labels))
    return out
