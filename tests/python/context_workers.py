"""The CP context's flash-linear-attention attributes: a token-by-token
reference (expected_fields), the comparison with flash-linear-attention's own
FLACPContext when it is installed, and a gloo worker building contexts over
a real group with even and uneven splits."""

import os

import torch
import torch.distributed as dist

import kdacp.torch as kt

RANK_FIELDS = ("pre_num_ranks", "post_num_ranks", "is_first_rank", "is_last_rank",
               "pre_num_conv_tokens")
PART_FIELDS = ("part_len", "front_num_seqs", "pre_num_ranks_by_part", "post_num_ranks_by_part",
               "is_first_by_part", "is_last_by_part", "pre_num_conv_tokens_by_part")
# The cases: documents crossing ranks, one-token documents, uneven lengths.
CASES = ([0, 16], [0, 3, 4, 10, 16], [0, 1, 2, 3, 16], [0, 15, 16], [0, 5, 6, 7, 11, 16],
         [0, 8, 16], [0, 1, 9, 10, 16])


def expected_fields(cu, parts, rank):
    """The attributes for `rank`, token by token: parts are (rank, begin,
    end) in token order, a part's slot its index."""
    seq = [i for i in range(len(cu) - 1) for _ in range(cu[i], cu[i + 1])]
    slot = [j for j, (_, b, e) in enumerate(parts) for _ in range(b, e)]
    local, metas = [0], []
    for j, (r, b, e) in enumerate(parts):
        if r != rank:
            continue
        base = local[-1]
        local += [base + t - b for t in range(b + 1, e) if seq[t] != seq[t - 1]] + [base + e - b]
        start, stop = cu[seq[b]], cu[seq[e - 1] + 1]
        pre, post = j - slot[start], slot[stop - 1] - j
        metas.append((b - start, pre, pre == 0, post, post == 0))
    out = {"cu_seqlens_cpu": local}
    if len(metas) == 1:
        (conv, pre, first, post, last), = metas
        out.update(pre_num_conv_tokens=conv, pre_num_ranks=pre, is_first_rank=first,
                   post_num_ranks=post, is_last_rank=last)
        return out
    lengths = {e - b for _, b, e in parts}
    out.update(part_len=lengths.pop() if len(lengths) == 1 else None,
               front_num_seqs=local.index(parts[rank][2] - parts[rank][1]),
               pre_num_conv_tokens_by_part=tuple(m[0] for m in metas),
               pre_num_ranks_by_part=tuple(m[1] for m in metas),
               is_first_by_part=tuple(m[2] for m in metas),
               post_num_ranks_by_part=tuple(m[3] for m in metas),
               is_last_by_part=tuple(m[4] for m in metas))
    return out


def check_fields(ctx, cu, rank):
    """ctx's flash-linear-attention attributes against expected_fields."""
    parts = ctx.global_layout.parts
    want = expected_fields(cu, parts, rank)
    assert ctx.cu_seqlens_cpu.dtype == torch.int32 and ctx.cu_seqlens.dtype == torch.int32
    assert ctx.cu_seqlens_cpu.device.type == "cpu"
    assert ctx.cu_seqlens_cpu.tolist() == want.pop("cu_seqlens_cpu") == ctx.cu_seqlens.tolist()
    assert ctx.num_seqs == len(ctx.cu_seqlens) - 1
    contiguous = ctx.layout == "contiguous"
    for name in RANK_FIELDS + PART_FIELDS:
        expect = want.get(name) if (name in RANK_FIELDS) == contiguous else None
        assert getattr(ctx, name) == expect, (name, getattr(ctx, name), expect, cu, rank)
    assert ctx.pre_num_ranks_dev is None and ctx.post_num_ranks_dev is None


def fla_fields_equal(ours, theirs):
    """Every field of flash-linear-attention's FLACPContext equal in kdacp's
    context (tensors: values, dtype and device)."""
    import dataclasses
    for field in dataclasses.fields(theirs):
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype, (field.name, a, b)
            assert a.device == b.device and torch.equal(a, b), (field.name, a, b)
        else:
            assert a == b, (field.name, a, b)
    assert ours.num_seqs == theirs.num_seqs and ours.is_cp_enabled == theirs.is_cp_enabled


def context_worker(rank, world, init_file):
    """build_cp_context over gloo: even splits equal get_cp_cu_seqlens'
    (and flash-linear-attention's when installed); uneven splits and zigzag
    follow the token-by-token reference."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        try:
            from fla.ops.cp.context import get_cp_cu_seqlens as fla_get
        except ImportError:
            fla_get = None
        group = dist.group.WORLD
        uneven = [1] * (world - 1) + [16 - (world - 1)]
        for cu in CASES:
            for layout, split in (("contiguous", None), ("contiguous", uneven),
                                  ("zigzag", None)):
                ctx = kt.build_cp_context(torch.tensor(cu), group, 4, None, True, layout,
                                          split=split, timeout=20)
                assert ctx.is_cp_enabled and ctx.group is group
                check_fields(ctx, cu, rank)
                if split is None:
                    local = kt.get_cp_cu_seqlens(torch.tensor(cu), None, world, rank,
                                                 layout=layout, conv1d_kernel_size=4)
                    for name in ("cu_seqlens_cpu",) + RANK_FIELDS + PART_FIELDS:
                        assert str(getattr(local, name)) == str(getattr(ctx, name)), name
                if split is None and fla_get is not None:
                    theirs = fla_get(torch.tensor(cu), group=group, conv1d_kernel_size=4,
                                     layout=layout)
                    fla_fields_equal(ctx, theirs)
        dist.barrier()
    finally:
        dist.destroy_process_group()
