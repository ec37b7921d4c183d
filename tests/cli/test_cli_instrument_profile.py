"""``hicache-obs instrument --profile/--audit-sample`` and ``HICACHE_OBS_PROFILE``: the profile
each rank runs, checked before the command starts."""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import pytest

from hicache_obs._profiles import Profile, Sampler, profile_from_env, resolve_profile
from hicache_obs.cli._instrument import child_environment
from hicache_obs.errors import ConfigError


def _args(**kw: Any) -> argparse.Namespace:
    base = {"metrics_port": 9400, "metrics_host": "127.0.0.1", "out": "o", "otlp_endpoint": None}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("options", "env", "profile", "share"),
    [
        ({}, {}, "metrics", ""),  # the launcher's default
        ({"profile": "audit"}, {}, "audit", ""),
        ({"profile": "sampling"}, {}, "sampling", "0.01"),
        ({"audit_sample": 0.05}, {}, "sampling", "0.05"),  # metrics with a share
        ({"profile": "sampling", "audit_sample": 0.5}, {}, "sampling", "0.5"),
        ({}, {"HICACHE_OBS_PROFILE": "audit"}, "audit", ""),  # the environment, where no option says
        ({}, {"HICACHE_OBS_PROFILE": "sampling", "HICACHE_OBS_AUDIT_SAMPLE": "0.2"}, "sampling", "0.2"),
        ({"profile": "metrics"}, {"HICACHE_OBS_PROFILE": "audit"}, "metrics", ""),  # the option wins
    ],
)
def test_the_profile_reaches_the_command(options: dict[str, Any], env: dict[str, str], profile: str, share: str) -> None:
    out = child_environment(_args(**{"profile": None, "audit_sample": None, **options}), env=dict(env))
    assert out["HICACHE_OBS_PROFILE"] == profile and out["HICACHE_OBS_AUDIT_SAMPLE"] == share
    assert profile_from_env(out) == resolve_profile(profile, float(share) if share else None, default="metrics")


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--profile", "full"], "argument --profile: invalid choice: 'full'"),
        (["--audit-sample", "1.5"], "argument --audit-sample: '1.5' is not a number from 0 to 1"),
        (["--audit-sample", "x"], "argument --audit-sample: 'x' is not a number from 0 to 1"),
        (["--profile", "audit", "--audit-sample", "0.1"], "audit_sample 0.1: the audit profile audits every operation"),
        (["--profile", "sampling", "--audit-sample", "0"], "audit_sample 0: the sampling profile needs a share above 0"),
    ],
)
def test_a_bad_profile_or_share_is_refused_before_the_command_runs(cli: Any, argv: list[str], text: str) -> None:
    code, out, err = cli("instrument", *argv, "--", "true")
    assert (code, out) == (2, "")
    assert text in err and "Traceback" not in err


def test_a_bad_environment_is_refused_naming_the_variables(cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_OBS_PROFILE", "fast")
    code, _, err = cli("instrument", "--", "true")
    assert code == 2 and "HICACHE_OBS_PROFILE=fast" in err and "got 'fast'" in err
    with pytest.raises(ConfigError, match=r"HICACHE_OBS_AUDIT_SAMPLE=-1: .*audit_sample must be|HICACHE_OBS_AUDIT_SAMPLE must"):
        profile_from_env({"HICACHE_OBS_PROFILE": "sampling", "HICACHE_OBS_AUDIT_SAMPLE": "-1"})


def test_resolve_profile() -> None:
    assert resolve_profile() == Profile("audit", 1.0) and resolve_profile().full
    assert resolve_profile(default="metrics") == Profile("metrics", 0.0)
    assert resolve_profile("metrics", 0.0) == Profile("metrics", 0.0)
    assert resolve_profile("metrics", 0.25) == Profile("sampling", 0.25)
    assert resolve_profile("sampling") == Profile("sampling", 0.01)
    assert resolve_profile("audit", 1.0) == Profile("audit", 1.0)
    p = Profile("sampling", 0.5)
    assert resolve_profile(p) is p
    for bad, text in (
        ({"profile": "Audit"}, "profile must be one of metrics, audit, sampling; got 'Audit'"),
        ({"profile": "sampling", "audit_sample": float("nan")}, "audit_sample must be a number from 0 to 1, got nan"),
        ({"profile": "sampling", "audit_sample": "0.1"}, None),  # a numeric string is a number
        ({"profile": p, "audit_sample": 0.1}, "give it with a profile name"),
    ):
        if text is None:
            assert resolve_profile(**bad) == Profile("sampling", 0.1)
            continue
        with pytest.raises(ConfigError, match=text.replace("(", r"\(")):
            resolve_profile(**bad)


@pytest.mark.parametrize("share", [0.01, 0.25, 1 / 3, 0.5, 1.0])
def test_the_sampler_takes_its_share_evenly_from_the_first(share: float) -> None:
    s = Sampler(share)
    taken = [i for i in range(1000) if s.take()]
    assert taken[0] == 0 and s.seen == 1000 and s.taken == len(taken)
    assert abs(len(taken) - 1000 * share) <= 1
    gaps = {b - a for a, b in itertools.pairwise(taken)}
    assert max(gaps) - min(gaps) <= 1  # evenly spread


def test_a_sampler_at_zero_takes_nothing() -> None:
    s = Sampler(0.0)
    assert not any(s.take() for _ in range(100)) and (s.taken, s.seen) == (0, 100)
