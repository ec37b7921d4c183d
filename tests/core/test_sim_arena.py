"""The ``sim`` runtime's seams: its arena (the allocator model), its scheduler (the stream
state) and the side data each device tensor carries (``sim_info``)."""

from __future__ import annotations

import gc
import threading

import torch

from hicache_obs.core._sim import SimArena, SimRuntime, SimScheduler, SimTensor, SimTensorInfo, set_sim_info, sim_info


def test_a_device_tensor_names_its_block_and_runtime_and_its_views_share_them() -> None:
    rt = SimRuntime()
    base = rt.to_device(torch.arange(8, dtype=torch.int64))
    info = sim_info(base)
    assert isinstance(info, SimTensorInfo) and info.runtime is rt and info.block is not None
    assert info.block.size == 512 and info.block.ptr == base.data_ptr()
    assert sim_info(base[2:5]) is info, "a view lies on its base's block"
    assert sim_info(base + 1) is not info and sim_info(base + 1).block is not info.block
    buf = rt.empty((4,), torch.float32)
    assert sim_info(buf).block is None and sim_info(buf).runtime is rt
    assert sim_info(buf[1:]) is sim_info(buf)
    assert sim_info(torch.arange(3)) is None, "a host tensor has no sim side data"


def test_set_sim_info_makes_a_tensor_one_of_a_runtimes_device_tensors() -> None:
    rt, other = SimRuntime(), SimRuntime()
    t = torch.zeros(3).as_subclass(SimTensor)
    set_sim_info(t, SimTensorInfo(None, rt))
    assert rt.is_device(t) and not other.is_device(t)
    assert rt.tensor_device(t) == "sim:0" and other.tensor_device(t) == "sim:0 of another SimRuntime"


def test_a_view_of_another_runtimes_tensor_stays_that_runtimes() -> None:
    """An op over tensors of two runtimes whose result views the second one's memory: the
    view lies in the second arena, so it is the second runtime's device tensor, whatever
    runtime the op's first argument belongs to."""
    rt1, rt2 = SimRuntime(), SimRuntime()
    a = rt1.to_device(torch.zeros((2, 3), dtype=torch.int64))
    b = rt2.to_device(torch.tensor([7, 8, 9], dtype=torch.int64))
    _, bb = torch.broadcast_tensors(a, b)  # bb: b expanded, stride 0, on b's block
    assert bb.data_ptr() == b.data_ptr() and sim_info(bb) is sim_info(b)
    assert rt2.is_device(bb) and not rt1.is_device(bb)


def test_the_arena_frees_lifo_and_defers_a_recorded_block_until_its_stream_ran() -> None:
    rt = SimRuntime()
    arena = rt.arena
    assert isinstance(arena, SimArena) and arena.runtime is rt
    b1 = arena.alloc(100)
    assert (b1.size, arena.blocks_allocated, arena.blocks_reused) == (512, 1, 0)
    seg, off = b1.seg, b1.offset
    arena.release(seg, off, b1.size, None)
    assert (arena.free_blocks, arena.deferred_blocks) == (1, 0)
    b2 = arena.alloc(300)  # the same size class: the block just freed
    assert (b2.seg, b2.offset, arena.blocks_reused) == (seg, off, 1)

    side = rt.stream("side")
    side.submit(lambda: None)
    arena.release(b2.seg, b2.offset, b2.size, {side})
    assert arena.has_deferred_frees and (arena.free_blocks, arena.deferred_blocks) == (0, 1)
    arena.retire()
    assert arena.deferred_blocks == 1, "the stream has not run the work queued before the free"
    side.run_until(side.submitted)  # runs the work and retires the deferred frees
    assert not arena.has_deferred_frees and (arena.free_blocks, arena.deferred_blocks) == (1, 0)
    b1.arena = b2.arena = None  # type: ignore[assignment]  # released by hand above: no second free


def test_a_closed_arena_takes_no_block_back() -> None:
    rt = SimRuntime()
    t = rt.to_device(torch.tensor([1, 2], dtype=torch.int64))
    rt.close()
    assert rt.arena.closed
    del t
    gc.collect()
    assert rt.free_blocks == 0


def test_the_scheduler_holds_the_current_stream_per_thread_and_the_pause() -> None:
    rt = SimRuntime()
    sched = rt.scheduler
    assert isinstance(sched, SimScheduler) and sched.current is sched.main and sched.main.is_main
    side = rt.stream("side")
    assert sched.streams == [side]
    seen: list[object] = []
    with rt.use(side):
        assert sched.current is side and rt.current_stream() is side
        worker = threading.Thread(target=lambda: seen.append(sched.current))
        worker.start()
        worker.join()
    assert seen == [sched.main], "another thread's current stream is its own"
    assert sched.current is sched.main
    ev = rt.event()
    ev.record(side)
    with rt.paused():
        assert sched.paused and not ev.query()
    assert not sched.paused and ev.query()
