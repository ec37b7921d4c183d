"""The wall between the product and the lab (:mod:`hicache_obs.lab`).

The lab imports the product; no product module imports the lab. The command line names
its two lab commands by module path (one table), and the old import paths of the moved
modules forward to the lab with a ``DeprecationWarning`` for one release.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hicache_obs._moved import KEPT, MOVED

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hicache_obs"
LAB = PACKAGE / "lab"
SHIMS = {str(Path(*old.split(".")).with_suffix(".py")) for old in MOVED}
#: the product modules allowed to name the lab, as a string: the moved-path table and the
#: command line's table of lab commands
NAMES_THE_LAB = {"hicache_obs/_moved.py", "hicache_obs/cli/__init__.py"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    if path.parent == ROOT / "exporters" or ROOT / "exporters" in path.parents:
        rel = Path("hicache_obs") / rel
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _product_files() -> list[Path]:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "exporters").rglob("*.py")]
    return sorted(f for f in files if LAB not in f.parents and str(f.relative_to(ROOT)) not in SHIMS)


def _imported(path: Path) -> list[str]:
    """Every module an import statement in ``path`` names, relative ones resolved."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out += [module] + [f"{module}.{a.name}" for a in node.names]
    return out


def test_the_scan_sees_the_product_and_the_lab() -> None:
    product = _product_files()
    names = {_module_name(f) for f in product}
    assert {"hicache_obs.core._controller", "hicache_obs.integrations.sglang._adapter",
            "hicache_obs.exporters._prometheus", "hicache_obs.cli._audit"} <= names
    assert not any(n.startswith("hicache_obs.lab") for n in names)
    # the scan resolves relative imports: the lab's own modules are seen importing the product
    lab_imports = {m for f in LAB.rglob("*.py") for m in _imported(f)}
    assert "hicache_obs.core._spec" in lab_imports


def test_no_product_module_imports_the_lab() -> None:
    offenders = {
        str(f.relative_to(ROOT)): m
        for f in _product_files()
        for m in _imported(f)
        if m == "hicache_obs.lab" or m.startswith("hicache_obs.lab.")
    }
    assert offenders == {}


def test_only_the_two_tables_name_the_lab() -> None:
    naming = set()
    for f in _product_files():
        tree = ast.parse(f.read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and "hicache_obs.lab" in node.value):
                naming.add(str(f.relative_to(ROOT)))
    assert naming == NAMES_THE_LAB


def test_importing_the_whole_product_loads_nothing_of_the_lab() -> None:
    modules = [_module_name(f) for f in _product_files()]
    modules = [m for m in modules if not m.endswith(("_boot.sitecustomize", "__main__")) and ".sinkhost.__main__" not in m]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "from hicache_obs.cli import build_parser\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('hicache_obs.lab'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert len(modules) > 50
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_the_command_line_reaches_the_lab_commands_by_name() -> None:
    out = subprocess.run([sys.executable, "-m", "hicache_obs", "--help"], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "demo" in out.stdout and "bench" in out.stdout
    code = (
        "import json, sys\nfrom hicache_obs.cli import build_parser\nbuild_parser()\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('hicache_obs.lab'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert {"hicache_obs.lab.cli.demo", "hicache_obs.lab.cli.bench"} <= set(loaded)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_import_path_warns_and_reads_the_moved_module(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(f"import {old}", __file__, "exec"), {})  # an import statement, as users write it
    shim = sys.modules[old]
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    if old in KEPT:  # a path that stays: no warning
        assert messages == []
    else:
        assert messages == [f"{old} moved to {MOVED[old]}; the old import path is kept for one release"]
        assert caught[0].filename == __file__  # the warning points at the line that imports the old path
    names = list(getattr(new, "__all__", [n for n in vars(new) if not n.startswith("_")]))
    assert names and list(shim.__all__) == names
    for name in names:
        assert getattr(shim, name) is getattr(new, name)
    star: dict[str, object] = {}
    exec(f"from {old} import *", star)
    assert {k for k in star if k != "__builtins__"} == set(names)
    with pytest.raises(AttributeError):
        _ = shim.no_such_name_here


def test_an_old_module_path_that_is_also_a_package_name_still_calls() -> None:
    """``hicache_obs.events.replay`` is a function of the package and the old path of its module:
    importing the old path (which binds the module there) leaves the package's name callable."""
    code = (
        "import warnings\nwarnings.simplefilter('ignore')\n"
        "import hicache_obs.events.replay, hicache_obs.events.audit\n"
        "from hicache_obs.events import ListSink, audit, replay\n"
        "from hicache_obs.events.audit import Auditor\n"
        f"r = replay({str(ROOT / 'tests' / 'data' / 'logs' / 'v2')!r})\n"
        "print(audit([]), type(r).__name__, Auditor.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "ReplayResult", "Auditor"]


def test_a_submodule_of_a_moved_package_forwards_and_is_never_a_second_copy() -> None:
    from hicache_obs.lab.sglang.kernels import installation
    from hicache_obs.lab.workload import driver

    for old, new in (("hicache_obs.workload.driver", driver), ("hicache_obs.integrations.sglang.kernels.installation", installation)):
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(f"import {old}", __file__, "exec"), {})
        shim = sys.modules[old]
        assert f"{old} moved to {new.__name__}; the old import path is kept for one release" in [
            str(w.message) for w in caught
        ]
        assert shim is not new and all(getattr(shim, n) is getattr(new, n) for n in shim.__all__)
        # nothing of the new module was loaded a second time under the old name
        assert not any(type(v).__module__ == old for v in vars(shim).values() if isinstance(v, type))


@pytest.mark.parametrize(
    ("package", "name", "module"),
    [("hicache_obs.core", "SimRuntime", "hicache_obs.core._sim"), ("hicache_obs.events", "SlotTable", "hicache_obs.events._state"),
     ("hicache_obs.exporters.sinkhost", "HostFeeder", "hicache_obs.exporters.sinkhost._feeder")],
)  # fmt: skip
def test_a_name_that_left_a_packages_all_still_reads_with_a_warning(package: str, name: str, module: str) -> None:
    pkg = importlib.import_module(package)
    assert name not in pkg.__all__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = getattr(pkg, name)
    assert got is getattr(importlib.import_module(module), name)
    assert [str(w.message) for w in caught] == [
        f"{package}.{name} moved to {module}.{name}; the old import path is kept for one release"
    ]
    assert not hasattr(pkg, "NoSuchName")
