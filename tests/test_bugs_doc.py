"""``docs/bugs.md`` is the bug table rendered from the results the SGLang tests measured and
committed (``tests/integrations/sglang/bug_table.py``): it cannot drift from them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _bug_table():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bug_table", HERE / "integrations" / "sglang" / "bug_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bug_table", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_docs_bugs_md_is_the_rendered_table() -> None:
    table = _bug_table()
    assert table.DOC.read_text() == table.render(), "regenerate: python tests/integrations/sglang/bug_table.py --write"


def test_every_row_was_measured_on_both_of_its_releases() -> None:
    table = _bug_table()
    for row in table.ROWS:
        bug = [c for c in table.load(row.bug) if c.row == row.number]
        fixed = [c for c in table.load(row.fixed) if c.row == row.number]
        assert bug and fixed, row
        assert all(c.findings for c in bug), row  # the bug is seen with every backend
        assert all(c.findings == {} for c in fixed), row  # and nothing on the fix
        backends = {c.io_backend for c in bug}
        assert backends == {"direct", "kernel"} and {c.io_backend for c in fixed} == backends, row
