"""The bench command's wiring (the measurements themselves are not timed in tests)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from hicache_obs.cli import main


def test_help_lists_the_sections_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "--json" in out and "data_path" in out
    assert "hicache-obs bench --quick" in out


def test_negative_threads_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--threads", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--threads must be >= 0, got -1" in err


@pytest.mark.parametrize("value", ["0", "-3"])
def test_profile_rounds_below_one_is_one_clear_error(capsys: pytest.CaptureFixture[str], value: str) -> None:
    assert main(["bench", "--profile-rounds", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--profile-rounds must be >= 1, got {value}" in err


@pytest.mark.parametrize(("argv", "rounds"), [([], 7), (["--quick"], 2), (["--profile-rounds", "45"], 45)])
def test_profile_rounds_reach_the_sglang_section(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], rounds: int
) -> None:
    import hicache_obs.lab.bench as bench

    seen: list[int | None] = []

    def sglang(**kw: object) -> dict[str, object]:
        seen.append(kw["profile_rounds"])  # type: ignore[arg-type]
        return {"available": False, "reason": "not here"}

    monkeypatch.setattr(bench, "bench_sglang", sglang)
    assert main(["bench", "--section", "sglang", "--json", *argv]) == 0
    assert seen == [rounds]
    assert '"reason": "not here"' in capsys.readouterr().out


def test_unknown_section_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--section", "gpu"]) == 2
    assert "invalid choice: 'gpu'" in capsys.readouterr().err


def test_data_path_section_reports_every_ratio_and_the_kernel_ceiling() -> None:
    from hicache_obs.lab.bench import bench_data_path

    out = bench_data_path(tokens=64, rounds=1, page_sizes=(1, 16))
    for layout in ("layer_first", "page_first"):
        for ps in ("ps1", "ps16"):
            row = out[layout][ps]
            assert row["bytes"] == 64 * 8 * 2 * 8 * 128 * 2  # 64 kept slots x layers x k/v x heads x dim x fp16
            for key in ("write_vs_memcpy", "load_vs_memcpy", "kernel_write_vs_memcpy"):
                assert 0 < row[key] < 100, (layout, ps, key, row[key])
            assert row["write_vs_memcpy_spread"][0] <= row["write_vs_memcpy"] <= row["write_vs_memcpy_spread"][1]


def test_events_section_reports_both_replays_against_the_floor(capsys: pytest.CaptureFixture[str]) -> None:
    from hicache_obs.lab.bench import bench_events
    from hicache_obs.lab.cli.bench import _table

    out = bench_events(n=3000, rounds=1)
    for key in ("append", "durable", "replay", "replay_retained"):
        vs = out[f"{key}_vs_floor"]
        assert 0 < vs < 100 and out[f"{key}_vs_floor_spread"] == [vs, vs], key
    assert out["replay_audit_per_s"] > 0 and out["replay_audit_retained_per_s"] > 0
    assert out["replay_retained_vs_floor"] == pytest.approx(out["replay_audit_retained_per_s"] / out["replay_floor_per_s"])
    _table({"machine": {"cores": 2, "torch": "t", "python": "p"}, "targets": [], "events": out})
    assert "replay + audit keeping every event in memory" in capsys.readouterr().out


def test_overhead_section_measures_every_profile_of_our_controller(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from hicache_obs.lab.bench import bench_overhead
    from hicache_obs.lab.cli.bench import _overhead_profiles_line

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the section's scratch folder goes
    out = bench_overhead(steps=20, rounds=1, runtimes=("sim",))
    assert set(out["profiles"]) == {"audit", "metrics", "sampling"}
    for name, got in out["profiles"].items():
        for cfg in ("events_metrics", "with_otel", "with_durable_log"):
            lo, hi = got[f"{cfg}_ratio_spread"]
            assert 0 < lo <= got[f"{cfg}_ratio"] <= hi < 100, (name, cfg)
    audit = out["profiles"]["audit"]  # the section's own figures are the audit profile's
    assert audit["events_metrics_ratio"] == out["events_metrics_ratio"]
    assert audit["per_op_overhead_us"] == out["per_op_overhead_us"]
    assert set(out["by_runtime"]["sim"]) >= {"events_metrics@metrics_ratio", "with_durable_log@sampling_ratio"}
    line = _overhead_profiles_line(out["profiles"])
    assert line.startswith("overhead (a) / (b) / (c) by profile: audit ")
    assert "; metrics " in line and "; sampling " in line and line.count(" us an op") == 3
    with pytest.raises(ValueError, match="profile 'audit' is not one of metrics, sampling"):
        bench_overhead(steps=1, rounds=1, runtimes=("sim",), profiles=("audit",))
    assert list(tmp_path.iterdir()) == []  # removed after a measure and after a refusal


def test_a_difference_of_ratios_is_taken_round_by_round() -> None:
    from hicache_obs.lab.bench import difference_by_round

    # 0.01 apart in two rounds, 0.1 in the third; the rounds' own noise (1.0 to 1.5) moves
    # both: paired it cancels, where the difference of the two medians would read 0.1
    got = difference_by_round([1.01, 1.51, 1.2], [1.0, 1.5, 1.1])
    assert (got.median, got.lo, got.hi, got.n) == pytest.approx((0.01, 0.01, 0.1, 3))
    with pytest.raises(ValueError, match="rounds differ: 2 vs 3"):
        difference_by_round([1.0, 1.0], [1.0, 1.0, 1.0])
