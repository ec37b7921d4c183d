"""The controller's parts: each concept in its module, and the units the split exposes.

``core/controller.py`` is the facade (the lock, the queues, the public methods); index
normalisation lives in ``index_moves``, multi-pool allocation in ``allocation``, tensor
descriptions in ``describe``, the launches in ``submission`` and the hybrid controller in
``hybrid``. The first tests hold that layout by reading the modules' code (what each one
calls and defines, and that none imports another's private names); the others exercise
the units directly, each result checked against the events and tables it leaves.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hicache_obs.core as core_pkg
from hicache_obs.core import CacheOperation, HybridCacheController, PoolTransfer
from hicache_obs.core._allocation import PoolAllocations, resolve_aliases, resolve_allocated
from hicache_obs.core._describe import describe, dtype_name
from hicache_obs.core._index_moves import IndexNormaliser
from hicache_obs.core._submission import index_pairs, slots_by_pool
from hicache_obs.errors import UnresolvedTransferError
from hicache_obs.events import IndicesMoved, SlotsAllocated, SlotsFreed, expand_runs, fold

CORE = Path(core_pkg.__file__).resolve().parent
#: the package's modules, by concept (``core/_<name>.py``; the modules without ``_`` are
#: old import paths that forward here)
MODULES = sorted(p.stem[1:] for p in CORE.glob("_*.py") if p.stem != "__init__")
PARTS = (
    "controller", "hybrid", "index_moves", "allocation", "describe", "submission", "acks", "closing", "reports", "admission",
)  # fmt: skip

#: calls that do one concept's work -> the one module (of PARTS) allowed to make them
CONCEPT_CALLS = {
    "argsort": "index_moves",  # the direct backend's pair sort
    "TensorRef": "describe",
    "plain_tensor_calls": "describe",
    "launch_backup": "submission",
    "launch_load_layer": "submission",
    "launch_load_all": "submission",
    "check_kernel_indices": "submission",
    "host_pair_runs": "submission",
    "runs_for_copy": "submission",
    "unallocated": "allocation",  # which of a failed op's slots are still allocated
    "settle": "acks",  # whether an op in flight is done, and how it failed
    "durations": "acks",
    "end_every_op": "controller",  # close(): the one caller
    "record_stream": "reports",  # a stream record the runtime then reports
    "check_request": "admission",  # a write's or load's checks, allocation and op
    "check_transfers": "admission",
    "resolve_allocated": "admission",
    "resolve_aliases": "admission",
    "DevicePool": "pools",  # a controller's pools are made by pools.make_pools
    "HostPool": "pools",
}


def _tree(module: str) -> ast.Module:
    return ast.parse((CORE / f"_{module}.py").read_text(encoding="utf-8"))


def _called_names(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
    return out


def _keyword_constants(tree: ast.AST, keyword: str) -> set[object]:
    return {
        kw.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for kw in node.keywords
        if kw.arg == keyword and isinstance(kw.value, ast.Constant)
    }


@pytest.mark.parametrize("module", PARTS)
def test_each_concepts_calls_are_made_in_its_own_module_only(module: str) -> None:
    called = _called_names(_tree(module))
    misplaced = sorted(
        f"{name} (belongs in {home})" for name, home in CONCEPT_CALLS.items() if name in called and home != module
    )
    assert misplaced == [], f"core/_{module}.py makes another part's calls: {misplaced}"


def test_each_concept_module_makes_its_concepts_calls() -> None:
    """The layout table above is about code that exists: every call is made in its part."""
    for name, home in CONCEPT_CALLS.items():
        assert name in _called_names(_tree(home)), f"core/{home}.py no longer calls {name}: update CONCEPT_CALLS"


def test_only_the_allocation_module_rolls_back_or_frees_failed_slots() -> None:
    for module in PARTS:
        reasons = _keyword_constants(_tree(module), "reason") & {"rollback", "failed"}
        assert reasons == ({"rollback", "failed"} if module == "allocation" else set()), module


def test_the_controller_defines_no_normalisation_allocation_or_description() -> None:
    tree = _tree("controller")
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    gone = {
        "_move_checked", "_move", "_move_hybrid", "_alloc_many", "_rollback", "_free_given",
        "_resolve_allocated", "_materialise_aliases", "_ref", "_submit_refs", "_pairs", "_runs_for",
        "_slots_by_pool", "IndexPair", "_Expected", "HybridCacheController",
        "_reap", "_end_unstarted", "_device_sizes", "_admit", "_check_transfers",
    }  # fmt: skip
    assert defined & gone == set()
    assert [n.name for n in tree.body if isinstance(n, ast.ClassDef)] == ["HiCacheController"]


def _uses_of(name: str) -> list[str]:
    """``module:function`` (the innermost one) of every use of ``name`` in core/ but its imports."""
    out: list[str] = []

    def visit(node: ast.AST, module: str, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, module, child.name)
            elif isinstance(child, ast.Name) and child.id == name:
                out.append(f"{module}:{where}")
            else:
                visit(child, module, where)

    for module in MODULES:
        visit(_tree(module), module, "<module>")
    return out


def _strings(module: str) -> set[str]:
    return {n.value for n in ast.walk(_tree(module)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_only_the_closing_module_ends_ops_at_close() -> None:
    """The errors of the ops ``close()`` ends are written in ``closing`` only."""
    marks = ("ended at close", "closed before this op started")
    where = {m: sorted(m2 for m2 in MODULES if any(m in t for t in _strings(m2))) for m in marks}
    assert where == {m: ["closing"] for m in marks}


def test_one_place_builds_every_transfer_submitted() -> None:
    """Launched or not (an index move that refused, a set-up that raised, an op cancelled at
    close), an op's ``TransferSubmitted`` is built in ``Submissions.submitted`` only."""
    assert _uses_of("TransferSubmitted") == ["submission:submitted"]


def test_only_the_runtimes_reports_emit_stream_records_and_index_moves() -> None:
    assert (_uses_of("StreamRecorded"), _uses_of("IndicesMoved")) == (["reports:recorded"], ["reports:moved"])


@pytest.mark.parametrize("module", MODULES)
def test_no_core_module_imports_another_ones_private_names(module: str) -> None:
    """(The package's own private modules, ``.._native``, are its shared seams.)"""
    private = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.ImportFrom) and node.level == 1  # a sibling in core/
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == [], f"core/_{module}.py imports private names {private}"


def test_each_part_imports_on_its_own_first() -> None:
    """Any one of the modules can be the first imported (the hybrid one imports the
    controller, which re-exports it): one fresh import of each, in one interpreter."""
    program = textwrap.dedent(
        f"""
        import importlib, sys
        import torch  # noqa: F401  (kept between rounds: only the package is imported anew)
        for name in {PARTS!r}:
            for m in [m for m in sys.modules if m == "hicache_obs" or m.startswith("hicache_obs.")]:
                del sys.modules[m]
            mod = importlib.import_module("hicache_obs.core._" + name)
            from hicache_obs.core._controller import HybridCacheController
            from hicache_obs.core import HybridCacheController as again
            assert HybridCacheController is again, name
            print(name, mod.__name__)
        """
    )
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [w for name in PARTS for w in (name, f"hicache_obs.core._{name}")]


def test_the_hybrid_controller_lives_in_its_module_and_is_exported_from_the_old_paths() -> None:
    from hicache_obs.core import _controller as controller
    from hicache_obs.core import _hybrid as hybrid

    assert HybridCacheController.__module__ == "hicache_obs.core._hybrid"
    assert controller.HybridCacheController is hybrid.HybridCacheController is core_pkg.HybridCacheController
    assert "HybridCacheController" in controller.__all__


# ------------------------------------------------------------------ allocation


def _tiers(c):
    return lambda pool, tier: (c.host_pool(pool) if tier == "host" else c.device_pool(pool)).allocator


def test_a_shortage_in_the_last_pool_rolls_back_every_earlier_one_in_reverse(make_controller) -> None:
    c = make_controller(spec="tiny_hybrid", runtime="cpu", device_size=64)
    allocations = PoolAllocations(_tiers(c))
    free = c.device_pool("mamba").allocator.available()
    n = len(c.log)
    got = allocations.take([("kv", "host", 32), ("mamba", "host", 2), ("mamba", "device", free + 1)], op=41)
    assert got is None
    evs = c.log.events()[n:]
    assert [(type(e).__name__, e.pool, e.tier) for e in evs] == [
        ("SlotsAllocated", "kv", "host"),
        ("SlotsAllocated", "mamba", "host"),
        ("AllocationFailed", "mamba", "device"),
        ("SlotsFreed", "mamba", "host"),  # the last taken is given back first
        ("SlotsFreed", "kv", "host"),
    ]
    taken = {(e.pool, e.tier): e.indices for e in evs if isinstance(e, SlotsAllocated)}
    freed = [e for e in evs if isinstance(e, SlotsFreed)]
    assert all(e.reason == "rollback" and e.op == 41 and e.indices == taken[e.pool, e.tier] for e in freed)
    assert allocations.given(41) == ()
    assert {k: t.used for k, t in c.state.tables.items()} == {k: 0 for k in c.state.tables}
    assert fold(c.log.events()).snapshot() == c.state.snapshot()


def test_what_an_op_was_given_follows_it_through_a_merge_and_frees_only_whats_left(make_controller) -> None:
    c = make_controller(spec="tiny_hybrid", runtime="cpu", device_size=64)
    allocations = PoolAllocations(_tiers(c))
    a = allocations.take([("kv", "host", 16), ("mamba", "host", 2)], op=1)
    b = allocations.take([("kv", "host", 16)], op=2)
    assert a is not None and b is not None
    allocations.merge(3, [1, 2])
    assert allocations.given(1) == allocations.given(2) == ()
    given = allocations.pop(3)
    assert [(p, t, s.tolist()) for p, t, s in given] == [
        ("kv", "host", a[0].tolist()), ("mamba", "host", a[1].tolist()), ("kv", "host", b[0].tolist()),
    ]  # fmt: skip
    c.evict_host(a[0])  # the caller already freed part of what op 1 had
    n = len(c.log)
    allocations.free_failed(3, given)
    freed = c.log.events()[n:]
    assert [(type(e).__name__, e.pool, e.reason, e.op) for e in freed] == [
        ("SlotsFreed", "mamba", "failed", 3),
        ("SlotsFreed", "kv", "failed", 3),
    ]
    assert expand_runs(freed[1].indices) == b[0].tolist()  # not a[0]'s again: no double free
    assert {k: t.used for k, t in c.state.tables.items()} == {k: 0 for k in c.state.tables}


def test_resolving_fills_the_allocated_side_and_aliases_per_op() -> None:
    own = PoolTransfer("swa", device_indices=torch.tensor([4, 5]))
    alias = PoolTransfer("mamba", indices_from_pool="kv")
    resolved = resolve_allocated((own, alias), [torch.tensor([9, 8])], "host")
    assert resolved is not None
    assert resolved[0].host_indices.tolist() == [9, 8] and resolved[0].device_indices is own.device_indices
    assert resolved[1] is alias
    host, device = torch.tensor([1, 2, 3]), torch.tensor([7, 6, 5])
    out = resolve_aliases(host, device, resolved)
    assert out is not None and out[1].host_indices is host and out[1].device_indices is device
    assert own.host_indices is None, "the caller's transfer is unchanged"


# ------------------------------------------------------------------ index moves


def test_the_direct_layer_first_normaliser_sorts_host_indices_and_keeps_the_pairs(make_controller) -> None:
    c = make_controller(spec="tiny", runtime="cpu", io_backend="direct", layout="layer_first")
    host, device = c.move_indices(torch.tensor([48, 0, 16, 32]), torch.tensor([1, 2, 3, 4]))
    assert (host.tolist(), device.tolist()) == ([0, 16, 32, 48], [2, 3, 4, 1])


def test_a_move_is_reported_only_for_the_controllers_own_normaliser(make_controller) -> None:
    """The runtime's report of a copy becomes an ``IndicesMoved`` only when the controller's
    own normaliser made it: the normaliser emits nothing, another one's move is not ours."""
    c = make_controller(spec="tiny", runtime="sim", io_backend="kernel")
    dev = c.alloc_device(16)
    assert dev is not None
    host = torch.arange(16, 32)
    n = len(c.log)
    other = IndexNormaliser(c.runtime, "kernel", "layer_first", read_runs=True)
    moved_host, _ = other.normalise(host, dev, 5, "kv")
    assert c.runtime.is_device(moved_host) and other.expected is None
    assert c.log.events()[n:] == []
    moved_host, _ = c.move_indices(host, dev, op=5)
    (ev,) = c.log.events()[n:]
    assert isinstance(ev, IndicesMoved)
    assert (ev.op, ev.pool, ev.role, ev.src_device, ev.dst_device) == (5, "kv", "host", "cpu", c.runtime.device)
    assert expand_runs(ev.tensor.indices) == list(range(16, 32))  # read before the move: the values are known


# ------------------------------------------------------------------ descriptions and submission


def test_describe_reads_cpu_values_and_never_a_device_tensors(make_controller) -> None:
    c = make_controller(spec="tiny", runtime="sim")
    cpu = describe(c.runtime, torch.tensor([3, 4, 5, 9]), "kv", "host")
    assert (cpu.device, cpu.numel, cpu.dtype, expand_runs(cpu.indices)) == ("cpu", 4, "int64", [3, 4, 5, 9])
    dev = c.runtime.to_device(torch.tensor([3, 4]))
    ref = describe(c.runtime, dev, "kv", "device")
    assert (ref.device, ref.numel, ref.indices) == (c.runtime.device, 2, None)
    assert describe(c.runtime, torch.tensor([1]), "kv", "host", ()).indices is None  # () means: none to report
    assert (dtype_name(torch.int32), dtype_name(torch.bfloat16)) == ("int32", "bfloat16")


def test_an_ops_pairs_and_slots_follow_its_transfers() -> None:
    h, d = torch.arange(16), torch.arange(16, 32)
    alias = PoolTransfer("mamba", indices_from_pool="kv")
    op = CacheOperation(host_indices=h, device_indices=d, id=7, pool_transfers=(alias,))
    assert slots_by_pool(op) == (("kv", 16), ("mamba", 16))  # an unresolved alias moves its source's count
    with pytest.raises(UnresolvedTransferError, match=r"pool transfer 'mamba' of op 7 reached submission"):
        index_pairs(op, _cpu_runtime())
    resolved = op.replace(pool_transfers=(alias.with_indices(h[:2], d[:2]),))
    pairs = index_pairs(resolved, _cpu_runtime())
    assert [(p.pool, p.runs) for p in pairs] == [("kv", ((0, 16, 16),)), ("mamba", ((0, 16, 2),))]


def _cpu_runtime():
    from hicache_obs.core import make_runtime

    return make_runtime("cpu")
