"""Which SGLang release this test run has, and whether CI requires one."""

from __future__ import annotations

import importlib.util
import os
import types

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


def fresh_module(name: str) -> types.ModuleType:
    """A new copy of SGLang's module ``name``, executed from its file, not in ``sys.modules``
    (and past any import hook, so nothing has patched it)."""
    from hicache_obs.integrations.sglang.testing import prepare

    prepare("cpu")  # SGLang's packages import here as in the other CPU tests
    found = importlib.util.find_spec(name)
    assert found is not None and found.origin is not None, name
    spec = importlib.util.spec_from_file_location(name, found.origin)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
