"""The gradients of tensors every rank holds whole (initial_state, A_log,
dt_bias, the convolution's weight, bias and initial_state) are each rank's
share: summed over the CP group, as the trainer's all-reduce does, they are
one process's gradient (docs/python.md). An initial state's share is the
whole row on the rank holding its sequence's first token and -0.0 on the
others."""

import torch
import torch.distributed as dist


def summed(grad, group=None):
    """The sum over the group of each rank's share (a copy)."""
    total = grad.clone()
    dist.all_reduce(total, group=group)
    return total


def first_token_rows(spans, cu_seqlens, n):
    """The state rows whose sequence's first token lies in this rank's token
    spans [(begin, end), ...] (without cu_seqlens every one of the n rows
    starts at token 0)."""
    starts = [0] * n if cu_seqlens is None else [int(c) for c in cu_seqlens[:-1]]
    return [i for i, s in enumerate(starts) if any(a <= s < e for a, e in spans)]


def state_share_sum(grad, spans, cu_seqlens, group=None):
    """Checks that `grad` [N, ...] is this rank's share of an initial
    state's gradient (the rows of sequences that start on another rank are
    -0.0) and returns the sum over the group."""
    owned = first_token_rows(spans, cu_seqlens, grad.shape[0])
    for i in range(grad.shape[0]):
        if i not in owned:
            row = grad[i]
            assert torch.equal(row, torch.zeros_like(row)) and torch.signbit(row).all(), \
                f"initial_state.grad row {i}: its sequence starts on another rank, expected -0.0"
    return summed(grad, group)
