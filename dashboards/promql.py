"""PromQL builders for the panel queries: every selector filters on the dashboard's ``job`` and ``instance``."""

from __future__ import annotations

__all__ = ["FILTER", "sel", "rate", "sum_by", "ratio", "quantile"]

#: The label filter of every panel query: the dashboard's ``job`` and ``instance`` variables.
FILTER = 'job=~"$job",instance=~"$instance"'


def sel(metric: str, extra: str = "") -> str:
    """``metric{job=~"$job",instance=~"$instance"[,extra]}``."""
    return f"{metric}{{{FILTER}{',' + extra if extra else ''}}}"


def rate(metric: str, extra: str = "", fn: str = "rate") -> str:
    """``rate(metric{filter}[$__rate_interval])`` (or ``increase``)."""
    return f"{fn}({sel(metric, extra)}[$__rate_interval])"


def sum_by(labels: str, inner: str) -> str:
    return f"sum by ({labels}) ({inner})"


def ratio(num: str, den: str, matching: str = "") -> str:
    """``num / den`` with the denominator kept off zero (a ratio of nothing reads 0, not NaN).

    ``matching``: vector matching for the division, e.g. ``on (direction) group_left``.
    """
    op = f"/ {matching}" if matching else "/"
    return f"{num}\n{op}\nclamp_min({den}, 1e-9)"


def quantile(q: float, histogram: str, by: str = "direction") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({rate(histogram + '_bucket')}))"
