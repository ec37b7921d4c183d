"""``hicache_obs.core`` and ``hicache_obs.events`` import without the exporters' dependencies."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ("opentelemetry", "prometheus_client", "structlog")

_PROGRAM = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = {blocked!r}

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"{{name}} is blocked by the test", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]
    try:
        import structlog  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("the blocker does not work")

    import hicache_obs.core
    import hicache_obs.events
    from hicache_obs.core import HybridCacheController, ModelSpec, PoolTransfer

    c = HybridCacheController(ModelSpec.tiny_hybrid(), runtime="sim", device_size=64)
    kv = c.alloc_device(16)
    m = c.alloc_device(1, pool="mamba")
    c.write(kv, pool_transfers=[PoolTransfer("mamba", device_indices=m)])
    c.close()
    loaded = sorted(n for n in sys.modules if n.split(".")[0] in BLOCKED)
    if loaded:
        raise SystemExit(f"blocked modules were imported: {{loaded}}")
    print("ok", len(c.log))
    """
)


def test_core_and_events_import_without_exporter_dependencies():
    proc = subprocess.run(
        [sys.executable, "-c", _PROGRAM.format(blocked=BLOCKED)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok ")
