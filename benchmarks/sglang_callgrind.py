"""The SGLang profiles' cost counted by callgrind: the same figure in every run.

Run by a Python that has SGLang (``make sglang``), with valgrind and a C compiler:

    .sglang/0.5.23/bin/python benchmarks/sglang_callgrind.py [--profiles metrics audit] > cg.json
    .sglang/0.5.23/bin/python benchmarks/sglang_callgrind.py --profiles metrics --leave-out copy record
    .sglang/0.5.23/bin/python benchmarks/sglang_callgrind.py --profiles metrics --by-code
    .sglang/0.5.23/bin/python benchmarks/sglang_callgrind.py --profiles metrics --opcodes

``hicache-obs bench``'s ``sglang.profiles`` measure times the controller thread, and on a
shared 2-core machine its medians move by a few hundredths from run to run: a change worth
1 % cannot be seen there. This script runs the same workload (SGLang's hybrid tree cache,
write-through, serving the bench's 144-request plan with its copies on a worker thread,
into a log with the bench's sink host) once bare and once per profile, each in its own
child under ``valgrind --tool=callgrind --cache-sim=yes``, all children at once. Only the
serving of the plan is counted, and only on the controller's thread: the children build
the tree and warm it up first, then turn counting on and off through callgrind's client
requests (a small library compiled here from valgrind's ``callgrind.h``).

It prints one JSON object: per kind the controller thread's instructions (``Ir``), its
level-1 and last-level cache misses, and ``cycles``, callgrind's estimate
``Ir + 10 * (L1 misses) + 100 * (last-level misses)``; per profile ``ratio``, its cycles over
bare's, and ``per_op_instructions``, the instructions it adds to an operation; with
``--by-code``, ``per_op_instructions_by_code``: the same split by the code that ran them
(:data:`CODE`), from each function's own instructions (``callgrind_annotate``).
``--keep DIR`` copies each run's dump into ``DIR`` (``bare.callgrind``, ``metrics.callgrind``,
...), for ``callgrind_annotate`` to say which functions the added instructions ran in.
``--opcodes`` counts, instead of instructions, the bytecode steps the controller's thread
runs in each Python function (``sys.settrace`` opcode events, no valgrind): per profile
``per_op_opcodes``, ``per_op_calls`` and ``by_function``, what each function adds to an
operation, most first. Two runs on
one tree give the same instructions within about 0.2 %, however busy the machine: the log
hands events to the sink host every 25 events (about what a real serving's 50 ms cadence
gives), never on time. The estimate leaves out what a real CPU's branch predictors,
prefetchers and other threads do, and the pools' occupancy, which a real run reads about 6
times (every 50 ms of wall time; valgrind's slowdown would multiply that); the thread-time measure of ``hicache-obs bench --section sglang`` stays the
one the targets are judged on.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HELPER = r"""
#include <valgrind/callgrind.h>
void counting_on(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void counting_off(void) { CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""
KINDS = ("bare", "metrics", "audit", "sampling")
#: what ``--leave-out`` can make a pass-through in a ``metrics`` run, to count what it costs
PARTS = {
    "copy": "the copy hook (and with it the copies' tensors, their descriptions and the watch)",
    "watch": "the conversion watch of a copy",
    "record": "the record_stream observer",
    "queues": "the queue and ack hooks",
    "move": "the op-level move hook",
    "events": "the log's emit (the hooks still make the events' fields)",
}
#: what ``--by-code`` splits an operation's added instructions into, by the code that ran them
CODE = {
    "bytecode": "CPython's bytecode loop (Python/ceval.c): the steps of Python functions, and their calls",
    "cpython": "the rest of CPython: calls, attribute and dict lookups, objects made and freed",
    "memory": "CPython's object allocator and garbage collector",
    "hicache_obs_c": "this project's compiled pieces (_slots, _logcore, _copy)",
    "msgspec": "msgspec: the events encoded for the sink host, the event structs made",
    "torch": "torch: its Python bindings (tensor reads) and kernels",
    "other": "everything else (libc, the loader, other extension modules)",
}
_FUNCTION_LINE = re.compile(r"^\s*([\d,]+)\s.*?\s(\S+?):(.+?)(?: \[(.+)\])?\s*$")
_CPYTHON_SOURCE = re.compile(r"/(Include|Objects|Python|Modules|Parser)/")
OPS_LINE = "hicache-callgrind-ops"  # an instrumented child's count of the operations it served
OPCODES_LINE = "hicache-callgrind-opcodes"  # a child's steps and calls per function (--opcodes)
_ROOT = str(Path(__file__).resolve().parents[1]) + os.sep
# The log hands events to the sink host every 50 ms of wall time (or 256 events): about every
# 25 events in a real serving of the plan (some 350 events in about 0.7 s), about every event
# under valgrind's slowdown, and as often as the machine is busy. Counted, it hands off every
# 25 events and never on time: the count stays the same, and the hand-offs as many as a real
# serving makes.
HANDOFF_BATCH = 25
HANDOFF_NEVER_ON_TIME = 3600.0  # seconds: the longest interval the log takes


def _build_helper(where: Path) -> Path:
    """The client-request library, compiled into ``where``."""
    src, lib = where / "counting.c", where / "libcounting.so"
    src.write_text(HELPER)
    cc = os.environ.get("CC", "cc")
    done = subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"sglang_callgrind: {cc} could not build the client-request library: {done.stderr.strip()}")
    return lib


def _leave_out(part: str) -> None:
    """Make ``part`` (of :data:`PARTS`) a pass-through in the adapter, before it is attached."""
    from hicache_obs.integrations.sglang._adapter import Instrumentation, _ConversionWatch

    def same(original: Any) -> Any:
        return original

    # a diagnostic of the adapter's own parts: it replaces their private builders
    if part == "copy":
        Instrumentation._copy_wrapper = lambda self, pool, host_pool: same  # type: ignore[method-assign]  # noqa: SLF001
    elif part == "watch":
        _ConversionWatch.METHODS = ()  # no observer placed
    elif part == "queues":
        Instrumentation._swap_list = lambda self, obj, attr, observed: None  # type: ignore[method-assign]  # noqa: SLF001
    elif part == "move":
        Instrumentation._move_wrapper = lambda self, takes_op: same  # type: ignore[method-assign]  # noqa: SLF001


def function_name(code: Any) -> str:
    """``path:qualified name`` of a code object, its path below ``site-packages`` or this
    repository where it lies there."""
    path = code.co_filename
    if "site-packages" + os.sep in path:
        path = path.split("site-packages" + os.sep, 1)[1]
    elif path.startswith(_ROOT):
        path = path[len(_ROOT) :]
    return f"{path}:{code.co_qualname}"


class OpcodeCount:
    """The bytecode steps and calls of each Python function run on the thread that starts
    it, while it runs (``sys.settrace`` with opcode events: some 50 times slower)."""

    def __init__(self) -> None:
        self.steps: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._names: dict[Any, str] = {}

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        name = self._names.get(code)
        if name is None:
            name = self._names[code] = function_name(code)
        if event == "opcode":
            self.steps[name] += 1
        elif event == "call":
            self.calls[name] += 1
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
        return self._trace

    def __enter__(self) -> OpcodeCount:
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(None)


def added_by_function(
    profile: dict[str, list[int]], bare: dict[str, list[int]], ops: int
) -> list[tuple[str, float, float]]:
    """``(function, steps, calls)`` that ``profile``'s count adds to bare's, per operation, each
    function whose steps or calls differ, most steps first."""
    out = []
    for name in profile.keys() | bare.keys():
        steps = profile.get(name, [0, 0])[0] - bare.get(name, [0, 0])[0]
        calls = profile.get(name, [0, 0])[1] - bare.get(name, [0, 0])[1]
        if steps or calls:
            out.append((name, round(steps / ops, 1), round(calls / ops, 2)))
    return sorted(out, key=lambda t: (-t[1], t[0]))


def _child(
    kind: str, lib: Path | None, audit_sample: float, leave_out: str | None = None, opcodes: bool = False
) -> None:
    """Serve the plan once, counted, under ``kind`` (run inside valgrind, or with ``opcodes``
    under :class:`OpcodeCount`), with ``leave_out`` (of :data:`PARTS`) a pass-through."""
    import torch

    from hicache_obs.core._spec import ModelSpec
    from hicache_obs.events._log import EventLog
    from hicache_obs.events._schema import OperationQueued, OpsSubmitted
    from hicache_obs.exporters.sinkhost import add_sink_host
    from hicache_obs.integrations.sglang import _adapter, instrument
    from hicache_obs.lab.bench import _conversation_plan, _sglang_sink_specs
    from hicache_obs.lab.sglang import deferred
    from hicache_obs.lab.sglang.deferred import cuda_semantics
    from hicache_obs.lab.sglang.harness import prepare
    from hicache_obs.lab.sglang.tree import build_hybrid_tree

    # The pools' occupancy rides on a submission every 50 ms of wall time: about 6 times in a
    # real serving of the plan, some 40 times as often under valgrind's slowdown, and as
    # often as the machine is slow. Not during the counted serving: the count stays the same.
    _adapter.POOLS_EVERY_NS = 1 << 62
    # A wait of the controller's thread for its copies wakes when they ran, and every
    # deferred.WAKE_S of wall time to look for a failed copy: some 0.1 s, which valgrind's
    # slowdown makes a few copies long, so the count would grow with the machine's load.
    # Counted, a wait wakes when its copies ran, as at full speed.
    deferred.WAKE_S = 30.0
    if leave_out is not None:
        _leave_out(leave_out)
    counting = ctypes.CDLL(str(lib)) if lib is not None else None
    prepare("cpu")
    spec = ModelSpec.tiny_hybrid()
    plan = _conversation_plan(144, 8, spec.page_size)

    def build() -> Any:
        th = build_hybrid_tree(
            spec, io_backend="kernel", layout="page_first", write_policy="write_through",
            device_size=24 * spec.page_size, host_ratio=4.0,
        )  # fmt: skip
        th.without_data()
        return th

    def serve(th: Any) -> None:
        for toks in plan:
            torch.cpu.synchronize()
            th.serve(toks)
        torch.cpu.synchronize()
        th.step()

    out_dir = Path(tempfile.mkdtemp(prefix="hicache-callgrind-"))
    with cuda_semantics(worker=True):
        warm = build()
        serve(warm)
        warm.harness.close()
        th = build()
        log = EventLog(capacity=1_000_000)
        inst = None
        if kind != "bare":
            add_sink_host(log, _sglang_sink_specs(out_dir), batch=HANDOFF_BATCH, interval=HANDOFF_NEVER_ON_TIME)
            inst = instrument(
                th.controller, log=log, profile=kind, audit_sample=audit_sample if kind == "sampling" else None
            )
            if leave_out == "events":
                log.emit = lambda *args, **fields: None  # type: ignore[method-assign]
            elif leave_out == "record":
                torch.Tensor.record_stream = torch.Tensor.record_stream.__wrapped__  # type: ignore[attr-defined]
        gc.collect()
        gc.freeze()
        if counting is not None:
            counting.counting_on()
            serve(th)
            counting.counting_off()
        else:
            with OpcodeCount() as count:
                serve(th)
            steps = {name: [count.steps[name], count.calls[name]] for name in count.steps.keys() | count.calls.keys()}
            print(f"{OPCODES_LINE} {json.dumps(steps)}", flush=True)
        if inst is not None:
            served = log.events()
            inst.detach()
            if inst.errors:
                raise SystemExit(f"sglang_callgrind: {inst.errors} steps of the {kind} run not observed")
            if leave_out is not None:  # its events may be missing: the full run says how many operations
                inst = None
        if inst is not None:
            ops = sum(len(e.queued) if type(e) is OpsSubmitted else type(e) is OperationQueued for e in served)
            print(f"{OPS_LINE} {ops}", flush=True)
        log.close()
        th.harness.close()
    shutil.rmtree(out_dir, ignore_errors=True)


def code_of(source: str, function: str, obj: str, python: str) -> str:
    """Which :data:`CODE` group a function's own instructions belong to: ``source`` and
    ``obj`` as ``callgrind_annotate`` names them (``obj`` empty for code inlined into
    another function), ``python`` the interpreter's executable (a static CPython's
    functions lie in it)."""
    where = f"{source} {obj}"
    # by file as well as by name: an optimized CPython's build places parts of the loop where
    # the debug information names another function of ceval.c (_PyObject_MakeTpCall)
    if function.startswith("_PyEval_EvalFrameDefault") or source.endswith("Python/ceval.c"):
        return "bytecode"
    if "/msgspec/" in where:
        return "msgspec"
    if "/torch/" in where:
        return "torch"
    if re.search(r"hicache_obs/_(slots|logcore|copy)[.c]", where):
        return "hicache_obs_c"
    if os.path.basename(source) in ("obmalloc.c", "gcmodule.c"):
        return "memory"
    name = os.path.basename(obj)
    if name.startswith("libpython") or (obj and obj == python) or (not obj and _CPYTHON_SOURCE.search(source)):
        return "cpython"
    return "other"


def by_code(annotated: str, python: str) -> dict[str, int]:
    """The instructions of ``callgrind_annotate --threshold=100 --auto=no`` output, summed
    per :data:`CODE` group (every function's own count, once)."""
    out = dict.fromkeys(CODE, 0)
    table = False
    for line in annotated.splitlines():
        if "file:function" in line:
            table = True
            continue
        if not table or "PROGRAM TOTALS" in line:
            continue
        m = _FUNCTION_LINE.match(line)
        if m is None:
            continue
        count, source, function, obj = m.groups()
        out[code_of(source, function, obj or "", python)] += int(count.replace(",", ""))
    return out


def _annotated(dump: Path) -> str:
    done = subprocess.run(
        ["callgrind_annotate", "--threshold=100", "--auto=no", str(dump)], capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"sglang_callgrind: callgrind_annotate failed on {dump}: {done.stderr.strip()}")
    return done.stdout


def _summary(path: Path) -> dict[str, int]:
    """The event totals of a callgrind dump."""
    names: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith("summary:"):
            return dict(zip(names, (int(v) for v in line.split()[1:])))
    raise SystemExit(f"sglang_callgrind: {path} has no summary line")


def _kinds(args: argparse.Namespace) -> list[str]:
    """The runs to count: bare, each profile, and ``metrics`` with each part left out."""
    return ["bare", *args.profiles, *(f"metrics-without-{part}" for part in args.leave_out)]


def _child_env() -> dict[str, str]:
    """A child's environment: this one's, with the same hash seed in every run, no warnings."""
    return {**os.environ, "PYTHONHASHSEED": "0", "PYTHONWARNINGS": "ignore"}


def _count_opcodes(args: argparse.Namespace) -> dict[str, Any]:
    """``--opcodes``: each kind served in a child of its own, its Python steps counted."""
    kinds, env = _kinds(args), _child_env()
    started = time.monotonic()
    children = {}
    for kind in kinds:
        child, _, part = kind.partition("-without-")
        cmd = [sys.executable, __file__, "--opcodes", "--child", child, "--audit-sample", str(args.audit_sample)]
        cmd += ["--child-leaves-out", part] if part else []
        children[kind] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    counts: dict[str, dict[str, list[int]]] = {}
    ops: dict[str, int] = {}
    for kind, proc in children.items():
        stdout, stderr = proc.communicate()
        if proc.returncode:
            tail = stderr.splitlines()[-15:]
            raise SystemExit(f"sglang_callgrind: the {kind} run exited with {proc.returncode}:\n" + "\n".join(tail))
        for line in stdout.splitlines():
            if line.startswith(OPCODES_LINE + " "):
                counts[kind] = json.loads(line[len(OPCODES_LINE) + 1 :])
            elif line.startswith(OPS_LINE + " "):
                ops[kind] = int(line.split()[1])
        if kind not in counts:
            raise SystemExit(f"sglang_callgrind: the {kind} run printed no opcode count")
    out: dict[str, Any] = {"wall_s": round(time.monotonic() - started, 1)}
    for kind in kinds:
        out[kind] = {
            "opcodes": sum(v[0] for v in counts[kind].values()),
            "calls": sum(v[1] for v in counts[kind].values()),
        }
    for kind in kinds[1:]:
        n = ops.get(kind) or ops.get("metrics")
        if not n:
            raise SystemExit(f"sglang_callgrind: the {kind} run did not say how many operations it served")
        out[kind]["ops"] = n
        out[kind]["per_op_opcodes"] = round((out[kind]["opcodes"] - out["bare"]["opcodes"]) / n, 1)
        out[kind]["per_op_calls"] = round((out[kind]["calls"] - out["bare"]["calls"]) / n, 2)
        out[kind]["by_function"] = added_by_function(counts[kind], counts["bare"], n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", nargs="+", default=["metrics", "audit"], choices=KINDS[1:])
    ap.add_argument("--audit-sample", type=float, default=0.01, help="the sampling profile's share")
    ap.add_argument(
        "--leave-out",
        nargs="+",
        default=[],
        choices=sorted(PARTS),
        metavar="PART",
        help="also count metrics with each PART a pass-through: " + "; ".join(f"{k}: {v}" for k, v in PARTS.items()),
    )
    ap.add_argument(
        "--by-code",
        action="store_true",
        help="also split each profile's added instructions by the code that ran them: "
        + "; ".join(f"{k}: {v}" for k, v in CODE.items()),
    )
    ap.add_argument(
        "--opcodes",
        action="store_true",
        help="count each Python function's bytecode steps on the controller's thread instead (no valgrind)",
    )
    ap.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="copy each run's dump of the controller's thread into DIR (KIND.callgrind), to read with callgrind_annotate",
    )
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--child-leaves-out", choices=sorted(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--lib", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, None if args.opcodes else args.lib, args.audit_sample, args.child_leaves_out, args.opcodes)
        return
    if args.leave_out and "metrics" not in args.profiles:
        args.profiles.append("metrics")  # what a part's count is read against
    if args.opcodes:
        if args.keep:
            raise SystemExit("sglang_callgrind: --keep keeps callgrind's dumps; --opcodes makes none")
        if args.by_code:
            raise SystemExit("sglang_callgrind: --by-code splits callgrind's instructions; --opcodes counts none")
        print(json.dumps(_count_opcodes(args), indent=1))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("sglang_callgrind: valgrind is not installed (Debian: apt-get install valgrind)")
    work = Path(tempfile.mkdtemp(prefix="hicache-callgrind-"))
    try:
        lib = _build_helper(work)
        kinds, env = _kinds(args), _child_env()
        started = time.monotonic()
        children = {}
        for kind in kinds:
            child, _, part = kind.partition("-without-")
            cmd = [
                "valgrind", "--tool=callgrind", "--instr-atstart=no", "--cache-sim=yes", "--separate-threads=yes",
                f"--callgrind-out-file={work}/{kind}.%p", sys.executable, __file__, "--child", child,
                "--lib", str(lib), "--audit-sample", str(args.audit_sample),
                *(["--child-leaves-out", part] if part else []),
            ]  # fmt: skip
            log = open(work / f"{kind}.log", "w")
            children[kind] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
        for kind, (proc, log) in children.items():
            rc = proc.wait()
            log.close()
            if rc:
                tail = (work / f"{kind}.log").read_text().splitlines()[-15:]
                raise SystemExit(f"sglang_callgrind: the {kind} run exited with {rc}:\n" + "\n".join(tail))
        out: dict[str, Any] = {"wall_s": round(time.monotonic() - started, 1)}
        codes: dict[str, dict[str, int]] = {}
        python = os.path.realpath(sys.executable)
        for kind, (proc, _) in children.items():
            dumps = sorted(work.glob(f"{kind}.{proc.pid}.1-01"))  # the counted serving, the controller's thread
            if not dumps:
                raise SystemExit(f"sglang_callgrind: no dump of the {kind} run's controller thread in {work}")
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(dumps[0], args.keep / f"{kind}.callgrind")
            s = _summary(dumps[0])
            l1 = s.get("I1mr", 0) + s.get("D1mr", 0) + s.get("D1mw", 0)
            ll = s.get("ILmr", 0) + s.get("DLmr", 0) + s.get("DLmw", 0)
            out[kind] = {"Ir": s["Ir"], "l1_misses": l1, "ll_misses": ll, "cycles": s["Ir"] + 10 * l1 + 100 * ll}
            if args.by_code and not kind.partition("-without-")[2]:
                codes[kind] = by_code(_annotated(dumps[0]), python)
        for kind in args.profiles:
            said = [ln.split()[1] for ln in (work / f"{kind}.log").read_text().splitlines() if ln.startswith(OPS_LINE)]
            if not said or not int(said[-1]):
                raise SystemExit(f"sglang_callgrind: the {kind} run did not say how many operations it served")
            ops = int(said[-1])  # writes plus loads queued, as the bench counts them
            out[kind]["ops"] = ops
            out[kind]["ratio"] = round(out[kind]["cycles"] / out["bare"]["cycles"], 4)
            out[kind]["per_op_instructions"] = round((out[kind]["Ir"] - out["bare"]["Ir"]) / ops)
            if args.by_code:
                out[kind]["per_op_instructions_by_code"] = {
                    code: round((codes[kind][code] - codes["bare"][code]) / ops) for code in CODE
                }
        for part in args.leave_out:
            kind, ops = f"metrics-without-{part}", out["metrics"]["ops"]
            out[kind]["per_op_instructions"] = round((out[kind]["Ir"] - out["bare"]["Ir"]) / ops)
            # what the part adds to a metrics operation
            out[kind]["part_per_op_instructions"] = round((out["metrics"]["Ir"] - out[kind]["Ir"]) / ops)
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
