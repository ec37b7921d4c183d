"""The torch Mamba2 scan standing in for SGLang's Triton kernels on a CPU (NemotronH).

Each result is compared with a plain reference written here: the Mamba2 recurrence one
token, one head at a time (``h = exp(dt A) h + dt B x^T``, ``y = C h + D x``, gated by
``silu(z)``). The SGLang tests check the signatures against SGLang's Triton functions and
what :func:`patch_module` binds in a fresh copy of ``mamba.py``.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from sglang_env import SERVER_RELEASE

from hicache_obs.lab.sglang.cpu_mamba2 import PAD_SLOT_ID, mamba_chunk_scan_combined, selective_state_update

NHEADS, HEADDIM, NGROUPS, DSTATE = 4, 3, 2, 5
LINES = 6


def naive(x, dt, A, B, C, D=None, z=None, h0=None):  # type: ignore[no-untyped-def]
    """One sequence; ``dt`` already final. Outputs ``(T, nheads, headdim)`` and every state
    (``T + 1``: before the first token, after each)."""
    T = x.shape[0]
    ratio = NHEADS // B.shape[1]
    h = torch.zeros(NHEADS, HEADDIM, DSTATE) if h0 is None else h0.clone().float()
    ys, states = torch.zeros(T, NHEADS, HEADDIM), [h.clone()]
    for t in range(T):
        for head in range(NHEADS):
            g = head // ratio
            a = math.exp(float(dt[t, head]) * float(A[head]))
            for p in range(HEADDIM):
                for n in range(DSTATE):
                    h[head, p, n] = a * h[head, p, n] + float(dt[t, head]) * float(B[t, g, n]) * float(x[t, head, p])
                y = float((h[head, p] * C[t, g]).sum())
                if D is not None:
                    y += float(D[head] if D.dim() == 1 else D[head, p]) * float(x[t, head, p])
                if z is not None:
                    y *= float(F.silu(z[t, head, p]))
                ys[t, head, p] = y
        states.append(h.clone())
    return ys, states


def final_dt(dt, bias=None, softplus=False, limit=(0.0, float("inf"))):  # type: ignore[no-untyped-def]
    dt = dt.float() + (0 if bias is None else bias.float())
    if softplus:
        dt = torch.where(dt <= 20, torch.log1p(torch.exp(dt)), dt)
    return dt.clamp(*limit)


def inputs(total: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(1, total, NHEADS, HEADDIM, generator=g),
        "dt": torch.randn(1, total, NHEADS, generator=g),
        "A": -torch.rand(NHEADS, generator=g) * 2,
        "B": torch.randn(1, total, NGROUPS, DSTATE, generator=g),
        "C": torch.randn(1, total, NGROUPS, DSTATE, generator=g),
        "dt_bias": torch.randn(NHEADS, generator=g),
        "z": torch.randn(1, total, NHEADS, HEADDIM, generator=g),
    }


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("with_z", [False, True])
@pytest.mark.parametrize("d_per_dim", [False, True])
def test_varlen_prefill_matches_the_recurrence(with_z: bool, d_per_dim: bool) -> None:
    """Sequences of several lengths (some crossing chunk boundaries, one empty), some starting
    from an initial state: outputs, final states, chunk-boundary states and tracked states."""
    lens, chunk = [5, 1, 0, 9, 3], 4
    total = sum(lens)
    t = inputs(total)
    g = torch.Generator().manual_seed(7)
    D = torch.randn(NHEADS, HEADDIM, generator=g) if d_per_dim else torch.randn(NHEADS, generator=g)
    init = torch.randn(len(lens), NHEADS, HEADDIM, DSTATE, generator=g)
    init[1] = 0  # a sequence without one reads zeros, as SGLang's torch.where makes it
    bounds = cu(lens)
    out = torch.full((1, total, NHEADS, HEADDIM), float("nan"))
    z = t["z"] if with_z else None
    chunk_states, varlen, track = mamba_chunk_scan_combined(
        t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, D=D, z=z, dt_bias=t["dt_bias"],
        initial_states=init, cu_seqlens=bounds, dt_softplus=True, out=out,
        return_varlen_states=True, return_track_states=True,
        track_seq_idx=torch.tensor([0, 3, 3]), track_end_locs=torch.tensor([3, 6, 15]),
        state_dtype=torch.float32,
    )  # fmt: skip
    dt = final_dt(t["dt"], t["dt_bias"], True)[0]
    every = {}
    for i, (s, e) in enumerate(zip(bounds.tolist(), bounds[1:].tolist())):
        y, states = naive(t["x"][0, s:e], dt[s:e], t["A"], t["B"][0, s:e], t["C"][0, s:e], D,
                          None if z is None else z[0, s:e], init[i])  # fmt: skip
        torch.testing.assert_close(out[0, s:e], y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(varlen[i], states[-1], rtol=1e-5, atol=1e-5)
        for k, st in enumerate(states):
            every[(i, s + k)] = st
    assert varlen.shape == (len(lens), NHEADS, HEADDIM, DSTATE)
    # tracked: sequence 0 after its 3 first tokens; sequence 3 after 0 and after all 9 tokens
    assert track.shape == (1, 3, NHEADS, HEADDIM, DSTATE)
    for row, key in enumerate([(0, 3), (3, 6), (3, 15)]):
        torch.testing.assert_close(track[0, row], every[key], rtol=1e-5, atol=1e-5)
    # chunk c: the state after global token c * chunk - 1, of the sequence holding it
    nchunks = math.ceil(total / chunk)
    assert chunk_states.shape == (1, nchunks, NHEADS, HEADDIM, DSTATE)
    torch.testing.assert_close(chunk_states[0, 0], init[0])
    owner = [i for i, n in enumerate(lens) for _ in range(n)]
    for c in range(1, nchunks):
        torch.testing.assert_close(chunk_states[0, c], every[(owner[c * chunk - 1], c * chunk)], rtol=1e-5, atol=1e-5)


def test_return_flags_follow_the_triton_function() -> None:
    t = inputs(6)
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"], 4)
    out = torch.empty(1, 6, NHEADS, HEADDIM)
    assert mamba_chunk_scan_combined(*args, out=out) is None
    final = mamba_chunk_scan_combined(*args, out=out, return_final_states=True)
    assert final.shape == (1, NHEADS, HEADDIM, DSTATE)
    varlen = mamba_chunk_scan_combined(*args, out=out, cu_seqlens=cu([2, 4]), return_varlen_states=True)
    assert varlen.shape == (2, NHEADS, HEADDIM, DSTATE)
    both = mamba_chunk_scan_combined(
        *args, out=out, cu_seqlens=cu([6]), return_varlen_states=True, return_final_states=True
    )
    torch.testing.assert_close(both[0], both[1])  # one sequence: its final state is the last
    states = mamba_chunk_scan_combined(*args, out=out, return_intermediate_states=True)
    assert states.shape == (1, 2, NHEADS, HEADDIM, DSTATE)
    _, _, track = mamba_chunk_scan_combined(
        *args, out=out, cu_seqlens=cu([6]), return_varlen_states=True, return_track_states=True
    )
    assert track is None  # nothing asked to be tracked
    with pytest.raises(ValueError, match="cu_seqlens"):
        mamba_chunk_scan_combined(*args, out=out, return_varlen_states=True)
    # dt_limit clamps, without softplus a negative dt becomes 0 (the default limit)
    y_limited = torch.empty_like(out)
    mamba_chunk_scan_combined(*args, out=y_limited, dt_limit=(0.1, 0.2))
    ref, _ = naive(t["x"][0], final_dt(t["dt"], limit=(0.1, 0.2))[0], t["A"], t["B"][0], t["C"][0])
    torch.testing.assert_close(y_limited[0], ref, rtol=1e-5, atol=1e-5)


def decode_args(batch: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """Decode inputs spelled as SGLang's MambaMixer2 passes them (expanded per head dim)."""
    g = torch.Generator().manual_seed(seed)
    A = -torch.rand(NHEADS, generator=g)
    dt = torch.randn(batch, NHEADS, generator=g)
    bias = torch.randn(NHEADS, generator=g)
    D = torch.randn(NHEADS, generator=g)
    return {
        "x": torch.randn(batch, NHEADS, HEADDIM, generator=g),
        "dt": dt[:, :, None].expand(-1, -1, HEADDIM),
        "A": A[:, None, None].expand(-1, HEADDIM, DSTATE),
        "B": torch.randn(batch, NGROUPS, DSTATE, generator=g),
        "C": torch.randn(batch, NGROUPS, DSTATE, generator=g),
        "D": D[:, None].expand(-1, HEADDIM),
        "dt_bias": bias[:, None].expand(-1, HEADDIM),
        "a": A, "dt1": dt, "bias1": bias, "d1": D,
    }  # fmt: skip


def test_decode_continues_named_lines_and_skips_pad_slots() -> None:
    a = decode_args(3)
    state = torch.randn(LINES, NHEADS, HEADDIM, DSTATE, generator=torch.Generator().manual_seed(5))
    before = state.clone()
    out = torch.full((3, NHEADS, HEADDIM), float("nan"))
    selective_state_update(
        state, a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], z=None, dt_bias=a["dt_bias"],
        dt_softplus=True, state_batch_indices=torch.tensor([4, PAD_SLOT_ID, 1], dtype=torch.int32), out=out,
    )  # fmt: skip
    dt = final_dt(a["dt1"], a["bias1"], True)
    for row, line in ((0, 4), (2, 1)):
        y, states = naive(a["x"][row : row + 1], dt[row : row + 1], a["a"], a["B"][row : row + 1],
                          a["C"][row : row + 1], a["d1"], None, before[line])  # fmt: skip
        torch.testing.assert_close(out[row], y[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[line], states[-1], rtol=1e-5, atol=1e-5)
    # the pad row reads a zero state (its output is one step from zero) and writes nothing
    y, _ = naive(a["x"][1:2], dt[1:2], a["a"], a["B"][1:2], a["C"][1:2], a["d1"])
    torch.testing.assert_close(out[1], y[0], rtol=1e-5, atol=1e-5)
    untouched = [i for i in range(LINES) if i not in (4, 1)]
    torch.testing.assert_close(state[untouched], before[untouched], rtol=0, atol=0)


def test_decode_several_tokens_z_and_intermediate_states() -> None:
    """``(batch, T, ...)`` inputs: T steps per row; with ``disable_state_update`` the cache
    stays and each step's state goes to the intermediate buffer."""
    batch, T = 2, 3
    g = torch.Generator().manual_seed(9)
    x = torch.randn(batch, T, NHEADS, HEADDIM, generator=g)
    dt1 = torch.randn(batch, T, NHEADS, generator=g)
    A1 = -torch.rand(NHEADS, generator=g)
    B = torch.randn(batch, T, NGROUPS, DSTATE, generator=g)
    C = torch.randn(batch, T, NGROUPS, DSTATE, generator=g)
    z = torch.randn(batch, T, NHEADS, HEADDIM, generator=g)
    state = torch.randn(LINES, NHEADS, HEADDIM, DSTATE, generator=g)
    before = state.clone()
    buf = torch.zeros(batch, T, NHEADS, HEADDIM, DSTATE)
    out = torch.empty_like(x)
    selective_state_update(
        state, x, dt1[..., None].expand(-1, -1, -1, HEADDIM), A1[:, None, None].expand(-1, HEADDIM, DSTATE), B, C,
        z=z, state_batch_indices=torch.tensor([3, 0]), out=out, disable_state_update=True,
        intermediate_states_buffer=buf, cache_steps=T, intermediate_state_indices=torch.tensor([1, 0]),
    )  # fmt: skip
    torch.testing.assert_close(state, before, rtol=0, atol=0)
    dt = final_dt(dt1, limit=(-math.inf, math.inf))  # decode does not clamp to dt_limit
    for row, (line, slot) in enumerate(((3, 1), (0, 0))):
        y, states = naive(x[row], dt[row], A1, B[row], C[row], None, z[row], before[line])
        torch.testing.assert_close(out[row], y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(buf[slot], torch.stack(states[1:]), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="retrieve_parent_token"):
        selective_state_update(state, x, dt1, A1, B, C, out=out, retrieve_parent_token=torch.zeros(batch, T))


def test_split_prefill_and_decode_continue_the_whole() -> None:
    """What a cache hit relies on: prefill of a prefix, then the rest from its saved state
    (chunked prefill, a host hit), then one decode step, equal one prefill of everything."""
    total = 12
    t = inputs(total + 1, seed=4)
    D = torch.randn(NHEADS)
    whole = torch.empty(1, total + 1, NHEADS, HEADDIM)
    kw = {"D": D, "dt_bias": t["dt_bias"], "dt_softplus": True, "return_varlen_states": True}
    full = mamba_chunk_scan_combined(
        t["x"], t["dt"], t["A"], t["B"], t["C"], 8, cu_seqlens=cu([total + 1]), out=whole, **kw
    )
    part = torch.empty(1, 7, NHEADS, HEADDIM)
    first = mamba_chunk_scan_combined(
        *(t[k][:, :7] for k in ("x", "dt")), t["A"], *(t[k][:, :7] for k in ("B", "C")), 8,
        cu_seqlens=cu([7]), out=part, **kw,
    )  # fmt: skip
    rest = torch.empty(1, total - 7, NHEADS, HEADDIM)
    second = mamba_chunk_scan_combined(
        *(t[k][:, 7:total] for k in ("x", "dt")), t["A"], *(t[k][:, 7:total] for k in ("B", "C")), 8,
        cu_seqlens=cu([total - 7]), out=rest, initial_states=first, **kw,
    )  # fmt: skip
    torch.testing.assert_close(torch.cat([part, rest], 1), whole[:, :total], rtol=1e-5, atol=1e-5)
    state = torch.zeros(LINES, NHEADS, HEADDIM, DSTATE)
    state[2] = second[0]
    out = torch.empty(1, NHEADS, HEADDIM)
    selective_state_update(
        state, t["x"][:, total], t["dt"][:, total, :, None].expand(-1, -1, HEADDIM),
        t["A"][:, None, None].expand(-1, HEADDIM, DSTATE), t["B"][:, total], t["C"][:, total],
        D[:, None].expand(-1, HEADDIM), dt_bias=t["dt_bias"][:, None].expand(-1, HEADDIM), dt_softplus=True,
        state_batch_indices=torch.tensor([2]), out=out,
    )  # fmt: skip
    torch.testing.assert_close(out[0], whole[0, total], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[2], full[0], rtol=1e-5, atol=1e-5)


# -- on SGLang's modules ---------------------------------------------------------------------

SSD_MODULE = "sglang.kernels.ops.mamba.triton_ops.ssd_combined"
SSU_MODULE = "sglang.kernels.ops.mamba.triton_ops.ssu_dispatch"


def spelled(fn: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


@pytest.mark.needs_sglang
@SERVER_RELEASE
def test_signatures_are_sglangs() -> None:
    ssd, ssu = importlib.import_module(SSD_MODULE), importlib.import_module(SSU_MODULE)
    assert spelled(mamba_chunk_scan_combined) == spelled(ssd.mamba_chunk_scan_combined)
    ours = spelled(selective_state_update)
    assert ours[-1][0] == "kwargs"  # the Triton kernel's rounding options, which SGLang's dispatch drops
    assert ours[:-1] == spelled(ssu.selective_state_update)
    assert importlib.import_module("sglang.kernels.ops.mamba.triton_ops").PAD_SLOT_ID == PAD_SLOT_ID


# run in a process of its own: the stand-ins this needs (cpu_server.install) are process-wide
_BINDS = """
import importlib.util, types
from hicache_obs.lab.sglang import cpu_conv, cpu_mamba2
from hicache_obs.lab.sglang.cpu_server import install

install()  # SGLang's layer modules import what a CPU-only install lacks
name = cpu_mamba2.TARGET_MODULES[0]
spec = importlib.util.spec_from_file_location(name, importlib.util.find_spec(name).origin)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
before = dict(vars(module))
assert "causal_conv1d_fn_triton" not in before  # bound under is_cuda() only
names = cpu_mamba2.patch_module(module)
assert set(names) == {
    "mamba_chunk_scan_combined", "selective_state_update", "causal_conv1d_fn", "causal_conv1d_update",
    "causal_conv1d_fn_triton", "causal_conv1d_update_triton",
}, names
assert module.mamba_chunk_scan_combined is cpu_mamba2.mamba_chunk_scan_combined
assert module.causal_conv1d_fn_triton is cpu_conv.causal_conv1d_fn
assert module.causal_conv1d_update_triton is cpu_conv.causal_conv1d_update
changed = {n for n in vars(module) if n not in before or vars(module)[n] is not before[n]}
assert changed == set(names), changed
assert cpu_mamba2.patch_module(module) == []  # idempotent
print("bound", sorted(names))
"""


@pytest.mark.needs_sglang
@SERVER_RELEASE
def test_patch_module_binds_the_names_mamba2_calls() -> None:
    """A fresh copy of SGLang's ``mamba.py`` (off CUDA its short-convolution names are unbound)
    gets the torch scan and convolution, and nothing else changes."""
    run = subprocess.run([sys.executable, "-c", _BINDS], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.startswith("bound ['causal_conv1d_fn', "), run.stdout
