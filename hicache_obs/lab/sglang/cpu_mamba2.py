"""Torch implementations of SGLang's Mamba2 (SSD) kernels, for a CPU (test support).

SGLang's ``MambaMixer2`` (``sglang.srt.layers.attention.mamba.mamba``, the mixer of
NemotronH, Falcon-H1, Granite-4 hybrid, Mamba2) calls Triton kernels that have no CPU
path: ``mamba_chunk_scan_combined`` (prefill, the chunked SSD scan) and
``selective_state_update`` (decode), and, under ``is_cuda()`` only, binds the short
convolution ``causal_conv1d_fn{,_triton}`` / ``causal_conv1d_update{,_triton}`` (so off
CUDA those names are missing). These have the kernels' signatures and effects; the
recurrence is the plain one, token after token, in float32:

* ``dt = dt + dt_bias``; ``softplus(dt)`` (identity above 20) when ``dt_softplus``;
  prefill also clamps to ``dt_limit`` as the chunked kernel does.
* ``h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t x_t^T`` per head (head ``h`` reads group
  ``h // (nheads / ngroups)`` of ``B`` and ``C``), ``y_t = C_t . h_t + D * x_t``, then
  ``y_t * silu(z_t)`` when ``z`` is given.

``mamba_chunk_scan_combined`` takes SGLang's varlen form (``batch == 1``, sequences
concatenated, bounded by ``cu_seqlens``; sequence ``i`` starts from
``initial_states[i]``, else zeros) and returns what the Triton path returns for the
flags given: the chunk-boundary states (``(1, nchunks, nheads, headdim, dstate)``; entry
``c`` is the state after global token ``c * chunk_size - 1`` of the sequence holding it,
entry 0 the first sequence's initial state), the final state of each sequence
(``return_varlen_states``), the states at ``track_end_locs`` (``return_track_states``).
``seq_idx`` / ``chunk_indices`` / ``chunk_offsets`` only steer the Triton chunking and
are not needed. ``selective_state_update`` continues the cache lines named by
``state_batch_indices`` (a line equal to ``pad_slot_id`` reads zeros and is not
written) and writes ``out`` in place.

:func:`patch_module` swaps these into ``mamba.py`` (the names the mixer calls), like
:mod:`.cpu_conv` does for the short convolution.
"""

from __future__ import annotations

import itertools
import math
import types
from typing import Any

import torch

from hicache_obs.lab.sglang import cpu_conv

__all__ = [
    "PAD_SLOT_ID",
    "TARGET_MODULES",
    "mamba_chunk_scan_combined",
    "patch_module",
    "reference_scan",
    "selective_state_update",
]

PAD_SLOT_ID = -1
TARGET_MODULES = ("sglang.srt.layers.attention.mamba.mamba",)
"""Modules to patch right after they run: the ``MambaMixer2`` module, which imports the
Triton scan functions by name and (on CUDA only) the short convolution."""


def _dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool, limit: tuple[float, float] | None
) -> torch.Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if softplus:
        dt = torch.where(dt <= 20.0, torch.nn.functional.softplus(dt, threshold=float("inf")), dt)
    if limit is not None:
        dt = dt.clamp(min=limit[0], max=limit[1])
    return dt


def _expand_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """``(..., ngroups, dstate)`` -> ``(..., nheads, dstate)``, each head reading its group."""
    ngroups = t.shape[-2]
    if nheads % ngroups:
        raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
    return t.repeat_interleave(nheads // ngroups, dim=-2)


def reference_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One sequence, token after token: ``x`` ``(T, nheads, headdim)``, ``dt`` ``(T, nheads)``
    already processed (bias, softplus, limit), ``A`` ``(nheads,)``, ``B``/``C``
    ``(T, ngroups, dstate)``, ``D`` ``(nheads,)`` or ``(nheads, headdim)``, ``z`` like ``x``,
    ``h0`` ``(nheads, headdim, dstate)``. Returns float32 ``y`` ``(T, nheads, headdim)`` and
    the state after each token (``T + 1`` entries, the first ``h0``)."""
    T, nheads, headdim = x.shape
    dstate = B.shape[-1]
    x, dt, A = x.float(), dt.float(), A.float()
    Bh, Ch = _expand_groups(B.float(), nheads), _expand_groups(C.float(), nheads)
    h = h0.float().clone() if h0 is not None else x.new_zeros(nheads, headdim, dstate)
    decay = torch.exp(dt * A)  # (T, nheads)
    ys = []
    states = [h]
    for t in range(T):
        h = decay[t, :, None, None] * h + (dt[t, :, None, None] * x[t, :, :, None]) * Bh[t, :, None, :]
        ys.append((h * Ch[t, :, None, :]).sum(-1))
        states.append(h)
    y = torch.stack(ys) if ys else x.new_zeros(0, nheads, headdim)
    if D is not None:
        Df = D.float()
        y = y + x * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        y = y * torch.nn.functional.silu(z.float())
    return y, states


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    out: torch.Tensor | None = None,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    return_intermediate_states: bool = False,
    state_dtype: torch.dtype | None = None,
    return_track_states: bool = False,
    track_seq_idx: torch.Tensor | None = None,
    track_end_locs: torch.Tensor | None = None,
) -> Any:
    """Prefill: ``x`` ``(batch, seqlen, nheads, headdim)``, ``dt`` ``(batch, seqlen, nheads)``,
    ``A`` ``(nheads,)``, ``B``/``C`` ``(batch, seqlen, ngroups, dstate)``. The output goes to
    ``out`` (same shape as ``x``; the Triton kernel writes only there). Returns as the
    Triton ``mamba_chunk_scan_combined`` does for the same flags."""
    batch, seqlen, nheads, headdim = x.shape
    dstate = B.shape[-1]
    if out is None:
        raise ValueError("out must be given (the Triton kernel writes its output there)")
    sdtype = state_dtype if state_dtype is not None else C.dtype
    if not return_varlen_states:
        cu_seqlens = None
    elif cu_seqlens is None:
        raise ValueError("cu_seqlens must be provided if return_varlen_states is True")
    if cu_seqlens is not None and batch != 1:
        raise ValueError("cu_seqlens needs batch == 1")
    dtp = _dt(dt, dt_bias, dt_softplus, dt_limit)
    nchunks = math.ceil(seqlen / chunk_size)
    chunk_states = x.new_zeros(batch, nchunks, nheads, headdim, dstate, dtype=torch.float32)
    final_states = x.new_zeros(batch, nheads, headdim, dstate, dtype=torch.float32)
    out4 = out.view(batch, seqlen, nheads, headdim)
    per_seq_states: list[list[torch.Tensor]] = []
    bounds = [int(b) for b in cu_seqlens.tolist()] if cu_seqlens is not None else None
    for b in range(batch):
        spans = list(itertools.pairwise(bounds)) if bounds is not None else [(0, seqlen)]
        for i, (start, end) in enumerate(spans):
            h0 = None
            if initial_states is not None:
                h0 = initial_states[i if bounds is not None else b]
            y, states = reference_scan(
                x[b, start:end],
                dtp[b, start:end],
                A,
                B[b, start:end],
                C[b, start:end],
                D,
                z[b, start:end] if z is not None else None,
                h0,
            )
            out4[b, start:end] = y.to(out4.dtype)
            per_seq_states.append(states)
            # chunk boundary c (global position c * chunk_size) inside this sequence's span
            for c in range(nchunks):
                pos = c * chunk_size  # the state after token pos - 1
                if c == 0 and i == 0:
                    chunk_states[b, 0] = states[0]
                elif start < pos <= end and pos > 0:
                    chunk_states[b, c] = states[pos - start]
            final_states[b] = states[-1]
    chunk_states = chunk_states.to(sdtype)
    final_states = final_states.to(sdtype)
    varlen_states = None
    track_states = None
    if bounds is not None:
        varlen_states = torch.stack([s[-1] for s in per_seq_states]).to(sdtype)
        if track_seq_idx is not None and track_end_locs is not None and track_end_locs.numel() > 0:
            rows = []
            for s, e in zip(track_seq_idx.tolist(), track_end_locs.tolist()):
                rows.append(per_seq_states[s][int(e) - bounds[s]])
            track_states = torch.stack(rows).unsqueeze(0).to(sdtype)
    if return_track_states:
        if not return_varlen_states:
            raise ValueError("return_track_states requires return_varlen_states (cu_seqlens mode)")
        return chunk_states, varlen_states, track_states
    if return_intermediate_states:
        if return_varlen_states:
            return (chunk_states, final_states, varlen_states) if return_final_states else (chunk_states, varlen_states)
        return (chunk_states, final_states) if return_final_states else chunk_states
    if not return_varlen_states:
        return final_states if return_final_states else None
    return (final_states, varlen_states) if return_final_states else varlen_states


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    out: torch.Tensor | None = None,
    disable_state_update: bool = False,
    intermediate_states_buffer: torch.Tensor | None = None,
    cache_steps: int | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    **kwargs: Any,
) -> None:
    """Decode: ``state`` ``(lines, nheads, dim, dstate)``; ``x``/``dt``/``z``/``out``
    ``(batch, nheads, dim)`` or ``(batch, T, nheads, dim)``; ``A`` ``(nheads, dim, dstate)``;
    ``B``/``C`` ``(batch, ngroups, dstate)`` or ``(batch, T, ngroups, dstate)``; ``D`` and
    ``dt_bias`` ``(nheads, dim)``. Row ``i`` continues line ``state_batch_indices[i]`` (else
    ``i``) for its ``T`` tokens, writes ``out``, and (unless ``disable_state_update``) stores
    the last state back. With ``intermediate_states_buffer`` the state after each step ``t``
    goes to ``buffer[intermediate_state_indices[i] (else the line), t]``."""
    if retrieve_parent_token is not None:
        raise NotImplementedError("the CPU selective_state_update does not implement retrieve_parent_token")
    if out is None:
        raise ValueError("out must be given")
    s4 = state.unsqueeze(1) if state.dim() == 3 else state

    def four(t: torch.Tensor) -> torch.Tensor:
        while t.dim() < 4:
            t = t.unsqueeze(1)
        return t

    x4, dt4, out4 = four(x), four(dt), four(out)
    B4, C4 = four(B), four(C)
    z4 = four(z) if z is not None else None
    A3 = A.unsqueeze(0) if A.dim() == 2 else A
    D2 = D.unsqueeze(0) if D is not None and D.dim() == 1 else D
    bias2 = dt_bias.unsqueeze(0) if dt_bias is not None and dt_bias.dim() == 1 else dt_bias
    batch, T, nheads, _ = x4.shape
    lines = state_batch_indices.tolist() if state_batch_indices is not None else list(range(batch))
    for row, line in enumerate(lines):
        pad = state_batch_indices is not None and line == pad_slot_id
        h = s4.new_zeros(s4.shape[1:], dtype=torch.float32) if pad else s4[line].float()
        cache_line, buf = None, None
        if intermediate_states_buffer is not None and not pad:
            cache_line = int(intermediate_state_indices[row]) if intermediate_state_indices is not None else line
            buf = intermediate_states_buffer.view(-1, cache_steps or T, *s4.shape[1:])
        for t in range(T):
            d = _dt(dt4[row, t], bias2, dt_softplus, None)  # (nheads, dim)
            dA = torch.exp(A3.float() * d[:, :, None])
            Bh = _expand_groups(B4[row, t].float(), nheads)  # (nheads, dstate)
            Ch = _expand_groups(C4[row, t].float(), nheads)
            xt = x4[row, t].float()
            h = h * dA + (d * xt)[:, :, None] * Bh[:, None, :]
            if buf is not None:
                buf[cache_line, t] = h.to(buf.dtype)
            y = (h * Ch[:, None, :]).sum(-1)
            if D2 is not None:
                y = y + xt * D2.float()
            if z4 is not None:
                y = y * torch.nn.functional.silu(z4[row, t].float())
            out4[row, t] = y.to(out4.dtype)
        if not disable_state_update and not pad:
            s4[line] = h.to(s4.dtype)


_SCAN = {
    "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
    "selective_state_update": selective_state_update,
}
_CONV = {
    "causal_conv1d_fn": cpu_conv.causal_conv1d_fn,
    "causal_conv1d_update": cpu_conv.causal_conv1d_update,
    "causal_conv1d_fn_triton": cpu_conv.causal_conv1d_fn,
    "causal_conv1d_update_triton": cpu_conv.causal_conv1d_update,
}


def patch_module(module: types.ModuleType) -> list[str]:
    """In ``module`` (SGLang's ``mamba.py``): bind ``mamba_chunk_scan_combined`` and
    ``selective_state_update`` to the torch ones, and the short-convolution names the mixer
    calls (``causal_conv1d_fn[_triton]``, ``causal_conv1d_update[_triton]``, bound only under
    ``is_cuda()``) to :mod:`.cpu_conv`'s. Return the names bound. Idempotent."""
    names = []
    for name, fn in {**_SCAN, **_CONV}.items():
        if getattr(module, name, None) is not fn:
            setattr(module, name, fn)
            names.append(name)
    return names
