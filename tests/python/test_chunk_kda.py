"""kdacp.torch.chunk_kda (flash-linear-attention's signature) and its C++
in-kernel transforms against an independent pure-torch reference written
here in flash-linear-attention's conventions (naive_kda_gate,
naive_kda_lowerbound_gate, l2norm with eps inside the sqrt, sigmoid,
naive_recurrent_kda), gradients by autograd; plus the CP context over gloo."""


import pytest
import torch
import torch.nn.functional as F

import kdacp.torch as kt
from kdacp import _chunk

import chunk_kda_workers
from spawn_ranks import spawn


# -- the reference -------------------------------------------------------------

def ref_gate(raw, a_log, dt_bias, lower_bound):
    hv, kd = raw.shape[-2:]
    x = raw if dt_bias is None else raw + dt_bias.view(hv, kd)
    scale = None if a_log is None else a_log.view(hv, 1).exp()
    if lower_bound is None:
        sp = F.softplus(x)
        return -(sp if scale is None else scale * sp)
    return lower_bound * torch.sigmoid(x if scale is None else scale * x)


def ref_l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def ref_recurrent(q, k, v, g, beta, scale, h0, cu):
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    rep = hv // h
    spans = [(r, 0, t, r) for r in range(b)] if cu is None else \
        [(0, cu[n], cu[n + 1], n) for n in range(len(cu) - 1)]
    rows = [[None] * t for _ in range(b)]
    finals = []
    for row, start, end, n in spans:
        s = q.new_zeros(hv, kd, vd) if h0 is None else h0[n]
        for i in range(start, end):
            kk = k[row, i].repeat_interleave(rep, 0)
            qq = q[row, i].repeat_interleave(rep, 0)
            s = s * g[row, i].exp()[:, :, None]
            err = v[row, i] - torch.einsum("hk,hkv->hv", kk, s)
            s = s + beta[row, i][:, None, None] * kk[:, :, None] * err[:, None, :]
            rows[row][i] = scale * torch.einsum("hkv,hk->hv", s, qq)
        finals.append(s)
    return torch.stack([torch.stack(r) for r in rows]), torch.stack(finals)


def ref_chunk_kda(q, k, v, g, beta, scale, h0, cu, l2, gate, sig, a_log, dt_bias, lower_bound):
    if gate:
        g = ref_gate(g, a_log, dt_bias, lower_bound)
    if l2:
        q, k = ref_l2norm(q), ref_l2norm(k)
    if sig:
        beta = torch.sigmoid(beta)
    return ref_recurrent(q, k, v, g, beta, scale, h0, cu)


def inputs(b, t, h, hv, kd, vd, n_states, seed, raw=True):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q, k, v = rnd(b, t, h, kd), rnd(b, t, h, kd), rnd(b, t, hv, vd)
    g = rnd(b, t, hv, kd) if raw else -0.5 * torch.rand(b, t, hv, kd, generator=gen,
                                                           dtype=torch.float64)
    beta = rnd(b, t, hv)
    a_log = 0.3 * rnd(hv)
    dt_bias = 0.5 * rnd(hv * kd)
    h0 = 0.5 * rnd(n_states, hv, kd, vd)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=a_log, dt_bias=dt_bias, h0=h0)


NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")


def run_both(x, dtype, cu, flags, scale=None, **kw):
    """(kdacp's o, ht, grads), (the reference's) for one loss on o and ht."""
    gen = torch.Generator().manual_seed(5)
    if not flags["use_beta_sigmoid_in_kernel"]:
        x = dict(x, beta=torch.sigmoid(x["beta"]))
    mine = {n: x[n].detach().clone().to(dtype).requires_grad_() for n in NAMES}
    ref = {n: x[n].detach().clone().requires_grad_() for n in NAMES}
    gate = flags["use_gate_in_kernel"]
    lb = flags.get("lower_bound")
    o, ht = kt.chunk_kda(mine["q"], mine["k"], mine["v"], mine["g"], mine["beta"], scale=scale,
                         initial_state=mine["h0"], output_final_state=True, cu_seqlens=cu,
                         A_log=mine["A_log"] if gate else None,
                         dt_bias=mine["dt_bias"] if gate else None, **flags, **kw)
    kd = x["q"].shape[-1]
    ro, rht = ref_chunk_kda(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"],
                            kd ** -0.5 if scale is None else scale, ref["h0"], cu,
                            flags["use_qk_l2norm_in_kernel"], gate,
                            flags["use_beta_sigmoid_in_kernel"], ref["A_log"], ref["dt_bias"], lb)
    do = torch.randn(ro.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(rht.shape, generator=gen, dtype=torch.float64)
    ((o * do.to(dtype)).sum() + (ht * dht.to(dtype)).sum()).backward()
    ((ro * do).sum() + (rht * dht).sum()).backward()
    return (o, ht, mine), (ro, rht, ref)


def worst(a, b):
    return (a.double() - b.double()).abs().max().item()


FLAG_SETS = [
    dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True),
    dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
         safe_gate=True, lower_bound=-5.0),
    dict(use_qk_l2norm_in_kernel=False, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=False,
         lower_bound=-2.0),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 5e-5)])
@pytest.mark.parametrize("flags", FLAG_SETS, ids=["softplus", "safe_lowerbound", "lowerbound"])
def test_matches_reference(dtype, tol, flags):
    # Packed sequences with GVA (HV = 2H); the chunk algorithm crosses a chunk edge.
    cu = [0, 23, 70, 81]
    x = inputs(1, 81, 2, 4, 8, 6, 3, seed=1)
    (o, ht, mine), (ro, rht, ref) = run_both(x, dtype, cu, flags)
    errs = {"o": worst(o, ro), "ht": worst(ht, rht)}
    for n in NAMES:
        assert mine[n].grad is not None, n
        assert mine[n].grad.dtype == dtype, n
        errs["d" + n] = worst(mine[n].grad, ref[n].grad)
    assert max(errs.values()) <= tol, errs


def test_plain_log_gate_and_batch_rows():
    # No flag: chunk_kda is kda (the ready log gate), B > 1 without cu_seqlens.
    x = inputs(2, 20, 1, 2, 4, 5, 2, seed=2, raw=False)
    flags = dict(use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                 use_beta_sigmoid_in_kernel=True)
    gen = {n: x[n] for n in NAMES}
    o, ht = kt.chunk_kda(gen["q"], gen["k"], gen["v"], gen["g"], gen["beta"], initial_state=gen["h0"],
                         output_final_state=True, use_beta_sigmoid_in_kernel=True)
    ro, rht = ref_chunk_kda(gen["q"], gen["k"], gen["v"], gen["g"], gen["beta"], 0.5, gen["h0"],
                            None, False, False, True, None, None, None)
    assert worst(o, ro) <= 1e-10 and worst(ht, rht) <= 1e-10
    o2, none = kt.chunk_kda(gen["q"], gen["k"], gen["v"], gen["g"], torch.sigmoid(gen["beta"]),
                            algorithm="recurrent", **{k_: v_ for k_, v_ in flags.items()
                                                      if k_ != "use_beta_sigmoid_in_kernel"})
    assert none is None
    o3, _ = kt.kda(gen["q"], gen["k"], gen["v"], gen["g"], torch.sigmoid(gen["beta"]),
                   algorithm="recurrent")
    assert torch.equal(o2, o3)  # one code path


def test_gate_without_a_log_or_bias():
    x = inputs(1, 9, 1, 1, 4, 3, 1, seed=3)
    for lb in (None, -3.0):
        for with_a, with_b in ((False, False), (True, False), (False, True)):
            raw = x["g"].clone().requires_grad_()
            a = x["A_log"].clone().requires_grad_() if with_a else None
            b = x["dt_bias"].clone().requires_grad_() if with_b else None
            g = _chunk._GateFunction.apply(lb, raw.dtype, raw, a, b)
            r_raw = x["g"].clone().requires_grad_()
            r_a = x["A_log"].clone().requires_grad_() if with_a else None
            r_b = x["dt_bias"].clone().requires_grad_() if with_b else None
            r = ref_gate(r_raw, r_a, r_b, lb)
            assert worst(g, r) <= 1e-14
            w = torch.randn(g.shape, dtype=torch.float64)
            (g * w).sum().backward()
            (r * w).sum().backward()
            assert worst(raw.grad, r_raw.grad) <= 1e-13
            for m, rr in ((a, r_a), (b, r_b)):
                if m is not None:
                    assert worst(m.grad, rr.grad) <= 1e-12


def test_gradcheck():
    x = inputs(1, 6, 1, 2, 3, 2, 2, seed=4)
    for flags in FLAG_SETS:
        y = x if flags["use_beta_sigmoid_in_kernel"] else dict(x, beta=torch.sigmoid(x["beta"]))
        args = [y[n].clone().requires_grad_() for n in NAMES]
        def f(q, k, v, g, beta, a_log, dt_bias, h0, flags=flags):
            return kt.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                cu_seqlens=[0, 2, 6], A_log=a_log, dt_bias=dt_bias, **flags)
        assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7)


def test_extreme_gate_inputs_stay_finite():
    for dtype, big in ((torch.float32, 1e30), (torch.float64, 1e300)):
        raw = torch.tensor([[[[big, -big, 0.0, 3.0]]]], dtype=dtype).repeat(1, 3, 1, 1)
        bias = torch.tensor([big, -big, -big, big], dtype=dtype)
        for a_log, lb in ((torch.tensor([0.0], dtype=dtype), -5.0),
                          (torch.tensor([30.0], dtype=dtype), -1.0),
                          (torch.tensor([-700.0 if dtype == torch.float64 else -80.0],
                                        dtype=dtype), -5.0),
                          (None, -2.0)):
            r = raw.clone().requires_grad_()
            b = bias.clone().requires_grad_()
            a = None if a_log is None else a_log.clone().requires_grad_()
            g = _chunk._GateFunction.apply(lb, dtype, r, a, b)
            assert torch.isfinite(g).all() and (g <= 0).all() and (g >= lb).all()
            g.sum().backward()
            for t in (r, b) + (() if a is None else (a,)):
                assert torch.isfinite(t.grad).all()
        # softplus gate: huge negative arguments give 0 (finite), moderate ones stay exact
        r = torch.tensor([[[[-big, -1e4, 0.0, 50.0]]]], dtype=dtype, requires_grad=True)
        g = _chunk._GateFunction.apply(None, dtype, r, None, None)
        assert torch.isfinite(g).all()
        assert g[0, 0, 0, 3].item() == pytest.approx(-50.0, rel=1e-12)
        g.sum().backward()
        assert torch.isfinite(r.grad).all()
        # and a gate whose exact value is beyond the dtype names the element
        with pytest.raises(ValueError, match="beyond"):
            _chunk._GateFunction.apply(None, dtype, torch.full((1, 1, 1, 1), big, dtype=dtype),
                                       torch.tensor([60.0 if dtype == torch.float32 else 700.0],
                                                    dtype=dtype), None)


def test_extreme_l2norm_and_sigmoid_stay_finite():
    for dtype, big in ((torch.float32, 3e38), (torch.float64, 1e308)):
        x = torch.tensor([[[[big, -big, big, 1.0], [0.0, 0.0, 0.0, 0.0],
                            [1e-30, 0.0, 0.0, 0.0]]]], dtype=dtype, requires_grad=True)
        y = _chunk._L2NormFunction.apply(dtype, x)
        assert torch.isfinite(y).all()
        assert y[0, 0, 0, 0].item() == pytest.approx(3 ** -0.5, rel=1e-6)
        y.sum().backward()
        assert torch.isfinite(x.grad).all()
        b = torch.tensor([[[big, -big, 0.0]]], dtype=dtype, requires_grad=True)
        s = _chunk._SigmoidFunction.apply(dtype, b)
        assert s.tolist() == [[[1.0, 0.0, 0.5]]]
        s.sum().backward()
        assert torch.isfinite(b.grad).all() and b.grad[0, 0, 2].item() == 0.25


def test_full_layer_with_extreme_raw_gates():
    x = inputs(1, 70, 1, 1, 4, 3, 1, seed=6)
    raw = x["g"].clone()
    raw[0, ::3] = 1e30
    raw[0, 1::3] = -1e30
    for lb in (-5.0, None):
        r = raw.clone().requires_grad_()
        q = x["q"].clone().requires_grad_()
        o, ht = kt.chunk_kda(q, x["k"], x["v"], r, x["beta"], output_final_state=True,
                             use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, lower_bound=lb,
                             A_log=torch.zeros(1, dtype=torch.float64))
        assert torch.isfinite(o).all() and torch.isfinite(ht).all()
        (o.sum() + ht.sum()).backward()
        assert torch.isfinite(r.grad).all() and torch.isfinite(q.grad).all()


def test_transforms_are_differentiable_once():
    x = inputs(1, 5, 1, 1, 4, 3, 1, seed=9)
    for flags in FLAG_SETS:
        leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
        beta = leaves[4] if flags["use_beta_sigmoid_in_kernel"] else torch.sigmoid(leaves[4])
        a_log = None if "lower_bound" in flags else x["A_log"].clone().requires_grad_()
        o, _ = kt.chunk_kda(*leaves[:4], beta, A_log=a_log, **flags)
        grads = torch.autograd.grad(o.sum(), leaves, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiable once"):
            sum(g_.sum() for g_ in grads).backward()


def test_unsupported_arguments_raise():
    x = inputs(1, 4, 1, 1, 4, 3, 1, seed=7, raw=False)
    args = (x["q"], x["k"], x["v"], x["g"], torch.sigmoid(x["beta"]))
    for kw in (dict(chunk_indices=torch.tensor([0, 0])),):
        name = next(iter(kw))
        with pytest.raises(NotImplementedError, match=name):
            kt.chunk_kda(*args, **kw)
    with pytest.raises(ValueError, match="lower_bound"):
        kt.chunk_kda(*args, use_gate_in_kernel=True, safe_gate=True)
    with pytest.raises(ValueError, match="lower_bound"):
        kt.chunk_kda(*args, use_gate_in_kernel=True, lower_bound=0.5)
    with pytest.raises(ValueError, match="A_log has 2 elements"):
        kt.chunk_kda(*args, use_gate_in_kernel=True, A_log=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="dt_bias has 3 elements"):
        kt.chunk_kda(*args, use_gate_in_kernel=True, A_log=torch.zeros(1, dtype=torch.float64),
                     dt_bias=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="needs A_log unless lower_bound"):
        kt.chunk_kda(*args, use_gate_in_kernel=True)  # flash-linear-attention's condition
    with pytest.raises(ValueError, match="use_gate_in_kernel=False"):
        kt.chunk_kda(*args, A_log=torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        kt.chunk_kda(*args, cu_seqlens=[0, 4], cu_seqlens_cpu=[0, 3, 4])
    with pytest.raises(ValueError, match="g"):  # non-finite raw gate: the C++ message
        bad = x["g"].clone()
        bad[0, 1, 0, 2] = float("nan")
        kt.chunk_kda(x["q"], x["k"], x["v"], bad, x["beta"], use_gate_in_kernel=True,
                     lower_bound=-5.0)


def test_single_process_context():
    x = inputs(1, 12, 1, 1, 4, 3, 2, seed=8, raw=False)
    ctx = kt.build_cp_context([0, 5, 12], kt.SINGLE_PROCESS, conv1d_kernel_size=4)
    assert (ctx.rank, ctx.world_size, ctx.backend, ctx.layout) == (0, 1, None, "contiguous")
    assert ctx.global_cu_seqlens == [0, 5, 12] and ctx.conv1d_kernel_size == 4
    assert ctx.global_layout.local_tokens(0) == 12
    beta = torch.sigmoid(x["beta"])
    o, _ = kt.chunk_kda(x["q"], x["k"], x["v"], x["g"], beta, cp_context=ctx)
    o2, _ = kt.chunk_kda(x["q"], x["k"], x["v"], x["g"], beta, cu_seqlens=[0, 5, 12])
    assert torch.equal(o, o2)
    o3, _ = kt.kda(x["q"], x["k"], x["v"], x["g"], beta, cp_context=ctx)
    assert torch.equal(o, o3)
    with pytest.raises(ValueError, match="the context holds them"):
        kt.kda(x["q"], x["k"], x["v"], x["g"], beta, cp_context=ctx, protocol="p2p")
    with pytest.raises(ValueError, match="split"):
        kt.build_cp_context(None, kt.SINGLE_PROCESS)
    # A call's boundaries must be the context's (its layout was built from them).
    with pytest.raises(ValueError, match=r"cu_seqlens \[0, 6, 12\] differs from its cp_context's"):
        kt.chunk_kda(x["q"], x["k"], x["v"], x["g"], beta, cu_seqlens=[0, 6, 12], cp_context=ctx)
    with pytest.raises(ValueError, match="expected strictly increasing boundaries"):
        kt.build_cp_context([0, 5, 5, 12], kt.SINGLE_PROCESS)
    with pytest.raises(ValueError, match="cu_seqlens is on the meta device"):
        kt.chunk_kda(x["q"], x["k"], x["v"], x["g"], beta,
                     cu_seqlens=torch.tensor([0, 5, 12], device="meta"))


# -- over gloo -----------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_context_over_gloo(world):
    spawn(chunk_kda_workers.context_worker, world, 120)


def test_ulysses_over_gloo():
    spawn(chunk_kda_workers.ulysses_worker, 4, 120)
