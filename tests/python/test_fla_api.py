"""flash-linear-attention 0.6's KDA API on kdacp (docs/fla.md): chunk_kda's
chunk_size, state_v_first / transpose_state_layout, return_intermediate_states,
use_graph / max_num_seqs; fused_recurrent_kda and fused_recurrent_kda_fwd;
the gate ops; causal_conv1d's seq_idx and [B,T,...] inputs. Each against an
FP64 recurrence written here from the definition (and flash-linear-attention's
naive references where it is installed), its signatures against
flash-linear-attention's, its errors and warnings."""

import inspect

import pytest
import torch
import torch.nn.functional as F

import kdacp.torch as kt
from spawn_ranks import spawn

F64 = torch.float64


def fla(module):
    return pytest.importorskip(module)


def reference(q, k, v, g, beta, scale=None, h0=None, cu=None, chunk=None):
    """o, final states, the state entering every chunk of `chunk` tokens of
    every sequence, and the state after every token: S_t = (I - b k kᵀ)
    Diag(e^g) S + k (b ⊙ v)ᵀ, o_t = scale S_tᵀ q_t; beta [.., HV] or one per
    value column [.., HV, V]."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    grp = hv // h
    scale = kd ** -0.5 if scale is None else scale
    spans = [(r, 0, t, r) for r in range(b)] if cu is None else \
        [(0, cu[n], cu[n + 1], n) for n in range(len(cu) - 1)]
    o = torch.zeros(b, t, hv, vd, dtype=F64)
    finals, chunks, after = [], [], {}
    for row, lo, hi, n in spans:
        s = torch.zeros(hv, kd, vd, dtype=F64) if h0 is None else h0[n].to(F64)
        for i in range(lo, hi):
            if chunk and (i - lo) % chunk == 0:
                chunks.append(s)
            kk = k[row, i].to(F64).repeat_interleave(grp, 0)
            qq = q[row, i].to(F64).repeat_interleave(grp, 0)
            s = s * g[row, i].to(F64).exp().unsqueeze(-1)
            bb = beta[row, i].to(F64)
            bb = bb[:, None] if bb.dim() == 1 else bb
            u = bb * (v[row, i].to(F64) - torch.einsum("hk,hkv->hv", kk, s))
            s = s + kk[:, :, None] * u[:, None, :]
            o[row, i] = scale * torch.einsum("hkv,hk->hv", s, qq)
            after[(row, i)] = s
        finals.append(s)
    return o, torch.stack(finals), chunks, after


def inputs(b, t, h, hv, kd, vd, seed, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, kd, generator=gen, dtype=F64)
    k = F.normalize(torch.randn(b, t, h, kd, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(b, t, hv, vd, generator=gen, dtype=F64)
    g = -0.4 * torch.rand(b, t, hv, kd, generator=gen, dtype=F64)
    beta = 0.9 * torch.rand(b, t, hv, generator=gen, dtype=F64) + 0.05
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def close(a, b, tol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a.to(F64) - b.to(F64)).abs().max().item() <= tol


# --- signatures ------------------------------------------------------------

PAIRS = [("chunk_kda", "fla.ops.kda", "chunk_kda"),
         ("fused_recurrent_kda", "fla.ops.kda", "fused_recurrent_kda"),
         ("fused_recurrent_kda_fwd", "fla.ops.kda.fused_recurrent", "fused_recurrent_kda_fwd"),
         ("fused_kda_gate", "fla.ops.kda.gate", "fused_kda_gate"),
         ("kda_gate_fwd", "fla.ops.kda.gate", "kda_gate_fwd"),
         ("kda_gate_bwd", "fla.ops.kda.gate", "kda_gate_bwd"),
         ("kda_gate_chunk_cumsum", "fla.ops.kda.gate", "kda_gate_chunk_cumsum"),
         ("causal_conv1d", "fla.modules.convolution", "causal_conv1d")]


def positional(fn):
    """(name, default) of the parameters before *args / keyword-only / **kwargs."""
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.kind == p.POSITIONAL_OR_KEYWORD]


@pytest.mark.parametrize("ours,module,theirs", PAIRS)
def test_signatures_equal_fla(ours, module, theirs):
    fn = getattr(fla(module), theirs)
    mine = inspect.signature(getattr(kt, ours)).parameters.values()
    assert positional(getattr(kt, ours)) == positional(fn)
    has_kwargs = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    assert has_kwargs == any(p.kind == p.VAR_KEYWORD for p in mine)


def test_signatures_hold_fla_names_without_fla():
    names = [n for n, _ in positional(kt.chunk_kda)]
    assert names[-5:] == ["cu_seqlens", "cu_seqlens_cpu", "cp_context", "use_graph",
                          "max_num_seqs"]
    assert [n for n, _ in positional(kt.fused_recurrent_kda_fwd)][-9:] == [
        "cu_seqlens", "ssm_state_indices", "num_accepted_tokens", "use_qk_l2norm_in_kernel",
        "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "lower_bound",
        "out"]
    assert dict(positional(kt.fused_recurrent_kda_fwd))["inplace_final_state"] is True
    assert dict(positional(kt.kda_gate_fwd))["output_dtype"] is torch.float32


# --- chunk_kda -------------------------------------------------------------

def test_state_v_first_and_its_deprecated_name():
    q, k, v, g, beta = inputs(1, 70, 1, 2, 6, 4, seed=1)
    h0 = torch.randn(2, 2, 6, 4, dtype=F64)
    cu = [0, 30, 70]
    leaf = h0.clone().requires_grad_()
    o, ht = kt.chunk_kda(q, k, v, g, beta, initial_state=leaf, output_final_state=True,
                         cu_seqlens=cu)
    (o.sum() + (ht ** 2).sum()).backward()
    ro, rf, _, _ = reference(q, k, v, g, beta, h0=h0, cu=cu)
    close(o, ro)
    close(ht, rf)
    leaf_t = h0.transpose(-1, -2).contiguous().requires_grad_()
    o2, ht2 = kt.chunk_kda(q, k, v, g, beta, initial_state=leaf_t, output_final_state=True,
                           cu_seqlens=cu, state_v_first=True)
    assert list(ht2.shape) == [2, 2, 4, 6]
    (o2.sum() + (ht2 ** 2).sum()).backward()
    close(o2, o, 0)
    close(ht2, ht.transpose(-1, -2), 0)
    close(leaf_t.grad, leaf.grad.transpose(-1, -2), 0)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout") as rec:
        o3, ht3 = kt.chunk_kda(q, k, v, g, beta, initial_state=leaf_t.detach(),
                               output_final_state=True, cu_seqlens=cu,
                               transpose_state_layout=True)
    assert rec[0].filename == __file__  # points at the caller, as flash-linear-attention's
    close(ht3, ht2, 0)
    with pytest.raises(ValueError, match="transpose_state_layout"):
        kt.chunk_kda(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True)
    with pytest.warns(DeprecationWarning):
        kt.fused_recurrent_kda(q, k, v, g, beta, transpose_state_layout=False)
    with pytest.raises(ValueError, match="state_v_first=1"):
        kt.chunk_kda(q, k, v, g, beta, state_v_first=1)


def test_chunk_size():
    q, k, v, g, beta = inputs(2, 50, 1, 1, 4, 3, seed=2)
    o64, _ = kt.chunk_kda(q, k, v, g, beta)
    o32, _ = kt.chunk_kda(q, k, v, g, beta, chunk_size=32)
    close(o32, o64, 0)  # kdacp's tiling does not depend on it
    for bad in (16, 128, True, 64.5):
        with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64"):
            kt.chunk_kda(q, k, v, g, beta, chunk_size=bad)


@pytest.mark.parametrize("chunk", [32, 64])
def test_return_intermediate_states(chunk):
    q, k, v, g, beta = inputs(2, 100, 1, 2, 5, 3, seed=3)
    h0 = torch.randn(2, 2, 5, 3, dtype=F64)
    with torch.inference_mode():
        o, ht, h = kt.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                return_intermediate_states=True, chunk_size=chunk)
    ro, rf, chunks, _ = reference(q, k, v, g, beta, h0=h0, chunk=chunk)
    nt = -(-100 // chunk)
    assert list(h.shape) == [2, nt, 2, 5, 3] and h.dtype == k.dtype
    close(h.reshape(-1, 2, 5, 3), torch.stack(chunks))
    close(o, ro)
    close(ht, rf)
    o2, ht2 = kt.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    close(o, o2, 0)


def test_return_intermediate_states_varlen_layouts_and_dtype():
    q, k, v, g, beta = inputs(1, 140, 2, 4, 4, 3, seed=4)
    cu = [0, 64, 64, 65, 140]
    h0 = torch.randn(4, 4, 4, 3, dtype=F64)
    _, _, chunks, _ = reference(q, k, v, g, beta, h0=h0, cu=cu, chunk=64)
    with torch.inference_mode():
        _, _, h = kt.chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                               return_intermediate_states=True)
        _, _, hv = kt.chunk_kda(q, k, v, g, beta, initial_state=h0.transpose(-1, -2),
                                cu_seqlens=cu, return_intermediate_states=True,
                                state_v_first=True)
        qb, kb, vb, gb, bb = (x.to(torch.bfloat16) for x in (q, k, v, g, beta))
        _, _, hb = kt.chunk_kda(qb, kb, vb, gb, bb, initial_state=h0.float(), cu_seqlens=cu,
                                return_intermediate_states=True)
    assert list(h.shape) == [1, 4, 4, 4, 3]  # 1 + 0 + 1 + 2 chunks
    close(h[0], torch.stack(chunks))
    close(hv, h.transpose(-1, -2), 0)
    assert hb.dtype == torch.bfloat16  # h is stored as k, as flash-linear-attention's
    _, _, chunks_b, _ = reference(qb, kb, vb, gb, bb, h0=h0.float(), cu=cu, chunk=64)
    close(hb[0], torch.stack(chunks_b), 0.05)


@pytest.mark.parametrize("world", [2, 3])
def test_return_intermediate_states_under_cp(world):
    """h with a cp_context over gloo: each rank's pieces, chunked from their
    local starts, a continuing piece from the state the earlier ranks leave,
    against the FP64 recurrence (contiguous off-grid cuts with h0, zigzag,
    a sequence per batch row)."""
    import intermediate_workers
    spawn(intermediate_workers.intermediate_worker, world, 180)


def test_return_intermediate_states_errors():
    q, k, v, g, beta = inputs(1, 10, 1, 1, 4, 3, seed=5)
    with pytest.raises(AssertionError, match="inference mode"):
        kt.chunk_kda(q, k, v, g, beta, return_intermediate_states=True)
    with pytest.raises(ValueError, match="inference mode"):  # kdacp's errors are ValueErrors too
        kt.chunk_kda(q, k, v, g, beta, return_intermediate_states=True)
    with torch.inference_mode(), pytest.raises(AssertionError, match="disable_recompute"):
        kt.chunk_kda(q, k, v, g, beta, return_intermediate_states=True, disable_recompute=True)


def test_use_graph_with_a_cp_context():
    # A context holds real sequences: use_graph changes nothing on the CPU,
    # and max_num_seqs must be its local sequence count.
    q, k, v, g, beta = inputs(1, 50, 1, 2, 4, 3, seed=8)
    ctx = kt.build_cp_context([0, 20, 50], kt.SINGLE_PROCESS)
    o1, _ = kt.chunk_kda(q, k, v, g, beta, cp_context=ctx)
    o2, _ = kt.chunk_kda(q, k, v, g, beta, cp_context=ctx, use_graph=True, max_num_seqs=2)
    assert torch.equal(o1, o2)
    with pytest.raises(AssertionError, match="holds 2 local sequences, expected max_num_seqs = 3"):
        kt.chunk_kda(q, k, v, g, beta, cp_context=ctx, use_graph=True, max_num_seqs=3)


def test_zero_length_sequences_and_use_graph():
    q, k, v, g, beta = inputs(1, 90, 1, 2, 4, 3, seed=6)
    h0 = torch.randn(5, 2, 4, 3, dtype=F64)
    cu = [0, 20, 20, 70, 70, 70]  # padded to 5 sequences, tokens 70..89 unused
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = kt.chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                         cu_seqlens=torch.tensor(cu), use_graph=True, max_num_seqs=5)
    ro, rf, _, _ = reference(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], h0=h0,
                             cu=cu)
    close(o[:, :70], ro[:, :70])
    assert o[:, 70:].abs().max() == 0
    close(ht, rf)
    close(ht[[1, 3, 4]], h0[[1, 3, 4]], 0)  # an empty sequence keeps its initial state
    (o.sum() + ht.sum()).backward()
    assert leaves[5].grad[[1, 3, 4]].eq(1).all()
    assert leaves[0].grad[:, 70:].abs().max() == 0
    with torch.inference_mode():
        _, _, h = kt.chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                               use_graph=True, return_intermediate_states=True)
    assert h.shape[1] == -(-90 // 64) + 5 - 1  # flash-linear-attention's fixed graph shape
    assert h[0, 3:].abs().max() == 0
    with pytest.raises(AssertionError, match="max_num_seqs"):
        kt.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, use_graph=True, max_num_seqs=8)
    with pytest.raises(ValueError, match="max_num_seqs"):
        kt.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, use_graph=True, max_num_seqs=0)
    with pytest.raises(ValueError):  # without use_graph cu_seqlens must cover every token
        kt.chunk_kda(q, k, v, g, beta, cu_seqlens=cu)
    # zero-length sequences in the middle without use_graph
    mid = [0, 30, 30, 90]
    o2, ht2 = kt.chunk_kda(q, k, v, g, beta, initial_state=h0[:3], output_final_state=True,
                           cu_seqlens=mid)
    ro2, rf2, _, _ = reference(q, k, v, g, beta, h0=h0[:3], cu=mid)
    close(o2, ro2)
    close(ht2, rf2)


# --- fused_recurrent_kda ---------------------------------------------------

def gate_ref(raw, a_log, dt_bias, lower_bound):
    hv, kd = raw.shape[-2:]
    x = raw.to(F64) + (0 if dt_bias is None else dt_bias.to(F64).view(hv, kd))
    a = torch.zeros(hv, dtype=F64) if a_log is None else a_log.to(F64)
    if lower_bound is None:
        return -a.exp()[:, None] * F.softplus(x)
    return lower_bound * torch.sigmoid(a.exp()[:, None] * x)


@pytest.mark.parametrize("headwise", [False, True])
@pytest.mark.parametrize("lower_bound", [None, -3.0])
def test_fused_recurrent_kda_against_reference(headwise, lower_bound):
    gen = torch.Generator().manual_seed(7)
    q, k, v, g, beta = inputs(1, 23, 1, 2, 4, 3, seed=7)
    raw_g = torch.randn(1, 23, 2, 4, generator=gen, dtype=F64)
    raw_b = torch.randn(1, 23, 2, 3, generator=gen, dtype=F64) if headwise else \
        torch.randn(1, 23, 2, generator=gen, dtype=F64)
    a_log = 0.3 * torch.randn(2, generator=gen, dtype=F64)
    dt_bias = 0.2 * torch.randn(8, generator=gen, dtype=F64)
    h0 = torch.randn(2, 2, 4, 3, dtype=F64)
    cu = [0, 9, 23]
    leaves = [x.clone().requires_grad_() for x in (q, k, v, raw_g, raw_b, a_log, dt_bias, h0)]
    o, ht = kt.fused_recurrent_kda(*leaves[:5], A_log=leaves[5], dt_bias=leaves[6],
                                   initial_state=leaves[7], output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound,
                                   cu_seqlens=cu)
    (o * torch.arange(o.numel(), dtype=F64).view(o.shape).cos()).sum().add(ht.sum()).backward()
    refs = [x.clone().requires_grad_() for x in (q, k, v, raw_g, raw_b, a_log, dt_bias, h0)]
    rq, rk = (x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for x in refs[:2])
    ro, rf, _, _ = reference(rq, rk, refs[2], gate_ref(refs[3], refs[5], refs[6], lower_bound),
                             torch.sigmoid(refs[4]), h0=refs[7], cu=cu)
    close(o, ro)
    close(ht, rf)
    (ro * torch.arange(ro.numel(), dtype=F64).view(ro.shape).cos()).sum().add(rf.sum()).backward()
    for mine, theirs in zip(leaves, refs):
        close(mine.grad, theirs.grad, 1e-9)


def test_fused_recurrent_kda_equals_fla_naive():
    naive = fla("fla.ops.kda.naive").naive_recurrent_kda
    q, k, v, g, beta = inputs(2, 17, 1, 2, 4, 3, seed=8, dtype=torch.float32)
    h0 = torch.randn(2, 2, 4, 3)
    o, ht = kt.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ro, rf = naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    close(o, ro, 1e-5)
    close(ht, rf, 1e-5)


def test_fused_recurrent_kda_errors():
    q, k, v, g, beta = inputs(1, 5, 1, 1, 4, 3, seed=9)
    with pytest.raises(ValueError, match="lower_bound"):
        kt.fused_recurrent_kda(q, k, v, g, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="use_beta_sigmoid_in_kernel"):
        kt.fused_recurrent_kda(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="beta has shape"):
        kt.fused_recurrent_kda(q, k, v, g, beta[..., None].expand(1, 5, 1, 2))
    with pytest.raises(NotImplementedError, match="no_such"):
        kt.fused_recurrent_kda(q, k, v, g, beta, no_such=1)


def test_all_sequences_empty():
    q, k, v, g, beta = inputs(1, 8, 1, 2, 4, 3, seed=10)
    h0 = torch.randn(2, 2, 4, 3, dtype=F64)
    o, ht = kt.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                         cu_seqlens=[0, 0, 0], use_graph=True, use_gate_in_kernel=True,
                         use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                         A_log=torch.zeros(2, dtype=F64))
    assert o.abs().max() == 0 and o.shape == v.shape
    close(ht, h0, 0)
    with torch.inference_mode():
        _, _, h = kt.chunk_kda(q, k, v, g, beta, cu_seqlens=[0, 0, 0], use_graph=True,
                               return_intermediate_states=True)
    assert list(h.shape) == [1, 2, 2, 4, 3] and h.abs().max() == 0
    with pytest.raises(ValueError, match="initial_state has 1 sequences"):
        kt.chunk_kda(q, k, v, g, beta, initial_state=h0[:1], cu_seqlens=[0, 0, 8])
