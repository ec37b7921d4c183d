"""Fixtures of the exporter tests (helpers live in ``exporters_kit``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hicache_obs.core import ModelSpec
from hicache_obs.events._audit import Auditor
from hicache_obs.testing import make_controller


@pytest.fixture
def controller() -> Iterator[Callable[..., Any]]:
    """``controller(spec_name, fault=None, audit=True, **kw)``: a sim controller, live-audited, closed after the test."""
    made: list[Any] = []

    def make(spec: str = "tiny_hybrid", fault: str | None = None, audit: bool = True, **kw: Any) -> Any:
        kw.setdefault("device_size", 512)
        c = make_controller(ModelSpec.preset(spec), fault=fault, runtime="sim", **kw)
        if audit:
            Auditor().attach(c.log)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
