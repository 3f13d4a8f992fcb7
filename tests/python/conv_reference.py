"""An independent reference of flash-linear-attention's causal_conv1d for the
tests: torch.nn.functional.conv1d (groups=D) over each sequence with its
W-1 tokens of history (the initial state's columns 1..W-1, or zeros) in
front, F.silu for the activation; the final state is each sequence's last W
positions of [initial state (or zeros); tokens]. Differentiable by torch's
autograd."""

import torch
import torch.nn.functional as F


def sequences(x, cu_seqlens):
    """(batch row, first token, end, state row) of each sequence."""
    if cu_seqlens is None:
        return [(b, 0, x.shape[1], b) for b in range(x.shape[0])]
    cu = [int(c) for c in cu_seqlens]
    return [(0, cu[n], cu[n + 1], n) for n in range(len(cu) - 1)]


def causal_conv1d_ref(x, weight, bias=None, activation=None, initial_state=None,
                      output_final_state=False, cu_seqlens=None):
    _, _, d = x.shape
    w = weight.shape[1]
    finals, out = [], []
    for b, lo, hi, n in sequences(x, cu_seqlens):  # n ascending: final states in order
        seq = x[b, lo:hi].t()  # [D, L]
        if initial_state is None:
            hist = seq.new_zeros(d, w)
        else:
            hist = initial_state[n]  # [D, W]: positions -W .. -1
        ext = torch.cat([hist, seq], dim=1)  # [D, W + L]
        z = F.conv1d(ext[:, 1:].unsqueeze(0), weight.unsqueeze(1), bias, groups=d)[0]  # [D, L]
        y = F.silu(z) if activation in ("silu", "swish") else z
        out.append((b, lo, hi, y.t()))
        finals.append(ext[:, -w:])
    parts = []
    for b in range(x.shape[0]):
        row = [y for bb, lo, hi, y in sorted(out, key=lambda e: (e[0], e[1])) if bb == b]
        parts.append(torch.cat(row, dim=0))
    ys = torch.stack(parts, dim=0)
    ht = torch.stack(finals, dim=0) if output_final_state else None
    return ys, ht
