"""torch.compile over kdacp.torch (docs/compile.md): chunk_kda, kda and
causal_conv1d are custom ops (kdacp::*), a fullgraph compilation of a model
calling them equals eager bitwise (outputs and gradients, one process and
gloo CP), a new cp_context per batch reuses the compilation, the forward's
saved state lives as long as its handle; group= takes a DeviceMesh. Under a
torch without torch.library.custom_op (Debian's 1.13) the entry points stay
eager functions and the compile tests skip."""

import gc

import pytest
import torch

import kdacp.torch as kt
from compile_workers import (Counting, assert_same, cp_compile_worker, make,
                             mesh_worker, model, run)
from kdacp import _ops
from spawn_ranks import spawn

needs_ops = pytest.mark.skipif(not _ops.AVAILABLE, reason="torch.library.custom_op needs "
                               f"torch >= 2.4 (this is {torch.__version__})")


def test_entry_points_stay_eager_functions():
    # The wrappers keep the functions' signatures, docs and home (any torch).
    import inspect
    for fn in (kt.chunk_kda, kt.kda, kt.causal_conv1d):
        assert fn.__module__ == "kdacp.torch" and fn.__doc__
        assert list(inspect.signature(fn).parameters)[0] in ("q", "x")
    assert not _ops.compiling()
    o, _ = kt.kda(*(torch.zeros(1, 3, 1, 4),) * 3, -torch.ones(1, 3, 1, 4),
                  torch.full((1, 3, 1), 0.5))
    assert o.shape == (1, 3, 1, 4)


@needs_ops
def test_ops_registered():
    for name in ("chunk_kda", "kda", "causal_conv1d"):
        assert hasattr(torch.ops.kdacp, name) and hasattr(torch.ops.kdacp, name + "_backward")


@needs_ops
def test_fullgraph_equals_eager_bitwise():
    torch._dynamo.reset()
    cu = torch.tensor([0, 7, 20])
    data = make(20, 2, seed=1)
    eager = run(model, data, cu, None, kt.SINGLE_PROCESS)
    compiled = torch.compile(model, fullgraph=True)  # inductor
    assert_same(eager, run(compiled, data, cu, None, kt.SINGLE_PROCESS), "inductor")
    # The saved state of the forward went with its backward.
    gc.collect()
    assert len(_ops._HELD) == 0
    with torch.no_grad():  # nothing kept without gradients
        args = {n: t for n, t in data.items() if n not in ("wo", "wh", "wc")}
        args.update(cu=cu, ctx=None, group=kt.SINGLE_PROCESS)
        for x, y in zip(compiled(**args), model(**args)):
            assert torch.equal(x, y)
        assert len(_ops._HELD) == 0


def graph_ops(fn, *args, **kwargs):
    """The kdacp ops in the graph dynamo captures for fn(*args, **kwargs),
    and the number of graphs (a backend that runs the graph as it is)."""
    found = []

    def backend(gm, example_inputs):
        found.append([str(n.target) for n in gm.graph.nodes if "kdacp" in str(n.target)])
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args, **kwargs)
    return found


@needs_ops
def test_graph_holds_the_ops():
    cu = torch.tensor([0, 7, 20])
    data = make(20, 2, seed=1)
    args = {n: t for n, t in data.items() if n not in ("wo", "wh", "wc")}
    graphs = graph_ops(model, **args, cu=cu, ctx=None, group=kt.SINGLE_PROCESS)
    assert graphs == [["kdacp.causal_conv1d.default", "kdacp.chunk_kda.default",
                       "kdacp.kda.default"]], graphs


@needs_ops
def test_new_context_per_batch_reuses_the_compilation():
    torch._dynamo.reset()
    counting = Counting("aot_eager")
    compiled = torch.compile(model, backend=counting, fullgraph=True)
    for seed, cu in ((3, [0, 7, 20]), (4, [0, 12, 20])):
        data = make(20, 2, seed=seed)
        ctx = kt.build_cp_context(torch.tensor(cu), kt.SINGLE_PROCESS, conv1d_kernel_size=4)
        eager = run(model, data, torch.tensor(cu), ctx, kt.SINGLE_PROCESS)
        ctx2 = kt.build_cp_context(torch.tensor(cu), kt.SINGLE_PROCESS, conv1d_kernel_size=4)
        assert_same(eager, run(compiled, data, torch.tensor(cu), ctx2, kt.SINGLE_PROCESS),
                    f"context, seed {seed}")
    assert counting.count == 1, counting.count


@needs_ops
def test_handle_owns_the_saved_state():
    torch._dynamo.reset()

    def f(q, k, v, g, beta):
        return kt.kda(q, k, v, g, beta)[0]

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 1, 4, generator=gen, requires_grad=True) for _ in range(3))
    g = -torch.rand(1, 8, 1, 4, generator=gen)
    beta = torch.rand(1, 8, 1, generator=gen)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    o = compiled(q, k, v, g, beta)
    assert len(_ops._HELD) == 1  # held while a backward may come
    del o
    gc.collect()
    assert len(_ops._HELD) == 0  # dropped with the graph, no backward run
    o = compiled(q, k, v, g, beta)
    o.sum().backward(retain_graph=True)
    first = q.grad.clone()
    o.sum().backward()  # retain_graph: the saved state serves a second backward
    assert torch.equal(q.grad, 2 * first)
    del o
    gc.collect()
    assert len(_ops._HELD) == 0
    # A saved-tensor hook that copies the handle frees the state: said, not silent.
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        o = compiled(q, k, v, g, beta)
    with pytest.raises(RuntimeError, match="the saved state of a compiled forward is gone"):
        o.sum().backward()


def error_of(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 (the type is compared)
        return type(e), str(e)
    raise AssertionError("no error")


@needs_ops
def test_errors_are_eagers():
    # An argument error is raised when the compiled call runs, eager's type and text.
    torch._dynamo.reset()

    def f(q, k, v, g, beta, mode):
        return kt.kda(q, k, v, g, beta, algorithm=mode)[0]

    x = torch.zeros(1, 4, 1, 4)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for args in ((x, x, x, -torch.ones_like(x), torch.zeros(1, 4, 1), "fast"),
                 (x, x, x, torch.ones_like(x), torch.zeros(1, 4, 1), "chunk")):
        want = error_of(f, *args)
        assert issubclass(want[0], ValueError) and error_of(compiled, *args) == want, want
    # A value the op cannot carry: a ValueError naming it when the call runs.
    import numpy as np
    got = error_of(compiled, x, x, x, -torch.ones_like(x), torch.zeros(1, 4, 1), np.int64(1))
    assert got == (ValueError, "algorithm is a numpy value: under torch.compile kdacp takes a Python "
                               "number, a list of them or a tensor there"), got


@needs_ops
def test_compiled_cp_equals_eager_and_1d_mesh():
    spawn(cp_compile_worker, 2, timeout_s=240)


def test_device_mesh_2d():
    pytest.importorskip("torch.distributed.device_mesh")
    spawn(mesh_worker, 4, timeout_s=180)


@needs_ops
def test_dynamic_shapes():
    # Batches of other lengths and sequence counts: one dynamic compilation (sizes
    # unlike the model's others, or duck sizing would pin an equality).
    torch._dynamo.reset()
    counting = Counting("aot_eager")
    compiled = torch.compile(model, backend=counting, fullgraph=True, dynamic=True)
    for t, cu in ((20, [0, 3, 7, 12, 15, 20]), (27, [0, 3, 7, 12, 15, 20, 27])):
        data = make(t, len(cu) - 1, seed=t)
        cu = torch.tensor(cu)
        assert_same(run(model, data, cu, None, kt.SINGLE_PROCESS),
                    run(compiled, data, cu, None, kt.SINGLE_PROCESS), f"T = {t}")
    assert counting.count == 1, counting.count


@needs_ops
def test_gradients_through_torchs_own_ops_inside_the_entry_points():
    # The op kernels run below autograd; eager's reshapes and transposes inside
    # them (a [B,T,H,D] convolution input, state_v_first states) must still
    # carry gradients: these were all zeros while those keys stayed excluded.
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    t, h, d, w = 12, 2, 4, 3
    x = torch.randn(1, t, h, d, generator=gen, dtype=torch.float64)
    wt = torch.randn(h * d, w, generator=gen, dtype=torch.float64)
    q, k = (torch.randn(1, t, 1, d, generator=gen, dtype=torch.float64) for _ in range(2))
    g = -torch.rand(1, t, h, d, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, t, h, generator=gen, dtype=torch.float64)
    h0 = torch.randn(1, h, d, d, generator=gen, dtype=torch.float64)

    def block(x, wt, q, k, g, beta, h0):
        y, _ = kt.causal_conv1d(x, wt, activation="silu")
        return kt.chunk_kda(q, k, y, g, beta, initial_state=h0, output_final_state=True,
                           state_v_first=True)

    def grads(fn):
        leaves = [a.clone().requires_grad_() for a in (x, wt, q, k, g, beta, h0)]
        o, ht = fn(*leaves)
        torch.autograd.backward((o, ht), (torch.ones_like(o), torch.ones_like(ht)))
        return [o.detach(), ht.detach()] + [a.grad for a in leaves]

    eager = grads(block)
    compiled = grads(torch.compile(block, backend="aot_eager", fullgraph=True))
    for name, a, b in zip(("o", "ht", "x", "w", "q", "k", "g", "beta", "h0"), eager, compiled):
        assert b is not None and a.abs().max() > 0, name
        assert torch.equal(a, b), (name, (a - b).abs().max().item())


@needs_ops
def test_fused_recurrent_kda_compiles_through_chunk_kdas_op():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(6)
    t, h, d = 10, 2, 4
    q = torch.randn(1, t, h, d, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(1, t, h, d, generator=gen,
                                                  dtype=torch.float64), dim=-1)
    v = torch.randn(1, t, h, d, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, t, h, d, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, t, h, generator=gen, dtype=torch.float64)

    def f(q, k, v, g, beta):
        return kt.fused_recurrent_kda(q, k, v, g, beta, output_final_state=True)

    eager, compiled = f(q, k, v, g, beta), torch.compile(f, backend="aot_eager",
                                                         fullgraph=True)(q, k, v, g, beta)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


@needs_ops
def test_fake_shapes_and_dtypes_are_eagers():
    """chunk_kda's o is q's dtype (a bf16 q beside float32 v) and its ht is
    [N, HV, V, K] with state_v_first (K != V): the compiled results have
    eager's shapes, dtypes and bytes."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(7)
    t, h, kd, vd = 9, 2, 4, 6
    q = torch.randn(1, t, h, kd, generator=gen).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, t, h, kd, generator=gen), dim=-1)
    v = torch.randn(1, t, h, vd, generator=gen)
    g = -torch.rand(1, t, h, kd, generator=gen)
    beta = torch.rand(1, t, h, generator=gen)

    def f(q, k, v, g, beta):
        return kt.chunk_kda(q, k, v, g, beta, output_final_state=True, state_v_first=True)

    eager = f(q, k, v, g, beta)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, g, beta)
    assert eager[0].dtype == torch.bfloat16 and list(eager[1].shape) == [1, h, vd, kd]
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
