"""Rank functions of test_chunk_kda's gloo tests (torch.multiprocessing
spawn): chunk_kda with a CpContext equals one process, and a call on a
context sends no agreement message."""

import time

import pytest
import torch
import torch.distributed as dist

import dist_workers
import kdacp.torch as kt
from shares import state_share_sum, summed

FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True)


def init(rank, world, init_file):
    dist_workers.init(rank, world, init_file, timeout_s=30)


finish = dist_workers.finish


def make(t, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)

    h, hv, kd, vd = 1, 2, 16, 16
    return dict(q=rnd(1, t, h, kd), k=rnd(1, t, h, kd), v=rnd(1, t, hv, vd),
                g=rnd(1, t, hv, kd), beta=rnd(1, t, hv), A_log=0.3 * rnd(hv),
                dt_bias=0.5 * rnd(hv * kd), h0=0.5 * rnd(n, hv, kd, vd))


TOKEN_WISE = ("q", "k", "v", "g", "beta")
NAMES = TOKEN_WISE + ("A_log", "dt_bias", "h0")


def call(x, flags, **kw):
    return kt.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                         output_final_state=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                         **flags, **kw)


class Counter:
    """Counts the backend's messages by kind (instance attributes shadow the
    methods the C++ communicator calls)."""

    KINDS = ("all_gather", "broadcast", "barrier", "isend", "irecv", "split")

    def __init__(self, backend):
        self.backend = backend
        self.counts = dict.fromkeys(self.KINDS, 0)
        for kind in self.KINDS:
            setattr(backend, kind, self._wrap(kind, getattr(backend, kind)))

    def _wrap(self, kind, method):
        def counted(*a, **k):
            self.counts[kind] += 1
            return method(*a, **k)
        return counted

    def reset(self):
        self.counts = dict.fromkeys(self.KINDS, 0)

    def remove(self):
        for kind in self.KINDS:
            delattr(self.backend, kind)


def got_and_want(mine, o, ht, ref, o_ref, ht_ref, local, spans, cu):
    """This rank's results and gradients and one process's, by name. A_log's,
    dt_bias's and h0's gradients are this rank's share (h0's: the rows of the
    sequences starting in `spans`): summed over the ranks (what data parallel
    training does with parameters) they are one process's."""
    got = {"o": o, "ht": ht, **{"d" + k_: mine[k_].grad for k_ in NAMES}}
    got["dA_log"], got["ddt_bias"] = summed(got["dA_log"]), summed(got["ddt_bias"])
    got["dh0"] = state_share_sum(got["dh0"], spans, cu)
    want = {"o": local(o_ref), "ht": ht_ref,
            **{"d" + k_: (local(ref[k_].grad) if k_ in TOKEN_WISE else ref[k_].grad)
               for k_ in NAMES}}
    return got, want


def context_worker(rank, world, init_file):
    init(rank, world, init_file)
    counts = [3 + 2 * r for r in range(world)]
    cases = [
        # dtype, tol, layout, split, total tokens, protocol, flags
        (torch.float64, 1e-10, "contiguous", counts, sum(counts), "p2p", FLAGS),
        (torch.float64, 1e-10, "zigzag", "balanced", 9 * world + 3, "allgather",
         dict(FLAGS, safe_gate=True, lower_bound=-4.0)),
        # split="balanced": the CLI's, the first T mod P ranks one token more.
        (torch.float32, 5e-5, "contiguous", "balanced", 8 * world + 1, "auto", FLAGS),
    ]
    if world > 2:
        cases = cases[1:2]  # the suite's time: world 2 runs every case and check
    for dtype, tol, layout, split, t, protocol, flags in cases:
        cu = [0, 4, t // 2 + 1, t]
        n = len(cu) - 1
        full = make(t, n, dtype, seed=31)
        gen = torch.Generator().manual_seed(32)
        d_o = torch.randn(1, t, 2, 16, generator=gen, dtype=torch.float64).to(dtype)
        d_ht = [torch.randn(n, 2, 16, 16, generator=gen, dtype=torch.float64).to(dtype)
                for _ in range(world)]
        ref = {k_: v_.clone().requires_grad_() for k_, v_ in full.items()}
        o_ref, ht_ref = call(ref, flags, cu_seqlens=cu)
        ((o_ref * d_o).sum() + (ht_ref * sum(d_ht[1:], d_ht[0].clone())).sum()).backward()

        ctx = kt.build_cp_context(torch.tensor(cu), dist.group.WORLD, conv1d_kernel_size=4,
                                  layout=layout, split=split, protocol=protocol, timeout=20,
                                  threads=1)
        if layout == "contiguous" and split == "balanced":
            assert ctx.split == [t // world + (r < t % world) for r in range(world)], ctx.split
        assert (ctx.rank, ctx.world_size, ctx.layout) == (rank, world, layout)
        assert ctx.global_cu_seqlens == cu and ctx.conv1d_kernel_size == 4
        assert ctx.group is dist.group.WORLD and ctx.backend is not None
        assert ctx.protocol == protocol and ctx.allgather_group_size == 1
        spans = ctx.global_layout.local_parts(rank)

        def local(x):
            return torch.cat([x[:, a:e] for a, e in spans], dim=1)

        for step in range(2):  # the first call agrees, the second runs on what it pinned
            mine = {k_: (local(v_) if k_ in TOKEN_WISE else v_).detach().clone()
                    .requires_grad_() for k_, v_ in full.items()}
            o, ht = call(mine, flags, cp_context=ctx)
            ((o * local(d_o)).sum() + (ht * d_ht[rank]).sum()).backward()
            got, want = got_and_want(mine, o, ht, ref, o_ref, ht_ref, local, spans, cu)
            for name in got:
                assert got[name].dtype == dtype, name
                err = (got[name].double() - want[name].double()).abs().max().item()
                assert err <= tol, (layout, protocol, dtype, name, err)
    # auto weighs the batch's cuts (build_cp_context knows cu_seqlens): at P = 4 with
    # the default cost model and zigzag, one document's chain over 8 parts loses to the
    # allgather, two documents' (cut at part 4: two 3-hop stretches at once) win with
    # p2p; the outputs are the same bits. (Contiguous P = 4 runs p2p either way since
    # the model prices each collective's agreement.)
    if world == 4:
        t = 8 * world
        outs = []
        for cu, want in (([0, t], "allgather"), ([0, t // 2, t], "p2p")):
            for protocol in ("auto", want):
                x = make(t, len(cu) - 1, torch.float64, seed=35)
                ctx = kt.build_cp_context(cu, dist.group.WORLD, layout="zigzag", protocol=protocol,
                                          timeout=20, threads=1)
                spans = ctx.global_layout.local_parts(rank)
                mine = {k_: (torch.cat([v_[:, a:e] for a, e in spans], dim=1) if k_ in TOKEN_WISE
                             else v_) for k_, v_ in x.items()}
                outs.append(call(mine, FLAGS, cp_context=ctx))
                methods = [layer.method for layer in ctx._layers.values()]
                assert methods == [want], (cu, protocol, methods)
            for got, ref in zip(outs[-2], outs[-1]):
                assert torch.equal(got, ref), cu
        # kda over a group weighs each call's own cuts (its cu_seqlens), or the
        # cuts it is told (expected_cuts).
        from kdacp import _layer
        for cu, cuts, want in ((None, None, "allgather"), ([0, t // 2, t], None, "p2p"),
                               (None, [True, False, False, False, True, False, False, False], "p2p")):
            extra = {} if cuts is None else {"expected_cuts": cuts}
            kt.kda(mine["q"], mine["k"], mine["v"], -torch.sigmoid(mine["g"]),
                   torch.sigmoid(mine["beta"]), cu_seqlens=cu, group=dist.group.WORLD,
                   layout="zigzag", protocol="auto", timeout=20, threads=1, **extra)
            assert list(_layer._LAYERS.values())[-1].method == want, (cu, cuts, want)
        with pytest.raises(ValueError, match="expected_cuts has 3 flags, expected one per part"):
            kt.kda(mine["q"], mine["k"], mine["v"], -torch.sigmoid(mine["g"]),
                   torch.sigmoid(mine["beta"]), group=dist.group.WORLD, layout="zigzag", protocol="auto",
                   timeout=20, threads=1, expected_cuts=[True, False, True])

    if world > 2:
        finish()
        return

    # Messages per call, counted on the backend. p2p without h0/ht: the exchange is
    # isend/irecv alone, so any collective would be an agreement.
    t = 8 * world
    x = make(t, 1, torch.float64, seed=34)
    mine = {k_: (v_[:, rank * 8:(rank + 1) * 8] if k_ in TOKEN_WISE else v_)
            for k_, v_ in x.items()}
    ctx = kt.build_cp_context([0, t], dist.group.WORLD, protocol="p2p", timeout=20, threads=1)
    counter = Counter(ctx.backend)
    for step in range(3):
        counter.reset()
        leaves = {k_: v_.clone().requires_grad_() for k_, v_ in mine.items()}
        o, ht = kt.chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                             A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], cp_context=ctx,
                             **FLAGS)
        assert ht is None
        o.sum().backward()
        collectives = sum(counter.counts[k_] for k_ in ("all_gather", "broadcast", "barrier",
                                                        "split"))
        if step == 0:
            assert counter.counts["all_gather"] >= 1, counter.counts  # the one agreement
        else:
            assert collectives == 0, (step, counter.counts)
        assert counter.counts["isend"] + counter.counts["irecv"] >= 1, counter.counts
    # kda without a context agrees on every call (forward and backward).
    for step in range(2):
        counter.reset()
        kt.kda(mine["q"], mine["k"], mine["v"], -torch.sigmoid(mine["g"]),
               torch.sigmoid(mine["beta"]), group=dist.group.WORLD, protocol="p2p", timeout=20,
               threads=1)
        assert counter.counts["all_gather"] >= 1, counter.counts
    counter.remove()

    # Per-call arguments that differ at a context's first call: ValueError on every
    # rank naming them, before any exchange message.
    t = 8 * world
    x = make(t, 1, torch.float64, seed=33)
    ctx = kt.build_cp_context([0, t], dist.group.WORLD, protocol="p2p", timeout=20, threads=1)
    mine = {k_: (v_[:, rank * 8:(rank + 1) * 8] if k_ in TOKEN_WISE else v_)
            for k_, v_ in x.items()}
    with pytest.raises(ValueError, match=r"the ranks disagree.*scale: rank 0 has 0.25, rank 1 has 0.5"):
        call(mine, FLAGS, cp_context=ctx, scale=0.25 if rank == 0 else 0.5)
    # The in-kernel transforms are part of the layer's config (agreed in C++).
    with pytest.raises(ValueError, match=r"the ranks disagree.*in-kernel transforms: rank 0 has "
                                         r"l2,gate,A,dt,sig, rank 1 has gate,A,dt,sig"):
        call(mine, dict(FLAGS, use_qk_l2norm_in_kernel=rank == 0), cp_context=ctx, scale=0.5)
    call(mine, FLAGS, cp_context=ctx, scale=0.5)  # now agreed, and pinned
    # A later call with other arguments raises on its rank before sending (here on
    # every rank alike, so no peer is left waiting for the timeout).
    with pytest.raises(ValueError, match=r"other arguments than at its first call.*"
                                         r"scale=0.3 \(agreed at the first call: 0.5\)"):
        call(mine, FLAGS, cp_context=ctx, scale=0.3)
    with pytest.raises(ValueError, match="use_qk_l2norm_in_kernel=False"):
        call(mine, dict(FLAGS, use_qk_l2norm_in_kernel=False), cp_context=ctx, scale=0.5)
    with pytest.raises(ValueError, match="q has 7 tokens, expected 8"):
        call({k_: (v_[:, :7] if k_ in TOKEN_WISE else v_) for k_, v_ in mine.items()}, FLAGS,
             cp_context=ctx, scale=0.5)
    # A rank whose first call fails its own checks: its peers, in the
    # layer's agreement, raise at once instead of waiting for it.
    ctx_f = kt.build_cp_context([0, t], dist.group.WORLD, protocol="p2p", timeout=20, threads=1)
    t0 = time.monotonic()
    bad = {k_: (v_[:, :7] if k_ in TOKEN_WISE and rank == 1 else v_) for k_, v_ in mine.items()}
    with pytest.raises(ValueError, match="q has 7 tokens" if rank == 1 else "rank 1 rejected"):
        call(bad, FLAGS, cp_context=ctx_f, scale=0.5)
    assert time.monotonic() - t0 < 10
    # Context arguments that differ: named at build.
    with pytest.raises(ValueError, match=r"the ranks disagree.*cu_seqlens: rank"):
        kt.build_cp_context([0, t - 1 - rank, t], dist.group.WORLD, timeout=20)
    with pytest.raises(ValueError, match=r"the ranks disagree.*layout: rank 0 has zigzag"):
        kt.build_cp_context([0, 2 * world * 4], dist.group.WORLD,
                            layout="zigzag" if rank == 0 else "contiguous", timeout=20)
    # One rank's argument that does not convert: every rank raises at once
    # (the error travels in the agreement), none waits for the timeout.
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="split" if rank == 1 else "rank 1 rejected"):
        kt.build_cp_context(None, dist.group.WORLD, split=[2.5] * world if rank == 1 else [8] * world,
                            timeout=20)
    assert time.monotonic() - t0 < 10
    finish()


def half_worker(rank, world, init_file):
    """bf16 under CP (zigzag, packed, h0/ht) against one process in bf16: both
    compute in float32 and round once, so they differ only where a float32
    rounding difference (other cuts, other chunking) flips a bf16 rounding:
    at most one bf16 ulp of the value (2^-8 relative), counted here against
    the tensor's largest value."""
    init(rank, world, init_file)
    t = 9 * world + 3
    cu = [0, 4, t // 2 + 1, t]
    n = len(cu) - 1
    dtype = torch.bfloat16
    full = make(t, n, dtype, seed=41)
    full["h0"] = full["h0"].float()
    full["A_log"], full["dt_bias"] = full["A_log"].float(), full["dt_bias"].float()
    gen = torch.Generator().manual_seed(42)
    d_o = torch.randn(1, t, 2, 16, generator=gen).to(dtype)
    d_ht = torch.randn(n, 2, 16, 16, generator=gen)
    ref = {k_: v_.clone().requires_grad_() for k_, v_ in full.items()}
    o_ref, ht_ref = call(ref, FLAGS, cu_seqlens=cu)
    ((o_ref.float() * d_o.float()).sum() + (ht_ref * d_ht).sum() * world).backward()
    ctx = kt.build_cp_context(torch.tensor(cu), dist.group.WORLD, layout="zigzag", timeout=20,
                              split="balanced", threads=1)
    spans = ctx.global_layout.local_parts(rank)

    def local(x):
        return torch.cat([x[:, a:e] for a, e in spans], dim=1)

    mine = {k_: (local(v_) if k_ in TOKEN_WISE else v_).detach().clone().requires_grad_()
            for k_, v_ in full.items()}
    o, ht = call(mine, FLAGS, cp_context=ctx)
    ((o.float() * local(d_o).float()).sum() + (ht * d_ht).sum()).backward()
    got, want = got_and_want(mine, o, ht, ref, o_ref, ht_ref, local, spans, cu)
    for name in got:
        assert got[name].dtype == want[name].dtype, name
        top = want[name].double().abs().max().item()
        e = (got[name].double() - want[name].double()).abs().max().item()
        assert e <= 2 ** -8 * top + 1e-6, (name, e, top)
    # Without the flags the bf16 q, k, v, g, beta reach the chunk kernels,
    # which read them in place: the float32 CP call on the widened values,
    # bit for bit (o and the gradients narrowed once).
    raw = {k_: local(v_) if k_ in TOKEN_WISE else v_ for k_, v_ in full.items()}
    raw["g"] = -torch.sigmoid(raw["g"].float()).to(dtype)  # a decay: g < 0
    raw["beta"] = torch.sigmoid(raw["beta"].float()).to(dtype)
    raw["k"] = (raw["k"].float() / raw["k"].float().norm(dim=-1, keepdim=True)).to(dtype)  # contractive
    outs = []
    for cast in (lambda t: t, lambda t: t.float()):
        leaves = {k_: (cast(v_) if k_ in TOKEN_WISE else v_).detach().clone().requires_grad_()
                  for k_, v_ in raw.items()}
        c = kt.build_cp_context(torch.tensor(cu), dist.group.WORLD, layout="zigzag", timeout=20,
                                split="balanced", threads=1)  # a context per set of arguments
        o, ht = kt.chunk_kda(*(leaves[k_] for k_ in TOKEN_WISE), initial_state=leaves["h0"],
                             output_final_state=True, cp_context=c)
        ((o.float() * local(d_o).float()).sum() + (ht * d_ht).sum()).backward()
        outs.append([o.to(dtype), ht, leaves["h0"].grad] + [leaves[k_].grad.to(dtype) for k_ in TOKEN_WISE])
    for i, (a, b) in enumerate(zip(*outs)):
        assert torch.equal(a.view(torch.int16) if a.dtype == dtype else a,
                           b.view(torch.int16) if b.dtype == dtype else b), i
    finish()


def ulysses_worker(rank, world, init_file):
    """ulysses=2 on 4 ranks (head groups {0,1}, {2,3}; the state exchange over 2):
    chunk_kda on a context and kda(group=) equal one process; a width that does
    not divide the ranks or the heads, or ranks that disagree on it, raise
    ValueError on every rank."""
    init(rank, world, init_file)
    gen = torch.Generator().manual_seed(41)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    counts = [3, 5, 7, 9]
    t, h, hv, kd, vd = sum(counts), 2, 4, 16, 16
    cu = [0, 4, 13, t]
    n = len(cu) - 1
    full = dict(q=rnd(1, t, h, kd), k=rnd(1, t, h, kd), v=rnd(1, t, hv, vd), g=rnd(1, t, hv, kd),
                beta=rnd(1, t, hv), A_log=0.3 * rnd(hv), dt_bias=0.5 * rnd(hv * kd),
                h0=0.5 * rnd(n, hv, kd, vd))
    d_o = rnd(1, t, hv, vd)
    d_ht = [rnd(n, hv, kd, vd) for _ in range(world)]
    ref = {k_: v_.clone().requires_grad_() for k_, v_ in full.items()}
    o_ref, ht_ref = call(ref, FLAGS, cu_seqlens=cu)
    ((o_ref * d_o).sum() + (ht_ref * sum(d_ht[1:], d_ht[0].clone())).sum()).backward()
    ctx = kt.build_cp_context(cu, dist.group.WORLD, split=counts, protocol="p2p", timeout=20,
                              threads=1, ulysses=2)
    spans = ctx.global_layout.local_parts(rank)

    def local(x):
        return torch.cat([x[:, a:e] for a, e in spans], dim=1)

    for step in range(2):
        mine = {k_: (local(v_) if k_ in TOKEN_WISE else v_).detach().clone().requires_grad_()
                for k_, v_ in full.items()}
        o, ht = call(mine, FLAGS, cp_context=ctx)
        ((o * local(d_o)).sum() + (ht * d_ht[rank]).sum()).backward()
        got, want = got_and_want(mine, o, ht, ref, o_ref, ht_ref, local, spans, cu)
        for name in got:
            err = (got[name] - want[name]).abs().max().item()
            assert err <= 1e-10, ("chunk_kda ulysses=2", step, name, err)
    assert [(layer.ulysses, layer.method) for layer in ctx._layers.values()] == [(2, "p2p")]

    # kda(group=) with ulysses: the layer alone (gates and beta as given).
    g_ = -torch.sigmoid(full["g"])
    beta_ = torch.sigmoid(full["beta"])
    ref = [x.clone().requires_grad_() for x in (full["q"], full["k"], full["v"], g_, beta_)]
    o_ref, ht_ref = kt.kda(*ref, initial_state=full["h0"], output_final_state=True, cu_seqlens=cu)
    ((o_ref * d_o).sum() + (ht_ref * sum(d_ht[1:], d_ht[0].clone())).sum()).backward()
    mine = [local(x).detach().clone().requires_grad_() for x in (full["q"], full["k"], full["v"], g_, beta_)]
    o, ht = kt.kda(*mine, initial_state=full["h0"], output_final_state=True, cu_seqlens=cu,
                   group=dist.group.WORLD, protocol="auto", timeout=20, threads=1, ulysses=2)
    ((o * local(d_o)).sum() + (ht * d_ht[rank]).sum()).backward()
    for name, a, b in [("o", o, local(o_ref)), ("ht", ht, ht_ref)] + \
            [("d" + nm, m.grad, local(r.grad)) for nm, m, r in zip("qkvgb", mine, ref)]:
        err = (a - b).abs().max().item()
        assert err <= 1e-10, ("kda ulysses=2", name, err)

    # ulysses="auto": the cost model's U (K = V = 128, 6 tokens per rank: U = 2, as
    # kdacp.choose_ulysses and `kdacp plan --tokens-per-rank 6` say), the results one
    # process's.
    from kdacp import _layer
    big = [rnd(1, t, h, 128), rnd(1, t, h, 128), rnd(1, t, hv, 128), -torch.rand(1, t, hv, 128, generator=gen,
                                                                                  dtype=torch.float64),
           torch.rand(1, t, hv, generator=gen, dtype=torch.float64)]
    o_one, _ = kt.kda(*big, cu_seqlens=cu)
    sixes = [6] * world
    big_ctx_parts = kt.build_cp_context(cu, dist.group.WORLD, split=sixes, timeout=20, threads=1).global_layout
    mine_big = [torch.cat([x[:, a:e] for a, e in big_ctx_parts.local_parts(rank)], dim=1) for x in big]
    o_auto, _ = kt.kda(*mine_big, cu_seqlens=cu, group=dist.group.WORLD, protocol="auto", timeout=20,
                       threads=1, ulysses="auto")
    assert list(_layer._LAYERS.values())[-1].ulysses == 2
    want_o = torch.cat([o_one[:, a:e] for a, e in big_ctx_parts.local_parts(rank)], dim=1)
    assert (o_auto - want_o).abs().max().item() <= 1e-10
    with pytest.raises(ValueError, match="expected protocol auto, got p2p"):
        kt.kda(*mine_big, cu_seqlens=cu, group=dist.group.WORLD, protocol="p2p", timeout=20,
               threads=1, ulysses="auto")

    # bfloat16 inputs (computed in float32, o and the gradients stored as bfloat16):
    # within bfloat16's rounding of one process's float32 run on the same values.
    half = [x.detach().to(torch.bfloat16) for x in (full["q"], full["k"], full["v"], g_, beta_)]
    one = [x.clone().requires_grad_() for x in half]
    o_one, _ = kt.kda(*one, cu_seqlens=cu)
    (o_one.float() * d_o).sum().backward()
    mine_h = [local(x).detach().clone().requires_grad_() for x in half]
    o_h, _ = kt.kda(*mine_h, cu_seqlens=cu, group=dist.group.WORLD, timeout=20, threads=1, ulysses=2)
    (o_h.float() * local(d_o)).sum().backward()
    assert o_h.dtype == torch.bfloat16 and mine_h[0].grad.dtype == torch.bfloat16
    assert list(_layer._LAYERS.values())[-1].wire_types == ["bfloat16"] * 6  # the backward's: d_o bfloat16 too
    for name, a, b in [("o", o_h, local(o_one))] + [("d" + nm, m.grad, local(r.grad))
                                                    for nm, m, r in zip("qkvgb", mine_h, one)]:
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err <= 1e-2, ("bfloat16 ulysses=2", name, err)
    # The same values as float32 tensors (float32 on the all-to-alls): the
    # bfloat16 run, whose all-to-alls move 16 bits, is that run rounded to
    # bfloat16, bit for bit.
    mine_f = [local(x).detach().float().clone().requires_grad_() for x in half]
    o_f, _ = kt.kda(*mine_f, cu_seqlens=cu, group=dist.group.WORLD, timeout=20, threads=1, ulysses=2)
    (o_f * local(d_o).float().to(torch.bfloat16).float()).sum().backward()
    assert list(_layer._LAYERS.values())[-1].wire_types == [None] * 6
    for name, a, b in [("o", o_h, o_f)] + [("d" + nm, m.grad, f.grad) for nm, m, f in zip("qkvgb", mine_h, mine_f)]:
        assert torch.equal(a, b.to(torch.bfloat16)), ("bfloat16 on the wire", name)

    # Widths that do not fit, and ranks that disagree: ValueError on every rank.
    with pytest.raises(ValueError, match="ulysses=3: expected a divisor of the group's 4 ranks"):
        kt.build_cp_context(cu, dist.group.WORLD, split=counts, timeout=20, ulysses=3)
    with pytest.raises(ValueError, match=r"ulysses 4: expected a divisor of the 4 ranks, of H = 2"):
        kt.kda(*[x.detach() for x in mine], cu_seqlens=cu, group=dist.group.WORLD, timeout=20,
               threads=1, ulysses=4)
    with pytest.raises(ValueError, match="ulysses"):
        kt.kda(*[x.detach() for x in mine], cu_seqlens=cu, group=dist.group.WORLD, timeout=20,
               threads=1, ulysses=1 if rank == 1 else 2)
    # One rank's q stored as bfloat16, the others' float32: the same compute
    # dtype, but 16-bit inputs travel the all-to-alls as 16 bits, so every
    # rank is told (before any all-to-all, which would not match in size).
    mixed = [x.detach().float() for x in mine_f]
    if rank == 1:
        mixed[0] = mixed[0].to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"storage dtypes q,k,v,g,beta"):
        kt.kda(*mixed, cu_seqlens=cu, group=dist.group.WORLD, timeout=20, threads=1, ulysses=2)
    ctx_m = kt.build_cp_context(cu, dist.group.WORLD, split=counts, timeout=20, threads=1, ulysses=2)
    with pytest.raises(ValueError, match=r"storage dtypes q,k,v,g,beta"):
        kt.chunk_kda(*mixed, cp_context=ctx_m)
    with pytest.raises(ValueError, match="not of the state exchange"):
        kt.build_kda_state_cp(dist.group.WORLD, ulysses=2)
    finish()
