"""What each part of the SGLang adapter's evidence costs, against the floor, side by side.

Run by a Python that has SGLang (``make sglang``), on an otherwise idle machine:

    .sglang/0.5.23/bin/python benchmarks/sglang_parts.py [--rounds 100] > parts.json

The ``sglang`` section's workload (``hicache_obs.lab.bench.sglang_workload``, 16 nodes,
batches of 8) on one real SGLang controller of the CPU harness, run bare, under the
adapter, under the floor (:mod:`hicache_obs.lab.sglang.floor`: the same hooks
emitting as many constant events, nothing read) and under the floor with the adapter's
own hooks for one part of its evidence (``floor_with([part])``), each into an
``EventLog`` with no sinks. Every round runs each kind once, in a shuffled order; each
run is timed by the thread's CPU time. Prints one JSON object: for each kind, the median
cost per operation over bare and over the floor, in microseconds, and its events per
run. A part's cost over the floor is what reading that part costs; the parts do not add
up to the adapter's exactly (a hook's reads warm the caches for the next), and a run with
some of the adapter's hooks reports its own mix of events (the adapter's move reports
each tensor that changed device; its submission's end, records of what its copies
noted: it is measured with them, ``floor+copy+submission``).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from typing import Any


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=100, help="rounds of every kind (default 100)")
    p.add_argument("--seed", type=int, default=1, help="seed of the shuffled orders")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")

    import torch

    from hicache_obs.core._spec import ModelSpec
    from hicache_obs.events._log import EventLog
    from hicache_obs.integrations.sglang import Instrumentation
    from hicache_obs.lab.bench import _sglang_plan, sglang_workload
    from hicache_obs.lab.sglang.floor import PARTS, FloorInstrumentation, floor_with
    from hicache_obs.lab.sglang.harness import build_controller, sglang_version

    if sglang_version() is None:
        print(f"sglang_parts: SGLang is not installed in {sys.executable} (make sglang)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    spec = ModelSpec.tiny_hybrid()
    batch = 8
    plan = _sglang_plan(16, spec.page_size)
    h = build_controller(spec, device_size=4 * spec.page_size * batch * 2, host_ratio=2.0)
    ops = 2 * len(plan)
    kinds: dict[str, type[Instrumentation] | None] = {
        "bare": None,
        "adapter": Instrumentation,
        "floor": FloorInstrumentation,
        # a submission's end describes what the copies noted: measured with them
        **{f"floor+{part}": floor_with([part]) for part in PARTS if part != "submission"},
        "floor+copy+submission": floor_with(["copy", "submission"]),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    events: dict[str, int] = {}

    def run(kind: str) -> float:
        cls = kinds[kind]
        if cls is None:
            gc.collect()
            t0 = time.thread_time()
            sglang_workload(h, plan, batch)
            return time.thread_time() - t0
        log = EventLog(capacity=100_000)
        inst = cls.attach(h.controller, log=log)
        try:
            start = log.published
            gc.collect()
            t0 = time.thread_time()
            sglang_workload(h, plan, batch)
            took = time.thread_time() - t0
            events[kind] = log.published - start
        finally:
            inst.detach()
            log.close()
        if inst.errors:
            raise RuntimeError(f"{kind}: the instrumentation failed to observe {inst.errors} steps")
        return took

    rng = random.Random(args.seed)
    order = list(kinds)
    gc.collect()
    gc.freeze()
    try:
        for kind in order:  # warm up every kind once
            run(kind)
        for _ in range(args.rounds):
            rng.shuffle(order)
            for kind in order:
                times[kind].append(run(kind))
    finally:
        gc.unfreeze()
        h.close()
    bare = statistics.median(times["bare"])
    floor = statistics.median(times["floor"])
    out: dict[str, Any] = {
        "release": sglang_version(),
        "rounds": args.rounds,
        "ops_per_run": ops,
        "bare_per_op_us": bare / ops * 1e6,
        "kinds": {
            kind: {
                "over_bare_per_op_us": (statistics.median(t) - bare) / ops * 1e6,
                "over_floor_per_op_us": (statistics.median(t) - floor) / ops * 1e6,
                "events_per_run": events.get(kind, 0),
            }
            for kind, t in times.items()
            if kind != "bare"
        },
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
