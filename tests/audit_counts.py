"""Audit findings counted as the demo's summary counts them (``violations``): ``{rule: {pool: n}}``,
computed here from the findings themselves, so a test can hold the summary against them."""

from __future__ import annotations

from typing import Any


def violation_counts(findings: list[Any]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for f in findings:
        out.setdefault(f.rule, {})
        out[f.rule][f.pool] = out[f.rule].get(f.pool, 0) + 1
    return out
