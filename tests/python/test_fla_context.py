"""The CP context's flash-linear-attention API: its attributes
(context_workers' token-by-token reference, and flash-linear-attention's own
get_cp_cu_seqlens on the CPU when it is installed), get_cp_cu_seqlens, the
positional orders of build_cp_context and causal_conv1d, residual, and the
fewer-tokens-than-ranks error."""

import inspect

import pytest
import torch

import kdacp.torch as kt
from context_workers import CASES, check_fields, context_worker, fla_fields_equal
from spawn_ranks import spawn

WORLDS = (1, 2, 4)


def fla_context():
    fla = pytest.importorskip("fla.ops.cp.context")
    return fla


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", WORLDS)
def test_get_cp_cu_seqlens_follows_the_reference(world, layout):
    for cu in CASES:
        for rank in range(world):
            ctx = kt.get_cp_cu_seqlens(torch.tensor(cu), world_size=world, rank=rank,
                                       layout=layout)
            assert (ctx.rank, ctx.world_size, ctx.layout) == (rank, world, layout)
            assert ctx.global_cu_seqlens == cu and not ctx.is_cp_enabled
            check_fields(ctx, cu, rank)


def test_attributes_by_hand():
    # [0,3,4,10,16] on 4 ranks of 4 tokens: the document [4,10) spans ranks 1 and 2.
    cu = torch.tensor([0, 3, 4, 10, 16])
    rows = [kt.get_cp_cu_seqlens(cu, world_size=4, rank=r) for r in range(4)]
    assert [c.cu_seqlens.tolist() for c in rows] == [[0, 3, 4], [0, 4], [0, 2, 4], [0, 4]]
    assert [(c.pre_num_ranks, c.post_num_ranks) for c in rows] == [(0, 0), (0, 1), (1, 1),
                                                                   (1, 0)]
    assert [(c.is_first_rank, c.is_last_rank) for c in rows] == [
        (True, True), (True, False), (False, False), (False, True)]
    assert [c.pre_num_conv_tokens for c in rows] == [0, 0, 4, 2]
    zig = kt.get_cp_cu_seqlens(cu, world_size=2, rank=1, layout="zigzag")
    assert zig.cu_seqlens.tolist() == [0, 4, 6, 8] and zig.part_len == 4
    assert zig.front_num_seqs == 1 and zig.pre_num_conv_tokens_by_part == (0, 4)
    assert zig.pre_num_ranks_by_part == (0, 1) and zig.post_num_ranks_by_part == (1, 1)
    assert zig.is_first_by_part == (True, False) and zig.is_last_by_part == (False, False)
    assert zig.pre_num_ranks is None and zig.is_first_rank is None
    # The balanced split (17 tokens on 2 ranks: 9 and 8) has them too.
    odd = kt.get_cp_cu_seqlens([0, 10, 17], world_size=2, rank=1, split="balanced")
    assert odd.cu_seqlens.tolist() == [0, 1, 8] and odd.pre_num_conv_tokens == 9
    assert (odd.pre_num_ranks, odd.post_num_ranks) == (1, 0)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", WORLDS)
def test_get_cp_cu_seqlens_equals_fla(world, layout):
    fla = fla_context()
    for cu in CASES:
        for rank in range(world):
            for kernel in (None, 4):
                ours = kt.get_cp_cu_seqlens(torch.tensor(cu), None, world, rank, None, kernel,
                                            True, layout)
                theirs = fla.get_cp_cu_seqlens(torch.tensor(cu), None, world, rank, None, kernel,
                                               True, layout)
                fla_fields_equal(ours, theirs)
                ours_b = ours.copy_for_backward()
                assert ours_b.cu_seqlens is not ours.cu_seqlens
                assert torch.equal(ours_b.cu_seqlens, ours.cu_seqlens)


def test_single_process_context_attributes():
    ctx = kt.build_cp_context(torch.tensor([0, 5, 12]), kt.SINGLE_PROCESS, 4)
    assert ctx.cu_seqlens.tolist() == [0, 5, 12] and ctx.cu_seqlens.dtype == torch.int32
    assert (ctx.pre_num_ranks, ctx.post_num_ranks, ctx.is_first_rank, ctx.is_last_rank,
            ctx.pre_num_conv_tokens) == (0, 0, True, True, 0)
    assert ctx.num_seqs == 2 and not ctx.is_cp_enabled
    rows = kt.build_cp_context(None, kt.SINGLE_PROCESS, split=[7])
    assert rows.cu_seqlens is None and rows.cu_seqlens_cpu is None and rows.num_seqs == 0
    # With a context, a call's cu_seqlens may be its local boundaries (fla's callers pass them).
    x = torch.randn(1, 12, 3, dtype=torch.float64)
    w = torch.randn(3, 4, dtype=torch.float64)
    y, _ = kt.causal_conv1d(x, w, cu_seqlens=ctx.cu_seqlens, cp_context=ctx)
    y_ref, _ = kt.causal_conv1d(x, w, cu_seqlens=[0, 5, 12])
    assert torch.equal(y, y_ref)


def test_metadata_only_context_is_refused():
    ctx = kt.get_cp_cu_seqlens([0, 4, 8], world_size=2, rank=0)
    with pytest.raises(ValueError, match="get_cp_cu_seqlens with world_size and rank"):
        kt.causal_conv1d(torch.randn(1, 4, 2), torch.randn(2, 3), cp_context=ctx)
    q = torch.randn(1, 4, 1, 16)
    g = -torch.rand(1, 4, 1, 16)
    with pytest.raises(ValueError, match="metadata only"):
        kt.chunk_kda(q, q, q, g, torch.rand(1, 4, 1), cp_context=ctx)


def _leading(fn):
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind == p.POSITIONAL_OR_KEYWORD]
    return [(p.name, p.default) for p in params]


def test_positional_orders():
    assert _leading(kt.build_cp_context) == [
        ("cu_seqlens", inspect.Parameter.empty), ("group", inspect.Parameter.empty),
        ("conv1d_kernel_size", None), ("cu_seqlens_cpu", None),
        ("use_tf32x3_affine_chain", True), ("layout", "contiguous")]
    assert [n for n, _ in _leading(kt.causal_conv1d)] == [
        "x", "weight", "bias", "residual", "initial_state", "output_final_state", "activation",
        "backend", "cu_seqlens", "cu_seqlens_cpu", "chunk_indices", "cp_context"]
    assert [n for n, _ in _leading(kt.get_cp_cu_seqlens)] == [
        "cu_seqlens", "cu_seqlens_cpu", "world_size", "rank", "group", "conv1d_kernel_size",
        "use_tf32x3_affine_chain", "layout"]
    for name in ("split", "protocol", "allgather_group_size"):
        assert (inspect.signature(kt.build_cp_context).parameters[name].kind
                == inspect.Parameter.KEYWORD_ONLY)
    ctx = kt.build_cp_context([0, 5, 12], kt.SINGLE_PROCESS, 4, torch.tensor([0, 5, 12]), True,
                              "zigzag")
    assert ctx.layout == "zigzag" and ctx.front_num_seqs == 2  # [0,6): 5 + 1 tokens
    with pytest.raises(ValueError, match="cu_seqlens_cpu"):
        kt.build_cp_context([0, 5, 12], kt.SINGLE_PROCESS, None, [0, 6, 12])
    with pytest.raises(ValueError, match="use_tf32x3_affine_chain=False"):
        kt.build_cp_context([0, 12], kt.SINGLE_PROCESS, None, None, False)
    with pytest.raises(TypeError):
        kt.build_cp_context([0, 12], kt.SINGLE_PROCESS, None, None, True, "contiguous", [12])


@pytest.mark.parametrize("fn", ["build_cp_context", "get_cp_cu_seqlens", "causal_conv1d"])
def test_positional_orders_equal_fla(fn):
    fla_context()
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.cp.context import build_cp_context, get_cp_cu_seqlens
    theirs = {"build_cp_context": build_cp_context, "get_cp_cu_seqlens": get_cp_cu_seqlens,
              "causal_conv1d": causal_conv1d}[fn]
    assert _leading(getattr(kt, fn)) == _leading(theirs)


def test_residual_is_added_after_the_activation():
    gen = torch.Generator().manual_seed(3)
    x, r, dy = (torch.randn(2, 7, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    y0, _ = kt.causal_conv1d(x, w, None, None, None, False, "silu")
    leaf = r.clone().requires_grad_(True)
    y1, _ = kt.causal_conv1d(x, w, None, leaf, None, False, "silu")
    assert torch.allclose(y1, y0 + r, rtol=0, atol=1e-15)
    (y1 * dy).sum().backward()
    assert torch.equal(leaf.grad, dy)
    leaves = tuple(t.clone().requires_grad_(True) for t in (x, w, r))
    assert torch.autograd.gradcheck(
        lambda a, b, c: kt.causal_conv1d(a, b, residual=c, activation="silu")[0], leaves,
        eps=1e-6, atol=1e-8)


def test_fewer_tokens_than_ranks_names_both_conditions():
    with pytest.raises(ValueError, match=r"`total_tokens` \(3\) must be at least `world_size` "
                                         r"\(4\) for context parallelism\."):
        kt.get_cp_cu_seqlens([0, 3], world_size=4, rank=0)
    # kdacp's balanced split: fla's condition, then kdacp's own reason
    with pytest.raises(ValueError, match=r"`total_tokens` \(3\) must be at least `world_size` "
                                         r"\(4\).*every rank needs a token"):
        kt.get_cp_cu_seqlens([0, 3], world_size=4, rank=0, split="balanced")
    with pytest.raises(ValueError, match=r"`total_tokens` \(1\) must be at least "
                                         r"`2 \* world_size` \(2\)"):
        kt.build_cp_context([0, 1], kt.SINGLE_PROCESS, layout="zigzag")
    with pytest.raises(ValueError, match="rank=2, expected 0 <= rank < world_size = 2"):
        kt.get_cp_cu_seqlens([0, 4], world_size=2, rank=2)


def test_equal_split_or_balanced():
    """fla's default split is equal (T divisible by the parts, its ValueError
    otherwise); kdacp's balanced split is the keyword split='balanced'."""
    for tokens, world, layout in ((10, 3, "contiguous"), (14, 4, "contiguous"),
                                  (10, 2, "zigzag")):
        parts = world if layout == "contiguous" else 2 * world
        what = "world_size" if layout == "contiguous" else "2 \\* world_size"
        with pytest.raises(ValueError, match=rf"`total_tokens` \({tokens}\) must be divisible "
                                             rf"by `{what}` \({parts}\)"):
            kt.get_cp_cu_seqlens([0, tokens], world_size=world, rank=0, layout=layout)
        with pytest.raises(ValueError, match=r"must be divisible.*split='balanced'"):
            kt.get_cp_cu_seqlens([0, tokens], world_size=world, rank=1, layout=layout)
        sizes = [kt.get_cp_cu_seqlens([0, tokens], world_size=world, rank=r, layout=layout,
                                      split="balanced").local_tokens for r in range(world)]
        assert sum(sizes) == tokens and max(sizes) - min(sizes) <= 2, sizes
    with pytest.raises(ValueError, match="split='even', expected None or 'balanced'"):
        kt.get_cp_cu_seqlens([0, 8], world_size=2, rank=0, split="even")
    with pytest.raises(TypeError, match="protocol"):
        kt.get_cp_cu_seqlens([0, 8], world_size=2, rank=0, protocol="ring")


def test_fewer_tokens_than_fla():
    fla = fla_context()
    for world, layout in ((4, "contiguous"), (2, "zigzag")):
        with pytest.raises(ValueError, match="must be at least") as theirs:
            fla.get_cp_cu_seqlens(torch.tensor([0, 3]), world_size=world, rank=0, layout=layout)
        with pytest.raises(ValueError, match="must be at least") as ours:
            kt.get_cp_cu_seqlens(torch.tensor([0, 3]), world_size=world, rank=0, layout=layout)
        parts = world if layout == "contiguous" else 2 * world
        for e in (theirs.value, ours.value):
            assert "(3)" in str(e) and f"({parts})" in str(e), e


@pytest.mark.parametrize("world", [2, 4])
def test_context_over_gloo(world):
    spawn(context_worker, world, 180)
