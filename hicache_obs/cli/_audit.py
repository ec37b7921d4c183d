"""``hicache-obs audit LOG...``: replay event logs and apply the audit rules offline.

The findings are recomputed from the log's other events; ``AuditViolation``
events a live auditor left in the log are not counted again. Exit 0 when clean,
1 with violations, 2 when an input cannot be read. A torn last line (a crash
mid-write) is skipped and reported as a warning. The log is folded block by block as
it is read and no event is kept, so a log of any size is audited in bounded memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._common import EXIT_FINDINGS, EXIT_OK, console, escape_text, fmt_ids, formatter, read_log

__all__ = ["register", "run", "audit_report"]

_EPILOG = """\
examples:
  hicache-obs audit hicache-demo/
  hicache-obs audit rank0/ rank1/ --json       several ranks, one report
  hicache-obs audit events-0-00000.jsonl -v    every finding with its detail

exit status: 0 no violations, 1 violations, 2 unreadable input
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "audit",
        help="replay logs and report stream-safety and slot violations",
        description="Replay event logs (files or folders of events*.jsonl segments, one or "
        "several ranks) and apply the audit rules: unrecorded_index, index_not_on_device, "
        "length_mismatch, slot_not_allocated, double_free, incomplete_operation, pool_omitted, "
        "misplaced_indices.",
        epilog=_EPILOG,
        formatter_class=formatter,
    )
    p.add_argument("logs", nargs="+", metavar="LOG", help="a log file or a folder of segments")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-v", "--verbose", action="store_true", help="list every finding")
    p.set_defaults(func=run)


def audit_report(res: Any) -> dict[str, Any]:
    """The ``--json`` document of a :class:`~hicache_obs.events._replay.ReplayResult`: its
    ``findings`` when it was replayed with ``audit=True``, else the audit of its events."""
    from ..events._audit import audit

    findings = res.findings if res.findings is not None else audit(res.events)
    return {
        "files": list(res.files),
        "events": res.n_events,
        "torn_lines": [{"file": t.file, "line": t.line} for t in res.torn_lines],
        "violations": [
            {"rule": f.rule, "pool": f.pool, "role": f.role, "op": f.op, "rank": f.rank, "detail": f.detail}
            for f in findings
        ],
    }


def run(args: argparse.Namespace) -> int:
    # folded block by block as it is read, no event kept: any size of log in bounded memory
    res = read_log(args.logs, audit=True, keep_events=False, states=False)
    report = audit_report(res)
    for t in report["torn_lines"]:
        where = escape_text(t["file"], markup=False)
        print(f"hicache-obs: warning: {where}:{t['line']}: torn last line skipped", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report, res, verbose=args.verbose)
    return EXIT_FINDINGS if report["violations"] else EXIT_OK


def _print(report: dict[str, Any], res: Any, *, verbose: bool) -> None:
    con = console()
    files = report["files"]
    ranks = ", ".join(str(r) for r in res.ranks) or "none"
    con.print(f"{report['events']} events from {len(files)} file(s), rank(s) {ranks}")
    if not report["events"]:
        con.print("[yellow]the log holds no events[/]")
    violations = report["violations"]
    if not violations:
        con.print("[green]no violations[/]")
        return
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for v in violations:
        groups.setdefault((v["rule"], v["pool"]), []).append(v)
    con.print(f"[red bold]{len(violations)} violation(s)[/] in {len(groups)} group(s):")
    for (rule, pool), items in sorted(groups.items()):
        roles = sorted({v["role"] for v in items})
        ops = sorted({v["op"] for v in items})
        multi_rank = len({v["rank"] for v in items}) > 1
        # rule, pool, role and detail come from the log: escaped (markup and control characters)
        shown_roles = "/".join(escape_text(r) for r in roles)
        con.print(f"\n[red]{escape_text(rule)}[/] pool [bold]{escape_text(pool)}[/] ({shown_roles}): {len(items)}")
        con.print(f"  ops {fmt_ids(ops, 12)}")
        shown = items if verbose else items[:1]
        for v in shown:
            where = f"rank {v['rank']} op {v['op']}" if multi_rank or verbose else f"op {v['op']}"
            con.print(f"  {where}: {escape_text(v['detail'])}")
