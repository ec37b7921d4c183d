"""On ``PYTHONPATH`` of a test's SGLang server: the CPU stand-ins of
:mod:`hicache_obs.lab.sglang.cpu_server` in every process started with
``HICACHE_OBS_SGLANG_CPU=1`` (but ``hicache-obs instrument``, which replaces itself with its
command), then the ``sitecustomize`` this one shadows, if any."""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("HICACHE_OBS_SGLANG_CPU") == "1":
    from hicache_obs.lab.sglang.cpu_server import install, replaced_by_its_command

    if not replaced_by_its_command(list(sys.orig_argv)):
        install()


def _chain() -> None:
    # only the entries after this folder: a boot folder before it has chained here already
    mine = [i for i, p in enumerate(sys.path) if os.path.abspath(p or ".") == _here]
    rest = sys.path[mine[-1] + 1 :] if mine else list(sys.path)
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_chain()
