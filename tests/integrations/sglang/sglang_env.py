"""Which SGLang release this test run has, and whether CI requires one."""

from __future__ import annotations

import importlib.util
import os
import types

import pytest

from hicache_obs.lab.sglang.harness import sglang_version

RELEASE = sglang_version()
REQUIRED = os.environ.get("HICACHE_REQUIRE_SGLANG") == "1"


def release_tuple() -> tuple[int, ...]:
    return tuple(int(x) for x in (RELEASE or "0").split(".")[:3] if x.isdigit())


#: SGLang's HTTP server packages (``make sglang-server``), which the real server and the model
#: modules the CPU server's stand-ins patch import; in CI a release that has its server set must
#: have them (HICACHE_REQUIRE_SGLANG_SERVER=1: its tests run, and fail, rather than skip).
SERVER_INSTALLED = all(importlib.util.find_spec(m) is not None for m in ("uvicorn", "fastapi", "einops"))
SERVER_REQUIRED = os.environ.get("HICACHE_REQUIRE_SGLANG_SERVER") == "1"


def _server_release_reason() -> str:
    if release_tuple() < (0, 5, 23):
        return "the CPU server stand-ins are for SGLang 0.5.23's modules"
    if not (SERVER_INSTALLED or SERVER_REQUIRED):
        return "SGLang's server packages are not installed here (make sglang-server)"
    return ""


#: The CPU server's stand-ins follow 0.5.23's modules, the release whose real server the tests
#: run, and import what its server set installs.
SERVER_RELEASE = pytest.mark.skipif(bool(_server_release_reason()), reason=_server_release_reason() or "runs")


def mamba_layouts() -> tuple[str, ...]:
    """The host layouts the installed release's Mamba host pool takes (all three without SGLang)."""
    if RELEASE is None:
        return ("page_first", "layer_first", "page_first_direct")
    from hicache_obs.lab.sglang.harness import mamba_host_layouts

    return mamba_host_layouts()


def needs_mamba_layout(layout: str) -> None:
    """Skip where the installed release's Mamba host pool refuses ``layout`` (SGLang raises)."""
    if layout not in mamba_layouts():
        pytest.skip(f"SGLang {RELEASE}'s MambaPoolHost refuses layout {layout} (takes {', '.join(mamba_layouts())})")


def hybrid_backend() -> tuple[str, str]:
    """An (io backend, layout) pair the installed release takes for a hybrid Mamba model: the
    kernel backend with page_first where it can, else direct with page_first_direct (0.5.14 to
    0.5.17 take nothing else)."""
    return ("kernel", "page_first") if "page_first" in mamba_layouts() else ("direct", "page_first_direct")


def skip_draft_with_the_kernel_backend_on_0_5_17(io_backend: str) -> None:
    """0.5.17's hybrid controller skips the op-level move where its host pool group moves the
    indices per pool, and hands a ``set_draft_kv_pool`` draft host pool (not in the group) the
    op's CPU host indices. With the kernel backend that pool copies with the staged write-back
    kernel on a GPU that builds it; without it (this CPU) its copy refuses CPU indices, as
    sgl-kernel does. 0.5.18 moves through its L2 engine, 0.5.20 per pool, the draft included."""
    if io_backend == "kernel" and release_tuple() == (0, 5, 17):
        pytest.skip("SGLang 0.5.17 hands the draft host pool CPU host indices its kernel copy refuses here")


def fresh_module(name: str) -> types.ModuleType:
    """A new copy of SGLang's module ``name``, executed from its file, not in ``sys.modules``
    (and past any import hook, so nothing has patched it)."""
    from hicache_obs.lab.sglang.harness import prepare

    prepare("cpu")  # SGLang's packages import here as in the other CPU tests
    found = importlib.util.find_spec(name)
    assert found is not None and found.origin is not None, name
    spec = importlib.util.spec_from_file_location(name, found.origin)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
