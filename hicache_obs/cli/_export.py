"""``hicache-obs export LOG... --chrome-trace FILE --otlp-json FILE``: render a log for other tools."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._common import EXIT_OK, CliError, escape_text, formatter, read_log

__all__ = ["register", "run"]

_EPILOG = """\
examples:
  hicache-obs export hicache-demo/ --chrome-trace trace.json
      open trace.json in https://ui.perfetto.dev (or chrome://tracing)
  hicache-obs export hicache-demo/ --otlp-json spans.json
      an OTLP/JSON ExportTraceServiceRequest, e.g. for
      curl -H 'Content-Type: application/json' --data @spans.json \\
           http://127.0.0.1:4318/v1/traces
  hicache-obs export rank0/ rank1/ --chrome-trace - | gzip > trace.json.gz
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a Chrome/Perfetto trace or OTLP JSON spans from a log",
        description="Replay event logs and write them as a Chrome trace (Perfetto, "
        "chrome://tracing) and/or OTLP/JSON spans. FILE '-' writes to stdout.",
        epilog=_EPILOG,
        formatter_class=formatter,
    )
    p.add_argument("logs", nargs="+", metavar="LOG", help="a log file or a folder of segments")
    p.add_argument("--chrome-trace", metavar="FILE", help="write Chrome trace event JSON")
    p.add_argument("--otlp-json", metavar="FILE", help="write an OTLP/JSON ExportTraceServiceRequest")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.chrome_trace and not args.otlp_json:
        raise CliError("export: give --chrome-trace FILE and/or --otlp-json FILE")
    if args.chrome_trace == "-" and args.otlp_json == "-":
        raise CliError("export: only one of --chrome-trace and --otlp-json can write to stdout")
    from .._files import OutputPathError, check_output

    for option, target in (("--chrome-trace", args.chrome_trace), ("--otlp-json", args.otlp_json)):
        if target and target != "-":
            try:  # a folder, a socket, a dangling link: refused before the log is read
                check_output(target)
            except OutputPathError as exc:
                raise CliError(f"export: {option} {exc}") from None
    res = read_log(args.logs)
    for t in res.torn_lines:
        where = escape_text(t.file, markup=False)
        print(f"hicache-obs: warning: {where}:{t.line}: torn last line skipped", file=sys.stderr)
    from ..events._audit import audited

    res.events = list(audited(res.events))  # the rules' verdicts, whatever the log holds
    if args.chrome_trace:
        from hicache_obs.exporters._chrome_trace import chrome_trace, write_chrome_trace

        if args.chrome_trace == "-":
            json.dump(chrome_trace(res.events), sys.stdout, separators=(",", ":"))
            sys.stdout.write("\n")
        else:
            write_chrome_trace(res.events, args.chrome_trace)
            print(f"wrote {args.chrome_trace} (Chrome trace, {len(res.events)} events)", file=sys.stderr)
    if args.otlp_json:
        from hicache_obs.exporters._otel import otlp_json

        doc = otlp_json(res.events)
        spans = sum(len(s["spans"]) for r in doc["resourceSpans"] for s in r["scopeSpans"])
        if args.otlp_json == "-":
            json.dump(doc, sys.stdout, separators=(",", ":"))
            sys.stdout.write("\n")
        else:
            from .._files import write_text

            write_text(args.otlp_json, json.dumps(doc, separators=(",", ":")))
            print(f"wrote {args.otlp_json} (OTLP/JSON, {spans} spans)", file=sys.stderr)
    return EXIT_OK

