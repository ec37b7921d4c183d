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
second vs ``Tensor.copy_`` of the same bytes between contiguous buffers).
"""

from __future__ import annotations

import gc
import io
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

__all__ = [
    "Ratio",
    "ratio_of_times",
    "ratio_of_rates",
    "interleave",
    "bench_events",
    "bench_data_path",
    "bench_overhead",
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
]


@dataclass(frozen=True)
class Ratio:
    """Median of per-round ratios, with their min and max."""

    median: float
    lo: float
    hi: float
    n: int

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.lo, "max": self.hi, "rounds": self.n}


def _ratio(values: list[float]) -> Ratio:
    if not values:
        raise ValueError("no rounds to take a ratio of")
    return Ratio(statistics.median(values), min(values), max(values), len(values))


def ratio_of_times(ours: list[float], reference: list[float]) -> Ratio:
    """Per-round ``ours / reference`` of durations (same round index = measured side by side)."""
    if len(ours) != len(reference):
        raise ValueError(f"rounds differ: {len(ours)} vs {len(reference)}")
    return _ratio([o / r for o, r in zip(ours, reference)])


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
    from .events.log import EventLog
    from .testing import make_controller
    from .workload import Workload

    log = EventLog(capacity=None)
    from .core.spec import ModelSpec
    from .workload import controller_options

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
    from .events.log import EventLog
    from .events.replay import replay
    from .events.schema import SlotsFreed
    from .events.store import JsonlStore

    events = _sample_events(n)
    tmp = Path(tempfile.mkdtemp(prefix="hicache-bench-"))
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

    def replay_audit() -> float:  # as `hicache-obs audit` does: folded as read, no event kept
        def run() -> None:
            replay(log_dir, audit=True, keep_events=False)

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
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------- data path
def _data_spec(page_size: int) -> Any:
    from .core.spec import ModelSpec

    # large enough items (2 KiB per token, layer and k/v) that copies are memory-bound
    return ModelSpec(name="bench", num_layers=8, num_kv_heads=8, head_dim=128, page_size=page_size)


def bench_data_path(
    tokens: int = 1024, rounds: int = 5, page_sizes: tuple[int, ...] = (1, 16, 64), runtime: str = "cpu"
) -> dict[str, Any]:
    from .core.controller import HiCacheController

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
            from .core.transfer import launch_backup

            hp, dp = c.host_pools["kv"], c.device_pools["kv"]
            runs = c._runs_for(host, c._with_runs([("kv", host, kv)])[0][3])  # as the controller chooses

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


def _observed_controller(config: str, runtime: str, out_dir: Path) -> tuple[Any, Callable[[], None]]:
    """A demo-workload controller with the observability of ``config`` attached.

    The three targets run the auditor and the sinks in a sink host process (the
    controller's process only encodes batches). For comparison,
    ``events_metrics_inline_audit`` is (a) with the auditor inline in the controller's
    process (its violations enter the log), and ``events_metrics_inprocess`` is that
    with the sinks on threads of the controller's process as well.
    """
    from .events.log import EventLog
    from .testing import make_controller

    log = EventLog(capacity=100_000)
    if config in ("events_metrics_inline_audit", "events_metrics_inprocess"):
        from .events.audit import Auditor

        Auditor().attach(log)
    if config == "events_metrics_inprocess":
        from hicache_obs.exporters.prometheus import PrometheusSink
        from hicache_obs.exporters.structlog_sink import StructlogSink, make_json_logger

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
    from .core.spec import ModelSpec
    from .workload import controller_options

    spec = ModelSpec.tiny_hybrid()
    detail = "bookkeeping" if config == "bare" else "full"
    c = make_controller(spec, log=log, runtime=runtime, event_detail=detail, **controller_options(spec))

    def close() -> None:
        c.close()
        log.close()
        for runner in log.sinks:  # a ratio measured while sinks lost events would flatter them
            st = runner.stats()
            if st["dropped"] or st["errors"]:
                raise RuntimeError(f"bench {config}/{runtime}: sink {runner.name} lost events: {st}")

    return c, close


def bench_overhead(steps: int = 150, rounds: int = 5, runtimes: tuple[str, ...] = ("sim", "cpu")) -> dict[str, Any]:
    from .workload import Workload

    tmp = Path(tempfile.mkdtemp(prefix="hicache-bench-"))
    counter = [0]
    ops = [0]

    def make(config: str, runtime: str) -> Callable[[], float]:
        def run() -> float:
            counter[0] += 1
            c, close = _observed_controller(config, runtime, tmp / str(counter[0]))
            w = Workload(c, seed=7)

            def go() -> None:
                w.run(steps)
                close()  # flushing every sink is part of the cost

            t = _timed(go)
            ops[0] = sum(c.state.completed.values()) + sum(c.state.failed.values())
            return t

        return run

    out: dict[str, Any] = {"steps": steps, "runtimes": list(runtimes)}
    per_runtime: dict[str, Any] = {}
    all_ratios: dict[str, list[float]] = {k: [] for k in CONFIGS[1:]}
    per_op: list[float] = []
    for rt in runtimes:
        fns = {cfg: make(cfg, rt) for cfg in CONFIGS}
        fns["bare"]()  # warm up
        got = interleave(fns, rounds)
        res: dict[str, Any] = {"ops": ops[0], "bare_s": statistics.median(got["bare"])}
        for cfg in CONFIGS[1:]:
            r = ratio_of_times(got[cfg], got["bare"])
            res[f"{cfg}_ratio"] = r.median
            res[f"{cfg}_ratio_spread"] = [r.lo, r.hi]
            all_ratios[cfg].extend(o / b for o, b in zip(got[cfg], got["bare"]))
        diff = [(a - b) / max(1, ops[0]) * 1e6 for a, b in zip(got["events_metrics"], got["bare"])]
        res["per_op_overhead_us"] = statistics.median(diff)
        per_op.extend(diff)
        per_runtime[rt] = res
    for cfg in CONFIGS[1:]:
        r = _ratio(all_ratios[cfg])
        out[f"{cfg}_ratio"] = r.median
        out[f"{cfg}_ratio_spread"] = [r.lo, r.hi]
    out["per_op_overhead_us"] = statistics.median(per_op)
    out["by_runtime"] = per_runtime
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return out


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
        ok = None if v is None else (v <= bound if op == "<=" else v >= bound)
        rows.append({"key": key, "target": f"{op} {bound:g}", "value": v, "met": ok})
    return rows


def run_bench(
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    sections: tuple[str, ...] = ("overhead", "events", "data_path"),
    threads: int | None = 1,
) -> dict[str, Any]:
    """Run the sections; ``quick`` keeps the whole run under a minute.

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
    result["targets"] = check_targets(result)
    return result
