"""flash-linear-attention 0.6's decode entry fused_recurrent_kda_fwd
(continuous batching), its KDA gate ops and causal_conv1d's seq_idx and
[B,T,...] inputs on kdacp (docs/fla.md): FP64 references written here from
the definitions (and flash-linear-attention's naive gate references where it
is installed), errors."""

import pytest
import torch
import torch.nn.functional as F

import kdacp.torch as kt
from conv_reference import causal_conv1d_ref
from test_fla_api import close, inputs, reference

F64 = torch.float64


# --- fused_recurrent_kda_fwd ----------------------------------------------

def test_decode_without_slots_updates_initial_state_in_place():
    q, k, v, g, beta = inputs(3, 2, 1, 2, 4, 3, seed=11)
    h0 = torch.randn(3, 2, 4, 3, dtype=F64)
    ro, rf, _, _ = reference(q, k, v, g, beta, h0=h0)
    pool = h0.clone()
    out, fs = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool)
    assert fs is pool and not out.requires_grad
    close(out, ro)
    close(pool, rf)
    out2, fs2 = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=h0,
                                           inplace_final_state=False, output_final_state=True)
    close(fs2, rf)
    buf = torch.full_like(v, 7.0)
    out3, none = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=h0,
                                            inplace_final_state=False, out=buf)
    assert out3 is buf and none is None
    close(buf, ro)


def test_continuous_batching_with_accepted_tokens():
    # 3 sequences of 2, 0 and 3 tokens (speculative decoding); the pool has 8 slots.
    q, k, v, g, beta = inputs(1, 5, 1, 2, 4, 3, seed=12)
    cu = [0, 2, 2, 5]
    pool = torch.randn(8, 2, 4, 3, dtype=F64)
    indices = torch.tensor([[1, 6, 0], [5, 5, 5], [2, 3, 4]])
    accepted = torch.tensor([2, 1, 1])  # sequence 0 reads slot indices[0, 1] = 6
    h0 = pool[[6, 5, 2]]
    ro, _, _, after = reference(q, k, v, g, beta, h0=h0, cu=cu)
    work = pool.clone()
    out, fs = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=work, cu_seqlens=cu,
                                         ssm_state_indices=indices,
                                         num_accepted_tokens=accepted)
    close(out, ro)
    expect = pool.clone()
    for slot, token in ((1, 0), (6, 1), (2, 2), (3, 3), (4, 4)):
        expect[slot] = after[(0, token)]
    close(work, expect)
    # not in place: the state after token i goes to final_state[i]
    q1, k1, v1, g1, b1 = (x[:, :3] for x in (q, k, v, g, beta))
    idx = torch.tensor([4, 0, 7])
    _, fs = kt.fused_recurrent_kda_fwd(q1, k1, v1, g1, b1, initial_state=pool,
                                       cu_seqlens=[0, 1, 2, 3], ssm_state_indices=idx,
                                       inplace_final_state=False, output_final_state=True,
                                       state_v_first=False)
    _, _, _, after1 = reference(q1, k1, v1, g1, b1, h0=pool[[4, 0, 7]], cu=[0, 1, 2, 3])
    close(fs, torch.stack([after1[(0, i)] for i in range(3)]))
    # there only the slots read must lie in the pool (-1: vLLM's unused entries)
    _, fs2 = kt.fused_recurrent_kda_fwd(q1, k1, v1, g1, b1, initial_state=pool,
                                        cu_seqlens=[0, 1, 2, 3], inplace_final_state=False,
                                        ssm_state_indices=torch.tensor([[4, -1], [0, -1], [7, -1]]),
                                        output_final_state=True)
    close(fs2, fs, 0)


def test_decode_state_v_first_headwise_beta_and_dtypes():
    q, k, v, g, beta = inputs(2, 3, 1, 2, 4, 3, seed=13)
    bh = torch.rand(2, 3, 2, 3, dtype=F64)
    h0 = torch.randn(2, 2, 4, 3, dtype=F64)
    ro, rf, _, _ = reference(q, k, v, g, bh, h0=h0)
    pool = h0.transpose(-1, -2).contiguous()
    out, _ = kt.fused_recurrent_kda_fwd(q, k, v, g, bh, initial_state=pool, state_v_first=True)
    close(out, ro)
    close(pool, rf.transpose(-1, -2))
    qb, kb, vb, gb, bb = (x.to(torch.bfloat16) for x in (q, k, v, g, beta))
    pool = h0.float()
    out, _ = kt.fused_recurrent_kda_fwd(qb, kb, vb, gb, bb, initial_state=pool)
    assert out.dtype == torch.bfloat16 and pool.dtype == torch.float32


def test_decode_transforms_equal_chunk_kda():
    """The decode path's in-kernel transforms are chunk_kda's (one helper):
    l2norm, the gate with A_log/dt_bias and lower_bound, beta = 2·sigmoid
    with allow_neg_eigval; float64, equal to 1e-12."""
    gen = torch.Generator().manual_seed(21)
    b, t, h, kd, vd = 2, 1, 2, 4, 3
    q, k, g = (torch.randn(b, t, h, kd, generator=gen, dtype=F64) for _ in range(3))
    v = torch.randn(b, t, h, vd, generator=gen, dtype=F64)
    beta = torch.randn(b, t, h, generator=gen, dtype=F64) * 3
    a_log, dt_bias = torch.randn(h, generator=gen, dtype=F64), torch.randn(h * kd, generator=gen,
                                                                            dtype=F64)
    h0 = torch.randn(b, h, kd, vd, generator=gen, dtype=F64)
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-3.0,
                 use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    want, want_ht = kt.chunk_kda(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias,
                                 initial_state=h0, output_final_state=True, **flags)
    pool = h0.clone()
    out, fs = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias,
                                         initial_state=pool, **flags)
    assert fs is pool
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(pool, want_ht, rtol=0, atol=1e-12)
    plain, _ = kt.fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias,
                                          initial_state=h0.clone(),
                                          **dict(flags, allow_neg_eigval=False))
    assert (plain - want).abs().max() > 1e-3  # beta doubled: a different result


def test_decode_errors():
    q, k, v, g, beta = inputs(1, 3, 1, 1, 4, 3, seed=14)
    pool = torch.zeros(4, 1, 4, 3, dtype=F64)
    with pytest.raises(AssertionError, match="inplace_final_state"):
        kt.fused_recurrent_kda_fwd(q, k, v, g, beta)
    with pytest.raises(AssertionError, match="out has shape"):
        kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool[:1], out=v[:, :2])
    with pytest.raises(ValueError, match=r"slot 9, expected one in \[0, 4\)"):
        kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, cu_seqlens=[0, 1, 2, 3],
                                   ssm_state_indices=torch.tensor([0, 9, 1]))
    with pytest.raises(ValueError, match="2 tokens"):  # [N] indices: one slot per sequence
        kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, cu_seqlens=[0, 2, 3],
                                   ssm_state_indices=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="num_accepted_tokens needs"):
        kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, cu_seqlens=[0, 1, 2, 3],
                                   ssm_state_indices=torch.tensor([0, 1, 2]),
                                   num_accepted_tokens=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="output_final_state=True"):
        kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool, cu_seqlens=[0, 1, 2, 3],
                                   ssm_state_indices=torch.tensor([0, 1, 2]),
                                   inplace_final_state=False)
    with pytest.raises(ValueError, match="lower_bound"):
        kt.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool[:1],
                                   use_gate_in_kernel=True)


# --- gates -----------------------------------------------------------------

def gate64(g, a_log, dt_bias, lower_bound):
    h, kd = g.shape[-2:]
    x = g.to(F64) + (0 if dt_bias is None else dt_bias.to(F64).view(h, kd))
    a = 1.0 if a_log is None else a_log.to(F64).view(h, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


@pytest.mark.parametrize("lower_bound,with_a", [(None, True), (-5.0, True), (-2.0, False)])
def test_fused_kda_gate_value_and_gradients(lower_bound, with_a):
    gen = torch.Generator().manual_seed(15)
    g = torch.randn(2, 7, 3, 4, generator=gen, dtype=F64, requires_grad=True)
    a = (torch.randn(3, generator=gen, dtype=F64) * 0.5).requires_grad_() if with_a else None
    b = torch.randn(12, generator=gen, dtype=F64, requires_grad=True)
    y = kt.fused_kda_gate(g, a, b, lower_bound, output_dtype=F64)
    ref = gate64(g, a, b, lower_bound)
    close(y, ref, 1e-13)
    dy = torch.randn(y.shape, generator=gen, dtype=F64)
    mine = torch.autograd.grad(y, [x for x in (g, a, b) if x is not None], dy)
    theirs = torch.autograd.grad(ref, [x for x in (g, a, b) if x is not None], dy)
    for m, t in zip(mine, theirs):
        close(m, t, 1e-12)
    dg, da, db = kt.kda_gate_bwd(g.detach(), None if a is None else a.detach(), b.detach(), dy,
                                 lower_bound)
    close(dg, mine[0], 0)
    assert (da is None) == (a is None)
    y32 = kt.kda_gate_fwd(g.detach().float(), None if a is None else a.detach().float(),
                          b.detach().float(), lower_bound)
    assert y32.dtype == torch.float32 and not y32.requires_grad
    close(y32, ref, 1e-5)


def test_gate_equals_fla_naive():
    naive = pytest.importorskip("fla.ops.kda.gate")
    g, a, b = torch.randn(1, 9, 2, 4), torch.randn(2), torch.randn(8)
    close(kt.fused_kda_gate(g, a, b), naive.naive_kda_gate(g, a, b), 1e-6)
    close(kt.fused_kda_gate(g, a, b, -5.0), naive.naive_kda_lowerbound_gate(g, a, b, -5.0), 1e-6)
    close(kt.fused_kda_gate(g, None, b, -3.0),
          naive.naive_kda_lowerbound_gate(g, None, b, -3.0), 1e-6)


def test_gate_dtypes_and_errors():
    g = torch.randn(1, 5, 2, 4, dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(2, requires_grad=True)
    y = kt.fused_kda_gate(g, a, None, output_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert g.grad.dtype == torch.bfloat16 and a.grad.dtype == torch.float32
    with pytest.raises(ValueError, match="lower_bound"):
        kt.fused_kda_gate(g, None)
    with pytest.raises(ValueError, match="A_log has 3 elements"):
        kt.fused_kda_gate(g, torch.zeros(3))
    with pytest.raises(ValueError, match="lower_bound"):
        kt.fused_kda_gate(g, a, lower_bound=1.0)


def test_kda_gate_chunk_cumsum():
    gen = torch.Generator().manual_seed(16)
    g = torch.randn(1, 40, 2, 3, generator=gen, dtype=F64)
    a = torch.randn(2, generator=gen, dtype=F64)
    cu = [0, 10, 10, 37]
    o = kt.kda_gate_chunk_cumsum(g, a, 16, scale=0.5, cu_seqlens=torch.tensor(cu),
                                 output_dtype=None)
    gate = gate64(g, a, None, None)
    ref = torch.zeros_like(gate)
    for lo, hi in ((0, 10), (10, 26), (26, 37)):
        ref[:, lo:hi] = gate[:, lo:hi].cumsum(1) * 0.5
    close(o, ref, 1e-13)
    assert o.dtype == F64
    o2 = kt.kda_gate_chunk_cumsum(g.repeat(2, 1, 1, 1), a, 32)
    assert o2.dtype == torch.float32
    close(o2[1, 32:], gate[0, 32:].cumsum(0), 1e-5)
    with pytest.raises(AssertionError, match="power of 2"):
        kt.kda_gate_chunk_cumsum(g, a, 24)
    with pytest.raises(ValueError, match="chunk_indices"):
        kt.kda_gate_chunk_cumsum(g, a, 16, cu_seqlens=cu, chunk_indices=torch.tensor([[0, 0]]))
    good = torch.tensor([[0, 0], [2, 0], [2, 1]])
    close(kt.kda_gate_chunk_cumsum(g, a, 16, cu_seqlens=cu, chunk_indices=good),
          kt.kda_gate_chunk_cumsum(g, a, 16, cu_seqlens=cu), 0)


# --- causal_conv1d ---------------------------------------------------------

def test_conv_seq_idx():
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(2, 10, 6, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(6, 3, generator=gen, dtype=F64, requires_grad=True)
    sid = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0, 3, 3]])
    y, ht = kt.causal_conv1d(x, w, activation="silu", seq_idx=sid)
    assert ht is None
    ref = torch.cat([causal_conv1d_ref(x[r:r + 1], w, activation="silu", cu_seqlens=cu)[0]
                     for r, cu in ((0, [0, 3, 7, 10]), (1, [0, 8, 10]))])
    close(y, ref, 1e-13)
    dy = torch.randn(y.shape, generator=gen, dtype=F64)
    for m, t in zip(torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)):
        close(m, t, 1e-12)
    y1, h1 = kt.causal_conv1d(x[:1], w, seq_idx=sid[:1], cu_seqlens=[0, 3, 7, 10],
                              output_final_state=True)
    r1, rh = causal_conv1d_ref(x[:1], w, cu_seqlens=[0, 3, 7, 10], output_final_state=True)
    close(y1, r1, 1e-13)
    close(h1, rh, 0)
    with pytest.raises(ValueError, match="same sequences"):
        kt.causal_conv1d(x[:1], w, seq_idx=sid[:1], cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match="decreases"):
        kt.causal_conv1d(x[:1], w, seq_idx=sid[:1].flip(1))
    with pytest.raises(ValueError, match="no initial_state"):
        kt.causal_conv1d(x, w, seq_idx=sid, output_final_state=True)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        kt.causal_conv1d(x, w, seq_idx=sid[:, :4])


def test_conv_multi_dim_x_and_weight_none():
    gen = torch.Generator().manual_seed(18)
    x = torch.randn(2, 7, 2, 3, generator=gen, dtype=F64)
    w = torch.randn(6, 4, generator=gen, dtype=F64)
    r = torch.randn(2, 7, 2, 3, generator=gen, dtype=F64)
    y, _ = kt.causal_conv1d(x, w, residual=r)
    assert y.shape == x.shape
    ref, _ = causal_conv1d_ref(x.reshape(2, 7, 6), w)
    close(y, (ref + r.reshape(2, 7, 6)).reshape(x.shape), 1e-13)
    with pytest.raises(ValueError, match="weight=None"):
        kt.causal_conv1d(x, None)
    with pytest.raises(ValueError, match="weight has shape"):
        kt.causal_conv1d(x, torch.randn(5, 4, dtype=F64))
