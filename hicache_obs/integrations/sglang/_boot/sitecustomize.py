"""Put first on PYTHONPATH by ``hicache-obs instrument``: instruments SGLang's HiCache
controllers in this process, then runs the ``sitecustomize`` it shadows, if any."""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("HICACHE_OBS_INSTRUMENT") == "1":
    try:
        from hicache_obs.integrations.sglang._launcher import install_import_hook

        install_import_hook()
    except Exception as exc:  # never stop the program over its telemetry
        print(f"hicache-obs: instrumentation is off in this process: {type(exc).__name__}: {exc}", file=sys.stderr)


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
