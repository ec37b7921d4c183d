"""The C extensions only; everything else about the package is in pyproject.toml.

All are plain C against the Python API (no torch headers, no ninja), built by
``pip install`` with the system C compiler, and all are optional accelerators: each has
a pure-Python twin that runs where it is not built (``hicache_obs/_native.py``).

- ``hicache_obs._copy``: the cpu runtime's copy loop (twin: the torch kernels);
- ``hicache_obs._logcore``: the event log's append path (``EventLog.emit``);
- ``hicache_obs._slots``: slot allocation maps and free-page lists (``SlotTable``), and the
  SGLang adapter's per-submission steps.

A compiler that fails (or none, ``CC=false``) leaves the package pure, with a warning
from the build. ``HICACHE_OBS_NO_EXTENSIONS`` as at run time: ``1`` builds none, a
comma-separated list of pieces (``slots,copy``) builds the others.
"""

import os

from setuptools import Extension, setup

PIECES = ("copy", "logcore", "slots")


def _skipped() -> set[str]:
    value = os.environ.get("HICACHE_OBS_NO_EXTENSIONS", "").strip()
    if value in ("", "0"):
        return set()
    if value == "1":
        return set(PIECES)
    names = {n.strip() for n in value.split(",")}
    unknown = sorted(names - set(PIECES))
    if unknown:
        raise SystemExit(
            f"HICACHE_OBS_NO_EXTENSIONS={value!r}: unknown piece {unknown[0]!r}; the value is 1 (every piece), "
            f"0 or empty (none), or a comma-separated list of {', '.join(PIECES)}"
        )
    return names


setup(
    ext_modules=[
        Extension(f"hicache_obs._{piece}", [f"hicache_obs/_{piece}.c"], extra_compile_args=["-O2"], optional=True)
        for piece in PIECES
        if piece not in _skipped()
    ]
)
