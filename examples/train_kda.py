#!/usr/bin/python3
"""Train a small Kimi Delta Attention model with kdacp, on one process or
with context parallelism over gloo.

It needs kdacp importable: install it into the Python that has torch first
(docs/install.md), from the repository root,

    pip install .                          # into a venv or any Python with torch
    python examples/train_kda.py                                # one process
    python examples/train_kda.py --nproc 4                      # CP over 4 processes
    python examples/train_kda.py --nproc 2 --layout zigzag --json-out run.json

or run it on a build tree's package (cmake --preset release && cmake --build
--preset release), with Debian's Python and python3-torch:

    PYTHONPATH=build/release/python /usr/bin/python3 examples/train_kda.py

The task is associative recall over packed documents: every document is a
run of (key, value) pairs with its own key -> value table; a key seen before
in the same document must be followed by its value, which only a model that
reads its context can predict. Documents of random lengths are packed into
one stream of --seq-len tokens (cu_seqlens), so the recurrent state restarts
at every document start, on any rank.

The model: embedding -> --layers blocks of [RMSNorm -> KDA attention (q, k, v
projections, causal short convolutions with SiLU, the in-kernel gate from a
low-rank projection with A_log and dt_bias, in-kernel q/k L2 norm and beta
sigmoid, a per-head RMSNorm times a sigmoid output gate) -> RMSNorm -> SwiGLU
MLP] -> RMSNorm -> head. Under CP every rank holds its tokens of the stream
(contiguous runs or zigzag parts), the projections are per token, the
convolutions receive their halo and KDA its incoming state through kdacp,
and the parameter gradients are summed over the ranks before AdamW: every
rank takes the same step, and the loss curve is that of one process up to
floating-point rounding.
"""

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import kdacp.torch as kt

# bfloat16: mixed precision as flash-linear-attention trains, float32
# parameters and optimizer, the forward under torch.autocast in bfloat16 (the
# projections' outputs, hence q, k, v, g, beta and the convolutions' inputs,
# are bfloat16; kdacp computes them in float32 and returns bfloat16).
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


# -- data ----------------------------------------------------------------------

def make_batch(step, args):
    """The global stream of step `step`, the same on every rank: token ids
    [T], targets [T] (-100 where nothing is predicted) and cu_seqlens."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    keys, values = args.keys, args.values
    ids, targets, cu = [], [], [0]
    while cu[-1] < args.seq_len:
        length = int(torch.randint(args.min_doc // 2, args.max_doc // 2 + 1, (1,), generator=gen)) * 2
        length = min(length, args.seq_len - cu[-1])
        table = torch.randint(0, values, (keys,), generator=gen)
        # A document draws its keys from a few of them, so most keys repeat.
        pool = torch.randperm(keys, generator=gen)[:args.keys_per_doc]
        seen = set()
        for i in range(length):
            if i % 2 == 0:
                key = int(pool[int(torch.randint(0, len(pool), (1,), generator=gen))])
                ids.append(1 + key)
                # The token after a key is its value: predictable once seen.
                targets.append(1 + keys + int(table[key]) if key in seen and i + 1 < length else -100)
                seen.add(key)
            else:
                ids.append(1 + keys + int(table[key]))
                targets.append(-100)
        cu.append(cu[-1] + length)
    return torch.tensor(ids), torch.tensor(targets), cu


def local_indices(tokens, rank, world, layout):
    """The global token indices this rank holds (kdacp/layout.hpp's rule:
    contiguous runs of T/P, or zigzag parts r and 2P-1-r of T/2P)."""
    if layout == "contiguous":
        n = tokens // world
        return torch.arange(rank * n, (rank + 1) * n)
    n = tokens // (2 * world)
    first = torch.arange(rank * n, (rank + 1) * n)
    second = torch.arange((2 * world - 1 - rank) * n, (2 * world - rank) * n)
    return torch.cat([first, second])


# -- the model -----------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class ShortConv(nn.Module):
    """A depthwise causal convolution over time, kdacp.torch.causal_conv1d."""

    def __init__(self, dim, width):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, width) / math.sqrt(width))

    def forward(self, x, cu_seqlens, cp_context):
        y, _ = kt.causal_conv1d(x, self.weight, None, activation="silu",
                                cu_seqlens=cu_seqlens, cp_context=cp_context)
        return y


class KdaAttention(nn.Module):
    def __init__(self, dim, heads, head_dim, conv_width, gate_rank=16):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(dim, inner, bias=False)
        self.k_proj = nn.Linear(dim, inner, bias=False)
        self.v_proj = nn.Linear(dim, inner, bias=False)
        self.q_conv = ShortConv(inner, conv_width)
        self.k_conv = ShortConv(inner, conv_width)
        self.v_conv = ShortConv(inner, conv_width)
        self.f_down = nn.Linear(dim, gate_rank, bias=False)
        self.f_up = nn.Linear(gate_rank, inner, bias=False)
        self.b_proj = nn.Linear(dim, heads, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1, 16)))
        # dt_bias = softplus^-1 of a time step in [1e-3, 1e-1].
        dt = torch.exp(torch.empty(inner).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.g_proj = nn.Linear(dim, inner, bias=False)
        self.o_norm = RMSNorm(head_dim)
        self.o_proj = nn.Linear(inner, dim, bias=False)

    def forward(self, x, cu_seqlens, cp_context):
        b, t, _ = x.shape
        shape = (b, t, self.heads, self.head_dim)
        q = self.q_conv(self.q_proj(x), cu_seqlens, cp_context).view(shape)
        k = self.k_conv(self.k_proj(x), cu_seqlens, cp_context).view(shape)
        v = self.v_conv(self.v_proj(x), cu_seqlens, cp_context).view(shape)
        g = self.f_up(self.f_down(x)).view(shape)
        beta = self.b_proj(x)
        o, _ = kt.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                            cu_seqlens=cu_seqlens, cp_context=cp_context,
                            A_log=self.A_log, dt_bias=self.dt_bias)
        o = self.o_norm(o) * torch.sigmoid(self.g_proj(x).view(shape))
        return self.o_proj(o.reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, head_dim, conv_width):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = KdaAttention(dim, heads, head_dim, conv_width)
        self.mlp_norm = RMSNorm(dim)
        self.gate_up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x, cu_seqlens, cp_context):
        x = x + self.attn(self.attn_norm(x), cu_seqlens, cp_context)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, vocab, dim, layers, heads, head_dim, conv_width):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, head_dim, conv_width) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, cu_seqlens, cp_context):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cu_seqlens, cp_context)
        return self.head(self.norm(x))


# -- training ------------------------------------------------------------------

def train(rank, world, args, init_file):
    torch.set_num_threads(max(1, args.threads // world))
    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        group = dist.group.WORLD
    dtype = DTYPES[args.dtype]
    amp = dtype == torch.bfloat16
    torch.manual_seed(args.seed)  # the same parameters on every rank
    vocab = 1 + args.keys + args.values
    model = Model(vocab, args.dim, args.layers, args.heads, args.head_dim, args.conv_width)
    model = model.to(torch.float32 if amp else dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    losses, tokens, elapsed = [], 0, 0.0
    for step in range(args.steps):
        ids, targets, cu = make_batch(step, args)
        n_targets = int((targets >= 0).sum())
        start = time.perf_counter()
        if world > 1:
            # One context per batch: the cross-rank agreement, the layout
            # and its cuts, the exchange, built once for every layer's calls.
            ctx = kt.build_cp_context(cu, group, conv1d_kernel_size=args.conv_width,
                                      layout=args.layout)
            mine = local_indices(args.seq_len, rank, world, args.layout)
            ids, targets, cu_local = ids[mine], targets[mine], None
        else:
            ctx, cu_local = None, torch.tensor(cu)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(ids.unsqueeze(0), cu_local, ctx)
        logits = logits.float() if amp else logits
        loss_sum = F.cross_entropy(logits.view(-1, vocab), targets,
                                   ignore_index=-100, reduction="sum")
        opt.zero_grad(set_to_none=True)
        (loss_sum / n_targets).backward()
        if world > 1:
            # Each rank's loss is its share of the global one: sum the shares.
            for p in model.parameters():
                dist.all_reduce(p.grad)
            total = loss_sum.detach().clone()
            dist.all_reduce(total)
        else:
            total = loss_sum.detach()
        opt.step()
        elapsed += time.perf_counter() - start
        tokens += args.seq_len
        losses.append(float(total) / n_targets)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.5f}  {tokens / elapsed:,.0f} tokens/s",
                  flush=True)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        result = {"world": world, "layout": args.layout, "dtype": args.dtype,
                  "steps": args.steps, "seq_len": args.seq_len, "parameters": params,
                  "losses": losses, "tokens_per_s": tokens / elapsed}
        print(f"{params} parameters, {world} process(es), {args.layout}: loss "
              f"{losses[0]:.4f} -> {losses[-1]:.4f}, {tokens / elapsed:,.0f} tokens/s")
        if args.json_out:
            tmp = args.json_out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f, indent=1)
            os.replace(tmp, args.json_out)  # never a partial file
    if world > 1:
        dist.barrier()
        del ctx  # the context's layers hold the group's communicator: drop them first
        dist.destroy_process_group()
        # torch 1.13 aborts ("terminate called without an active exception")
        # when a gloo worker thread takes the GIL during interpreter shutdown:
        # give them a moment to finish with their last tensors.
        time.sleep(0.2)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="processes (CP degree) over gloo")
    p.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per step (one packed stream)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--conv-width", type=int, default=4)
    p.add_argument("--keys", type=int, default=32)
    p.add_argument("--values", type=int, default=32)
    p.add_argument("--keys-per-doc", type=int, default=8)
    p.add_argument("--min-doc", type=int, default=32, help="shortest document (tokens)")
    p.add_argument("--max-doc", type=int, default=512, help="longest document (tokens)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads in all (split over the processes)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--json-out", help="write the loss curve and tokens/s here (atomically)")
    args = p.parse_args(argv)
    parts = args.nproc * (2 if args.layout == "zigzag" else 1)
    checks = [(args.nproc >= 1, "--nproc must be >= 1"),
              (args.steps >= 1, "--steps must be >= 1"),
              (args.seq_len >= 2 and args.seq_len % parts == 0,
               f"--seq-len must be a positive multiple of {parts} (the parts of the layout)"),
              (2 <= args.conv_width <= 8, "--conv-width must be in [2, 8]"),
              (2 <= args.min_doc <= args.max_doc, "--min-doc must be in [2, --max-doc]"),
              (1 <= args.keys_per_doc <= args.keys, "--keys-per-doc must be in [1, --keys]"),
              (args.log_every >= 1, "--log-every must be >= 1")]
    for ok, message in checks:
        if not ok:
            p.error(message)
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.nproc == 1:
        train(0, 1, args, None)
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(train, args=(args.nproc, args, os.path.join(tmp, "init")),
                           nprocs=args.nproc, start_method="spawn")


if __name__ == "__main__":
    main()
