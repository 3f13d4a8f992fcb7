"""kdacp.torch on one process: kda (group=None) against the independent
recurrence and torch.autograd.gradcheck, merge_affine_summaries against the
chain, input errors."""

import pytest
import torch

import kdacp
import kdacp.torch as kt
from kdacp import _common
from kda_oracle import make_inputs, naive_kda


def _leaves(tensors):
    return [t.clone().requires_grad_(True) if t is not None else None for t in tensors]


@pytest.mark.parametrize("with_states", [False, True])
def test_gradcheck_float64(with_states):
    q, k, v, g, beta, h0 = make_inputs(1, 12, 2, 4, 16, 16, torch.float64, seed=1,
                                       n_states=1 if with_states else None)
    args = _leaves([q, k, v, g, beta] + ([h0] if with_states else []))

    def f(*xs):
        o, ht = kt.kda(*xs[:5], initial_state=xs[5] if with_states else None,
                       output_final_state=with_states, threads=1)
        return (o, ht) if with_states else o

    assert torch.autograd.gradcheck(f, tuple(args), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("packed", [False, True])
def test_kda_matches_oracle(dtype, tol, packed):
    b = 1 if packed else 2
    cu = [0, 5, 13, 20] if packed else None
    n = 3 if packed else b
    inputs = make_inputs(b, 20, 2, 4, 16, 32, dtype, seed=2, n_states=n)
    mine = _leaves(inputs)
    ref = _leaves([x.double() for x in inputs])
    o, ht = kt.kda(*mine[:5], initial_state=mine[5], output_final_state=True,
                   cu_seqlens=torch.tensor(cu) if packed else None)
    o_ref, ht_ref = naive_kda(*ref[:5], initial_state=ref[5], cu_seqlens=cu)
    gen = torch.Generator().manual_seed(3)
    w_o = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    w_h = torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64)
    ((o.double() * w_o).sum() + (ht.double() * w_h).sum()).backward()
    ((o_ref * w_o).sum() + (ht_ref * w_h).sum()).backward()

    def rel(a, b_):
        return ((a.double() - b_).norm() / b_.norm()).item()

    assert o.dtype == dtype and ht.dtype == dtype
    assert rel(o, o_ref) <= tol
    assert rel(ht, ht_ref) <= tol
    for name, x, r in zip("q k v g beta h0".split(), mine, ref):
        assert x.grad is not None, name
        assert rel(x.grad, r.grad) <= tol, name


@pytest.mark.parametrize("packed", [False, True])
def test_kda_chunk_matches_recurrent(packed):
    """algorithm="chunk" (the default) against the recurrent algorithm in float64:
    o, ht and every gradient within 1e-10, T over several chunks of 64 with a
    partial last one (and packed sequences across chunk boundaries)."""
    b = 1 if packed else 2
    cu = [0, 70, 71, 140, 150] if packed else None
    n = 4 if packed else b
    inputs = make_inputs(b, 150, 2, 4, 16, 32, torch.float64, seed=6, n_states=n)
    gen = torch.Generator().manual_seed(7)
    results = {}
    for algorithm in ("recurrent", "chunk"):
        xs = _leaves(inputs)
        o, ht = kt.kda(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu,
                       algorithm=algorithm, threads=1)
        if algorithm == "recurrent":
            w_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
            w_h = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
        ((o * w_o).sum() + (ht * w_h).sum()).backward()
        results[algorithm] = [o.detach(), ht.detach()] + [x.grad for x in xs]

    names = "o ht dq dk dv dg dbeta dh0".split()
    differ = False
    for name, got, want in zip(names, results["chunk"], results["recurrent"]):
        assert got is not None and got.shape == want.shape, name
        err = ((got - want).norm() / want.norm()).item()
        assert err <= 1e-10, (name, err)
        differ = differ or not torch.equal(got, want)
    assert differ, "chunk gave the recurrent algorithm's bits: the keyword did not reach the layer"
    with pytest.raises(ValueError, match="algorithm"):
        kt.kda(*inputs[:5], algorithm="wy")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kda_keep_forward_changes_no_bit(dtype):
    """keep_forward=True (the chunk forward keeps its per-chunk states for the
    backward) gives the same bits as recomputing them: o, ht and every
    gradient, packed sequences across chunk boundaries; also a second forward
    whose backward runs after the first's."""
    cu = [0, 70, 71, 140, 150]
    inputs = make_inputs(1, 150, 2, 4, 16, 32, dtype, seed=8, n_states=4)
    gen = torch.Generator().manual_seed(9)
    w_o = w_h = None
    results = {}
    for keep in (False, True):
        xs = _leaves(inputs)
        o, ht = kt.kda(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu,
                       keep_forward=keep, threads=2)
        if w_o is None:
            w_o = torch.randn(o.shape, generator=gen, dtype=dtype)
            w_h = torch.randn(ht.shape, generator=gen, dtype=dtype)
        ys = _leaves(inputs)
        o2, ht2 = kt.kda(*ys[:5], initial_state=ys[5], output_final_state=True, cu_seqlens=cu,
                         keep_forward=keep, threads=2)
        ((o2 * w_o).sum() + (ht2 * w_h).sum()).backward()
        ((o * w_o).sum() + (ht * w_h).sum()).backward()
        results[keep] = [o.detach(), ht.detach()] + [x.grad for x in xs] + [y.grad for y in ys]
    for i, (got, want) in enumerate(zip(results[True], results[False])):
        assert torch.equal(got, want), i


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kda_retain_graph_second_backward_same_bits(dtype):
    """The first backward hands the forward cache back to the layer's pool; a
    second backward through the same graph (retain_graph=True) recomputes
    what it held, with the same bits: the gradients accumulate to exactly
    twice the first's (x + x is exact)."""
    cu = [0, 70, 71, 140, 150]
    inputs = make_inputs(1, 150, 2, 4, 16, 32, dtype, seed=10, n_states=4)
    xs = _leaves(inputs)
    o, ht = kt.kda(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu,
                   keep_forward=True, threads=2)
    gen = torch.Generator().manual_seed(11)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=dtype)).sum() + \
        (ht * torch.randn(ht.shape, generator=gen, dtype=dtype)).sum()
    loss.backward(retain_graph=True)
    first = [x.grad.clone() for x in xs]
    loss.backward()
    for name, x, g1 in zip("q k v g beta h0".split(), xs, first):
        assert torch.equal(x.grad, 2 * g1), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_kda_non_contiguous_gradient_same_bits(dtype):
    """A gradient of o that is not contiguous (o.sum()'s expanded ones, a
    transposed tensor) is copied into a buffer from kdacp's cache before the
    C++ backward reads it: the gradients are bitwise those of the same values
    passed contiguous, and a second call (reusing that buffer) agrees too."""
    inputs = make_inputs(1, 70, 2, 4, 16, 32, torch.float64, seed=13)
    inputs = [x.to(dtype) for x in inputs[:5]]
    gen = torch.Generator().manual_seed(14)
    weights = torch.randn(1, 4, 70, 32, generator=gen).to(dtype)

    def grads(backward):
        xs = _leaves(inputs)
        o, _ = kt.kda(*xs)
        backward(o)
        return [x.grad for x in xs]

    cases = [(lambda o: o.sum().backward(), lambda o: o.backward(torch.ones_like(o))),
             (lambda o: o.backward(weights.transpose(1, 2)),
              lambda o: o.backward(weights.transpose(1, 2).contiguous()))]
    for strided, dense in cases:
        for _ in range(2):
            for name, a, b in zip("q k v g beta".split(), grads(strided), grads(dense)):
                assert a.dtype == dtype and torch.equal(a, b), name


def test_kda_training_loop_reuses_one_forward_cache():
    """A training loop keeps the previous step's output (and so its graph)
    alive while the next forward runs; the layer still holds one forward
    cache, not one per graph alive: the backward lets its cache go."""
    from kdacp import _layer
    inputs = make_inputs(1, 200, 2, 4, 16, 32, torch.float32, seed=12)
    held = []
    for step in range(4):
        xs = _leaves(inputs)
        o, _ = kt.kda(*xs, keep_forward=True, threads=3)
        o.sum().backward()
        layers = [l for key, l in _layer._LAYERS.items() if key[0] == "single" and key[2] == 3]
        assert len(layers) == 1
        held.append(layers[0].forward_cache_bytes)
        prev = o  # noqa: F841 (the previous step's graph, alive during the next forward)
    assert held[0] > 0 and held == [held[0]] * 4, held


def test_kda_default_scale_and_no_final_state():
    q, k, v, g, beta, _ = make_inputs(1, 8, 1, 2, 16, 16, torch.float64, seed=4)
    o, ht = kt.kda(q, k, v, g, beta)
    assert ht is None
    o2, _ = kt.kda(q, k, v, g, beta, scale=0.25)
    o_ref, _ = naive_kda(q, k, v, g, beta, scale=0.25)
    assert torch.allclose(o2, o_ref, rtol=0, atol=1e-12)
    assert torch.allclose(o, o2 * (0.25 ** -1) * 16 ** -0.5, rtol=0, atol=1e-12)


def test_kda_bad_inputs():
    q, k, v, g, beta, _ = make_inputs(1, 8, 2, 4, 16, 16, torch.float64, seed=5)
    with pytest.raises(ValueError, match="dtype"):
        kt.kda(q, k.float(), v, g, beta)
    with pytest.raises(ValueError, match="g has shape"):
        kt.kda(q, k, v, g[..., :8], beta)
    with pytest.raises(ValueError, match="value heads"):
        kt.kda(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match="initial_state"):
        kt.kda(q, k, v, g, beta, initial_state=torch.zeros(2, 4, 16, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="zigzag"):
        kt.kda(q, k, v, g, beta, layout="zigzag")
    for bad in ("no", 1, None):
        with pytest.raises(ValueError, match="keep_forward"):
            kt.kda(q, k, v, g, beta, keep_forward=bad)
    with pytest.raises(ValueError, match="dtype"):
        kt.kda(q.to(torch.int64), k, v, g, beta)
    with pytest.raises(ValueError):
        kt.kda(q, k, v, g, beta, scale=-1.0)
    # The C++ checks reach Python as ValueError with kdacp's message.
    with pytest.raises(ValueError, match="cu_seqlens"):
        kt.kda(q, k, v, g, beta, cu_seqlens=[0, 3, 2, 8])
    with pytest.raises(TypeError, match="unknown exchange option"):
        kt.kda(q, k, v, g, beta, budget=3)


def _chain(states, matrices, rank, forward):
    p = states.shape[0]
    if forward:
        x = torch.zeros_like(states[0])
        for j in range(rank):
            x = matrices[j] @ x + states[j] if j else states[0].clone()
        return x
    x = torch.zeros_like(states[0])
    for j in range(p - 1, rank, -1):
        x = matrices[j].transpose(-1, -2) @ x + states[j] if j != p - 1 else states[j].clone()
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_affine_summaries(dtype):
    gen = torch.Generator().manual_seed(6)
    p, b, h, kd, vd = 5, 2, 3, 16, 32
    s = torch.randn(p, b, h, kd, vd, generator=gen).to(dtype)
    m = (0.3 * torch.randn(p, b, h, kd, kd, generator=gen)).to(dtype)
    for forward in (True, False):
        ref = kdacp._kdacp.inprocess_exchange("p2p", 1, _common._desc(s), _common._desc(m), forward)
        for r in range(p):
            got = kt.merge_affine_summaries(s, m, r, forward=forward)
            assert got.shape == (b, h, kd, vd) and got.dtype == dtype
            # The serial chain: bitwise the in-process p2p exchange ...
            assert torch.equal(got, torch.from_numpy(ref[r])), (forward, r)
            # ... and the chain's value, evaluated independently.
            want = _chain(s.double(), m.double(), r, forward)
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            assert (got.double() - want).abs().max() <= tol * max(1.0, want.abs().max())


def test_merge_views_and_errors():
    gen = torch.Generator().manual_seed(7)
    packed = torch.randn(3, 1, 2, 16, 48, generator=gen)  # [S | M] slots, as gathered
    s, m = packed[..., :32], packed[..., 32:]
    got = kt.merge_affine_summaries(s, m, 2)
    assert torch.equal(got, kt.merge_affine_summaries(s.contiguous(), m.contiguous(), 2))
    with pytest.raises(ValueError, match="rank"):
        kt.merge_affine_summaries(s, m, 3)
    with pytest.raises(ValueError, match="dtype"):
        kt.merge_affine_summaries(s, m.double(), 0)
    # Any head size in [1, 256]: V = 20 merges as its contiguous copy does.
    assert torch.equal(kt.merge_affine_summaries(s[..., :20], m, 1),
                       kt.merge_affine_summaries(s[..., :20].contiguous(), m, 1))
    with pytest.raises(ValueError, match=r"an integer in \[1, 256\]"):
        kt.merge_affine_summaries(torch.zeros(3, 1, 1, 257, 2), torch.zeros(3, 1, 1, 257, 257), 1)
    with pytest.raises(ValueError, match="5 dims"):
        kt.merge_affine_summaries(s[0], m[0], 0)


def test_exchange_needs_distributed():
    with pytest.raises(ValueError, match="init_process_group"):
        kt.build_kda_state_cp(protocol="p2p")
    with pytest.raises(ValueError, match="unknown protocol"):
        kt.build_kda_state_cp(protocol="ring")
