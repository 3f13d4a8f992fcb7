"""Rank function of test_deterministic.py (torch.multiprocessing spawn, gloo
on localhost): kdacp.torch's deterministic=True gives, on every rank of a
world of 1, 2 or 4, the same bytes as one process for every output and
every gradient; the default mode does not at world 4; a cut off the
64-token grid with algorithm "chunk" raises on every rank naming the rule."""

import torch
import torch.distributed as dist

import dist_workers
import kdacp.torch as kt
from shares import state_share_sum, summed

FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True)
H, HV, K, V = 1, 2, 16, 16
TOKEN_WISE = ("q", "k", "v", "g", "beta")
PER_TOKEN = ("o",) + tuple("d" + n for n in TOKEN_WISE)  # results over this rank's tokens
RULE = "a cut inside a sequence must fall on a 64-token boundary of that sequence"


def init(rank, world, init_file):
    dist_workers.init(rank, world, init_file, timeout_s=60)


finish = dist_workers.finish


def make(t, n, dtype, seed, raw):
    """Global inputs; raw: chunk_kda's in-kernel inputs (raw gate, beta
    before its sigmoid), else kda's (log gate <= 0, beta in [0, 1])."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    x = dict(q=rnd(1, t, H, K), k=rnd(1, t, H, K), v=rnd(1, t, HV, V), g=rnd(1, t, HV, K),
             beta=rnd(1, t, HV), h0=0.5 * rnd(n, HV, K, V))
    if raw:
        x["A_log"], x["dt_bias"] = 0.3 * rnd(HV), 0.5 * rnd(HV * K)
    else:
        x["q"], x["k"] = 0.25 * x["q"], 0.25 * x["k"]
        x["g"] = torch.nn.functional.logsigmoid(x["g"] + 3)
        x["beta"] = torch.sigmoid(x["beta"])
    d_o = rnd(1, t, HV, V).to(dtype)
    d_ht = rnd(n, HV, K, V).to(dtype)
    return {k_: v_.to(dtype) for k_, v_ in x.items()}, d_o, d_ht


def run(fn, x, d_o, d_ht, local, give_dht, **kw):
    """fn over this rank's tokens of x (local), backward of o·d_o (+ ht·d_ht
    on the rank that gives it): {name: tensor} of every output and grad."""
    leaves = {k_: (local(v_) if k_ in TOKEN_WISE else v_).detach().clone().requires_grad_()
              for k_, v_ in x.items()}
    extra = {k_: leaves[k_] for k_ in ("A_log", "dt_bias") if k_ in leaves}
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
               initial_state=leaves["h0"], output_final_state=True, **extra, **kw)
    loss = (o * local(d_o)).sum()
    if give_dht:
        loss = loss + (ht * d_ht).sum()
    loss.backward()
    out = {"o": o.detach(), "ht": ht.detach()}
    out.update({"d" + k_: v_.grad for k_, v_ in leaves.items()})
    return out


def as_bits(t):
    return t.contiguous().view(torch.int64 if t.element_size() == 8 else torch.int32)


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bits(a), as_bits(b))


def det_worker(rank, world, init_file):
    init(rank, world, init_file)
    group = dist.group.WORLD
    last = world - 1  # the rank whose loss uses ht

    # chunk_kda with every in-kernel flag on a CpContext: packed sequences of
    # 30, 192 and 28 tokens, the cuts on sequence starts or 64 tokens into
    # the 192-token one (contiguous, uneven); zigzag of 512 tokens (parts of
    # 512 / (2P) tokens, sequence starts on multiples of 64); recurrent
    # zigzag with cuts anywhere.
    splits = {1: [250], 2: [94, 156], 4: [30, 64, 64, 92]}
    cases = [
        ("contiguous", [0, 30, 222, 250], splits[world], "chunk", torch.float64),
        ("contiguous", [0, 30, 222, 250], splits[world], "chunk", torch.float32),
        ("zigzag", [0, 128, 384, 512], "balanced", "chunk", torch.float32),
        ("zigzag", [0, 5, 23, 41], "balanced", "recurrent", torch.float64),
    ]
    checked = 0
    for layout, cu, split, algorithm, dtype in cases:
        t, n = cu[-1], len(cu) - 1
        x, d_o, d_ht = make(t, n, dtype, seed=t + len(layout), raw=True)
        ref = run(kt.chunk_kda, x, d_o, d_ht, lambda y: y, True, cu_seqlens=cu,
                  algorithm=algorithm, threads=1, **FLAGS)
        ctx = kt.build_cp_context(cu, group, layout=layout, split=split, protocol="p2p",
                                  timeout=30, threads=2 if rank == 0 else 1)
        spans = ctx.global_layout.local_parts(rank)

        def local(y):
            return torch.cat([y[:, a:e] for a, e in spans], dim=1)

        got = run(kt.chunk_kda, x, d_o, d_ht, local, rank == last, cp_context=ctx,
                  algorithm=algorithm, deterministic=True, **FLAGS)
        for name, g in got.items():
            want = ref[name]
            if name in ("dA_log", "ddt_bias"):
                # Sums over this rank's tokens: summed over the ranks, close to
                # one process's (docs/python.md: not the same bytes).
                g = summed(g)
                assert torch.allclose(g.double(), want.double(), rtol=1e-4, atol=1e-4), name
                continue
            if name == "dh0":
                # This rank's share (one process's rows of the sequences it
                # starts, -0.0 elsewhere): the sum over ranks is one process's bytes.
                g = state_share_sum(g, spans, cu)
            if name in PER_TOKEN:
                want = local(want)
            assert same_bytes(g, want), (layout, algorithm, dtype, name,
                                         (g.double() - want.double()).abs().max().item())
            checked += 1

    # kda through a group (its per-call agreement), zigzag 512: deterministic
    # equals one process; the default mode differs somewhere at world 4.
    cu = [0, 64, 448, 512]
    x, d_o, d_ht = make(512, 3, torch.float32, seed=5, raw=False)
    ref = run(kt.kda, x, d_o, d_ht, lambda y: y, True, cu_seqlens=cu, threads=1)
    spans = kt.build_cp_context(cu, group, layout="zigzag", timeout=30).global_layout.local_parts(rank)

    def zz(y):
        return torch.cat([y[:, a:e] for a, e in spans], dim=1)

    for det in (True, False):
        got = run(kt.kda, x, d_o, d_ht, zz, rank == last, cu_seqlens=cu, group=group,
                  layout="zigzag", protocol="allgather", timeout=30, deterministic=det)
        got["dh0"] = state_share_sum(got["dh0"], spans, cu)
        equal = {name: same_bytes(g, zz(ref[name]) if name in PER_TOKEN else ref[name])
                 for name, g in got.items()}
        if det:
            assert all(equal.values()), equal
            checked += len(equal)
        else:
            # Every rank learns whether any rank's bytes differ.
            differs = torch.tensor([int(not all(equal.values()))])
            dist.all_reduce(differs)
            if world == 4:
                assert differs.item() > 0, "the default mode gave one process's bytes at P = 4"
    assert checked == 4 * 8 + 8, checked

    # A bad value is named; a cut off the 64-token grid with chunk raises on
    # every rank naming the rule (through a context and through a group).
    x, _, _ = make(250, 1, torch.float64, seed=9, raw=True)
    try:
        kt.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], deterministic=1, A_log=x["A_log"],
                     **FLAGS)
    except ValueError as e:
        assert "deterministic=1, expected True or False" in str(e), e
    else:
        raise AssertionError("deterministic=1 passed")
    if world > 1:
        split = [100] + [150 // (world - 1)] * (world - 1)
        ctx = kt.build_cp_context([0, 250], group, split=split, timeout=30)
        mine = {k_: (v_[:, sum(split[:rank]):sum(split[:rank + 1])] if k_ in TOKEN_WISE else v_)
                for k_, v_ in x.items()}
        for fn, kw in ((kt.chunk_kda, dict(cp_context=ctx, A_log=x["A_log"], **FLAGS)),
                       (kt.kda, dict(group=group, timeout=30))):
            g = mine["g"] if fn is kt.chunk_kda else -torch.sigmoid(mine["g"])
            beta = mine["beta"] if fn is kt.chunk_kda else torch.sigmoid(mine["beta"])
            try:
                fn(mine["q"], mine["k"], mine["v"], g, beta, deterministic=True, **kw)
            except ValueError as e:
                # The layer's config check, in kdacp.torch's names: the
                # context's split, or each rank's T without a context.
                split_name = "split" if fn is kt.chunk_kda else "tokens per rank (each rank's T)"
                assert ("start 100 tokens into their sequence" in str(e)
                        and f"choose {split_name} so that every cut inside a sequence falls on a "
                            "64-token boundary of it" in str(e)), e
            else:
                raise AssertionError(f"{fn.__name__}: a cut 100 tokens into a sequence passed")
        # recurrent has no grid: the same cut runs.
        o, _ = kt.kda(mine["q"], mine["k"], mine["v"], -torch.sigmoid(mine["g"]),
                      torch.sigmoid(mine["beta"]), group=group, timeout=30, algorithm="recurrent",
                      deterministic=True)
        assert o.shape[1] == split[rank]
        # The ranks agree on it: one rank's other value is named on every rank.
        try:
            kt.kda(mine["q"], mine["k"], mine["v"], -torch.sigmoid(mine["g"]),
                   torch.sigmoid(mine["beta"]), group=group, timeout=30, algorithm="recurrent",
                   deterministic=rank != last)
        except ValueError as e:
            assert "the ranks disagree" in str(e) and "deterministic: " in str(e), e
        else:
            raise AssertionError("ranks passing different deterministic values ran")
    conv_check(rank, world, group)
    finish()


def conv_check(rank, world, group):
    """causal_conv1d on a CpContext (it needs no deterministic mode): y,
    final_state and the gradients of x and initial_state (its shares summed
    over the ranks) are one process's bytes, with cuts 1 and 29 tokens into a
    sequence and a part of 1 token."""
    t, d, w = 150, 8, 4
    cu = [0, 1, 3, 70, 150]
    split = {1: [150], 2: [71, 79], 4: [4, 1, 29, 116]}[world]
    for dtype in (torch.float32, torch.float64):
        gen = torch.Generator().manual_seed(7)
        rnd = [torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)
               for s in ((1, t, d), (d, w), (d,), (len(cu) - 1, d, w), (1, t, d),
                         (len(cu) - 1, d, w))]
        x, weight, bias, h0, dy, dht = rnd
        a, e = sum(split[:rank]), sum(split[:rank + 1])

        def one(xs, ctx, give_dht):
            leaves = [v.clone().requires_grad_(True) for v in (xs, weight, bias, h0)]
            y, ht = kt.causal_conv1d(leaves[0], leaves[1], leaves[2], None, leaves[3], True,
                                     "silu", cu_seqlens=None if ctx else cu, cp_context=ctx)
            loss = (y * dy[:, a:e] if ctx else y * dy).sum()
            ((loss + (ht * dht).sum()) if give_dht else loss).backward()
            return y.detach(), ht.detach(), leaves[0].grad, leaves[3].grad

        y1, ht1, dx1, dh01 = one(x, None, True)
        ctx = kt.build_cp_context(cu, group, conv1d_kernel_size=w, split=split, timeout=30)
        y, ht, dx, dh0 = one(x[:, a:e], ctx, rank == world - 1)
        dh0 = state_share_sum(dh0, [(a, e)], cu, group)
        for name, got, want in (("y", y, y1[:, a:e]), ("final_state", ht, ht1),
                                ("dx", dx, dx1[:, a:e]), ("dinitial_state", dh0, dh01)):
            assert same_bytes(got, want), (dtype, "causal_conv1d", name)
