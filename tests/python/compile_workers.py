"""The model of test_compile (causal_conv1d, chunk_kda with its in-kernel
transforms, then kda) and its rank functions (torch.multiprocessing spawn,
gloo): torch.compile(fullgraph=True) over the model equals eager, bitwise,
on one process and under CP; the device-mesh forms of group=."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dist_workers
import kdacp.torch as kt

H, HV, K, V, W = 1, 2, 16, 16, 4


def make(t, n, seed, dtype=torch.float32):
    """The global leaves of a batch of t tokens and n sequences."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=gen, dtype=torch.float64)).to(dtype)

    return dict(x=rnd(1, t, HV * V), w=rnd(HV * V, W, scale=0.5), q=rnd(1, t, H, K),
                k=rnd(1, t, H, K), g=rnd(1, t, HV, K), beta=torch.rand(1, t, HV, generator=gen,
                                                                     dtype=torch.float64).to(dtype),
                A_log=rnd(HV, scale=0.3), dt_bias=rnd(HV * K, scale=0.5),
                h0=rnd(n, HV, K, V, scale=0.5), wo=rnd(1, t, HV, V), wh=rnd(n, HV, K, V),
                wc=rnd(n, HV * V, W))


TOKEN_WISE = ("x", "q", "k", "g", "beta", "wo")
LEAVES = ("x", "w", "q", "k", "g", "beta", "A_log", "dt_bias", "h0")


def model(x, w, q, k, g, beta, A_log, dt_bias, h0, cu, ctx, group):
    """A small KDA block over this rank's tokens: ctx (a CpContext or None)
    for the convolution and chunk_kda, group (a process group, a device mesh
    or SINGLE_PROCESS) for kda. Between the ops only exact arithmetic (a
    scaling by 0.5, a square), so that a compiled model's bytes are kdacp's."""
    y, conv_state = kt.causal_conv1d(x, w, activation="silu", output_final_state=True,
                                     cu_seqlens=cu if ctx is None else None, cp_context=ctx)
    v = y.view(y.shape[0], y.shape[1], HV, V)
    o, ht = kt.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                         dt_bias=dt_bias, cu_seqlens=cu if ctx is None else None,
                         cp_context=ctx)
    o2, _ = kt.kda(q, k, o * 0.5, -(g * g), beta, cu_seqlens=cu, group=group,
                   **({} if group is kt.SINGLE_PROCESS else {"protocol": "p2p", "timeout": 20}))
    return o2, ht, conv_state


def run(fn, data, cu, ctx, group, local=lambda t: t):
    """fn's outputs and the gradients of the leaves (this rank's tokens) for
    the seeds wo, wh, wc (a backward from each output: no reduction whose
    order a compiler may change)."""
    leaves = {n: (local(t) if n in TOKEN_WISE else t).detach().clone()
              for n, t in data.items()}
    for n in LEAVES:
        leaves[n].requires_grad_()
    seeds = [leaves.pop(n) for n in ("wo", "wh", "wc")]
    outs = fn(**leaves, cu=cu, ctx=ctx, group=group)
    torch.autograd.backward(outs, seeds)
    return [x.detach() for x in outs], {n: leaves[n].grad for n in LEAVES}


def assert_same(a, b, what):
    outs_a, grads_a = a
    outs_b, grads_b = b
    for name, x, y in zip(("o", "ht", "conv_state"), outs_a, outs_b):
        assert torch.equal(x, y), (what, name, (x - y).abs().max().item())
    for n in LEAVES:
        assert grads_a[n] is not None and grads_b[n] is not None, (what, n)
        assert torch.equal(grads_a[n], grads_b[n]), \
            (what, n, (grads_a[n] - grads_b[n]).abs().max().item())


class Counting:
    """A torch.compile backend that counts its compilations."""

    def __init__(self, backend):
        self.backend, self.count = backend, 0

    def __call__(self, gm, example_inputs):
        self.count += 1
        from torch._dynamo.backends.registry import lookup_backend
        return lookup_backend(self.backend)(gm, example_inputs)


def cp_compile_worker(rank, world, init_file):
    """Under CP (gloo, contiguous layout): the compiled model equals eager
    bitwise on every rank, for two batches whose contexts (new objects, other
    boundaries, the same counts) reuse one compilation; then mesh_checks.
    Backend aot_eager: dynamo and AOT autograd around the ops, as inductor's
    (which test_compile runs on one process), at half its compile time."""
    dist_workers.init(rank, world, init_file)
    torch._dynamo.reset()
    counting = Counting("aot_eager")
    compiled = torch.compile(model, backend=counting, fullgraph=True)
    t = 12 * world
    for seed, cu in ((5, [0, 5, t - 3, t]), (6, [0, 9, t - 1, t])):
        data = make(t, len(cu) - 1, seed)
        ctx = kt.build_cp_context(torch.tensor(cu), dist.group.WORLD, conv1d_kernel_size=W,
                                  protocol="p2p", timeout=20)
        spans = ctx.global_layout.local_parts(rank)

        def local(x):
            return torch.cat([x[:, a:e] for a, e in spans], dim=1)

        cu_t = torch.tensor(cu)
        eager = run(model, data, cu_t, ctx, dist.group.WORLD, local)
        again = run(compiled, data, cu_t, ctx, dist.group.WORLD, local)
        assert_same(eager, again, f"rank {rank} seed {seed}")
    assert counting.count == 1, counting.count
    mesh_checks(rank, world)
    dist_workers.finish()


def mesh_worker(rank, world, init_file):
    dist_workers.init(rank, world, init_file)
    mesh_checks(rank, world)
    dist_workers.finish()


def mesh_checks(rank, world):
    """group= as a DeviceMesh: a 1-D mesh (world 2), or the "cp" dimension of
    a 2x2 mesh (world 4); kda, build_cp_context and build_kda_state_cp give
    the results of the mesh's process group; an n-D mesh is a ValueError."""
    from torch.distributed.device_mesh import init_device_mesh
    if world == 2:
        mesh = init_device_mesh("cpu", (2,))
        cp, pg = mesh, mesh.get_group()
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        cp, pg = mesh["cp"], mesh.get_group("cp")
        for call in (lambda: kt.kda(*(torch.zeros(1, 2, 1, 16),) * 4, torch.zeros(1, 2, 1),
                                    group=mesh),
                     lambda: kt.build_cp_context([0, 4], mesh),
                     lambda: kt.build_kda_state_cp(group=mesh)):
            try:
                call()
            except ValueError as e:
                assert "2-D DeviceMesh" in str(e) and "mesh['cp']" in str(e), str(e)
            else:
                raise AssertionError("an n-D mesh was accepted")
    p = dist.get_world_size(pg)
    me = dist.get_rank(pg)
    t = 6 * p
    data = make(t, 2, seed=9 + dist.get_rank() // p)  # one batch per replica
    cu = [0, 5, t]
    results = []
    for group in (cp, pg):
        ctx = kt.build_cp_context(cu, group, conv1d_kernel_size=W, protocol="p2p", timeout=20)
        assert ctx.group is pg and ctx.world_size == p and ctx.rank == me
        spans = ctx.global_layout.local_parts(me)

        def local(x):
            return torch.cat([x[:, a:e] for a, e in spans], dim=1)

        results.append(run(model, data, torch.tensor(cu), ctx, group, local))
        if world == 2 and group is cp:  # under torch.compile too (the op names its group)
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
            results.append(run(compiled, data, torch.tensor(cu), ctx, group, local))
    for other in results[1:]:
        assert_same(results[0], other, f"rank {rank}: mesh vs its group, or compiled")
    state = torch.randn(1, 1, 16, 16)
    ex_mesh = kt.build_kda_state_cp(group=cp, protocol="p2p", timeout=20)
    ex_pg = kt.build_kda_state_cp(group=pg, protocol="p2p", timeout=20)
    matrix = 0.5 * torch.eye(16).expand(1, 1, 16, 16).contiguous()
    assert torch.equal(ex_mesh.forward(state, matrix), ex_pg.forward(state, matrix))
