"""bfloat16 and float16 inputs, flash-linear-attention's training dtypes:
kdacp computes in float32 (states, accumulation, exchange) and stores the
results and gradients in the inputs' dtypes (states in float32).

Against the float64 reference on the very same 16-bit values, kdacp's error
is set beside the error of the reference itself run the way
flash-linear-attention's naive reference runs a 16-bit call (inputs cast to
float32, results cast back to the 16-bit dtype): both are printed, and
kdacp's may exceed the reference's by at most a quarter, plus 1e-4 of the
tensor's largest value (gradients summed over many tokens round there)."""

import pytest
import torch

import kdacp.torch as kt

import chunk_kda_workers
from conv_reference import causal_conv1d_ref
from spawn_ranks import spawn
from test_chunk_kda import NAMES, inputs, ref_chunk_kda

HALF = [torch.bfloat16, torch.float16]
FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
STATE_LIKE = ("A_log", "dt_bias", "h0")  # float32 parameters and states by default


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


def compare(got, ref16, ref64, label):
    """Asserts kdacp's error against float64 is within the 16-bit reference's."""
    report = {}
    for name in ref64:
        mine, theirs = err(got[name], ref64[name]), err(ref16[name], ref64[name])
        report[name] = (mine, theirs)
        top = ref64[name].abs().max().item()
        assert mine <= 1.25 * theirs + 1e-4 * top, (label, name, mine, theirs, top)
    print(label, {k: f"kdacp {a:.2e} / reference {b:.2e}" for k, (a, b) in report.items()})


@pytest.mark.parametrize("param_dtype", ["float32", "same"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_chunk_kda_in_16_bit(dtype, param_dtype):
    cu = [0, 23, 70, 81]
    x = inputs(1, 81, 2, 4, 8, 6, 3, seed=1)
    pdt = torch.float32 if param_dtype == "float32" else dtype
    # The 16-bit values are the inputs; every computation starts from them.
    x = {n: x[n].to(torch.float32 if n == "h0" else pdt if n in STATE_LIKE else dtype) for n in NAMES}
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(1, 81, 4, 6, generator=gen, dtype=torch.float64)
    dht = torch.randn(3, 4, 8, 6, generator=gen, dtype=torch.float64)

    def run(fn, cast, out_dtype):
        leaves = {n: x[n].detach().clone().requires_grad_() for n in NAMES}
        args = {n: cast(leaves[n]) for n in NAMES}
        o, ht = fn(args)
        o = o.to(out_dtype)
        ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
        return {"o": o, "ht": ht, **{"d" + n: leaves[n].grad for n in NAMES}}

    def reference(a):
        return ref_chunk_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], 8 ** -0.5, a["h0"], cu,
                             True, True, True, a["A_log"], a["dt_bias"], None)

    mine = run(lambda a: kt.chunk_kda(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                      initial_state=a["h0"], output_final_state=True,
                                      cu_seqlens=cu, A_log=a["A_log"], dt_bias=a["dt_bias"],
                                      **FLAGS), lambda t: t, dtype)
    ref16 = run(reference, lambda t: t.float(), dtype)
    ref64 = run(reference, lambda t: t.double(), torch.float64)
    assert mine["o"].dtype == dtype and mine["ht"].dtype == torch.float32
    for n in NAMES:
        assert mine["d" + n].dtype == x[n].dtype, n
    compare(mine, ref16, ref64, f"chunk_kda {dtype} params {param_dtype}")


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_kda_in_16_bit_both_algorithms(dtype):
    x = inputs(2, 70, 1, 2, 16, 8, 2, seed=3, raw=False)
    # Unit keys keep the recurrence contractive (I - beta k k^T), as l2norm does.
    x["k"] = x["k"] / x["k"].norm(dim=-1, keepdim=True)
    q, k, v = (x[n].to(dtype) for n in ("q", "k", "v"))
    g, beta = x["g"].to(dtype), torch.sigmoid(x["beta"]).to(dtype)
    h0 = x["h0"].float()
    outs = {}
    for algorithm in ("recurrent", "chunk"):
        o, ht = kt.kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                       algorithm=algorithm)
        assert o.dtype == dtype and ht.dtype == torch.float32
        outs[algorithm] = o
    ro, _ = ref_chunk_kda(q.double(), k.double(), v.double(), g.double(), beta.double(), 16 ** -0.5,
                          h0.double(), None, False, False, False, None, None, None)
    r16, _ = ref_chunk_kda(q.float(), k.float(), v.float(), g.float(), beta.float(), 16 ** -0.5,
                           h0, None, False, False, False, None, None, None)
    for algorithm, o in outs.items():
        compare({"o": o}, {"o": r16.to(dtype)}, {"o": ro}, f"kda {algorithm} {dtype}")


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_causal_conv1d_in_16_bit(dtype):
    gen = torch.Generator().manual_seed(9)
    b, t, d, w = 1, 40, 6, 4
    cu = [0, 3, 25, 40]
    x = {"x": torch.randn(b, t, d, generator=gen), "weight": torch.randn(d, w, generator=gen),
         "bias": torch.randn(d, generator=gen), "initial_state": torch.randn(3, d, w, generator=gen)}
    x = {n: v.to(dtype) for n, v in x.items()}
    dy = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
    dht = torch.randn(3, d, w, generator=gen, dtype=torch.float64)

    def run(fn, cast, out_dtype):
        leaves = {n: v.detach().clone().requires_grad_() for n, v in x.items()}
        a = {n: cast(v) for n, v in leaves.items()}
        y, ht = fn(a["x"], a["weight"], a["bias"], activation="silu", initial_state=a["initial_state"],
                   output_final_state=True, cu_seqlens=cu)
        y, ht = y.to(out_dtype), ht.to(out_dtype)
        ((y.double() * dy).sum() + (ht.double() * dht).sum()).backward()
        return {"y": y, "ht": ht, **{"d" + n: v.grad for n, v in leaves.items()}}

    mine = run(kt.causal_conv1d, lambda v: v, dtype)
    assert mine["y"].dtype == dtype and mine["ht"].dtype == dtype
    for n in x:
        assert mine["d" + n].dtype == dtype, n
    compare(mine, run(causal_conv1d_ref, lambda v: v.float(), dtype),
            run(causal_conv1d_ref, lambda v: v.double(), torch.float64), f"causal_conv1d {dtype}")


def test_float16_overflow_is_an_error_not_inf():
    x = inputs(1, 8, 1, 1, 4, 4, 1, seed=2, raw=False)
    q, k = x["q"].half(), x["k"].half()
    v = torch.full((1, 8, 1, 4), 60000.0, dtype=torch.float16)  # o sums past 65504
    g, beta = x["g"].half(), torch.ones(1, 8, 1, dtype=torch.float16)
    q = torch.full_like(q, 8.0)
    k = torch.full_like(k, 0.5)
    with pytest.raises(ValueError, match=r"kdacp.torch.kda: o element \[0,\d+,0,\d\] is .* beyond "
                                         r"float16's range"):
        kt.kda(q, k, v, g, beta, scale=1.0)
    # float64 is all or nothing; float32 and the 16-bit types mix.
    with pytest.raises(ValueError, match="q has dtype torch.float16 while k is torch.float64"):
        kt.kda(q, k.double(), v, g, beta)
    with pytest.raises(ValueError, match="initial_state has dtype torch.float16, expected torch.float32"):
        kt.kda(q, k, v, g, beta, initial_state=torch.zeros(1, 1, 4, 4, dtype=torch.float16))


def test_mixed_16_bit_and_float32_is_the_float32_call_on_the_same_values():
    # A 16-bit tensor is widened exactly, so a call mixing bf16, fp16 and
    # float32 is bit for bit the float32 call on the widened values.
    x = inputs(1, 70, 1, 2, 16, 8, 1, seed=4, raw=False)
    x["k"] = x["k"] / x["k"].norm(dim=-1, keepdim=True)
    q, k = x["q"].bfloat16(), x["k"].half()
    v, g, beta = x["v"].float(), x["g"].bfloat16(), torch.sigmoid(x["beta"]).half()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    wide = [t.float().requires_grad_() for t in (q, k, v, g, beta)]
    o1, _ = kt.kda(*leaves)
    o2, _ = kt.kda(*wide)
    assert o1.dtype == torch.float32 and torch.equal(o1, o2)
    o1.sum().backward()
    o2.sum().backward()
    for a, b in zip(leaves, wide):
        assert a.grad.dtype == a.dtype
        assert torch.equal(a.grad, b.grad.to(a.dtype))


def test_chunk_kda_output_takes_q_dtype():
    # flash-linear-attention's chunk_kda returns o as q's dtype (kt.kda: v's);
    # the values are the float32 call's, rounded once.
    x = inputs(1, 40, 1, 2, 16, 8, 1, seed=5, raw=False)
    x["k"] = x["k"] / x["k"].norm(dim=-1, keepdim=True)
    beta = torch.sigmoid(x["beta"]).float()
    q, k, v, g = (x[n].float() for n in ("q", "k", "v", "g"))
    wide, _ = kt.chunk_kda(q, k, v, g, beta)
    for qd, vd in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                   (torch.float16, torch.float16)):
        leaves = [q.detach().to(qd).requires_grad_(), k.detach().requires_grad_(),
                  v.detach().to(vd).requires_grad_(), g, beta]
        o, _ = kt.chunk_kda(*leaves)
        assert o.dtype == qd, (qd, vd, o.dtype)
        ref, _ = kt.chunk_kda(*(t.float() for t in leaves))
        assert torch.equal(o, ref.to(qd))
        o.float().sum().backward()
        assert leaves[0].grad.dtype == qd and leaves[2].grad.dtype == vd


@pytest.mark.parametrize("algorithm", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_16_bit_inputs_give_the_widened_float32_calls_bits(dtype, algorithm):
    # The chunk kernels read 16-bit q, k, v, g, beta in place and widen each
    # value as they load it (the recurrent ones take a widened copy): either
    # way the float32 call on the widened values, bit for bit, o and the
    # gradients then narrowed once, the final state in float32.
    cu = [0, 23, 70, 150]
    x = inputs(1, 150, 2, 4, 24, 20, 3, seed=6, raw=False)
    x["k"] = x["k"] / x["k"].norm(dim=-1, keepdim=True)
    x["beta"] = torch.sigmoid(x["beta"])
    half = [x[n].to(dtype) for n in ("q", "k", "v", "g", "beta")]
    h0 = x["h0"].float()
    gen = torch.Generator().manual_seed(8)
    do = torch.randn(1, 150, 4, 20, generator=gen).to(dtype).float()  # d_o as the 16-bit call gets it
    dht = torch.randn(3, 4, 24, 20, generator=gen)
    outs = []
    for cast in (lambda t: t, lambda t: t.float()):
        leaves = [cast(t).detach().requires_grad_() for t in half]
        o, ht = kt.kda(*leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                       algorithm=algorithm)
        ((o.float() * do).sum() + (ht * dht).sum()).backward()
        outs.append([o.to(dtype), ht] + [t.grad.to(dtype) for t in leaves])
    assert outs[0][0].dtype == dtype and outs[0][2].dtype == dtype
    for name, a, b in zip(["o", "ht", "dq", "dk", "dv", "dg", "dbeta"], *outs):
        assert torch.equal(a.view(torch.int16) if a.dtype == dtype else a,
                           b.view(torch.int16) if b.dtype == dtype else b), name


def test_context_over_gloo_in_bf16():
    spawn(chunk_kda_workers.half_worker, 2, 120)
