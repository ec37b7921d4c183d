"""The generator's parts: panel tables laid out by row, the checks on a table, the YAML writer."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from dashboard_checks import load_generator

load_generator()  # puts dashboards/ on sys.path, where its modules import each other by name
panels = importlib.import_module("panels")
render = importlib.import_module("render")
alerts = importlib.import_module("alerts")
yaml_out = importlib.import_module("yaml_out")

Panel, Board = panels.Panel, panels.Board


def _ts(title: str, width: int) -> Any:
    return Panel("timeseries", title, "short", "d", (("up", ""),), width)


def _stat(title: str, width: int) -> Any:
    return Panel("stat", title, "short", "d", (("up", ""),), width)


def test_grid_follows_the_row_order() -> None:
    board = Board(
        "b.json", "b", "B", "d", ((_stat("s1", 6), _stat("s2", 6)), (_ts("t1", 12), _stat("s3", 4)), (_ts("t2", 24),))
    )
    grid = [(p["id"], p["title"], p["gridPos"]) for p in render.layout(board)]
    assert grid == [
        (1, "s1", {"h": 5, "w": 6, "x": 0, "y": 0}),
        (2, "s2", {"h": 5, "w": 6, "x": 6, "y": 0}),
        (3, "t1", {"h": 8, "w": 12, "x": 0, "y": 5}),  # the next row starts under the tallest of the last
        (4, "s3", {"h": 5, "w": 4, "x": 12, "y": 5}),
        (5, "t2", {"h": 8, "w": 24, "x": 0, "y": 13}),
    ]


def test_committed_boards_are_their_tables_rows() -> None:
    for board in panels.BOARDS:
        built = render.dashboard(board)
        assert [p["title"] for p in built["panels"]] == [p.title for row in board.rows for p in row]
        starts = [p["gridPos"]["y"] for p in built["panels"] if p["gridPos"]["x"] == 0]
        assert len(starts) == len(board.rows) and starts == sorted(set(starts))


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (((_ts("a", 12), _ts("b", 13)),), r"b\.json: row 0 must hold panels 1 to 24 columns wide in all, got widths \[12, 13\]"),
        (((_ts("a", 24),), ()), r"b\.json: row 1 .* got widths \[\]"),
        (((_ts("a", 0),),), r"row 0 .* got widths \[0\]"),
        (((Panel("gauge", "g", "short", "d", (("up", ""),), 6),),), r"panel 'g': kind must be one of \['stat', 'timeseries'\], got 'gauge'"),
        (((Panel("stat", "two", "short", "d", (("up", ""), ("down", "")), 6),),), r"stat panel 'two' needs exactly one query, got 2"),
    ],
)  # fmt: skip
def test_a_table_that_cannot_be_laid_out_is_refused(rows: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        render.layout(Board("b.json", "b", "B", "d", rows))


def test_alert_table_names_are_unique_and_rules_keep_their_keys() -> None:
    names = [a.name for a in alerts.ALERTS]
    assert len(names) == len(set(names))
    rule = alerts.ALERTS[0].rule()
    assert list(rule) == ["alert", "expr", "for", "labels", "annotations"]
    assert list(rule["annotations"]) == ["summary", "description"]


def test_yaml_writer_scalars_and_nesting() -> None:
    doc = {
        "plain": "HiCacheAuditViolation",
        "duration": "5m",
        "word": "on",  # YAML 1.1 would read a bare on as true
        "quoted": "a: b",
        "block": "x > 0\nand y\n\nz",
        "empty": {},
        "list": [{"k": 1, "n": None}, "v"],
    }
    assert "\n".join(yaml_out.lines(doc)).split("\n") == [
        "plain: HiCacheAuditViolation",
        "duration: 5m",
        'word: "on"',
        'quoted: "a: b"',
        "block: |-",
        "  x > 0",
        "  and y",
        "",
        "  z",
        "empty: {}",
        "list:",
        "  - k: 1",
        "    n: null",
        "  - v",
    ]


def test_out_is_created_and_a_file_in_its_place_is_refused(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    generate = load_generator()
    out = tmp_path / "new" / "boards"
    assert generate.main(["--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(generate.render_files())
    assert generate.main(["--check", "--out", str(out)]) == 0
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert generate.main(["--out", str(blocker)]) == 2
    assert f"--out {blocker} is not a folder" in capsys.readouterr().err
