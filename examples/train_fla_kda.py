#!/usr/bin/env python3
"""Train flash-linear-attention's own KDA model (fla.models.KDAForCausalLM)
on the CPU with kdacp, on one process and with context parallelism over gloo,
and show that the loss curves agree.

Install / run (flash-linear-attention 0.6 and torch 2.x, e.g. the test venv
scripts/python-env.sh builds at build/venv):

    # from the build tree
    PYTHONPATH=build/release/python build/venv/bin/python examples/train_fla_kda.py
    # or after `pip install .` into an environment with flash-linear-attention
    python examples/train_fla_kda.py --worlds 1,2,4 --steps 40 --dtype float64

For every CP world size in --worlds (1 runs in this process; others are
spawned with torch.multiprocessing and meet over gloo) the same model (same
seed) trains with AdamW on the same synthetic batches: documents of random
lengths packed into one stream of --seq-len tokens (cu_seqlens), each
counting through the vocabulary in a stride of its own, so a token is
predictable only from the ones before it in its document. fla's model code runs unedited: kdacp.torch.
use_with_fla() routes its KDA layers, short convolutions, norms and SwiGLU
to kdacp, and FlaPatch.cp(ctx) hands each batch's CP context
(kdacp.torch.build_cp_context) to every layer. Under CP each rank holds its
tokens of the stream (contiguous runs, or zigzag parts with --layout
zigzag); the loss is each rank's sum over its tokens divided by the global
count of predicted tokens (targets are shifted on the global stream, so no
prediction is lost at a rank boundary), and the parameter gradients are
summed over the ranks before the step, so every rank takes the same step.

The script prints the loss of every world per step and the largest relative
difference from one process, and exits with status 1 if it exceeds --rtol.
Defaults: float64, rtol 1e-9 (CP computes the same function; only the
order of a few sums differs: measured 4.6e-12 over the 30 default steps,
CP 1, 2, 4, while the loss falls from 3.49 to 0.26). In float32 (--dtype float32, rtol 1e-2) the
curves start equal to ~1e-9 and drift apart as training amplifies the
ranks' different roundings (measured: 5e-7 by step 6, 7e-3 by step 30 at
the default learning rate), as any change of summation order would.
"""

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="1,2,4", help="CP world sizes to train, comma separated")
    p.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per batch (one stream)")
    p.add_argument("--max-doc", type=int, default=96, help="longest document, in tokens")
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    p.add_argument("--rtol", type=float, default=None,
                   help="largest relative loss difference from one process accepted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="write {world: [losses]} here")
    args = p.parse_args(argv)
    try:
        args.worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        p.error(f"--worlds {args.worlds!r}: expected comma separated integers, e.g. 1,2,4")
    if not args.worlds or any(w < 1 for w in args.worlds):
        p.error("--worlds: every world size must be >= 1")
    for name in ("steps", "seq_len", "vocab", "hidden", "layers", "heads", "head_dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_doc < 2:
        p.error("--max-doc must be >= 2")
    if args.vocab < 3:
        p.error("--vocab must be >= 3")
    parts = max(args.worlds) * (2 if args.layout == "zigzag" else 1)
    if args.seq_len < parts:
        p.error(f"--seq-len {args.seq_len}: expected at least one token per rank "
                f"({parts} with --worlds {max(args.worlds)} and --layout {args.layout})")
    if args.rtol is None:
        args.rtol = 1e-9 if args.dtype == "float64" else 1e-2
    return args


def make_batch(step, args):
    """The global stream of step `step` (the same on every rank): ids [1, T],
    targets [1, T] (the next token of the same document; -100 at a
    document's first and last token) and cu_seqlens. A document counts in
    steps of its own stride through the tokens 1 .. vocab-1: the next token
    follows from the last two, which only a model that reads its context
    (here the short convolutions and KDA) predicts."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    ids, targets, cu = [], [], [0]
    n = args.vocab - 1
    while cu[-1] < args.seq_len:
        length = min(int(torch.randint(2, args.max_doc + 1, (1,), generator=gen)),
                     args.seq_len - cu[-1])
        start, stride = (int(torch.randint(0, n, (1,), generator=gen)),
                         int(torch.randint(1, 5, (1,), generator=gen)))
        doc = [1 + (start + stride * i) % n for i in range(length)]
        ids += doc
        targets += [doc[i + 1] if 1 <= i < length - 1 else -100 for i in range(length)]
        cu.append(cu[-1] + length)
    return torch.tensor([ids]), torch.tensor([targets]), torch.tensor(cu)


def make_model(args):
    from fla.models import KDAConfig, KDAForCausalLM
    torch.manual_seed(args.seed)
    # fuse_cross_entropy=False: fla's fused cross-entropy is Triton-only; the
    # loss below is torch's. fuse_norm and fuse_swiglu stay on: use_with_fla
    # gives their RMSNorm and SwiGLU a torch implementation.
    config = KDAConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                       num_heads=args.heads, head_dim=args.head_dim, vocab_size=args.vocab,
                       hidden_ratio=2, fuse_cross_entropy=False, use_cache=False)
    return KDAForCausalLM(config).to(DTYPES[args.dtype])


def train(rank, world, args, init_file=None):
    """One rank's run; the global loss per step (the same on every rank)."""
    import kdacp.torch as kt
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                                world_size=world)
    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    losses = []
    with kt.use_with_fla() as fla_on_kdacp:
        for step in range(args.steps):
            ids, targets, cu = make_batch(step, args)
            count = int((targets != -100).sum())
            ctx, local = None, (lambda t: t)
            if world > 1:
                # Once per batch: every cross-rank agreement and the layout.
                ctx = kt.build_cp_context(cu, dist.group.WORLD,
                                          conv1d_kernel_size=model.config.conv_size,
                                          layout=args.layout, threads=1)
                spans = ctx.global_layout.local_parts(rank)

                def local(t, spans=spans):
                    return torch.cat([t[:, a:e] for a, e in spans], 1)

            opt.zero_grad(set_to_none=True)
            with fla_on_kdacp.cp(ctx):
                logits = model(input_ids=local(ids),
                               cu_seqlens=cu if ctx is None else ctx.cu_seqlens).logits
            loss = F.cross_entropy(logits.flatten(0, 1).to(torch.float64),
                                   local(targets).flatten(), ignore_index=-100,
                                   reduction="sum") / count
            loss.backward()
            total = loss.detach().clone()
            if world > 1:
                dist.all_reduce(total)
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)  # each rank holds its tokens' share
            opt.step()
            losses.append(total.item())
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return losses


def _rank_main(rank, world, args, init_file, out_file):
    losses = train(rank, world, args, init_file)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(losses, f)


def run_world(world, args):
    if world == 1:
        return train(0, 1, args)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "losses.json")
        mp.start_processes(_rank_main, args=(world, args, os.path.join(tmp, "init"), out),
                           nprocs=world, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def main(argv=None):
    args = parse(argv)
    curves = {w: run_world(w, args) for w in args.worlds}
    base_world = 1 if 1 in curves else args.worlds[0]
    base = curves[base_world]
    others = [w for w in args.worlds if w != base_world]
    print(f"KDAForCausalLM ({args.layers} layers, hidden {args.hidden}), {args.dtype}, "
          f"{args.seq_len} tokens per step, layout {args.layout}")
    print("step " + "".join(f"   loss CP={w:<3}" for w in args.worlds) + "  max rel diff")
    worst = 0.0
    for step in range(args.steps):
        diff = max([abs(curves[w][step] - base[step]) / abs(base[step]) for w in others],
                   default=0.0)
        worst = max(worst, diff)
        print(f"{step:4d} " + "".join(f"  {curves[w][step]:13.9f}" for w in args.worlds)
              + f"  {diff:.2e}")
    ok = worst <= args.rtol
    print(f"largest relative difference from CP={base_world}: {worst:.2e} "
          f"({'within' if ok else 'ABOVE'} the tolerance {args.rtol:g}); "
          f"loss {base[0]:.4f} -> {base[-1]:.4f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"worlds": {str(w): c for w, c in curves.items()}, "max_rel_diff": worst,
                       "rtol": args.rtol, "dtype": args.dtype, "layout": args.layout}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
