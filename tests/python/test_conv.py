"""kdacp.torch.causal_conv1d against torch.nn.functional.conv1d (conv_reference),
gradcheck, its errors, and CP over gloo worlds 2 and 4 (conv_workers)."""


import pytest
import torch

import kdacp.torch as kt
from conv_reference import causal_conv1d_ref
import conv_workers
from spawn_ranks import spawn


def make(b, t, d, w, dtype, bias, h0, cu, seed):
    gen = torch.Generator().manual_seed(seed)
    n = b if cu is None else len(cu) - 1
    x = torch.randn(b, t, d, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(d, w, generator=gen, dtype=torch.float64).to(dtype)
    bb = torch.randn(d, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    hh = torch.randn(n, d, w, generator=gen, dtype=torch.float64).to(dtype) if h0 else None
    return x, weight, bb, hh


def run(fn, x, weight, bias, h0, act, want_ht, cu, dy, dht):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None
              for t in (x, weight, bias, h0)]
    y, ht = fn(leaves[0], leaves[1], bias=leaves[2], activation=act, initial_state=leaves[3],
               output_final_state=want_ht, cu_seqlens=cu)
    loss = (y * dy).sum() + ((ht * dht).sum() if want_ht else 0)
    loss.backward()
    return [y, ht] + [None if t is None else t.grad for t in leaves]


def close(a, b, tol, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a.double() - b.double()).abs().max().item() / max(1.0, b.double().abs().max().item())
    assert err <= tol, (what, err)


CASES = [(w, act, bias, state, cu)
         for w in (1, 2, 4, 8)
         for act in (None, "silu", "swish")
         for bias in (False, True)
         for state in (False, True)
         for cu in (None, [0, 1, 4, 5, 13, 20])
         if (w + bias + state + (cu is None) + (act is None)) % 2 == 0 or w == 4]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_matches_torch_conv1d(dtype, tol):
    for i, (w, act, bias, state, cu) in enumerate(CASES):
        b = 1 if cu is not None else 2
        x, weight, bb, hh = make(b, 20, 5, w, dtype, bias, state, cu, seed=i)
        gen = torch.Generator().manual_seed(1000 + i)
        dy = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(dtype)
        n = b if cu is None else len(cu) - 1
        dht = torch.randn(n, 5, w, generator=gen, dtype=torch.float64).to(dtype)
        got = run(kt.causal_conv1d, x, weight, bb, hh, act, state, cu, dy, dht)
        ref = run(causal_conv1d_ref, x, weight, bb, hh, act, state, cu, dy, dht)
        for name, a, r in zip(("y", "final_state", "dx", "dweight", "dbias", "dinitial_state"),
                              got, ref):
            close(a, r, tol, (name, w, act, bias, state, cu))
        assert got[0].dtype == dtype


def test_gradcheck():
    for cu in (None, [0, 2, 3, 9]):
        b = 1 if cu else 2
        x, weight, bb, hh = make(b, 9, 3, 4, torch.float64, True, True, cu, seed=5)
        for act in (None, "silu"):
            def f(x_, w_, b_, h_):
                y, ht = kt.causal_conv1d(x_, w_, b_, None, h_, True, act, "triton", cu)
                return y, ht
            inputs = tuple(t.clone().requires_grad_(True) for t in (x, weight, bb, hh))
            assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8)


def test_final_state_follows_fla_convention():
    # Column j of the final state is the token W-j before the end; a sequence
    # shorter than W reaches into the initial state.
    x = torch.arange(1.0, 4.0, dtype=torch.float64).view(1, 3, 1)
    w = torch.ones(1, 4, dtype=torch.float64)
    h0 = torch.tensor([[[10.0, 20.0, 30.0, 40.0]]], dtype=torch.float64)
    y, ht = kt.causal_conv1d(x, w, initial_state=h0, output_final_state=True)
    assert ht.tolist() == [[[40.0, 1.0, 2.0, 3.0]]]
    # y[0] = h0[1] + h0[2] + h0[3] + x[0]: column 0 of h0 is not read.
    assert y[0, :, 0].tolist() == [20 + 30 + 40 + 1, 30 + 40 + 1 + 2, 40 + 1 + 2 + 3]
    _, none = kt.causal_conv1d(x, w)
    assert none is None


def test_errors():
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    w = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="W = 9, expected 1 <= W <= 8"):
        kt.causal_conv1d(x, torch.randn(3, 9, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight has dtype torch.float32 while x is torch.float64"):
        kt.causal_conv1d(x, w.float())
    with pytest.raises(ValueError, match="activation='relu'"):
        kt.causal_conv1d(x, w, activation="relu")
    with pytest.raises(ValueError, match=r"initial_state has shape \[2, 3, 3\], expected"):
        kt.causal_conv1d(x, w, initial_state=torch.zeros(2, 3, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="expected B = 1"):
        kt.causal_conv1d(x, w, cu_seqlens=[0, 2, 6])
    with pytest.raises(ValueError, match="cu_seqlens"):
        kt.causal_conv1d(x[:1], w, cu_seqlens=[0, 4, 5])
    with pytest.raises(ValueError, match="residual has shape"):
        kt.causal_conv1d(x, w, residual=x[:, 1:])
    with pytest.raises(ValueError, match="seq_idx"):
        kt.causal_conv1d(x, w, seq_idx=torch.zeros(1, 6, dtype=torch.int32))
    with pytest.raises(TypeError, match="unexpected keyword"):
        kt.causal_conv1d(x, w, no_such_thing=1)
    bad = x.clone()
    bad[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"x: element \[1,2,0\] is nan"):
        kt.causal_conv1d(bad, w)
    big = torch.full((1, 4, 1), 3e38, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="non-finite y"):
        kt.causal_conv1d(big, torch.ones(1, 2))
    y, _ = kt.causal_conv1d(x.requires_grad_(True), w, activation="silu")
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        g.sum().backward()


@pytest.mark.parametrize("world", [2, 4])
def test_cp_over_gloo(world):
    spawn(conv_workers.conv_worker, world, 120)
