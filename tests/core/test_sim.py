"""The ``sim`` runtime itself: deferred side-stream work, the caching-allocator model, records."""

from __future__ import annotations

import gc

import pytest
import torch

from hicache_obs.core._sim import SimRuntime, SimTensor, sim_info


def _gather(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor) -> None:
    dst.copy_(src.index_select(0, idx))


def _setup():
    rt = SimRuntime()
    side = rt.stream("side")
    src = rt.empty((16,), torch.float32)  # persistent pool-like buffers
    src.copy_(torch.arange(100, 116, dtype=torch.float32))
    dst = rt.empty((3,), torch.float32)
    return rt, side, src, dst


@pytest.mark.parametrize("recorded", [False, True], ids=["missing_record", "recorded"])
def test_a_missing_record_lets_the_deferred_copy_read_clobbered_indices(recorded):
    rt, side, src, dst = _setup()
    idx = rt.to_device(torch.tensor([1, 2, 3], dtype=torch.int64))
    with rt.use(side):
        rt.launch(_gather, dst, src, idx)
    assert rt.pending_work() == 1 and dst.tolist() == [0.0, 0.0, 0.0], "side-stream work is deferred"
    if recorded:
        rt.record_stream(idx, side)
    del idx
    gc.collect()
    clobber = rt.to_device(torch.tensor([9, 8, 7], dtype=torch.int64))  # the next allocation of that size
    rt.synchronize()
    if recorded:
        assert rt.blocks_reused == 0
        assert dst.tolist() == [101.0, 102.0, 103.0]
    else:
        assert rt.blocks_reused == 1
        assert dst.tolist() == [109.0, 108.0, 107.0], "the copy read the new owner's values"
    del clobber


def test_a_recorded_block_returns_after_the_stream_work_ran():
    rt, side, src, dst = _setup()
    idx = rt.to_device(torch.tensor([0, 1, 2], dtype=torch.int64))
    with rt.use(side):
        rt.launch(_gather, dst, src, idx)
    rt.record_stream(idx, side)
    free_before = rt.free_blocks
    del idx
    gc.collect()
    assert (rt.deferred_blocks, rt.free_blocks) == (1, free_before)
    rt.synchronize()
    assert (rt.deferred_blocks, rt.free_blocks) == (0, free_before + 1)
    again = rt.to_device(torch.tensor([5, 5, 5], dtype=torch.int64))
    assert rt.blocks_reused == 1, "the returned block is handed out again"
    del again


def test_an_unrecorded_block_returns_at_once_and_lifo():
    rt = SimRuntime()
    a = rt.to_device(torch.tensor([1], dtype=torch.int64))
    b = rt.to_device(torch.tensor([2], dtype=torch.int64))
    pa, pb = a.data_ptr(), b.data_ptr()
    assert pa != pb and rt.free_blocks == 0
    del a
    del b
    gc.collect()
    assert rt.free_blocks == 2
    assert rt.to_device(torch.tensor([3], dtype=torch.int64)).data_ptr() == pb, "most recently freed first"


def test_a_record_on_a_stream_without_pending_work_frees_at_once():
    rt, side, _, _ = _setup()
    idx = rt.to_device(torch.tensor([1, 2], dtype=torch.int64))
    rt.record_stream(idx, side)
    del idx
    gc.collect()
    assert (rt.deferred_blocks, rt.free_blocks) == (0, 1)


def test_views_keep_their_base_block_alive():
    rt = SimRuntime()
    base = rt.to_device(torch.arange(8, dtype=torch.int64))
    view = base[2:5]
    assert isinstance(view, SimTensor) and rt.is_device(view)
    assert sim_info(view).block is sim_info(base).block
    del base
    gc.collect()
    assert rt.free_blocks == 0, "the view still holds the block"
    other = rt.to_device(torch.tensor([42] * 8, dtype=torch.int64))
    assert view.tolist() == [2, 3, 4], "a new allocation must not land on a live view"
    del view
    gc.collect()
    assert rt.free_blocks == 1
    del other


def test_ops_on_device_tensors_make_new_device_blocks():
    rt = SimRuntime()
    a = rt.to_device(torch.tensor([3, 1, 2], dtype=torch.int64))
    s = a.sort()  # keeps torch's named fields
    assert isinstance(s.values, SimTensor) and sim_info(s.values).block is not sim_info(a).block
    assert s.values.tolist() == [1, 2, 3] and s.indices.tolist() == [1, 2, 0]
    assert rt.is_device(s.indices)
    assert rt.blocks_allocated == 3


def test_cpu_returns_a_plain_host_tensor():
    rt = SimRuntime()
    d = rt.to_device(torch.tensor([4, 5, 6], dtype=torch.int64))
    for h in (d.cpu(), d.to("cpu"), rt.to_host(d)):
        assert type(h) is torch.Tensor and not rt.is_device(h)
        assert h.tolist() == [4, 5, 6]
        h[0] = 99
        assert d.tolist() == [4, 5, 6], "the host copy does not alias device memory"
    assert rt.tensor_device(d) == "sim:0" and rt.tensor_device(d.cpu()) == "cpu"
    assert rt.to_device(d) is d


def test_main_stream_work_runs_at_once():
    rt, _, src, dst = _setup()
    idx = rt.to_device(torch.tensor([4, 5, 6], dtype=torch.int64))
    rt.launch(_gather, dst, src, idx)
    assert rt.pending_work() == 0 and dst.tolist() == [104.0, 105.0, 106.0]


def test_events_order_and_pausing():
    rt, side, src, dst = _setup()
    idx = rt.to_device(torch.tensor([7, 8, 9], dtype=torch.int64))
    with rt.use(side):
        rt.launch(_gather, dst, src, idx)
    ev = rt.event()
    ev.record(side)
    with rt.paused():
        assert not ev.query() and rt.pending_work() == 2
        with pytest.raises(RuntimeError, match="paused"):
            rt.synchronize()
        with pytest.raises(RuntimeError, match="deadlock"):
            ev.synchronize()
    assert ev.query() and dst.tolist() == [107.0, 108.0, 109.0] and rt.pending_work() == 0
    main_ev = rt.event()
    main_ev.record()
    assert main_ev.query(), "main-stream events are complete at once"


def test_a_side_stream_waiting_on_another_runs_it_first():
    rt, side, src, dst = _setup()
    other = rt.stream("other")
    idx = rt.to_device(torch.tensor([0, 0, 0], dtype=torch.int64))
    with rt.use(side):
        rt.launch(_gather, dst, src, idx)
    ev = rt.event()
    ev.record(side)
    ev.wait(other)
    done = rt.event()
    done.record(other)
    assert dst.tolist() == [0.0, 0.0, 0.0]
    assert done.query()
    assert dst.tolist() == [100.0, 100.0, 100.0]


def test_device_tensors_cannot_be_pickled():
    import pickle

    rt = SimRuntime()
    with pytest.raises(TypeError, match="host first"):
        pickle.dumps(rt.to_device(torch.tensor([1], dtype=torch.int64)))


def test_drain_runs_every_deferred_side_stream_launch():
    rt, side, src, dst = _setup()
    idx = rt.to_device(torch.tensor([4, 5, 6], dtype=torch.int64))
    with rt.use(side):
        rt.launch(_gather, dst, src, idx)
    assert rt.pending_work() == 1 and dst.tolist() == [0.0, 0.0, 0.0]
    rt.drain()
    assert rt.pending_work() == 0 and dst.tolist() == [104.0, 105.0, 106.0]


def test_drain_on_the_cpu_runtime_has_nothing_to_wait_for():
    from hicache_obs.core._runtime import CpuRuntime

    rt = CpuRuntime()
    dst = torch.zeros(2)
    with rt.use(rt.stream("side")):
        rt.launch(lambda d: d.fill_(3.0), dst)
    assert dst.tolist() == [3.0, 3.0]  # synchronous: it already ran
    assert rt.drain() is None and dst.tolist() == [3.0, 3.0]
