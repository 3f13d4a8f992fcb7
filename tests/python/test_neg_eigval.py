"""allow_neg_eigval (flash-linear-attention's flag): beta in [0, 2], so that
I - beta k k^T may have eigenvalues down to -1. kdacp's chunk and recurrent
algorithms against the FP64 recurrence of the definition (kda_oracle, its
gradients by autograd), strong gates included; chunk_kda's 2·sigmoid
transform; the CP group and the deterministic mode (gloo, world 2); and
head sizes that are not multiples of 16 under CP."""

import pytest
import torch

import kdacp.torch as kt
from kda_oracle import make_inputs, naive_kda
from spawn_ranks import spawn
import neg_eigval_workers

NAMES = ("q", "k", "v", "g", "beta", "h0")


def wide_inputs(t, hv, kd, vd, seed, strong):
    """float64 leaves: unit k, beta in [0, 2] with both ends present; strong:
    one key channel decays by e^-60 per token (the chunk kernels' exact
    path for strong gates)."""
    q, k, v, g, _, h0 = make_inputs(1, t, 1, hv, kd, vd, torch.float64, seed, n_states=2)
    gen = torch.Generator().manual_seed(seed + 1)
    beta = 2 * torch.rand(1, t, hv, generator=gen, dtype=torch.float64)
    beta.view(-1)[:4] = torch.tensor([2.0, 0.0, 2.0, 1.0])
    if strong:
        g[..., 1] = -60.0
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)


def outputs_and_grads(fn, x, d_o, d_ht, dtype):
    leaves = {n: x[n].detach().to(dtype).clone().requires_grad_() for n in NAMES}
    o, ht = fn(leaves)
    ((o * d_o.to(dtype)).sum() + (ht * d_ht.to(dtype)).sum()).backward()
    out = {"o": o.detach(), "ht": ht.detach()}
    out.update({"d" + n: leaves[n].grad for n in NAMES})
    return out


def rel_err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def test_beta_domain_is_checked_in_the_users_terms():
    x = wide_inputs(8, 2, 4, 3, seed=1, strong=False)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match=r"beta in \[0, 1\]"):
        kt.kda(*args)
    kt.kda(*args, allow_neg_eigval=True)
    over = x["beta"].clone()
    over[0, 3, 1] = 2.0 + 1e-12
    with pytest.raises(ValueError, match=r"beta: element \[0,3,1\] is 2.000000000001, expected beta in \[0, 2\] \(allow_neg_eigval=True\)"):
        kt.kda(*args[:4], over, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="allow_neg_eigval=1, expected True or False"):
        kt.kda(*args, allow_neg_eigval=1)
    # chunk_kda: the flag only with the in-kernel sigmoid, as flash-linear-attention; a
    # ready beta in [0, 2] is taken without it (fla's kernels check no range, its own
    # test passes 2·sigmoid ready), one outside [0, 2] is named.
    with pytest.raises(ValueError, match="needs use_beta_sigmoid_in_kernel=True"):
        kt.chunk_kda(*args, allow_neg_eigval=True)
    o, _ = kt.chunk_kda(*args)
    want, _ = naive_kda(*args)
    assert rel_err(o, want) <= 1e-10
    with pytest.raises(ValueError, match=r"element \[0,3,1\] is 2.000000000001"):
        kt.chunk_kda(*args[:4], over)


@pytest.mark.parametrize("algorithm", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
@pytest.mark.parametrize("strong", [False, True])
def test_matches_the_fp64_recurrence(algorithm, dtype, tol, strong):
    x = wide_inputs(150, 2, 16, 8, seed=3, strong=strong)  # GVA: H = 1, HV = 2
    cu = [0, 70, 150]
    gen = torch.Generator().manual_seed(4)
    d_o = torch.randn(1, 150, 2, 8, generator=gen, dtype=torch.float64)
    d_ht = torch.randn(2, 2, 16, 8, generator=gen, dtype=torch.float64)
    want = outputs_and_grads(
        lambda z: naive_kda(z["q"], z["k"], z["v"], z["g"], z["beta"], initial_state=z["h0"],
                            cu_seqlens=cu), x, d_o, d_ht, torch.float64)
    for det in (False, True):
        got = outputs_and_grads(
            lambda z: kt.kda(z["q"], z["k"], z["v"], z["g"], z["beta"], initial_state=z["h0"],
                             output_final_state=True, cu_seqlens=cu, algorithm=algorithm,
                             deterministic=det, allow_neg_eigval=True), x, d_o, d_ht, dtype)
        for name, w in want.items():
            assert got[name].dtype == dtype, name
            err = rel_err(got[name], w)
            assert err <= tol, (name, det, err)
    # beta > 1 matters: the same inputs with beta clipped to 1 differ.
    clipped = dict(x, beta=x["beta"].clamp(max=1))
    o_clip, _ = naive_kda(*(clipped[n] for n in NAMES[:5]), initial_state=x["h0"], cu_seqlens=cu)
    assert rel_err(o_clip, want["o"]) > 1e-3


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
def test_chunk_kda_scales_the_sigmoid_by_two(dtype, tol):
    x = wide_inputs(100, 2, 16, 16, seed=5, strong=False)
    gen = torch.Generator().manual_seed(6)
    x["beta"] = 3 * torch.randn(1, 100, 2, generator=gen, dtype=torch.float64)  # raw
    d_o = torch.randn(1, 100, 2, 16, generator=gen, dtype=torch.float64)
    d_ht = torch.randn(2, 2, 16, 16, generator=gen, dtype=torch.float64)
    cu = [0, 37, 100]
    want = outputs_and_grads(
        lambda z: naive_kda(z["q"], z["k"], z["v"], z["g"], 2 * torch.sigmoid(z["beta"]),
                            initial_state=z["h0"], cu_seqlens=cu), x, d_o, d_ht, torch.float64)
    for algorithm in ("chunk", "recurrent"):
        got = outputs_and_grads(
            lambda z: kt.chunk_kda(z["q"], z["k"], z["v"], z["g"], z["beta"],
                                   initial_state=z["h0"], output_final_state=True,
                                   use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                   cu_seqlens=cu, algorithm=algorithm), x, d_o, d_ht, dtype)
        for name, w in want.items():
            err = rel_err(got[name], w)
            assert err <= tol, (algorithm, name, err)
    # Without the flag chunk_kda's sigmoid is the plain one (a different result).
    plain, _ = kt.chunk_kda(*(x[n] for n in NAMES[:5]), initial_state=x["h0"],
                            use_beta_sigmoid_in_kernel=True, cu_seqlens=cu)
    assert rel_err(plain, want["o"]) > 1e-3


def test_sigmoid_transform_is_twice_the_plain_one():
    from kdacp import _chunk
    x = torch.tensor([-800.0, -30.0, -1.0, 0.0, 0.5, 30.0, 800.0], dtype=torch.float64,
                     requires_grad=True)
    for dtype in (torch.float64, torch.float32):
        plain = _chunk._SigmoidFunction.apply(dtype, x.to(dtype))
        wide = _chunk._SigmoidFunction.apply(dtype, x.to(dtype), True)
        assert torch.equal(wide, 2 * plain)  # x2 is exact
        assert wide.max().item() == 2.0 and wide.min().item() == 0.0
        (d_plain,) = torch.autograd.grad(plain.sum(), x)
        (d_wide,) = torch.autograd.grad(wide.sum(), x)
        assert torch.equal(d_wide, 2 * d_plain)
        ref = 2 * torch.sigmoid(x.detach()) * torch.sigmoid(-x.detach())  # no cancellation
        assert torch.allclose(d_wide.double(), ref, rtol=1e-6, atol=0)


def test_cp_context_takes_it_or_says_it_does_not():
    """With a cp_context the flag reaches the layer's agreement; a CpContext
    that does not take it raises NotImplementedError naming it."""
    from kdacp import _context
    x = wide_inputs(12, 2, 4, 3, seed=8, strong=False)
    ctx = kt.build_cp_context([0, 5, 12], kt.SINGLE_PROCESS)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    if "allow_neg_eigval" in _context._CALL_FIELDS:
        o, _ = kt.kda(*args, cp_context=ctx, allow_neg_eigval=True)
        o2, _ = kt.kda(*args, cu_seqlens=[0, 5, 12], allow_neg_eigval=True)
        assert torch.equal(o, o2)
    else:
        with pytest.raises(NotImplementedError, match="allow_neg_eigval"):
            kt.kda(*args, cp_context=ctx, allow_neg_eigval=True)
        with pytest.raises(NotImplementedError, match="allow_neg_eigval"):
            kt.chunk_kda(*args, cp_context=ctx, use_beta_sigmoid_in_kernel=True,
                         allow_neg_eigval=True)


def test_over_gloo():
    spawn(neg_eigval_workers.neg_eigval_worker, 2, 240)


def test_head_dims_over_gloo():
    spawn(neg_eigval_workers.head_dims_worker, 2, 240)
