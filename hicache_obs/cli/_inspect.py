"""``hicache-obs inspect LOG...``: operations as a tree or as a timeline.

Tree (default): one entry per submitted (merged) operation -> the ops merged into
it -> per pool: index moves and stream records (with the ones missing flagged) ->
the transfer -> its completion, with durations. ``--timeline``: one line per
operation event, in log order, with the time since the log began. Filters:
``--op N`` (a merged op or one merged into it), ``--pool NAME``,
``--violations-only``. Violations are recomputed from the log (the audit rules); those no op
owns (a free handed indices of another device, a free of free slots) come last, "outside any
op" (``outside_ops`` in ``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any

from ._common import EXIT_OK, console, escape_text, fmt_bytes, fmt_ids, fmt_ns, formatter, read_log

__all__ = ["register", "run", "op_views", "timeline"]

_EPILOG = """\
examples:
  hicache-obs inspect hicache-demo/                    every op as a tree
  hicache-obs inspect hicache-demo/ --violations-only  only ops the audit flags
  hicache-obs inspect hicache-demo/ --op 42 --timeline one op, event by event
  hicache-obs inspect hicache-demo/ --pool mamba --json
"""

OP_EVENTS = (
    "OperationQueued",
    "OperationsMerged",
    "IndicesMoved",
    "StreamRecorded",
    "TransferSubmitted",
    "TransferCompleted",
    "TransferFailed",
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show operations as a tree or a timeline",
        description="Show each operation of an event log: the ops merged into it, the index "
        "moves and stream records per pool, the transfer and its completion, with durations "
        "and the violations the audit rules find.",
        epilog=_EPILOG,
        formatter_class=formatter,
    )
    p.add_argument("logs", nargs="+", metavar="LOG", help="a log file or a folder of segments")
    p.add_argument("--timeline", action="store_true", help="one line per event instead of a tree")
    p.add_argument("--op", type=int, metavar="N", help="only op N (or the op it was merged into)")
    p.add_argument("--pool", metavar="NAME", help="only ops that move pool NAME, and only its rows")
    p.add_argument("--rank", type=int, metavar="R", help="only rank R")
    p.add_argument("--violations-only", action="store_true", help="only ops with violations")
    p.add_argument("--limit", type=int, metavar="N", help="show at most N ops (timeline: N lines)")
    p.add_argument("--json", action="store_true", help="print JSON instead")
    p.set_defaults(func=run)


# ------------------------------------------------------------- the model
def op_views(events: list[Any], findings: Iterable[Any]) -> list[dict[str, Any]]:
    """One dict per top-level (submitted or merged) operation, in submission order."""
    from ..events._projections import lifecycles, tensor_records
    from ..events._schema import TransferSubmitted

    t0 = events[0].ts_ns if events else 0
    lcs = lifecycles(events)
    subs = {(ev.rank, ev.op): ev for ev in events if isinstance(ev, TransferSubmitted)}
    recs: dict[tuple[int, int], list[Any]] = {}
    for r in tensor_records(events):
        recs.setdefault((r.rank, r.op), []).append(r)
    found: dict[tuple[int, int], list[Any]] = {}
    for f in findings:
        found.setdefault((f.rank, f.op), []).append(f)

    def rel(ns: int | None) -> float | None:
        return None if ns is None else (ns - t0) / 1e6

    out = []
    for (rank, op), lc in lcs.items():
        if lc.merged_into is not None:
            continue
        sub = subs.get((rank, op))
        sources = [o for o in lc.merged_from if o != op]
        pools: dict[str, dict[str, Any]] = {}
        slots = dict(lc.slots_by_pool)
        nbytes = dict(lc.bytes_by_pool)
        for name in slots:
            pools[name] = {"slots": slots[name], "bytes": nbytes.get(name, 0), "moves": [], "tensors": []}
        for mv in lc.moves:
            pools.setdefault(mv.pool, {"slots": 0, "bytes": 0, "moves": [], "tensors": []})["moves"].append(
                {
                    "role": mv.role,
                    "src": mv.src_device,
                    "dst": mv.dst_device,
                    "numel": mv.tensor.numel,
                    "t_ms": rel(mv.ts_ns),
                }
            )
        for r in recs.get((rank, op), []):
            pools.setdefault(r.pool, {"slots": 0, "bytes": 0, "moves": [], "tensors": []})["tensors"].append(
                {
                    "role": r.role,
                    "device": r.device,
                    "numel": r.numel,
                    "stream": r.stream,
                    "needs_record": r.needs_record,
                    "recorded": r.recorded,
                    "recorded_on": list(r.recorded_on),
                }
            )
        out.append(
            {
                "rank": rank,
                "op": op,
                "direction": lc.direction,
                "status": lc.status,
                "node_ids": list(lc.node_ids),
                "merged_ops": sources,
                "stream": lc.stream,
                "io_backend": sub.io_backend if sub is not None else None,
                "layout": sub.layout if sub is not None else None,
                "queued_ms": rel(lc.queued_ns),
                "submitted_ms": rel(lc.submitted_ns),
                "finished_ms": rel(lc.finished_ns),
                "queue_wait_ns": lc.queue_wait_ns,
                "duration_ns": lc.duration_ns,
                "total_ns": lc.total_ns,
                "layer_durations_ns": list(lc.layer_durations_ns) if lc.layer_durations_ns else None,
                "error": lc.error,
                "pools": pools,
                "violations": [
                    {"rule": f.rule, "pool": f.pool, "role": f.role, "detail": f.detail}
                    for f in found.get((rank, op), [])
                ],
            }
        )
    out.sort(key=lambda v: (v["submitted_ms"] if v["submitted_ms"] is not None else float("inf"), v["rank"], v["op"]))
    return out


def _select(views: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for v in views:
        if args.rank is not None and v["rank"] != args.rank:
            continue
        if args.op is not None and args.op != v["op"] and args.op not in v["merged_ops"]:
            continue
        if args.pool is not None:
            if args.pool not in v["pools"]:
                continue
            v = {**v, "pools": {args.pool: v["pools"][args.pool]}}
            v["violations"] = [f for f in v["violations"] if f["pool"] in (args.pool, "*")]
        if args.violations_only and not v["violations"]:
            continue
        out.append(v)
    return out


def timeline(events: list[Any], keep: set[tuple[int, int]] | None, pool: str | None) -> list[dict[str, Any]]:
    """Operation events and the audit's verdicts as lines, in log order.

    ``events`` is a log as :func:`~hicache_obs.events._audit.audited` gives it: each verdict
    is shown after the event that revealed it (with its time), the end-of-log ones last
    (seq -1, at the log's last time).
    """
    from ..events._schema import (
        AuditViolation,
        IndicesMoved,
        OperationQueued,
        OperationsMerged,
        StreamRecorded,
        TransferCompleted,
        TransferFailed,
        TransferSubmitted,
    )

    t0 = events[0].ts_ns if events else 0
    owner: dict[tuple[int, int], int] = {}  # source op -> merged op
    for ev in events:
        if isinstance(ev, OperationsMerged):
            for o in ev.merged_ops:
                owner[(ev.rank, o)] = ev.op
    lines: list[dict[str, Any]] = []

    def add(ev: Any, op: int, text: str) -> None:
        lines.append(
            {
                "t_ms": (ev.ts_ns - t0) / 1e6,
                "seq": ev.seq,
                "rank": ev.rank,
                "op": op,
                "type": type(ev).__name__,
                "text": text,
            }
        )

    def kept(rank: int, op: int) -> bool:
        return keep is None or (rank, op) in keep or (rank, owner.get((rank, op), -1)) in keep

    def verdicts(held: list[Any], seq: int, ts: int) -> None:
        for v in held:
            if kept(v.rank, v.op) and (pool is None or v.pool in (pool, "*")):
                lines.append(_finding_line(v, seq, ts, t0))

    def slots(pairs: Any) -> str:
        return " ".join(f"{p}:{n}" for p, n in pairs if pool is None or p == pool)

    last_ts = t0
    held: list[Any] = []  # the verdicts that come before the event that revealed them
    for ev in events:
        last_ts = max(last_ts, ev.ts_ns)
        if isinstance(ev, AuditViolation):
            held.append(ev)
            continue
        name = type(ev).__name__
        if name in OP_EVENTS and kept(ev.rank, ev.op):
            ev_pool = getattr(ev, "pool", None)
            if pool is None or ev_pool is None or ev_pool == pool:
                if isinstance(ev, OperationQueued):
                    add(ev, ev.op, f"queued {ev.direction} node {ev.node_id} {slots(ev.slots_by_pool)}")
                elif isinstance(ev, OperationsMerged):
                    add(ev, ev.op, f"merged {fmt_ids(list(ev.merged_ops), 6)}")
                elif isinstance(ev, IndicesMoved):
                    add(ev, ev.op, f"moved {ev.pool} {ev.role} {ev.src_device}->{ev.dst_device} ({ev.tensor.numel})")
                elif isinstance(ev, StreamRecorded):
                    add(ev, ev.op, f"recorded {ev.pool} {ev.role} on {ev.stream}")
                elif isinstance(ev, TransferSubmitted):
                    add(ev, ev.op, f"submitted on {ev.stream} {slots(ev.slots_by_pool)}")
                elif isinstance(ev, TransferCompleted):
                    add(ev, ev.op, f"completed in {fmt_ns(ev.duration_ns)}")
                elif isinstance(ev, TransferFailed):
                    add(ev, ev.op, f"FAILED {ev.error}")
        if held:
            verdicts(held, ev.seq, ev.ts_ns)
            held = []
    verdicts(held, -1, last_ts)  # after the last event: the end-of-log findings
    return lines


def _finding_line(v: Any, seq: int, ts: int, t0: int) -> dict[str, Any]:
    return {
        "t_ms": (ts - t0) / 1e6,
        "seq": seq,
        "rank": v.rank,
        "op": v.op,
        "type": "AuditViolation",
        "text": f"VIOLATION {v.rule} {v.pool}/{v.role}",
        "detail": v.detail,
    }


# ------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    from ..events._audit import Auditor, audited
    from ..events._state import PoolLimits

    res = read_log(args.logs)
    for t in res.torn_lines:
        where = escape_text(t.file, markup=False)
        print(f"hicache-obs: warning: {where}:{t.line}: torn last line skipped", file=sys.stderr)
    events = res.events
    auditor = Auditor(limits=PoolLimits())  # as ``audit`` holds a log read back
    stream = list(audited(events, auditor=auditor))  # the log's own violations replaced by the rules'
    views = _select(op_views(events, auditor.findings), args)
    if args.timeline:
        keep = {(v["rank"], v["op"]) for v in views}
        unfiltered = args.op is None and args.pool is None and not args.violations_only and args.rank is None
        lines = timeline(stream, None if unfiltered else keep, args.pool)
        if args.limit is not None:
            lines = lines[: args.limit]
        if args.json:
            print(json.dumps({"files": res.files, "events": len(events), "timeline": lines}, indent=2))
        else:
            _print_timeline(lines, multi_rank=len(res.ranks) > 1)
        return EXIT_OK
    if args.limit is not None:
        views = views[: args.limit]
    loose = _outside_ops(auditor.findings, args)
    if args.json:
        print(json.dumps({"files": res.files, "events": len(events), "ops": views, "outside_ops": loose}, indent=2))
    else:
        _print_tree(views, multi_rank=len(res.ranks) > 1, loose=loose)
    return EXIT_OK


def _outside_ops(findings: Iterable[Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The findings no op owns (a free handed indices of another device, a free of free slots),
    under the same ``--rank`` and ``--pool`` filters; none when ``--op`` picks one op."""
    if args.op is not None:
        return []
    return [
        {"rank": f.rank, "rule": f.rule, "pool": f.pool, "role": f.role, "seq": f.seq, "detail": f.detail}
        for f in findings
        if f.op < 0
        and (args.rank is None or f.rank == args.rank)
        and (args.pool is None or f.pool in (args.pool, "*"))
    ]


def _short(detail: str) -> str:
    """The first clause of a finding's detail (``audit -v`` and ``--json`` give all of it)."""
    return detail.split(";", 1)[0]


def _print_timeline(lines: list[dict[str, Any]], *, multi_rank: bool) -> None:
    from rich.padding import Padding
    from rich.text import Text

    con = console()
    if not lines:
        con.print("no matching events")
        return
    for ln in lines:
        who = f"r{ln['rank']} op {ln['op']}" if multi_rank else f"op {ln['op']}"
        style = "red" if ln["type"] in ("AuditViolation", "TransferFailed") else None
        text = f"{ln['t_ms']:10.3f} ms  {who:>8}  {escape_text(ln['text'])}"  # names from the log: escaped
        con.print(text, style=style, overflow="fold")
        if "detail" in ln:
            con.print(Padding(Text(escape_text(_short(ln["detail"]), markup=False), style="red"), (0, 0, 0, 24)))


def _print_tree(views: list[dict[str, Any]], *, multi_rank: bool, loose: list[dict[str, Any]] | None = None) -> None:
    from rich.tree import Tree

    e = escape_text  # every name, stream, error and detail below comes from the log

    con = console()
    if not views and not loose:
        con.print("no matching operations")
        return
    for v in views:
        status = v["status"]
        colour = {"completed": "green", "failed": "red"}.get(status, "yellow")
        if v["violations"]:
            colour = "red"
        rank = f"rank {v['rank']} " if multi_rank else ""
        nodes = fmt_ids(v["node_ids"], 6)
        head = (
            f"[bold]{rank}op {v['op']}[/] {e(v['direction'])} [{colour}]{e(status)}[/]"
            f" nodes {nodes} device {fmt_ns(v['duration_ns'])}"
        )
        tree = Tree(head)
        if v["merged_ops"]:
            tree.add(f"merged ops {fmt_ids(v['merged_ops'], 8)}")
        for name, p in v["pools"].items():
            n = p["slots"]
            branch = tree.add(f"[bold]{e(name)}[/] {n} slot{'' if n == 1 else 's'}, {fmt_bytes(p['bytes'])}")
            for mv in p["moves"]:
                branch.add(f"{e(mv['role'])} indices moved {e(mv['src'])} -> {e(mv['dst'])} ({mv['numel']})")
            for t in p["tensors"]:
                if not t["needs_record"]:
                    continue
                mark = "[green]recorded[/]" if t["recorded"] else "[red bold]NOT recorded[/]"
                branch.add(f"{e(t['role'])} index on {e(t['device'])}: {mark} on {e(t['stream'])}")
        if v["submitted_ms"] is not None:
            tree.add(
                f"transfer on {e(v['stream'])} ({e(v['io_backend'])}, {e(v['layout'])}) at {v['submitted_ms']:.3f} ms,"
                f" queued {fmt_ns(v['queue_wait_ns'])}"
            )
        if status == "completed":
            layers = v["layer_durations_ns"]
            extra = f", {len(layers)} layers" if layers else ""
            tree.add(f"[green]completed[/] at {v['finished_ms']:.3f} ms: device {fmt_ns(v['duration_ns'])}{extra}")
        elif status == "failed":
            tree.add(f"[red]failed[/] at {v['finished_ms']:.3f} ms: {e(v['error'] or '')}")
        else:
            tree.add(f"[yellow]{e(status)}[/], never completed")
        for f in v["violations"]:
            tree.add(f"[red]{e(f['rule'])}[/] {e(f['pool'])}/{e(f['role'])}: {e(_short(f['detail']))}")
        con.print(tree)
    if loose:  # findings no op owns: a free's
        tree = Tree("[bold]outside any op[/] [red]violations[/]")
        for f in loose:
            rank = f"rank {f['rank']} " if multi_rank else ""
            tree.add(f"{rank}[red]{e(f['rule'])}[/] {e(f['pool'])}/{e(f['role'])}: {e(_short(f['detail']))}")
        con.print(tree)
