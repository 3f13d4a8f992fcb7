"""flash-linear-attention's per-rank CP metadata (the attributes of its
FLACPContext: the local cu_seqlens, pre/post_num_ranks, is_first/last_rank,
pre_num_conv_tokens, and per part under zigzag) read off kdacp's C++ Layout,
so uneven splits get them too; get_cp_cu_seqlens. docs/python.md."""

from bisect import bisect_left, bisect_right

import torch

# The fla attributes a contiguous context sets and a zigzag one leaves None
# (flash-linear-attention's rule: zigzag's metadata is per part).
RANK_FIELDS = ("is_last_rank", "pre_num_ranks", "is_first_rank", "post_num_ranks",
               "pre_num_conv_tokens")
PART_FIELDS = ("part_len", "front_num_seqs", "pre_num_ranks_by_part", "post_num_ranks_by_part",
               "is_first_by_part", "is_last_by_part", "pre_num_conv_tokens_by_part")


def fewer_tokens(tokens, world, layout_name):
    """flash-linear-attention's condition for a split with fewer tokens than
    parts (its words), or None when there are enough."""
    parts = world if layout_name == "contiguous" else 2 * world
    if tokens >= parts:
        return None
    what = "`world_size`" if layout_name == "contiguous" else "`2 * world_size`"
    return (f"`total_tokens` ({tokens}) must be at least {what} ({parts}) for context "
            f"parallelism.")


def equal_split_condition(tokens, world, layout_name):
    """flash-linear-attention's conditions for its equal split (its words):
    at least one token per part and a total divisible by the parts; None when
    they hold. kdacp's other splits are build_cp_context's split keyword."""
    fewer = fewer_tokens(tokens, world, layout_name)
    if fewer is not None:
        return fewer
    parts = world if layout_name == "contiguous" else 2 * world
    if tokens % parts == 0:
        return None
    what = "`world_size`" if layout_name == "contiguous" else "`2 * world_size`"
    return (f"`total_tokens` ({tokens}) must be divisible by {what} ({parts}) for context "
            f"parallelism. (kdacp: split='balanced' gives the first {tokens % parts} of the "
            f"{parts} {'ranks' if layout_name == 'contiguous' else 'parts'} one token more; "
            f"split=[...] any tokens per rank)")


def _interval(cu, begin, end, slot, starts):
    """The metadata of the tokens [begin, end), the `slot`-th part in token
    order (parts begin at `starts`): local boundaries, pre_num_conv_tokens,
    pre_num_ranks, is_first, post_num_ranks, is_last."""
    first = bisect_right(cu, begin) - 1  # the sequence holding token `begin`
    last = bisect_left(cu, end) - 1  # the sequence holding token `end - 1`
    local = [0] + [c - begin for c in cu[first + 1:last + 1]] + [end - begin]
    first_slot = bisect_right(starts, cu[first]) - 1
    last_slot = bisect_right(starts, cu[last + 1] - 1) - 1
    pre, post = slot - first_slot, last_slot - slot
    return local, begin - cu[first], pre, pre == 0, post, post == 0


def fla_fields(layout, layout_name, rank, cu, device):
    """The dict of flash-linear-attention's context attributes for `rank` of
    the kdacp Layout `layout` over the global boundaries `cu` (a list; None:
    one sequence per batch row, then the boundaries are None and the rest is
    computed as for one sequence of all T tokens). The local boundaries are
    int32, on `device` (cu_seqlens) and on the CPU (cu_seqlens_cpu)."""
    parts = layout.parts  # (rank, begin, end) in token order: slot = index
    starts = [p[1] for p in parts]
    bounds = cu if cu is not None else [0, layout.tokens]
    mine = [(slot, b, e) for slot, (r, b, e) in enumerate(parts) if r == rank]
    metas = [_interval(bounds, b, e, slot, starts) for slot, b, e in mine]
    local = list(metas[0][0])
    for meta in metas[1:]:
        local += [v + local[-1] for v in meta[0][1:]]
    out = dict.fromkeys(RANK_FIELDS + PART_FIELDS)
    out["cu_seqlens"] = out["cu_seqlens_cpu"] = None
    if cu is not None:
        out["cu_seqlens_cpu"] = torch.tensor(local, dtype=torch.int32)
        out["cu_seqlens"] = out["cu_seqlens_cpu"].to(device)
    if layout_name == "contiguous":
        (_, conv, pre, first, post, last), = metas
        out.update(pre_num_conv_tokens=conv, pre_num_ranks=pre, is_first_rank=first,
                   post_num_ranks=post, is_last_rank=last)
        return out
    lengths = {e - b for _, b, e in parts}
    out.update(part_len=lengths.pop() if len(lengths) == 1 else None,
               front_num_seqs=len(metas[0][0]) - 1,
               pre_num_conv_tokens_by_part=tuple(m[1] for m in metas),
               pre_num_ranks_by_part=tuple(m[2] for m in metas),
               is_first_by_part=tuple(m[3] for m in metas),
               post_num_ranks_by_part=tuple(m[4] for m in metas),
               is_last_by_part=tuple(m[5] for m in metas))
    return out
