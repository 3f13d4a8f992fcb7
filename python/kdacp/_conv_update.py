"""flash-linear-attention's decode-time convolution ops on kdacp:
causal_conv1d_update (one token per sequence against a rolling cache,
ShortConvolution.step's) and causal_conv1d_update_states (a cache from a
prefill). The arithmetic is kdacp.torch.causal_conv1d's (C++); these only
reshape and move the window. docs/conv.md."""

import torch

from kdacp._autograd import cu_list
from kdacp._common import _check_tensor
from kdacp._conv import causal_conv1d


def _flat(x, weight, op):
    """x as [N, D]: [N, D], [1, N, D] or [N, 1, D] (one token per sequence),
    trailing dimensions merged when they do not match weight's D."""
    if weight is not None and x.dim() >= 3 and x.shape[-1] != weight.shape[0]:
        x = x.reshape(*x.shape[:2], -1)
    if x.dim() == 2:
        return x
    if x.dim() == 3 and (x.shape[0] == 1 or x.shape[1] == 1):
        return x.reshape(-1, x.shape[-1])
    raise ValueError(f"{op}: x has shape {list(x.shape)}, expected [N, D], [1, N, D] or "
                     f"[N, 1, D] (one token per sequence)")


def causal_conv1d_update(x, cache, residual=None, weight=None, bias=None, activation=None):
    """flash-linear-attention's causal_conv1d_update: one decoding step.

    x: [N, D], [1, N, D] or [N, 1, D], one token per sequence (with weight
    given, [B, T, H, d] is merged to D = H·d). cache [N, D, W]: each
    sequence's last W inputs, column W-1 the latest; updated in place (it
    shifts left by one and takes x in column W-1). Returns (y shaped as x,
    cache): y = act(Σ_w cache[:, :, w]·weight[:, w] + bias) + residual on the
    updated cache, activation None, "silu" or "swish". Forward only (no
    gradient, as flash-linear-attention's kernel). weight None or cache None:
    ValueError (flash-linear-attention fails with a TypeError, or reads a
    zero window that ignores x).
    """
    op = "causal_conv1d_update"
    if weight is None:
        raise ValueError(f"{op}: weight=None, expected a [D, W] tensor")
    if cache is None:
        raise ValueError(f"{op}: cache=None, expected the [N, D, W] rolling window (zeros "
                         "before the first token)")
    _check_tensor(cache, "cache", 3)
    shape = x.shape
    flat = _flat(x, weight, op)
    n, d = flat.shape
    w = weight.shape[-1]
    if tuple(cache.shape) != (n, d, w):
        raise ValueError(f"{op}: cache has shape {list(cache.shape)}, expected [N, D, W] = "
                         f"[{n}, {d}, {w}] (x's tokens, x's D, weight's W)")
    if residual is not None:
        if residual.numel() != n * d:
            raise ValueError(f"{op}: residual has shape {list(residual.shape)}, expected "
                             f"{n * d} elements (x's)")
        residual = residual.reshape(n, 1, d)
    with torch.no_grad():
        y, final = causal_conv1d(flat.reshape(n, 1, d), weight, bias, residual,
                                 initial_state=cache, output_final_state=True,
                                 activation=activation)
        cache.copy_(final)
    return y.reshape(shape), cache


def causal_conv1d_update_states(x, state_len, initial_state=None, cu_seqlens=None):
    """flash-linear-attention's causal_conv1d_update_states: the rolling
    cache [N, D, state_len] after x, each sequence's last state_len inputs
    (column state_len-1 the latest), reaching into initial_state [N, D,
    state_len] (or zeros) for a sequence shorter than that. x [B, T, D], or
    with cu_seqlens (N+1 boundaries) [1, T, D] or [T, D]. Stored as x; no
    gradient."""
    op = "causal_conv1d_update_states"
    if isinstance(state_len, bool) or not isinstance(state_len, int) or state_len < 1:
        raise ValueError(f"{op}: state_len={state_len!r}, expected an integer >= 1")
    _check_tensor(x, "x")
    if cu_seqlens is None:
        if x.dim() != 3:
            raise ValueError(f"{op}: x has shape {list(x.shape)}, expected [B, T, D]")
        seqs = [x[b] for b in range(x.shape[0])]
    else:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1]) if x.dim() == 3 and \
            x.shape[0] == 1 else None
        if rows is None:
            raise ValueError(f"{op}: x has shape {list(x.shape)}, expected [1, T, D] or [T, D] "
                             "with cu_seqlens")
        cu = cu_list(cu_seqlens)
        if cu[0] != 0 or cu[-1] != rows.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{op}: cu_seqlens {cu}, expected non-decreasing from 0 to T = "
                             f"{rows.shape[0]}")
        seqs = [rows[a:b] for a, b in zip(cu, cu[1:])]
    n, d = len(seqs), x.shape[-1]
    if initial_state is not None:
        _check_tensor(initial_state, "initial_state", 3)
        if tuple(initial_state.shape) != (n, d, state_len):
            raise ValueError(f"{op}: initial_state has shape {list(initial_state.shape)}, "
                             f"expected [N, D, state_len] = [{n}, {d}, {state_len}]")
    with torch.no_grad():
        out = x.new_zeros(n, d, state_len)
        for i, seq in enumerate(seqs):
            take = min(state_len, seq.shape[0])
            if take:
                out[i, :, state_len - take:] = seq[seq.shape[0] - take:].t()
            if take < state_len and initial_state is not None:
                out[i, :, :state_len - take] = initial_state[i, :, take:]
    return out
