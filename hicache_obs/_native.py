"""The compiled accelerators and their pure-Python twins, chosen in one place.

Three pieces are written in C, each an accelerator of a pure path that does the same:

- ``logcore`` (``hicache_obs/_logcore.c``): ``EventLog.emit``, the hand-off to a sink
  host's pipe, the replay's seq check (:func:`gap_free_run`); twin:
  ``hicache_obs/events/_logcore_py.py``.
- ``slots`` (``hicache_obs/_slots.c``): the slot maps (:class:`SlotMap`), the
  run-length encoding of index values (:func:`runs_of`, :func:`pair_runs_of`,
  :func:`side_runs`, :func:`dlpack_facts`) and the SGLang adapter's description of a
  submission (:func:`use_refs`, :func:`recorded`, :func:`op_tensors`,
  :func:`device_changes`, :func:`received`, :func:`meta_ref`, :func:`value_ref`,
  :func:`device_of`, :func:`slots_by_pool`, :func:`submission_event`), its ``record_stream`` observer
  (:func:`record_observer`), its copy hook (:func:`copy_hook`), its move hook (:func:`move_hook`), its start of a
  submission (:func:`start_hook`, :class:`Submission`), its queues (:class:`OpQueue`,
  :class:`AckQueue`, :class:`Stamp`, :class:`AckNote`, :class:`AckTaken`, :class:`QueueCleared`), the end of a submission (:class:`FinishHook`), its conversion watch's
  observer (:func:`conversion_observer`, put on and taken off by :func:`place_observers`
  and :func:`remove_observers`), its guard of an allocator's calls (:func:`slot_guard`)
  and its read of the allocator's free lists (:func:`read_free_lists`); twin:
  ``hicache_obs/events/_slots_py.py``.
- ``copy`` (``hicache_obs/_copy.c``): the cpu runtime's copy loop; twin: the torch kernels
  of ``hicache_obs/core/_transfer.py`` (:data:`copy` is then ``None``).

Each piece is the C module when it imports, else its twin (a DEBUG line on the
``hicache_obs.native`` logger says why). Two environment variables, read once at import:

- ``HICACHE_OBS_NO_EXTENSIONS``: ``1`` runs every piece pure; a comma-separated list of
  piece names (``slots,copy``) those pieces; unset, empty or ``0`` none.
- ``HICACHE_OBS_REQUIRE_EXTENSIONS=1``: a piece whose C module does not import is a
  :class:`~hicache_obs.errors.ConfigError` instead of a fallback (CI and ``make bench``).

Any other value of either is a :class:`~hicache_obs.errors.ConfigError` naming it.
:data:`IMPLEMENTATIONS` records what each piece runs on (``"c"`` or ``"py"``);
``hicache-obs bench --json`` reports it under ``machine``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from .errors import ConfigError

__all__ = [
    "IMPLEMENTATIONS",
    "NO_EXTENSIONS_ENV",
    "PIECES",
    "REQUIRE_EXTENSIONS_ENV",
    "LogCore",
    "SlotMap",
    "Submission",
    "OpQueue",
    "AckQueue",
    "Stamp",
    "AckNote",
    "FinishHook",
    "AckTaken",
    "QueueCleared",
    "conversion_observer",
    "copy",
    "copy_hook",
    "device_changes",
    "device_of",
    "dlpack_facts",
    "gap_free_run",
    "meta_ref",
    "move_hook",
    "op_tensors",
    "pair_runs_of",
    "place_observers",
    "read_free_lists",
    "received",
    "record_observer",
    "recorded",
    "recording",
    "remove_observers",
    "runs_of",
    "side_runs",
    "slot_guard",
    "submission_event",
    "slots_by_pool",
    "start_hook",
    "use_refs",
    "value_ref",
]

NO_EXTENSIONS_ENV = "HICACHE_OBS_NO_EXTENSIONS"
REQUIRE_EXTENSIONS_ENV = "HICACHE_OBS_REQUIRE_EXTENSIONS"
#: the pieces, each named by its C module without the leading underscore
PIECES = ("logcore", "slots", "copy")
#: the pure twin of each piece ("": the torch kernels of core/transfer.py)
_TWINS = {
    "logcore": "hicache_obs.events._logcore_py",
    "slots": "hicache_obs.events._slots_py",
    "copy": "",
}
#: what each piece is, for messages
_ROLES = {"logcore": "the event log's append path", "slots": "the slot maps", "copy": "the cpu runtime's copy loop"}

_log = logging.getLogger("hicache_obs.native")


def forced_pure(value: str | None) -> frozenset[str]:
    """The pieces a value of ``HICACHE_OBS_NO_EXTENSIONS`` runs pure."""
    v = (value or "").strip()
    if v in ("", "0"):
        return frozenset()
    if v == "1":
        return frozenset(PIECES)
    names = [n.strip() for n in v.split(",")]
    unknown = [n for n in names if n not in PIECES]
    if unknown:
        raise ConfigError(
            f"{NO_EXTENSIONS_ENV}={value!r}: unknown piece {unknown[0]!r}; the value is 1 (every piece), "
            f"0 or empty (none), or a comma-separated list of {', '.join(PIECES)}"
        )
    return frozenset(names)


def required(value: str | None) -> bool:
    """Whether a value of ``HICACHE_OBS_REQUIRE_EXTENSIONS`` requires every C module."""
    v = (value or "").strip()
    if v not in ("", "0", "1"):
        raise ConfigError(f"{REQUIRE_EXTENSIONS_ENV}={value!r}: the value is 1 (require every C module), 0 or empty")
    return v == "1"


def choose(environ: Any = os.environ) -> tuple[dict[str, str], dict[str, ModuleType | None]]:
    """``(implementations, modules)``: ``"c"``/``"py"`` per piece and the module it runs on
    (the C module, the pure twin, or ``None`` for the torch copies)."""
    pure = forced_pure(environ.get(NO_EXTENSIONS_ENV))
    need = required(environ.get(REQUIRE_EXTENSIONS_ENV))
    if need and pure:
        raise ConfigError(
            f"{REQUIRE_EXTENSIONS_ENV}=1 with {NO_EXTENSIONS_ENV}={environ.get(NO_EXTENSIONS_ENV)!r}: "
            f"{', '.join(p for p in PIECES if p in pure)} cannot be both required compiled and forced pure"
        )
    impls: dict[str, str] = {}
    mods: dict[str, ModuleType | None] = {}
    for piece in PIECES:
        twin = _TWINS[piece]
        if piece not in pure:
            try:
                mods[piece] = importlib.import_module(f"hicache_obs._{piece}")
                impls[piece] = "c"
                continue
            except ImportError as exc:
                if need:
                    raise ConfigError(
                        f"hicache_obs._{piece} ({_ROLES[piece]}) is not built ({exc}) and {REQUIRE_EXTENSIONS_ENV}=1: "
                        "install the package with a C compiler present (make venv, or pip install -e .)"
                    ) from None
                _log.debug("hicache_obs._%s is not built (%s): running its pure-Python twin", piece, exc)
        mods[piece] = _load_twin(twin) if twin else None
        impls[piece] = "py"
    return impls, mods


def _load_twin(name: str) -> ModuleType:
    """The pure twin ``name``, loaded from its file without running its package's
    ``__init__`` (``hicache_obs.events`` imports this module: importing the package from
    here would be a cycle). The twins import nothing of ``hicache_obs.events``."""
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent.joinpath(*name.split(".")[1:]).with_suffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


_impls, _mods = choose()
#: what each piece runs on: ``{"logcore": "c" | "py", "slots": ..., "copy": ...}``
IMPLEMENTATIONS: dict[str, str] = _impls

_logcore: Any = _mods["logcore"]
_slots: Any = _mods["slots"]
LogCore = _logcore.LogCore
gap_free_run = _logcore.gap_free_run
SlotMap = _slots.SlotMap
runs_of = _slots.runs_of
pair_runs_of = _slots.pair_runs_of
side_runs = _slots.side_runs
dlpack_facts = _slots.dlpack_facts
use_refs = _slots.use_refs
recorded = _slots.recorded
record_observer = _slots.record_observer
recording = _slots.recording
op_tensors = _slots.op_tensors
device_changes = _slots.device_changes
received = _slots.received
read_free_lists = _slots.read_free_lists
meta_ref = _slots.meta_ref
value_ref = _slots.value_ref
device_of = _slots.device_of
copy_hook = _slots.copy_hook
start_hook = _slots.start_hook
Submission = _slots.Submission
OpQueue = _slots.OpQueue
AckQueue = _slots.AckQueue
Stamp = _slots.Stamp
AckNote = _slots.AckNote
FinishHook = _slots.FinishHook
AckTaken = _slots.AckTaken
QueueCleared = _slots.QueueCleared
move_hook = _slots.move_hook
slot_guard = _slots.slot_guard
submission_event = _slots.submission_event
conversion_observer = _slots.conversion_observer
place_observers = _slots.place_observers
remove_observers = _slots.remove_observers
slots_by_pool = _slots.slots_by_pool
#: the compiled copy loop (``copy_runs``), or ``None``: the cpu runtime then copies with torch
copy: ModuleType | None = _mods["copy"]
