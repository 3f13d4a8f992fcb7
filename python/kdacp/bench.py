"""python3 -m kdacp.bench: kdacp from PyTorch against what a PyTorch user
writes without it, over gloo on localhost (one process per rank).

1. The exchange, forward + backward: the allgather protocol through
   kdacp.torch.build_kda_state_cp vs dist.all_gather of [S|M] and a
   torch.matmul fold loop from the zero state (what a user writes: rank r
   folds r maps, the first a product with zeros, which kdacp skips, SPEC §3),
   same run, same group, same inputs, iterations interleaved.
2. The binding's overhead: kdacp.torch.kda (forward + backward through
   autograd) vs the time the C++ layer itself reports for the same calls.
3. A CP context's per-call saving: chunk_kda(..., cp_context=ctx) with a
   context built once (no agreement message per call) vs kda(..., group=...)
   (one agreement all-gather per forward and per backward), calls/s, the
   same tensors; and chunk_kda with the three in-kernel flags on (raw gate,
   A_log, dt_bias, q/k l2norm, beta sigmoid: the C++ transforms' cost), in
   float32 and with q, k, v, g, beta in bfloat16 (flash-linear-attention's
   training dtype: the transforms' results are float32); and chunk_kda
   without the flags, bfloat16 against float32 inputs (the chunk kernels
   read bfloat16 in place, computing in float32; results narrowed back).

Times are medians over --iters iterations, the slowest rank's.

--fla instead measures what a flash-linear-attention user asks (kdacp/_bench_fla.py,
docs/fla-models.md): chunk_kda in bfloat16 vs float32 (time, peak memory),
torch.compile vs eager, and fla's KDAForCausalLM training step at 1, 2, 4 processes.

--cold instead times a process's first kdacp.torch.kda call (one process, no
group: forward + o.sum().backward(), or o.backward(d_o) with --given-grad)
against its warm calls: --processes fresh interpreters, each timing --calls
calls (wall, CPU and system time, minor page faults from getrusage); warm is
the median of calls 3 on (call 2 may still meet torch's allocator growing).
"""

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kdacp
import kdacp.torch as kt
from kdacp import _kdacp, _layer


def _median_max(seconds):
    """The slowest rank's median."""
    t = torch.tensor([statistics.median(seconds)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _plain_torch(s, m, g, rank, world):
    """forward + backward as a PyTorch user writes it: gather [S|M] (then
    [G|M]), fold from the zero state with torch.matmul."""
    v = s.shape[-1]
    slots = [torch.empty(s.shape[:-1] + (v + m.shape[-1],)) for _ in range(world)]
    dist.all_gather(slots, torch.cat([s, m], dim=-1))
    x = torch.zeros_like(s)
    for j in range(rank):
        x = torch.matmul(slots[j][..., v:], x) + slots[j][..., :v]
    dist.all_gather(slots, torch.cat([g, m], dim=-1))
    y = torch.zeros_like(g)
    for j in range(world - 1, rank, -1):
        y = torch.matmul(slots[j][..., v:].transpose(-1, -2), y) + slots[j][..., :v]
    return x, y


def _layer_inputs(seed, t, h, k, v):
    """Leaves q, k (unit rows), v, g in [-0.1, 0), beta [1,T,H,...] and a d_o."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, h, k, generator=gen)
    kk = torch.nn.functional.normalize(torch.randn(1, t, h, k, generator=gen), dim=-1)
    vv = torch.randn(1, t, h, v, generator=gen)
    g = -0.1 * torch.rand(1, t, h, k, generator=gen)
    beta = torch.rand(1, t, h, generator=gen)
    leaves = [x.requires_grad_(True) for x in (q, kk, vv, g, beta)]
    return leaves, torch.randn(1, t, h, v, generator=gen)


def _worker(rank, world, init_file, args, out_file):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=kdacp.defaults()["timeout"]))
    gen = torch.Generator().manual_seed(rank)
    b, h, k, v = 1, args.bh, args.key_dim, args.value_dim
    s = torch.randn(b, h, k, v, generator=gen)
    m = 0.05 * torch.randn(b, h, k, k, generator=gen)
    g = torch.randn(b, h, k, v, generator=gen)

    def measure(fns):
        """Median seconds of each fn; every iteration runs all of them, in an
        order that rotates, so a noisy neighbour hits them alike."""
        for _ in range(args.warmup):
            for fn in fns:
                fn()
        times = [[] for _ in fns]
        for it in range(args.iters):
            for i in range(len(fns)):
                j = (i + it) % len(fns)
                dist.barrier()
                t0 = time.perf_counter()
                fns[j]()
                times[j].append(time.perf_counter() - t0)
        return [_median_max(t) for t in times]

    checked = kt.build_kda_state_cp(None, "allgather", threads=args.threads, check_ranks=True)
    ex = kt.build_kda_state_cp(None, "allgather", threads=args.threads, check_ranks=False)
    x, y = _plain_torch(s, m, g, rank, world)
    # The same values (not bits: torch.matmul's order differs from the chain's).
    err = max(float((ex.forward(s, m) - x).abs().max()), float((ex.backward(g, m) - y).abs().max()))
    t_checked, t_kdacp, t_plain = measure([
        lambda: (checked.forward(s, m), checked.backward(g, m)),
        lambda: (ex.forward(s, m), ex.backward(g, m)),
        lambda: _plain_torch(s, m, g, rank, world)])
    rows = [("kdacp allgather (check_ranks=True)", t_checked),
            ("kdacp allgather (check_ranks=False)", t_kdacp),
            ("torch all_gather + matmul fold", t_plain)]

    # kt.kda vs the C++ layer's own time for the same calls.
    t_local = args.tokens
    hv = args.bh
    leaves, d_o = _layer_inputs(100 + rank, t_local, hv, k, v)
    layer_times = []

    def kda_step():
        o, _ = kt.kda(*leaves, group=dist.group.WORLD, protocol="allgather",
                      threads=args.threads)
        o.backward(d_o)
        lay = next(iter(_layer._LAYERS.values()))  # the one layer these calls use
        f, bw = lay.times(True), lay.times(False)
        layer_times.append(sum(f) + sum(bw))
        for x_ in leaves:
            x_.grad = None

    _layer._LAYERS.clear()
    t_kda, = measure([kda_step])
    t_layer = _median_max(layer_times[args.warmup:])

    # chunk_kda on a context built once vs kda agreeing per call.
    ctx = kt.build_cp_context(None, dist.group.WORLD, split=[t_local] * world,
                              protocol="allgather", threads=args.threads)
    a_log = torch.zeros(hv, requires_grad=True)
    dt_bias = torch.zeros(hv * k, requires_grad=True)
    raw = torch.randn(1, t_local, hv, k, generator=gen).requires_grad_(True)

    half = [x_.detach().bfloat16().requires_grad_(True) for x_ in leaves + [raw]]
    d_o_half = d_o.bfloat16()

    def step(fn, d=d_o):
        def run():
            o, _ = fn()
            o.backward(d)
            for x_ in leaves + [a_log, dt_bias, raw] + half:
                x_.grad = None
        return run

    with_ctx = step(lambda: kt.chunk_kda(*leaves, cp_context=ctx))
    per_call = step(lambda: kt.kda(*leaves, group=dist.group.WORLD, protocol="allgather",
                                   threads=args.threads))
    flags = step(lambda: kt.chunk_kda(leaves[0], leaves[1], leaves[2], raw, leaves[4],
                                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                      use_beta_sigmoid_in_kernel=True, A_log=a_log,
                                      dt_bias=dt_bias, cp_context=ctx2))
    flags_bf16 = step(lambda: kt.chunk_kda(half[0], half[1], half[2], half[5], half[4],
                                           use_qk_l2norm_in_kernel=True,
                                           use_gate_in_kernel=True,
                                           use_beta_sigmoid_in_kernel=True, A_log=a_log,
                                           dt_bias=dt_bias, cp_context=ctx4), d_o_half)
    plain_bf16 = step(lambda: kt.chunk_kda(*half[:5], cp_context=ctx3), d_o_half)
    # A context per set of arguments (the storage dtypes are among them).
    ctx2, ctx3, ctx4 = (kt.build_cp_context(None, dist.group.WORLD, split=[t_local] * world,
                                            protocol="allgather", threads=args.threads)
                        for _ in range(3))
    t_ctx, t_call, t_flags, t_bf16, t_plain16 = measure([with_ctx, per_call, flags, flags_bf16,
                                                         plain_bf16])
    if rank == 0:
        with open(out_file, "w") as f:
            f.write(f"P={world} B*H={b * h} K={k} V={v} float32, threads/rank={args.threads}\n")
            for name, t in rows:
                f.write(f"  exchange fwd+bwd  {name:<42} {t * 1e3:9.3f} ms\n")
            f.write(f"  speed-up of kdacp over plain torch: {t_plain / t_kdacp:.2f}x "
                    f"(check_ranks=True: {t_plain / t_checked:.2f}x); max |diff| {err:.2e}\n")
            f.write(f"  kda fwd+bwd T_local={t_local} H=HV={hv}: kdacp.torch.kda {t_kda * 1e3:9.3f} ms,"
                    f" C++ layer {t_layer * 1e3:9.3f} ms, ratio {t_kda / t_layer:.3f}\n")
            f.write(f"  chunk_kda fwd+bwd with a cp_context {1 / t_ctx:9.1f} calls/s, kda agreeing "
                    f"per call {1 / t_call:9.1f} calls/s: {t_call / t_ctx:.3f}x; with the "
                    f"in-kernel gate/l2norm/sigmoid {1 / t_flags:9.1f} calls/s\n")
            f.write(f"  chunk_kda fwd+bwd with the flags, bfloat16 inputs {1 / t_bf16:9.1f} calls/s vs "
                    f"float32 {1 / t_flags:9.1f} calls/s: {t_flags / t_bf16:.3f}x\n")
            f.write(f"  chunk_kda fwd+bwd, bfloat16 q, k, v, g, beta read in place {1 / t_plain16:9.1f} "
                    f"calls/s vs float32 {1 / t_ctx:9.1f} calls/s: {t_ctx / t_plain16:.3f}x\n")
    dist.destroy_process_group()


def _threads(text):
    """--threads: a count in [1, the CLI's --threads maximum], read by the
    C++ parser (kdacp/units.hpp) so that its text and limits are the CLI's."""
    try:
        return _kdacp.parse_integer(text, "--threads", 1, _kdacp.threads_range[1])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cold_child(args):
    """One process: --calls kda calls at B = 1, T = --tokens, H = HV = --bh,
    K, V; one JSON line of per-call seconds and faults."""
    import json
    import resource

    leaves, d_o = _layer_inputs(0, args.tokens, args.bh, args.key_dim, args.value_dim)

    def sample():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), r.ru_utime + r.ru_stime, r.ru_stime, r.ru_minflt

    calls = []
    for _ in range(args.calls):
        a = sample()
        o, _ = kt.kda(*leaves, **({} if args.threads is None else {"threads": args.threads}))
        if args.given_grad:
            o.backward(d_o)
        else:
            o.sum().backward()
        b = sample()
        for x in leaves:
            x.grad = None
        del o
        calls.append([y - x for x, y in zip(a, b)])
    print(json.dumps(calls))


def _cold(args):
    """--processes fresh interpreters of _cold_child; per process the first
    call against the median warm call, then the medians."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kdacp.bench", "--cold-child", "--tokens", str(args.tokens),
           "--bh", str(args.bh), "--key-dim", str(args.key_dim), "--value-dim",
           str(args.value_dim), "--calls", str(args.calls)]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    if args.given_grad:
        cmd.append("--given-grad")
    print(f"kdacp.torch.kda first call vs warm: T={args.tokens} H=HV={args.bh} K={args.key_dim} "
          f"V={args.value_dim} float32 chunk, threads={args.threads or 'default'}, "
          f"{'o.backward(d_o)' if args.given_grad else 'o.sum().backward()'}, "
          f"{args.processes} processes")
    ratios, cpu_ratios = [], []
    for i in range(args.processes):
        calls = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                          text=True).stdout)
        first, warm = calls[0], calls[2:]
        wall = statistics.median(c[0] for c in warm)
        cpu = statistics.median(c[1] for c in warm)
        ratios.append(first[0] / wall)
        cpu_ratios.append(first[1] / cpu)
        print(f"  process {i}: first {first[0] * 1e3:8.1f} ms (CPU {first[1] * 1e3:.1f}, system "
              f"{first[2] * 1e3:.1f}, {first[3]} faults), warm {wall * 1e3:8.1f} ms (CPU "
              f"{cpu * 1e3:.1f}, {statistics.median(c[3] for c in warm):.0f} faults): "
              f"{ratios[-1]:.2f}x wall, {cpu_ratios[-1]:.2f}x CPU", flush=True)
    print(f"  median first/warm: {statistics.median(ratios):.2f}x wall "
          f"({min(ratios):.2f}-{max(ratios):.2f}), {statistics.median(cpu_ratios):.2f}x CPU")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m kdacp.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="process counts (2 4; --fla 1 2 4)")
    p.add_argument("--bh", type=int, default=None, help="B*H (B = 1; 16, with --cold H = HV = 4)")
    p.add_argument("--key-dim", type=int, default=128)
    p.add_argument("--value-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per rank for the kda test (256; with --cold 8192, the CLI's "
                        "default; with --fla 2048: chunk_kda's T and the model's total)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (20; --fla 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first (3; --fla 1)")
    p.add_argument("--threads", type=_threads, default=None,
                   help="threads per rank (torch and kdacp; 1, with --cold kda's default)")
    p.add_argument("--cold", action="store_true",
                   help="time a process's first kda call against warm ones (see above)")
    p.add_argument("--processes", type=int, default=7, help="--cold: fresh processes")
    p.add_argument("--calls", type=int, default=6, help="--cold: calls per process (>= 3)")
    p.add_argument("--given-grad", action="store_true",
                   help="--cold: o.backward(d_o) instead of o.sum().backward()")
    p.add_argument("--cold-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fla", action="store_true",
                   help="bfloat16 vs float32 (time, peak memory), torch.compile vs eager and "
                        "fla's KDA model's training step at 1, 2, 4 processes "
                        "(docs/fla-models.md, kdacp/_bench_fla.py)")
    p.add_argument("--json", default=None, metavar="FILE", help="--fla: write the rows here")
    args = p.parse_args(argv)
    if args.fla:
        if args.cold or args.cold_child or args.given_grad or args.bh is not None:
            p.error("--fla reads --tokens, --iters, --warmup, --threads, --ranks and --json "
                    "(not --cold, --given-grad or --bh)")
        from kdacp import _bench_fla
        return _bench_fla.main(args, p)
    if args.json is not None:
        p.error("--json needs --fla")
    args.ranks = args.ranks if args.ranks is not None else [2, 4]
    args.iters = args.iters if args.iters is not None else 20
    args.warmup = args.warmup if args.warmup is not None else 3
    cold = args.cold or args.cold_child
    args.bh = args.bh if args.bh is not None else (4 if cold else 16)
    args.tokens = args.tokens if args.tokens is not None else (8192 if cold else 256)
    if cold:
        if args.calls < 3:
            p.error("--calls must be >= 3 (the first, then warm calls from the third)")
        if args.cold_child:
            _cold_child(args)
        else:
            _cold(args)
        return
    args.threads = args.threads if args.threads is not None else 1
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result")
            mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), args, out), nprocs=world)
            with open(out) as f:
                print(f.read(), end="", flush=True)


if __name__ == "__main__":
    main()
