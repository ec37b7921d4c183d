"""Which SGLang release this test run has, and whether CI requires one."""

from __future__ import annotations

import os

from hicache_obs.integrations.sglang.testing import sglang_version

RELEASE = sglang_version()
REQUIRED = os.environ.get("HICACHE_REQUIRE_SGLANG") == "1"


def release_tuple() -> tuple[int, ...]:
    return tuple(int(x) for x in (RELEASE or "0").split(".")[:3] if x.isdigit())
