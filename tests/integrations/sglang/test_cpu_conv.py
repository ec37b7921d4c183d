"""The torch short convolution standing in for SGLang's Triton kernels on a CPU (LFM2).

Each result is compared with a plain reference: ``F.conv1d`` over one sequence, padded on
the left with its initial state (or zeros). The SGLang tests check the signatures and what
:func:`patch_module` rebinds in fresh copies of SGLang's modules.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from sglang_env import SERVER_RELEASE, fresh_module

from hicache_obs.lab.sglang import cpu_conv
from hicache_obs.lab.sglang.cpu_conv import PAD_SLOT_ID, causal_conv1d_fn, causal_conv1d_update

DIM = 6
LINES, STATE_LEN = 7, 4  # cache lines; state columns (>= width - 1: the last stay untouched for width < 5)
WRAPPER_MODULE = "sglang.srt.layers.attention.mamba.causal_conv1d"


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, prior: torch.Tensor | None, silu: bool):
    """One sequence ``x`` ``(dim, n)``: outputs ``(dim, n)`` and the last ``W - 1`` window columns."""
    k = w.shape[1] - 1
    window = F.pad(x.float(), (k, 0)) if prior is None else torch.cat([prior.float(), x.float()], 1)
    y = F.conv1d(window[None], w.float()[:, None, :], None if b is None else b.float(), groups=x.shape[0])[0]
    return (F.silu(y) if silu else y), window[:, window.shape[1] - k :]


def params(width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(DIM, width, generator=g), torch.randn(DIM, generator=g)


def states(seed: int = 1) -> torch.Tensor:
    return torch.randn(LINES, DIM, STATE_LEN, generator=torch.Generator().manual_seed(seed))


def batch(lens: list[int], seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(DIM, sum(lens), generator=torch.Generator().manual_seed(seed))
    return x, torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_prefill_matches_reference_per_sequence(width: int, activation: str | None) -> None:
    lens, lines, warm = [5, 1, 2, 9], [4, 0, 6, 2], [True, False, True, False]  # lens 1, 2 < width - 1 for width 4
    w, b = params(width)
    x, qsl = batch(lens)
    cs = states()
    before = cs.clone()
    out = causal_conv1d_fn(
        x, w, b, conv_states=cs, query_start_loc=qsl, seq_lens_cpu=lens,
        cache_indices=torch.tensor(lines, dtype=torch.int64), has_initial_state=torch.tensor(warm),
        activation=activation,
    )  # fmt: skip
    assert out.shape == x.shape and out.dtype == x.dtype
    k = width - 1
    for i, (line, hot) in enumerate(zip(lines, warm)):
        seq = slice(int(qsl[i]), int(qsl[i + 1]))
        y, state = reference(x[:, seq], w, b, before[line, :, :k] if hot else None, activation == "silu")
        torch.testing.assert_close(out[:, seq], y)
        torch.testing.assert_close(cs[line, :, :k], state)
        assert torch.equal(cs[line, :, k:], before[line, :, k:])  # past width - 1: untouched
    untouched = [n for n in range(LINES) if n not in lines]
    assert torch.equal(cs[untouched], before[untouched])


def test_prefill_defaults_line_i_and_zero_state() -> None:
    """No ``cache_indices``: sequence ``i`` uses line ``i``; no ``has_initial_state``: zeros."""
    w, _ = params(4)
    x, qsl = batch([3, 4])
    cs = states()
    out = causal_conv1d_fn(x, w, None, cs, qsl, [3, 4])  # activation defaults to "silu"
    for i in range(2):
        y, state = reference(x[:, int(qsl[i]) : int(qsl[i + 1])], w, None, None, True)
        torch.testing.assert_close(out[:, int(qsl[i]) : int(qsl[i + 1])], y)
        torch.testing.assert_close(cs[i, :, :3], state)


def test_prefill_skips_pad_slots_and_empty_sequences() -> None:
    w, b = params(4)
    lens, lines = [3, 4, 0, 2], [PAD_SLOT_ID, 1, 5, 3]
    x, qsl = batch(lens)
    cs = states()
    before = cs.clone()
    out = causal_conv1d_fn(
        x, w, b, cs, qsl, lens, cache_indices=torch.tensor(lines, dtype=torch.int32),
        has_initial_state=torch.tensor([True, True, True, True]), activation=None,
    )  # fmt: skip
    assert torch.equal(out[:, 0:3], torch.zeros(DIM, 3))  # pad: no output, no line touched
    assert torch.equal(cs[5], before[5])  # empty sequence: its line keeps its state
    for i, line in ((1, 1), (3, 3)):
        seq = slice(int(qsl[i]), int(qsl[i + 1]))
        y, state = reference(x[:, seq], w, b, before[line, :, :3], False)
        torch.testing.assert_close(out[:, seq], y)
        torch.testing.assert_close(cs[line, :, :3], state)
    assert torch.equal(cs[[0, 2, 4, 6]], before[[0, 2, 4, 6]])


@pytest.mark.parametrize("activation", [None, "silu"])
def test_decode_steps_continue_the_prefill(activation: str | None) -> None:
    """Prefill a prefix, then decode token by token: the same outputs and states as one
    prefill over the whole sequences."""
    w, b = params(4)
    prefix, steps, lines = [4, 1], 5, torch.tensor([3, 6], dtype=torch.int64)
    full_x, full_qsl = batch([p + steps for p in prefix], seed=5)
    expect_states = states()
    whole = causal_conv1d_fn(full_x, w, b, expect_states, full_qsl, [], cache_indices=lines, activation=activation)

    starts = full_qsl[:-1].tolist()
    px = torch.cat([full_x[:, s : s + p] for s, p in zip(starts, prefix)], 1)
    pqsl = torch.tensor([0, *torch.tensor(prefix).cumsum(0).tolist()], dtype=torch.int32)
    cs = states()
    head = causal_conv1d_fn(px, w, b, cs, pqsl, prefix, cache_indices=lines, activation=activation)
    for i, (s, p) in enumerate(zip(starts, prefix)):
        torch.testing.assert_close(head[:, int(pqsl[i]) : int(pqsl[i]) + p], whole[:, s : s + p])
    for t in range(steps):
        token = torch.stack([full_x[:, s + p + t] for s, p in zip(starts, prefix)])  # (batch, dim)
        y = causal_conv1d_update(token, cs, w, b, activation=activation, conv_state_indices=lines)
        assert y.shape == token.shape
        torch.testing.assert_close(y, torch.stack([whole[:, s + p + t] for s, p in zip(starts, prefix)]))
    torch.testing.assert_close(cs, expect_states)


def test_decode_several_tokens_at_once_and_pad_rows() -> None:
    w, b = params(3)
    x = torch.randn(3, DIM, 4, generator=torch.Generator().manual_seed(7))  # (batch, dim, seqlen)
    idx = torch.tensor([2, PAD_SLOT_ID, 0], dtype=torch.int32)
    cs, stepped = states(), states()
    before = cs.clone()
    out = causal_conv1d_update(x, cs, w, b, activation="silu", conv_state_indices=idx)
    assert torch.equal(out[1], torch.zeros(DIM, 4))
    for t in range(4):
        y = causal_conv1d_update(x[:, :, t], stepped, w, b, activation="silu", conv_state_indices=idx)
        torch.testing.assert_close(out[[0, 2], :, t], y[[0, 2]])
    torch.testing.assert_close(cs, stepped)
    for row, line in ((0, 2), (2, 0)):
        y, state = reference(x[row], w, b, before[line, :, :2], True)
        torch.testing.assert_close(out[row], y)
        torch.testing.assert_close(cs[line, :, :2], state)
    assert torch.equal(cs[[1, 3, 4, 5, 6]], before[[1, 3, 4, 5, 6]])
    assert torch.equal(cs[:, :, 2:], before[:, :, 2:])


def test_decode_without_indices_uses_row_lines() -> None:
    w, _ = params(4)
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(8))
    cs = states()
    before = cs.clone()
    out = causal_conv1d_update(x, cs, w)
    for row in range(2):
        y, state = reference(x[row][:, None], w, None, before[row, :, :3], False)
        torch.testing.assert_close(out[row], y[:, 0])
        torch.testing.assert_close(cs[row, :, :3], state)
    assert torch.equal(cs[2:], before[2:])


def test_decode_records_the_window_after_each_token() -> None:
    """Target verify (``intermediate_conv_window``): step ``t``'s window is the state that
    decoding tokens ``0..t`` one at a time leaves."""
    w, b = params(4)
    x = torch.randn(2, DIM, 3, generator=torch.Generator().manual_seed(9))
    idx = torch.tensor([5, 1])
    tape = torch.zeros(4, 3, DIM, 3)
    cs, stepped = states(), states()
    causal_conv1d_update(
        x, cs, w, b, conv_state_indices=idx, intermediate_conv_window=tape,
        intermediate_state_indices=torch.tensor([0, 2], dtype=torch.int32),
    )  # fmt: skip
    for t in range(3):
        causal_conv1d_update(x[:, :, t], stepped, w, b, conv_state_indices=idx)
        torch.testing.assert_close(tape[0, t], stepped[5, :, :3])
        torch.testing.assert_close(tape[2, t], stepped[1, :, :3])
    assert torch.equal(tape[[1, 3]], torch.zeros(2, 3, DIM, 3))


def test_low_precision_inputs_keep_their_dtypes() -> None:
    w, b = params(4)
    x, qsl = batch([6])
    cs = states()
    before = cs.clone()
    out = causal_conv1d_fn(
        x.bfloat16(), w.bfloat16(), b.bfloat16(), cs, qsl, [6], has_initial_state=torch.tensor([True]), activation=None
    )
    assert out.dtype == torch.bfloat16 and cs.dtype == torch.float32
    y, state = reference(x.bfloat16(), w.bfloat16(), b.bfloat16(), before[0, :, :3], False)
    torch.testing.assert_close(out, y.bfloat16())
    torch.testing.assert_close(cs[0, :, :3], state)


def test_activation_spellings_and_unsupported_arguments() -> None:
    w, b = params(4)
    x, qsl = batch([5])
    silu = causal_conv1d_fn(x, w, b, states(), qsl, [5], activation="silu")
    assert torch.equal(causal_conv1d_fn(x, w, b, states(), qsl, [5], activation=True), silu)
    assert torch.equal(causal_conv1d_fn(x, w, b, states(), qsl, [5], activation="swish"), silu)
    with pytest.raises(NotImplementedError, match="activation"):
        causal_conv1d_fn(x, w, b, states(), qsl, [5], activation="relu")
    with pytest.raises(NotImplementedError, match="block_table"):
        causal_conv1d_fn(x, w, b, states(), qsl, [5], block_table=torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="num_accept_tokens"):
        causal_conv1d_update(x[:, :1].T, states(), w, num_accept_tokens=torch.ones(1, dtype=torch.int32))


# -- on SGLang's modules ---------------------------------------------------------------------


@pytest.fixture
def modules(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, types.ModuleType]:
    """Fresh copies of the Triton module and of the wrapper module importing from it."""
    triton_module = fresh_module(cpu_conv.TRITON_MODULE)
    monkeypatch.setitem(sys.modules, cpu_conv.TRITON_MODULE, triton_module)
    return triton_module, fresh_module(WRAPPER_MODULE)


@pytest.mark.needs_sglang
@SERVER_RELEASE
def test_signatures_are_sglangs(modules: tuple[types.ModuleType, types.ModuleType]) -> None:
    triton_module, _ = modules
    assert triton_module.PAD_SLOT_ID == PAD_SLOT_ID
    for name in ("causal_conv1d_fn", "causal_conv1d_update"):
        ours, theirs = inspect.signature(getattr(cpu_conv, name)), inspect.signature(getattr(triton_module, name))
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
            (p.name, p.kind, p.default) for p in theirs.parameters.values()
        ]


@pytest.mark.needs_sglang
@SERVER_RELEASE
def test_patch_module_rebinds_exactly_the_triton_functions(modules: tuple[types.ModuleType, types.ModuleType]) -> None:
    triton_module, wrapper_module = modules
    assert set(cpu_conv.TARGET_MODULES) == {cpu_conv.TRITON_MODULE, WRAPPER_MODULE}
    for module, names in (
        (triton_module, ["causal_conv1d_fn", "causal_conv1d_update"]),
        (wrapper_module, ["_causal_conv1d_fn_triton", "_causal_conv1d_update_triton"]),
    ):
        before = dict(vars(module))
        assert sorted(cpu_conv.patch_module(module)) == names
        after = vars(module)
        assert set(after) == set(before)
        assert {n for n in before if after[n] is not before[n]} == set(names)
        assert [getattr(module, n).__module__ for n in names] == [cpu_conv.__name__] * 2
        assert cpu_conv.patch_module(module) == []  # idempotent
    # the wrappers stay SGLang's, calling the torch functions off CUDA
    assert wrapper_module.causal_conv1d_fn.__module__ == WRAPPER_MODULE


@pytest.mark.needs_sglang
@SERVER_RELEASE
def test_sglang_wrappers_run_on_torch_as_lfm2_calls_them(modules: tuple[types.ModuleType, types.ModuleType]) -> None:
    """After the wrapper module is patched, LFM2's prefill and decode calls (its argument
    spelling: int64 slot indices, a bool prefix mask, ``activation=None``) match the reference."""
    _, wrapper_module = modules
    cpu_conv.patch_module(wrapper_module)
    w, b = params(3)
    lens, lines = [4, 2], torch.tensor([1, 4], dtype=torch.int64)
    x, qsl = batch(lens)
    cs = states()
    before = cs.clone()
    bx = x.T.contiguous()  # (tokens, dim), as LFM2 holds it
    out = wrapper_module.causal_conv1d_fn(
        bx.transpose(0, 1).contiguous(), w, b, query_start_loc=qsl, cache_indices=lines,
        has_initial_state=torch.tensor([True, False]), conv_states=cs, activation=None,
    ).transpose(0, 1)  # fmt: skip
    for i, (line, prior) in enumerate(((1, before[1, :, :2]), (4, None))):
        seq = slice(int(qsl[i]), int(qsl[i + 1]))
        y, state = reference(x[:, seq], w, b, prior, False)
        torch.testing.assert_close(out[seq].T, y)
        torch.testing.assert_close(cs[line, :, :2], state)
    token = torch.randn(2, DIM, generator=torch.Generator().manual_seed(11))
    mid = cs.clone()
    y = wrapper_module.causal_conv1d_update(token, cs, w, b, activation=None, conv_state_indices=lines)
    for row, line in enumerate((1, 4)):
        ref, state = reference(token[row][:, None], w, b, mid[line, :, :2], False)
        torch.testing.assert_close(y[row], ref[:, 0])
        torch.testing.assert_close(cs[line, :, :2], state)
