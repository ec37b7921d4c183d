"""The launcher's import hook wraps a controller class's ``__init__`` once, however often it runs
(no SGLang needed: a stand-in module under the target's name)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from hicache_obs.integrations.sglang import _launcher as launcher

TARGET = "sglang.srt.managers.cache_controller"


def test_the_hook_wraps_init_once_and_instruments_each_controller_once(monkeypatch: pytest.MonkeyPatch) -> None:
    def __init__(self: Any, size: int) -> None:
        self.size = size

    cls = type("HiCacheController", (), {"__init__": __init__})
    module = types.ModuleType(TARGET)
    module.HiCacheController = cls  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, TARGET, module)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the hook's finder goes with the test
    # only the stand-in: the real controller classes of an SGLang imported here stay unpatched
    monkeypatch.setattr(launcher, "TARGETS", {TARGET: launcher.TARGETS[TARGET]})
    seen: list[Any] = []
    monkeypatch.setattr(launcher, "instrument_new_controller", seen.append)

    launcher.install_import_hook()
    wrapped = cls.__dict__["__init__"]
    assert wrapped is not __init__ and wrapped.__wrapped__ is __init__
    launcher.install_import_hook()  # again: the wrapper is recognised, not wrapped a second time
    assert cls.__dict__["__init__"] is wrapped

    c = cls(7)
    assert c.size == 7 and seen == [c], "instrumented once, when its __init__ returned"
