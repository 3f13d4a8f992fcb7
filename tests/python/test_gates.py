"""kdacp.torch.kda on strong gates (issue 18): constant g = -8 (float32's
chunk gradients were NaN), -50 (float64's) and -1e4, and ordinary gates
mixed with a few extreme channels, one process and both algorithms, against
the float64 torch transcription of the recurrence (autograd through it)."""

import pytest
import torch

import kdacp.torch as kt
from kda_oracle import make_inputs, naive_kda


def _leaves(tensors):
    return [t.clone().requires_grad_(True) for t in tensors]


def _gates(case, shape, gen):
    if case == "mix":
        g = torch.log(torch.empty(shape, dtype=torch.float64).uniform_(0.9, 1.0, generator=gen))
        g[..., 0] = -1e4
        g[..., 1] = -50.0
        g[..., 5] = -8.0
        g[..., 9] = -800.0
        return g
    return torch.full(shape, float(case), dtype=torch.float64)


@pytest.mark.parametrize("algorithm", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 5e-5)])
@pytest.mark.parametrize("case", ["-8", "-50", "-1e4", "mix"])
def test_strong_gates_match_oracle(case, dtype, tol, algorithm):
    cu = [0, 70, 71, 140, 150]
    inputs = make_inputs(1, 150, 1, 2, 16, 32, torch.float64, seed=7, n_states=len(cu) - 1)
    gen = torch.Generator().manual_seed(8)
    inputs[3] = _gates(case, inputs[3].shape, gen)
    mine = _leaves([x.to(dtype) for x in inputs])
    ref = _leaves(inputs)
    o, ht = kt.kda(*mine[:5], initial_state=mine[5], output_final_state=True,
                   cu_seqlens=torch.tensor(cu), algorithm=algorithm)
    o_ref, ht_ref = naive_kda(*ref[:5], initial_state=ref[5], cu_seqlens=cu)
    w_o = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    w_h = torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64)
    ((o.double() * w_o).sum() + (ht.double() * w_h).sum()).backward()
    ((o_ref * w_o).sum() + (ht_ref * w_h).sum()).backward()
    tiny = torch.finfo(dtype).tiny

    def rel(a, b_):
        assert torch.isfinite(a).all()
        return ((a.double() - b_).abs().max() / max(b_.abs().max().item(), tiny)).item()

    assert rel(o, o_ref) <= tol
    assert rel(ht, ht_ref) <= tol
    for name, x, r in zip("q k v g beta h0".split(), mine, ref):
        assert rel(x.grad, r.grad) <= tol, name
