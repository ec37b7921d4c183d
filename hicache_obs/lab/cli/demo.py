"""``hicache-obs demo``: the synthetic serving workload with the whole pipeline attached.

Builds an :class:`~hicache_obs.events._log.EventLog` and attaches, before the
controller exists (so ``PoolCreated`` reaches everything): the durable JSON Lines
store in ``--out``, the live :class:`~hicache_obs.events._audit.Auditor`, the
Prometheus sink behind ``/metrics`` on 127.0.0.1, and the OpenTelemetry span sink
when an OTLP endpoint is given. Then it runs :class:`~hicache_obs.lab.workload.Workload`,
closes everything, writes ``trace.json`` and prints a summary (``--json``: one
JSON object).

``--engine sglang`` runs SGLang's real server instead (``python -m sglang.launch_server``
with HiCache, under ``hicache-obs instrument``, a tiny model made in ``--out``), sends it
chat requests over HTTP, checks each host-served answer against a recompute and summarises
the rank folders (:mod:`hicache_obs.lab.sglang.server_demo`).

``--engine sglang-controller`` serves the same synthetic workload through SGLang's real
HiCache controller (built on this machine's CPU, instrumented by
:mod:`hicache_obs.integrations.sglang`; see :mod:`hicache_obs.lab.sglang.engine`),
with the same pipeline and summary. It refuses what it cannot honour (``--model tiny_swa``,
a ``--runtime`` other than ``cpu`` or ``cuda``, ``--layout page_first_direct`` without
``--io-backend direct``, any ``--fault``: it injects nothing, SGLang 0.5.10 *is* the
pre-#22940 code) and defaults ``--layout`` to the installed release's own default; where the
release's Mamba host pool refuses that layout and neither ``--layout`` nor ``--io-backend``
was given (0.5.14 to 0.5.17 take ``page_first_direct`` only), it runs the hybrid model with
``--io-backend direct --layout page_first_direct`` and says so on stderr. A copy
SGLang raises in (0.5.10's kernel backend on the hybrid model) is a failed transfer,
counted like ours.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hicache_obs.cli._common import (
    EXIT_OK,
    CliError,
    console,
    escape_text,
    fmt_bytes,
    fmt_ids,
    fmt_rate,
    formatter,
    port_arg,
)

__all__ = ["register", "run", "DEFAULT_STEPS", "DEFAULT_OUT"]

DEFAULT_STEPS = 200
DEFAULT_OUT = "hicache-demo"
TRACE_FILE = "trace.json"
ENGINES = ("ours", "sglang", "sglang-controller")
DEFAULT_RUNTIME = "sim"
DEFAULT_LAYOUT = "layer_first"
#: How far the store's writer thread may fall behind before the demo waits for it (policy
#: ``block``). With the runner's 4096-event batches this bounds what a SIGKILL can lose: at
#: most ``STORE_MAX_QUEUE`` + 4096 events, those emitted since the writer last took a batch
#: (it takes one at least every 50 ms). SIGINT and SIGTERM lose nothing.
STORE_MAX_QUEUE = 4096

_EPILOG = """\
examples:
  hicache-obs demo
      200 requests on tiny_hybrid (KV + Mamba) with the sim runtime; event log
      and trace.json in ./hicache-demo/, /metrics on a free 127.0.0.1 port
  hicache-obs demo --fault unrecorded-pool-indices
      the pre-#22940 bug: Mamba index tensors not recorded on the copy stream;
      the audit flags them and the data checks find the corrupted slots
  hicache-obs demo --steps 1000 --metrics-port 9400 --serve
      keep /metrics up after the run (Ctrl-C to stop)
  hicache-obs demo --otlp-endpoint http://127.0.0.1:4318
      also send one span per transfer over OTLP/HTTP (or set
      OTEL_EXPORTER_OTLP_ENDPOINT)
  hicache-obs demo --fault unrecorded-pool-indices --profile metrics
      the same finding at the profile a production launcher runs (no slot
      values); --audit-sample 0.01 audits one operation in a hundred in full
  hicache-obs demo --model tiny_swa --runtime cpu --json
  hicache-obs demo --engine sglang --steps 60
      SGLang's real server (python -m sglang.launch_server, HiCache on, a tiny
      model made here) under hicache-obs instrument, with chat clients over HTTP
      (needs SGLang and its server: make sglang sglang-server)
  hicache-obs demo --engine sglang-controller --steps 50
      the synthetic workload through SGLang's HiCache controller, instrumented
      (on 0.5.10 add --io-backend direct to see the unrecorded Mamba indices, or
      keep kernel to see its copies fail)

then:
  hicache-obs audit hicache-demo/      hicache-obs inspect hicache-demo/
  open hicache-demo/trace.json in https://ui.perfetto.dev
"""


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


_port = port_arg()


def register(sub: Any) -> None:
    from hicache_obs._profiles import PROFILES
    from hicache_obs.cli._instrument import _share
    from hicache_obs.core._policy import WRITE_POLICIES
    from hicache_obs.core._pools import LAYOUTS
    from hicache_obs.core._runtime import RUNTIME_NAMES
    from hicache_obs.core._spec import MODEL_PRESETS
    from hicache_obs.core._transfer import IO_BACKENDS
    from hicache_obs.testing import FAULTS

    p = sub.add_parser(
        "demo",
        help="run the synthetic serving workload with every exporter attached",
        description="A synthetic prefix-reuse serving workload (write-through, eviction, "
        "load-back) that drives the controller like SGLang's radix cache, with the event "
        "log, the live auditor, /metrics and (optionally) OTLP spans attached. Every loaded "
        "slot is compared with what was written.",
        epilog=_EPILOG,
        formatter_class=formatter,
    )
    p.add_argument(
        "--engine",
        choices=list(ENGINES),
        default="ours",
        metavar="NAME",
        help="what serves: ours (hicache_obs.core, the synthetic workload), sglang (SGLang's real server "
        "with HiCache, instrumented, driven over HTTP by chat clients; needs SGLang and its server "
        "installed in this Python) or sglang-controller (SGLang's controller driven by the synthetic "
        "workload, in this process) (default: %(default)s)",
    )
    p.add_argument(
        "--model",
        choices=list(MODEL_PRESETS),
        default="tiny_hybrid",
        metavar="NAME",
        help="%(choices)s (default: %(default)s)",
    )
    p.add_argument(
        "--runtime",
        choices=list(RUNTIME_NAMES),
        default=None,
        metavar="NAME",
        help=f"%(choices)s (default: {DEFAULT_RUNTIME}; cpu with --engine sglang, cpu or cuda with "
        "--engine sglang-controller)",
    )
    p.add_argument(
        "--steps",
        type=_positive_int,
        default=DEFAULT_STEPS,
        metavar="N",
        help="requests to serve (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the request stream and the data (default: %(default)s)",
    )
    p.add_argument(
        "--io-backend",
        choices=list(IO_BACKENDS),
        default=None,
        metavar="NAME",
        help="%(choices)s (default: kernel)",
    )
    p.add_argument(
        "--layout",
        choices=list(LAYOUTS),
        default=None,
        metavar="NAME",
        help=f"host pool layout: %(choices)s (default: {DEFAULT_LAYOUT}; page_first with --engine sglang; "
        "the SGLang release's own default with --engine sglang-controller)",
    )
    p.add_argument(
        "--write-policy",
        choices=list(WRITE_POLICIES),
        default="write_through",
        metavar="NAME",
        help="when to back nodes up: %(choices)s (default: %(default)s)",
    )
    p.add_argument(
        "--device-tokens",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="KV slots on the device; the host holds twice as many (default: %(default)s)",
    )
    p.add_argument(
        "--fault",
        choices=list(FAULTS),
        default=None,
        metavar="NAME",
        help="inject a known bug: %(choices)s (see hicache_obs.testing)",
    )
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help="output folder for events*.jsonl and trace.json (default: ./%(default)s/)",
    )
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=0,
        metavar="PORT",
        help="port of /metrics on 127.0.0.1 (default: 0, a free one)",
    )
    p.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="OTLP/HTTP base URL for spans, e.g. http://127.0.0.1:4318 (default: $OTEL_EXPORTER_OTLP_ENDPOINT, else off)",
    )
    p.add_argument(
        "--profile",
        choices=list(PROFILES),
        default=None,
        metavar="NAME",
        help="how much evidence the controller records: %(choices)s (default: $HICACHE_OBS_PROFILE, "
        "else audit, or with --engine sglang the launcher's metrics; --engine sglang-controller takes "
        "audit only)",
    )
    p.add_argument(
        "--audit-sample",
        type=_share,
        default=None,
        metavar="SHARE",
        help="share of the operations audited in full, 0 to 1 (alone or with metrics: sampling above 0; "
        "default for sampling 0.01)",
    )
    p.add_argument("--serve", action="store_true", help="keep /metrics up after the run until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=run)


# ------------------------------------------------------------------ run
def run(args: argparse.Namespace) -> int:
    """Run the demo. Interrupted (SIGINT, or SIGTERM, which the command turns into the same
    unwinding), it closes the controller and the log, so every event emitted reaches the
    store, says so in one line on stderr, and re-raises for the exit status (130/143)."""
    opened: dict[str, Any] = {}
    try:
        return _run(args, opened)
    except KeyboardInterrupt as exc:
        _report_interrupted(opened, exc)
        raise


def _report_interrupted(opened: dict[str, Any], exc: KeyboardInterrupt) -> None:
    if "store" not in opened:
        return  # interrupted before the log existed: nothing was recorded
    from hicache_obs.cli import Terminated

    st = opened["store"].stats()
    lost = f", {st['dropped']} lost (counted)" if st["dropped"] else ""
    print(
        f"hicache-obs: {'terminated' if isinstance(exc, Terminated) else 'interrupted'}: "
        f"{st['handled']} of {opened['log'].published} events written to "
        f"{escape_text(opened['out'], markup=False)}/{lost}",
        file=sys.stderr,
    )


def _run(args: argparse.Namespace, opened: dict[str, Any]) -> int:
    from hicache_obs.core._runtime import make_runtime
    from hicache_obs.core._spec import ModelSpec
    from hicache_obs.events._audit import Auditor
    from hicache_obs.events._log import EventLog
    from hicache_obs.events._store import SEGMENT_GLOB, open_store
    from hicache_obs.lab.workload import Workload, controller_options
    from hicache_obs.testing import fault_class, make_controller

    if getattr(args, "engine", "ours") == "sglang":
        args.io_backend = args.io_backend or "kernel"
        return _run_server(args)
    profile = _profile(args)
    spec = ModelSpec.preset(args.model)
    # before torch is asked for terabytes; on cuda the device tier is the GPU's memory, not this
    _check_pool_memory(spec, args.device_tokens, device_tier=(args.runtime or DEFAULT_RUNTIME) != "cuda")
    harness = None
    if getattr(args, "engine", "ours") == "sglang-controller":
        harness = _sglang_harness(args, spec)  # refusals, a missing SGLang: before --out is touched
        runtime = None
    else:
        args.runtime = args.runtime or DEFAULT_RUNTIME
        args.layout = args.layout or DEFAULT_LAYOUT
        args.io_backend = args.io_backend or "kernel"
        fault_class(args.fault, spec)  # an impossible fault/model pair fails before anything starts
        runtime = make_runtime(args.runtime)  # so does a runtime this machine lacks: before --out is touched
    out = Path(args.out)
    try:
        _prepare_out(out, SEGMENT_GLOB)
    except BaseException:
        if harness is not None:
            harness.close()  # what SGLang's host pools registered with CUDA
        raise

    t_start = time.perf_counter()
    from hicache_obs.cli import deferred_interrupts

    def held(close: Callable[[], Any]) -> Callable[[], None]:
        """``close`` with SIGINT/SIGTERM held until it returns: a signal cannot cut a flush short."""

        def run_held() -> None:
            with deferred_interrupts():
                close()

        return run_held

    with contextlib.ExitStack() as stack:
        if harness is not None:
            stack.callback(harness.close)  # last: after the engine's close (a no-op again then)
        log = EventLog()
        stack.callback(held(log.close))
        store = open_store(log, out, max_queue=STORE_MAX_QUEUE)
        opened.update(log=log, store=store, out=str(out))
        metrics_url, server = _start_metrics(log, args.metrics_port)
        stop = getattr(server, "stop", None) or server.shutdown
        stack.callback(stop)
        otlp_endpoint = args.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
        if otlp_endpoint:
            stack.callback(_attach_otel(log, args.otlp_endpoint))
        auditor = Auditor().attach(log)

        stack.enter_context(_quiet_controller_warnings())  # failed transfers are counted, not logged
        controller: Any
        if harness is not None:
            from hicache_obs.lab.sglang.engine import build_engine

            # after the sinks and the auditor: instrumenting reports SGLang's pools (PoolCreated)
            controller = build_engine(harness, log=log, write_policy=args.write_policy)
        else:
            controller = make_controller(
                spec,
                fault=args.fault,
                runtime=runtime,
                log=log,
                io_backend=args.io_backend,
                layout=args.layout,
                write_policy=args.write_policy,
                profile=profile,
                **controller_options(spec, args.device_tokens),
            )
        stack.callback(held(controller.close))
        workload = Workload(controller, seed=args.seed, fault=args.fault)
        if not args.json:
            print(f"/metrics at {metrics_url}", file=sys.stderr)
        with _progress(args.steps, enabled=not args.json and sys.stderr.isatty()) as advance:
            stats = workload.run(args.steps, on_step=advance)
        with deferred_interrupts():  # a signal now waits until everything is written
            controller.close()
            auditor.finish()
            log.close()  # flushes every sink: the store, the metrics, the spans
        wall = time.perf_counter() - t_start

        if log.overflowed:  # the in-memory log kept only the newest events: read the store back
            from hicache_obs.events._replay import replay

            events = replay(out).events
        else:
            events = log.events()
        from hicache_obs.exporters._chrome_trace import write_chrome_trace

        trace = out / TRACE_FILE
        write_chrome_trace(events, trace)
        from hicache_obs.cli._summary import transfer_totals

        totals = transfer_totals(events)
        summary: dict[str, Any] = {
            "steps": args.steps,
            "engine": args.engine,
            "sglang_release": harness.release if harness is not None else None,
            "seed": args.seed,
            "runtime": args.runtime,
            "model": args.model,
            "io_backend": args.io_backend,
            "layout": args.layout,
            "write_policy": args.write_policy,
            "fault": args.fault,
            "profile": profile.name,
            "audit_sample": profile.audit_sample,
            "events": len(log),
            **totals.to_dict(),
            "hit_rate": stats.hit_rate,
            "tokens": dict(stats.tokens),
            "requests": stats.requests,
            "writes": dict(stats.writes),
            "loads": dict(stats.loads),
            "evictions": dict(stats.evictions),
            "violations": auditor.counts(),
            "data_intact": stats.data_intact,
            "checked_slots": stats.checked_slots,
            "corruptions": stats.corruptions,
            "corrupted_slots": [c.to_dict() for c in stats.corrupted],
            "out": str(out),
            "files": {"events": [str(p) for p in store.sink.paths], "trace": str(trace)},
            "metrics_url": metrics_url,
            "otlp_endpoint": otlp_endpoint,
            "sinks": {r.name: _sink_stats(r) for r in log.sinks},
            "wall_seconds": wall,
        }
        try:  # with --serve, Ctrl-C is how the demo ends, whenever it comes
            if args.json:
                print(json.dumps(summary, indent=2), flush=True)
            else:
                _print_summary(summary, serving=args.serve)
            if args.serve:
                _serve(metrics_url, quiet=args.json)
        except KeyboardInterrupt:
            if not args.serve:
                raise
    return EXIT_OK


def _run_server(args: argparse.Namespace) -> int:
    """``--engine sglang``: SGLang's real server under ``hicache-obs instrument``, chat clients over HTTP."""
    from hicache_obs.lab.sglang import server_demo as sd

    sd.check_server_options(
        model=args.model, runtime=args.runtime, fault=args.fault, io_backend=args.io_backend, layout=args.layout
    )
    profile, _ = _chosen_profile(args, "metrics")  # the launcher's default
    release = sd.require_server()  # refusals and a missing server: before --out is touched
    args.runtime, args.layout = "cpu", args.layout or "page_first"
    out = Path(args.out)
    _prepare_out(out, "rank-*/events*.jsonl")
    otlp_endpoint = args.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
    say = (lambda msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    demo = sd.ServerDemo(
        model=args.model, steps=args.steps, out=out, io_backend=args.io_backend, layout=args.layout,
        write_policy=args.write_policy, device_tokens=args.device_tokens, seed=args.seed,
        metrics_port=args.metrics_port, otlp_endpoint=otlp_endpoint, profile=profile,
    )  # fmt: skip
    t_start = time.perf_counter()
    server = demo.server()
    metrics_url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    say(f"starting SGLang {release}'s server (about a minute on a CPU); its log: {server.log_path}")
    with server:
        say(f"serving at {server.url}; hicache-obs /metrics at {metrics_url}")
        try:
            with _progress(args.steps, enabled=not args.json and sys.stderr.isatty()) as advance:
                turns = demo.serve(server, on_request=advance)
            data = sd.check_data(server, turns)
            demo.settle(server)
        except OSError as exc:  # the server died or refused: say where its log is
            raise sd.stopped_error(server, exc) from None
        if args.serve:  # the summary of the folders as they are, then /metrics until Ctrl-C
            _show_server_summary(
                args,
                _server_summary(args, release, out, server, turns, data, metrics_url, otlp_endpoint, profile),
                t_start,
            )
            try:
                _serve(metrics_url, quiet=args.json)
            except KeyboardInterrupt:
                pass
            return EXIT_OK
    # the server is down: every rank closed its log, the summary counts every event it wrote
    _show_server_summary(
        args, _server_summary(args, release, out, server, turns, data, metrics_url, otlp_endpoint, profile), t_start
    )
    return EXIT_OK


def _show_server_summary(args: argparse.Namespace, summary: dict[str, Any], t_start: float) -> None:
    summary["wall_seconds"] = time.perf_counter() - t_start
    if args.json:
        print(json.dumps(summary, indent=2), flush=True)
    else:
        _print_server_summary(summary)


def _server_summary(
    args: argparse.Namespace, release: str, out: Path, server: Any, turns: list[Any], data: dict[str, Any],
    metrics_url: str, otlp_endpoint: str | None, profile: Any,
) -> dict[str, Any]:  # fmt: skip
    """The server demo's summary, from its rank folders."""
    from hicache_obs.cli._summary import transfer_totals
    from hicache_obs.events._replay import replay
    from hicache_obs.exporters._chrome_trace import write_chrome_trace
    from hicache_obs.lab.sglang.server_demo import MODEL_KINDS

    res = replay(out, audit=True)
    trace = out / TRACE_FILE
    write_chrome_trace(res.events, trace)
    violations: dict[str, dict[str, int]] = {}
    for f in res.findings or []:
        by_pool = violations.setdefault(f.rule, {})
        by_pool[f.pool] = by_pool.get(f.pool, 0) + 1
    return {
        "steps": args.steps,
        "engine": "sglang",
        "sglang_release": release,
        "seed": args.seed,
        "runtime": "cpu",
        "model": args.model,
        "served_model": MODEL_KINDS[args.model],
        "io_backend": args.io_backend,
        "layout": args.layout,
        "write_policy": args.write_policy,
        "fault": None,
        "profile": profile.name,
        "audit_sample": profile.audit_sample,
        "events": res.n_events,
        "ranks": res.ranks,
        **transfer_totals(res.events).to_dict(),
        "requests": len(turns),
        **data,
        "violations": violations,
        "out": str(out),
        "files": {
            "events": [str(p) for p in sorted(out.glob("rank-*/events*.jsonl"))],
            "trace": str(trace),
            "server_log": str(server.log_path),
        },
        "metrics_url": metrics_url,
        "otlp_endpoint": otlp_endpoint,
    }


def _print_server_summary(s: dict[str, Any]) -> None:
    con = console()
    e = escape_text  # paths, and the violations a log names, are printed as given, not as markup
    lines = [
        f"[bold]hicache-obs demo[/]: SGLang {e(s['sglang_release'])}'s server, {e(s['served_model'])} "
        f"({e(s['model'])}), {s['requests']} requests, {e(s['io_backend'])} / {e(s['layout'])} / "
        f"{e(s['write_policy'])}",
        f"  transfers: {s['operations']['d2h']} writes (d2h), {s['operations']['h2d']} loads (h2d), "
        f"failed {s['failed_operations']}",
        f"  prompt tokens from host: {s['host_hit_tokens']}, from device: {s['device_hit_tokens']}, "
        f"of {s['prompt_tokens']}",
        "  host-served answers equal to a recompute: "
        + ("[green]yes[/]" if s["data_intact"] else f"[red]no[/] ({s['mismatched_requests']} differ)")
        + f" ({s['checked_requests']} checked)",
        f"  [red]audit findings[/]: {e(s['violations'])}" if s["violations"] else "  audit: [green]no findings[/]",
        f"  {s['events']} events in {e(s['out'])}/ (ranks {s['ranks']}, profile {_profile_text(s)}); "
        f"trace: {e(s['files']['trace'])}",
    ]
    for line in lines:
        con.print(line, soft_wrap=True)


def _chosen_profile(args: argparse.Namespace, default: str) -> tuple[Any, str]:
    """The profile ``--profile`` and ``--audit-sample`` name (a share alone: ``metrics`` with that
    share, so ``sampling`` above 0), else ``HICACHE_OBS_PROFILE`` and ``HICACHE_OBS_AUDIT_SAMPLE``,
    else ``default``; with where it came from, for a message. A bad value is a
    :class:`CliError` naming the options or variables that gave it."""
    from hicache_obs._profiles import AUDIT_SAMPLE_ENV, PROFILE_ENV, profile_from_env, resolve_profile
    from hicache_obs.errors import ConfigError

    name, share = getattr(args, "profile", None), getattr(args, "audit_sample", None)
    if name is None and share is None:
        try:
            profile = profile_from_env(default=default)
        except ConfigError as exc:
            raise CliError(str(exc)) from None  # it names the variables
        named = [f"{var}={os.environ[var]}" for var in (PROFILE_ENV, AUDIT_SAMPLE_ENV) if os.environ.get(var)]
        return profile, " ".join(named) or "the default"
    given = " ".join(f"{opt} {val}" for opt, val in (("--profile", name), ("--audit-sample", share)) if val is not None)
    try:
        return resolve_profile(name or "metrics", share), given
    except ConfigError as exc:
        raise CliError(f"{given}: {exc}") from None


def _profile(args: argparse.Namespace) -> Any:
    """The demo controller's profile (default ``audit``). ``--engine sglang-controller`` takes
    ``audit`` only: it reads the slots a load or write took from the log's ``SlotsAllocated``
    events, which only ``audit`` records."""
    profile, given = _chosen_profile(args, "audit")
    if getattr(args, "engine", "ours") == "sglang-controller" and not profile.full:
        raise CliError(
            f"{given}: --engine sglang-controller takes the audit profile only, not {profile.name!r}: it "
            "reads the slots SGLang took from the allocation events only that profile records"
        )
    return profile


def _sglang_harness(args: argparse.Namespace, spec: Any) -> Any:
    """``--engine sglang``: refuse what it cannot honour, then build SGLang's pools and controller.

    Resolves ``args.runtime`` (``cpu`` unless ``cuda``) and ``args.layout`` (the release's default when not
    given; the one SGLang really uses, e.g. ``page_first_direct`` for direct + page_first)."""
    from hicache_obs.lab.sglang import engine
    from hicache_obs.lab.sglang.harness import LayoutRefused, mamba_host_layouts

    chosen = args.layout is not None or args.io_backend is not None
    args.io_backend = args.io_backend or "kernel"
    engine.check_options(
        model=args.model, runtime=args.runtime, fault=args.fault, io_backend=args.io_backend, layout=args.layout
    )
    engine.require_sglang()
    args.runtime = args.runtime or engine.ENGINE_RUNTIME
    layout = args.layout or engine.default_layout(args.runtime)

    def build(io_backend: str, layout: str) -> Any:
        return engine.build_harness(
            spec,
            io_backend=io_backend,
            layout=layout,
            write_policy=args.write_policy,
            device_tokens=args.device_tokens,
            runtime=args.runtime,
        )

    try:
        harness = build(args.io_backend, layout)
    except LayoutRefused as exc:
        # the release's Mamba host pool takes page_first_direct (with the direct backend) only
        if chosen or "page_first_direct" not in mamba_host_layouts():
            raise
        harness = build("direct", "page_first_direct")
        print(
            f"hicache-obs: {str(exc).rstrip('.')}; running --io-backend direct --layout page_first_direct instead",
            file=sys.stderr,
            flush=True,
        )
        args.io_backend = "direct"
    args.layout = harness.layout
    return harness


def _pool_bytes(spec: Any, device_tokens: int, *, device_tier: bool = True) -> int:
    """Bytes the pools of the workload take in host memory: the host tier (``host_ratio`` x
    device) and, with ``device_tier`` (the cpu and sim runtimes), the device tier too."""
    from hicache_obs.lab.workload import controller_options

    opts = controller_options(spec, device_tokens)
    sizes = {"kv": opts["device_size"], **opts["pool_sizes"]}
    tiers = float(opts["host_ratio"]) + (1.0 if device_tier else 0.0)
    return int(sum(spec.slot_bytes(name) * n * tiers for name, n in sizes.items()))


def _available_memory() -> int | None:
    """Memory this machine can give now: ``MemAvailable`` (Linux), else physical memory."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return None  # pragma: no cover - every POSIX system answers one of them


def _check_pool_memory(spec: Any, device_tokens: int, *, device_tier: bool = True) -> None:
    """Refuse a ``--device-tokens`` whose pools cannot fit in memory (torch would fail, or the
    kernel's OOM killer would end the run, after minutes of zeroing pages)."""
    need = _pool_bytes(spec, device_tokens, device_tier=device_tier)
    have = _available_memory()
    if have is not None and need > have:
        tiers = "device and host tiers" if device_tier else "host tier"
        raise CliError(
            f"--device-tokens {device_tokens}: the pools of model {spec.name} need {fmt_bytes(need)} "
            f"({tiers}), more than the {fmt_bytes(have)} of memory available"
        )


def _sink_stats(runner: Any) -> dict[str, int]:
    """A runner's counts plus what its sink lost after taking events (spans a collector refused)."""
    st = dict(runner.stats())
    delivery = getattr(runner.sink, "delivery_stats", None)
    if delivery is not None:
        extra = delivery()
        st["dropped"] += int(extra.get("dropped", 0))
        st["errors"] += int(extra.get("errors", 0))
    return st


def _prepare_out(out: Path, glob: str) -> None:
    """Create ``out`` and check that this process can write there, before any work is done;
    remove an earlier run's segments and trace (they would not replay with this run's).

    A ``trace.json`` that is a symlink, a FIFO or a device is left alone and written through
    (or in place) at the end, as :func:`hicache_obs._files.write_text` does."""
    import tempfile

    from hicache_obs._files import OutputPathError, check_output, make_dirs

    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a folder")
    try:
        make_dirs(out)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".hicache-probe.")  # /proc/self, a read-only mount...
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise CliError(f"--out {out}: cannot write there: {exc.strerror or exc}") from None
    try:
        check_output(out / TRACE_FILE)
    except OutputPathError as exc:
        raise CliError(f"--out {out}: {exc}") from None
    for old in [*out.glob(glob), out / TRACE_FILE]:
        if old.is_file() and not old.is_symlink():
            old.unlink()


def _start_metrics(log: Any, port: int) -> tuple[str, Any]:
    from prometheus_client import CollectorRegistry

    from hicache_obs.exporters._metrics_server import start_metrics_server
    from hicache_obs.exporters._prometheus import PrometheusSink

    registry = CollectorRegistry()
    log.add_sink(PrometheusSink(registry, log=log))
    try:
        server, bound = start_metrics_server(registry, port=port, addr="127.0.0.1")
    except OSError as exc:
        raise CliError(f"cannot serve /metrics on 127.0.0.1:{port}: {exc.strerror or exc}") from None
    return f"http://127.0.0.1:{bound}/metrics", server


def _attach_otel(log: Any, endpoint: str | None) -> Callable[[], None]:
    """Attach the span sink; returns what shuts its provider down (after the log closed)."""
    from hicache_obs.exporters._otel import OtelSpanSink

    if endpoint is None:  # OTEL_EXPORTER_OTLP_ENDPOINT and friends configure the sink's own provider
        log.add_sink(OtelSpanSink(service_name="hicache-obs-demo"))
        return lambda: None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    # the sink owns the provider, so failed exports count as its drops and errors
    log.add_sink(OtelSpanSink(service_name="hicache-obs-demo", exporter=OTLPSpanExporter(endpoint=url)))
    return lambda: None


@contextlib.contextmanager
def _quiet_controller_warnings() -> Iterator[None]:
    logger = logging.getLogger("hicache_obs.controller")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _progress(total: int, *, enabled: bool) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda done: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("serving"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task("serving", total=total)
        yield lambda done: progress.update(task, completed=done)


def _serve(url: str, *, quiet: bool) -> None:
    if not quiet:
        print(f"serving {url} until Ctrl-C", file=sys.stderr)
    while True:
        time.sleep(3600)


# -------------------------------------------------------------- summary
def _profile_text(s: dict[str, Any]) -> str:
    """``audit``, ``metrics``, or ``sampling (0.01 of the operations audited)``."""
    if s["profile"] != "sampling":
        return str(s["profile"])
    return f"sampling ({s['audit_sample']:.4g} of the operations audited)"


def _print_summary(s: dict[str, Any], *, serving: bool = False) -> None:
    from rich.table import Table

    con = console()
    e = escape_text  # pool names (SGLang's, or a log's), paths and URLs are printed as given, not as markup
    fault = f", fault {s['fault']}" if s["fault"] else ""
    engine = f"SGLang {s['sglang_release']}'s controller" if s.get("sglang_release") else "our controller"
    con.print(
        f"[bold]hicache-obs demo[/]: {s['model']} on {s['runtime']} ({engine}), {s['steps']} requests, seed {s['seed']}, "
        f"{s['wall_seconds']:.2f} s\n"
        f"{s['io_backend']} io backend, {s['layout']} host layout, {s['write_policy']}{fault}, "
        f"profile {_profile_text(s)}"
    )

    t = Table(title="Transfers (completed)", title_justify="left")
    for col in ("direction", "ops", "failed", "pool", "slots", "bytes", "bandwidth"):
        t.add_column(col, justify="left" if col in ("direction", "pool") else "right")
    for d, label in (("d2h", "d2h write"), ("h2d", "h2d load")):
        pools = list(s["slots"])
        for i, pool in enumerate(pools):
            first = i == 0
            t.add_row(
                label if first else "",
                str(s["operations"][d]) if first else "",
                str(s["failed_operations"][d]) if first else "",
                e(pool),
                str(s["slots"][pool][d]),
                fmt_bytes(s["bytes"][pool][d]),
                fmt_rate(s["bandwidth_bytes_per_s"][d]) if first else "",
            )
    con.print(t)

    hr, tok = s["hit_rate"], s["tokens"]
    c = Table(title="Cache", title_justify="left", show_header=False)
    c.add_column("what")
    c.add_column("value")
    c.add_row(
        "hit rate (tokens)",
        f"device {hr['device']:.1%} ({tok['device_hit']}), host {hr['host']:.1%} ({tok['host_hit']}), "
        f"miss {hr['miss']:.1%} ({tok['miss']})",
    )
    w, ld, ev = s["writes"], s["loads"], s["evictions"]
    c.add_row(
        "writes", f"{w['issued']} issued, {w['completed']} done, {w['failed']} failed, {w['host_full']} host full"
    )
    c.add_row(
        "loads",
        f"{ld['issued']} issued, {ld['completed']} done, {ld['failed']} failed, {ld['device_full']} device full",
    )
    c.add_row(
        "evictions",
        f"device {ev['device']}, host {ev['host']}, dropped {ev['dropped']}, lost to failed loads {ev['lost']}",
    )
    con.print(c)

    a = Table(title="Audit and data", title_justify="left")
    a.add_column("rule")
    a.add_column("pool")
    a.add_column("violations", justify="right")
    for rule, pools in sorted(s["violations"].items()):
        for pool, n in sorted(pools.items()):
            a.add_row(f"[red]{e(rule)}[/]", e(pool), str(n))
    if not s["violations"]:
        a.add_row("[green]none[/]", "", "0")
    con.print(a)
    if s["data_intact"]:
        con.print(
            f"[green]data intact[/]: {s['checked_slots']} loaded/backed-up slots bit-identical to what was written"
        )
    else:
        con.print(
            f"[red bold]data corrupted[/]: {s['corruptions']} checks found slots that differ from what was written"
        )
        for item in s["corrupted_slots"][:5]:
            con.print(
                f"  node {item['node']} pool {e(item['pool'])} after {item['direction']} op {item['op']}: "
                f"{item['tier']} slots {fmt_ids(item['slots'], 6)}"
            )

    out = e(s["out"])
    lines = [
        f"events:  {out}/ ({len(s['files']['events'])} segment(s), {s['events']} events)",
        f"trace:   {e(s['files']['trace'])}  (open in https://ui.perfetto.dev)",
        f"metrics: {e(s['metrics_url'])}" + ("" if serving else "  (until exit; --serve keeps it)"),
    ]
    if s["otlp_endpoint"]:
        otel = s["sinks"].get("otel", {})
        lost = otel.get("dropped", 0)
        note = f"  ({lost} lost: the collector did not take them)" if lost else ""
        lines.append(f"spans:   exported to {e(s['otlp_endpoint'])}{note}")
    lines += [f"next:    hicache-obs audit {out}", f"         hicache-obs inspect {out}"]
    con.print()
    for line in lines:  # paths and commands stay whole, to be copied
        con.print(line, no_wrap=True, crop=False, overflow="ignore")
