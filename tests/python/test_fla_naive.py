"""flash-linear-attention's own naive references as ground truth (imported
from the installed package, never copied): fla.ops.kda.naive's
naive_recurrent_kda and naive_chunk_kda, and fla.ops.kda.gate's naive gates,
against kdacp.torch's chunk_kda and kda, each beside the FP64 recurrence of
the definition (kda_oracle). Each check reports both errors, kdacp's against
the naive reference and against FP64 (pytest -s prints them), and bounds
them. The naive functions compute in float32 whatever their inputs (so they
are compared with kdacp's float32 and float64 alike), have no cu_seqlens (a
packed batch is compared sequence by sequence) and take GVA (HV = 2·H).
Skipped where flash-linear-attention cannot be imported (Debian's torch)."""

import pytest
import torch

from kda_oracle import naive_kda

import kdacp.torch as kt

try:
    from fla.ops.kda import gate as fla_gate
    from fla.ops.kda import naive as fla_naive
    _MISSING = None
except Exception as e:  # ImportError, or an older torch it cannot run on
    fla_gate = fla_naive = None
    _MISSING = e


@pytest.fixture(autouse=True)
def _needs_fla():
    """Each test skips (the module is still collected, so a run without
    flash-linear-attention passes as skipped) where it cannot be imported."""
    if _MISSING is not None:
        pytest.skip(f"flash-linear-attention is not importable here: {_MISSING!r}")

H, HV, K, V = 1, 2, 16, 8


def make(t, seed, n=1):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    return dict(q=rnd(1, t, H, K), k=torch.nn.functional.normalize(rnd(1, t, H, K), dim=-1),
                v=rnd(1, t, HV, V), g=-0.3 * torch.rand(1, t, HV, K, generator=gen,
                                                        dtype=torch.float64),
                beta=torch.rand(1, t, HV, generator=gen, dtype=torch.float64),
                h0=0.5 * rnd(n, HV, K, V), A_log=0.3 * rnd(HV), dt_bias=0.5 * rnd(HV * K),
                raw_g=rnd(1, t, HV, K), raw_beta=2 * rnd(1, t, HV))


def rel(got, want):
    want = want.double()
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def report(what, got, naive, fp64, tol_fp64, tol_naive, naive_tol=2e-5):
    """kdacp's errors against fla's naive reference and against FP64, and the
    naive reference's own error against FP64 (it computes in float32)."""
    e_naive, e_fp64, naive_err = rel(got, naive), rel(got, fp64), rel(naive, fp64)
    print(f"{what}: kdacp vs fla naive {e_naive:.2e}, kdacp vs FP64 {e_fp64:.2e} "
          f"(fla naive vs FP64 {naive_err:.2e})")
    assert naive_err <= naive_tol, (what, "fla naive vs FP64", naive_err)
    assert e_fp64 <= tol_fp64, (what, "kdacp vs FP64", e_fp64)
    assert e_naive <= tol_naive, (what, "kdacp vs fla naive", e_naive)


TOLS = {torch.float64: (1e-10, 2e-5), torch.float32: (2e-5, 4e-5)}


def fp64(x, beta=None, g=None, cu=None):
    return naive_kda(x["q"], x["k"], x["v"], x["g"] if g is None else g,
                     x["beta"] if beta is None else beta, initial_state=x["h0"], cu_seqlens=cu)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("algorithm", ["chunk", "recurrent"])
def test_recurrent_and_chunk_references(dtype, algorithm):
    x = make(128, seed=1)  # naive_chunk_kda needs T a multiple of 64
    o_ref, ht_ref = fp64(x)
    args = [x[n].to(dtype) for n in ("q", "k", "v", "g", "beta")]
    o, ht = kt.chunk_kda(*args, initial_state=x["h0"].to(dtype), output_final_state=True,
                         algorithm=algorithm)
    for name, fn in (("naive_recurrent_kda", fla_naive.naive_recurrent_kda),
                     ("naive_chunk_kda", fla_naive.naive_chunk_kda)):
        o_n, ht_n = fn(*(x[n] for n in ("q", "k", "v", "g", "beta")),
                       initial_state=x["h0"].float(), output_final_state=True)
        what = f"{name} {algorithm} {dtype}"
        report(what + " o", o, o_n, o_ref, *TOLS[dtype])
        report(what + " ht", ht, ht_n, ht_ref, *TOLS[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradients_against_the_naive_recurrence(dtype):
    x = make(70, seed=2)
    names = ("q", "k", "v", "g", "beta", "h0")
    gen = torch.Generator().manual_seed(3)
    d_o = torch.randn(1, 70, HV, V, generator=gen, dtype=torch.float64)
    d_ht = torch.randn(1, HV, K, V, generator=gen, dtype=torch.float64)

    def grads(fn, cast):
        leaves = {n: x[n].detach().to(cast).clone().requires_grad_() for n in names}
        o, ht = fn(leaves)
        ((o * d_o.to(o.dtype)).sum() + (ht * d_ht.to(ht.dtype)).sum()).backward()
        return {n: leaves[n].grad for n in names}

    naive = grads(lambda z: fla_naive.naive_recurrent_kda(
        *(z[n] for n in names[:5]), initial_state=z["h0"], output_final_state=True),
        torch.float32)
    ref = grads(lambda z: naive_kda(*(z[n] for n in names[:5]), initial_state=z["h0"]),
                torch.float64)
    got = grads(lambda z: kt.chunk_kda(*(z[n] for n in names[:5]), initial_state=z["h0"],
                                       output_final_state=True), dtype)
    for n in names:
        report(f"d{n} {dtype}", got[n], naive[n], ref[n], *TOLS[dtype], naive_tol=5e-5)


def test_packed_sequences_against_per_sequence_calls():
    """cu_seqlens (which the naive functions lack): each sequence of the
    packed call equals the naive reference run on that sequence alone."""
    cu = [0, 30, 31, 100]
    x = make(100, seed=4, n=3)
    o_ref, ht_ref = fp64(x, cu=cu)
    for dtype in (torch.float64, torch.float32):
        o, ht = kt.chunk_kda(*(x[n].to(dtype) for n in ("q", "k", "v", "g", "beta")),
                             initial_state=x["h0"].to(dtype), output_final_state=True,
                             cu_seqlens=torch.tensor(cu))
        for i in range(3):
            a, e = cu[i], cu[i + 1]
            o_n, ht_n = fla_naive.naive_recurrent_kda(
                *(x[n][:, a:e] for n in ("q", "k", "v", "g", "beta")),
                initial_state=x["h0"][i:i + 1].float(), output_final_state=True)
            report(f"sequence {i} o {dtype}", o[:, a:e], o_n, o_ref[:, a:e], *TOLS[dtype])
            report(f"sequence {i} ht {dtype}", ht[i:i + 1], ht_n, ht_ref[i:i + 1], *TOLS[dtype])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gate_in_kernel_against_the_naive_gates(lower_bound):
    x = make(64, seed=5)
    if lower_bound is None:
        g_naive = fla_gate.naive_kda_gate(x["raw_g"], x["A_log"], x["dt_bias"])
        g_ref = -x["A_log"].exp()[:, None] * torch.nn.functional.softplus(
            x["raw_g"] + x["dt_bias"].view(HV, K))
    else:
        g_naive = fla_gate.naive_kda_lowerbound_gate(x["raw_g"], x["A_log"], x["dt_bias"],
                                                     lower_bound=lower_bound)
        g_ref = lower_bound * torch.sigmoid(x["A_log"].exp()[:, None] *
                                            (x["raw_g"] + x["dt_bias"].view(HV, K)))
    o_ref, ht_ref = fp64(x, g=g_ref)
    o_n, ht_n = fla_naive.naive_recurrent_kda(*(x[n] for n in ("q", "k", "v")), g_naive,
                                              x["beta"], initial_state=x["h0"].float(),
                                              output_final_state=True)
    extra = {} if lower_bound is None else dict(lower_bound=lower_bound, safe_gate=True)
    for dtype in (torch.float64, torch.float32):
        o, ht = kt.chunk_kda(*(x[n].to(dtype) for n in ("q", "k", "v", "raw_g", "beta")),
                             initial_state=x["h0"].to(dtype), output_final_state=True,
                             use_gate_in_kernel=True, A_log=x["A_log"].to(dtype),
                             dt_bias=x["dt_bias"].to(dtype), **extra)
        report(f"gate lb={lower_bound} o {dtype}", o, o_n, o_ref, *TOLS[dtype])
        report(f"gate lb={lower_bound} ht {dtype}", ht, ht_n, ht_ref, *TOLS[dtype])


def test_allow_neg_eigval_against_the_naive_recurrence():
    """beta = 2·sigmoid(raw) in [0, 2]: the naive recurrence takes any beta."""
    x = make(96, seed=6)
    beta = 2 * torch.sigmoid(x["raw_beta"])
    assert beta.max() > 1.5
    o_ref, ht_ref = fp64(x, beta=beta)
    o_n, ht_n = fla_naive.naive_recurrent_kda(*(x[n] for n in ("q", "k", "v", "g")), beta,
                                              initial_state=x["h0"].float(),
                                              output_final_state=True)
    for dtype in (torch.float64, torch.float32):
        for algorithm in ("chunk", "recurrent"):
            o, ht = kt.chunk_kda(*(x[n].to(dtype) for n in ("q", "k", "v", "g", "raw_beta")),
                                 initial_state=x["h0"].to(dtype), output_final_state=True,
                                 use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                 algorithm=algorithm)
            report(f"neg eigval {algorithm} o {dtype}", o, o_n, o_ref, *TOLS[dtype])
            report(f"neg eigval {algorithm} ht {dtype}", ht, ht_n, ht_ref, *TOLS[dtype])
