"""The C extension only; everything else about the package is in pyproject.toml.

``hicache_obs._copy`` is the cpu runtime's copy loop: plain C against the Python API
(no torch headers, no ninja), built by ``pip install`` with the system C compiler.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("hicache_obs._copy", ["hicache_obs/_copy.c"], extra_compile_args=["-O2"])])
