"""GPU bench: data-path ratios against pinned cudaMemcpyAsync and the overhead ratio on cuda.

Run on a machine with a CUDA GPU (well under 5 minutes):

    python benchmarks/gpu_bench.py > gpu-bench.json

Prints one JSON object: ``data_path.<layout>.ps<N>.<write|load>_vs_memcpy`` where
the reference is a pinned host <-> device copy of the same bytes, and
``overhead.<config>_ratio`` of the demo workload on the ``cuda`` runtime.
"""

from __future__ import annotations

import json
import sys

import torch

from hicache_obs.lab.bench import bench_data_path, bench_overhead


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    result = {
        "machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__},
        "data_path": bench_data_path(tokens=8192, rounds=7, runtime="cuda"),
        "overhead": bench_overhead(steps=150, rounds=5, runtimes=("cuda",)),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
