"""Probes of the C extensions, run in a child interpreter so that a crash is seen, not suffered.

``run_code(src)`` runs a snippet in a fresh interpreter that imports this tree;
``run_probes(kind, probes)`` sends a batch of probes (JSON) to this file run as a
script, which calls the entry points one by one, printing ``probe <i>`` before and
``ok <i> <outcome>`` after each: a child killed by a signal (or stopped by a sanitizer)
names the probe it died on. The child inherits the environment, so under ``make
sanitize`` (``LD_PRELOAD`` of the sanitizer runtimes) the children are checked too.

The probes' own checks, in the child (a failed one is ``FAIL <i> <why>`` on stdout):

- ``copy``: ``copy_runs`` on real buffers sized to the declared planes, with guard
  bytes after each: a call either raises and changes no byte, or copies exactly what a
  Python reference copy does and leaves the guards alone. Probes with addresses that
  are not real (0, negative, past 2^64, near the top) always carry a run outside the
  planes: they must raise before touching memory.
- ``slots``: ``SlotMap`` methods, ``runs_of``, ``pair_runs_of``, ``side_runs`` with
  hostile values; a result must be well formed (runs of positive length), an error a
  ``TypeError``/``ValueError``/``OverflowError``/``RuntimeError``.
- ``logcore``: a ``LogCore`` bound to plain lists, with its counters set to hostile
  values, its ring resized, hostile event classes and subscribers; ``gap_free_run`` on
  hostile lists. Every event appended carries the seq it was given, seqs stay gap-free.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import hicache_obs

TREE = str(Path(hicache_obs.__file__).resolve().parent.parent)
KIT = str(Path(__file__).resolve())
EXPECTED = (TypeError, ValueError, OverflowError, RuntimeError, KeyError, AttributeError, MemoryError)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TREE, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def run_code(src: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``src`` in a fresh interpreter that imports this tree (``-P``: not the one in the working directory)."""
    return subprocess.run(
        [sys.executable, "-P", "-c", src], capture_output=True, text=True, timeout=timeout, env=_env(), check=False
    )


def crashed(proc: subprocess.CompletedProcess[str]) -> bool:
    """Killed by a signal, or stopped by a sanitizer report."""
    return proc.returncode < 0 or "Sanitizer" in proc.stderr or "runtime error:" in proc.stderr


#: ``show(fn, *args)`` in a child: prints the result's repr, or the error's type and message
SHOW = """
def show(fn, *args):
    try:
        print(repr(fn(*args)))
    except (ValueError, TypeError, OverflowError, RuntimeError) as exc:
        print(type(exc).__name__, exc)
"""


def run_lines(src: str) -> list[str]:
    """Run ``src`` (after :data:`SHOW`) in a child that must neither crash nor fail; its output lines."""
    proc = run_code(SHOW + src)
    assert not crashed(proc), f"the child crashed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def run_probes(kind: str, probes: list[Any], timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run a batch of probes; returns the process and a description of what failed ('' if nothing)."""
    proc = subprocess.run(
        [sys.executable, KIT, kind],
        input=json.dumps(probes),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        check=False,
    )
    lines = proc.stdout.splitlines()
    fails = [ln for ln in lines if ln.startswith("FAIL ")]
    if crashed(proc) or proc.returncode != 0:
        started = [ln for ln in lines if ln.startswith("probe ")]
        last = int(started[-1].split()[1]) if started else -1
        probe = probes[last] if 0 <= last < len(probes) else None
        return proc, (
            f"the child died (rc {proc.returncode}) on probe {last}: {probe!r}\nstderr tail:\n{proc.stderr[-3000:]}"
        )
    if fails:
        i = int(fails[0].split()[1])
        return proc, f"{fails[0]}\nprobe: {probes[i]!r}"
    done = sum(1 for ln in lines if ln.startswith("ok "))
    if done != len(probes):
        return proc, f"only {done} of {len(probes)} probes reported\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc, ""


# ----------------------------------------------------------------- the child side
def _say(*parts: object) -> None:
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def _int(v: Any) -> Any:
    """JSON carries big ints as {"int": "123"} (some parsers round them)."""
    if isinstance(v, dict) and "int" in v:
        return int(v["int"])
    if isinstance(v, list):
        return [_int(x) for x in v]
    return v


FAKE = {"null": 0, "negative": -1, "top": 2**64 - 16, "beyond": 2**64 + 4096, "low": 4096}
REAL_LIMIT = 1 << 16


def _extent(slots: int, slot: int, layers: int, layer: int, chunk: int) -> int:
    return 0 if slots <= 0 else (slots - 1) * slot + (layers - 1) * layer + chunk


def _copy_probe(copy_runs: Any, p: dict[str, Any]) -> str:
    import ctypes
    from array import array

    g = [_int(x) for x in p["geometry"]]  # layers, chunk, dslots, dslot, dlayer, sslots, sslot, slayer
    layers, chunk, ds, dss, dls, ss, sss, sls = g
    runs = [_int(r) for r in p["runs"]]
    swap = bool(p["swap"])
    kind = p["addr"]
    ok_ints = all(isinstance(x, int) and -(2**63) <= x < 2**63 for x in [*g, *(v for r in runs for v in r)])
    flat = [v for r in runs for v in r]
    fmt = p.get("format", "q")
    try:
        packed: Any = array(fmt, flat) if fmt != "bytes" else bytes(array("q", flat))
    except (OverflowError, TypeError):  # values the format cannot hold: no runs, of int64
        packed, fmt, flat = array("q"), "q", []
    sane = ok_ints and min(layers, chunk, dss, dls, sss, sls) > 0 and min(ds, ss) >= 0
    dext = max(ds * dss, layers * dls) if sane else 0  # the bytes of a tensor with that layout
    sext = max(ss * sss, layers * sls) if sane else 0
    if kind in FAKE or not ok_ints:
        # 0, -1 and addresses past 2^64 are refused whatever else is given; an address near the
        # top only when its plane would pass 2^64; a plausible one (4096) is given a run outside
        # the planes too, so that no correct call can touch memory that is not there
        refused = kind in ("null", "negative", "beyond") or (
            kind == "top" and sane and ds > 0 and _extent(ds, dss, layers, dls, chunk) > 16
        )
        if not refused:
            fit = flat if all(-(2**63) <= v < 2**63 for v in flat) else []
            packed = array("q", [*fit, -1, 0, 1])
        addr = FAKE.get(kind, 4096)
        try:
            copy_runs(addr, 1 << 40, packed, swap, *g)
        except EXPECTED as exc:
            return type(exc).__name__
        return f"FAIL accepted a call at the fake address {addr:#x}"
    if dext > REAL_LIMIT or sext > REAL_LIMIT:
        return "skipped (too large for real buffers)"
    guard = 64
    pattern = bytes(range(1, 256))
    dst = bytearray((pattern * (1 + (dext + guard) // 255))[: dext + guard])
    src = bytearray((pattern[::-1] * (1 + (sext + guard) // 255))[: sext + guard])
    before_dst, before_src = bytes(dst), bytes(src)
    da = ctypes.addressof((ctypes.c_char * len(dst)).from_buffer(dst))
    sa = ctypes.addressof((ctypes.c_char * len(src)).from_buffer(src))
    try:
        copy_runs(da, sa, packed, swap, *g)
    except EXPECTED as exc:
        if bytes(dst) != before_dst or bytes(src) != before_src:
            return f"FAIL raised {type(exc).__name__} after changing bytes"
        return type(exc).__name__
    if bytes(src) != before_src:
        return "FAIL the source plane changed"
    if fmt not in ("q", "l") or array(fmt).itemsize != 8:
        return f"FAIL accepted runs of format {fmt!r}"
    expect = bytearray(before_dst)
    for r in zip(flat[0::3], flat[1::3], flat[2::3]):
        d, s, n = (r[1], r[0], r[2]) if swap else r
        for t in range(n):
            for lay in range(layers):
                do, so = (d + t) * dss + lay * dls, (s + t) * sss + lay * sls
                if do + chunk > dext or so + chunk > sext or do < 0 or so < 0:
                    return f"FAIL accepted a run that leaves the planes: {r}"
                expect[do : do + chunk] = before_src[so : so + chunk]
    if bytes(dst) != bytes(expect):
        where = next(i for i in range(len(dst)) if dst[i] != expect[i])
        return f"FAIL the copy differs from the reference at byte {where} of {dext} (+{guard} guard)"
    return "copied"


def _runs_ok(out: Any) -> bool:
    return isinstance(out, tuple) and all(isinstance(r, tuple) and r[-1] >= 1 for r in out)


def _slots_probe(mod: Any, p: dict[str, Any]) -> str:
    from array import array

    op = p["op"]
    args = _int(p["args"])
    try:
        if op == "map":
            cap, page, track = args[0], args[1], args[2]
            m = mod.SlotMap(cap, page, track)
            for name, arg in p["calls"]:
                arg = _int(arg)
                if name in ("apply_alloc", "apply_free", "unallocated"):
                    arg = [tuple(r) if isinstance(r, list) else r for r in arg] if isinstance(arg, list) else arg
                try:
                    out = getattr(m, name)(arg) if name not in ("free_order", "allocated_runs") else getattr(m, name)()
                except EXPECTED:
                    if name == "peek" and track and isinstance(arg, int) and 0 <= arg <= m.free_pages:
                        return f"FAIL peek({arg}) refused with {m.free_pages} free pages"
                    continue
                if name == "peek" and (not isinstance(arg, int) or arg < 0):
                    return f"FAIL peek({arg!r}) returned {out!r}"
                if not (0 <= m.used <= m.capacity and 0 <= m.free_pages):
                    return f"FAIL counters out of range: used {m.used}, free pages {m.free_pages}"
            return "map"
        if op == "runs_of":
            vals, fmt = args
            src: Any = vals if fmt == "list" else array(fmt, vals)
            out = mod.runs_of(src)
        elif op == "pair_runs_of":
            h, d, fmt = args
            out = mod.pair_runs_of(h if fmt == "list" else array(fmt, h), d if fmt == "list" else array(fmt, d))
        else:
            pairs, side = args
            out = mod.side_runs([tuple(r) if isinstance(r, list) else r for r in pairs], side)
        if not _runs_ok(out):
            return f"FAIL a malformed result {out!r}"
        return "runs"
    except EXPECTED as exc:
        return type(exc).__name__


class _Ev:
    __slots__ = ("seq", "ts_ns", "rank", "fields")

    def __init__(self, seq: int, ts_ns: int, rank: Any, **fields: Any) -> None:
        self.seq, self.ts_ns, self.rank, self.fields = seq, ts_ns, rank, fields


def _logcore_probe(mod: Any, p: dict[str, Any]) -> str:
    import threading
    from collections import deque

    core = mod.LogCore()
    ring: list[Any] = [None] * _int(p["ring"])
    events: deque[Any] = deque(maxlen=16)
    subs: list[Any] = []
    pending: deque[Any] = deque()
    lock = threading.RLock()
    try:
        core._bind(ring=ring, events=events, subscribers=subs, blocking=[], pending=pending, lock=lock)
    except EXPECTED as exc:
        return type(exc).__name__
    seen: list[int] = []
    subs.append(lambda ev: seen.append(ev.seq))
    spent: list[int] = []
    made = {
        "event": _Ev,
        "none": lambda **kw: None,
        "int": lambda **kw: 5,
        "wrong_seq": lambda **kw: _Ev(**{**kw, "seq": kw["seq"] + 1}),
        "raises": lambda **kw: (_ for _ in ()).throw(ValueError("no")),
    }
    for step, (name, arg) in enumerate(p["steps"]):
        arg = _int(arg)
        try:
            if name == "set_seq":
                core._seq = arg
            elif name == "set_published":
                core.published = arg
            elif name == "ring":
                {"clear": ring.clear, "append": lambda: ring.append(None), "pop": ring.pop}[arg]()
            elif name == "sub":
                if arg == "interrupt":

                    def interrupt(ev: Any) -> None:
                        raise KeyboardInterrupt

                    subs.append(interrupt)
                elif arg == "emits":
                    subs.append(lambda ev: core.emit(_Ev, nested=1) if ev.fields.get("nested") is None else None)
                else:
                    subs.append(lambda ev: 1 / 0)
            elif name == "emit":
                before = core._seq
                try:
                    ev = core.emit(made[arg], a=1)
                except KeyboardInterrupt:
                    ev = None
                after = core._seq
                if ev is not None and ev.seq != before:
                    return f"FAIL step {step}: emit returned seq {ev.seq}, _seq was {before}"
                if not before <= after <= before + 1 + len(subs):  # one each for the emitting subscribers
                    return f"FAIL step {step}: _seq went from {before} to {after}"
                spent.extend(range(before, after))
            elif name == "publish":
                core._publish(_Ev(arg, 0, 0))
            elif name == "handoff":
                core._set_handoff(lambda start, evs: None, *arg)
                core._handoff_now()
            elif name == "gap_free_run":
                evs = [_Ev(_int(s), 0, r) if isinstance(s, (int, dict)) else s for s, r in arg]
                out = mod.gap_free_run(evs)
                if out is not None and not (isinstance(out, tuple) and len(out) == 2):
                    return f"FAIL gap_free_run returned {out!r}"
            elif name == "rebind":  # a ring of any length (a big one would only cost memory)
                core._bind(
                    ring=[None] * (arg if arg < 64 else arg % 64),
                    events=events,
                    subscribers=subs,
                    blocking=[],
                    pending=pending,
                    lock=lock,
                )
        except (*EXPECTED, ZeroDivisionError, KeyboardInterrupt, IndexError):
            pass
        if core._seq < 0 or core.published < 0 or core.published > core._seq:
            return f"FAIL step {step}: _seq {core._seq}, published {core.published}"
    for a, b in itertools.pairwise(seen):
        if b < a:
            return f"FAIL a subscriber saw seq {b} after {a}"
    return "log"


def _child(kind: str) -> None:
    probes = json.loads(sys.stdin.read())
    if kind == "copy":
        from hicache_obs import _copy as mod
    elif kind == "slots":
        from hicache_obs import _slots as mod
    else:
        from hicache_obs import _logcore as mod
    fn = {"copy": lambda p: _copy_probe(mod.copy_runs, p), "slots": lambda p: _slots_probe(mod, p)}.get(
        kind, lambda p: _logcore_probe(mod, p)
    )
    for i, p in enumerate(probes):
        _say("probe", i)
        out = fn(p)
        if out.startswith("FAIL"):
            _say("FAIL", i, out)
        _say("ok", i, out)


if __name__ == "__main__":
    _child(sys.argv[1])
