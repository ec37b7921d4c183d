"""The rooms the controller facade hands its work to, each exercised on its own: the FIFO
reaper (``acks.reap``), the one builder of ``TransferSubmitted`` (``submission.Submissions``)
and the ending of every op at close (``closing.end_every_op``); each result is checked
against the events it emits and, on a real controller, against the fold of its log."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from hicache_obs.core.acks import Ack, InFlightCopy, reap
from hicache_obs.events.schema import TransferCompleted, TransferFailed


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
