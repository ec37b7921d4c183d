"""The adapter's watch on the index tensors one pool copy received (no SGLang needed).

It must see a ``.to()``/``.cuda()`` of exactly those tensors, on the copying thread,
during the copy, and leave each tensor as it was afterwards.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hicache_obs.integrations.sglang._adapter import _ConversionWatch


def _watch(t: torch.Tensor, role: str = "host", failed: list[str] | None = None) -> _ConversionWatch:
    def count(what: str) -> None:
        if failed is None:
            raise AssertionError(f"the watch failed to {what}")
        failed.append(what)

    return _ConversionWatch("mamba", {id(t): (role, t)}, count)


def _count_descriptions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The roles the watch describes from now on, in order (``tensor_ref`` counted)."""
    from hicache_obs.integrations.sglang import _adapter as adapter

    described: list[str] = []
    real = adapter.tensor_ref

    def counting(t: torch.Tensor, pool: str, role: str, dev: str | None = None) -> object:
        described.append(role)
        return real(t, pool, role, dev)

    monkeypatch.setattr(adapter, "tensor_ref", counting)
    return described


def test_a_move_of_a_received_tensor_is_seen_with_its_new_tensor() -> None:
    t = torch.arange(8, dtype=torch.int64)
    with _watch(t) as w:
        out = t.to("meta")
        same = t.to(torch.int64)  # no move: the same tensor back
    assert out.device.type == "meta" and same is t
    assert len(w.moves) == 1
    role, src, dst, ref = w.moves[0]
    assert (role, src, dst) == ("host", "cpu", "meta")
    assert (ref.pool, ref.role, ref.device, ref.numel) == ("mamba", "host", "meta", 8)


def test_a_role_whose_move_the_op_already_reported_is_not_described_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load copies per layer and each layer's copy converts the same indices again: the
    op's first move of a role is reported, the later ones are neither described nor kept
    (the conversion itself still happens)."""
    described = _count_descriptions(monkeypatch)
    h, d = torch.arange(4), torch.arange(4)

    def fail(what: str) -> None:
        raise AssertionError(what)

    watch = _ConversionWatch("mamba", {id(h): ("host", h), id(d): ("device", d)}, fail, frozenset({"host"}))
    with watch:
        assert h.to("meta").device.type == "meta"  # converted, as the copy asked
        assert d.to("meta").device.type == "meta"
    assert [m[0] for m in watch.moves] == ["device"] and described == ["device"]


def test_the_tensor_is_left_as_it_was() -> None:
    t = torch.arange(4)
    with _watch(t):
        assert "to" in t.__dict__ and "cuda" in t.__dict__
    assert "to" not in t.__dict__ and "cuda" not in t.__dict__
    assert t.to("meta").device.type == "meta"  # the class's method again


def test_the_watch_is_taken_off_when_the_copy_raises() -> None:
    t = torch.arange(4)
    try:
        with _watch(t):
            raise RuntimeError("the copy failed")
    except RuntimeError:
        pass
    assert "to" not in t.__dict__ and "cuda" not in t.__dict__


def test_other_tensors_and_other_threads_are_not_seen() -> None:
    t, other = torch.arange(4), torch.arange(4)
    with _watch(t) as w:
        other.to("meta")
        th = threading.Thread(target=lambda: t.to("meta"))
        th.start()
        th.join()
    assert w.moves == []


def test_a_method_already_on_the_tensor_is_not_replaced() -> None:
    t = torch.arange(4)
    mine = lambda *a, **k: "theirs"  # noqa: E731
    t.to = mine  # type: ignore[method-assign]
    with _watch(t) as w:
        assert t.to("meta") == "theirs"
    assert t.__dict__["to"] is mine and w.moves == []


def test_a_description_that_fails_is_counted_and_the_move_still_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy's own ``.to()`` returns its tensor even where describing it raises."""
    from hicache_obs.integrations.sglang import _adapter as adapter

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no description")

    monkeypatch.setattr(adapter, "tensor_ref", broken)
    t = torch.arange(6, dtype=torch.int64)
    failed: list[str] = []
    with _watch(t, failed=failed) as w:
        out = t.to("meta")
    assert out.device.type == "meta" and out.shape == (6,)
    assert w.moves == [] and failed == ["describe an index tensor a copy moved"]


def test_a_second_move_of_a_role_in_one_watch_is_not_described(monkeypatch: pytest.MonkeyPatch) -> None:
    """A subclass's torch-function dispatch calls the watched method again for one ``.to()``:
    the role's first move is kept and described, a second one in the same copy is neither."""
    described = _count_descriptions(monkeypatch)
    t = torch.arange(4)
    with _watch(t) as w:
        first = t.to("meta")
        again = t.to("meta")
    assert first.device.type == again.device.type == "meta"  # both converted, as asked
    assert [m[0] for m in w.moves] == ["host"] and described == ["host"]
