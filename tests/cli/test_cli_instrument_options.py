"""``hicache-obs instrument --metrics-host``: where each rank's /metrics binds.

The option reaches the instrumented processes as ``HICACHE_OBS_METRICS_HOST``; the launcher
binds the address as given (every interface for ``0.0.0.0`` or ``::``). A value that is not
an IP address is refused at the command line, and in a process that got it anyway the rank
says so in one line and runs on without its server. The binds here are intercepted: tests
open sockets on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from hicache_obs.cli._instrument import child_environment
from hicache_obs.integrations.sglang import _launcher as launcher


def _args(**kw: Any) -> argparse.Namespace:
    base = {"metrics_port": 9400, "metrics_host": "127.0.0.1", "out": "o", "otlp_endpoint": None}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1"])
def test_the_host_reaches_the_command(host: str) -> None:
    env = child_environment(_args(metrics_host=host), env={})
    assert env["HICACHE_OBS_METRICS_HOST"] == host and env["HICACHE_OBS_METRICS_PORT"] == "9400"


@pytest.mark.parametrize("value", ["nope", "example.com", "127.0.0.1:9400", ""])
def test_a_host_that_is_not_an_ip_address_is_refused(cli: Any, value: str) -> None:
    code, out, err = cli("instrument", "--metrics-host", value, "--", "true")
    assert (code, out) == (2, "")
    assert f"argument --metrics-host: metrics host {value!r} is not an IP address" in err
    assert "Traceback" not in err


def test_metrics_address_brackets_ipv6() -> None:
    assert launcher.metrics_address("0.0.0.0", 9400) == "0.0.0.0:9400"
    assert launcher.metrics_address("::", 9401) == "[::]:9401"
    with pytest.raises(ValueError, match="'localhost' is not an IP address"):
        launcher.metrics_address("localhost", 9400)


class _Rank:
    """What ``_Pipeline._start_metrics`` reads and writes of a pipeline."""

    rank = 1

    def __init__(self) -> None:
        from hicache_obs.events._log import EventLog

        self.log = EventLog()
        self.metrics_url = None
        self._server = None


@pytest.fixture
def binds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    from hicache_obs.exporters import _metrics_server as metrics_server

    seen: list[tuple[str, int]] = []

    def start(registry: Any, *, port: int, addr: str) -> tuple[object, int]:
        seen.append((addr, port))
        return object(), port

    monkeypatch.setattr(metrics_server, "start_metrics_server", start)
    monkeypatch.setattr(launcher, "_served_ports", set())
    monkeypatch.setenv("HICACHE_OBS_METRICS_PORT", "9400")
    return seen


@pytest.mark.parametrize(
    ("host", "url"), [("0.0.0.0", "http://0.0.0.0:9401/metrics"), ("::", "http://[::]:9401/metrics")]
)
def test_the_launcher_binds_the_host_given(
    binds: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch, host: str, url: str
) -> None:
    monkeypatch.setenv("HICACHE_OBS_METRICS_HOST", host)
    rank = _Rank()
    launcher._Pipeline._start_metrics(rank)  # type: ignore[arg-type]
    assert binds == [(host, 9401)] and rank.metrics_url == url


def test_the_launcher_binds_loopback_by_default(binds: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HICACHE_OBS_METRICS_HOST", raising=False)
    rank = _Rank()
    launcher._Pipeline._start_metrics(rank)  # type: ignore[arg-type]
    assert binds == [("127.0.0.1", 9401)] and rank.metrics_url == "http://127.0.0.1:9401/metrics"


def test_a_bad_host_in_a_rank_is_one_line_and_no_server(
    binds: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HICACHE_OBS_METRICS_HOST", "nope")
    rank = _Rank()
    launcher._Pipeline._start_metrics(rank)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert (
        err
        == "hicache-obs: rank 1: cannot serve /metrics: metrics host 'nope' is not an IP address (127.0.0.1, 0.0.0.0, ::1, ...)\n"
    )
    assert binds == [] and rank.metrics_url is None
