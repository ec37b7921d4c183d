"""``SUPPORTED_RELEASES`` names exactly the SGLang releases the tests pin and CI runs."""

from __future__ import annotations

import re
from pathlib import Path

from hicache_obs.integrations.sglang import SUPPORTED_RELEASES

ROOT = Path(__file__).resolve().parents[2]


def test_supported_releases_are_the_pinned_and_tested_ones() -> None:
    pinned = sorted(
        p.name.removeprefix("sglang-").removesuffix(".txt")
        for p in (ROOT / "tests/integrations/sglang/requirements").glob("sglang-*.txt")
    )
    made = re.search(r"^SGLANG_RELEASES \?= (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert made is not None, "the Makefile no longer sets SGLANG_RELEASES"
    key = lambda r: tuple(int(x) for x in r.split("."))  # noqa: E731
    assert sorted(SUPPORTED_RELEASES, key=key) == sorted(pinned, key=key) == sorted(made.group(1).split(), key=key)
    for release in SUPPORTED_RELEASES:  # each pin file installs that very release
        text = (ROOT / f"tests/integrations/sglang/requirements/sglang-{release}.txt").read_text()
        assert re.search(rf"^sglang=={re.escape(release)}$", text, re.M), release
