"""``use_refs`` and ``recorded``: the SGLang adapter's description of one submission.

The compiled functions (``hicache_obs/_slots.c``) and their pure twins
(``hicache_obs/events/_slots_py.py``) must give the same results and errors on random
submissions: tensors that report a CUDA device (a subclass, as a GPU's index tensors, on
device 0 or 1), CPU tensors of every dtype, empty ones, views, tensors on the ``meta``
device (neither CPU nor CUDA), one tensor under several keys; records on used tensors, on
other tensor objects over the same memory, on other memory, on the submission's stream, on
named and unnamed streams. ``use_refs`` must also give what ``tensor_meta`` gives for each
tensor, whichever way it read it.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_obs import _slots as c_slots
from hicache_obs.events import _slots_py as py_slots
from hicache_obs.events._schema import TensorRef
from hicache_obs.integrations.sglang import _tensor_facts as facts

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool, torch.float32]
IMPLS = [pytest.param(c_slots, id="c"), pytest.param(py_slots, id="py")]


class _OnDevice(torch.Tensor):
    """A CPU tensor that reports a CUDA device (``index``), as a GPU's index tensor does."""

    index = 0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.index)

    def __repr__(self) -> str:  # type: ignore[override]
        with torch._C.DisableTorchFunctionSubclass():
            return f"{type(self).__name__}({self.tolist()})"


class _OnDevice1(_OnDevice):
    index = 1


class _OddDevice(_OnDevice):
    """Reports CUDA with a device that is not a ``torch.device``: the pure description's case."""

    @property
    def device(self) -> Any:  # type: ignore[override]
        return SimpleNamespace(type="cuda", index=3)


class _NamedDevice(_OnDevice):
    """Reports CUDA with its device as a name (a string), as some stand-ins do."""

    name = "cuda:2"

    @property
    def device(self) -> Any:  # type: ignore[override]
        return self.name


class _BadlyNamedDevice(_NamedDevice):
    name = "not a device"


def _outcome(fn: Any, *args: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn(*args))
    except (TypeError, ValueError, AttributeError) as exc:
        return ("raised", type(exc).__name__, str(exc))


@st.composite
def _tensor(draw: Any) -> torch.Tensor:
    kind = draw(st.sampled_from(["cpu", "cuda0", "cuda1", "odd", "named", "badly named", "meta", "view"]))
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(0, 12))
    if kind == "meta":
        return torch.empty(n, dtype=dtype, device="meta")
    t = torch.arange(n).to(dtype)
    if kind == "view" and n > 2:
        t = t[1::2]
    cls = {
        "cuda0": _OnDevice, "cuda1": _OnDevice1, "odd": _OddDevice, "named": _NamedDevice,
        "badly named": _BadlyNamedDevice,
    }.get(kind)  # fmt: skip
    return t.as_subclass(cls) if cls is not None else t


@st.composite
def _submission(draw: Any) -> tuple[dict[tuple[str, str], Any], list[tuple[Any, Any]], Any, dict[int, str], list[Any]]:
    pool_tensors = draw(st.lists(_tensor(), min_size=0, max_size=6))
    keys = [("kv", "host"), ("kv", "device"), ("mamba", "host"), ("mamba", "device"), ("draft", "host"), ("draft", "device")]
    uses: dict[tuple[str, str], Any] = {}
    for key, t in zip(keys, pool_tensors):
        # now and then one tensor under a second key (a draft pool copies with the KV indices)
        uses[key] = uses[keys[0]] if uses and draw(st.integers(0, 5)) == 0 else t
    streams = [object(), object(), object()]
    names = {id(streams[0]): "write_stream", id(streams[1]): ""}  # an empty name reads as unnamed
    records: list[tuple[Any, Any]] = []
    used = list(uses.values())
    for _ in range(draw(st.integers(0, 8))):
        how = draw(st.sampled_from(["used", "alias", "other"]))
        stream = draw(st.sampled_from(streams))
        if how == "used" and used:
            records.append((draw(st.sampled_from(used)), stream))
        elif how == "alias" and used:
            src = draw(st.sampled_from(used))
            records.append((src if src.is_meta else src.view(src.shape), stream))
        else:
            records.append((torch.arange(draw(st.integers(0, 4))), stream))
    return uses, records, streams[0], names, streams


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(sub=_submission())
def test_use_refs_give_what_tensor_meta_gives(impl: Any, sub: Any) -> None:
    uses = sub[0]
    cache: dict[Any, Any] = {}
    with facts.NO_TORCH_FUNCTION():
        got = impl.use_refs(uses, cache, TensorRef, facts.META_NAMES, facts.tensor_meta)
        want = [facts.tensor_meta(t, pool, role) for (pool, role), t in uses.items()]
    assert got == want
    assert cache == {(id(t), pool, role): ref for ((pool, role), t), ref in zip(uses.items(), want)}
    # what the cache holds is taken, not made again
    marker = TensorRef(pool="kv", role="host", device="x", numel=0, dtype="int64", ptr=0)
    for key in cache:
        cache[key] = marker
    assert impl.use_refs(uses, cache, TensorRef, facts.META_NAMES, facts.tensor_meta) == [marker] * len(uses)


@SETTINGS
@given(sub=_submission())
def test_recorded_c_and_pure_agree(sub: Any) -> None:
    uses, records, stream, names, _ = sub
    tensors = list(uses.values())
    with facts.NO_TORCH_FUNCTION():
        refs = [facts.tensor_meta(t, pool, role) for (pool, role), t in uses.items()]
        got = _outcome(c_slots.recorded, tensors, refs, records, stream, "the-stream", names)
        want = _outcome(py_slots.recorded, tensors, refs, records, stream, "the-stream", names)
    assert got == want


def test_recorded_names_each_hit() -> None:
    a, b = torch.arange(4), torch.arange(6)
    alias = a.view(4)  # another object over a's memory
    other = torch.arange(4)
    s, named, unnamed = object(), object(), object()
    names = {id(named): "load_stream"}
    for impl in (c_slots, py_slots):
        refs = [facts.tensor_meta(t, "kv", r) for t, r in ((a, "host"), (b, "device"), (a, "host"))]
        got = impl.recorded([a, b, a], refs, [(a, s), (b, named), (alias, unnamed), (other, s)], s, "write", names)
        assert got == [(0, "write"), (2, "write"), (1, "load_stream"), (0, f"stream@{id(unnamed):x}"), (2, f"stream@{id(unnamed):x}")]


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_are_named(impl: Any) -> None:
    t = torch.arange(3)
    ref = facts.tensor_meta(t, "kv", "host")
    cases = [
        (impl.use_refs, ([], {}, TensorRef, facts.META_NAMES, facts.tensor_meta), TypeError, "uses and cache are dicts"),
        (impl.use_refs, ({"kv": t}, {}, TensorRef, facts.META_NAMES, facts.tensor_meta), TypeError, "(pool, role)"),
        (impl.use_refs, ({}, {}, TensorRef, ({}, {}), facts.tensor_meta), TypeError, "names is"),
        (impl.use_refs, ({}, {}, None, facts.META_NAMES, facts.tensor_meta), TypeError, "are callables"),
        (impl.recorded, ((t,), [ref], [], None, "s", {}), TypeError, "are lists"),
        (impl.recorded, ([t], [], [], None, "s", {}), ValueError, "1 tensors and 0 refs"),
        (impl.recorded, ([t], [ref], [t], None, "s", {}), TypeError, "a record is (tensor, stream)"),
    ]
    for fn, args, exc, text in cases:
        with pytest.raises(exc) as info:
            fn(*args)
        assert text in str(info.value), (fn, str(info.value))


class _Name:
    """A pool's name as SGLang's enums give it: its text under ``value``."""

    def __init__(self, value: str) -> None:
        self.value = value


def _pool_name(name: Any) -> str:
    return f"named-{name.value}"


@st.composite
def _op(draw: Any) -> tuple[Any, ...]:
    def part() -> Any:
        return draw(st.one_of(_tensor(), st.none(), st.just([1, 2])))

    names = [_Name("mamba"), _Name("swa"), _Name("mamba")]
    cached = {id(names[0]): (names[0], "mamba"), id(names[2]): (object(), "stale")}  # a stale entry: not this object
    transfers = [
        SimpleNamespace(name=draw(st.sampled_from(names)), host_indices=part(), device_indices=part())
        for _ in range(draw(st.integers(0, 3)))
    ]
    return part(), part(), draw(st.sampled_from([transfers, None, ()])), cached


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(op=_op())
def test_op_tensors_c_and_pure_agree(impl: Any, op: Any) -> None:
    host, device, transfers, cached = op
    got = impl.op_tensors(host, device, transfers, "kv", torch.Tensor, cached, _pool_name)
    want = py_slots.op_tensors(host, device, transfers, "kv", torch.Tensor, cached, _pool_name)
    assert list(got.items()) == list(want.items())
    expect = [("kv", "host")] * isinstance(host, torch.Tensor) + [("kv", "device")] * isinstance(device, torch.Tensor)
    assert list(got)[: len(expect)] == expect
    for t in transfers or ():
        pool = "mamba" if t.name is next(iter(cached.values()))[0] else _pool_name(t.name)
        if isinstance(t.host_indices, torch.Tensor):
            assert (pool, "host") in got


def test_op_tensors_names_a_broken_transfer() -> None:
    broken = [SimpleNamespace(name=_Name("swa"), host_indices=torch.arange(2))]  # no device_indices
    for impl in (c_slots, py_slots):
        with pytest.raises(AttributeError, match="device_indices"):
            impl.op_tensors(None, None, broken, "kv", torch.Tensor, {}, _pool_name)
        with pytest.raises(TypeError, match="pool_names is a dict"):
            impl.op_tensors(None, None, (), "kv", torch.Tensor, [], _pool_name)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(sub=_submission(), moved=st.lists(st.sampled_from(["same", "moved", "gone", "none", "copy"]), max_size=6))
def test_device_changes_name_what_a_move_put_elsewhere(impl: Any, sub: Any, moved: list[str]) -> None:
    before = dict(sub[0])
    after: dict[Any, Any] = {}
    for (key, t), how in zip(before.items(), moved + ["same"] * len(before)):
        if how == "same":
            after[key] = t
        elif how == "moved":  # to the other side: a CPU tensor onto the device, a device one back
            plain = t.as_subclass(torch.Tensor) if not t.is_meta else torch.arange(2)
            after[key] = plain.as_subclass(_OnDevice) if not t.is_cuda else plain.clone()
        elif how == "none":
            after[key] = None
        elif how == "copy":  # another object on the same device
            after[key] = t.clone() if not t.is_meta else t
    with facts.NO_TORCH_FUNCTION():
        got = impl.device_changes(before, after, facts.META_NAMES, facts.device_name)
        want = [
            (key, facts.device_name(src), facts.device_name(after[key]), after[key])
            for key, src in before.items()
            if after.get(key) is not None
            and after[key] is not src
            and facts.device_name(after[key]) != facts.device_name(src)
        ]
    assert [(k, w, n) for k, w, n, _ in got] == [(k, w, n) for k, w, n, _ in want]
    assert all(a is b for (*_, a), (*_, b) in zip(got, want))


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(host=st.one_of(_tensor(), st.none()), device=st.one_of(_tensor(), st.none()), known=st.booleans())
def test_received_notes_uses_and_watches_what_is_off_the_device(impl: Any, host: Any, device: Any, known: bool) -> None:
    earlier = torch.arange(1)
    uses: dict[Any, Any] = {("kv", "host"): earlier} if known else {}
    with facts.NO_TORCH_FUNCTION():
        watched = impl.received(uses, "kv", host, device, torch.Tensor)
        off = [(role, t) for role, t in (("host", host), ("device", device)) if t is not None and not t.is_cuda]
    assert watched == {id(t): (role, t) for role, t in off} and all(watched[id(t)][1] is t for _, t in off)
    want = {("kv", "host"): earlier} if known else {}
    for role, t in (("host", host), ("device", device)):
        if t is not None:
            want.setdefault(("kv", role), t)
    assert list(uses) == list(want) and all(uses[k] is want[k] for k in want)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_cached_none_is_described_again(impl: Any) -> None:
    t = torch.arange(3)
    cache: dict[Any, Any] = {(id(t), "kv", "host"): None}
    with facts.NO_TORCH_FUNCTION():
        got = impl.use_refs({("kv", "host"): t}, cache, TensorRef, facts.META_NAMES, facts.tensor_meta)
        assert got == [facts.tensor_meta(t, "kv", "host")] == [cache[(id(t), "kv", "host")]]


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(t=_tensor())
def test_meta_ref_and_device_of_give_what_the_pure_descriptions_give(impl: Any, t: Any) -> None:
    with facts.NO_TORCH_FUNCTION():
        assert impl.meta_ref(t, "kv", "device", TensorRef, facts.META_NAMES, facts.tensor_meta) == facts.tensor_meta(
            t, "kv", "device"
        )
        assert impl.device_of(t, facts.META_NAMES, facts.device_name) == facts.device_name(t)


def test_a_device_reported_by_name_is_read_from_the_name() -> None:
    with facts.NO_TORCH_FUNCTION():
        assert facts.device_name(torch.arange(2).as_subclass(_NamedDevice)) == "cuda:2"
        assert facts.device_name(torch.arange(2).as_subclass(_BadlyNamedDevice)) == "cuda:0"
        assert facts.tensor_meta(torch.arange(2).as_subclass(_NamedDevice), "kv", "device").device == "cuda:2"


@pytest.mark.parametrize("impl", IMPLS)
def test_meta_ref_and_device_of_name_bad_arguments(impl: Any) -> None:
    t = torch.arange(3)
    cases = [
        (impl.meta_ref, (t, "kv", "host", TensorRef, ({}, {}), facts.tensor_meta), "names is"),
        (impl.meta_ref, (t, "kv", "host", None, facts.META_NAMES, facts.tensor_meta), "are callables"),
        (impl.device_of, (t, facts.META_NAMES, None), "slow is a callable"),
        (impl.device_of, (t, None, facts.device_name), "names is"),
    ]
    for fn, args, text in cases:
        with pytest.raises(TypeError, match=text):
            fn(*args)


@st.composite
def _queued_op(draw: Any) -> Any:
    def indices() -> Any:
        return draw(st.one_of(st.none(), st.integers(0, 9).map(torch.arange), st.integers(0, 9).map(
            lambda n: torch.arange(n).as_subclass(_OnDevice))))

    names = [_Name("mamba"), _Name("swa"), _Name("mamba")]
    transfers = []
    for _ in range(draw(st.integers(0, 4))):
        fields = {"name": draw(st.sampled_from(names)), "host_indices": indices(), "device_indices": indices()}
        how = draw(st.sampled_from(["own", "own", "from_pool", "from_none"]))
        if how == "from_pool":
            fields["indices_from_pool"] = "kv"  # indices shared with another pool: not counted
        elif how == "from_none":
            fields["indices_from_pool"] = None
        transfers.append(SimpleNamespace(**fields))
    op = {"host_indices": torch.arange(draw(st.integers(0, 9)))}
    which = draw(st.sampled_from(["list", "none", "empty", "absent"]))
    if which != "absent":
        op["pool_transfers"] = {"list": transfers, "none": None, "empty": []}[which]
    return SimpleNamespace(**op)


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(op=_queued_op())
def test_slots_by_pool_counts_each_pools_slots(impl: Any, op: Any) -> None:
    cached = {id(n): (n, "mamba") for n in {t.name for t in getattr(op, "pool_transfers", None) or ()}
              if n.value == "mamba"}  # fmt: skip
    with facts.NO_TORCH_FUNCTION():
        got = impl.slots_by_pool(op, "kv", cached, _pool_name)
    want: dict[str, int] = {"kv": op.host_indices.numel()}
    for t in getattr(op, "pool_transfers", None) or ():
        if getattr(t, "indices_from_pool", None) is not None:
            continue
        idx = t.host_indices if t.host_indices is not None else t.device_indices
        pool = "mamba" if t.name.value == "mamba" else _pool_name(t.name)
        want[pool] = want.get(pool, 0) + (idx.numel() if idx is not None else 0)
    assert got == tuple(want.items())
    assert all(type(n) is int for _, n in got)


def test_slots_by_pool_names_what_it_cannot_read() -> None:
    for impl in (c_slots, py_slots):
        with pytest.raises(AttributeError, match="host_indices"):
            impl.slots_by_pool(SimpleNamespace(), "kv", {}, _pool_name)
        broken = SimpleNamespace(host_indices=torch.arange(2), pool_transfers=[SimpleNamespace(name=_Name("swa"))])
        with pytest.raises(AttributeError, match="host_indices"):
            impl.slots_by_pool(broken, "kv", {}, _pool_name)
        with pytest.raises(TypeError, match="pool_names is a dict"):
            impl.slots_by_pool(broken, "kv", [], _pool_name)


class _Current:
    sub: Any = None


@pytest.mark.parametrize("impl", IMPLS)
def test_copy_hook_passes_through_what_the_submission_has_seen(impl: Any) -> None:
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def original(*args: Any, **kwargs: Any) -> str:
        calls.append(("original", args, kwargs))
        return "copied"

    def first(*args: Any, **kwargs: Any) -> str:
        calls.append(("first", args, kwargs))
        if len(args) >= 3:
            current.sub.copied.add(("kv", id(args[1]), id(args[2])))
        return "described"

    current = _Current()
    hook = impl.copy_hook(original, current, "kv", first)
    assert hook.__wrapped__ is original
    pool, h, d = object(), torch.arange(2), torch.arange(2)
    assert hook(pool, h, d, 3, layer_id=0) == "copied"  # outside a submission
    current.sub = SimpleNamespace(copied=set())
    assert hook(pool, h, d, 3, layer_id=0) == "described"  # the submission's first copy of these tensors
    assert hook(pool, h, d, 3, layer_id=1) == "copied"  # the next layer's
    assert hook(pool, d, h, layer_id=2) == "described"  # other tensors
    assert hook(pool, h, device_indices=d) == "described"  # another shape: first's to read
    assert [c[0] for c in calls] == ["original", "first", "original", "first", "first"]
    assert calls[0] == ("original", (pool, h, d, 3), {"layer_id": 0})
    assert calls[2] == ("original", (pool, h, d, 3), {"layer_id": 1})
    assert calls[4] == ("first", (pool, h), {"device_indices": d})
    with pytest.raises(TypeError, match="are callables"):
        impl.copy_hook(None, current, "kv", first)
    current.sub = SimpleNamespace()  # a submission without copied: its error, not a wrong pass-through
    with pytest.raises(AttributeError, match="copied"):
        hook(pool, h, d)


class _Watch:
    """What a conversion observer reads of its watch: its thread, the roles it knows, ``describe``."""

    def __init__(self, known: set[str]) -> None:
        self.thread = threading.get_ident()
        self.known = known
        self.described: list[tuple[Any, Any, str]] = []

    def describe(self, src: Any, out: Any, role: str) -> None:
        self.described.append((src, out, role))
        self.known.add(role)


@pytest.mark.parametrize("impl", IMPLS)
def test_conversion_observer_describes_a_new_tensor_once_on_the_watchs_thread(impl: Any) -> None:
    src = torch.arange(4)
    watch = _Watch(set())
    to = impl.conversion_observer(torch.Tensor.to, src, "host", watch, torch.Tensor)
    assert to.__wrapped__ is torch.Tensor.to
    assert to(torch.int64) is src and watch.described == []  # the same tensor back: no move
    out = to("meta", non_blocking=True)
    assert out.device.type == "meta" and watch.described == [(src, out, "host")]
    again = to("meta")  # the role is known now
    assert again.device.type == "meta" and len(watch.described) == 1
    other = _Watch(set())
    elsewhere = impl.conversion_observer(torch.Tensor.to, src, "host", other, torch.Tensor)
    got: list[Any] = []
    th = threading.Thread(target=lambda: got.append(elsewhere("meta")))
    th.start()
    th.join()
    assert got[0].device.type == "meta" and other.described == []  # another thread's call
    not_a_tensor = impl.conversion_observer(lambda t, *a: [t, a], src, "host", _Watch(set()), torch.Tensor)
    assert not_a_tensor(1, 2, 3, 4, 5, 6, 7, 8, 9) == [src, (1, 2, 3, 4, 5, 6, 7, 8, 9)]  # more than 8 arguments
    with pytest.raises(TypeError, match="method is torch\\.Tensor's to or cuda"):
        impl.conversion_observer(None, src, "host", watch, torch.Tensor)


@pytest.mark.parametrize("impl", IMPLS)
def test_conversion_observer_raises_what_the_method_or_the_description_raised(impl: Any) -> None:
    src = torch.arange(4)

    def broken(t: Any, *a: Any) -> Any:
        raise RuntimeError("the conversion failed")

    with pytest.raises(RuntimeError, match="the conversion failed"):
        impl.conversion_observer(broken, src, "host", _Watch(set()), torch.Tensor)("meta")

    class Failing(_Watch):
        def describe(self, src: Any, out: Any, role: str) -> None:
            raise ValueError("no description")

    with pytest.raises(ValueError, match="no description"):
        impl.conversion_observer(torch.Tensor.to, src, "host", Failing(set()), torch.Tensor)("meta")


@st.composite
def _exported(draw: Any) -> torch.Tensor:
    """A CPU tensor DLPack exports without runs of its values (a 2-D view across rows, a
    negative view that must be resolved), or an index tensor it gives runs of."""
    kind = draw(st.sampled_from(["2d", "neg", "plain"]))
    n = draw(st.integers(1, 12))
    t = torch.arange(n * 3, dtype=draw(st.sampled_from([torch.int64, torch.int32]))).reshape(3, n)
    if kind == "2d":
        return t[:, ::2]
    if kind == "neg":
        return torch.arange(n)._neg_view()
    return t[0]


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(
    t=st.one_of(_tensor(), _exported()),
    dev=st.sampled_from([None, None, "cpu", "cuda:0", "meta"]),
    values=st.booleans(),
)
def test_value_ref_gives_what_the_pure_description_gives(impl: Any, t: Any, dev: Any, values: bool) -> None:
    reads = (TensorRef, facts.META_NAMES, facts._TO_DLPACK, facts._tensor_ref)
    with facts.NO_TORCH_FUNCTION():
        want = _outcome(facts._tensor_ref, t, "kv", "host", dev, values)
        got = _outcome(impl.value_ref, t, "kv", "host", dev, values, *reads)
    assert got == want
    if want[0] == "ok" and dev in (None, "cpu") and values and not t.is_cuda and t.is_cpu and t.numel():
        assert got[1].indices == (tuple(facts.host_runs(t)) or None)  # the values, as the adapter reads them


@pytest.mark.parametrize("impl", IMPLS)
def test_value_ref_asks_slow_for_what_the_export_does_not_give(impl: Any) -> None:
    asked: list[tuple[Any, ...]] = []

    def slow(*args: Any) -> str:
        asked.append(args)
        return "slow's"

    exported, named, floats = torch.arange(4), torch.arange(3).as_subclass(_NamedDevice), torch.ones(2)
    with facts.NO_TORCH_FUNCTION():
        for t, dev in ((exported, None), (named, None), (floats, "cpu")):
            got = impl.value_ref(t, "kv", "host", dev, True, TensorRef, facts.META_NAMES, facts._TO_DLPACK, slow)
            if impl is py_slots or t is not exported:
                assert got == "slow's" and asked[-1][0] is t and asked[-1][1:] == ("kv", "host", dev, True)
            else:
                assert got == TensorRef(
                    pool="kv", role="host", device="cpu", numel=4, dtype="int64", ptr=t.data_ptr(), indices=((0, 4),)
                )
        got = impl.value_ref(exported, "kv", "host", None, True, TensorRef, facts.META_NAMES, None, slow)
        assert got == "slow's" and asked[-1][3] is None  # no DLPack export in this torch
    with pytest.raises(TypeError, match=r"value_ref\(\): names is"):
        impl.value_ref(exported, "kv", "host", None, True, TensorRef, (), facts._TO_DLPACK, slow)


@pytest.mark.parametrize("impl", IMPLS)
def test_observers_are_placed_on_each_watched_tensor_and_taken_off_again(impl: Any) -> None:
    host, device, kept = torch.arange(4), torch.arange(3), torch.arange(2)
    own = kept.to  # something a tensor has there already is never replaced
    kept.__dict__["to"] = own
    watch = _Watch(set())
    watched = {id(host): ("host", host), id(device): ("device", device), id(kept): ("host", kept), 1: ("host", 7)}
    placed: list[Any] = []
    assert impl.place_observers(watched, ("to", "cuda"), torch.Tensor, watch, placed) is None
    assert placed == [(host, "to"), (host, "cuda"), (device, "to"), (device, "cuda"), (kept, "cuda")]
    assert all(placed_t.__dict__[name].__wrapped__ is getattr(torch.Tensor, name) for placed_t, name in placed)
    assert kept.__dict__["to"] is own  # an int has no __dict__: passed over
    out = host.to("meta")
    assert watch.described == [(host, out, "host")]
    device.to("meta")
    assert [role for *_, role in watch.described] == ["host", "device"]
    assert impl.remove_observers(placed) is None
    assert placed == [] and "to" not in host.__dict__ and "cuda" not in device.__dict__ and kept.__dict__ == {"to": own}
    host.to("meta")
    assert len(watch.described) == 2  # taken off: the class's own method again


@pytest.mark.parametrize("impl", IMPLS)
def test_observers_refuse_what_is_not_a_watch(impl: Any) -> None:
    t = torch.arange(2)
    with pytest.raises(TypeError, match=r"place_observers\(\): watched is a dict, methods a tuple, placed a list"):
        impl.place_observers({}, ["to"], torch.Tensor, _Watch(set()), [])
    with pytest.raises(TypeError, match=r"watched maps to \(role, tensor\)"):
        impl.place_observers({1: t}, ("to",), torch.Tensor, _Watch(set()), [])
    with pytest.raises(TypeError, match=r"remove_observers\(\): placed is a list"):
        impl.remove_observers(())
    with pytest.raises(TypeError, match=r"placed holds \(tensor, name\)"):
        impl.remove_observers([t])
