"""The bench harness computes its ratios correctly from given timings (no timed asserts)."""

from __future__ import annotations

import pytest

from hicache_obs.lab.bench import Ratio, check_targets, interleave, ratio_of_rates, ratio_of_times, turn_orders


def test_ratio_of_times_is_the_median_of_per_round_ratios() -> None:
    r = ratio_of_times([1.1, 2.0, 3.3], [1.0, 2.0, 3.0])
    assert r == Ratio(median=pytest.approx(1.1), lo=pytest.approx(1.0), hi=pytest.approx(1.1), n=3)


def test_ratio_pairs_rounds_not_medians() -> None:
    # the medians alone would say 1.0; round by round ours is always twice as slow
    ours = [2.0, 4.0, 100.0]
    ref = [1.0, 2.0, 50.0]
    r = ratio_of_times(ours, ref)
    assert r.median == pytest.approx(2.0)
    assert (r.lo, r.hi) == (pytest.approx(2.0), pytest.approx(2.0))


def test_rates_ratio_and_mismatched_rounds() -> None:
    assert ratio_of_rates([300.0, 600.0], [1000.0, 1000.0]).median == pytest.approx(0.45)
    with pytest.raises(ValueError, match="rounds differ: 2 vs 1"):
        ratio_of_times([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="no rounds"):
        ratio_of_times([], [])


def test_interleave_rotates_the_order_and_collects_every_round() -> None:
    calls: list[str] = []

    def fn(name: str, value: float):
        def run() -> float:
            calls.append(name)
            return value

        return run

    got = interleave({"a": fn("a", 1.0), "b": fn("b", 2.0), "c": fn("c", 3.0)}, rounds=3)
    assert got == {"a": [1.0] * 3, "b": [2.0] * 3, "c": [3.0] * 3}
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_turn_orders_balance_place_and_succession_over_every_four_turns() -> None:
    kinds = ("bare", "metrics", "audit", "sampling")
    orders = turn_orders(kinds, 9, start=2)
    assert len(orders) == 9 and all(sorted(o) == sorted(kinds) for o in orders)
    for first in range(len(orders) - 3):  # any four turns in a row
        window = orders[first : first + 4]
        for place in range(4):
            assert sorted(o[place] for o in window) == sorted(kinds), (first, place)
        after = [(o[i], o[i + 1]) for o in window for i in range(3)]
        assert len(set(after)) == 12, (first, after)  # each kind right after each other kind once
    assert orders[:2] == turn_orders(kinds, 6, start=2)[:2] and orders[2] == turn_orders(kinds, 1, start=4)[0]
    assert turn_orders(kinds, 1, start=5) == turn_orders(kinds, 1, start=1)  # the row is start mod 4
    with pytest.raises(ValueError, match=r"takes 4 kinds, got 3: \('a', 'b', 'c'\)"):
        turn_orders(("a", "b", "c"), 2)


def test_check_targets_reads_dotted_keys_and_compares() -> None:
    result = {
        "overhead": {"events_metrics_ratio": 1.04, "with_otel_ratio": 1.2},
        "events": {"append_per_s": 2_000_000, "append_vs_floor": 0.2},
        "data_path": {"page_first": {"ps16": {"write_vs_memcpy": 0.71}}},
    }
    rows = {r["key"]: r for r in check_targets(result)}
    assert rows["overhead.events_metrics_ratio"]["met"] is True
    assert rows["overhead.with_otel_ratio"]["met"] is False
    assert rows["events.append_per_s"]["met"] is True
    assert rows["events.append_vs_floor"]["met"] is False
    assert rows["data_path.page_first.ps16.write_vs_memcpy"]["met"] is True
    assert rows["events.durable_per_s"]["met"] is None  # not measured
    assert rows["overhead.events_metrics_ratio"]["target"] == "<= 1.05"
    # within 0.01 either way: a sampling run far cheaper than metrics is not a target met
    for diff, met in ((0.009, True), (-0.009, True), (0.011, False), (-0.02, False)):
        row = {r["key"]: r for r in check_targets({"sglang": {"profiles": {"sampling_minus_metrics": diff}}})}
        assert row["sglang.profiles.sampling_minus_metrics"]["met"] is met, diff
        assert row["sglang.profiles.sampling_minus_metrics"]["target"] == "within 0.01"
