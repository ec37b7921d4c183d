"""How a copy's runs are chosen (``core.transfer``): the pair runs of host-side index values,
then whether the copy takes them or the index kernels."""

from __future__ import annotations

import torch

from hicache_obs.core._runtime import CpuRuntime
from hicache_obs.core._sim import SimRuntime
from hicache_obs.core._transfer import host_pair_runs, plan_runs, runs_for_copy


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


CONTIGUOUS = (_t([4, 5, 6, 7]), _t([0, 1, 2, 3]))  # one run
SCATTERED = (_t([9, 1, 7, 3]), _t([0, 2, 4, 6]))  # four runs of one slot


def test_host_pair_runs_reads_cpu_values_and_never_a_device_tensors() -> None:
    rt = SimRuntime()
    host, dev = CONTIGUOUS
    assert host_pair_runs(rt, host, dev) == ((4, 0, 4),)
    assert host_pair_runs(rt, *SCATTERED) == ((9, 0, 1), (1, 2, 1), (7, 4, 1), (3, 6, 1))
    assert host_pair_runs(rt, host, rt.to_device(dev)) is None
    assert host_pair_runs(rt, rt.to_device(host), dev) is None


def test_runs_for_copy_keeps_fragmented_runs_only_where_slices_are_cheap() -> None:
    host, dev = SCATTERED
    runs = host_pair_runs(CpuRuntime(), host, dev)
    assert runs_for_copy("kernel", False, host, runs) is None, "4 runs of 4 slots: torch's index kernel"
    assert runs_for_copy("direct", False, host, runs) == runs
    assert runs_for_copy("kernel", True, host, runs) == runs, "the native loop takes runs of any length"
    one = host_pair_runs(CpuRuntime(), *CONTIGUOUS)
    assert runs_for_copy("kernel", False, CONTIGUOUS[0], one) == one
    assert runs_for_copy("direct", True, host, None) is None


def test_plan_runs_is_the_two_steps_for_the_runtime_it_is_given() -> None:
    host, dev = SCATTERED
    cpu, sim = CpuRuntime(), SimRuntime()
    native = cpu.native_copies is not None
    assert plan_runs("kernel", host, dev, cpu) == (host_pair_runs(cpu, host, dev) if native else None)
    assert plan_runs("kernel", host, dev, sim) is None  # no native loop on sim: fragmented -> index kernel
    assert plan_runs("direct", host, dev, sim) == ((9, 0, 1), (1, 2, 1), (7, 4, 1), (3, 6, 1))
    assert plan_runs("direct", host, sim.to_device(dev), sim) is None
