"""Putting the stand-ins where SGLang imports them from, and taking them out again.

:func:`install` puts ``sgl_kernel`` / ``sgl_kernel.kvcacheio`` and
``transfer_mamba`` stand-in modules into ``sys.modules`` where the real ones do
not import; :func:`bind` sets the op names a SGLang module skipped importing on a
CPU (a CUDA-guarded import) on that module. :class:`Installation` records what
one install did, so :func:`uninstall` undoes just that.
"""

from __future__ import annotations

import ast
import dis
import importlib
import importlib.machinery
import importlib.util
import inspect
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hicache_obs.lab.sglang.kernels.kvcacheio import KVCACHEIO_MODULE, KVCACHEIO_OPS
from hicache_obs.lab.sglang.kernels.mamba import TRANSFER_MAMBA_MODULE, TRANSFER_MAMBA_OPS

__all__ = ["OPS", "Installation", "install", "uninstall", "bind", "unbind"]

OPS: dict[str, Callable[..., None]] = {**KVCACHEIO_OPS, **TRANSFER_MAMBA_OPS}
"""Every stand-in op by name: the names :func:`bind` looks for."""

STAND_IN_FLAG = "__hicache_obs_stand_in__"
"""Set on every stand-in module this package puts into ``sys.modules``."""
_STAND_IN_FLAG = STAND_IN_FLAG


@dataclass
class Installation:
    """What one :func:`install` did; :func:`uninstall` takes it to undo just that."""

    stand_ins: dict[str, types.ModuleType] = field(default_factory=dict)
    """``sys.modules`` name -> the stand-in put there."""
    bound: dict[str, list[str]] = field(default_factory=dict)
    """Module name -> the op names :func:`bind` set on it."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Module name -> why no stand-in was put there."""
    _parent_attrs: list[tuple[types.ModuleType, str, types.ModuleType]] = field(default_factory=list, repr=False)
    _modules: list[weakref.ReferenceType[types.ModuleType]] = field(default_factory=list, repr=False)

    def remember_attr(self, parent: types.ModuleType, attr: str, module: types.ModuleType) -> None:
        """Record that ``parent.attr`` was set to the stand-in ``module``, for :meth:`undo`."""
        self._parent_attrs.append((parent, attr, module))

    def remember_module(self, module: types.ModuleType) -> None:
        """Record that ``module``'s op names were bound (the names are in :attr:`bound`), for
        :meth:`undo`. Held weakly: a module that is gone has nothing left to unbind."""
        self._modules.append(weakref.ref(module))

    def undo(self) -> None:
        """Take out what this installation put in, where it is still what it put there: its
        stand-ins from ``sys.modules``, the attributes it set on their parents, the op names it
        bound on modules. Whatever replaced one of them since is left alone."""
        for name, module in self.stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
        for parent, attr, module in self._parent_attrs:
            if vars(parent).get(attr) is module:
                delattr(parent, attr)
        for ref in self._modules:
            target = ref()
            if target is not None:
                _unbind_names(target, self.bound.get(target.__name__, ()))


_lock = threading.RLock()
_installations: list[Installation] = []
_bound: dict[str, tuple[weakref.ReferenceType[types.ModuleType], list[str]]] = {}


def _stand_in(
    name: str, doc: str, *, package: bool = False, ops: dict[str, Callable[..., None]] | None = None
) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    setattr(module, _STAND_IN_FLAG, True)
    for op_name, op in (ops or {}).items():
        setattr(module, op_name, op)
    if ops:
        vars(module)["__all__"] = list(ops)
    return module


def _put(name: str, module: types.ModuleType, installation: Installation) -> None:
    sys.modules[name] = module
    installation.stand_ins[name] = module
    parent_name, _, attr = name.rpartition(".")
    parent = sys.modules.get(parent_name) if parent_name else None
    if parent is not None and not hasattr(parent, attr):
        setattr(parent, attr, module)
        installation.remember_attr(parent, attr, module)


def _install_kvcacheio(installation: Installation) -> None:
    if getattr(sys.modules.get(KVCACHEIO_MODULE), _STAND_IN_FLAG, False):
        installation.skipped[KVCACHEIO_MODULE] = "the stand-in is already installed"
        return
    try:
        importlib.import_module(KVCACHEIO_MODULE)
        installation.skipped[KVCACHEIO_MODULE] = "imports: left as it is"
        return
    except Exception as exc:  # a CUDA wheel on a CPU host fails with OSError as often as ImportError
        reason = f"{type(exc).__name__}: {exc}"
    if "sgl_kernel" not in sys.modules:
        _put(
            "sgl_kernel",
            _stand_in("sgl_kernel", f"hicache-obs CPU stand-in for sgl-kernel ({reason})", package=True),
            installation,
        )
    _put(
        KVCACHEIO_MODULE,
        _stand_in(
            KVCACHEIO_MODULE, f"hicache-obs CPU stand-ins for sgl_kernel.kvcacheio ({reason})", ops=KVCACHEIO_OPS
        ),
        installation,
    )


def _install_transfer_mamba(installation: Installation) -> None:
    if TRANSFER_MAMBA_MODULE in sys.modules:
        installation.skipped[TRANSFER_MAMBA_MODULE] = "already imported: bind() the pool module instead"
        return
    try:
        if importlib.util.find_spec("sglang.kernels") is None:
            installation.skipped[TRANSFER_MAMBA_MODULE] = (
                "this sglang has no sglang.kernels (0.5.10 and 0.5.11 have none)"
            )
            return
    except (ImportError, ValueError) as exc:
        installation.skipped[TRANSFER_MAMBA_MODULE] = f"sglang is not importable ({type(exc).__name__}: {exc})"
        return
    try:
        importlib.import_module(TRANSFER_MAMBA_MODULE)
        installation.skipped[TRANSFER_MAMBA_MODULE] = "imports (its JIT ops need CUDA): bind() the pool module instead"
        return
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
    try:
        importlib.import_module(TRANSFER_MAMBA_MODULE.rpartition(".")[0])
    except Exception as exc:
        installation.skipped[TRANSFER_MAMBA_MODULE] = (
            f"its package does not import either ({type(exc).__name__}: {exc})"
        )
        return
    _put(
        TRANSFER_MAMBA_MODULE,
        _stand_in(
            TRANSFER_MAMBA_MODULE, f"hicache-obs CPU stand-ins for transfer_mamba ({reason})", ops=TRANSFER_MAMBA_OPS
        ),
        installation,
    )


def install(modules: Iterable[types.ModuleType | str] = ()) -> Installation:
    """Make the ops importable where SGLang looks for them, then :func:`bind` each of ``modules``.

    ``sgl_kernel`` / ``sgl_kernel.kvcacheio`` stand-ins go into ``sys.modules``
    when ``import sgl_kernel.kvcacheio`` fails; a ``transfer_mamba`` stand-in
    when that module fails to import while its package does. Nothing that
    imports is replaced. Names in ``modules`` are imported after the stand-ins
    are in place.
    """
    installation = Installation()
    with _lock:
        _install_kvcacheio(installation)
        _install_transfer_mamba(installation)
        _installations.append(installation)
    for module in modules:
        target = importlib.import_module(module) if isinstance(module, str) else module
        installation.bound[target.__name__] = bind(target)
        installation.remember_module(target)
    return installation


def uninstall(installation: Installation | None = None) -> None:
    """Undo ``installation`` (default: every install and every :func:`bind`), leaving whatever was replaced since."""
    with _lock:
        targets = list(_installations) if installation is None else [installation]
        for inst in targets:
            inst.undo()
            if inst in _installations:
                _installations.remove(inst)
        if installation is None:
            for ref, names in list(_bound.values()):
                target = ref()
                if target is not None:
                    _unbind_names(target, names)
            _bound.clear()


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


def _code_names(code: types.CodeType, out: set[str]) -> None:
    """Global names ``code`` (and the code nested in it) loads; attribute names do not count."""
    out.update(i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_LOADS and isinstance(i.argval, str))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_names(const, out)


def _function_names(fn: Any, module: types.ModuleType, out: set[str], seen: set[int]) -> None:
    """Names loaded by ``fn`` when it is one of ``module``'s functions, following ``functools.wraps`` chains."""
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if isinstance(fn, types.FunctionType) and fn.__globals__ is module.__dict__:
            _code_names(fn.__code__, out)
        try:  # no getattr: a module-level object's __getattr__ may import or raise
            namespace = object.__getattribute__(fn, "__dict__")
        except AttributeError:
            return
        fn = namespace.get("__wrapped__") if isinstance(namespace, dict) else None


def _class_names(cls: type, module: types.ModuleType, out: set[str], seen: set[int]) -> None:
    if id(cls) in seen:
        return
    seen.add(id(cls))
    for value in vars(cls).values():
        if isinstance(value, (staticmethod, classmethod)):
            _function_names(value.__func__, module, out, seen)
        elif isinstance(value, property):
            for accessor in (value.fget, value.fset, value.fdel):
                _function_names(accessor, module, out, seen)
        elif isinstance(value, type) and value.__module__ == module.__name__:
            _class_names(value, module, out, seen)
        else:
            _function_names(value, module, out, seen)


def _referenced_names(module: types.ModuleType) -> set[str]:
    """Global names the module's functions and methods load, plus names its source loads."""
    out: set[str] = set()
    seen: set[int] = set()
    for value in list(vars(module).values()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            _class_names(value, module, out, seen)
        else:
            _function_names(value, module, out, seen)
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError, ValueError):
        return out
    out.update(node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load))
    return out


def bind(module: types.ModuleType) -> list[str]:
    """Set each op name ``module``'s code uses but never got (a CUDA-guarded import skipped on a CPU); returns those names.

    A name the module already has, whatever its value, is left alone.
    """
    names = sorted(n for n in _referenced_names(module) & OPS.keys() if n not in vars(module))
    with _lock:
        for name in names:
            setattr(module, name, OPS[name])
        if names:
            _, previous = _bound.get(module.__name__, (None, []))
            _bound[module.__name__] = (weakref.ref(module), sorted({*previous, *names}))
    return names


def _unbind_names(module: types.ModuleType, names: Iterable[str]) -> None:
    for name in names:
        if vars(module).get(name) is OPS.get(name):
            delattr(module, name)


def unbind(module: types.ModuleType) -> None:
    """Remove the names :func:`bind` set on ``module`` that still hold our ops."""
    with _lock:
        entry = _bound.pop(module.__name__, None)
        if entry is not None:
            _unbind_names(module, entry[1])
