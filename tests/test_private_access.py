"""Modules talk through public seams: the package reaches no ``_private`` member of another
object (ruff's SLF001), and no line of it is excused from the rule.

``pyproject.toml`` turns SLF001 on for everything but ``tests/`` (tests may inspect
internals), so ``make lint`` fails on a new access; this test holds the same line without
the project's ruff configuration (``--select SLF001`` on the package's paths) and also
refuses a ``# noqa: SLF...`` comment, which would hide an access from both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("hicache_obs", "exporters", "dashboards")
#: a per-line excuse from the rule, in any spelling ruff accepts (``noqa:SLF001``, ``NOQA: SLF``)
NOQA_SLF = re.compile(r"#\s*noqa\s*:[^#\n]*\bSLF", re.IGNORECASE)


def _ruff() -> str:
    beside = Path(sys.executable).parent / "ruff"  # the venv's own, as make lint runs it
    path = str(beside) if beside.exists() else shutil.which("ruff")
    if path is None:
        msg = f"ruff is not installed (neither beside {sys.executable} nor on PATH; make venv installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{msg} and CI=true")
        pytest.skip(msg)
    return path


def _ruff_slf001(ruff: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [ruff, "check", "--no-cache", "--isolated", "--select", "SLF001", *args, *TARGETS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode not in (0, 1):  # 1: violations found; anything else: ruff itself failed
        pytest.fail(f"ruff exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def test_the_package_reaches_no_private_member_of_another_object() -> None:
    ruff = _ruff()
    stats = json.loads(_ruff_slf001(ruff, "--statistics", "--output-format", "json").stdout or "[]")
    counts = {row["code"]: row["count"] for row in stats}
    assert set(counts) <= {"SLF001"}, f"ruff reported other codes under --select SLF001: {counts}"
    count = counts.get("SLF001", 0)
    if count:
        where = _ruff_slf001(ruff, "--output-format", "concise").stdout
        pytest.fail(
            f"{count} private-member accesses (SLF001) in {', '.join(TARGETS)}: reach another module "
            f"through a public method or attribute instead (the log's are listed in "
            f"hicache_obs/events/_log.py).\n{where}"
        )


def _noqa_slf_lines() -> list[str]:
    found = []
    for target in TARGETS:
        for path in sorted((ROOT / target).rglob("*.py")):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if NOQA_SLF.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return found


def test_no_line_of_the_package_is_excused_from_the_rule() -> None:
    found = _noqa_slf_lines()
    assert found == [], "a `# noqa: SLF` comment in the package (use a public seam instead):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    ["x = log._ring  # noqa: SLF001", "x = a._b  # NOQA:SLF001", "x = a._b  # noqa: E501, SLF001", "y = 1  # noqa:SLF"],
)
def test_the_excuse_is_recognised_in_every_spelling(line: str) -> None:
    assert NOQA_SLF.search(line)


def test_other_noqa_comments_are_not_mistaken_for_it() -> None:
    for line in ("x = 1  # noqa: E501", "x = 1  # noqa", "# SLF001 is on for the package"):
        assert not NOQA_SLF.search(line), line


def test_the_project_lints_the_package_for_it_and_excuses_only_the_tests() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    select = re.search(r"^\[tool\.ruff\.lint\]\n(?:.*\n)*?select = \[([^\]]*)\]", text, re.MULTILINE)
    assert select is not None, "pyproject.toml has no [tool.ruff.lint] select list"
    assert '"SLF"' in select.group(1) or '"SLF001"' in select.group(1), select.group(0)
    ignores = re.search(r"^\[tool\.ruff\.lint\.per-file-ignores\]\n((?:[^\[\n].*\n)*)", text, re.MULTILINE)
    excused = [] if ignores is None else [ln for ln in ignores.group(1).splitlines() if "SLF" in ln]
    assert [ln.split("=")[0].strip() for ln in excused] == ['"tests/**"'], excused
