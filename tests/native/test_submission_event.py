"""``submission_event``: a submission's one event, from what the SGLang adapter's hooks noted.

The compiled function (``hicache_obs/_slots.c``) and its pure twin
(``hicache_obs/events/_slots_py.py``) must hand ``emit`` the same fields on random
submissions (merged ops with and without node ids and priorities, ops queued before the
instrumentation or not, moves of the op and of a pool's copy, records on used tensors and on
others, loads and writes, results of every kind), take the same queue times, and raise the
same errors.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_obs import _slots as c_slots
from hicache_obs.events import _slots_py as py_slots
from hicache_obs.events._schema import Moved, OpsSubmitted, TensorRef
from hicache_obs.integrations.sglang import _tensor_facts as facts

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IMPLS = [pytest.param(c_slots, id="c"), pytest.param(py_slots, id="py")]
WRITE, LOAD = object(), object()  # the streams
STREAM_NAMES = {id(WRITE): "write_stream"}  # the load stream is not named: stream@<id>


def _pool_name(name: Any) -> str:
    return str(name)


def _setup(queued_at: dict[int, int], *, sidecars: tuple[Any, ...] = (), audit: float = 0.0) -> tuple[Any, ...]:
    owner = SimpleNamespace(write_stream=WRITE, load_stream=LOAD)
    return (
        {"d2h": (owner, "write_stream"), "h2d": (owner, "load_stream")},
        STREAM_NAMES,
        "kernel",
        "page_first",
        "cuda:0",
        sidecars,
        audit,
        {"kv": 16, "mamba": 4096},
        queued_at,
        "kv",
        {},
        _pool_name,
        Moved,
        "h2d",
    )


def _emit(cls: Any, **fields: Any) -> tuple[Any, dict[str, Any]]:
    return cls, fields


def _ref(t: torch.Tensor, pool: str, role: str) -> TensorRef:
    return facts.tensor_meta(t, pool, role)


@st.composite
def _submission(draw: Any) -> tuple[Any, dict[int, int], Any, Any]:
    def op(i: int) -> SimpleNamespace:
        fields: dict[str, Any] = {"id": i, "priority": draw(st.sampled_from([None, 0, 7, True]))}
        nodes = draw(st.sampled_from(["absent", "none", "empty", "some"]))
        if nodes != "absent":
            fields["node_ids"] = {"none": None, "empty": [], "some": [i + 100, i + 200]}[nodes]
        return SimpleNamespace(**fields)

    queued_ops = [op(i) for i in range(draw(st.integers(0, 4)))]
    queued_at = {id(q): 1000 + k for k, q in enumerate(queued_ops) if draw(st.booleans())}
    merged = None
    if draw(st.booleans()):
        merged = op(50)
        merged.host_indices = torch.arange(draw(st.integers(0, 6)))
        if draw(st.booleans()):
            merged.pool_transfers = [SimpleNamespace(name="mamba", host_indices=torch.arange(2), device_indices=None)]
    tensors = [torch.arange(draw(st.integers(0, 4))) for _ in range(3)]
    uses = {}
    for pool, role, k in (("kv", "host", 0), ("kv", "device", 1), ("mamba", "host", 2), ("mamba", "device", 0)):
        if draw(st.booleans()):
            uses[(pool, role)] = tensors[k]
    stranger = torch.arange(3)
    records = [
        (draw(st.sampled_from([*tensors, stranger, tensors[0][:]])), draw(st.sampled_from([WRITE, LOAD, object()])))
        for _ in range(draw(st.integers(0, 3)))
    ]
    ref = TensorRef(pool="kv", role="host", device="cpu", numel=1, dtype="int64", ptr=8)
    sub = SimpleNamespace(
        direction=draw(st.sampled_from(["d2h", "h2d"])),
        op=merged,
        queued_ops=queued_ops,
        uses=uses,
        records=records,
        moves=[Moved("kv", "host", "cpu", "cuda:0", ref)] if draw(st.booleans()) else [],
        side_moves=[("mamba", "host", "cpu", "cuda:0", ref)] if draw(st.booleans()) else [],
        host_indices_on_cpu=draw(st.sampled_from([[], ["mamba"]])),
        sampled=draw(st.booleans()),
    )
    result = draw(st.sampled_from([None, 0, 5, True, "ack", 2.5]))
    pools = draw(st.sampled_from([(), (("kv", "device", 3, 64),)]))
    return sub, queued_at, result, pools


def _run(impl: Any, sub: Any, queued_at: dict[int, int], result: Any, pools: Any) -> tuple[Any, ...]:
    refs = [_ref(t, pool, role) for (pool, role), t in sub.uses.items()]
    op_id = int(sub.op.id) if sub.op is not None else 9
    with facts.NO_TORCH_FUNCTION():
        cls, fields = impl.submission_event(
            _emit, OpsSubmitted, sub, op_id, refs, result, 5000, pools, _setup(queued_at)
        )
    return cls, fields, queued_at


@SETTINGS
@given(case=_submission())
def test_the_compiled_event_is_the_pure_one(case: Any) -> None:
    sub, queued_at, result, pools = case
    got = _run(c_slots, sub, dict(queued_at), result, pools)
    want = _run(py_slots, copy.copy(sub), dict(queued_at), result, pools)
    assert got == want
    cls, fields, left = got
    assert cls is OpsSubmitted
    OpsSubmitted(seq=0, ts_ns=0, rank=0, **fields)  # the fields make the event
    assert left == {}  # each merged op's queue time was taken
    assert [row[3] for row in fields["queued"]] == [queued_at.get(id(q), 5000) for q in sub.queued_ops]
    assert all(type(v) is int for row in fields["queued"] for v in row)


def test_the_fields_of_a_load_with_every_part() -> None:
    for impl in (c_slots, py_slots):
        host, device = torch.arange(4), torch.arange(4)
        op = SimpleNamespace(id=7, priority=None, node_ids=[3, 4], host_indices=host)
        queued = [op, SimpleNamespace(id=8, priority=2)]
        ref = _ref(host, "kv", "host")
        sub = SimpleNamespace(
            direction="h2d",
            op=op,
            queued_ops=queued,
            uses={("kv", "host"): host, ("kv", "device"): device},
            records=[(device, LOAD), (torch.arange(9), LOAD)],
            moves=[],
            side_moves=[("mamba", "host", "cpu", "cuda:0", ref)],
            host_indices_on_cpu=["mamba"],
            sampled=False,
        )
        queued_at = {id(op): 11}
        refs = [ref, _ref(device, "kv", "device")]
        with facts.NO_TORCH_FUNCTION():
            cls, fields = impl.submission_event(
                _emit,
                OpsSubmitted,
                sub,
                7,
                refs,
                42,
                99,
                (),
                _setup(queued_at, sidecars=(("mamba", "kv"),), audit=0.01),
            )
        load = f"stream@{id(LOAD):x}"
        assert cls is OpsSubmitted
        assert fields == {
            "op": 7,
            "direction": "h2d",
            "stream": load,
            "io_backend": "kernel",
            "layout": "page_first",
            "tensors": tuple(refs),
            "slots_by_pool": (("kv", 4),),
            "bytes_by_pool": (("kv", 64),),
            "producer_id": 42,
            "device": "cuda:0",
            "host_indices_on_cpu": ("mamba",),
            "sidecar_pools": (("mamba", "kv"),),
            "queued": ((7, 3, 7, 11), (8, -1, 2, 99)),
            "node_ids": (3, 4),
            "moves": (Moved("mamba", "host", "cpu", "cuda:0", ref, load),),
            "records": ((1, load),),
            "sampled": False,
            "pools": (),
            "audit_sample": 0.01,
        }
        assert queued_at == {}


@pytest.mark.parametrize("impl", IMPLS)
def test_what_it_cannot_read_is_raised(impl: Any) -> None:
    def sub(**fields: Any) -> SimpleNamespace:
        base: dict[str, Any] = {"direction": "d2h", "op": None, "queued_ops": [], "uses": {}, "records": [],
                                "moves": [], "side_moves": [], "host_indices_on_cpu": [], "sampled": False}  # fmt: skip
        base.update(fields)
        return SimpleNamespace(**base)

    good = _setup({})
    cases = [
        (sub(), [], good[:-1], TypeError, "setup is a tuple of 14"),
        (sub(), (), good, TypeError, "refs a list"),
        (sub(direction="sideways"), [], good, KeyError, "no stream for direction 'sideways'"),
        (sub(side_moves=[("mamba", "host")]), [], good, ValueError, "a side move is"),
        (sub(uses=[]), [], good, TypeError, "uses is a dict"),
        (sub(queued_ops=[SimpleNamespace(priority=None)]), [], good, AttributeError, "id"),
        (sub(op=SimpleNamespace(id=1)), [], good, AttributeError, "host_indices"),
    ]
    for s, refs, setup, error, text in cases:
        with pytest.raises(error, match=text), facts.NO_TORCH_FUNCTION():
            impl.submission_event(_emit, OpsSubmitted, s, 1, refs, None, 0, (), setup)

    def refuse(cls: Any, **fields: Any) -> Any:
        raise RuntimeError("the log is closed")

    with pytest.raises(RuntimeError, match="the log is closed"):
        impl.submission_event(refuse, OpsSubmitted, sub(), 1, [], None, 0, (), good)
