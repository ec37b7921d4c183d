"""The text summary of ``demo --engine sglang`` (the run itself is in
tests/integrations/sglang/test_real_server.py, which needs SGLang's server)."""

from __future__ import annotations

import pytest

from hicache_obs.lab.cli.demo import _print_server_summary


def _summary(**changes: object) -> dict[str, object]:
    s: dict[str, object] = {
        "sglang_release": "0.5.23", "served_model": "lfm2", "model": "tiny_hybrid", "requests": 40,
        "io_backend": "kernel", "layout": "page_first", "write_policy": "write_through",
        "operations": {"d2h": 31, "h2d": 6}, "failed_operations": {"d2h": 0, "h2d": 0},
        "host_hit_tokens": 1230, "device_hit_tokens": 4100, "prompt_tokens": 9000,
        "data_intact": True, "mismatched_requests": 0, "checked_requests": 6, "violations": {},
        "events": 812, "out": "out/[x]", "ranks": [0], "files": {"trace": "out/trace.json"},
        "profile": "metrics", "audit_sample": 0.0,
    }  # fmt: skip
    s.update(changes)
    return s


def test_a_clean_run_reads_as_one(capsys: pytest.CaptureFixture[str]) -> None:
    _print_server_summary(_summary())
    text = capsys.readouterr().out
    assert "SGLang 0.5.23's server, lfm2 (tiny_hybrid), 40 requests, kernel / page_first / write_through" in text
    assert "31 writes (d2h), 6 loads (h2d)" in text
    assert "prompt tokens from host: 1230, from device: 4100, of 9000" in text
    assert "equal to a recompute: yes (6 checked)" in text
    assert "audit: no findings" in text
    assert "812 events in out/[x]/ (ranks [0], profile metrics)" in text  # a folder name is printed as written


def test_findings_and_differing_answers_are_said(capsys: pytest.CaptureFixture[str]) -> None:
    _print_server_summary(_summary(data_intact=False, mismatched_requests=2, violations={"double_free": {"mamba": 9}}))
    text = capsys.readouterr().out
    assert "equal to a recompute: no (2 differ) (6 checked)" in text
    assert "audit findings: {'double_free': {'mamba': 9}}" in text


def test_the_ranks_profile_is_said_with_its_share(capsys: pytest.CaptureFixture[str]) -> None:
    _print_server_summary(_summary(profile="sampling", audit_sample=0.05))
    assert "profile sampling (0.05 of the operations audited)" in capsys.readouterr().out
