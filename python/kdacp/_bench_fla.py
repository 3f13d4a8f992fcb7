"""python3 -m kdacp.bench --fla: what a flash-linear-attention user trading
its GPU for kdacp on the CPU asks first, measured in one run.

1. bfloat16 vs float32: kdacp.torch.chunk_kda forward + backward at B = 1,
   T = --tokens, H = 4, K = V = 128, in two configurations: "ready" (q, k
   with unit rows, v, g <= 0, beta in (0, 1), no in-kernel flags) and
   "fla_flags" (the flags fla's KDA layer trains with: raw gate with A_log
   and dt_bias, q/k l2norm, beta sigmoid; A_log and dt_bias stay float32).
   The four (configuration, dtype) steps are timed interleaved in one run,
   so the ratio float32 / bfloat16 (> 1: bfloat16 faster) compares like
   with like; absolute times depend on the machine and its neighbours.
   Peak memory of one step, per (configuration, dtype) in a fresh process
   (python -m kdacp._bench_fla; the four run side by side after the
   timings): Linux's resident-set high-water mark
   (VmHWM) is reset through /proc/self/clear_refs just before the step and
   read just after; the row gives its rise above the resident set before
   the step. glibc's mmap threshold is pinned at 64 KiB in that process
   (MALLOC_MMAP_THRESHOLD_) so that freed tensors leave the resident set
   rather than wait in malloc's pool for reuse: the figure is the step's
   peak working set, every allocation counted (torch's and kdacp's C++
   buffers alike, which torch.profiler's memory events would miss), up to
   small allocations served from pages already resident. "first" is the
   process's first step (kdacp builds and keeps its C++ layer and thread
   pool then), "step" a later one (the steady state of a training loop).
   Where clear_refs cannot be written, the rise of getrusage's ru_maxrss
   over the step is given instead: a lower bound (memory = "maxrss").
2. torch.compile vs eager: a block projecting x [1, T, 512] to q, k, v,
   the raw gate and beta, chunk_kda with fla's flags, then an output
   projection; float32, forward + backward. The compiled block is
   torch.compile(block, fullgraph=True) (inductor); its first call
   (compilation included, after torch._dynamo.reset(); inductor's on-disk
   cache can shorten a rerun) is reported on its own, the later calls are
   timed interleaved with eager's: ratio eager / compiled (> 1: compiled
   faster). Skipped under torch < 2.4 (no torch.library.custom_op).
3. fla's KDAForCausalLM (hidden 256, 2 layers, 4 heads of 64, vocab 1000,
   float32) on kdacp.torch.use_with_fla(): one training step (forward, the
   cross-entropy over the rank's tokens, backward, one all-reduce of the
   flattened gradients, AdamW) on --tokens tokens in total, one document,
   at each process count of --ranks (gloo, one process per rank, the tokens
   split evenly in a contiguous layout; the CP context is built inside the
   step, once per batch as in training). The median step time is the
   slowest rank's; tokens/s = tokens / that time; the speed-up is against
   the 1-process row (no context: the model as one process runs it). Below
   each row, the slowest rank's median of each phase (context build,
   forward, backward, gradient all-reduce, AdamW) and of the step's CPU
   time (time.process_time: what a neighbour's load does not inflate, as
   it does wall time). Every row's first loss is the same model on the
   same batch. The process counts run one after another, not interleaved:
   on a shared machine compare their CPU times too. Skipped when
   flash-linear-attention is not importable (Debian's torch 1.13).

Defaults with --fla: --tokens 2048, --iters 5, --warmup 1, --threads 1
(per process), --ranks 1 2 4: about a minute on a 2-core machine. With
--ranks above the core count the processes share cores: no speed-up is
expected there. --json FILE writes the rows (the table's values, unrounded)
to FILE, atomically.
"""

import datetime
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

H, K, V, D = 4, 128, 128, 512
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CONFIGS = ("ready", "fla_flags")
DEFAULTS = {"tokens": 2048, "iters": 5, "warmup": 1, "threads": 1, "ranks": [1, 2, 4]}
MODEL = dict(hidden_size=256, num_hidden_layers=2, num_heads=4, head_dim=64, vocab_size=1000,
             fuse_cross_entropy=False, use_cache=False)
MODEL_TEXT = "KDAForCausalLM hidden 256, 2 layers, 4 heads x 64, vocab 1000"
PHASES = ("context", "forward", "backward", "all_reduce", "adamw")
FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True)


def _interleaved(fns, iters, warmup, barrier=None):
    """Median seconds of each fn; every iteration runs all of them in an
    order that rotates, so a noisy neighbour hits them alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for it in range(iters):
        for i in range(len(fns)):
            j = (i + it) % len(fns)
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            fns[j]()
            times[j].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def chunk_step(config, dtype, t, seed=0):
    """A function running one chunk_kda forward + backward of `config` in
    `dtype` at B = 1, T = t, H, K, V (its gradients dropped after)."""
    import kdacp.torch as kt
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v, g, beta = rnd(1, t, H, K), rnd(1, t, H, K), rnd(1, t, H, V), rnd(1, t, H, K), \
        rnd(1, t, H)
    extra = {}
    if config == "ready":
        k = F.normalize(k, dim=-1)
        g = 0.1 * F.logsigmoid(g)
        beta = torch.sigmoid(beta)
    else:
        extra = dict(FLAGS, A_log=torch.log(1 + 7 * torch.rand(H, generator=gen)),
                     dt_bias=0.5 * rnd(H * K))
    leaves = [x.to(dtype).requires_grad_(True) for x in (q, k, v, g, beta)]
    for name in ("A_log", "dt_bias"):
        if name in extra:
            extra[name].requires_grad_(True)
            leaves.append(extra[name])
    d_o = rnd(1, t, H, V).to(dtype)

    def step():
        o, _ = kt.chunk_kda(*leaves[:5], **extra)
        o.backward(d_o)
        for x in leaves:
            x.grad = None

    return step


# -- peak memory, in a fresh process -------------------------------------------

def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def _step_rise(step):
    """(bytes the resident set peaked above its size before the step, bytes
    it stayed above it after the step, method); kept is None with maxrss."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _status_kib("VmRSS")
        step()
        peak = _status_kib("VmHWM")
        gc.collect()
        return (peak - before) * 1024, (_status_kib("VmRSS") - before) * 1024, "vmhwm"
    except OSError:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        step()
        rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        return rise * 1024, None, "maxrss"


def _memory_child(config, dtype_name, tokens, threads):
    """One process: a step at T = 16 (the process's one-time costs: code
    paged in, kdacp's C++ layer and threads), then at T = tokens the rise
    of the first step, what it kept, and the rise of the third, as JSON."""
    torch.set_num_threads(threads)
    chunk_step(config, DTYPES[dtype_name], 16)()
    step = chunk_step(config, DTYPES[dtype_name], tokens)
    first, kept, method = _step_rise(step)
    step()
    later, _, _ = _step_rise(step)
    print(json.dumps({"first": first, "kept": kept, "step": later, "method": method}))


def peak_memory(pairs, tokens, threads):
    """_memory_child's result for each (config, dtype name), each in a fresh
    interpreter (run side by side: each measures its own resident set)."""
    import kdacp
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="131072")
    root = os.path.dirname(os.path.dirname(os.path.abspath(kdacp.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    children = [subprocess.Popen([sys.executable, "-m", "kdacp._bench_fla", config, dtype,
                                  str(tokens), str(threads)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for config, dtype in pairs]
    results = []
    try:
        for (config, dtype), child in zip(pairs, children):
            out, err = child.communicate()
            if child.returncode != 0:
                raise RuntimeError(f"kdacp.bench --fla: the memory process for {config} {dtype} "
                                   f"failed (exit {child.returncode}): {err.strip()[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for child in children:  # the others, when one failed
            if child.poll() is None:
                child.kill()
                child.wait()
    return results


def dtype_rows(args):
    t = args.tokens
    pairs = [(c, d) for c in CONFIGS for d in DTYPES]
    torch.set_num_threads(args.threads)
    steps = [chunk_step(c, DTYPES[d], t) for c, d in pairs]
    times = _interleaved(steps, args.iters, args.warmup)
    rows = []
    for (config, dtype), sec, mem in zip(pairs, times, peak_memory(pairs, t, args.threads)):
        rows.append({"row": "dtype", "config": config, "shape": f"B=1 T={t} H={H} K={K} V={V}",
                     "dtype": dtype, "threads": args.threads, "median_s": sec,
                     "peak_first_bytes": mem["first"], "kept_bytes": mem["kept"],
                     "peak_step_bytes": mem["step"],
                     "memory": mem["method"]})
    for config in CONFIGS:
        f32, bf16 = (next(r for r in rows if r["config"] == config and r["dtype"] == d)
                     for d in DTYPES)
        ratio = f32["median_s"] / bf16["median_s"]
        f32["float32_over_bfloat16"] = bf16["float32_over_bfloat16"] = ratio
    return rows


# -- torch.compile vs eager -------------------------------------------------------

class Block(torch.nn.Module):
    """x [B, T, D] -> q, k, v, raw gate, beta -> chunk_kda with fla's flags
    -> output projection [B, T, D]."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.g = (torch.nn.Linear(D, H * K, bias=False) for _ in range(3))
        self.v = torch.nn.Linear(D, H * V, bias=False)
        self.beta = torch.nn.Linear(D, H, bias=False)
        self.o = torch.nn.Linear(H * V, D, bias=False)
        self.A_log = torch.nn.Parameter(torch.log(1 + 7 * torch.rand(H)))
        self.dt_bias = torch.nn.Parameter(0.5 * torch.randn(H * K))

    def forward(self, x):
        import kdacp.torch as kt
        b, t, _ = x.shape
        o, _ = kt.chunk_kda(self.q(x).view(b, t, H, K), self.k(x).view(b, t, H, K),
                            self.v(x).view(b, t, H, V), self.g(x).view(b, t, H, K),
                            self.beta(x), A_log=self.A_log, dt_bias=self.dt_bias, **FLAGS)
        return self.o(o.reshape(b, t, H * V))


def compile_unavailable():
    """Why torch.compile of chunk_kda cannot be measured here, or None."""
    from kdacp import _ops
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 4) or not _ops.AVAILABLE or not hasattr(torch, "compile"):
        return (f"torch {torch.__version__}: kdacp's ops compile under torch >= 2.4 "
                "(torch.library.custom_op)")
    return None


def compile_rows(args):
    reason = compile_unavailable()
    if reason is not None:
        return [{"row": "compile", "skipped": reason}]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    block = Block()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, D, generator=gen)
    d_y = torch.randn(1, args.tokens, D, generator=gen)

    def step(fn):
        def run():
            fn(x).backward(d_y)
            block.zero_grad(set_to_none=True)
        return run

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    t0 = time.perf_counter()
    step(compiled)()
    compile_s = time.perf_counter() - t0
    eager_s, compiled_s = _interleaved([step(block), step(compiled)], args.iters, args.warmup)
    return [{"row": "compile", "shape": f"x [1, {args.tokens}, {D}], H={H} K={K} V={V}",
             "dtype": "float32", "threads": args.threads, "eager_median_s": eager_s,
             "compiled_median_s": compiled_s, "compile_s": compile_s,
             "eager_over_compiled": eager_s / compiled_s}]


# -- fla's model through kdacp, 1..P processes --------------------------------------

def fla_unavailable():
    """Why fla's model cannot run here, or None."""
    try:
        import fla.models  # noqa: F401
    except Exception as e:  # fla's import fails on old torch with errors of many types
        return f"flash-linear-attention is not importable ({type(e).__name__}: {e})"
    return None


def _train_worker(rank, world, tokens, threads, iters, warmup, init_file, out_file):
    import kdacp
    import kdacp.torch as kt
    from fla.models import KDAConfig, KDAForCausalLM
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=kdacp.defaults()["timeout"]))
    torch.manual_seed(0)
    model = KDAForCausalLM(KDAConfig(**MODEL))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (1, tokens), generator=gen)
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    count = tokens - 1
    cu = torch.tensor([0, tokens])
    losses, phases = [], []
    with kt.use_with_fla() as fla_on_kdacp:
        def step():
            marks, cpu0 = [time.perf_counter()], time.process_time()
            ctx, local = None, (lambda t: t)
            if world > 1:
                ctx = kt.build_cp_context(cu, dist.group.WORLD,
                                          conv1d_kernel_size=model.config.conv_size,
                                          threads=threads)
                (a, e), = ctx.global_layout.local_parts(rank)

                def local(t):
                    return t[:, a:e]
            marks.append(time.perf_counter())
            opt.zero_grad(set_to_none=True)
            with fla_on_kdacp.cp(ctx):
                logits = model(input_ids=local(ids),
                               cu_seqlens=cu if ctx is None else ctx.cu_seqlens).logits
            loss = F.cross_entropy(logits.flatten(0, 1), local(targets).flatten(),
                                   ignore_index=-100, reduction="sum") / count
            marks.append(time.perf_counter())
            loss.backward()
            marks.append(time.perf_counter())
            total = loss.detach().clone()
            if world > 1:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                flat = torch.cat([g.reshape(-1) for g in grads] + [total.reshape(1)])
                dist.all_reduce(flat)
                total = flat[-1]
                for p, g in zip(params, flat[:-1].split([g.numel() for g in grads])):
                    p.grad = g.view_as(p)
            marks.append(time.perf_counter())
            opt.step()
            marks.append(time.perf_counter())
            losses.append(float(total))
            phases.append([b - a for a, b in zip(marks, marks[1:])]
                          + [time.process_time() - cpu0])

        barrier = dist.barrier if world > 1 else None
        sec, = _interleaved([step], iters, warmup, barrier)
    # The step's median, then each phase's (context, forward, backward,
    # all-reduce, AdamW) and the step's CPU time: the slowest rank's.
    t = torch.tensor([sec] + [statistics.median(p) for p in zip(*phases[warmup:])],
                     dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"median_s": float(t[0]), "phases_s": dict(zip(PHASES, t[1:-1].tolist())),
                       "cpu_s": float(t[-1]), "first_loss": losses[0]}, f)


def fla_rows(args):
    reason = fla_unavailable()
    if reason is not None:
        return [{"row": "fla_train", "skipped": reason}]
    rows = []
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.start_processes(_train_worker, args=(world, args.tokens, args.threads, args.iters,
                                                    args.warmup, os.path.join(tmp, "init"), out),
                               nprocs=world, start_method="spawn")
            with open(out) as f:
                got = json.load(f)
        rows.append({"row": "fla_train", "processes": world, "model": MODEL_TEXT,
                     "shape": f"T={args.tokens} total, {args.tokens // world} per rank",
                     "dtype": "float32", "threads": args.threads, "median_s": got["median_s"],
                     "tokens_per_s": args.tokens / got["median_s"], "phases_s": got["phases_s"],
                     "cpu_s": got["cpu_s"],
                     "first_loss": got["first_loss"]})
    one = next((r for r in rows if r["processes"] == 1), None)
    for r in rows:
        if one is not None:
            r["speedup_vs_1"] = one["median_s"] / r["median_s"]
    return rows


# -- output -----------------------------------------------------------------------

def _mib(n):
    return f"{n / 2**20:8.2f}"


def table(rows):
    """The rows as the lines printed."""
    lines = []
    for kind, title in (("dtype", "chunk_kda forward + backward, bfloat16 vs float32"),
                        ("compile", "torch.compile(fullgraph=True) vs eager, forward + backward"),
                        ("fla_train", f"{MODEL_TEXT}: one training step through kdacp")):
        mine = [r for r in rows if r["row"] == kind]
        if mine:
            lines.append(title)
        for r in mine:
            if "skipped" in r:
                lines.append(f"  skipped: {r['skipped']}")
            elif kind == "dtype":
                lines.append(f"  {r['config']:<9} {r['shape']:<28} {r['dtype']:<8} threads "
                             f"{r['threads']}  {r['median_s'] * 1e3:9.2f} ms  f32/bf16 "
                             f"{r['float32_over_bfloat16']:5.2f}x  MiB: first peak "
                             f"{_mib(r['peak_first_bytes'])} kept "
                             f"{'-' if r['kept_bytes'] is None else _mib(r['kept_bytes'])} "
                             f"later peak {_mib(r['peak_step_bytes'])} ({r['memory']})")
            elif kind == "compile":
                lines.append(f"  {r['shape']} {r['dtype']} threads {r['threads']}: eager "
                             f"{r['eager_median_s'] * 1e3:.2f} ms, compiled "
                             f"{r['compiled_median_s'] * 1e3:.2f} ms, eager/compiled "
                             f"{r['eager_over_compiled']:.2f}x; first call (compiling) "
                             f"{r['compile_s']:.1f} s")
            else:
                speed = (f"  {r['speedup_vs_1']:5.2f}x vs 1 process"
                         if "speedup_vs_1" in r else "")
                lines.append(f"  P={r['processes']}  {r['shape']:<28} {r['dtype']} threads/rank "
                             f"{r['threads']}  {r['median_s'] * 1e3:9.1f} ms  "
                             f"{r['tokens_per_s']:9.0f} tokens/s{speed}  first loss "
                             f"{r['first_loss']:.6f}")
                lines.append("       slowest rank's medians, ms: " + ", ".join(
                    f"{name} {r['phases_s'][name] * 1e3:.1f}" for name in PHASES)
                    + f"; the step's CPU time {r['cpu_s'] * 1e3:.1f}")
    return lines


def write_json(path, payload):
    """payload to path through a temporary file in its folder and os.replace."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".kdacp-bench-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def check_args(args, parser):
    """--fla's defaults and ranges (parser.error names the flag)."""
    for name in ("tokens", "iters", "warmup", "threads", "ranks"):
        if getattr(args, name) is None:
            setattr(args, name, DEFAULTS[name])
    for name, low in (("tokens", 1), ("iters", 1), ("warmup", 0)):
        if getattr(args, name) < low:
            parser.error(f"--{name} is {getattr(args, name)}, expected >= {low} with --fla")
    for p in args.ranks:
        if p < 1:
            parser.error(f"--ranks: {p} processes, expected >= 1")
        if args.tokens % p:
            parser.error(f"--tokens {args.tokens} is not divisible by --ranks {p} (the model "
                         "row splits the tokens evenly)")


def main(args, parser):
    check_args(args, parser)
    print(f"python3 -m kdacp.bench --fla: torch {torch.__version__}, medians of {args.iters} "
          f"iterations after {args.warmup} warm-up; times are one run's (ratios compare)",
          flush=True)
    rows = []
    for part in (dtype_rows, compile_rows, fla_rows):
        new = part(args)
        rows += new
        for line in table(new):
            print(line, flush=True)
    if args.json:
        write_json(args.json, {"torch": torch.__version__, "tokens": args.tokens,
                               "iters": args.iters, "warmup": args.warmup,
                               "threads": args.threads, "ranks": args.ranks, "rows": rows})


if __name__ == "__main__":
    _memory_child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
