"""Gloo workers for chunk_kda(..., return_intermediate_states=True,
cp_context=ctx): each rank's h against the FP64 recurrence's states
(test_fla_api.reference), chunks counted from each local sequence piece's
first token, a piece that continues a sequence starting from the state the
earlier ranks leave."""

import torch

import chunk_kda_workers as ckw
import kdacp.torch as kt
from test_fla_api import F64, close, inputs, reference


def expected_h(after, h0, cu, b, parts, chunk):
    """The states entering every chunk of this rank's pieces, in h's order:
    row by row (B rows without cu_seqlens), part by part, piece by piece."""
    out = []
    for row in range(b):
        for first, end in parts:
            spans = ([(0, first, end, row)] if cu is None else
                     [(cu[m], max(first, cu[m]), min(end, cu[m + 1]), m)
                      for m in range(len(cu) - 1) if cu[m] < end and cu[m + 1] > first])
            for seq_start, lo, hi, m in spans:
                for i in range(lo, hi, chunk):
                    if i == seq_start:
                        out.append(torch.zeros(2, 5, 3, dtype=F64) if h0 is None else h0[m])
                    else:
                        out.append(after[(row, i - 1)])
    return out


def intermediate_worker(rank, world, init_file):
    ckw.init(rank, world, init_file)
    group = torch.distributed.group.WORLD
    cases = [("contiguous", [0, 37, 150, 181], True, 64),  # cuts off the chunk grid, h0
             ("zigzag", [0, 70, 181], False, 32),
             ("contiguous", None, True, 32)]  # a sequence per batch row
    for layout, cu, with_h0, chunk in cases:
        b, t = (1, 181) if cu is not None else (2, 96)
        q, k, v, g, beta = inputs(b, t, 1, 2, 5, 3, seed=11)
        n = b if cu is None else len(cu) - 1
        h0 = torch.randn(n, 2, 5, 3, generator=torch.Generator().manual_seed(12),
                         dtype=F64) if with_h0 else None
        if cu is None:
            ctx = kt.build_cp_context(None, group, split=[t // world] * world, timeout=30)
        else:
            ctx = kt.build_cp_context(cu, group, layout=layout, split="balanced", timeout=30)
        parts = ctx._parts()
        mine = [torch.cat([x[:, a:e] for a, e in parts], 1) for x in (q, k, v, g, beta)]
        with torch.inference_mode():
            o, _, h = kt.chunk_kda(*mine, initial_state=h0, cp_context=ctx,
                                   return_intermediate_states=True, chunk_size=chunk)
        ro, _, _, after = reference(q, k, v, g, beta, h0=h0, cu=cu)
        want = expected_h(after, h0, cu, b, parts, chunk)
        assert h.dim() == 5 and h.shape[0] == b, (layout, h.shape)
        got = h.reshape(-1, 2, 5, 3)  # [B, NT, ...] row by row
        assert len(want) == got.shape[0], (layout, len(want), got.shape)
        close(got, torch.stack(want))
        close(o, torch.cat([ro[:, a:e] for a, e in parts], 1))
    ckw.finish()
