"""``copy_hook`` with its setup: the SGLang adapter's copy hook describing a copy itself.

The first call of a submission's copy with a pair of index tensors notes them as the op's
uses; where one is off the device and the io backend is ``kernel`` the copy runs under a
conversion watch, and the moves it saw join the submission's. Both implementations (the
C hook of ``hicache_obs/_slots.c`` and the twin of ``hicache_obs/events/_slots_py.py``) must
do the same, including when a step of their own fails: counted, the copy run as it came.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hicache_obs import _slots as c_slots
from hicache_obs.events import _slots_py as py_slots
from hicache_obs.integrations.sglang import _tensor_facts as facts

IMPLS = [pytest.param(c_slots, id="c"), pytest.param(py_slots, id="py")]


class _Current:
    sub: Any = None


class _OnDevice(torch.Tensor):
    """A CPU tensor that reports a CUDA device, as a GPU's index tensor does."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class _Watch:
    """The conversion watch's contract: made ``(pool, watched, failed, known, values)``; read
    for ``thread``, ``known``, ``describe`` (by the observers) and ``moves`` (by the hook)."""

    made: list[_Watch] = []

    def __init__(self, pool: str, watched: dict[int, Any], failed: Any, known: frozenset[str], values: bool) -> None:
        self.pool, self.watched, self.failed, self.values = pool, watched, failed, values
        self.given_known = known
        self.known = set(known)
        self.thread = threading.get_ident()
        self.moves: list[Any] = []
        _Watch.made.append(self)

    def describe(self, src: Any, out: Any, role: str) -> None:
        self.moves.append((role, str(src.device), str(out.device), f"ref of {role}"))
        self.known.add(role)


class _Copy:
    """A pool's copy: records each call, and what the index tensors carried while it ran;
    moves the host indices to ``meta`` itself where ``converts`` (SGLang's Mamba host pool
    moves its CPU indices to the device inside the copy)."""

    def __init__(self, converts: bool = False, raises: BaseException | None = None) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.observed: list[set[str]] = []
        self.converts, self.raises = converts, raises

    def __call__(self, device_pool: Any, host: Any, device: Any, *args: Any, **kwargs: Any) -> str:
        self.calls.append(((device_pool, host, device, *args), kwargs))
        self.observed.append(set(getattr(host, "__dict__", {})) & {"to", "cuda"})
        if self.converts:
            host.to("meta")
            host.to("meta")  # a second layer's conversion of the same role: one move
        if self.raises is not None:
            raise self.raises
        return "copied"


def _sub(**fields: Any) -> SimpleNamespace:
    base: dict[str, Any] = {
        "copied": set(),
        "uses": {},
        "direction": "d2h",
        "host_indices_on_cpu": [],
        "side_moves": [],
        "sampled": False,
    }
    base.update(fields)
    return SimpleNamespace(**base)


def _setup(
    failed: list[str],
    *,
    received: Any = None,
    kernel: bool = True,
    staged: Any = None,
    full: bool = False,
    watch: Any = _Watch,
    impl: Any = c_slots,
) -> tuple[Any, ...]:
    return (
        watch,
        failed.append,
        torch.Tensor,
        facts.NO_TORCH_FUNCTION,
        ("to", "cuda"),
        impl.received if received is None else received,
        kernel,
        staged,
        full,
        "d2h",
    )


def _hook(impl: Any, copy: Any, current: _Current, setup: tuple[Any, ...]) -> Any:
    def first(device_pool: Any, host_indices: Any, device_indices: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(device_pool, host_indices, device_indices, *args, **kwargs)

    hook = impl.copy_hook(copy, current, "mamba", first, setup)
    return hook


@pytest.mark.parametrize("impl", IMPLS)
def test_the_first_copy_notes_its_tensors_and_watches_those_off_the_device(impl: Any) -> None:
    failed: list[str] = []
    copy, current = _Copy(converts=True), _Current()
    hook = _hook(impl, copy, current, _setup(failed, impl=impl))
    assert hook.__wrapped__ is copy
    pool, host, device = object(), torch.arange(4), torch.arange(4).as_subclass(_OnDevice)
    assert hook(pool, host, device, 7, layer_id=0) == "copied"  # outside a submission: nothing noted
    assert copy.observed == [set()]
    sub = current.sub = _sub()
    _Watch.made.clear()
    assert hook(pool, host, device, 7, layer_id=0) == "copied"
    assert copy.calls[-1] == ((pool, host, device, 7), {"layer_id": 0})  # the call as it came
    assert sub.copied == {("mamba", id(host), id(device))}
    assert sub.uses == {("mamba", "host"): host, ("mamba", "device"): device}
    assert copy.observed[-1] == {"to", "cuda"}  # the watch was on the host indices while it copied
    assert "to" not in vars(host) and "cuda" not in vars(host)  # and is off again
    (watch,) = _Watch.made
    assert watch.pool == "mamba" and watch.watched == {id(host): ("host", host)} and watch.values is False
    assert sub.side_moves == [("mamba", "host", "cpu", "meta", "ref of host")]  # one move of the role
    assert hook(pool, host, device, 7, layer_id=1) == "copied"  # the next layer's: passed through
    assert len(_Watch.made) == 1 and copy.observed[-1] == set()
    assert failed == []


@pytest.mark.parametrize("impl", IMPLS)
def test_a_role_already_moved_is_known_and_not_kept_again(impl: Any) -> None:
    failed: list[str] = []
    copy, current = _Copy(converts=True), _Current()
    hook = _hook(impl, copy, current, _setup(failed, impl=impl, full=True))
    earlier = ("mamba", "host", "cpu", "cuda:0", "earlier")
    other_pool = ("kv", "device", "cpu", "cuda:0", "kv's")
    sub = current.sub = _sub(side_moves=[other_pool, earlier])
    _Watch.made.clear()
    hook(object(), torch.arange(2), torch.arange(2))
    (watch,) = _Watch.made
    assert watch.given_known == frozenset({"host"}) and watch.values is True  # full: values always
    assert sub.side_moves == [other_pool, earlier]
    assert failed == []


@pytest.mark.parametrize("impl", IMPLS)
def test_values_follow_the_submissions_sample_and_nothing_is_watched_off_kernel(impl: Any) -> None:
    failed: list[str] = []
    copy, current = _Copy(), _Current()
    hook = _hook(impl, copy, current, _setup(failed, impl=impl))
    current.sub = _sub(sampled=True)
    _Watch.made.clear()
    hook(object(), torch.arange(2), torch.arange(2))
    assert [w.values for w in _Watch.made] == [True]
    direct = _hook(impl, copy, current, _setup(failed, impl=impl, kernel=False))
    sub = current.sub = _sub()
    host = torch.arange(2)
    direct(object(), host, torch.arange(2).as_subclass(_OnDevice))
    assert len(_Watch.made) == 1 and copy.observed[-1] == set() and ("mamba", "host") in sub.uses
    on_device = _hook(impl, copy, current, _setup(failed, impl=impl))
    on_device(object(), torch.arange(2).as_subclass(_OnDevice), torch.arange(2).as_subclass(_OnDevice))
    assert len(_Watch.made) == 1  # every tensor on the device: nothing to watch
    assert failed == []


@pytest.mark.parametrize("impl", IMPLS)
def test_a_staged_write_back_notes_its_pool_once(impl: Any) -> None:
    failed: list[str] = []
    copy, current = _Copy(), _Current()
    host_pool = SimpleNamespace(can_use_write_back_jit=True)
    hook = _hook(impl, copy, current, _setup(failed, impl=impl, staged=host_pool))
    sub = current.sub = _sub()
    hook(object(), torch.arange(2), torch.arange(2))
    hook(object(), torch.arange(3), torch.arange(3))  # another pair of tensors, the same pool
    assert sub.host_indices_on_cpu == ["mamba"]
    load = current.sub = _sub(direction="h2d")
    hook(object(), torch.arange(2), torch.arange(2))
    assert load.host_indices_on_cpu == []  # a load is never staged
    for flag in (1, False, None):  # set, and exactly True; read at each call
        host_pool.can_use_write_back_jit = flag
        sub = current.sub = _sub()
        hook(object(), torch.arange(2), torch.arange(2))
        assert sub.host_indices_on_cpu == []
    del host_pool.can_use_write_back_jit
    sub = current.sub = _sub()
    hook(object(), torch.arange(2), torch.arange(2))
    assert sub.host_indices_on_cpu == [] and failed == []


@pytest.mark.parametrize("impl", IMPLS)
def test_a_call_with_its_tensors_by_name_is_described_the_same(impl: Any) -> None:
    failed: list[str] = []
    copy, current = _Copy(), _Current()
    hook = _hook(impl, copy, current, _setup(failed, impl=impl))
    sub = current.sub = _sub()
    pool, host, device = object(), torch.arange(2), torch.arange(2)
    assert hook(pool, host_indices=host, device_indices=device, layer_id=3) == "copied"
    assert copy.calls[-1] == ((pool, host, device), {"layer_id": 3})
    assert sub.copied == {("mamba", id(host), id(device))} and copy.observed[-1] == {"to", "cuda"}


@pytest.mark.parametrize("impl", IMPLS)
def test_a_step_of_the_hook_that_fails_is_counted_and_the_copy_runs(impl: Any) -> None:
    def unreadable(*args: Any) -> Any:
        raise RuntimeError("cannot read")

    failed: list[str] = []
    copy, current = _Copy(converts=True), _Current()
    current.sub = _sub()
    _hook(impl, copy, current, _setup(failed, impl=impl, received=unreadable))(
        object(), torch.arange(2), torch.arange(2)
    )
    current.sub = _sub()
    _hook(impl, copy, current, _setup(failed, impl=impl, received=lambda *a: [1]))(
        object(), torch.arange(2), torch.arange(2)
    )
    assert failed == ["describe the index tensors a copy received"] * 2 and len(copy.calls) == 2

    def no_watch(*args: Any) -> Any:
        raise ValueError("no watch")

    failed.clear()
    sub = current.sub = _sub()
    host = torch.arange(2)
    _hook(impl, copy, current, _setup(failed, impl=impl, watch=no_watch))(object(), host, torch.arange(2))
    assert failed == ["watch the index tensors of a copy"] and copy.observed[-1] == set()
    assert sub.uses[("mamba", "host")] is host  # noted before the watch failed
    failed.clear()
    current.sub = _sub(side_moves=None)  # the known roles cannot be read
    _hook(impl, copy, current, _setup(failed, impl=impl))(object(), torch.arange(2), torch.arange(2))
    assert failed == ["watch the index tensors of a copy"] and len(copy.calls) == 4

    class BadMoves(_Watch):
        def describe(self, src: Any, out: Any, role: str) -> None:
            self.moves.append(("host", "cpu"))

    failed.clear()
    sub = current.sub = _sub()
    assert (
        _hook(impl, copy, current, _setup(failed, impl=impl, watch=BadMoves))(
            object(), torch.arange(2), torch.arange(2)
        )
        == "copied"
    )
    assert failed == ["record the index tensors a copy moved"] and sub.side_moves == []


@pytest.mark.parametrize("impl", IMPLS)
def test_what_the_copy_raises_is_raised_with_the_watch_off(impl: Any) -> None:
    failed: list[str] = []
    copy, current = _Copy(raises=RuntimeError("CUDA error: an illegal memory access")), _Current()
    sub = current.sub = _sub()
    host = torch.arange(2)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _hook(impl, copy, current, _setup(failed, impl=impl))(object(), host, torch.arange(2))
    assert copy.observed[-1] == {"to", "cuda"} and "to" not in vars(host)
    assert sub.side_moves == [] and failed == []

    def interrupted(*args: Any) -> Any:
        raise KeyboardInterrupt

    current.sub = _sub()
    with pytest.raises(KeyboardInterrupt):  # not an Exception: not the hook's to count
        _hook(impl, _Copy(), current, _setup(failed, impl=impl, received=interrupted))(
            object(), torch.arange(2), torch.arange(2)
        )
    assert failed == []


@pytest.mark.parametrize("impl", IMPLS)
def test_a_setup_of_the_wrong_shape_is_refused(impl: Any) -> None:
    failed: list[str] = []
    good = _setup(failed, impl=impl)
    cases = [
        (good[:-1], "setup is None or a tuple of 10"),
        (list(good), "setup is None or a tuple of 10"),
        ((None, *good[1:]), "are callables, got None"),
        ((*good[:5], "received", *good[6:]), "are callables, got 'received'"),
        ((*good[:4], ["to"], *good[5:]), "methods is a tuple of names"),
    ]
    for setup, text in cases:
        with pytest.raises(TypeError, match=text):
            impl.copy_hook(_Copy(), _Current(), "mamba", _Copy(), setup)
