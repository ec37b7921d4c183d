"""The C extensions only; everything else about the package is in pyproject.toml.

All are plain C against the Python API (no torch headers, no ninja), built by
``pip install`` with the system C compiler:

- ``hicache_obs._copy``: the cpu runtime's copy loop;
- ``hicache_obs._logcore``: the event log's append path (``EventLog.emit``);
- ``hicache_obs._slots``: slot allocation maps and free-page lists (``SlotTable``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("hicache_obs._copy", ["hicache_obs/_copy.c"], extra_compile_args=["-O2"]),
        Extension("hicache_obs._logcore", ["hicache_obs/_logcore.c"], extra_compile_args=["-O2"]),
        Extension("hicache_obs._slots", ["hicache_obs/_slots.c"], extra_compile_args=["-O2"]),
    ]
)
