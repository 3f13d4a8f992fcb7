"""Rank function of test_conv.py's multi-process test (gloo on localhost):
kdacp.torch.causal_conv1d with a cp_context, every rank checking its tokens'
y and dx and the final state, and the sum over ranks of the weight's,
bias's and initial state's gradients (each rank's share), against one process (kdacp's
and the torch reference's)."""

import datetime
import faulthandler
import time

import torch
import torch.distributed as dist

import kdacp.torch as kt
from kdacp import _comm, _kdacp
from conv_reference import causal_conv1d_ref
from shares import state_share_sum


def context(group, layout, layout_name, cu_seqlens, kernel_size, world):
    """kdacp.torch.build_cp_context for this layout: its per-rank counts as
    the split (required without cu_seqlens, zigzag's own for zigzag)."""
    split = [layout.local_tokens(r) for r in range(world)]
    ctx = kt.build_cp_context(cu_seqlens, group, conv1d_kernel_size=kernel_size,
                              layout=layout_name, split=split)
    assert str(ctx.global_layout) == str(layout), (ctx.global_layout, layout)
    return ctx


def local_tokens(full, layout, rank):
    """This rank's tokens of a [B,T,...] tensor, its parts concatenated."""
    return torch.cat([full[:, lo:hi] for lo, hi in layout.local_parts(rank)], dim=1)


def layouts(t, world, w):
    out = [("contiguous", _kdacp.Layout.contiguous(t, world)),
           ("zigzag", _kdacp.Layout.zigzag(t, world))]
    # Parts shorter than W-1: every rank but the last holds one token, or the
    # first holds nearly all.
    ones = [1] * (world - 1) + [t - (world - 1)]
    out.append(("contiguous", _kdacp.Layout.contiguous(t, world, ones)))
    front = [t - (world - 1)] + [1] * (world - 1)
    out.append(("contiguous", _kdacp.Layout.contiguous(t, world, front)))
    return out


def conv_worker(rank, world, init_file):
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD
    t, d = 21, 3
    checked = 0
    for dtype, tol, w in ((torch.float64, 1e-12, 2), (torch.float64, 1e-12, 8),
                          (torch.float32, 1e-6, 4)):
        for cu in (None, [0, 1, 3, 4, 12, 13, 21]):
            b = 2 if cu is None else 1
            n = b if cu is None else len(cu) - 1
            gen = torch.Generator().manual_seed(w * 10 + (cu is None))
            x = torch.randn(b, t, d, generator=gen, dtype=torch.float64).to(dtype)
            weight = torch.randn(d, w, generator=gen, dtype=torch.float64).to(dtype)
            bias = torch.randn(d, generator=gen, dtype=torch.float64).to(dtype)
            h0 = torch.randn(n, d, w, generator=gen, dtype=torch.float64).to(dtype)
            dy = torch.randn(b, t, d, generator=gen, dtype=torch.float64).to(dtype)
            # Each rank's loss puts its own gradient on the final state.
            dhts = torch.randn(world, n, d, w, generator=gen, dtype=torch.float64).to(dtype)
            act = "silu" if w != 4 else None

            def one(fn):
                leaves = [v.clone().requires_grad_(True) for v in (x, weight, bias, h0)]
                y, ht = fn(leaves[0], leaves[1], bias=leaves[2], activation=act,
                           initial_state=leaves[3], output_final_state=True, cu_seqlens=cu)
                ((y * dy).sum() + (ht * dhts.sum(0)).sum()).backward()
                return y.detach(), ht.detach(), [v.grad for v in leaves]

            y1, ht1, g1 = one(kt.causal_conv1d)
            yr, htr, gr = one(causal_conv1d_ref)
            assert (y1.double() - yr.double()).abs().max() <= tol * max(1, yr.abs().max())
            for name, layout in layouts(t, world, w):
                ctx = context(group, layout, name, cu, w, world)
                xl = local_tokens(x, layout, rank).clone().requires_grad_(True)
                wl = weight.clone().requires_grad_(True)
                bl = bias.clone().requires_grad_(True)
                hl = h0.clone().requires_grad_(True)
                y, ht = kt.causal_conv1d(xl, wl, bl, None, hl, True, act, cp_context=ctx)
                ((y * local_tokens(dy, layout, rank)).sum() + (ht * dhts[rank]).sum()).backward()
                what = (dtype, w, cu, str(layout))

                def check(a, ref, name):
                    err = (a.double() - ref.double()).abs().max().item()
                    scale = max(1.0, ref.double().abs().max().item())
                    assert err <= tol * scale, (name, err, what)

                check(y, local_tokens(y1, layout, rank), "y")
                check(ht, ht1, "final_state")
                check(xl.grad, local_tokens(g1[0], layout, rank), "dx")
                check(state_share_sum(hl.grad, layout.local_parts(rank), cu, group), g1[3],
                      "dinitial_state summed over ranks")
                for name_, grad, ref in (("dweight", wl.grad, g1[1]), ("dbias", bl.grad, g1[2])):
                    total = grad.clone()
                    dist.all_reduce(total)
                    check(total, ref, name_ + " summed over ranks")
                # and against the torch reference
                check(y, local_tokens(yr, layout, rank), "y vs torch")
                check(xl.grad, local_tokens(gr[0], layout, rank), "dx vs torch")
                checked += 1
    assert checked == 3 * 2 * 4
    # A context built for another kernel width is refused, naming both.
    ctx = context(group, _kdacp.Layout.contiguous(t, world), "contiguous", None, 4, world)
    try:
        kt.causal_conv1d(torch.zeros(1, _kdacp.Layout.contiguous(t, world).local_tokens(rank), 2),
                         torch.zeros(2, 3), cp_context=ctx)
    except ValueError as e:
        assert "conv1d_kernel_size=4" in str(e), e
    else:
        raise AssertionError("a width other than the context's passed")
    # Ranks that call with different arguments are each told which, before
    # any halo moves (a message of another size would abort its receiver, a
    # final state gathered by some ranks only would time the others out).
    layout = _kdacp.Layout.contiguous(t, world)
    ctx = context(group, layout, "contiguous", None, None, world)
    tl = layout.local_tokens(rank)
    other = rank == 1

    def expect(needle, d=2, w=4, dtype=torch.float32, want_ht=False):
        try:
            kt.causal_conv1d(torch.ones(1, tl, d, dtype=dtype), torch.ones(d, w, dtype=dtype),
                             output_final_state=want_ht, cp_context=ctx)
        except ValueError as e:
            assert "the ranks disagree" in str(e) and needle in str(e), (needle, e)
        else:
            raise AssertionError(f"ranks disagreeing on {needle} passed")

    expect("W (weight's kernel width): ", w=3 if other else 4)
    expect("D (x's channels): ", d=3 if other else 2)
    expect("dtype: ", dtype=torch.float64 if other else torch.float32)
    expect("output_final_state: ", want_ht=other)
    dist.barrier()
    _comm._BACKENDS.clear()
    dist.destroy_process_group()
    time.sleep(0.2)
