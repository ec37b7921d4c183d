"""Which SGLang release this test run has, and whether CI requires one."""

from __future__ import annotations

import os

import pytest

from hicache_obs.integrations.sglang.testing import sglang_version

RELEASE = sglang_version()
REQUIRED = os.environ.get("HICACHE_REQUIRE_SGLANG") == "1"


def release_tuple() -> tuple[int, ...]:
    return tuple(int(x) for x in (RELEASE or "0").split(".")[:3] if x.isdigit())


#: The CPU server's stand-ins follow 0.5.23's modules, the release whose real server the tests run.
SERVER_RELEASE = pytest.mark.skipif(
    release_tuple() < (0, 5, 23), reason="the CPU server stand-ins are for SGLang 0.5.23's modules"
)
