"""SGLang #24585's corruption itself, on the CPU: the harness's copies with CUDA stream semantics.

On the CPU harness a copy runs at the call, so 0.5.12's write-back demotion (the device slots
freed while the D2H write still reads them) backs up the right rows: only the log shows the
use after free. Under :func:`~hicache_obs.lab.sglang.deferred.cuda_semantics` the
write runs when its stream is waited for, as late as a GPU may run it: the next request has
taken the freed slots and written its own KV by then, and the host copy of the demoted node
holds that request's rows. 0.5.13 waits for the write before it frees, and serves the same
workload with every row intact, loads back included.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from sglang_env import release_tuple
from test_tree import BACKENDS, EVICTING, WORKLOAD

from hicache_obs.core import ModelSpec
from hicache_obs.events import EventLog
from hicache_obs.events._audit import audit
from hicache_obs.events._schema import AuditViolation
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang

PAGE = ModelSpec.tiny().page_size


@pytest.fixture
def unified() -> None:
    from hicache_obs.lab.sglang.tree import has_unified_hicache

    if not has_unified_hicache():
        pytest.skip("this SGLang release has no UnifiedRadixCache with HiCache (init_hicache)")


def _build(io_backend: str, layout: str) -> tuple[Any, EventLog, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The tree, its log, and for each write the tree asked for, in order, its host indices and
    the device rows it was to back up, as the device held them when it was asked for."""
    from hicache_obs.lab.sglang.tree import build_tree

    t = build_tree(ModelSpec.tiny(), io_backend=io_backend, layout=layout, device_size=128)
    log = EventLog()
    instrument(t.controller, log=log)
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    write = t.controller.write

    def tracked(device_indices: Any, *args: Any, **kwargs: Any) -> Any:
        rows = t.harness.read_kv(device_indices)  # (layers k then v, tokens, heads, dim)
        out = write(device_indices, *args, **kwargs)
        if out is not None:
            writes.append((out.detach().clone().as_subclass(torch.Tensor), rows))
        return out

    t.controller.write = tracked
    return t, log, writes


def _host_rows(t: Any, host: torch.Tensor) -> torch.Tensor:
    """The host copy at ``host``, as ``(layers k then v, tokens, heads, dim)``."""
    from hicache_obs.lab.sglang.engine import _kv_planes

    _, planes = _kv_planes(t.harness)
    got = planes.read_slots(host)
    return torch.cat([got["k"], got["v"]]).float()


def _rows(tokens: list[int], t: Any) -> list[torch.Tensor]:
    """The rows the harness wrote for ``tokens``, one per token."""
    from hicache_obs.lab.sglang.tree import _prefix_rows

    dtype = t.harness.kv_pool.k_buffer[0].dtype
    return list(_prefix_rows(tokens, 0, t._row_shape()).to(dtype).float().unbind(1))


def _backed_up(t: Any, writes: list[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """For each write: whether its host copy holds the rows the device held when it was asked."""
    return [torch.equal(_host_rows(t, host), rows) for host, rows in writes]


@pytest.mark.skipif(release_tuple()[:3] != (0, 5, 12), reason="SGLang 0.5.12's write-back demotion (PR #24585)")
@pytest.mark.parametrize("worker", [False, True], ids=["at-the-wait", "worker"])
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_0_5_12_backs_up_the_next_requests_rows_under_cuda_semantics(
    unified: None, io_backend: str, layout: str, worker: bool
) -> None:
    """The copies run at the same points with or without the copy worker (``worker``: on it)."""
    from hicache_obs.lab.sglang import deferred
    from hicache_obs.lab.sglang.deferred import cuda_semantics, pending

    ran_on: set[int] = set()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deferred, "partial", _recording(ran_on))
        with cuda_semantics(worker=worker):
            _serve_0_5_12_demotion(io_backend, layout, pending)
    assert ran_on and (threading.get_ident() in ran_on) is not worker


def _recording(ran_on: set[int], on_run: Callable[[], None] = lambda: None) -> Callable[..., Any]:
    """A stand-in for the deferred module's ``partial`` (what a stream's queue holds): the
    queued copy call adds the ident of the thread that runs it to ``ran_on``, then ``on_run()``."""

    def queued(op: Any, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        def call() -> Any:
            ran_on.add(threading.get_ident())
            on_run()
            return op(*args, **kwargs)

        return call

    return queued


def _serve_0_5_12_demotion(io_backend: str, layout: str, pending: Any) -> None:
    t, log, writes = _build(io_backend, layout)
    for tokens in WORKLOAD[: EVICTING + 1]:
        assert t.serve(tokens).data_ok
    assert writes and pending() > 0  # the demoted nodes' writes have not run yet
    with pytest.raises(AssertionError):
        t.serve(WORKLOAD[EVICTING + 1])  # writing_check waits for them, then SGLang asserts
    assert pending() == 0
    intact = _backed_up(t, writes)
    assert not all(intact), intact
    # what the host copies hold instead: rows of the evicting request, which took the slots
    evicting = _rows(WORKLOAD[EVICTING], t)
    for (host, _), ok in zip(writes, intact):
        if not ok:
            copy = _host_rows(t, host).unbind(1)
            assert any(any(torch.equal(row, other) for other in evicting) for row in copy)
    found = [(f.rule, f.pool, f.role) for f in audit([e for e in log.events() if not isinstance(e, AuditViolation)])]
    assert ("slot_not_allocated", "kv", "device") in found  # and the log said so


@pytest.mark.skipif(release_tuple()[:3] != (0, 5, 12), reason="SGLang 0.5.12's write-back demotion (PR #24585)")
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_0_5_12_backs_up_the_right_rows_when_copies_run_at_the_call(
    unified: None, io_backend: str, layout: str
) -> None:
    t, _, writes = _build(io_backend, layout)
    for tokens in WORKLOAD[: EVICTING + 1]:
        t.serve(tokens)
    with pytest.raises(AssertionError):
        t.serve(WORKLOAD[EVICTING + 1])
    assert writes and all(_backed_up(t, writes))  # the copies ran at the call: the CPU hides it


@pytest.mark.skipif(release_tuple() < (0, 5, 13), reason="0.5.13 waits for a write-back before it demotes")
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_the_fixed_release_serves_intact_under_cuda_semantics(unified: None, io_backend: str, layout: str) -> None:
    from hicache_obs.lab.sglang.deferred import cuda_semantics

    with cuda_semantics():
        t, log, writes = _build(io_backend, layout)
        served = [t.serve(tokens) for tokens in WORKLOAD]
        t.step()
    assert writes and all(_backed_up(t, writes))
    assert [s.loaded for s in served] == [0, 0, 0, 2 * PAGE, 0, 2 * PAGE]
    assert all(s.data_ok for s in served), [s.data_ok for s in served]
    log.flush()
    assert audit([e for e in log.events() if not isinstance(e, AuditViolation)]) == []


def test_cuda_semantics_refuses_a_second_block() -> None:
    from hicache_obs.errors import ConfigError
    from hicache_obs.lab.sglang.deferred import cuda_semantics
    from hicache_obs.lab.sglang.harness import prepare

    prepare("cpu")
    with cuda_semantics():
        with pytest.raises(ConfigError, match="one block at a time"):
            with cuda_semantics():
                pass


@pytest.mark.skipif(release_tuple() < (0, 5, 13), reason="0.5.13 waits for a write-back before it demotes")
@pytest.mark.parametrize("io_backend,layout", BACKENDS)
def test_the_copy_worker_runs_the_copies_while_the_controller_waits(
    unified: None, io_backend: str, layout: str
) -> None:
    """``worker=True``: the copies run on a thread of their own, the rows come out intact, the
    controller's thread copies nothing (its threads' idents, seen from inside a copy), and each
    copy runs while the controller's thread waits for it (never while it works)."""
    from hicache_obs.lab.sglang import deferred

    ran_on: set[int] = set()
    waits = [0]  # the controller's thread is inside a wait for queued copies
    while_working: list[int] = []

    def outside_a_wait() -> None:
        if not waits[0]:
            while_working.append(1)

    run_until = deferred._Queue.run_until

    def waiting(q: Any, mark: int) -> None:
        waits[0] += 1
        try:
            run_until(q, mark)
        finally:
            waits[0] -= 1

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deferred, "partial", _recording(ran_on, outside_a_wait))
        mp.setattr(deferred._Queue, "run_until", waiting)
        with deferred.cuda_semantics(worker=True):
            t, log, writes = _build(io_backend, layout)
            served = [t.serve(tokens) for tokens in WORKLOAD]
            torch.cpu.synchronize()  # waits for the worker: every copy queued so far has run
            assert deferred.pending() == 0
            t.step()
    assert ran_on and threading.get_ident() not in ran_on  # every queued copy ran on the worker
    assert while_working == []
    assert writes and all(_backed_up(t, writes))
    assert [s.loaded for s in served] == [0, 0, 0, 2 * PAGE, 0, 2 * PAGE]
    assert all(s.data_ok for s in served), [s.data_ok for s in served]
    log.flush()
    assert audit([e for e in log.events() if not isinstance(e, AuditViolation)]) == []


@pytest.mark.skipif(release_tuple() < (0, 5, 13), reason="0.5.13 waits for a write-back before it demotes")
def test_a_wait_for_the_copy_worker_wakes_when_its_copies_ran(unified: None) -> None:
    """A wait of the controller's thread sleeps until the worker ran the copies it asked for:
    with ``WAKE_S`` (the look for a failed copy) far longer than any copy, as a counted run
    under valgrind sets it, every wait the controller's thread makes ends by the worker's
    notice, never by the clock, so the serving takes the same steps however slow the copies."""
    from hicache_obs.lab.sglang import deferred

    controller = threading.get_ident()
    woken: list[bool] = []  # each wait of the controller's thread: notified (True) or timed out
    ran_on: set[int] = set()
    slow = [True]

    def first_copy_slow() -> None:  # longer than the default WAKE_S (0.1 s)
        if slow[0]:
            slow[0] = False
            time.sleep(0.3)

    class Watched(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            got = super().wait(timeout)
            if threading.get_ident() == controller:
                woken.append(got)
            return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deferred, "WAKE_S", 30.0)
        mp.setattr(deferred, "_ran", Watched(deferred._lock))
        mp.setattr(deferred, "partial", _recording(ran_on, first_copy_slow))
        with deferred.cuda_semantics(worker=True):
            t, _, writes = _build("kernel", "page_first")  # the bench's backend
            served = [t.serve(tokens) for tokens in WORKLOAD]
            torch.cpu.synchronize()
            t.step()
    assert not slow[0] and threading.get_ident() not in ran_on  # the worker ran them, the first slowly
    assert woken and all(woken), woken
    assert writes and all(_backed_up(t, writes))
    assert all(s.data_ok for s in served), [s.data_ok for s in served]
