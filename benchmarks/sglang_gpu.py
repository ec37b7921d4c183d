"""SGLang's real controller on a GPU, instrumented: the demo workload per io backend and the
bench's ``sglang`` section, in one process (SGLang's import is the slow part).

Run with an SGLang release importable, on a machine with CUDA (benchmarks/gpu_check.sh does):

    python benchmarks/sglang_gpu.py --out DIR [--steps 60] [--bench]

Writes ``DIR/demo-<backend>.json`` (the demo's ``--json`` summary), ``DIR/bench.json``
with ``--bench``, and prints one line per run: findings, operations, data check, and
which copy kernels ran (real or stand-in).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--bench", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from hicache_obs.cli import main as cli
    from hicache_obs.lab.sglang.harness import kernel_sources, sglang_version

    if not torch.cuda.is_available():
        print("sglang_gpu: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    print(f"SGLang {sglang_version()} on {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    rc = 0
    for backend in ("kernel", "direct"):
        buf = io.StringIO()
        argv = ["demo", "--engine", "sglang-controller", "--runtime", "cuda", "--io-backend", backend]
        argv += ["--steps", str(args.steps), "--json", "--out", str(out / f"log-{backend}")]
        try:
            with contextlib.redirect_stdout(buf):
                code = cli(argv)
            (out / f"demo-{backend}.json").write_text(buf.getvalue())
            s = json.loads(buf.getvalue()) if code == 0 else None
        except (Exception, SystemExit) as exc:  # the next run still runs
            code, s = f"{type(exc).__name__}: {exc}", None
        if s is None:
            print(f"demo {backend}: failed ({code})")
            rc = 1
            continue
        print(
            f"demo {backend}/{s['layout']}: violations {s['violations']}, operations {s['operations']}, "
            f"failed {s['failed_operations']}, data_intact {s['data_intact']} ({s['checked_slots']} slots), "
            f"events {s['events']}, {s['wall_seconds']:.2f} s"
        )
    print("kernels:", json.dumps(kernel_sources()))
    if args.bench:
        from hicache_obs.lab.bench import bench_sglang_here

        try:
            b = bench_sglang_here(device="cuda")
        except Exception as exc:
            print(f"bench: failed ({type(exc).__name__}: {exc})")
            return 1
        (out / "bench.json").write_text(json.dumps(b, indent=1))
        keys = ("overhead_ratio", "overhead_ratio_spread", "per_op_overhead_us", "in_process_ratio",
                "in_process_per_op_us", "flush_wait_per_op_us", "bare_per_op_us", "controller_cpu_ratio",
                "io_backend", "layout", "ops", "events")  # fmt: skip
        print("bench:", json.dumps({k: b.get(k) for k in keys}))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
