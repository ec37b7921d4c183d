"""SGLang adapter tests: they run on SGLang's real packages (``make sglang`` installs them).

Where SGLang is not importable these tests are skipped with the reason;
``HICACHE_REQUIRE_SGLANG=1`` (set by ``make test`` for each release's run) makes a
missing SGLang a failure (``test_sglang_installed_where_required``).

A test that builds a hybrid harness in a host layout the installed release's Mamba host pool
refuses (``LayoutRefused``: 0.5.14 to 0.5.17 take ``page_first_direct`` only) is skipped with
SGLang's reason: that release does not run that configuration.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sglang_env import RELEASE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if RELEASE is not None:
        return
    marker = pytest.mark.skip(reason="SGLang is not installed in this environment (make sglang; make test runs each release)")
    for item in items:
        if "needs_sglang" in item.keywords:
            item.add_marker(marker)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    except Exception as exc:
        if type(exc).__name__ == "LayoutRefused":
            pytest.skip(str(exc).splitlines()[0])
        raise
