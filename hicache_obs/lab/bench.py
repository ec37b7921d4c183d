"""``hicache-obs bench``: overhead and bandwidth ratios, measured side by side in one run.

Every figure is a ratio of two things measured in the same process, interleaved
round by round (this machine is shared and noisy): the median of the per-round
ratios is reported with its spread (min, max). Times: ``ours / reference``
(lower is better, 1.0 = no overhead). Rates: ``ours / reference`` (higher is
better, 1.0 = as fast as the reference).

Sections: ``overhead`` (the demo workload with observability on vs the bare
controller), ``events`` (append, durable write and replay+audit rates vs a floor
loop doing the least the same work needs; replay+audit as ``hicache-obs audit`` runs
it, folded as read with no event kept, and beside it with every event kept), ``data_path`` (write/load bytes per
second vs ``Tensor.copy_`` of the same bytes between contiguous buffers), ``sglang``
(where SGLang is installed in this Python: a serving workload on SGLang's real HiCache
controller, instrumented with the sinks of ``overhead`` (a) in the sink host vs bare, in
a fresh interpreter of its own; elsewhere ``{"available": false, "reason": ...}``).
"""

from __future__ import annotations

import gc
import io
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from hicache_obs import _native

__all__ = [
    "Ratio",
    "ratio_of_times",
    "ratio_of_rates",
    "interleave",
    "bench_events",
    "bench_data_path",
    "bench_overhead",
    "bench_sglang",
    "bench_sglang_here",
    "sglang_workload",
    "run_bench",
    "TARGETS",
]

#: What the performance issue asks for: (key, comparison, bound).
TARGETS: list[tuple[str, str, float]] = [
    ("overhead.events_metrics_ratio", "<=", 1.05),
    ("overhead.with_otel_ratio", "<=", 1.10),
    ("overhead.with_durable_log_ratio", "<=", 1.10),
    ("events.append_per_s", ">=", 1_000_000),
    ("events.durable_per_s", ">=", 300_000),
    ("events.replay_audit_per_s", ">=", 500_000),
    ("events.append_vs_floor", ">=", 1 / 3),
    ("events.durable_vs_floor", ">=", 1 / 3),
    ("events.replay_vs_floor", ">=", 1 / 3),
    ("data_path.page_first.ps16.write_vs_memcpy", ">=", 0.7),
    ("data_path.page_first.ps16.load_vs_memcpy", ">=", 0.7),
    ("data_path.page_first.ps64.write_vs_memcpy", ">=", 0.7),
    ("data_path.page_first.ps64.load_vs_memcpy", ">=", 0.7),
    ("sglang.overhead_ratio", "<=", 1.05),
    ("sglang.profiles.metrics.controller_cpu_ratio", "<=", 1.03),
    ("sglang.profiles.metrics.events_per_op", "<=", 2.0),
    ("sglang.profiles.audit.controller_cpu_ratio", "<=", 1.15),
    ("sglang.profiles.sampling_minus_metrics", "within", 0.01),  # of metrics, either way
]


@dataclass(frozen=True)
class Ratio:
    """Median of per-round ratios, with their min and max."""

    median: float
    lo: float
    hi: float
    n: int


def _ratio(values: list[float]) -> Ratio:
    if not values:
        raise ValueError("no rounds to take a ratio of")
    return Ratio(statistics.median(values), min(values), max(values), len(values))


def ratio_of_times(ours: list[float], reference: list[float]) -> Ratio:
    """Per-round ``ours / reference`` of durations (same round index = measured side by side)."""
    if len(ours) != len(reference):
        raise ValueError(f"rounds differ: {len(ours)} vs {len(reference)}")
    return _ratio([o / r for o, r in zip(ours, reference)])


def difference_by_round(ours: list[float], reference: list[float]) -> Ratio:
    """Per-round ``ours - reference`` of two ratios taken over the same rounds (paired: what
    the rounds' common denominator adds to both cancels), its median and spread."""
    if len(ours) != len(reference):
        raise ValueError(f"rounds differ: {len(ours)} vs {len(reference)}")
    return _ratio([o - r for o, r in zip(ours, reference)])


def ratio_of_rates(ours: list[float], reference: list[float]) -> Ratio:
    """Per-round ``ours / reference`` of rates (higher is better)."""
    return ratio_of_times(ours, reference)


def interleave(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Run every function once per round, rotating the order; collect what each returns."""
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(fns[name]())
    return out


def _timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------- events
def _sample_events(n: int) -> list[Any]:
    """A realistic mix: the events of a hybrid demo workload, repeated to ``n``."""
    from hicache_obs.events._log import EventLog
    from hicache_obs.lab.workload import Workload
    from hicache_obs.testing import make_controller

    log = EventLog(capacity=None)
    from hicache_obs.core._spec import ModelSpec
    from hicache_obs.lab.workload import controller_options

    spec = ModelSpec.tiny_hybrid()
    c = make_controller(spec, log=log, **controller_options(spec))
    Workload(c, seed=1).run(60)
    c.close()
    base = log.events()
    out: list[Any] = []
    seq = 0
    while len(out) < n:
        for ev in base:
            out.append(msgspec.structs.replace(ev, seq=seq))
            seq += 1
            if len(out) == n:
                break
    return out


def bench_events(n: int = 200_000, rounds: int = 5) -> dict[str, Any]:
    from hicache_obs.events._log import EventLog
    from hicache_obs.events._replay import replay
    from hicache_obs.events._schema import SlotsFreed
    from hicache_obs.events._store import JsonlStore

    events = _sample_events(n)
    tmp = Path(tempfile.mkdtemp(prefix="hicache-bench-"))
    try:
        enc = msgspec.json.Encoder()

        def append() -> float:
            log = EventLog(capacity=n)
            sink: list[Any] = []
            log.subscribe(sink.append)
            emit = log.emit
            t = _timed(
                lambda: [
                    emit(SlotsFreed, pool="kv", tier="host", indices=((i, 16),), reason="evict", op=i) for i in range(n)
                ]
            )
            return n / t

        def append_floor() -> float:
            def run() -> None:
                out: list[Any] = []
                add = out.append
                for i in range(n):
                    add((i, 0, 0, "kv", "host", ((i, 16),), "evict", i))

            return n / _timed(run)

        counter = [0]

        def durable() -> float:
            counter[0] += 1
            d = tmp / f"store{counter[0]}"
            store = JsonlStore(d, max_bytes=1 << 30)

            def run() -> None:
                for i in range(0, n, 4096):
                    store.handle_batch(events[i : i + 4096])
                store.close()

            return n / _timed(run)

        def durable_floor() -> float:
            counter[0] += 1
            path = tmp / f"floor{counter[0]}.jsonl"

            def run() -> None:
                with open(path, "wb") as fh:
                    for i in range(0, n, 4096):
                        fh.write(b"".join([enc.encode(e) + b"\n" for e in events[i : i + 4096]]))

            return n / _timed(run)

        log_dir = tmp / "replay"
        store = JsonlStore(log_dir, max_bytes=1 << 30)
        store.handle_batch(events)
        store.close()
        raw = store.paths[0].read_bytes()

        def replay_audit() -> float:  # as `hicache-obs audit` does: audited as read, no event kept, no bookkeeping
            def run() -> None:
                replay(log_dir, audit=True, keep_events=False, states=False)

            return n / _timed(run)

        def replay_audit_retained() -> float:  # every event kept in memory (and freed after)
            def run() -> None:
                replay(log_dir, audit=True)

            return n / _timed(run)

        def replay_floor() -> float:
            dec = msgspec.json.Decoder()

            def run() -> None:
                decode = dec.decode
                for line in raw.splitlines():
                    decode(line)

            return n / _timed(run)

        got = interleave(
            {
                "append": append,
                "append_floor": append_floor,
                "durable": durable,
                "durable_floor": durable_floor,
                "replay": replay_audit,
                "replay_retained": replay_audit_retained,
                "replay_floor": replay_floor,
            },
            rounds,
        )
        out: dict[str, Any] = {
            "n_events": n,
            "append_per_s": statistics.median(got["append"]),
            "durable_per_s": statistics.median(got["durable"]),
            "replay_audit_per_s": statistics.median(got["replay"]),
            "replay_audit_retained_per_s": statistics.median(got["replay_retained"]),
            "append_floor_per_s": statistics.median(got["append_floor"]),
            "durable_floor_per_s": statistics.median(got["durable_floor"]),
            "replay_floor_per_s": statistics.median(got["replay_floor"]),
        }
        for key, ours, ref in (
            ("append_vs_floor", "append", "append_floor"),
            ("durable_vs_floor", "durable", "durable_floor"),
            ("replay_vs_floor", "replay", "replay_floor"),
            ("replay_retained_vs_floor", "replay_retained", "replay_floor"),
        ):
            r = ratio_of_rates(got[ours], got[ref])
            out[key] = r.median
            out[key + "_spread"] = [r.lo, r.hi]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------- data path
def _data_spec(page_size: int) -> Any:
    from hicache_obs.core._spec import ModelSpec

    # large enough items (2 KiB per token, layer and k/v) that copies are memory-bound
    return ModelSpec(name="bench", num_layers=8, num_kv_heads=8, head_dim=128, page_size=page_size)


def bench_data_path(
    tokens: int = 1024, rounds: int = 5, page_sizes: tuple[int, ...] = (1, 16, 64), runtime: str = "cpu"
) -> dict[str, Any]:
    from hicache_obs.core._controller import HiCacheController

    out: dict[str, Any] = {}
    for layout in ("layer_first", "page_first"):
        out[layout] = {}
        for ps in page_sizes:
            spec = _data_spec(ps)
            c = HiCacheController(spec, runtime=runtime, device_size=tokens * 2, layout=layout, host_ratio=1.0)
            # a fragmented device: every other page of a node is taken by another node
            a = c.alloc_device(tokens * 2)
            assert a is not None
            keep = a.view(-1, ps)[0::2].reshape(-1)
            drop = a.view(-1, ps)[1::2].reshape(-1)
            c.free_device(drop)
            kv = keep
            nbytes = kv.numel() * spec.slot_bytes("kv")
            if runtime == "cuda":  # the reference is a pinned cudaMemcpyAsync of the same bytes
                src = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
                dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
            else:
                src = torch.ones(nbytes, dtype=torch.uint8)
                dst = torch.zeros(nbytes, dtype=torch.uint8)
            sync = c.runtime.synchronize
            host = c.write(kv)
            c.poll_writes()
            assert host is not None

            def memcpy(src: torch.Tensor = src, dst: torch.Tensor = dst, nbytes: int = nbytes, sync: Any = sync) -> float:
                def run() -> None:
                    dst.copy_(src, non_blocking=True)
                    sync()

                return nbytes / _timed(run)

            def write(c: Any = c, kv: torch.Tensor = kv, nbytes: int = nbytes) -> float:
                def run() -> None:
                    h = c.write(kv)
                    c.synchronize()
                    c.poll_writes()
                    c.evict_host(h)

                return nbytes / _timed(run)

            def load(c: Any = c, host: torch.Tensor = host, nbytes: int = nbytes) -> float:
                holder: list[Any] = []

                def run() -> None:
                    d = c.load(host)
                    c.start_loading()
                    c.synchronize()
                    c.poll_loads()
                    holder.append(d)

                t = nbytes / _timed(run)
                c.free_device(holder[0])
                return t

            # the copy kernels alone, on the same pools and slots: what the data path would
            # reach with no controller work around the copies (its ceiling)
            from hicache_obs.core._transfer import launch_backup, plan_runs

            hp, dp = c.host_pools["kv"], c.device_pools["kv"]
            runs = plan_runs(c.io_backend, host, kv, c.runtime)  # as the controller chooses

            def kernel(
                host: torch.Tensor = host,
                kv: torch.Tensor = kv,
                nbytes: int = nbytes,
                runs: Any = runs,
                c: Any = c,
                hp: Any = hp,
                dp: Any = dp,
            ) -> float:
                def run() -> None:
                    with c.runtime.use(c.write_stream):
                        launch_backup(c.runtime, hp, dp, host, kv, runs)
                    c.runtime.synchronize()

                return nbytes / _timed(run)

            for fn in (memcpy, write, load, kernel):  # warm up: page faults, allocator caches
                fn()
            got = interleave({"memcpy": memcpy, "write": write, "load": load, "kernel": kernel}, rounds)
            w = ratio_of_rates(got["write"], got["memcpy"])
            ld = ratio_of_rates(got["load"], got["memcpy"])
            kw = ratio_of_rates(got["kernel"], got["memcpy"])
            out[layout][f"ps{ps}"] = {
                "write_vs_memcpy": w.median,
                "write_vs_memcpy_spread": [w.lo, w.hi],
                "load_vs_memcpy": ld.median,
                "load_vs_memcpy_spread": [ld.lo, ld.hi],
                "kernel_write_vs_memcpy": kw.median,
                "memcpy_bytes_per_s": statistics.median(got["memcpy"]),
                "write_bytes_per_s": statistics.median(got["write"]),
                "load_bytes_per_s": statistics.median(got["load"]),
                "bytes": nbytes,
            }
            c.close()
    return out


# -------------------------------------------------------------- overhead
CONFIGS = (
    "bare",
    "events_metrics",
    "with_otel",
    "with_durable_log",
    "events_metrics_inline_audit",
    "events_metrics_inprocess",
)
#: The configurations measured in every profile: (a), (b) and (c).
PROFILE_CONFIGS = ("events_metrics", "with_otel", "with_durable_log")
#: The profiles the overhead section measures besides ``audit`` (the section's own figures),
#: ``sampling`` at :data:`~hicache_obs._profiles.DEFAULT_AUDIT_SAMPLE`.
OVERHEAD_PROFILES = ("metrics", "sampling")


def _observed_controller(
    config: str, runtime: str, out_dir: Path, profile: str = "audit"
) -> tuple[Any, Callable[[], None]]:
    """A demo-workload controller with the observability of ``config`` attached, in ``profile``.

    The three targets run the auditor and the sinks in a sink host process (the
    controller's process only encodes batches). For comparison,
    ``events_metrics_inline_audit`` is (a) with the auditor inline in the controller's
    process (its violations enter the log), and ``events_metrics_inprocess`` is that
    with the sinks on threads of the controller's process as well.
    """
    from hicache_obs.events._log import EventLog
    from hicache_obs.testing import make_controller

    log = EventLog(capacity=100_000)
    if config in ("events_metrics_inline_audit", "events_metrics_inprocess"):
        from hicache_obs.events._audit import Auditor

        Auditor().attach(log)
    if config == "events_metrics_inprocess":
        from hicache_obs.exporters._prometheus import PrometheusSink
        from hicache_obs.exporters._structlog_sink import StructlogSink, make_json_logger

        log.add_sink(PrometheusSink(log=log))
        log.add_sink(StructlogSink(make_json_logger(io.StringIO())))
    elif config != "bare":
        from hicache_obs.exporters.sinkhost import add_sink_host

        specs: list[dict[str, Any]] = [] if config == "events_metrics_inline_audit" else [{"sink": "audit"}]
        specs += [
            {"sink": "prometheus"},
            {"sink": "structlog", "file": str(out_dir / "lines.jsonl"), "level": "info"},
        ]
        if config in ("with_otel", "with_durable_log"):
            specs.append({"sink": "otel", "exporter": "memory"})
        if config == "with_durable_log":
            specs.append({"sink": "jsonl", "dir": str(out_dir / "log")})
        add_sink_host(log, specs)
    from hicache_obs.core._spec import ModelSpec
    from hicache_obs.lab.workload import controller_options

    spec = ModelSpec.tiny_hybrid()
    detail = "bookkeeping" if config == "bare" else "full"
    c = make_controller(
        spec, log=log, runtime=runtime, event_detail=detail, profile=profile, **controller_options(spec)
    )

    def close() -> None:
        c.close()
        log.close()
        for runner in log.sinks:  # a ratio measured while sinks lost events would flatter them
            st = runner.stats()
            if st["dropped"] or st["errors"]:
                raise RuntimeError(f"bench {config}/{runtime}: sink {runner.name} lost events: {st}")

    return c, close


def bench_overhead(
    steps: int = 150,
    rounds: int = 5,
    runtimes: tuple[str, ...] = ("sim", "cpu"),
    profiles: tuple[str, ...] = OVERHEAD_PROFILES,
) -> dict[str, Any]:
    """The demo workload on our controller, observed in each configuration vs bare.

    The section's figures (``events_metrics_ratio`` = (a), ``with_otel_ratio`` = (b),
    ``with_durable_log_ratio`` = (c), ``per_op_overhead_us``) are the ``audit`` profile's;
    ``profiles`` holds (a), (b), (c) and the per-op cost of every profile, ``audit`` and each
    of ``profiles``, measured in the same rounds."""
    from hicache_obs.lab.workload import Workload

    tmp = Path(tempfile.mkdtemp(prefix="hicache-bench-"))
    try:
        counter = [0]
        ops = [0]

        def make(config: str, runtime: str) -> Callable[[], float]:
            cfg, _, profile = config.partition("@")

            def run() -> float:
                counter[0] += 1
                c, close = _observed_controller(cfg, runtime, tmp / str(counter[0]), profile or "audit")
                w = Workload(c, seed=7)

                def go() -> None:
                    w.run(steps)
                    close()  # flushing every sink is part of the cost

                t = _timed(go)
                ops[0] = sum(c.state.completed.values()) + sum(c.state.failed.values())
                return t

            return run

        for name in profiles:
            if name not in OVERHEAD_PROFILES:
                raise ValueError(f"bench_overhead: profile {name!r} is not one of {', '.join(OVERHEAD_PROFILES)}")
        configs = list(CONFIGS) + [f"{cfg}@{name}" for name in profiles for cfg in PROFILE_CONFIGS]
        out: dict[str, Any] = {"steps": steps, "runtimes": list(runtimes)}
        per_runtime: dict[str, Any] = {}
        all_ratios: dict[str, list[float]] = {k: [] for k in configs[1:]}
        per_op: dict[str, list[float]] = {name: [] for name in ("audit", *profiles)}
        for rt in runtimes:
            fns = {cfg: make(cfg, rt) for cfg in configs}
            fns["bare"]()  # warm up
            got = interleave(fns, rounds)
            res: dict[str, Any] = {"ops": ops[0], "bare_s": statistics.median(got["bare"])}
            for cfg in configs[1:]:
                r = ratio_of_times(got[cfg], got["bare"])
                res[f"{cfg}_ratio"] = r.median
                res[f"{cfg}_ratio_spread"] = [r.lo, r.hi]
                all_ratios[cfg].extend(o / b for o, b in zip(got[cfg], got["bare"]))
            for name in per_op:
                a_cfg = "events_metrics" if name == "audit" else f"events_metrics@{name}"
                diff = [(a - b) / max(1, ops[0]) * 1e6 for a, b in zip(got[a_cfg], got["bare"])]
                per_op[name].extend(diff)
                if name == "audit":
                    res["per_op_overhead_us"] = statistics.median(diff)
            per_runtime[rt] = res
        by_profile: dict[str, dict[str, Any]] = {name: {} for name in per_op}
        for cfg in configs[1:]:
            r = _ratio(all_ratios[cfg])
            base, _, name = cfg.partition("@")
            if not name:
                out[f"{cfg}_ratio"] = r.median
                out[f"{cfg}_ratio_spread"] = [r.lo, r.hi]
                if base not in PROFILE_CONFIGS:
                    continue
            by_profile[name or "audit"][f"{base}_ratio"] = r.median
            by_profile[name or "audit"][f"{base}_ratio_spread"] = [r.lo, r.hi]
        for name, diffs in per_op.items():
            by_profile[name]["per_op_overhead_us"] = statistics.median(diffs)
        out["per_op_overhead_us"] = by_profile["audit"]["per_op_overhead_us"]
        out["profiles"] = by_profile
        out["by_runtime"] = per_runtime
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------- sglang
#: The sinks of the instrumented SGLang run: configuration (a) of ``overhead`` (event log,
#: auditor, Prometheus and structlog, the last three in the sink host process).
def _sglang_sink_specs(out_dir: Path) -> list[dict[str, Any]]:
    return [
        {"sink": "audit"},
        {"sink": "prometheus"},
        {"sink": "structlog", "file": str(out_dir / "lines.jsonl"), "level": "info"},
    ]


#: The rows of a balanced Latin square of four: over four rows each of four kinds runs once in
#: each place, and right after each other kind once.
_BALANCED_4 = ((0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1))

#: The orders of a round's slices: bare, instrumented, in-process and floor runs.
_KINDS = ("bare", "instrumented", "in_process", "floor")
_ORDERS = tuple(tuple(_KINDS[i] for i in row) for row in _BALANCED_4)


def turn_orders(kinds: tuple[str, ...], turns: int, start: int = 0) -> list[tuple[str, ...]]:
    """The order in which each of ``turns`` turns runs the four ``kinds``: the rows of a balanced
    Latin square in turn, from row ``start`` (mod 4). Over any four turns in a row each kind
    runs once in each place, and right after each other kind once."""
    if len(kinds) != len(_BALANCED_4):
        raise ValueError(f"turn_orders: takes {len(_BALANCED_4)} kinds, got {len(kinds)}: {kinds}")
    return [tuple(kinds[i] for i in _BALANCED_4[(start + t) % len(_BALANCED_4)]) for t in range(turns)]


#: (io backend, host layout) tried in order: the first whose warm-up runs is measured.
#: 0.5.10's kernel path refuses the hybrid model's Mamba host indices (they are never
#: moved to the device), so that release is measured on the direct backend.
SGLANG_BACKENDS: tuple[tuple[str, str], ...] = (("kernel", "page_first"), ("direct", "page_first"))


def _sink_host_cpu_us_per_event(log: Any, what: str) -> float | None:
    """The sink host's CPU time from ready to close per event it handled (None: it handled
    none), once ``log`` is closed; a ``RuntimeError`` where any sink lost events (a ratio
    measured while sinks lost events would flatter them)."""
    host_stats: dict[str, Any] = {}
    for runner in log.sinks:
        st = runner.stats()
        if st["dropped"] or st["errors"]:
            raise RuntimeError(f"{what}: sink {getattr(runner, 'name', runner)} lost events: {st}")
        host_stats = getattr(getattr(runner, "sink", None), "stats", None) or host_stats
    if not host_stats.get("events"):
        return None
    return float(host_stats["cpu_s"] / host_stats["events"] * 1e6)


def _sglang_plan(nodes: int, page_size: int, seed: int = 3) -> list[int]:
    """Tokens per node: 1 to 4 pages, the same plan in every round."""
    import random

    rng = random.Random(seed)
    return [page_size * rng.randint(1, 4) for _ in range(nodes)]


def sglang_workload(h: Any, plan: list[int], batch: int) -> int:
    """The serving pattern on a real SGLang controller; returns the operations (writes + loads).

    Per batch of ``batch`` nodes, as the radix cache drives HiCache: each node's KV (and
    one Mamba slot on a hybrid model) is backed up (``write``, write-through); the finished
    write acks are reaped in FIFO order; the device copies are freed (evicted from the
    device); the nodes are loaded back (one ``load`` each, one ``start_loading``) and the
    load ack reaped; then the loaded device slots are freed and the host copies evicted.
    No data is checked here (the adapter's tests check the data).
    """
    c = h.controller
    hybrid = h.mamba_allocator is not None
    ops = 0
    for start in range(0, len(plan), batch):
        written = []
        for i, tokens in enumerate(plan[start : start + batch]):
            kv = h.alloc_kv(tokens)
            mamba = h.alloc_mamba(1) if hybrid else None
            host, t = h.write(kv, mamba, node_id=start + i)
            if host is None:
                raise RuntimeError(f"sglang bench: no host room for node {start + i} ({tokens} tokens)")
            written.append((kv, mamba, host, t))
            ops += 1
        c.start_writing()  # a no-op where write() started it
        h.reap(wait=True)  # on a GPU the copies run on: their slots are reused next
        loaded = []
        for i, (kv, mamba, host, t) in enumerate(written):
            h.kv_allocator.free(kv)
            if mamba is not None:
                h.mamba_allocator.free(mamba)
            dev, lt = h.load(host, t.host_indices if t is not None else None, node_id=start + i)
            if dev is None:
                raise RuntimeError(f"sglang bench: no device room to load node {start + i}")
            loaded.append((dev, lt, host, t))
            ops += 1
        c.start_loading()
        h.reap(wait=True)
        for dev, lt, host, t in loaded:
            h.kv_allocator.free(dev)
            c.evict_host(host)
            if lt is not None:
                h.mamba_allocator.free(lt.device_indices)
                h.mamba_host.free(t.host_indices)
    return ops


def _sglang_free(h: Any) -> tuple[int, ...]:
    """Free slots of every pool: equal before and after a run, or the workload leaked."""
    out = [h.kv_allocator.available_size(), h.kv_host.available_size()]
    if h.mamba_allocator is not None:
        out += [h.mamba_allocator.available_size(), h.mamba_host.available_size()]
    return tuple(out)


def _sglang_check_idle(h: Any, free: tuple[int, ...], what: str) -> None:
    c = h.controller
    left = {n: len(getattr(c, n)) for n in ("write_queue", "load_queue", "ack_write_queue", "ack_load_queue")}
    if any(left.values()) or _sglang_free(h) != free:
        raise RuntimeError(
            f"sglang bench ({what}): the workload left work behind: {left}, free {_sglang_free(h)} vs {free}"
        )


def bench_sglang_here(
    nodes: int = 16,
    batch: int = 8,
    rounds: int = 5,
    slices: int = 4,
    backends: tuple[tuple[str, str], ...] = SGLANG_BACKENDS,
    device: str = "cpu",
) -> dict[str, Any]:
    """The ``sglang`` section, measured in this process (which must have SGLang).

    It builds SGLang's real pools and controller (:func:`~hicache_obs.lab.sglang.harness.build_controller`,
    which on the CPU installs a process-wide torch function mode
    for its CUDA stand-ins: run this in a process of its own, as :func:`bench_sglang` does). The
    same controller runs :func:`sglang_workload` bare and instrumented
    (:func:`~hicache_obs.integrations.sglang.instrument` with the sinks of configuration (a)
    in a sink host). A round rotates ``slices`` bare, ``slices`` instrumented, ``slices``
    in-process and ``slices`` floor runs (this machine's speed drifts within a second: short
    alternating runs see the same drift) and compares their totals; the round's ratio is one
    sample. An in-process run is the same instrumentation into an :class:`EventLog` of its
    own with no sinks: ``in_process_ratio`` and ``in_process_per_op_us`` are the adapter's and
    the log's share, and the rest of ``per_op_overhead_us`` the sink host's. A floor run is
    the adapter's hooks on the same boundaries emitting as many events (``floor_events``) with constant
    contents, reading nothing (:mod:`~hicache_obs.lab.sglang.floor`), into a log of its own with
    no sinks: ``floor_per_op_us`` is what reporting these steps from Python hooks costs
    whatever is read, and ``in_process_per_op_us`` minus it what the adapter's evidence
    (slots, devices, descriptions) adds. Each instrumented
    run ends when the sink host handled all of its events (``log.flush``), and closing the
    round's log (every sink flushed and closed) counts as instrumented time too. The log
    and its sink host are set up before, and the instrumentation attached before and
    detached after each instrumented run, untimed: nothing of it is left while a bare run
    goes (the process-wide ``record_stream`` observer included). ``ops``: writes plus
    loads of one round's bare (or instrumented) runs. ``device`` ``cuda`` builds SGLang's
    device pools on the GPU (``harness`` and ``kernels`` say what the copies ran on).
    """
    from hicache_obs.core._spec import ModelSpec
    from hicache_obs.events._log import EventLog
    from hicache_obs.exporters.sinkhost import add_sink_host
    from hicache_obs.integrations.sglang import instrument
    from hicache_obs.lab.sglang.floor import instrument_floor
    from hicache_obs.lab.sglang.harness import LayoutRefused, build_controller, kernel_sources, sglang_version

    spec = ModelSpec.tiny_hybrid()
    plan = _sglang_plan(nodes, spec.page_size)
    device_size = 4 * spec.page_size * batch * 2  # a batch of the largest nodes, twice over
    tmp = Path(tempfile.mkdtemp(prefix="hicache-bench-sglang-"))
    try:
        counter = [0]
        tried: list[str] = []
        h: Any = None
        for io_backend, layout in backends:
            try:
                h = build_controller(
                    spec, io_backend=io_backend, layout=layout, device_size=device_size, host_ratio=2.0, device=device
                )
            except LayoutRefused as exc:  # the release's Mamba host pool takes other layouts
                tried.append(f"{io_backend}/{layout}: {exc}")
                h = None
                continue
            free = _sglang_free(h)
            try:
                sglang_workload(h, plan[:batch], batch)  # the release runs this path at all
                _sglang_check_idle(h, free, f"{io_backend}/{layout}")
            except Exception as exc:
                first = str(exc).splitlines()[0] if str(exc) else ""
                tried.append(f"{io_backend}/{h.layout}: {type(exc).__name__}: {first}")  # and the next backend
                h.close()
                h = None
                continue
            break
        if h is None:
            raise RuntimeError("sglang bench: no io backend runs the workload: " + "; ".join(tried))
        harness = h

        def run(name: str, fn: Callable[[], Any], wall: dict[str, float], cpu: dict[str, float]) -> None:
            c0, t0 = time.thread_time(), time.perf_counter()
            fn()
            wall[name] += time.perf_counter() - t0
            cpu[name] += time.thread_time() - c0

        def one_round() -> tuple[dict[str, float], dict[str, float]]:
            """``slices`` bare, instrumented and in-process runs of the plan, rotating; their total times."""
            wall = {"bare": 0.0, "instrumented": 0.0, "in_process": 0.0, "floor": 0.0}
            cpu = {"bare": 0.0, "instrumented": 0.0, "in_process": 0.0, "floor": 0.0}
            counter[0] += 1
            in_process_events[0] = 0
            floor_events[0] = 0
            flush_s[0] = 0.0
            out_dir = tmp / str(counter[0])
            out_dir.mkdir()
            log = EventLog(capacity=100_000)
            add_sink_host(log, _sglang_sink_specs(out_dir))
            # each slice runs the four in one of the orders, in turn: over a round's four slices each
            # comes first, and right after each of the others, once (what one run leaves behind, a
            # sink host still busy or the caches, falls on every kind of run alike)
            names = [name for s in range(slices) for name in _ORDERS[(counter[0] + s) % len(_ORDERS)]]
            try:
                for name in names:
                    gc.collect()
                    if name == "bare":
                        run("bare", lambda: sglang_workload(harness, plan, batch), wall, cpu)
                        _sglang_check_idle(harness, free, "bare")
                        continue
                    # in_process: the same instrumentation into a log of this process with no sinks
                    # (what the adapter and the log cost, without the sink host's share); floor: the
                    # same hooks emitting constant events into such a log (nothing read)
                    into = log if name == "instrumented" else EventLog(capacity=100_000)
                    attach = instrument_floor if name == "floor" else instrument
                    inst = attach(harness.controller, log=into)  # attached and detached untimed
                    try:

                        def go(into: EventLog = into) -> None:
                            sglang_workload(harness, plan, batch)
                            f0 = time.perf_counter()
                            into.flush()  # the sink host (if any) handled every event of this run
                            if into is log:
                                flush_s[0] += time.perf_counter() - f0

                        run(name, go, wall, cpu)
                    finally:
                        inst.detach()
                        if into is not log:
                            (floor_events if name == "floor" else in_process_events)[0] += into.published
                            into.close()
                    if getattr(inst, "errors", 0):  # an observation that failed was cheaper than one made
                        raise RuntimeError(f"sglang bench: the instrumentation failed to observe {inst.errors} steps")
                    _sglang_check_idle(harness, free, name)
                run("instrumented", log.close, wall, cpu)  # closing every sink is part of the cost
            finally:
                log.close()
            per_event = _sink_host_cpu_us_per_event(log, "sglang bench")
            if per_event is not None:
                host_cpu_per_event.append(per_event)
            flush_per_run.append(flush_s[0] / slices)
            events[0] = log.published
            return wall, cpu

        events = [0]
        in_process_events = [0]
        floor_events = [0]
        flush_s = [0.0]  # the round's waits for the sink host at the end of its instrumented runs
        flush_per_run: list[float] = []
        host_cpu_per_event: list[float] = []
        ops = 2 * len(plan) * slices  # per round and side
        got: dict[str, list[float]] = {"bare": [], "instrumented": [], "in_process": [], "floor": []}
        got_cpu: dict[str, list[float]] = {"bare": [], "instrumented": [], "in_process": [], "floor": []}
        gc.collect()
        gc.freeze()  # SGLang's and torch's objects: out of every collection the rounds trigger
        try:
            one_round()  # warm up both (first calls, the adapter's first instrumentation)
            flush_per_run.clear()
            host_cpu_per_event.clear()
            for _ in range(rounds):
                wall, cpu = one_round()
                for name in got:
                    got[name].append(wall[name])
                    got_cpu[name].append(cpu[name])
        finally:
            gc.unfreeze()
            harness.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r = ratio_of_times(got["instrumented"], got["bare"])
    per_op = [(i - b) / ops * 1e6 for i, b in zip(got["instrumented"], got["bare"])]
    ratios = sorted(i / b for i, b in zip(got["instrumented"], got["bare"]))
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    rc = ratio_of_times(got_cpu["instrumented"], got_cpu["bare"])
    rp = ratio_of_times(got["in_process"], got["bare"])
    per_op_in_process = [(i - b) / ops * 1e6 for i, b in zip(got["in_process"], got["bare"])]
    rf = ratio_of_times(got["floor"], got["bare"])
    per_op_floor = [(f - b) / ops * 1e6 for f, b in zip(got["floor"], got["bare"])]
    out: dict[str, Any] = {
        "available": True,
        "release": sglang_version(),
        "overhead_ratio": r.median,
        "overhead_ratio_spread": [r.lo, r.hi],
        "overhead_ratio_iqr": [q[0], q[2]],
        "per_op_overhead_us": statistics.median(per_op),
        "per_op_overhead_us_spread": [min(per_op), max(per_op)],
        "rounds": r.n,
        "slices_per_round": slices,
        "ops": ops,
        "events": events[0],
        "nodes": len(plan),
        "batch": batch,
        "tokens": sum(plan),
        "bare_s": statistics.median(got["bare"]),
        "instrumented_s": statistics.median(got["instrumented"]),
        "bare_per_op_us": statistics.median(got["bare"]) / ops * 1e6,
        # the controller thread's CPU time alone (the sink host's is not in it): steadier
        # than wall time on a loaded machine, and what the instrumentation adds in-thread
        "controller_cpu_ratio": rc.median,
        "controller_cpu_ratio_spread": [rc.lo, rc.hi],
        # the same runs' share without the sink host: the adapter and an in-process log with no
        # sinks, measured in the same rounds (what is left of per_op_overhead_us is the sink host's)
        "in_process_ratio": rp.median,
        "in_process_ratio_spread": [rp.lo, rp.hi],
        "in_process_per_op_us": statistics.median(per_op_in_process),
        "in_process_events": in_process_events[0],  # of one round's in-process runs, as ``events``
        # the same hooks emitting constant events, nothing read (the cost of reporting these
        # steps from Python at all), in the same rounds; its events of one round's floor runs
        "floor_ratio": rf.median,
        "floor_ratio_spread": [rf.lo, rf.hi],
        "floor_per_op_us": statistics.median(per_op_floor),
        "floor_events": floor_events[0],
        # of the sink host's share: the wait at the end of each instrumented run for the child to
        # handle what was handed over last (its work on the run's last batch), per operation, and
        # the child's CPU time per event it handled (beside the controller, on another core)
        "flush_wait_per_op_us": statistics.median(flush_per_run) / (ops / slices) * 1e6,
        "sink_host_cpu_us_per_event": statistics.median(host_cpu_per_event) if host_cpu_per_event else None,
        "io_backend": harness.io_backend,
        "layout": harness.layout,
        "model": spec.name,
        "sinks": [s["sink"] for s in _sglang_sink_specs(tmp)],
        "sink_host": True,
        "controller": type(harness.controller).__name__,
        # what the copies run on here: on a CPU per-op times are this harness's, not a GPU's
        "harness": (
            "CPU: torch stand-ins for sgl_kernel.kvcacheio, CPU streams, CUDA index stand-ins"
            if device == "cpu"
            else f"CUDA: {torch.cuda.get_device_name(0)}, SGLang's CUDA streams and events, pinned host pools"
        ),
        "device": device,
        "kernels": kernel_sources(),
    }
    if tried:
        out["backends_refused"] = tried
    return out


#: The profiles the ``sglang`` section's profile measure runs, beside the bare controller.
SGLANG_PROFILES = ("metrics", "audit", "sampling")


def _conversation_plan(turns: int, conversations: int, page_size: int, seed: int = 5) -> list[list[int]]:
    """Multi-turn requests: each turn of a conversation is its previous turn and one more page
    (a restart after six pages); the same plan in every run."""
    import random

    rng = random.Random(seed)
    convs = [[c * 100_000 + i for i in range(page_size)] for c in range(conversations)]
    out = []
    for r in range(turns):
        c = rng.randrange(conversations)
        toks = convs[c] + [c * 100_000 + 50_000 + r * page_size + i for i in range(page_size)]
        if len(toks) > 6 * page_size:
            toks = [c * 100_000 + 70_000 + r * page_size + i for i in range(page_size)]
        convs[c] = toks
        out.append(toks)
    return out


def bench_sglang_profiles_here(
    turns: int = 144,
    conversations: int = 8,
    rounds: int = 5,
    slices: int = 3,
    audit_sample: float = 0.01,
    backends: tuple[tuple[str, str], ...] = SGLANG_BACKENDS,
) -> dict[str, Any]:
    """The ``sglang`` section's measure per profile, in this process (which must have SGLang).

    SGLang's own hybrid tree cache (:func:`~hicache_obs.lab.sglang.tree.build_hybrid_tree`,
    write-through) serves a multi-turn plan as its scheduler does (match, load back, evict,
    insert, back up, poll), its rows never written or read (``without_data``: the model's work
    is not the cache's), with the copies off the controller's thread: queued on their streams
    and run by a worker thread of their own while the controller's thread waits for them, so
    they take nothing from it, as a GPU's kernels take nothing from the thread that launched
    them (:func:`~hicache_obs.lab.sglang.deferred.cuda_semantics` with ``worker``). Each
    step starts once the copies queued so far have run (a GPU's copies of this size finish
    within a step), so every run does the same work.

    A round serves the plan ``slices`` times, each time on four trees built for it (untimed): a
    bare one, and one instrumented with each profile of :data:`SGLANG_PROFILES` (``sampling``
    at ``audit_sample``) into a log whose auditor, Prometheus and structlog sinks run in a sink
    host. Each is instrumented as on a GPU
    (:func:`~hicache_obs.lab.sglang.gpu_view.instrument_as_on_a_gpu`: the device tiers unseen,
    though the harness keeps their free lists in host memory). Each turn of the plan runs on
    all four before the next turn starts, in the orders of :func:`turn_orders`, and only the
    turns themselves are timed: the machine's drift between runs a second apart cancels out of
    every ratio. Per profile: ``controller_cpu_ratio``, the controller thread's CPU time
    instrumented / bare (median of the rounds, ``_spread``), ``per_op_us``
    (what it adds per operation, writes plus loads queued), ``events_per_op`` and the sink
    host's CPU time per event it handled (``sink_host_cpu_us_per_event``, on its own core).
    ``controller_cpu_ratio_rounds``: each round's ratio. ``sampling_minus_metrics``: the median
    of the rounds' ``sampling`` ratio minus their ``metrics`` ratio (paired: both over the same
    bare turns), with its spread.
    """
    from hicache_obs.core._spec import ModelSpec
    from hicache_obs.events._log import EventLog
    from hicache_obs.events._schema import OperationQueued, OpsSubmitted
    from hicache_obs.exporters.sinkhost import add_sink_host
    from hicache_obs.lab.sglang.deferred import cuda_semantics
    from hicache_obs.lab.sglang.gpu_view import instrument_as_on_a_gpu
    from hicache_obs.lab.sglang.harness import LayoutRefused, prepare, sglang_version
    from hicache_obs.lab.sglang.tree import build_hybrid_tree

    prepare("cpu")
    spec = ModelSpec.tiny_hybrid()
    plan = _conversation_plan(turns, conversations, spec.page_size)
    tmp = Path(tempfile.mkdtemp(prefix="hicache-bench-profiles-"))
    try:
        kinds = ("bare", *SGLANG_PROFILES)

        def build(io_backend: str, layout: str) -> Any:
            th = build_hybrid_tree(
                spec, io_backend=io_backend, layout=layout, write_policy="write_through",
                device_size=24 * spec.page_size, host_ratio=4.0,
            )  # fmt: skip
            th.without_data()
            return th

        with cuda_semantics(worker=True):
            tried: list[str] = []
            chosen: tuple[str, str] | None = None
            for io_backend, layout in backends:
                try:
                    th = build(io_backend, layout)
                    for toks in plan[:8]:
                        th.serve(toks)
                    torch.cpu.synchronize()
                    th.step()
                except (LayoutRefused, RuntimeError) as exc:
                    first = str(exc).splitlines()[0] if str(exc) else ""
                    tried.append(f"{io_backend}/{layout}: {type(exc).__name__}: {first}")
                    while True:  # what that tree queued runs (and fails) before the next one starts
                        try:
                            torch.cpu.synchronize()
                            break
                        except RuntimeError:
                            continue
                    continue
                chosen = (io_backend, th.harness.layout)  # the layout SGLang took (direct: page_first_direct)
                tree_name = type(th.tree).__name__
                th.harness.close()
                break
            if chosen is None:
                raise RuntimeError("sglang profiles bench: no io backend serves the plan: " + "; ".join(tried))

            def fresh() -> Any:
                return build(*chosen)

            def serve_interleaved(trees: dict[str, Any], orders: list[tuple[str, ...]], cpu: dict[str, float]) -> None:
                """Each turn of the plan on every tree, in that turn's order; then each tree's last step."""
                sync = torch.cpu.synchronize
                clock = time.thread_time
                for toks, order in zip(plan, orders):
                    for name in order:
                        sync()  # the copies queued so far have run: the same work in every run
                        c0 = clock()
                        trees[name].serve(toks)
                        cpu[name] += clock() - c0
                for name in orders[len(plan)]:
                    sync()
                    c0 = clock()
                    trees[name].step()
                    cpu[name] += clock() - c0
                sync()

            def one_pass(
                trees: dict[str, Any],
                logs: dict[str, EventLog],
                cpu: dict[str, float],
                events: dict[str, int],
                ops: dict[str, int],
                start: int,
            ) -> None:
                """The plan served once on ``trees`` (bare and one per profile), turn by turn."""
                insts: dict[str, Any] = {}
                first: dict[str, int] = {}
                for name in SGLANG_PROFILES:
                    first[name] = logs[name].published
                    share = audit_sample if name == "sampling" else None
                    insts[name] = instrument_as_on_a_gpu(
                        trees[name].controller, log=logs[name], profile=name, audit_sample=share
                    )
                gc.collect()
                serve_interleaved(trees, turn_orders(kinds, len(plan) + 1, start=start), cpu)
                for name, inst in insts.items():
                    c0 = time.thread_time()
                    served = logs[name].published  # the events of serving (detach logs one more)
                    inst.detach()
                    logs[name].flush()  # the sink host handled all of it
                    cpu[name] += time.thread_time() - c0
                    if inst.errors:
                        raise RuntimeError(f"sglang profiles bench: {inst.errors} steps not observed")
                    got = logs[name].events()[first[name] : served]  # this pass's (the log keeps every event)
                    events[name] += len(got)
                    ops[name] += sum(
                        len(e.queued) if type(e) is OpsSubmitted else type(e) is OperationQueued for e in got
                    )

            counter = [0]

            def one_round() -> tuple[dict[str, float], dict[str, int], dict[str, int], dict[str, float]]:
                counter[0] += 1
                cpu = dict.fromkeys(kinds, 0.0)
                events = dict.fromkeys(SGLANG_PROFILES, 0)
                ops = dict.fromkeys(SGLANG_PROFILES, 0)
                logs: dict[str, EventLog] = {}
                for name in SGLANG_PROFILES:
                    out_dir = tmp / f"{counter[0]}-{name}"
                    out_dir.mkdir()
                    logs[name] = EventLog(capacity=1_000_000)
                    add_sink_host(logs[name], _sglang_sink_specs(out_dir))
                try:
                    for sl in range(slices):
                        trees: dict[str, Any] = {}
                        try:
                            for name in kinds:
                                trees[name] = fresh()
                            one_pass(trees, logs, cpu, events, ops, start=counter[0] * slices + sl)
                        finally:
                            for th in trees.values():
                                th.harness.close()
                    for name in SGLANG_PROFILES:
                        c0 = time.thread_time()
                        logs[name].close()  # closing every sink is part of the cost
                        cpu[name] += time.thread_time() - c0
                finally:
                    for log in logs.values():
                        log.close()
                host = {}
                for name, log in logs.items():
                    per_event = _sink_host_cpu_us_per_event(log, "sglang profiles bench")
                    if per_event is not None:
                        host[name] = per_event
                return cpu, events, ops, host

            gc.collect()
            gc.freeze()
            try:
                one_round()  # warm up
                got: list[tuple[dict[str, float], dict[str, int], dict[str, int], dict[str, float]]] = [
                    one_round() for _ in range(rounds)
                ]
            finally:
                gc.unfreeze()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    first_ops = got[0][2]
    if len(set(first_ops.values())) != 1:
        raise RuntimeError(f"sglang profiles bench: the profiles' runs queued different operations: {first_ops}")
    ops_per_run = first_ops[SGLANG_PROFILES[0]] / slices
    bare = [r[0]["bare"] for r in got]
    out: dict[str, Any] = {
        "release": sglang_version(),
        "tree": tree_name,
        "io_backend": chosen[0],
        "layout": chosen[1],
        "model": spec.name,
        "turns": len(plan),
        "ops_per_run": ops_per_run,
        "rounds": rounds,
        "slices_per_round": slices,
        "audit_sample": audit_sample,
        "bare_cpu_per_op_us": statistics.median(bare) / (ops_per_run * slices) * 1e6,
        "copies": "a worker thread of their own, run while the controller waits; each step after the last copies ran",
        "device_tiers": "unseen, as on a GPU",
    }
    for name in SGLANG_PROFILES:
        mine = [r[0][name] for r in got]
        per_round = [m / b for m, b in zip(mine, bare)]
        ratio = _ratio(per_round)
        per_op = [(i - b) / (ops_per_run * slices) * 1e6 for i, b in zip(mine, bare)]
        ev = [r[1][name] / r[2][name] for r in got if r[2][name]]
        host = [r[3][name] for r in got if name in r[3]]
        out[name] = {
            "controller_cpu_ratio": ratio.median,
            "controller_cpu_ratio_spread": [ratio.lo, ratio.hi],
            "controller_cpu_ratio_rounds": per_round,
            "per_op_us": statistics.median(per_op),
            "per_op_us_spread": [min(per_op), max(per_op)],
            "events_per_op": statistics.median(ev) if ev else None,
            "sink_host_cpu_us_per_event": statistics.median(host) if host else None,
        }
    diff = difference_by_round(
        out["sampling"]["controller_cpu_ratio_rounds"], out["metrics"]["controller_cpu_ratio_rounds"]
    )
    out["sampling_minus_metrics"] = diff.median
    out["sampling_minus_metrics_spread"] = [diff.lo, diff.hi]
    if tried:
        out["backends_refused"] = tried
    return out


def _sglang_child() -> None:
    """``python -c 'from hicache_obs.lab.bench import _sglang_child; _sglang_child()' PARAMS OUT``."""
    import json
    import sys

    params = json.loads(sys.argv[1])
    threads = params.pop("threads", None)
    if threads is not None:
        torch.set_num_threads(threads)
    backends = params.pop("backends", None)
    if backends is not None:
        params["backends"] = tuple(tuple(b) for b in backends)
    profiles = params.pop("profiles", None)
    result = bench_sglang_here(**params)
    if profiles is not None:  # the measure per profile, in the same process (its harness is prepared)
        from hicache_obs.errors import IntegrationError

        try:
            result["profiles"] = {"available": True, **bench_sglang_profiles_here(**profiles)}
        except IntegrationError as exc:  # a release without SGLang's hybrid tree cache
            result["profiles"] = {"available": False, "reason": str(exc)}
    result["torch_threads"] = torch.get_num_threads()
    Path(sys.argv[2]).write_text(json.dumps(result))


def sglang_unavailable_reason(python: str | None = None) -> str | None:
    """Why the ``sglang`` section cannot run in this Python (None: it can)."""
    import sys

    from hicache_obs.lab.sglang.harness import sglang_version

    if sglang_version() is None:
        return (
            f"SGLang is not installed in this Python ({python or sys.executable}); "
            "`make sglang` builds .sglang/<release>/bin/python, whose `-m hicache_obs bench` measures it"
        )
    return None


def bench_sglang(
    nodes: int = 16,
    batch: int = 8,
    rounds: int = 5,
    slices: int = 4,
    threads: int | None = 1,
    timeout: float | None = None,
    backends: tuple[tuple[str, str], ...] | None = None,
    profile_rounds: int | None = 5,
) -> dict[str, Any]:
    """The ``sglang`` section: :func:`bench_sglang_here` in a fresh interpreter of this Python,
    then (``profile_rounds`` rounds; None: not) :func:`bench_sglang_profiles_here` as ``profiles``.
    ``timeout``: how long the child may run (None: 600 s, and 120 s more for each profile
    round; a round takes about 30 s on a 2-core machine).

    A fresh process, so that the harness's process-wide torch function mode (its CUDA
    stand-ins) never slows the other sections. Where SGLang is not installed:
    ``{"available": False, "reason": ...}``; where its run fails: ``available`` true with
    ``error`` (the child's last lines), and no ratio. ``wall_s``: the child's wall time,
    SGLang's import included.
    """
    import json
    import subprocess
    import sys

    reason = sglang_unavailable_reason()
    if reason is not None:
        return {"available": False, "reason": reason}
    from hicache_obs.lab.sglang.harness import sglang_version

    if timeout is None:
        timeout = 600.0 + 120.0 * (profile_rounds or 0)
    params: dict[str, Any] = {"nodes": nodes, "batch": batch, "rounds": rounds, "slices": slices, "threads": threads}
    if profile_rounds is not None:
        params["profiles"] = {"rounds": profile_rounds}
    if backends is not None:
        params["backends"] = [list(b) for b in backends]
    with tempfile.TemporaryDirectory(prefix="hicache-bench-sglang-") as d:
        out = Path(d) / "result.json"
        code = "from hicache_obs.lab.bench import _sglang_child; _sglang_child()"
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code, json.dumps(params), str(out)],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {"available": True, "release": sglang_version(), "error": f"the SGLang bench ran past {timeout:g} s"}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            tail = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()][-3:]
            return {
                "available": True,
                "release": sglang_version(),
                "error": f"the SGLang bench exited {proc.returncode}: " + " | ".join(tail),
            }
        result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = wall
    return result


# ------------------------------------------------------------------ all
def _lookup(d: dict[str, Any], dotted: str) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def check_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with the measured value and whether it is met."""
    rows = []
    for key, op, bound in TARGETS:
        v = _lookup(result, key)
        if v is None:
            ok = None
        elif op == "within":
            ok = abs(v) <= bound
        else:
            ok = v <= bound if op == "<=" else v >= bound
        rows.append({"key": key, "target": f"{op} {bound:g}", "value": v, "met": ok})
    return rows


def run_bench(
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    sections: tuple[str, ...] = ("overhead", "events", "data_path", "sglang"),
    threads: int | None = 1,
    profile_rounds: int | None = None,
) -> dict[str, Any]:
    """Run the sections; ``quick`` keeps the whole run under a minute.

    ``profile_rounds``: the rounds of the ``sglang`` section's measure per profile
    (:func:`bench_sglang_profiles_here`; None: 2 with ``quick``, else 7). Its spread narrows
    as the square root of the rounds.

    ``threads`` sets torch's intra-op threads for the run (default 1: on a small
    shared machine OpenMP threads that spin while another process holds a core
    make copies tens of times slower, for ours and the references alike, and the
    ratios meaningless). ``None`` keeps torch's setting.
    """
    say = progress or (lambda s: None)
    if threads is not None:
        torch.set_num_threads(threads)
    result: dict[str, Any] = {
        "machine": {
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            # what each native piece ran on: "c" (compiled) or "py" (its pure twin)
            "implementations": dict(_native.IMPLEMENTATIONS),
        },
        "quick": quick,
    }
    if "overhead" in sections:
        say("overhead")
        result["overhead"] = bench_overhead(steps=100 if quick else 300, rounds=3 if quick else 15)
    if "events" in sections:
        say("events")
        result["events"] = bench_events(n=50_000 if quick else 200_000, rounds=3 if quick else 5)
    if "data_path" in sections:
        say("data path")
        result["data_path"] = bench_data_path(tokens=512 if quick else 2048, rounds=3 if quick else 7)
    if "sglang" in sections:  # last: its interpreter has exited before anything else could run
        say("sglang")
        result["sglang"] = bench_sglang(
            nodes=16,
            rounds=3 if quick else 15,
            slices=2 if quick else 4,
            threads=torch.get_num_threads() if threads is not None else None,
            profile_rounds=profile_rounds if profile_rounds is not None else 2 if quick else 7,
        )
    result["targets"] = check_targets(result)
    return result
