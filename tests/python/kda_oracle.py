"""An independent pure-torch KDA recurrence in flash-linear-attention's
conventions (naive_recurrent_kda), the tests' oracle; gradients by autograd.

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,   o_t = scale S_t^T q_t
"""

import torch


def naive_kda(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None):
    b, t, h, kd = q.shape
    hv = v.shape[2]
    grp = hv // h
    if scale is None:
        scale = kd ** -0.5
    if cu_seqlens is None:
        spans = [(row, 0, t, row) for row in range(b)]
    else:
        cu = [int(c) for c in cu_seqlens]
        spans = [(0, cu[n], cu[n + 1], n) for n in range(len(cu) - 1)]
    outs = [[None] * t for _ in range(b)]
    finals = []
    for row, start, end, n in spans:
        if initial_state is None:
            s = q.new_zeros(hv, kd, v.shape[3])
        else:
            s = initial_state[n]
        for i in range(start, end):
            kt = k[row, i].repeat_interleave(grp, dim=0)  # [HV,K]
            qt = q[row, i].repeat_interleave(grp, dim=0)
            s = s * g[row, i].exp().unsqueeze(-1)
            ks = torch.einsum("hk,hkv->hv", kt, s)
            s = s + beta[row, i][:, None, None] * kt[:, :, None] * (v[row, i] - ks)[:, None, :]
            outs[row][i] = scale * torch.einsum("hkv,hk->hv", s, qt)
        finals.append(s)
    o = torch.stack([torch.stack(r) for r in outs])
    return o, torch.stack(finals)


def make_inputs(b, t, h, hv, kd, vd, dtype, seed, n_states=None):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rnd(b, t, h, kd)
    k = torch.nn.functional.normalize(rnd(b, t, h, kd), dim=-1)
    v = rnd(b, t, hv, vd)
    g = -0.5 * torch.rand(b, t, hv, kd, generator=gen, dtype=torch.float64)
    beta = torch.rand(b, t, hv, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    h0 = None if n_states is None else 0.5 * rnd(n_states, hv, kd, vd)
    cast = [x.to(dtype) if x is not None else None for x in (q, k, v, g, beta, h0)]
    return cast
