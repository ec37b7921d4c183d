"""The bug table (``bug_table.py``): each row measured again on this release, against the results
committed for it; the bug's release shows the row's rule, the fixing release no finding."""

from __future__ import annotations

import os

import pytest
from bug_table import ROWS, dump, load, measure, results_path, rows_for
from sglang_env import RELEASE

pytestmark = pytest.mark.needs_sglang


def test_this_release_measures_what_the_table_says() -> None:
    assert RELEASE is not None
    rows = rows_for(RELEASE)
    if not rows:
        pytest.skip(f"SGLang {RELEASE} is neither the buggy nor the fixing release of a row")
    cases = measure(RELEASE)
    if os.environ.get("HICACHE_REGENERATE_GOLDENS") == "1":
        dump(RELEASE, cases)
    assert results_path(RELEASE).is_file(), f"no results for {RELEASE}: HICACHE_REGENERATE_GOLDENS=1 writes them"
    assert cases == load(RELEASE)
    for row in rows:
        mine = [c for c in cases if c.row == row.number]
        assert mine, f"row {row.number}: nothing ran on {RELEASE}"
        for c in mine:
            if RELEASE == row.bug:
                assert row.rule in c.findings or (row.number == 1 and "index_not_on_device" in c.findings), c
            else:
                assert c.findings == {}, c
    assert {r.number for r in ROWS} >= {r.number for r in rows}
