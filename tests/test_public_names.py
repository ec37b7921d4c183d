"""Every public name stays where users import it from: the guard for moving code between modules.

The docs are the pins: every name the front door (the product's public packages) lists in
``__all__`` is named in README.md or docs/*.md, every name the docs import is in its
module's ``__all__``, and the front door stays small. Held here besides:

- the methods and fields the API names: controllers, runtimes, operations, the workload,
  and every event type with its fields (the keys of the JSON log);
- the command line: the subcommands of ``hicache-obs``, the options of each, the console
  script, and the sink host's child entry ``python -m hicache_obs.exporters.sinkhost``.

Read from the tree: every ``from hicache_obs... import`` line and every dotted
``hicache_obs.`` name in README.md and docs/*.md, and every ``__all__`` entry of every
module of the package.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

import hicache_obs
from hicache_obs._moved import KEPT, MOVED
from hicache_obs.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: The front door: the product's public modules. Every other product module is private
#: (``_`` in its path) or an old path that forwards (``hicache_obs._moved.MOVED``); the lab
#: (``hicache_obs.lab``) is a place of its own.
FRONT_DOOR = (
    "hicache_obs",
    "hicache_obs.errors",
    "hicache_obs.core",
    "hicache_obs.events",
    "hicache_obs.exporters",
    "hicache_obs.exporters.metric_names",
    "hicache_obs.exporters.sinkhost",
    "hicache_obs.integrations",
    "hicache_obs.integrations.sglang",
    "hicache_obs.cli",
    "hicache_obs.testing",
)
#: Names the docs list as tables rather than by name: the event types and schema helpers
#: (held field by field below), the metric name constants (held by the dashboard and sink
#: tests against ``ALL_METRICS``) and the error classes (each raised by a test of its own).
TABLES = ("hicache_obs.events._schema", "hicache_obs.exporters.metric_names", "hicache_obs.errors")
#: The most names the front door may hold beyond those tables.
FRONT_DOOR_MAX = 60

#: Methods and attributes the API names on a class (``module.Class``).
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "hicache_obs.core.HiCacheController": (
        "write", "load", "start_writing", "start_loading", "move_indices", "poll_writes", "poll_loads",
        "evict_host", "evict_device", "alloc_device", "free_device", "device_pool", "host_pool", "synchronize",
        "close",
    ),
    "hicache_obs.core.HybridCacheController": (
        "move_hybrid_indices", "_record_transfer_indices_on_stream",
    ),
    "hicache_obs.core._runtime.Runtime": (
        "stream", "current_stream", "use", "event", "record_stream", "is_device", "to_device", "synchronize",
    ),
    "hicache_obs.core.ModelSpec": ("tiny", "tiny_hybrid", "tiny_swa"),
    "hicache_obs.integrations.sglang.Instrumentation": ("detach", "__enter__", "__exit__"),
    "hicache_obs.lab.workload.Workload": ("run", "step", "finish"),
    "hicache_obs.lab.workload.WorkloadStats": ("data_intact", "hit_rate", "to_dict"),
    "hicache_obs.lab.workload.Corruption": ("to_dict",),
}  # fmt: skip

#: Dataclass fields the API names (``module.Class``).
FIELDS: dict[str, tuple[str, ...]] = {
    "hicache_obs.core.CacheOperation": (
        "host_indices", "device_indices", "node_ids", "priority", "pool_transfers",
    ),
    "hicache_obs.core.PoolTransfer": ("pool", "host_indices", "device_indices", "indices_from_pool"),
    "hicache_obs.lab.workload.WorkloadConfig": (
        "documents", "chunks_per_document", "chunk_tokens", "suffix_tokens", "popularity",
    ),
    "hicache_obs.lab.workload.WorkloadStats": (
        "steps", "requests", "tokens", "nodes_created", "writes", "loads", "evictions", "truncated_requests",
        "checked_slots", "corruptions", "corrupted",
    ),
    "hicache_obs.lab.workload.Corruption": ("node", "pool", "direction", "op", "tier", "slots"),
}  # fmt: skip

HEADER = ("seq", "ts_ns", "rank")
#: Every event type (its ``type`` tag in the log) and the fields it has beyond the header.
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "PoolCreated": ("pool", "tier", "capacity", "page_size", "slot_bytes", "layout"),
    "SlotsAllocated": ("pool", "tier", "indices", "op"),
    "SlotsFreed": ("pool", "tier", "indices", "reason", "op"),
    "AllocationFailed": ("pool", "tier", "requested", "available"),
    "OperationQueued": ("op", "direction", "node_id", "priority", "slots_by_pool"),
    "OperationsMerged": ("op", "merged_ops", "direction", "node_ids"),
    "IndicesMoved": ("op", "pool", "role", "src_device", "dst_device", "tensor", "stream"),
    "StreamRecorded": ("op", "pool", "role", "stream", "tensor"),
    "TransferSubmitted": (
        "op", "direction", "stream", "io_backend", "layout", "tensors", "slots_by_pool", "bytes_by_pool",
        "producer_id", "device", "host_indices_on_cpu",
    ),
    "TransferCompleted": ("op", "direction", "duration_ns", "layer_durations_ns"),
    "TransferFailed": ("op", "direction", "error"),
    "AuditViolation": ("op", "rule", "pool", "role", "detail", "stream", "direction"),
}  # fmt: skip
TENSOR_REF_FIELDS = ("pool", "role", "device", "numel", "dtype", "ptr", "indices")

#: ``hicache-obs`` subcommands, in the order ``--help`` lists them.
COMMANDS = ("demo", "audit", "inspect", "export", "bench", "instrument")
#: The options of each subcommand (a command may gain options, never lose one).
OPTIONS: dict[str, tuple[str, ...]] = {
    "demo": (
        "--engine", "--model", "--runtime", "--steps", "--seed", "--io-backend", "--layout", "--write-policy",
        "--device-tokens", "--fault", "--out", "--metrics-port", "--otlp-endpoint", "--serve", "--json",
    ),
    "audit": ("--json", "--verbose"),
    "inspect": ("--timeline", "--op", "--pool", "--rank", "--violations-only", "--limit", "--json"),
    "export": ("--chrome-trace", "--otlp-json"),
    "bench": ("--quick", "--json", "--section", "--threads"),
    "instrument": ("--metrics-port", "--out", "--otlp-endpoint"),
}  # fmt: skip


def resolve(dotted: str) -> Any:
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        if name in MOVED and hasattr(importlib.import_module(".".join(parts[: cut - 1])), parts[cut - 1]):
            continue  # a package's own name (``events.replay``), not the old module of that name
        try:
            obj: Any = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name) and exc.name.startswith("hicache_obs"):
                continue  # that prefix is not a module: an attribute of a shorter one
            raise
        for i, attr in enumerate(parts[cut:], cut):
            if not hasattr(obj, attr):
                raise AttributeError(f"{'.'.join(parts[:i])} has no {attr!r} (resolving {dotted})")
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def package_modules() -> list[ModuleType]:
    """Every module of the package, imported (``__main__`` runs the CLI, SGLang's boot hook is
    not ours, and an old path that forwards warns)."""
    mods = [hicache_obs, importlib.import_module("hicache_obs.exporters")]
    for pkg in list(mods):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name.rsplit(".", 1)[-1] == "__main__" or "._boot" in info.name or info.name in MOVED:
                continue
            mods.append(importlib.import_module(info.name))
    return mods


def is_private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split(".")[1:])


FROM_IMPORT = re.compile(r"^\s*from\s+(hicache_obs[\w.]*)\s+import\s+\(?([\w\s,]+?)\)?\s*$", re.M)
DOTTED = re.compile(r"(?<![\w.])hicache_obs(?:\.\w+)+")


def documented_names() -> list[tuple[str, str]]:
    """``(doc file, dotted name)`` for every import line and dotted name in the docs."""
    found: dict[tuple[str, str], None] = {}
    for doc in DOCS:
        text = doc.read_text()
        for module, names in FROM_IMPORT.findall(text):
            for item in names.split(","):
                if item.strip():
                    found[(doc.name, f"{module}.{item.split()[0]}")] = None
        for dotted in DOTTED.findall(text):
            found[(doc.name, dotted)] = None
    return list(found)


DOCUMENTED = documented_names()


# ------------------------------------------------------------------ modules
def test_the_front_door_is_the_products_public_modules() -> None:
    public = {
        m.__name__ for m in package_modules()
        if not is_private(m.__name__) and not m.__name__.startswith("hicache_obs.lab")
    }  # fmt: skip
    assert public == set(FRONT_DOOR)


def test_every_all_entry_of_every_module_resolves() -> None:
    listed = {m.__name__: m for m in package_modules() if hasattr(m, "__all__")}
    dangling = [f"{name}.{n}" for name, mod in listed.items() for n in mod.__all__ if not hasattr(mod, n)]
    assert not dangling, f"__all__ names what the module does not have: {dangling}"
    repeated = [f"{name}.{n}" for name, mod in listed.items() for n in set(mod.__all__) if mod.__all__.count(n) > 1]
    assert not repeated, f"__all__ lists a name twice: {sorted(repeated)}"


def front_door_names() -> dict[str, list[str]]:
    """Each front-door module's ``__all__``, less the names of the tables."""
    tabled = {n for t in TABLES for n in importlib.import_module(t).__all__}
    out = {}
    for module in FRONT_DOOR:
        mod = importlib.import_module(module)
        out[module] = [n for n in getattr(mod, "__all__", ()) if n not in tabled or module == "hicache_obs"]
    return out


def test_the_front_door_is_small() -> None:
    names = [f"{m}.{n}" for m, ns in front_door_names().items() for n in ns]
    assert 30 <= len(names) <= FRONT_DOOR_MAX, names


def test_every_front_door_name_is_in_the_docs() -> None:
    """The docs are the pins: a name the front door lists and no page names is a name nobody
    was told about (document it or make it private)."""
    text = "\n".join(doc.read_text() for doc in DOCS)
    words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text))
    missing = [f"{m}.{n}" for m, ns in front_door_names().items() for n in ns if n not in words]
    assert not missing, f"listed in __all__ but named in no doc: {missing}"


def test_the_api_page_lists_exactly_each_packages_names() -> None:
    """docs/api.md names, package by package, what that package's ``__all__`` lists (a
    section's tables and lines name it in backticks)."""
    text = (ROOT / "docs" / "api.md").read_text()
    sections = re.split(r"^## `([\w.]+)`.*$", text, flags=re.M)
    got = {sections[i]: set(re.findall(r"`(\w+)`", sections[i + 1])) for i in range(1, len(sections), 2)}
    # a table's first column is exactly the package's names
    tabled = {
        sections[i]: {n for row in re.findall(r"^\| ([^|]+) \|", sections[i + 1], re.M) for n in re.findall(r"`(\w+)`", row)}
        for i in range(1, len(sections), 2)
    }
    names_of = front_door_names()
    in_tables = {n for t in TABLES for n in importlib.import_module(t).__all__}
    for module, names in tabled.items():
        if names:
            assert names - in_tables == set(names_of[module]) - in_tables, f"docs/api.md's table of {module}"
    for module, names in names_of.items():
        if module in ("hicache_obs.errors", "hicache_obs.exporters.metric_names", "hicache_obs.integrations"):
            continue  # named as a whole on the page
        home = module if module in got else module.rpartition(".")[0]
        missing = set(names) - got.get(home, set())
        assert not missing, f"docs/api.md does not list {sorted(missing)} of {module}"
    assert set(got) <= set(FRONT_DOOR)


def test_the_docs_import_only_through_the_front_door_or_the_lab() -> None:
    """Every name a doc imports is in its module's ``__all__``; no doc imports a private
    module or an old path that forwards."""
    wrong = []
    for doc in DOCS:
        for module, names in FROM_IMPORT.findall(doc.read_text()):
            if module in MOVED or is_private(module):
                wrong.append(f"{doc.name}: from {module}")
                continue
            listed = getattr(importlib.import_module(module), "__all__", ())
            wrong += [f"{doc.name}: {module}.{n}" for n in (x.split()[0] for x in names.split(",") if x.strip())
                      if n not in listed]
    assert not wrong


# --------------------------------------------------------------------- docs
def test_docs_name_what_this_guard_expects() -> None:
    names = {dotted for _, dotted in DOCUMENTED}
    # the parser reads both forms: an import line of a README example and a dotted name in prose
    assert "hicache_obs.exporters.sinkhost.add_sink_host" in names
    assert "hicache_obs.testing.FAULTS" in names
    assert len(names) >= 15, sorted(names)


@pytest.mark.parametrize(("doc", "dotted"), DOCUMENTED, ids=[f"{d}:{n}" for d, n in DOCUMENTED])
def test_documented_name_imports_from_the_documented_path(doc: str, dotted: str) -> None:
    package, _, name = dotted.rpartition(".")
    exported = package in FRONT_DOOR and name in getattr(importlib.import_module(package), "__all__", ())
    assert exported or any(dotted == k or dotted.startswith(k + ".") for k in KEPT) or not any(dotted == old or dotted.startswith(old + ".") for old in MOVED), f"{dotted}: an old path"
    resolve(dotted)


def test_resolve_names_the_missing_part() -> None:
    assert resolve("hicache_obs.lab.workload.Workload").__name__ == "Workload"
    with pytest.raises(AttributeError, match=r"hicache_obs\.lab\.workload has no 'Nope'"):
        resolve("hicache_obs.lab.workload.Nope")
    with pytest.raises(ModuleNotFoundError):
        resolve("hicache_obs_nope.x")


# ---------------------------------------------------------------------- API
@pytest.mark.parametrize("cls", sorted(ATTRIBUTES))
def test_named_methods_and_attributes(cls: str) -> None:
    obj = resolve(cls)
    missing = [a for a in ATTRIBUTES[cls] if not hasattr(obj, a)]
    assert not missing, f"{cls} no longer has {missing}"


@pytest.mark.parametrize("cls", sorted(FIELDS))
def test_named_dataclass_fields(cls: str) -> None:
    import dataclasses

    have = {f.name for f in dataclasses.fields(resolve(cls))}
    missing = [f for f in FIELDS[cls] if f not in have]
    assert not missing, f"{cls} no longer has the fields {missing}"


def test_event_types_and_their_fields() -> None:
    from hicache_obs.events._schema import EVENT_TYPES, TensorRef

    assert set(EVENT_FIELDS) <= set(EVENT_TYPES), sorted(set(EVENT_FIELDS) - set(EVENT_TYPES))
    for name, fields in EVENT_FIELDS.items():
        cls = EVENT_TYPES[name]
        assert cls.__name__ == name and cls.__struct_config__.tag == name
        have = [f.name for f in msgspec.structs.fields(cls)]
        assert tuple(have[:3]) == HEADER, (name, have)
        assert not set(fields) - set(have), f"{name} no longer has {sorted(set(fields) - set(have))}"
    have = [f.name for f in msgspec.structs.fields(TensorRef)]
    assert not set(TENSOR_REF_FIELDS) - set(have), have


# ---------------------------------------------------------------------- CLI
def help_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    code = main([*argv, "--help"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def test_subcommands_are_the_held_list(capsys: pytest.CaptureFixture[str]) -> None:
    from hicache_obs import cli

    text = help_text(capsys)
    assert text.startswith("usage: hicache-obs ")
    listed = re.findall(r"^ {4}([a-z][a-z-]*)(?: {2,}|$)", text, re.M)  # the COMMAND block of `hicache-obs --help`
    assert tuple(listed) == COMMANDS
    assert tuple(cli.COMMANDS) == COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_options_of_each_subcommand(capsys: pytest.CaptureFixture[str], command: str) -> None:
    text = help_text(capsys, command)
    assert text.startswith(f"usage: hicache-obs {command} ")
    found = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))
    missing = [o for o in OPTIONS[command] if o not in found]
    assert not missing, f"hicache-obs {command} no longer has {missing}"


def test_console_script_points_at_the_cli() -> None:
    scripts = re.search(r"^\[project\.scripts\]\n(.*?)(?:^\[|\Z)", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert scripts is not None
    assert 'hicache-obs = "hicache_obs.cli:main"' in scripts.group(1).splitlines()


def test_sink_host_child_entry_runs_as_a_module() -> None:
    # SinkHost spawns exactly this module with -m; its argument parser is the child's contract
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_obs.exporters.sinkhost", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m hicache_obs.exporters.sinkhost ")
    assert "--reply-fd REPLY_FD" in proc.stdout and " specs" in proc.stdout
