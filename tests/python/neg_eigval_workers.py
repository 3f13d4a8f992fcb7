"""Rank functions of test_neg_eigval.py (torch.multiprocessing spawn, gloo
on localhost): beta in [0, 2] (allow_neg_eigval) over a CP group equals one
process (the same bytes in the deterministic mode, within rounding with the
exchange otherwise), and head sizes that are not multiples of 16 (K = V = 8,
K = 24, V = 40) run through chunk_kda with a cp_context and every protocol."""

import torch
import torch.distributed as dist

import dist_workers
import kdacp.torch as kt
from det_workers import same_bytes
from shares import state_share_sum, summed

TOKEN_WISE = ("q", "k", "v", "g", "beta")


def init(rank, world, init_file):
    dist_workers.init(rank, world, init_file, timeout_s=60)


finish = dist_workers.finish


def make(t, n, hv, kd, vd, seed, wide_beta=True, raw=False):
    """Global float64 inputs: unit-norm k, g <= 0, beta in [0, 2] (its ends
    included) or raw (chunk_kda's in-kernel inputs)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    x = dict(q=rnd(1, t, 1, kd), k=rnd(1, t, 1, kd), v=rnd(1, t, hv, vd), g=rnd(1, t, hv, kd),
             beta=rnd(1, t, hv), h0=0.5 * rnd(n, hv, kd, vd))
    if raw:
        x["A_log"], x["dt_bias"] = 0.3 * rnd(hv), 0.5 * rnd(hv * kd)
    else:
        x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
        x["g"] = torch.nn.functional.logsigmoid(x["g"] + 3)
        x["beta"] = (2 if wide_beta else 1) * torch.rand(1, t, hv, generator=gen,
                                                          dtype=torch.float64)
        x["beta"].view(-1)[:2] = torch.tensor([2.0, 0.0])
    return x, rnd(1, t, hv, vd), rnd(n, hv, kd, vd)


def run(fn, x, d_o, d_ht, local, **kw):
    """fn over this rank's tokens: every output and gradient by name (the
    shares of the whole-held tensors as they come)."""
    leaves = {k_: (local(v_) if k_ in TOKEN_WISE else v_).detach().clone().requires_grad_()
              for k_, v_ in x.items()}
    extra = {k_: leaves[k_] for k_ in ("A_log", "dt_bias") if k_ in leaves}
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
               initial_state=leaves["h0"], output_final_state=True, **extra, **kw)
    ((o * local(d_o)).sum() + (ht * d_ht).sum()).backward()
    out = {"o": o.detach(), "ht": ht.detach()}
    out.update({"d" + k_: v_.grad for k_, v_ in leaves.items()})
    return out


def compare(got, want, spans, cu, exact, tol, what):
    """got: this rank's (whole-held gradients as shares), want: one process's
    over this rank's tokens. exact: the same bytes (A_log's and dt_bias's
    shares are sums of per-rank sums: within rounding)."""
    for name in got:
        g = got[name]
        if name == "dh0":
            g = state_share_sum(g, spans, cu)
        elif name in ("dA_log", "ddt_bias"):
            g = summed(g)
        if exact and name not in ("dA_log", "ddt_bias"):
            assert same_bytes(g, want[name]), (what, name)
        else:
            err = ((g - want[name]).abs().max() / want[name].abs().max().clamp_min(1)).item()
            assert err <= tol, (what, name, err)


def neg_eigval_worker(rank, world, init_file):
    init(rank, world, init_file)
    group = dist.group.WORLD
    # The second sequence crosses the ranks, cut 64 tokens into it (the
    # deterministic mode's chunk rule).
    t, cu = 150, [0, 40, 150]
    spans = None
    for alg in ("chunk", "recurrent"):
        x, d_o, d_ht = make(t, 2, 2, 16, 8, seed=41)
        # The ht gradient given by every rank is summed over them: one process sees the sum.
        one = run(kt.kda, x, d_o, d_ht * world, lambda z: z, cu_seqlens=cu, algorithm=alg,
                  allow_neg_eigval=True)
        split = [104, 46] if world == 2 else None
        for protocol, det in (("p2p", True), ("pipelined_p2p", False), ("allgather", False)):
            counts = split or [t // world + (r < t % world) for r in range(world)]
            begin = sum(counts[:rank])
            spans = [(begin, begin + counts[rank])]

            def local(z, a=begin, e=begin + counts[rank]):
                return z[:, a:e]

            got = run(kt.kda, x, d_o, d_ht, local, cu_seqlens=cu, group=group,
                      protocol=protocol, algorithm=alg, deterministic=det,
                      allow_neg_eigval=True, timeout=30)
            want = {n: (local(v) if n in ("o",) + tuple("d" + k for k in TOKEN_WISE) else v)
                    for n, v in one.items()}
            compare(got, want, spans, cu, det, 1e-10, (alg, protocol, det))
        # Without the flag a beta above 1 is named on every rank (its own check, then the peers').
        try:
            run(kt.kda, x, d_o, d_ht, lambda z: z[:, :75] if rank == 0 else z[:, 75:],
                cu_seqlens=cu, group=group, timeout=30)
        except ValueError as e:
            assert "beta" in str(e), str(e)
        else:
            raise AssertionError("beta above 1 accepted without allow_neg_eigval")
    chunk_kda_on_a_context(rank, world, group)
    finish()


def chunk_kda_on_a_context(rank, world, group):
    """chunk_kda(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True) on a
    cp_context: the same bytes as one process in the deterministic mode, or,
    where the CpContext does not take the flag, NotImplementedError naming
    it on every rank before any message."""
    from kdacp import _context
    t, cu = 150, [0, 40, 150]
    counts = [104, 46] if world == 2 else [t // world + (r < t % world) for r in range(world)]
    begin = sum(counts[:rank])
    spans = [(begin, begin + counts[rank])]

    def local(z, a=begin, e=begin + counts[rank]):
        return z[:, a:e]

    x, d_o, d_ht = make(t, 2, 2, 16, 8, seed=43, raw=True)
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    ctx = kt.build_cp_context(torch.tensor(cu), group, split=counts, timeout=30, threads=1)
    if "allow_neg_eigval" not in _context._CALL_FIELDS:
        try:
            run(kt.chunk_kda, x, d_o, d_ht, local, cp_context=ctx, **flags)
        except NotImplementedError as e:
            assert "allow_neg_eigval" in str(e), str(e)
            return
        raise AssertionError("allow_neg_eigval on a cp_context neither ran nor raised")
    one = run(kt.chunk_kda, x, d_o, d_ht * world, lambda z: z, cu_seqlens=cu, **flags)
    want = {n: (local(v) if n in ("o",) + tuple("d" + k for k in TOKEN_WISE) else v)
            for n, v in one.items()}
    for _ in range(2):
        got = run(kt.chunk_kda, x, d_o, d_ht, local, cp_context=ctx, deterministic=True, **flags)
        compare(got, want, spans, cu, True, 1e-12, "chunk_kda allow_neg_eigval on a cp_context")


def head_dims_worker(rank, world, init_file):
    """chunk_kda with every in-kernel flag on a cp_context at head sizes that
    are not multiples of 16: the same bytes as one process in the
    deterministic mode, within rounding over every exact protocol."""
    init(rank, world, init_file)
    group = dist.group.WORLD
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True)
    t, cu = 140, [0, 12, 140]
    for kd, vd in ((8, 8), (24, 40), (1, 3)):
        x, d_o, d_ht = make(t, 2, 2, kd, vd, seed=50 + kd, raw=True)
        one = run(kt.chunk_kda, x, d_o, d_ht * world, lambda z: z, cu_seqlens=cu, **flags)
        counts = [76, 64] if world == 2 else [t // world + (r < t % world) for r in range(world)]
        begin = sum(counts[:rank])
        spans = [(begin, begin + counts[rank])]

        def local(z, a=begin, e=begin + counts[rank]):
            return z[:, a:e]

        want = {n: (local(v) if n in ("o",) + tuple("d" + k for k in TOKEN_WISE) else v)
                for n, v in one.items()}
        for protocol, det in (("p2p", True), ("pipelined_p2p", False), ("allgather", False),
                              ("recursive_doubling", False), ("auto", False)):
            ctx = kt.build_cp_context(torch.tensor(cu), group, split=counts, protocol=protocol,
                                      timeout=30, threads=1)
            for _ in range(2):  # the first call agrees, the second runs on what it pinned
                got = run(kt.chunk_kda, x, d_o, d_ht, local, cp_context=ctx,
                          deterministic=det, **flags)
                compare(got, want, spans, cu, det, 1e-9, (kd, vd, protocol, det))
    finish()
