"""The bench command's wiring (the measurements themselves are not timed in tests)."""

from __future__ import annotations

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


def test_unknown_section_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--section", "gpu"]) == 2
    assert "invalid choice: 'gpu'" in capsys.readouterr().err
