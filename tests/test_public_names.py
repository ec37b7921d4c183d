"""Every public name stays where users import it from: the guard for moving code between modules.

Held here as they are today (a move that drops or relocates one fails; a new name needs no
change here):

- the names every public module lists in ``__all__``, importable from that module;
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
from hicache_obs.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: ``__all__`` of every public module (no ``_`` in its path), as it is today.
PUBLIC_NAMES: dict[str, tuple[str, ...]] = {
    "hicache_obs": ("HiCacheError", "__version__"),
    "hicache_obs.exporters": (
        "PrometheusSink", "start_metrics_server", "stop_metrics_server", "OtelSpanSink", "otlp_json",
        "StructlogSink", "make_json_logger", "ChromeTraceSink", "write_chrome_trace",
    ),
    "hicache_obs.lab.bench": (
        "Ratio", "ratio_of_times", "ratio_of_rates", "interleave", "bench_events", "bench_data_path",
        "bench_overhead", "bench_sglang", "bench_sglang_here", "sglang_workload", "run_bench", "TARGETS",
    ),
    "hicache_obs.cli": (
        "main", "build_parser", "COMMANDS", "Terminated", "deferred_interrupts", "EXIT_INTERRUPTED",
        "EXIT_TERMINATED",
    ),
    "hicache_obs.cli.audit": ("register", "run", "audit_report"),
    "hicache_obs.lab.cli.bench": ("register", "run"),
    "hicache_obs.lab.cli.demo": ("register", "run", "DEFAULT_STEPS", "DEFAULT_OUT"),
    "hicache_obs.cli.export": ("register", "run"),
    "hicache_obs.cli.inspect": ("register", "run", "op_views", "timeline"),
    "hicache_obs.cli.instrument": ("register", "run", "child_environment"),
    "hicache_obs.core": (
        "ANCHOR", "Ack", "CacheOperation", "CpuRuntime", "CudaRuntime", "DeviceEvent", "DevicePool",
        "HiCacheController", "HostPool", "HybridCacheController", "IO_BACKENDS", "LAYOUTS", "LayerDoneCounter",
        "MODEL_PRESETS", "ModelSpec", "PlaneSpec", "PoolTransfer", "RUNTIME_NAMES", "Runtime", "SimRuntime",
        "SimTensor", "SlotAllocator", "WRITE_POLICIES", "WritePolicy", "host_size", "make_runtime", "merge_ops",
    ),
    "hicache_obs.core.controller": ("Ack", "HiCacheController", "HybridCacheController", "ANCHOR", "EVENT_DETAILS"),
    "hicache_obs.core.layers": ("LayerDoneCounter",),
    "hicache_obs.core.operations": ("PoolTransfer", "CacheOperation", "merge_ops", "HIT_POLICIES"),
    "hicache_obs.core.policy": ("WRITE_POLICIES", "WritePolicy"),
    "hicache_obs.core.pools": ("LAYOUTS", "SlotAllocator", "DevicePool", "HostPool", "host_size", "indices_list"),
    "hicache_obs.core.runtime": (
        "CallObservers", "Stream", "DeviceEvent", "Runtime", "CpuRuntime", "CudaRuntime", "make_runtime",
        "RUNTIME_NAMES",
    ),
    "hicache_obs.core.sim": ("SimRuntime", "SimTensor", "SimStream", "SimEvent"),
    "hicache_obs.core.spec": ("ModelSpec", "PlaneSpec", "MODEL_PRESETS"),
    "hicache_obs.core.tensors": ("subclass_problem", "tensor_problem"),
    "hicache_obs.core.transfer": (
        "IO_BACKENDS", "CopyFault", "check_kernel_indices", "pair_runs", "tensor_pair_runs", "launch_backup",
        "launch_load_layer", "launch_load_all",
    ),
    "hicache_obs.errors": (
        "HiCacheError", "InvalidIndicesError", "LengthMismatchError", "SlotNotAllocatedError", "DoubleFreeError",
        "PageSizeError", "UnknownPoolError", "UnknownBackendError", "UnknownLayoutError", "UnresolvedTransferError",
        "IndexNotOnDeviceError", "RuntimeUnavailableError", "ControllerClosedError", "ProducerSlotBusyError",
        "SequenceError", "LogFormatError", "LogLimitError", "ConfigError", "IntegrationError",
    ),
    "hicache_obs.events": (
        "Runs", "TensorRef", "Event", "PoolCreated", "SlotsAllocated", "SlotsFreed", "AllocationFailed",
        "OperationQueued", "OperationsMerged", "IndicesMoved", "StreamRecorded", "TransferSubmitted",
        "TransferCompleted", "TransferFailed", "AuditViolation", "AnyEvent", "EVENT_TYPES", "D2H", "H2D",
        "DIRECTIONS", "TIERS", "ROLES", "runs_from_list", "expand_runs", "runs_len", "EventLog", "Subscriber",
        "Sink", "BatchSink", "ListSink", "SinkRunner", "CacheState", "OpState", "SlotTable", "fold",
    ),
    "hicache_obs.events.audit": ("RULES", "Finding", "Auditor", "audit"),
    "hicache_obs.events.lifecycle": (
        "PHASES", "UNRECORDED_RULE", "NOT_OP_EVENTS", "OpKey", "OpRecord", "Step", "Applied", "OpLifecycles",
    ),
    "hicache_obs.events.log": ("EventLog", "Subscriber"),
    "hicache_obs.events.projections": ("occupancy", "OpLifecycle", "lifecycles", "TensorRecord", "tensor_records"),
    "hicache_obs.events.replay": (
        "TornLine", "ReplayResult", "expand_paths", "read_file", "read_segments", "replay", "MAX_LINE_BYTES",
    ),
    "hicache_obs.events.schema": (
        "Runs", "TensorRef", "Event", "PoolCreated", "SlotsAllocated", "SlotsFreed", "AllocationFailed",
        "OperationQueued", "OperationsMerged", "IndicesMoved", "StreamRecorded", "TransferSubmitted",
        "TransferCompleted", "TransferFailed", "AuditViolation", "AnyEvent", "EVENT_TYPES", "D2H", "H2D",
        "DIRECTIONS", "TIERS", "ROLES", "runs_from_list", "expand_runs", "runs_len",
    ),
    "hicache_obs.events.sinks": ("Sink", "BatchSink", "SinkRunner", "ListSink", "report_losses"),
    "hicache_obs.events.state": (
        "AllocMap", "SlotTable", "OpState", "OpQueue", "CacheState", "PoolLimits", "fold", "bad_runs", "ALLOC",
        "FREE", "CHECK", "first_slots", "MAX_POOLS", "MAX_TOTAL_CAPACITY", "MAP_CALL_SLOTS",
    ),
    "hicache_obs.events.store": ("JsonlStore", "open_store", "segment_name", "SEGMENT_GLOB"),
    "hicache_obs.exporters.chrome_trace": (
        "CONTROLLER_TRACK", "AUDIT_TRACK", "STREAM_TRACKS", "chrome_trace", "write_chrome_trace", "ChromeTraceSink",
    ),
    "hicache_obs.exporters.metric_names": (
        "OPERATIONS_TOTAL", "TRANSFERS_IN_FLIGHT", "TRANSFER_SLOTS_TOTAL", "TRANSFER_BYTES_TOTAL",
        "TRANSFER_DURATION_SECONDS", "QUEUE_WAIT_SECONDS", "INDEX_MOVES_TOTAL", "STREAM_RECORDS_TOTAL",
        "UNRECORDED_INDICES_TOTAL", "AUDIT_VIOLATIONS_TOTAL", "POOL_USED_SLOTS", "POOL_CAPACITY_SLOTS",
        "ALLOCATION_FAILURES_TOTAL", "EVENTS_TOTAL", "EVENTS_DROPPED_TOTAL", "EXPORTER_ERRORS_TOTAL",
        "EVICTIONS_TOTAL", "EVICTED_SLOTS_TOTAL", "COUNTER", "GAUGE", "HISTOGRAM", "DESIGN_METRICS", "ADDITIONS",
        "ALL_METRICS", "HELP", "OPERATION_STATUSES", "series_names",
    ),
    "hicache_obs.exporters.otel": (
        "SPAN_ATTRIBUTES", "INSTRUMENTATION_NAME", "OtelSpanSink", "make_tracer_provider", "span_attributes",
        "otlp_json",
    ),
    "hicache_obs.exporters.metrics_server": ("MetricsServer", "start_metrics_server", "stop_metrics_server"),
    "hicache_obs.exporters.prometheus": (
        "DEFAULT_POOLS", "DEFAULT_DURATION_BUCKETS", "DEFAULT_QUEUE_WAIT_BUCKETS", "PrometheusSink",
        "SinkStatsCollector", "MetricsServer", "start_metrics_server", "stop_metrics_server",
    ),
    "hicache_obs.exporters.sinkhost": (
        "SinkHost", "SinkHostError", "HostFeeder", "add_sink_host", "SINK_KINDS", "PIPE_BYTES",
    ),
    "hicache_obs.exporters.structlog_sink": ("StructlogSink", "make_json_logger", "LEVELS"),
    "hicache_obs.integrations.sglang": (
        "Instrumentation", "IntegrationError", "instrument", "instrumentation_of", "SUPPORTED_RELEASES",
    ),
    "hicache_obs.integrations.sglang.adapter": ("Instrumentation", "instrument", "instrumentation_of"),
    "hicache_obs.lab.sglang.engine": (
        "ENGINE_RUNTIME", "ENGINE_RUNTIMES", "ENGINE_MODELS", "SGLangEngine", "SGLangHybridEngine", "build_engine", "check_options",
        "default_layout", "require_sglang",
    ),
    "hicache_obs.lab.sglang.kernels": (
        "KernelCheckError", "UnmappedAddressError", "Memory", "MEMORY", "register_buffers", "transfer_kv_per_layer",
        "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf", "transfer_kv_all_layer",
        "transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_lf_ph", "transfer_kv_per_layer_mla",
        "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
        "transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf",
        "transfer_kv_mamba_pf_lf", "transfer_kv_mamba_lf_pf", "KVCACHEIO_OPS", "TRANSFER_MAMBA_OPS", "OPS",
        "KVCACHEIO_MODULE", "TRANSFER_MAMBA_MODULE", "Installation", "install", "uninstall", "bind", "unbind",
    ),
    "hicache_obs.integrations.sglang.launcher": (
        "ENV", "TARGETS", "install_import_hook", "instrument_new_controller", "pipelines",
    ),
    "hicache_obs.lab.sglang.testing": (
        "CudaStandIn", "SGLangHarness", "build_controller", "prepare", "sglang_version", "DEVICES",
        "SGL_KERNEL_IMPORTS", "kernel_sources",
    ),
    "hicache_obs.lab.testing": ("FAULTS", "Captured", "capture_events", "InMemorySink", "make_controller", "fault_class"),
    "hicache_obs.lab.workload": (
        "WorkloadConfig", "WorkloadStats", "Corruption", "Workload", "controller_options", "run_workload",
    ),
}  # fmt: skip

#: Methods and attributes the API names on a class (``module.Class``).
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "hicache_obs.core.controller.HiCacheController": (
        "write", "load", "start_writing", "start_loading", "move_indices", "poll_writes", "poll_loads",
        "evict_host", "evict_device", "alloc_device", "free_device", "device_pool", "host_pool", "synchronize",
        "close",
    ),
    "hicache_obs.core.controller.HybridCacheController": (
        "move_hybrid_indices", "_record_transfer_indices_on_stream",
    ),
    "hicache_obs.core.runtime.Runtime": (
        "stream", "current_stream", "use", "event", "record_stream", "is_device", "to_device", "synchronize",
    ),
    "hicache_obs.core.spec.ModelSpec": ("tiny", "tiny_hybrid", "tiny_swa"),
    "hicache_obs.integrations.sglang.Instrumentation": ("detach", "__enter__", "__exit__"),
    "hicache_obs.lab.workload.Workload": ("run", "step", "finish"),
    "hicache_obs.lab.workload.WorkloadStats": ("data_intact", "hit_rate", "to_dict"),
    "hicache_obs.lab.workload.Corruption": ("to_dict",),
}  # fmt: skip

#: Dataclass fields the API names (``module.Class``).
FIELDS: dict[str, tuple[str, ...]] = {
    "hicache_obs.core.operations.CacheOperation": (
        "host_indices", "device_indices", "node_ids", "priority", "pool_transfers",
    ),
    "hicache_obs.core.operations.PoolTransfer": ("pool", "host_indices", "device_indices", "indices_from_pool"),
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
    """Every module of the package, imported (``__main__`` runs the CLI and SGLang's boot hook is not ours)."""
    mods = [hicache_obs, importlib.import_module("hicache_obs.exporters")]
    for pkg in list(mods):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name.rsplit(".", 1)[-1] == "__main__" or "._boot" in info.name:
                continue
            mods.append(importlib.import_module(info.name))
    return mods


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
@pytest.mark.parametrize("module", sorted(PUBLIC_NAMES))
def test_held_names_stay_in_their_module_and_its_all(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in PUBLIC_NAMES[module] if not hasattr(mod, n)]
    assert not missing, f"{module} no longer has {missing}"
    unlisted = [n for n in PUBLIC_NAMES[module] if n not in getattr(mod, "__all__", ())]
    assert not unlisted, f"{module}.__all__ no longer lists {unlisted}"


def test_every_all_entry_of_every_module_resolves() -> None:
    listed = {m.__name__: m for m in package_modules() if hasattr(m, "__all__")}
    assert set(PUBLIC_NAMES) <= set(listed), f"held modules not found: {sorted(set(PUBLIC_NAMES) - set(listed))}"
    dangling = [f"{name}.{n}" for name, mod in listed.items() for n in mod.__all__ if not hasattr(mod, n)]
    assert not dangling, f"__all__ names what the module does not have: {dangling}"
    repeated = [f"{name}.{n}" for name, mod in listed.items() for n in set(mod.__all__) if mod.__all__.count(n) > 1]
    assert not repeated, f"__all__ lists a name twice: {sorted(repeated)}"


# --------------------------------------------------------------------- docs
def test_docs_name_what_this_guard_expects() -> None:
    names = {dotted for _, dotted in DOCUMENTED}
    # the parser reads both forms: an import line of a README example and a dotted name in prose
    assert "hicache_obs.exporters.sinkhost.add_sink_host" in names
    assert "hicache_obs.lab.testing.FAULTS" in names
    assert len(names) >= 20, sorted(names)


@pytest.mark.parametrize(("doc", "dotted"), DOCUMENTED, ids=[f"{d}:{n}" for d, n in DOCUMENTED])
def test_documented_name_imports_from_the_documented_path(doc: str, dotted: str) -> None:
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
    from hicache_obs.events.schema import EVENT_TYPES, TensorRef

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
