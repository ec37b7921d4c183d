"""The parts the controller facade hands its work to, each exercised on its own: the FIFO
reaper (``acks.reap``), the one builder of ``TransferSubmitted`` (``submission.Submissions``)
and the ending of every op at close (``closing.end_every_op``); each result is checked
against the events it emits and, on a real controller, against the fold of its log."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
import torch

from hicache_obs.core._acks import Ack, InFlightCopy, reap
from hicache_obs.events import expand_runs, fold
from hicache_obs.events._schema import TransferCompleted, TransferFailed, TransferSubmitted


class _Event:
    """A device event whose answers the test sets: done or not, a time, or a refusal."""

    def __init__(self, t: int, done: bool = True, refuse: str | None = None) -> None:
        self.t, self.done, self.refuse = t, done, refuse

    def query(self) -> bool:
        if self.refuse is not None:
            raise RuntimeError(self.refuse)
        return self.done

    def elapsed_ns(self, end: _Event) -> int:
        return end.t - self.t

    def record(self, stream: Any = None) -> None:
        pass


def _copy(op: int, *, done: bool = True, error: str | None = None, refuse: str | None = None) -> InFlightCopy:
    given = (("kv", "host", f"slots of {op}"),)  # what free_failed is handed back, as is
    return InFlightCopy(
        op, "d2h", (op * 10,), _Event(100 * op), _Event(100 * op + 7, done, refuse), None,
        (("kv", 16),), (("kv", 1024),), -1, error=error, given=given,  # type: ignore[arg-type]
    )  # fmt: skip


class _Emitted(list[tuple[str, dict[str, Any]]]):
    def __call__(self, cls: type, **fields: Any) -> None:
        self.append((cls.__name__, fields))


def test_reap_takes_ops_in_fifo_order_failures_in_their_place_and_stops_at_the_first_not_done() -> None:
    q = deque(
        [
            _copy(1),
            _copy(2, error="ValueError: refused"),
            _copy(3, refuse="device lost"),
            _copy(4, done=False),
            _copy(5),
        ]
    )
    emitted = _Emitted()
    acks = reap(q, emitted)
    assert emitted == [
        ("TransferCompleted", {"op": 1, "direction": "d2h", "duration_ns": 7, "layer_durations_ns": None}),
        ("TransferFailed", {"op": 2, "direction": "d2h", "error": "ValueError: refused"}),
        ("TransferFailed", {"op": 3, "direction": "d2h", "error": "RuntimeError: device lost"}),
    ]
    assert acks == [
        Ack(1, "d2h", (10,), True, None, 7, None, (("kv", 16),), (("kv", 1024),), -1),
        Ack(2, "d2h", (20,), False, "ValueError: refused", None, None, (("kv", 16),), (("kv", 1024),), -1),
        Ack(3, "d2h", (30,), False, "RuntimeError: device lost", None, None, (("kv", 16),), (("kv", 1024),), -1),
    ]
    assert [a.op_id for a in q] == [4, 5], "op 4 is not done: op 5, done, waits behind it"
    assert reap(q, emitted) == [] and len(emitted) == 3


def test_reap_at_close_takes_every_op_and_gives_back_the_slots_of_failed_ones_whose_copies_cannot_write() -> None:
    q = deque([_copy(1), _copy(2, error="ValueError: refused"), _copy(3, done=False), _copy(4)])
    emitted = _Emitted()
    freed: list[tuple[int, object]] = []
    acks = reap(q, emitted, closing=True, free_failed=lambda op, given: freed.append((op, given)))
    assert not q
    assert [(a.op_id, a.ok, a.error) for a in acks] == [
        (1, True, None),
        (2, False, "ValueError: refused"),
        (3, False, "RuntimeError: still unfinished at close(), after the runtime's synchronize()"),
        (4, True, None),
    ]
    assert [name for name, _ in emitted] == [
        "TransferCompleted",
        "TransferFailed",
        "TransferFailed",
        "TransferCompleted",
    ]
    assert freed == [(2, (("kv", "host", "slots of 2"),))], "op 3 may still write into its slots: they stay taken"


def test_reap_of_a_real_controller_emits_what_its_fold_then_holds(make_controller) -> None:
    c = make_controller(spec="tiny", runtime="cpu")
    dev = c.alloc_device(16)
    host = c.write(dev, node_id=4)
    assert host is not None
    (ack,) = c.poll_writes()
    (done,) = [e for e in c.log.events() if isinstance(e, (TransferCompleted, TransferFailed))]
    assert isinstance(done, TransferCompleted)
    assert (ack.op_id, ack.node_ids, ack.ok, ack.duration_ns or 0) == (done.op, (4,), True, done.duration_ns)
    assert c.in_flight("d2h") == 0 and c.state.ops == {}


@pytest.mark.parametrize("closing", [False, True])
def test_reap_of_an_empty_queue_emits_nothing(closing: bool) -> None:
    emitted = _Emitted()
    assert reap(deque(), emitted, closing=closing) == [] and emitted == []


# ------------------------------------------------------------------ submissions


def _without(ev: Any, *names: str) -> dict[str, Any]:
    import msgspec

    return {k: v for k, v in msgspec.to_builtins(ev).items() if k not in ("seq", "ts_ns", *names)}


def _ended_write(make_controller, monkeypatch: pytest.MonkeyPatch, where: str, spec: str) -> tuple[Any, list[Any], Ack]:
    """A write of a fresh controller whose ``where`` raises; its events from the write on, and its ack."""
    c = make_controller(spec=spec, runtime="sim")
    nodes = {p: c.alloc_device(16 if p != "mamba" else 2, pool=p) for p in c.spec.pool_names}

    def refuse(*args: object) -> None:
        raise ValueError(f"refused at {where}")

    monkeypatch.setattr(c, where, refuse)
    n = len(c.log)
    if spec == "tiny":
        assert c.write(nodes["kv"], node_id=3) is not None
    else:
        from hicache_obs.core import PoolTransfer

        transfers = [PoolTransfer(p, device_indices=t) for p, t in nodes.items() if p != "kv"]
        assert c.write(nodes["kv"], node_id=3, pool_transfers=transfers) is not None
    monkeypatch.undo()
    c.synchronize()
    (ack,) = c.poll_writes()
    return c, c.log.events()[n:], ack


@pytest.mark.parametrize("spec", ["tiny", "tiny_hybrid"])
def test_a_refused_index_move_and_a_failed_launch_end_the_op_with_the_same_event_fields(
    make_controller, monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    """An op that launched nothing (its index move refused) and an op whose launch raised
    carry the same ``TransferSubmitted`` but for the tensors (none were handed to a copy),
    the same ``TransferFailed`` but for the place named in the error, and the same ack."""
    ends = {where: _ended_write(make_controller, monkeypatch, where, spec) for where in ("_move_op", "_launch_write")}
    subs = {w: [e for e in evs if isinstance(e, TransferSubmitted)] for w, (_, evs, _) in ends.items()}
    fails = {w: [e for e in evs if isinstance(e, TransferFailed)] for w, (_, evs, _) in ends.items()}
    (refused,), (launched,) = subs["_move_op"], subs["_launch_write"]
    pools = ends["_launch_write"][0].spec.pool_names
    assert refused.tensors == () and len(launched.tensors) == 2 * len(pools)  # host and device, per pool
    assert _without(refused, "tensors") == _without(launched, "tensors")
    assert [_without(e, "error") for e in fails["_move_op"]] == [_without(e, "error") for e in fails["_launch_write"]]
    assert [e.error for w in ends for e in fails[w]] == [
        "ValueError: refused at _move_op",
        "ValueError: refused at _launch_write",
    ]
    acks = {w: ack for w, (_, _, ack) in ends.items()}
    assert acks["_move_op"].ok is acks["_launch_write"].ok is False
    assert {k: v for k, v in vars(acks["_move_op"]).items() if k != "error"} == {
        k: v for k, v in vars(acks["_launch_write"]).items() if k != "error"
    }
    for c, _, _ in ends.values():
        assert fold(c.log.events()).snapshot() == c.state.snapshot()


def test_end_unlaunched_submits_no_tensors_and_hands_back_a_failed_copy_done_at_once(make_controller) -> None:
    """The op's ``TransferSubmitted`` (sizes from the spec) and its copy: finished on the main
    stream, carrying the error and the slots it was given, reaped as its ``TransferFailed``."""
    from hicache_obs.core._submission import Submissions

    c = make_controller(spec="tiny_hybrid", runtime="sim")
    emitted = _Emitted()
    subs = Submissions(emitted, c.runtime, c.spec, "kernel", "page_first", enable_timing=True)
    given = (("kv", "device", "the slots given"),)
    copy = subs.end_unlaunched(9, "h2d", (1, 2), (("kv", 16), ("mamba", 2)), c.load_stream, 4, KeyError("gone"), given)  # type: ignore[arg-type]
    assert emitted == [
        (
            "TransferSubmitted",
            {
                "op": 9,
                "direction": "h2d",
                "stream": c.load_stream.name,
                "io_backend": "kernel",
                "layout": "page_first",
                "tensors": (),
                "slots_by_pool": (("kv", 16), ("mamba", 2)),
                "bytes_by_pool": (("kv", 16 * c.spec.slot_bytes("kv")), ("mamba", 2 * c.spec.slot_bytes("mamba"))),
                "producer_id": 4,
                "device": c.runtime.device,
            },
        )
    ]
    assert (copy.op_id, copy.direction, copy.node_ids, copy.producer_id, copy.given) == (9, "h2d", (1, 2), 4, given)
    assert copy.error == "KeyError: 'gone'" and copy.start is copy.finish and copy.layer_events is None
    (ack,) = reap(deque([copy]), emitted)
    assert emitted[-1] == ("TransferFailed", {"op": 9, "direction": "h2d", "error": "KeyError: 'gone'"})
    assert (ack.ok, ack.slots_by_pool, ack.bytes_by_pool) == (False, copy.slots_by_pool, copy.bytes_by_pool)


# ------------------------------------------------------------------ closing


def test_end_every_op_reaps_then_cancels_each_direction_and_leaves_nothing_open(make_controller) -> None:
    """A write in flight and a load queued, never started: the write is reaped first, then
    the load is merged alone, submitted with no tensors, reaped failed as cancelled and its
    device slots freed; ``end_unlaunched`` is asked for the load's op, nodes and pools."""
    from hicache_obs.core._closing import end_every_op
    from hicache_obs.events._schema import D2H, H2D

    c = make_controller(spec="tiny", runtime="sim")
    dev = c.alloc_device(16)
    host = c.write(dev, node_id=1)
    assert host is not None
    c.synchronize()
    assert [a.ok for a in c.poll_writes()] == [True]
    with c.runtime.paused():
        c.write(c.alloc_device(16), node_id=2)  # in flight: its copies wait on the paused stream
        loaded = c.load(host, node_id=3)  # queued: start_loading never called
    assert loaded is not None
    asked: list[tuple[Any, ...]] = []

    def end_unlaunched(*args: Any) -> InFlightCopy:
        asked.append(args[:6])
        return c._submissions.end_unlaunched(*args)

    n = len(c.log)
    c.runtime.synchronize()
    streams = {D2H: c.write_stream, H2D: c.load_stream}
    acks = end_every_op(c.state, c._ops, c._acks, streams, c._allocations, c._emit, end_unlaunched)
    assert [(a.op_id, a.node_ids, a.ok) for a in acks] == [(1, (2,), True), (2, (3,), False)]
    evs = c.log.events()[n:]
    assert [type(e).__name__ for e in evs] == [
        "TransferCompleted",
        "OperationsMerged",
        "TransferSubmitted",
        "TransferFailed",
        "SlotsFreed",
    ]
    merged, submitted, failed, freed = evs[1:]
    assert (merged.op, merged.merged_ops, merged.node_ids) == (2, (2,), (3,))
    assert asked == [(2, H2D, (3,), (("kv", 16),), c.load_stream, -1)]
    assert submitted.tensors == () and submitted.slots_by_pool == (("kv", 16),)
    assert failed.error == "ControllerClosedError: cancelled: the controller was closed before this op started"
    assert (freed.tier, freed.reason, freed.op, expand_runs(freed.indices)) == ("device", "failed", 2, loaded.tolist())
    assert c.state.ops == {} and c._ops == {} and not any(c._acks.values())
    assert fold(c.log.events()).snapshot() == c.state.snapshot()


# ------------------------------------------------------------------ the runtime's reports


def test_the_runtimes_reports_are_events_only_for_the_call_announced_and_reuse_its_description() -> None:
    """Two controllers' reports on one runtime: a record is reported to both, an event of
    the one that announced it only, with the description its submission made (the same
    object); a move is an event only when the normaliser is making it."""
    from hicache_obs.core import make_runtime
    from hicache_obs.core._describe import describe
    from hicache_obs.core._index_moves import IndexNormaliser
    from hicache_obs.core._reports import RuntimeReports
    from hicache_obs.events import EventLog, IndicesMoved, StreamRecorded

    rt = make_runtime("sim")
    logs = [EventLog(), EventLog()]
    reports = [RuntimeReports(rt, log, IndexNormaliser(rt, "kernel", "layer_first", read_runs=True)) for log in logs]
    for r in reports:
        rt.observers.add(record=r.recorded, move=r.moved)
    stream = rt.stream("side")
    host, device = torch.tensor([4, 5, 6]), rt.to_device(torch.tensor([1, 2, 3]))
    assert [len(log) for log in logs] == [0, 0], "a move nobody announced is no one's"
    ref = describe(rt, device, "kv", "device")
    reports[0].refs = {(id(device), "kv", "device"): ref}
    reports[0].record_pair(stream, "kv", host, device, 7)
    (ev,) = logs[0].events()
    assert isinstance(ev, StreamRecorded) and ev.tensor is ref
    assert (ev.op, ev.pool, ev.role, ev.stream) == (7, "kv", "device", "side")
    assert len(logs[1]) == 0 and reports[0].expected is None
    reports[0].refs = {}
    moved_host, _ = reports[1].moves.normalise(host, device, 8, "kv")
    assert rt.is_device(moved_host)
    (mv,) = logs[1].events()
    assert isinstance(mv, IndicesMoved) and (mv.op, mv.role, mv.src_device, mv.dst_device) == (
        8,
        "host",
        "cpu",
        rt.device,
    )
    assert expand_runs(mv.tensor.indices) == [4, 5, 6] and len(logs[0]) == 1


# ------------------------------------------------------------------ configuration and pools


@pytest.mark.parametrize("spec", ["tiny", "tiny_hybrid", "tiny_swa"])
def test_make_pools_creates_what_a_controller_logs_at_birth(spec: str) -> None:
    """Pools and their ``PoolCreated`` events (device, then host, per pool), the host sized
    from ``host_bytes`` across pools: what a controller with those options holds and logs."""
    from hicache_obs.core import HybridCacheController, ModelSpec, make_runtime
    from hicache_obs.core._pools import device_sizes, make_pools
    from hicache_obs.events import EventLog
    from hicache_obs.events._state import CacheState

    s = ModelSpec.preset(spec)
    log, state = EventLog(), CacheState()

    def emit(cls: type, **fields: Any) -> Any:  # the controller's: append, and fold at once
        ev = log.emit(cls, **fields)
        state.apply(ev)
        return ev

    dev, host = make_pools(
        s, device_sizes(s, 64, {}), host_ratio=2.0, host_bytes=1 << 20, layout="page_first_direct",
        runtime=make_runtime("cpu"), emit=emit, table=state.table,
    )  # fmt: skip
    opts = {"device_size": 64, "host_bytes": 1 << 20, "layout": "page_first_direct", "io_backend": "direct"}
    with HybridCacheController(s, runtime="cpu", **opts) as c:  # type: ignore[arg-type]
        assert [_without(e) for e in log.events()] == [
            _without(e) for e in c.log.events() if type(e).__name__ == "PoolCreated"
        ]
        assert {p: (d.size, host[p].size, host[p].layout) for p, d in dev.items()} == {
            p: (c.device_pool(p).size, c.host_pool(p).size, "page_first") for p in s.pool_names
        }
        assert state.snapshot() == c.state.snapshot()
        assert all(host[p].allocator.table is state.table(p, "host") for p in s.pool_names)


def test_the_configuration_is_checked_in_the_order_the_controller_always_did() -> None:
    """A hybrid model on the plain controller is named before a bad device size."""
    from hicache_obs.core import ModelSpec
    from hicache_obs.core._validation import check_options
    from hicache_obs.errors import ConfigError, UnknownLayoutError

    hybrid = ModelSpec.preset("tiny_hybrid")
    opts = {"io_backend": "kernel", "layout": "layer_first", "device_size": 3, "host_ratio": 2.0, "host_bytes": None}
    with pytest.raises(ConfigError, match=r"model 'tiny_hybrid' is hybrid .*; use HybridCacheController"):
        check_options(hybrid, **opts, plain=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"device_size must be a positive multiple of page size 16, got 3"):
        check_options(hybrid, **opts, plain=False)  # type: ignore[arg-type]
    with pytest.raises(UnknownLayoutError, match=r"'page_first_direct' needs io backend 'direct', got 'kernel'"):
        check_options(hybrid, **dict(opts, layout="page_first_direct"), plain=True)  # type: ignore[arg-type]
    check_options(hybrid, **dict(opts, device_size=64), plain=False)  # type: ignore[arg-type]


# ------------------------------------------------------------------ admission


def test_admission_checks_each_tensor_in_order_then_takes_every_pools_slots_or_none(make_controller) -> None:
    """The anchor's tensor is checked first, then each transfer's; the op holds new slots in
    new transfers; a runtime that fails to move a load's new slots leaves none taken; a pool
    that is short takes none; a transfer that names the side to allocate is refused."""
    from hicache_obs.core import PoolTransfer
    from hicache_obs.core._admission import Admission
    from hicache_obs.core._allocation import PoolAllocations
    from hicache_obs.errors import InvalidIndicesError
    from hicache_obs.events._schema import D2H, H2D

    c = make_controller(spec="tiny_hybrid", runtime="cpu", device_size=64)
    checked: list[tuple[str, str, str]] = []

    def validate(t: Any, *, arg: str, pool: str, tier: str, allow_empty: bool = False) -> None:
        checked.append((arg, pool, tier))

    ids = iter(range(100, 200))
    allocations = PoolAllocations(
        lambda pool, tier: (c.host_pool(pool) if tier == "host" else c.device_pool(pool)).allocator
    )
    admission = Admission(c.spec, c.runtime, allocations, validate, lambda p, t: c.device_pool(p), lambda: next(ids))
    kv, mamba = c.alloc_device(16), c.alloc_device(2, pool="mamba")
    theirs = (PoolTransfer("mamba", device_indices=mamba),)
    op = admission.admit(D2H, kv, None, 5, theirs)
    assert op is not None and checked == [("device_indices", "kv", "device"), ("device_indices", "mamba", "device")]
    assert (op.id, op.node_ids, op.priority, op.device_indices is kv) == (100, (5,), 100, True)
    assert op.pool_transfers[0].host_indices is not None and theirs[0].host_indices is None, "a new transfer"
    assert [(p, t, s.tolist()) for p, t, s in allocations.given(100)] == [
        ("kv", "host", op.host_indices.tolist()),
        ("mamba", "host", op.pool_transfers[0].host_indices.tolist()),
    ]
    used = {k: t.used for k, t in c.state.tables.items()}

    def refuse(t: Any) -> Any:
        raise RuntimeError("the runtime cannot move them")

    admission.runtime = type("Refusing", (), {"to_device": staticmethod(refuse)})()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="cannot move them"):
        admission.admit(
            H2D, op.host_indices, None, 6, (PoolTransfer("mamba", host_indices=op.pool_transfers[0].host_indices),)
        )
    assert {k: t.used for k, t in c.state.tables.items()} == used and allocations.given(101) == ()
    room = c.host_pool("kv").allocator.available()  # a write takes host slots
    assert admission.admit(D2H, torch.arange(room + 16), None, 7, None) is None
    assert {k: t.used for k, t in c.state.tables.items()} == used
    with pytest.raises(InvalidIndicesError, match=r"pool transfer .mamba.: host_indices must be None for a write"):
        admission.admit(D2H, kv, None, 8, (PoolTransfer("mamba", device_indices=mamba, host_indices=mamba),))
