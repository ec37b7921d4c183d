"""Golden outputs of the exporters for the committed v1 log (``tests/data/logs/v1/``).

The log is a ``hicache-obs demo --steps 40 --fault unrecorded-pool-indices`` run, so it
holds transfers of two pools, merged loads and audit violations. Each exporter's output
for it is compared byte for byte with the file under ``tests/data/logs/golden/v1/``:
``hicache-obs export --chrome-trace`` and ``--otlp-json``, the lines of a
:class:`StructlogSink` fed the events and the Prometheus text of a :class:`PrometheusSink`
fed the events (audited: :func:`~hicache_obs.events._audit.audited`). Every timestamp in them comes from the log (no wall clock), and the span
ids are derived from the log, so the outputs are the same on every run and machine.

A change to any exporter that alters a JSON key, a span attribute, a metric family or a
value shows here. When the change is meant, regenerate the goldens and review the diff::

    HICACHE_REGENERATE_GOLDENS=1 python -m pytest -q tests/exporters/test_golden.py tests/events/test_log_versions.py
    git diff tests/data/logs/golden/

(with the variable set, each test writes its golden file and is reported as skipped).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from goldens import FIXTURE, REPO, check_golden
from prometheus_client import generate_latest

from hicache_obs.cli import main
from hicache_obs.events._audit import audited
from hicache_obs.events._replay import read_segments
from hicache_obs.events._schema import Event
from hicache_obs.exporters._prometheus import PrometheusSink
from hicache_obs.exporters._structlog_sink import StructlogSink


@pytest.fixture(scope="module")
def events() -> list[Event]:
    """The fixture's events as a live sink gets them: audited, each verdict before the
    event that revealed it (a version 1 log holds them after it)."""
    return list(audited(read_segments([REPO / FIXTURE]).events))


def _export(option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> bytes:
    monkeypatch.chdir(REPO)
    out = tmp_path / "out.json"
    code = main(["export", FIXTURE, option, str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    return out.read_bytes()


def test_chrome_trace_golden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    check_golden("chrome_trace.json", _export("--chrome-trace", tmp_path, monkeypatch, capsys))


def test_otlp_json_golden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    check_golden("otlp.json", _export("--otlp-json", tmp_path, monkeypatch, capsys))


def _feed(sink: StructlogSink | PrometheusSink, events: list[Event], batch: int) -> None:
    for i in range(0, len(events), batch):
        sink.handle_batch(events[i : i + batch])
    sink.close()


def _structlog_lines(events: list[Event], batch: int) -> bytes:
    buf = io.StringIO()
    _feed(StructlogSink(file=buf), events, batch)
    return buf.getvalue().encode()


def _prometheus_text(events: list[Event], batch: int) -> bytes:
    sink = PrometheusSink()
    _feed(sink, events, batch)
    return generate_latest(sink.registry)


def test_structlog_lines_golden(events: list[Event]) -> None:
    got = _structlog_lines(events, len(events))
    assert got.count(b"\n") > 100  # one line per finished op and per violation
    # how the events are batched does not change a line
    assert _structlog_lines(events, 1) == got
    assert _structlog_lines(events, 64) == got
    check_golden("structlog.jsonl", got)


def test_prometheus_text_golden(events: list[Event]) -> None:
    got = _prometheus_text(events, len(events))
    assert _prometheus_text(events, 1) == got
    assert _prometheus_text(events, 64) == got
    check_golden("prometheus.txt", got)
