"""``hicache-obs bench``: the performance ratios, measured side by side in one run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hicache_obs.cli._common import EXIT_OK, CliError, formatter

__all__ = ["register", "run"]

_EPILOG = """\
examples:
  hicache-obs bench --quick          one minute: a table of ratios and targets
  hicache-obs bench --json > b.json  the full run as one JSON object
  hicache-obs bench --section events --json
  .sglang/0.5.23/bin/python -m hicache_obs bench --section sglang
  .sglang/0.5.23/bin/python -m hicache_obs bench --section sglang \\
      --profile-rounds 15

Every figure is a ratio of two things measured in the same process, interleaved
round by round; the median of the per-round ratios is shown with its spread.
The sglang section runs where SGLang is installed in the running Python (a fresh
interpreter of it: SGLang's real controller, instrumented vs bare); elsewhere it
says why not, in one line.
"""

SECTIONS = ("overhead", "events", "data_path", "sglang")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="measure observability overhead, event throughput and data-path bandwidth",
        description="Measure, side by side in one run: the demo workload with observability on "
        "against the bare controller; event append, durable write and replay+audit rates "
        "against floor loops; write/load bandwidth against Tensor.copy_ of the same bytes; "
        "where SGLang is installed, a serving workload on SGLang's real controller, "
        "instrumented against bare.",
        epilog=_EPILOG,
        formatter_class=formatter,
    )
    p.add_argument("--quick", action="store_true", help="fewer rounds and smaller sizes (under a minute)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--section", action="append", choices=SECTIONS, help="run only this section (repeatable; default: all)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads during the run (default 1; 0 keeps torch's default)",
    )
    p.add_argument(
        "--profile-rounds",
        type=int,
        metavar="N",
        help="rounds of the sglang section's measure per profile (default 7; 2 with --quick); "
        "its spread narrows as the square root of N",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hicache_obs.lab.bench import run_bench

    def progress(name: str) -> None:
        if not args.json:
            print(f"bench: {name} ...", file=sys.stderr, flush=True)

    if args.threads < 0:
        raise CliError(f"bench: --threads must be >= 0, got {args.threads}")
    if args.profile_rounds is not None and args.profile_rounds < 1:
        raise CliError(f"bench: --profile-rounds must be >= 1, got {args.profile_rounds}")
    result = run_bench(
        quick=args.quick,
        progress=progress,
        sections=tuple(args.section or SECTIONS),
        threads=args.threads or None,
        profile_rounds=args.profile_rounds,
    )
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    _table(result)
    return EXIT_OK


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}"
    return str(v)


def _table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=100)
    m = result["machine"]
    console.print(f"machine: {m['cores']} cores, torch {m['torch']}, python {m['python']}")
    t = Table(title="targets")
    t.add_column("figure")
    t.add_column("target")
    t.add_column("measured", justify="right")
    t.add_column("met")
    for row in result["targets"]:
        met = {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}[row["met"]]
        t.add_row(row["key"], row["target"], _fmt(row["value"]), met)
    console.print(t)
    dp = result.get("data_path")
    if dp:
        d = Table(title="data path vs Tensor.copy_ (median ratio)")
        for col in ("layout", "page size", "write", "load"):
            d.add_column(col)
        for layout, by_ps in dp.items():
            for ps, r in by_ps.items():
                d.add_row(layout, ps[2:], _fmt(r["write_vs_memcpy"]), _fmt(r["load_vs_memcpy"]))
        console.print(d)
    ov = result.get("overhead")
    if ov:
        console.print(f"per-operation overhead (events + audit + metrics + logs): {ov['per_op_overhead_us']:.1f} us")
        if isinstance(ov.get("profiles"), dict):
            console.print(_overhead_profiles_line(ov["profiles"]), markup=False, highlight=False, soft_wrap=True)
    sg = result.get("sglang")
    if sg:
        console.print(_sglang_line(sg), markup=False, highlight=False, soft_wrap=True)
        if isinstance(sg.get("profiles"), dict):
            console.print(_profiles_line(sg["profiles"]), markup=False, highlight=False, soft_wrap=True)
    ev = result.get("events")
    if ev:
        console.print(
            f"replay + audit keeping every event in memory: {_fmt(ev['replay_audit_retained_per_s'])}/s "
            f"({ev['replay_retained_vs_floor']:.2f}x the floor; the target row folds as it reads, as "
            "`hicache-obs audit` does)"
        )


def _overhead_profiles_line(pr: dict[str, dict[str, Any]]) -> str:
    """The overhead section per profile of our controller in one line: (a) / (b) / (c), us an op."""
    parts = []
    for name, got in pr.items():
        ratios = " / ".join(f"{got[f'{k}_ratio']:.3f}" for k in ("events_metrics", "with_otel", "with_durable_log"))
        parts.append(f"{name} {ratios}, {got['per_op_overhead_us']:+.0f} us an op")
    return "overhead (a) / (b) / (c) by profile: " + "; ".join(parts)


def _profiles_line(pr: dict[str, Any]) -> str:
    """The ``sglang`` section's measure per profile in one line."""
    if not pr.get("available"):
        return f"sglang profiles: not measured: {pr.get('reason', '?')}"
    parts = []
    for name in ("metrics", "audit", "sampling"):
        p = pr[name]
        lo, hi = p["controller_cpu_ratio_spread"]
        ev = p["events_per_op"]
        parts.append(
            f"{name} {p['controller_cpu_ratio']:.3f} ({lo:.3f}-{hi:.3f}), {p['per_op_us']:+.0f} us, "
            + (f"{ev:.2f} events" if ev is not None else "? events")
        )
    return (
        f"sglang profiles ({pr['tree']}, {pr['io_backend']}/{pr['layout']}, copies on a worker thread, "
        f"{pr['rounds']} rounds; controller thread CPU instrumented / bare, per operation, "
        f"bare {pr['bare_cpu_per_op_us']:.0f} us): " + "; ".join(parts)
        + f"; sampling {pr['audit_sample']:g} minus metrics {pr['sampling_minus_metrics']:+.3f}"
    )


def _sglang_line(sg: dict[str, Any]) -> str:
    """The ``sglang`` section in one line."""
    if not sg.get("available"):
        return f"sglang: not measured: {sg.get('reason', 'SGLang is not available')}"
    if "error" in sg:
        return f"sglang {sg.get('release') or '?'}: the bench failed: {sg['error']}"
    lo, hi = sg["overhead_ratio_spread"]
    q1, q3 = sg["overhead_ratio_iqr"]
    return (
        f"sglang {sg['release']} ({sg['model']}, {sg['io_backend']}/{sg['layout']}, {sg['rounds']} rounds, "
        f"sinks in the sink host): instrumented / bare {sg['overhead_ratio']:.3f} "
        f"(IQR {q1:.3f}-{q3:.3f}, range {lo:.3f}-{hi:.3f}), "
        f"{sg['per_op_overhead_us']:+.0f} us per operation (bare {sg['bare_per_op_us']:.0f} us)"
        + (
            f"; into an in-process log with no sinks {sg['in_process_ratio']:.3f}, "
            f"{sg['in_process_per_op_us']:+.0f} us"
            if "in_process_ratio" in sg
            else ""
        )
        + (
            f"; the wait for the sink host at each run's end {sg['flush_wait_per_op_us']:.0f} us an operation"
            if "flush_wait_per_op_us" in sg
            else ""
        )
        + (
            f"; the hooks alone (constant events, nothing read) {sg['floor_ratio']:.3f}, {sg['floor_per_op_us']:+.0f} us"
            if "floor_per_op_us" in sg
            else ""
        )
    )
