"""The thread-safety contract (docs/reliability.md), checked clause by clause.

- every public controller method takes the controller's lock;
- ``EventLog.emit`` from many threads gives gap-free ``seq``; subscribers run inline,
  on the emitting thread, in log order;
- sinks run on their own threads, never raise into the emitter, and a hanging
  sink does not hang ``log.close(timeout)``;
- the engine's own pool reads and writes (``DevicePool.write_slots``/``read_slots``,
  on the main stream) may run beside a thread that submits transfers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from hicache_obs.core import CacheOperation, HybridCacheController, ModelSpec, PoolTransfer
from hicache_obs.events import EventLog, TransferFailed

THREADS = 8
EMITS = 2000



def _hybrid() -> HybridCacheController:
    return HybridCacheController(ModelSpec.tiny_hybrid(), runtime="sim", device_size=1024)


# ------------------------------------------------------------ controller lock
def test_public_methods_wait_for_the_controller_lock() -> None:
    """BUG (core/controller.py): ``move_indices``, ``move_hybrid_indices`` and ``synchronize`` take no lock."""
    c = _hybrid()
    kv = c.alloc_device(16)
    mb = c.alloc_device(1, pool="mamba")
    assert kv is not None and mb is not None
    res = c.write(kv, pool_transfers=[PoolTransfer("mamba", device_indices=mb)])
    assert res is not None
    host, tr = res
    assert tr is not None and tr[0].host_indices is not None
    c.poll_writes()
    op = CacheOperation(host, kv, pool_transfers=(PoolTransfer("mamba", tr[0].host_indices, mb),))
    calls: dict[str, Callable[[], object]] = {
        "alloc_device": lambda: c.alloc_device(16),
        "write": lambda: c.write(kv),
        "load": lambda: c.load(host),
        "evict_host": lambda: c.evict_host(host),
        "evict_device": lambda: c.evict_device(kv),
        "free_device": lambda: c.free_device(kv),
        "start_writing": c.start_writing,
        "start_loading": c.start_loading,
        "poll_writes": c.poll_writes,
        "poll_loads": c.poll_loads,
        "move_indices": lambda: c.move_indices(host, kv),
        "move_hybrid_indices": lambda: c.move_hybrid_indices(op),
        "synchronize": c.synchronize,
        "close": c.close,
    }
    unlocked = []
    for name, call in calls.items():
        finished = threading.Event()

        def run(call: Callable[[], object] = call, finished: threading.Event = finished) -> None:
            try:
                call()
            except Exception:
                pass  # the call's own outcome does not matter here, only whether it waited
            finally:
                finished.set()

        with c._lock:  # another thread inside the controller
            t = threading.Thread(target=run, daemon=True)
            t.start()
            if finished.wait(0.2):
                unlocked.append(name)
        t.join(10)
    assert not unlocked, f"public methods that ran while another thread held the controller's lock: {unlocked}"


# ------------------------------------------------------------------ event log
def test_emits_from_many_threads_are_gap_free_and_delivered_inline_in_order(fast_switching: None) -> None:
    log = EventLog()
    seen: list[tuple[int, int, int]] = []  # (seq, emitter index, thread that ran the subscriber)
    log.subscribe(lambda ev: seen.append((ev.seq, ev.op, threading.get_ident())))  # type: ignore[attr-defined]
    idents: dict[int, int] = {}
    start = threading.Barrier(THREADS)

    def emitter(i: int) -> None:
        idents[i] = threading.get_ident()
        start.wait()
        for _ in range(EMITS):
            log.emit(TransferFailed, op=i, direction="d2h", error="test")

    threads = [threading.Thread(target=emitter, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    total = THREADS * EMITS
    assert len(log) == total
    assert [e.seq for e in log.events()] == list(range(total))  # gap-free, no duplicate
    assert [s for s, _, _ in seen] == list(range(total))  # every event, in log order
    assert all(ident == idents[i] for _, i, ident in seen), "a subscriber ran on another thread than the emitter"
    per_thread = [[s for s, i, _ in seen if i == k] for k in range(THREADS)]
    assert all(len(p) == EMITS and p == sorted(p) for p in per_thread)


class _ThreadRecordingSink:
    name = "threads"

    def __init__(self, fail: bool) -> None:
        self.threads: set[str] = set()
        self.handled = 0
        self.fail = fail

    def handle(self, event: object) -> None:
        self.threads.add(threading.current_thread().name)
        self.handled += 1
        if self.fail:
            raise RuntimeError("sink failure")

    def flush(self) -> None:
        if self.fail:
            raise RuntimeError("sink failure")

    def close(self) -> None:
        if self.fail:
            raise RuntimeError("sink failure")


def test_sinks_run_on_their_own_threads_and_never_raise_into_the_emitter() -> None:
    log = EventLog()
    good, bad = _ThreadRecordingSink(False), _ThreadRecordingSink(True)
    r_good, r_bad = log.add_sink(good), log.add_sink(bad)
    emitters = {threading.current_thread().name}
    for i in range(500):
        log.emit(TransferFailed, op=i, direction="h2d", error="test")  # never raises
    log.close()
    assert good.handled == 500 and r_good.dropped == 0
    assert good.threads and not (good.threads & emitters)
    assert all(name.startswith("hicache-sink-") for name in good.threads | bad.threads)
    assert r_bad.errors >= 1 and r_bad.dropped == 500


class _HangingSink:
    """Handles events at once, but ``flush()`` and ``close()`` hang until released."""

    name = "hanging"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.handled = 0

    def handle(self, event: object) -> None:
        self.handled += 1

    def flush(self) -> None:
        self.release.wait(30)

    def close(self) -> None:
        self.release.wait(30)


def test_a_sink_whose_flush_or_close_hangs_does_not_hang_log_close() -> None:
    """BUG (events/sinks.py SinkRunner.flush/close): ``sink.flush()``/``sink.close()`` run unbounded on the caller.

    ``log.close(timeout)`` (and so ``controller.close()`` of a controller that owns
    its log) waits as long as the sink's ``flush()`` plus its ``close()`` take.
    """
    log = EventLog()
    sink = _HangingSink()
    runner = log.add_sink(sink)
    for i in range(100):
        log.emit(TransferFailed, op=i, direction="d2h", error="test")
    release = threading.Timer(3.0, sink.release.set)  # a failing run ends after 3 s, not 60
    release.start()
    try:
        t0 = time.perf_counter()
        log.close(timeout=0.3)
        took = time.perf_counter() - t0
    finally:
        sink.release.set()
        release.cancel()
    assert sink.handled == 100 and runner.dropped == 0
    assert took < 2.0, f"log.close(timeout=0.3) took {took:.2f}s behind a hanging sink"
    assert runner.errors >= 1  # the hang is counted


# ------------------------------------------------------------- runtime threads
def test_pool_reads_and_writes_beside_a_submitting_thread(fast_switching: None) -> None:
    """BUG (core/sim.py SimRuntime._current): the current stream is global, not per thread.

    While one thread submits a load (inside ``runtime.use(load_stream)``), another
    thread's main-stream ``DevicePool.read_slots`` is queued on the load stream: its
    gather does not run and ``read_slots`` raises IndexError (``write_slots`` is
    deferred the same way). CUDA's current stream is per thread.
    """
    c = _hybrid()
    kv = c.alloc_device(256)
    mb = c.alloc_device(4, pool="mamba")
    assert kv is not None and mb is not None
    res = c.write(kv, pool_transfers=[PoolTransfer("mamba", device_indices=mb)])
    assert res is not None
    host, tr = res
    assert tr is not None
    c.poll_writes()
    stop = threading.Event()
    errors: list[BaseException] = []
    checks = [0]

    def submitter() -> None:
        try:
            while not stop.is_set():
                got = c.load(host, pool_transfers=[PoolTransfer("mamba", host_indices=tr[0].host_indices)])
                assert got is not None
                dev, tr2 = got
                c.start_loading()
                c.poll_loads()
                c.evict_device(dev)
                assert tr2 is not None
                c.evict_device(tr2[0].device_indices, pool="mamba")  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    def engine() -> None:
        mine = c.alloc_device(16)
        assert mine is not None
        dp = c.device_pool()
        g = torch.Generator().manual_seed(0)
        try:
            while not stop.is_set():
                want = {
                    n: torch.randn((p.shape[0], 16, *p.shape[2:]), generator=g).to(p.dtype)
                    for n, p in dp.planes.items()
                }
                dp.write_slots(mine, want)
                got = dp.read_slots(mine)
                assert all(torch.equal(got[k], want[k]) for k in want), "the engine read other data than it wrote"
                checks[0] += 1
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=submitter), threading.Thread(target=engine)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2.0
    while not stop.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(30)
    c.close()
    assert not errors, f"after {checks[0]} engine round trips: {errors[0]!r}"
    assert checks[0] > 0
