"""Rank functions of the multi-process tests (torch.multiprocessing spawn,
gloo on localhost). Each rank builds the same global inputs from a seed and
checks its own results; an assertion fails the spawn."""

import datetime
import faulthandler
import math
import os
import re
import time

import torch
import torch.distributed as dist

import kdacp
import kdacp.torch as kt
from kdacp import _comm, _common, _layer
from kda_oracle import make_inputs
from shares import state_share_sum, summed

EXACT = ["p2p", "pipelined_p2p", "allgather", "grouped_allgather_p2p"]
REASSOCIATING = ["recursive_doubling", "grouped_allgather_rd"]


def init(rank, world, init_file, timeout_s=30):
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def finish():
    """Tears the group down and gives the backend's worker threads a moment to
    drop their last tensors before Python shuts down (torch 1.13 aborts when
    one takes the GIL during interpreter finalization)."""
    dist.barrier()
    _layer._LAYERS.clear()
    _comm._BACKENDS.clear()
    dist.destroy_process_group()
    time.sleep(0.2)


def widths(method, p):
    if method.startswith("grouped"):
        return [w for w in range(1, p + 1) if p % w == 0]
    return [1]


def exchange_worker(rank, world, init_file):
    """Every protocol x width through build_kda_state_cp, forward and backward,
    float32 and float64: exact ones bitwise equal to the in-process C++
    exchange, reassociating ones within 1e-5 of it."""
    init(rank, world, init_file)
    for dtype in (torch.float32, torch.float64):
        gen = torch.Generator().manual_seed(11)
        b, h, kd, vd = 2, 2, 16, 32
        s = torch.randn(world, b, h, kd, vd, generator=gen).to(dtype)
        m = (0.3 * torch.randn(world, b, h, kd, kd, generator=gen)).to(dtype)
        refs = {d: torch.from_numpy(kdacp._kdacp.inprocess_exchange(
            "p2p", 1, _common._desc(s), _common._desc(m), d)) for d in (True, False)}
        for method in EXACT + REASSOCIATING + ["auto"]:
            for w in widths(method, world):
                ex = kt.build_kda_state_cp(None, method, w, timeout=20, threads=1)
                assert ex.rank == rank and ex.size == world
                fwd = ex.forward(s[rank], m[rank])
                bwd = ex.backward(s[rank], m[rank])
                assert ex.method in kdacp.exchange_methods() and ex.method != "auto"
                for got, d in ((fwd, True), (bwd, False)):
                    want = refs[d][rank]
                    assert got.dtype == dtype and got.shape == want.shape
                    if ex.exact:
                        same = kdacp._kdacp.inprocess_exchange(
                            method, w, _common._desc(s), _common._desc(m), d)
                        assert torch.equal(got, torch.from_numpy(same)[rank]), (method, w, d)
                        assert torch.equal(got, want), (method, w, d)
                        assert torch.equal(got, kt.merge_affine_summaries(s, m, rank, d))
                    else:
                        err = (got.double() - want.double()).norm() / max(want.double().norm(), 1e-30)
                        assert err <= 1e-5, (method, w, d, err)
        # Options reach the C++ exchange: pipelined_p2p with 2 column segments.
        ex = kt.build_kda_state_cp(None, "pipelined_p2p", segments=2, timeout=20, threads=1)
        assert ex.segments == 2
        for d in (True, False):
            same = kdacp._kdacp.inprocess_exchange("pipelined_p2p", 1, _common._desc(s), _common._desc(m), d, 2)
            got = ex.forward(s[rank], m[rank]) if d else ex.backward(s[rank], m[rank])
            assert torch.equal(got, torch.from_numpy(same)[rank])
        # split when the group does not span the default group: the sub-groups
        # are p2p views over the parent (forced here on the world group).
        for method in ("grouped_allgather_p2p", "grouped_allgather_rd"):
            for w in widths(method, world):
                backend = _comm.backend_for(None, 20)
                backend.spans_world = False
                ex = kt.StateExchange(backend, method, w, {"threads": 1})
                for d in (True, False):
                    got = ex.forward(s[rank], m[rank]) if d else ex.backward(s[rank], m[rank])
                    same = kdacp._kdacp.inprocess_exchange(method, w, _common._desc(s), _common._desc(m), d)
                    assert torch.equal(got, torch.from_numpy(same)[rank]), (method, w, d)
    # A non-contiguous state (a view into packed [S|M] storage) is used in place.
    packed = torch.randn(1, 2, 16, 48, generator=torch.Generator().manual_seed(rank))
    ex = kt.build_kda_state_cp(None, "allgather", timeout=20)
    a = ex.forward(packed[..., :32], packed[..., 32:])
    b_ = ex.forward(packed[..., :32].contiguous(), packed[..., 32:].contiguous())
    assert torch.equal(a, b_)
    finish()


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / max(b.norm().item(), 1e-300)).item()


def _zigzag_slices(t, p, r):
    parts = 2 * p
    base, extra = divmod(t, parts)
    bounds = [0]
    for j in range(parts):
        bounds.append(bounds[-1] + base + (1 if j < extra else 0))
    return [(bounds[r], bounds[r + 1]), (bounds[parts - 1 - r], bounds[parts - r])]


def kda_worker(rank, world, init_file):
    """kt.kda over the group vs group=None on the whole stream, o, ht and every
    gradient; exact protocols bitwise equal to one another (p2p recomputes its
    chunk forward in the backward, the others keep it: keep_forward changes
    no bit)."""
    init(rank, world, init_file)
    t = 9 * world + 3
    cases = [
        # (dtype, tol, packed, layout, counts)
        (torch.float64, 1e-12, False, "contiguous", None),
        (torch.float32, 2e-5, False, "contiguous", None),
        (torch.float64, 1e-12, True, "contiguous", None),
        (torch.float64, 1e-12, False, "contiguous", [3 + 2 * r for r in range(world)]),
        (torch.float64, 1e-12, True, "zigzag", None),
    ]
    for dtype, tol, packed, layout, counts in cases:
        if counts is not None:
            t_case = sum(counts)
        else:
            t_case = t
        cu = [0, 4, t_case // 2 + 1, t_case] if packed else None
        b = 1 if packed else 2
        n = 3 if packed else b
        full = make_inputs(b, t_case, 2, 4, 16, 16, dtype, seed=21, n_states=n)
        gen = torch.Generator().manual_seed(22)
        d_o = torch.randn(b, t_case, 4, 16, generator=gen).to(dtype)
        d_ht = [torch.randn(n, 4, 16, 16, generator=gen).to(dtype) for _ in range(world)]
        # One process on the whole stream; ht's gradient is the sum of the ranks'.
        ref = [x.clone().requires_grad_(True) for x in full]
        o_ref, ht_ref = kt.kda(*ref[:5], initial_state=ref[5], output_final_state=True,
                               cu_seqlens=cu, threads=1)
        dht_total = sum(d_ht[1:], d_ht[0].clone())
        ((o_ref * d_o).sum() + (ht_ref * dht_total).sum()).backward()
        if layout == "zigzag":
            spans = _zigzag_slices(t_case, world, rank)
        else:
            sizes = counts or [t_case // world + (1 if j < t_case % world else 0)
                               for j in range(world)]
            start = sum(sizes[:rank])
            spans = [(start, start + sizes[rank])]

        def local(x):
            return torch.cat([x[:, a:e] for a, e in spans], dim=1)

        methods = ["p2p", "allgather", "auto"] if layout == "zigzag" else \
            EXACT + ["recursive_doubling", "auto"]
        first_exact = None
        for method in methods:
            for w in widths(method, world):
                if method.startswith("grouped") and w in (1, world):
                    continue
                mine = [local(x).detach().clone().requires_grad_(True) for x in full[:5]]
                h0 = full[5].clone().requires_grad_(True)
                o, ht = kt.kda(*mine, initial_state=h0, output_final_state=True,
                               cu_seqlens=cu, group=dist.group.WORLD, layout=layout,
                               protocol=method, allgather_group_size=w, timeout=20, threads=1,
                               keep_forward=method != "p2p")
                ((o * local(d_o)).sum() + (ht * d_ht[rank]).sum()).backward()
                # h0.grad is this rank's share: summed over the ranks, one process's.
                got = [o, ht] + [x.grad for x in mine] + [state_share_sum(h0.grad, spans, cu)]
                want = [local(o_ref), ht_ref] + [local(x.grad) for x in ref[:5]] + [ref[5].grad]
                names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
                for name, a, e in zip(names, got, want):
                    assert a.dtype == dtype, name
                    err = _rel(a, e)
                    assert err <= tol, (method, w, layout, dtype, name, err)
                if method in EXACT:
                    if first_exact is None:
                        first_exact = got
                    else:
                        for name, a, e in zip(names, got, first_exact):
                            assert torch.equal(a, e), (method, w, layout, name)
    finish()


def _same_bytes(a, b):
    bits = torch.int64 if a.element_size() == 8 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def share_worker(rank, world, init_file):
    """A learned initial state, held whole by every rank, gets this rank's
    share of its gradient as every parameter does: the rows of the sequences
    whose first token this rank holds (token 0 of every batch row without
    cu_seqlens), -0.0 in the others, so the all-reduce a trainer runs over
    the CP ranks gives one process's gradient, bit for bit in the
    deterministic mode. kda over a group (ranks that start several sequences
    or none, zigzag over batch rows, Ulysses) and causal_conv1d on a context,
    whose sequence 2 starts on rank 0 and reads its initial state on rank 1."""
    init(rank, world, init_file)
    counts = [3, 5, 7, 9] if world == 4 else [3, 9]
    t = sum(counts)
    cu = [0, 1, 2, 13, t] if world == 4 else [0, 1, 2, 10, t]
    start = sum(counts[:rank])
    contiguous = [(start, start + counts[rank])]
    zigzag = _zigzag_slices(t, world, rank)
    cases = [  # name, dtype, B, cu_seqlens, this rank's spans, kda's arguments
        ("contiguous", torch.float64, 1, cu, contiguous, dict(layout="contiguous")),
        ("deterministic", torch.float32, 1, cu, contiguous,
         dict(deterministic=True, algorithm="recurrent")),
        ("zigzag rows", torch.float64, 2, None, zigzag, dict(layout="zigzag")),
        ("ulysses", torch.float64, 1, cu, contiguous, dict(ulysses=2)),
    ]
    for name, dtype, b, cu_, spans, kw in cases:
        n = b if cu_ is None else len(cu_) - 1
        full = make_inputs(b, t, 2, 2, 16, 16, dtype, seed=61, n_states=n)
        gen = torch.Generator().manual_seed(62)
        d_o = torch.randn(b, t, 2, 16, generator=gen).to(dtype)
        d_ht = [torch.randn(n, 2, 16, 16, generator=gen).to(dtype) for _ in range(world)]

        def local(x):
            return torch.cat([x[:, a:e] for a, e in spans], dim=1)

        ref = torch.nn.Parameter(full[5].clone())
        o, ht = kt.kda(*full[:5], initial_state=ref, output_final_state=True, cu_seqlens=cu_,
                       threads=1, **{k_: v_ for k_, v_ in kw.items() if k_ == "algorithm"})
        ((o * d_o).sum() + (ht * sum(d_ht[1:], d_ht[0].clone())).sum()).backward()
        h0 = torch.nn.Parameter(full[5].clone())
        o, ht = kt.kda(*[local(x) for x in full[:5]], initial_state=h0, output_final_state=True,
                       cu_seqlens=cu_, group=dist.group.WORLD, protocol="p2p", timeout=20,
                       threads=1, **kw)
        ((o * local(d_o)).sum() + (ht * d_ht[rank]).sum()).backward()
        total = state_share_sum(h0.grad, spans, cu_)  # -0.0 rows checked here
        if kw.get("deterministic"):
            assert _same_bytes(total, ref.grad), name
        else:
            assert _rel(total, ref.grad) <= 1e-12, (name, _rel(total, ref.grad))
        owners = torch.tensor([0.0 if torch.equal(r, -torch.zeros_like(r)) and torch.signbit(r).all()
                               else 1.0 for r in h0.grad])
        dist.all_reduce(owners)
        assert owners.tolist() == [1.0] * n, (name, owners)  # each row: one rank's

    # causal_conv1d: weight, bias and initial_state, each rank's share.
    d, w = 3, 4
    gen = torch.Generator().manual_seed(63)
    x, dy = torch.randn(2, 1, t, d, generator=gen, dtype=torch.float64)
    params = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((d, w), (d,), (4, d, w))]
    ctx = kt.build_cp_context(cu, dist.group.WORLD, conv1d_kernel_size=w, split=counts, timeout=20)
    grads = []
    for xs, dys, context in ((x, dy, None), (x[:, start:start + counts[rank]],
                                             dy[:, start:start + counts[rank]], ctx)):
        leaves = [torch.nn.Parameter(p.clone()) for p in params]
        y, _ = kt.causal_conv1d(xs, leaves[0], leaves[1], None, leaves[2], activation="silu",
                                cu_seqlens=None if context else cu, cp_context=context)
        (y * dys).sum().backward()
        grads.append([p.grad for p in leaves])
    one, mine = grads
    for name, a, e in zip(("weight", "bias"), mine[:2], one[:2]):
        assert _rel(summed(a), e) <= 1e-13, ("causal_conv1d", name)
    assert _same_bytes(state_share_sum(mine[2], contiguous, cu), one[2]), "conv initial_state"
    finish()


def error_worker(rank, world, init_file):
    """Bad inputs: a ValueError before anything is sent; shapes that differ
    between ranks: an error on every rank; a rank that raises before the
    exchange: the others raise RuntimeError within the timeout."""
    init(rank, world, init_file, timeout_s=15)
    ex = kt.build_kda_state_cp(None, "allgather", timeout=5, threads=1)
    s = torch.randn(1, 2, 16, 32)
    m = torch.randn(1, 2, 16, 16)
    # Local errors: ValueError, nothing sent (the next collective still pairs up).
    for bad in ((s.double(), m), (s[0], m), (s, m[:, :, :, :8]), (s.to(torch.int32), m)):
        try:
            ex.forward(*bad)
        except ValueError:
            pass
        else:
            raise AssertionError("bad input accepted")
    assert torch.equal(ex.forward(s, m), ex.forward(s, m))
    # Shapes that differ between ranks: ValueError on every rank.
    v = 32 if rank == 0 else 48
    try:
        ex.forward(torch.randn(1, 2, 16, v), m)
    except ValueError as e:
        assert "the ranks disagree" in str(e) and "shape B,H,K,V: " in str(e), e
    else:
        raise AssertionError("rank %d: mismatched shapes accepted" % rank)
    # kda: ranks disagreeing on the heads.
    q, k, v_, g, beta, _ = make_inputs(1, 8, 2 if rank == 0 else 1, 2, 16, 16, torch.float64, 3)
    try:
        kt.kda(q, k, v_, g, beta, group=dist.group.WORLD, protocol="p2p", timeout=5)
    except ValueError as e:
        assert "the ranks disagree" in str(e) and "shape B,H,HV,K,V: " in str(e), e
    else:
        raise AssertionError("rank %d: kda with mismatched heads accepted" % rank)
    dist.barrier()
    # Rank 0 raises before the exchange (a bad input); the others wait for it
    # in the p2p chain (check_ranks=False: nothing before the protocol).
    ex2 = kt.build_kda_state_cp(None, "p2p", timeout=2, check_ranks=False, threads=1)
    if rank == 0:
        try:
            ex2.forward(s, torch.randn(1, 2, 16, 17))
        except ValueError:
            pass
        else:
            raise AssertionError("bad input accepted")
        time.sleep(4)
    else:
        t0 = time.monotonic()
        try:
            ex2.forward(s, m)
        except RuntimeError as e:
            waited = time.monotonic() - t0
            assert not isinstance(e, ValueError)
            # The chain's rank 1 waits on rank 0; later ranks on their predecessor.
            assert "global rank %d" % (rank - 1) in str(e), e
            assert waited < 2 + 3, waited
        else:
            raise AssertionError("rank %d: no error although a peer never sent" % rank)
    os._exit(0)  # the group holds a stale receive; leave without tearing it down


def _raises(exc, fn, *words):
    """fn() raises exc whose message holds every word; returns the message."""
    try:
        fn()
    except exc as e:
        text = str(e)
        for w in words:
            assert w in text, (w, text)
        return text
    raise AssertionError(f"rank {dist.get_rank()}: no {exc.__name__} ({words})")


def trust_worker(rank, world, init_file):
    """Issue 18 over gloo: every argument that must match is compared before
    any other message (ValueError on every rank naming the argument and the
    global ranks, no rank crashes or waits for the timeout); a rank with a bad
    value or option raises its own error and its peers name it; an overflow
    raises RuntimeError on every rank; a double backward raises; a destroyed
    group raises. Each case leaves the group in step for the next."""
    init(rank, world, init_file, timeout_s=60)
    world_group = dist.group.WORLD
    t_rank = 12
    full = make_inputs(1, t_rank * world, 2, 4, 16, 16, torch.float64, seed=31, n_states=1)
    mine = [x[:, rank * t_rank:(rank + 1) * t_rank].contiguous() for x in full[:5]]
    h0 = full[5]
    base = dict(group=world_group, protocol="p2p", timeout=10, threads=1)
    other = rank == world - 1  # the rank that passes something else

    def run(**kw):
        args = dict(base)
        args.update(kw)
        xs = args.pop("xs", mine)
        return kt.kda(*xs, **args)

    # A correct call first: the group's backend exists from here on.
    o_ok, _ = run()
    # The agreement's names: "rank 2", "ranks 0,1", "ranks 0-2".
    last = f"rank {world - 1} has"
    first = "rank 0 has" if world == 2 else f"ranks 0{',' if world == 3 else '-'}{world - 2} have"
    cases = [
        ("scale", dict(scale=0.5 if other else 0.25), ["0.25", "0.5"]),
        ("cu_seqlens", dict(cu_seqlens=[0, 2, 3, 7, 24] if other else [0, 1, 5, 6, 24]), []),
        ("layout", dict(layout="zigzag" if other else "contiguous"), ["zigzag", "contiguous"]),
        ("protocol", dict(protocol="allgather" if other else "p2p"), []),
        ("allgather_group_size", dict(protocol="grouped_allgather_p2p",
                                      allgather_group_size=2 if other else 1), []),
        ("algorithm", dict(algorithm="recurrent" if other else "chunk"), ["recurrent", "chunk"]),
        ("output_final_state", dict(output_final_state=other), []),
        ("initial_state", dict(initial_state=h0 if other else None), []),
        ("timeout (s)", dict(timeout=7 if other else 10), ["7", "10"]),
        ("segments", dict(protocol="pipelined_p2p", segments=1 if other else 0), []),
        ("memory_budget_bytes", dict(memory_budget_bytes="1MiB" if other else 0), ["1048576"]),
        ("dtype", dict(xs=[x.float() for x in mine] if other else mine), ["float32", "float64"]),
    ]
    for name, kw, shown in cases:
        t0 = time.monotonic()
        text = _raises(ValueError, lambda: run(**kw), f"{name}: ", "the ranks disagree",
                       first, last, *shown)
        assert time.monotonic() - t0 < 5, (name, text)  # the agreement, not a timeout (10 s)
    # Still in step: the same correct call gives the same bits.
    assert torch.equal(run()[0], o_ok)

    # A rank with a bad value (NaN, g > 0, beta > 1) or option raises its
    # own error (the CLI's message); its peers name it, none waits for it.
    bad_cases = [
        (dict(xs=[mine[0].clone().index_fill_(1, torch.tensor([3]), math.nan)] + mine[1:]),
         "q: element [0,3,0,0] is nan, expected finite values"),
        (dict(xs=mine[:3] + [mine[3].clone().fill_(0.5)] + mine[4:]),
         "g: element [0,0,0,0] is 0.5, expected g <= 0"),
        (dict(xs=mine[:4] + [mine[4].clone().fill_(1.5)]), "beta: element [0,0,0] is 1.5"),
        (dict(threads=30000), "threads is '30000'"),
        (dict(segments=-1), "segments is '-1'"),
        (dict(memory_budget_bytes="-5MiB"), "memory_budget_bytes is '-5MiB'"),
        (dict(cu_seqlens=[0, 2.5, 24]), "cu_seqlens[1] is 2.5"),
        (dict(budget=3), "unknown exchange option"),
    ]
    for kw, message in bad_cases:
        t0 = time.monotonic()
        if other:
            _raises(TypeError if "unknown" in message else ValueError, lambda: run(**kw), message)
        else:
            _raises(ValueError, lambda: run(), f"rank {world - 1} rejected its own arguments")
        assert time.monotonic() - t0 < 5, message
    assert torch.equal(run()[0], o_ok)

    # An overflow from finite inputs: RuntimeError naming the tensor on every rank.
    b, t, h, kd, vd = 1, 2, 1, 16, 16
    q = torch.ones(b, t, h, kd)
    big = [q, q.clone(), torch.full((b, t, h, vd), 3e38), torch.zeros(b, t, h, kd),
           torch.ones(b, t, h)]
    text = _raises(RuntimeError, lambda: run(xs=big))
    assert re.search(r"\b(o|ht)\b", text), text
    fine = [x.clone().requires_grad_(True) for x in big[:2]] + \
        [torch.ones(b, t, h, vd, requires_grad=True)] + [x.clone().requires_grad_(True) for x in big[3:]]
    o, _ = run(xs=fine)
    text = _raises(RuntimeError, lambda: (o * 3e38).sum().backward())
    assert re.search(r"\bd(q|k|v|g|beta)\b", text), text

    # A double backward through kda over the group raises on every rank.
    xs = [x.clone().requires_grad_(True) for x in mine]
    o, _ = run(xs=xs)
    (gq,) = torch.autograd.grad(o.sum() + (xs[0] * xs[0]).sum(), xs[0], create_graph=True)
    _raises(RuntimeError, lambda: gq.sum().backward(), "once_differentiable")
    assert torch.equal(run()[0], o_ok)

    # The exchange: protocol, width, options and timeout agree at construction.
    for name, kw in (("protocol", dict(protocol="allgather" if other else "p2p")),
                     ("segments", dict(protocol="pipelined_p2p", segments=2 if other else 1)),
                     ("timeout", dict(protocol="p2p", timeout=7 if other else 10)),
                     ("allgather_group_size", dict(protocol="grouped_allgather_p2p",
                                                   allgather_group_size=2 if other else 1))):
        _raises(ValueError, lambda: kt.build_kda_state_cp(world_group, threads=1, **{
            "timeout": 10, **kw}), f"{name}", "the ranks disagree", last)
    ex = kt.build_kda_state_cp(world_group, "p2p", timeout=10, threads=1)
    s = torch.randn(1, 2, 16, 32)
    m = torch.randn(1, 2, 16, 16)
    _raises(ValueError, lambda: ex.forward(s.clone().requires_grad_(True), m), "requires grad")
    _raises(ValueError, lambda: ex.forward(s, m) if not other else ex.backward(s, m),
            "the ranks disagree", "direction: ")
    assert torch.equal(ex.forward(s, m), ex.forward(s, m))

    finish()
    # The group is gone: the same object, or dist.group.WORLD (now None),
    # raise instead of running one process.
    _raises(ValueError, lambda: run(), "not initialised")
    _raises(ValueError, lambda: run(group=dist.group.WORLD), "group=None")
    os._exit(0)


def first_call_timeout_worker(rank, world, init_file):
    """The timeout option bounds the very first call over a group (the
    members' gather), not the process group's own timeout (60 s here): the
    last rank never calls; the others raise RuntimeError well before it
    exits (10 s)."""
    init(rank, world, init_file, timeout_s=60)
    if rank == world - 1:
        time.sleep(10)
        os._exit(0)
    q, k, v, g, beta, _ = make_inputs(1, 8, 2, 4, 16, 16, torch.float64, seed=3)
    t0 = time.monotonic()
    _raises(RuntimeError, lambda: kt.kda(q, k, v, g, beta, group=dist.group.WORLD,
                                         protocol="p2p", timeout=2, threads=1),
            "no answer within 2 s")
    assert time.monotonic() - t0 < 8, time.monotonic() - t0
    os._exit(0)


def first_exchange_timeout_worker(rank, world, init_file):
    """The same for build_kda_state_cp."""
    init(rank, world, init_file, timeout_s=60)
    if rank == world - 1:
        time.sleep(10)
        os._exit(0)
    t0 = time.monotonic()
    _raises(RuntimeError, lambda: kt.build_kda_state_cp(None, "p2p", timeout=2, threads=1),
            "no answer within 2 s")
    assert time.monotonic() - t0 < 8, time.monotonic() - t0
    os._exit(0)
