"""kdacp.torch fails like the CLI (issue 18): bad values, bad options, bad
groups and a double backward raise a clear error naming what is wrong; a
forward or backward that overflows raises RuntimeError naming the tensor.
One process here; the same over gloo in test_distributed.py (trust_worker)."""

import datetime
import math
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist

import kdacp
import kdacp.torch as kt
from kdacp import _layer
from kda_oracle import make_inputs


def _inputs(dtype=torch.float64):
    return list(make_inputs(1, 8, 2, 4, 16, 16, dtype, seed=5, n_states=1))


def _poke(t, index, value):
    t = t.clone()
    t[index] = value
    return t


# The messages are kdacp/finite.hpp's, the CLI's for q.npy, g.npy, beta.npy:
# "<name>: element <index> is <exact value>, expected <rule>".
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("which,index,value,message", [
    (0, (0, 3, 1, 2), math.nan, "q: element [0,3,1,2] is nan, expected finite values"),
    (1, (0, 7, 0, 15), -math.inf, "k: element [0,7,0,15] is -inf, expected finite values"),
    (2, (0, 0, 3, 0), math.inf, "v: element [0,0,3,0] is inf, expected finite values"),
    (3, (0, 1, 0, 2), 0.5, "g: element [0,1,0,2] is 0.5, expected g <= 0 (the log of a decay in (0, 1])"),
    (3, (0, 1, 0, 2), math.nan, "g: element [0,1,0,2] is nan, expected finite values"),
    (4, (0, 2, 1), 1.5, "beta: element [0,2,1] is 1.5, expected beta in [0, 1]"),
    (4, (0, 2, 1), -0.25, "beta: element [0,2,1] is -0.25, expected beta in [0, 1]"),
    (5, (0, 3, 1, 2), math.inf, "initial_state: element [0,3,1,2] is inf, expected finite values"),
])
def test_rejects_bad_values_like_the_cli(dtype, which, index, value, message):
    xs = [x.to(dtype) for x in _inputs()]
    xs[which] = _poke(xs[which], index, value)
    with pytest.raises(ValueError) as e:
        kt.kda(*xs[:5], initial_state=xs[5], threads=1)
    assert str(e.value) == message


def test_value_printed_exactly():
    q, k, v, g, beta, _ = _inputs(torch.float32)
    with pytest.raises(ValueError) as e:
        kt.kda(q, k, v, g, _poke(beta, (0, 0, 0), 1.0000001), threads=1)
    assert str(e.value) == "beta: element [0,0,0] is 1.0000001, expected beta in [0, 1]"
    with pytest.raises(ValueError) as e:
        kt.kda(q, k, v, _poke(g, (0, 0, 0, 0), 1e-30), beta, threads=1)
    assert "is 1e-30, expected g <= 0" in str(e.value)
    # A non-contiguous input is checked as the tensor it is (its own indices).
    gt = g.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match=r"g: element \[0,5,1,3\] is 0.25"):
        kt.kda(q, k, v, _poke(gt, (0, 5, 1, 3), 0.25), beta, threads=1)


def test_same_validator_as_the_cli():
    """kdacp._kdacp.check_tensor is kdacp/finite.hpp (require_finite,
    require_kda_gate, require_kda_beta), the functions the CLI runs on its
    .npy inputs: the same text for the same element."""
    beta = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
    with pytest.raises(ValueError) as e:
        kdacp._kdacp.check_tensor(beta.data_ptr(), [1, 2], "float64", "dir/beta.npy", "beta")
    assert str(e.value) == "dir/beta.npy: element [0,1] is 2, expected beta in [0, 1]"
    with pytest.raises(ValueError, match="rule"):
        kdacp._kdacp.check_tensor(beta.data_ptr(), [1, 2], "float64", "x", "positive")


@pytest.mark.parametrize("cu", [[0, 2.5, 8], [0, 4.0, 8], np.array([0, 3, 8], dtype=np.float64),
                                [0, True, 8], "08", 8, [0, -3, 8], [0, 2 ** 70, 8]])
def test_cu_seqlens_must_be_integers(cu):
    q, k, v, g, beta, _ = _inputs()
    with pytest.raises(ValueError, match="cu_seqlens"):
        kt.kda(q, k, v, g, beta, cu_seqlens=cu, threads=1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kt.kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 3.0, 8.0]), threads=1)


def test_cu_seqlens_integer_types_accepted():
    q, k, v, g, beta, _ = _inputs()
    ref = {n: kt.kda(q, k, v, g, beta, cu_seqlens=[0, n, 8], threads=1)[0] for n in (3, 4)}
    for cu, n in ((np.array([0, 3, 8]), 3), ([np.int32(0), np.int64(3), 8], 3),
                  (torch.tensor([0, 3, 8]), 3), ((0, 3, 8), 3), (range(0, 9, 4), 4)):
        o, _ = kt.kda(q, k, v, g, beta, cu_seqlens=cu, threads=1)
        assert torch.equal(o, ref[n]), cu
    # A 0-d tensor scale is a number.
    assert torch.equal(kt.kda(q, k, v, g, beta, scale=torch.tensor(0.25), threads=1)[0],
                       kt.kda(q, k, v, g, beta, scale=0.25, threads=1)[0])


@pytest.mark.parametrize("option,value", [
    ("threads", 30000), ("threads", 1025), ("threads", -1), ("threads", 2.0), ("threads", "4"),
    ("threads", True), ("threads", 2 ** 70),
    ("segments", -1), ("segments", 1.5), ("segments", 2 ** 70), ("segments", 17),
    ("memory_budget_bytes", "-5MiB"), ("memory_budget_bytes", "infGiB"),
    ("memory_budget_bytes", 2 ** 70), ("memory_budget_bytes", -5),
    ("memory_budget_bytes", "nanMiB"), ("memory_budget_bytes", 1.5), ("memory_budget_bytes", True),
    ("timeout", -1), ("timeout", 0), ("timeout", math.nan), ("timeout", math.inf),
    ("timeout", 2 ** 2000), ("timeout", True), ("timeout", "soon"), ("timeout", 1e9),
    ("allow_reassociation", "no"), ("check_ranks", 1), ("calibration", 3),
    ("expected_shape", (1, 2, -16, 16)), ("expected_cuts", "yes"), ("expected_cuts", [True, 2]),
    ("expected_cuts", 1),
], ids=lambda x: str(x)[:24])
def test_options_out_of_range_are_value_errors(option, value):
    """ValueError naming the option (never TypeError, OverflowError, or 30,000
    threads started), from the CLI's parsers, before anything runs."""
    q, k, v, g, beta, _ = _inputs()
    with pytest.raises(ValueError, match=option):
        kt.kda(q, k, v, g, beta, **{option: value})
    with pytest.raises(ValueError, match=option):
        kt.build_kda_state_cp(None, "p2p", **{option: value})


def test_options_in_range_accepted():
    q, k, v, g, beta, _ = _inputs()
    ref, _ = kt.kda(q, k, v, g, beta, threads=1)
    for opts in ({"threads": 0}, {"threads": 1024}, {"segments": 16},
                 {"memory_budget_bytes": "64MiB"}, {"memory_budget_bytes": 1 << 20},
                 {"memory_budget_bytes": 0}, {"memory_budget_bytes": None},
                 {"timeout": 0.5}, {"timeout": 86400}, {"timeout": "2.5"}):
        o, _ = kt.kda(q, k, v, g, beta, **opts)
        assert torch.equal(o, ref), opts
    # The byte sizes are the C++ parser's (kdacp/units.hpp), the CLI's --memory-budget.
    assert kdacp._kdacp.parse_bytes("1.5KiB", "memory_budget_bytes") == 1536
    with pytest.raises(ValueError, match="memory_budget_bytes is '-5MiB'"):
        kdacp._kdacp.parse_bytes("-5MiB", "memory_budget_bytes")


def test_bench_threads_read_by_the_cpp_parser():
    """python3 -m kdacp.bench --threads: the C++ integer parser's text and
    limits (1 up to the CLI's --threads maximum), not argparse's int()."""
    import argparse
    import kdacp.bench as kb
    top = kdacp._kdacp.threads_range[1]
    assert kb._threads("4") == 4 and kb._threads(str(top)) == top
    for bad in ("0", "-1", "1.5", str(top + 1)):
        with pytest.raises(argparse.ArgumentTypeError,
                           match=rf"--threads is '{bad}', expected an integer in \[1, {top}\]"):
            kb._threads(bad)


def test_double_backward_raises():
    """The C++ backward is not differentiable: create_graph=True then a
    backward through kda's gradient raises (once_differentiable) instead of
    dropping kda's part (q.grad would be 2q exactly)."""
    q, k, v, g, beta, _ = [x.requires_grad_(True) for x in _inputs()[:5]] + [None]
    o, _ = kt.kda(q, k, v, g, beta, threads=1)
    (gq,) = torch.autograd.grad(o.sum() + (q * q).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gq.sum().backward()
    xs = [x.detach().clone().requires_grad_(True) for x in _inputs()[:5]]
    with pytest.raises(RuntimeError, match="once_differentiable"):
        torch.autograd.gradgradcheck(lambda *a: kt.kda(*a, threads=1)[0], tuple(xs))


def _overflow_inputs(v_value):
    """float32, finite and valid (g = 0, beta = 1, k = q = 1): o = scale ·
    Σ_k S[k,:] with S = k v^T, so v ~ 3e38 overflows o (4 · 3e38)."""
    b, t, h, kd, vd = 1, 2, 1, 16, 16
    q = torch.ones(b, t, h, kd)
    k = torch.ones(b, t, h, kd)
    v = torch.full((b, t, h, vd), v_value)
    g = torch.zeros(b, t, h, kd)
    beta = torch.ones(b, t, h)
    return q, k, v, g, beta


@pytest.mark.parametrize("algorithm", ["chunk", "recurrent"])
def test_non_finite_forward_raises(algorithm):
    xs = _overflow_inputs(3e38)
    assert all(bool(torch.isfinite(x).all()) for x in xs)
    # RuntimeError naming the tensor (the Python check says "o: element
    # [..] is inf"; a check inside the C++ layer may word it its own way).
    with pytest.raises(RuntimeError, match=r"\b(o|ht)\b"):
        kt.kda(*xs, output_final_state=True, algorithm=algorithm, threads=1)


@pytest.mark.parametrize("algorithm", ["chunk", "recurrent"])
def test_non_finite_backward_raises(algorithm):
    xs = [x.requires_grad_(True) for x in _overflow_inputs(1.0)]
    o, _ = kt.kda(*xs, algorithm=algorithm, threads=1)
    assert bool(torch.isfinite(o).all())
    with pytest.raises(RuntimeError, match=r"\bd(q|k|v|g|beta)\b"):
        (o * 3e38).sum().backward()


def test_non_finite_incoming_gradient_named():
    xs = [x.requires_grad_(True) for x in _inputs()[:5]]
    o, _ = kt.kda(*xs, threads=1)
    with pytest.raises(ValueError, match=r"the gradient of o: element \[0,0,0,0\] is nan"):
        o.backward(torch.full_like(o, math.nan))


# -- groups: these run last, on a gloo world of one process ------------------

def test_group_none_is_not_one_process():
    """torch.distributed.group.WORLD is None before init_process_group: kda
    must not read it as 'run one process'."""
    assert dist.group.WORLD is None
    q, k, v, g, beta, _ = _inputs()
    with pytest.raises(ValueError, match="group=None"):
        kt.kda(q, k, v, g, beta, group=dist.group.WORLD, threads=1)
    o, _ = kt.kda(q, k, v, g, beta, group=kt.SINGLE_PROCESS, threads=1)
    assert torch.equal(o, kt.kda(q, k, v, g, beta, threads=1)[0])


def test_destroyed_group_raises():
    q, k, v, g, beta, _ = _inputs()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "init"),
                                rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
        try:
            world = dist.group.WORLD
            o, _ = kt.kda(q, k, v, g, beta, group=world, protocol="p2p", timeout=5, threads=1)
            assert torch.allclose(o, kt.kda(q, k, v, g, beta, threads=1)[0], rtol=0, atol=1e-12)
            s = torch.randn(1, 2, 16, 16, dtype=torch.float64)
            m = torch.randn(1, 2, 16, 16, dtype=torch.float64)
            ex = kt.build_kda_state_cp(world, "p2p", timeout=5, threads=1)
            # The exchange is not differentiable: a state that requires grad
            # would silently lose it.
            with pytest.raises(ValueError, match="requires grad"):
                ex.forward(s.clone().requires_grad_(True), m)
            with torch.no_grad():
                ex.forward(s.clone().requires_grad_(True), m)
        finally:
            _layer._LAYERS.clear()
            dist.destroy_process_group()
    # The same group object, destroyed: an error, not a silent run.
    with pytest.raises(ValueError, match="not initialised"):
        kt.kda(q, k, v, g, beta, group=world, protocol="p2p", timeout=5, threads=1)
    with pytest.raises(ValueError, match="group=None"):
        kt.kda(q, k, v, g, beta, group=dist.group.WORLD, threads=1)
    with pytest.raises(ValueError, match="not initialised"):
        kt.build_kda_state_cp(world, "p2p")
    # ... and after a new init_process_group, the old object is stale.
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "init"),
                                rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
        try:
            with pytest.raises(ValueError, match="not a live process group"):
                kt.kda(q, k, v, g, beta, group=world, protocol="p2p", timeout=5, threads=1)
            with pytest.raises(ValueError, match="not a live process group"):
                kt.build_kda_state_cp(world, "p2p")
            with pytest.raises(ValueError, match="ProcessGroup"):
                kt.kda(q, k, v, g, beta, group="world", threads=1)
        finally:
            _layer._LAYERS.clear()
            dist.destroy_process_group()
