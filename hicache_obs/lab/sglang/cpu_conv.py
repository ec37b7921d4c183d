"""Torch implementations of SGLang's short-convolution kernels (LFM2), for a CPU (test support).

SGLang's ``causal_conv1d_fn`` / ``causal_conv1d_update``
(``sglang.kernels.ops.mamba.causal_conv1d_triton``) are Triton kernels off CUDA; these
have their signatures and effects. A depthwise causal convolution of width ``W`` runs
over each sequence's window: the ``W - 1`` tokens before it (its cache line, else zeros),
then its tokens. Layouts are SGLang's:

* ``x``: ``(dim, total_tokens)`` for prefill, sequences concatenated, bounded by
  ``query_start_loc`` (``batch + 1`` offsets from 0); ``(batch, dim)`` or
  ``(batch, dim, seqlen)`` for decode. The result has ``x``'s shape and dtype; ``x`` is
  not written.
* ``conv_states``: ``(num_cache_lines, dim, state_len)``, ``state_len >= W - 1``; a
  sequence uses line ``cache_indices[i]`` (decode: ``conv_state_indices[i]``; else
  ``i``), columns ``[0, W - 1)``, oldest first. After the call those columns hold the
  last ``W - 1`` tokens of the window, in place.
* A sequence whose line is ``pad_slot_id``, or (prefill) which has no tokens, is skipped:
  its state is untouched and its output is zeros (the Triton kernels leave it unwritten).

Arithmetic is float32, as the kernels accumulate; ``bias`` is added before ``silu``.
:func:`patch_module` swaps these in wherever a module holds the Triton functions.
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["PAD_SLOT_ID", "TARGET_MODULES", "TRITON_MODULE", "causal_conv1d_fn", "causal_conv1d_update", "patch_module"]

PAD_SLOT_ID = -1
TRITON_MODULE = "sglang.kernels.ops.mamba.causal_conv1d_triton"
TARGET_MODULES = (TRITON_MODULE, "sglang.srt.layers.attention.mamba.causal_conv1d")
"""Modules to patch right after they run: the Triton module (whose functions ``lfm2.py``
also imports directly) and SGLang's wrapper module, which binds them under private names."""


def _silu(activation: Any) -> bool:
    if isinstance(activation, bool):  # the kernels also take True for "silu"
        return activation
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"activation must be None, 'silu' or 'swish', not {activation!r}")
    return activation is not None


def _conv(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """``(dim, W - 1 + n)`` window -> ``(dim, n)`` float32 outputs."""
    taps = window.float().unfold(1, weight.shape[1], 1)  # (dim, n, W), oldest first
    y = (taps * weight.float()[:, None, :]).sum(-1)
    if bias is not None:
        y = y + bias.float()[:, None]
    return torch.nn.functional.silu(y) if silu else y


def _unsupported(**arguments: Any) -> None:
    given = [name for name, value in arguments.items() if value is not None]
    if given:
        raise NotImplementedError(f"the CPU short convolution does not implement {', '.join(given)}")


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens_cpu: list[int],
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    validate_data: bool = False,
    block_table: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Varlen prefill: ``x`` ``(dim, total_tokens)`` -> the same shape. Sequence ``i`` starts
    from its cache line when ``has_initial_state[i]``, else from zeros; its line is then
    updated. ``seq_lens_cpu`` (the Triton launch grid) is not needed here."""
    _unsupported(block_table=block_table)
    silu = _silu(activation)
    k = weight.shape[1] - 1
    out = torch.zeros_like(x)
    bounds = query_start_loc.tolist()
    lines = cache_indices.tolist() if cache_indices is not None else range(len(bounds) - 1)
    resume = has_initial_state.tolist() if has_initial_state is not None else [False] * (len(bounds) - 1)
    for start, end, line, warm in zip(bounds, bounds[1:], lines, resume):
        if end <= start or line == pad_slot_id:
            continue
        tokens = x[:, start:end].float()
        prior = conv_states[line, :, :k].float() if warm else tokens.new_zeros(tokens.shape[0], k)
        window = torch.cat([prior, tokens], 1)
        out[:, start:end] = _conv(window, weight, bias, silu).to(out.dtype)
        if conv_states is not None:
            conv_states[line, :, :k] = window[:, -k:]
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accept_tokens: torch.Tensor | None = None,
    intermediate_conv_window: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    retrieve_next_token: torch.Tensor | None = None,
    retrieve_next_sibling: torch.Tensor | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    metadata: Any = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """Decode: ``x`` ``(batch, dim)`` or ``(batch, dim, seqlen)`` continues row ``i``'s cache
    line and updates it. ``cache_seqlens`` is ignored, as by the Triton kernel. With
    ``intermediate_conv_window`` (target verify), the window after each token ``t`` is also
    written to ``intermediate_conv_window[intermediate_state_indices[i], t, :, :W - 1]``."""
    _unsupported(
        num_accept_tokens=num_accept_tokens,
        retrieve_next_token=retrieve_next_token,
        retrieve_next_sibling=retrieve_next_sibling,
        retrieve_parent_token=retrieve_parent_token,
    )
    silu = _silu(activation)
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(-1) if squeeze else x
    k = weight.shape[1] - 1
    out = torch.zeros_like(x3)
    lines = conv_state_indices.tolist() if conv_state_indices is not None else range(x3.shape[0])
    for row, line in enumerate(lines):
        if line == pad_slot_id:
            continue
        window = torch.cat([conv_state[line, :, :k].float(), x3[row].float()], 1)
        out[row] = _conv(window, weight, bias, silu).to(out.dtype)
        if intermediate_conv_window is not None and intermediate_state_indices is not None:
            after = window.unfold(1, k, 1)[:, 1:]  # (dim, seqlen, k): the window after each token
            step_line = int(intermediate_state_indices[row])
            intermediate_conv_window[step_line, : after.shape[1], :, :k] = after.transpose(0, 1)
        conv_state[line, :, :k] = window[:, -k:]
    return out.squeeze(-1) if squeeze else out


_TORCH = {"causal_conv1d_fn": causal_conv1d_fn, "causal_conv1d_update": causal_conv1d_update}


def patch_module(module: types.ModuleType) -> list[str]:
    """Rebind, in ``module``, every name that holds SGLang's Triton ``causal_conv1d_fn`` or
    ``causal_conv1d_update`` to the torch one; return the names rebound. In the Triton module
    these are the functions themselves; SGLang's wrapper module holds them as
    ``_causal_conv1d_fn_triton`` / ``_causal_conv1d_update_triton`` and calls them off CUDA,
    so its own wrappers (and their signatures) stay. Idempotent."""
    names = []
    for name, value in list(vars(module).items()):
        if getattr(value, "__module__", None) == TRITON_MODULE and getattr(value, "__name__", None) in _TORCH:
            setattr(module, name, _TORCH[value.__name__])
            names.append(name)
    return names
