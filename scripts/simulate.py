#!/usr/bin/env python3
"""kdacp's state exchange on simulated clusters (SimGrid SMPI; docs/scale.md).

For each platform in platforms/ and each P, runs every configuration the cost
model weighs (the rows of `kdacp plan` with the platform's cost parameters:
every registry row, every group width, the model's segments) plus `auto`, as
`kdacp-smpi bench exchange` under smpirun: the real protocol and communicator
code, one simulated rank per process of the job, the compute bursts measured
on this host's core and scaled to the platform's speed. It writes
results.json, table.md (time beside the model, their ratio, auto's pick and
its rank) and plot.svg into --out.

Runs are folded by default (--fold always; KDACP_SMPI_FOLD=1,
src/comm/smpi/fold.hpp): every rank's large buffers map the same pages and
each fold step is charged as its flops at the platform's speed instead of
running, so only the messages and the clock are real, and the clock does not
depend on this host's load. --fold auto folds only the runs whose ranks'
memory would exceed --max-memory, --fold never none. The records say which
runs were folded.

--check runs the small simulation of `make test` instead: for each platform
and protocol, the SMPI run's incoming states and final-state gradients must
be byte-identical to the in-process backend's and the simulated time within
--tolerance of the model; the first protocol also runs folded twice, which
must say so, time within --tolerance of the model and give the same time
both times; a folded grouped_allgather_p2p w=2 with zigzag and documents at
P = 32 (whose relay acts on the cut flags it gathers) must time within
--tolerance of the model, a folded all-gather with one head (latency-bound:
each collective's agreement) within 10 %, and each --ulysses U within
--tolerance. The exit status says whether all held.

--check-doc PAGE reads the results tables of PAGE (docs/scale.md, merged
from many runs) back and checks them against themselves (make test's
docs.scale_tables).

Standard library only; run it with any Python 3 (the build's kdacp and
kdacp-smpi do the work).
"""
import argparse
import datetime
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# SMPI settings of every run (docs/scale.md says why each):
# - no privatization, one thread per simulated rank: kdacp keeps no per-rank
#   globals, and its per-thread state (memory accounting) needs real threads;
# - bandwidth and latency factors 1: the platform files state end-to-end
#   numbers; SMPI's default piecewise factors were fitted to one 2009
#   Ethernet cluster;
# - no cross-traffic: the α-β model has none, and InfiniBand/NVLink carry
#   acknowledgements out of band.
SMPI_OPTIONS = [
    "-no-privatize",
    "--cfg=contexts/factory:thread",
    "--cfg=smpi/bw-factor:0:1",
    "--cfg=smpi/lat-factor:0:1",
    "--cfg=network/crosstraffic:0",
    # The collectives' algorithms (kdacp-smpi calls the blocking ones,
    # src/comm/mpi/communicator.cpp): recursive doubling and a binomial tree,
    # what the cost model prices and Open MPI offers for these sizes; the
    # header all-reduce before each collective (the agreement) by recursive
    # doubling too, as Open MPI does a few words: ceil(log2 m) latencies,
    # what add_agreement prices (SMPI's default took one more per
    # collective, docs/scale.md).
    "--cfg=smpi/allgather:rdb",
    "--cfg=smpi/bcast:binomial_tree",
    "--cfg=smpi/allreduce:rdb",
    "--log=root.thres:warning",
]


def fail(msg):
    print(f"simulate.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def write_atomic(path, text):
    """Writes `path` whole or not at all: a temporary file beside it, renamed."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def platform_facts(name, platform_dir):
    """A platform's cost parameters (platforms/<name>.json) and, from their
    "simulation" object, its file (platforms/<name>.xml, or the .so CMake
    builds from platforms/<name>.cpp into --platform-dir), hosts, ranks per
    host and host names."""
    cost = ROOT / "platforms" / f"{name}.json"
    if not cost.is_file():
        fail(f"platform '{name}': expected platforms/{name}.json")
    sim = json.loads(cost.read_text()).get("simulation")
    if not isinstance(sim, dict) or not all(k in sim for k in ("file", "hosts", "ranks_per_host", "host_prefix")):
        fail(f"platforms/{name}.json: expected a \"simulation\" object with file, hosts, ranks_per_host, host_prefix")
    path = ROOT / "platforms" / sim["file"]
    if sim["file"].endswith(".so"):
        path = Path(platform_dir) / sim["file"]
    if not path.is_file():
        fail(f"platform '{name}': {path} not found (the .so platforms are built with kdacp-smpi)")
    return {"name": name, "xml": path, "cost": cost, "prefix": sim["host_prefix"], "hosts": int(sim["hosts"]),
            "per_host": int(sim["ranks_per_host"])}


def hostfile(facts, ranks, folder):
    per = facts["per_host"]
    nodes = math.ceil(ranks / per)
    if nodes > facts["hosts"]:
        raise ValueError(f"P = {ranks} needs {nodes} hosts, platform {facts['name']} has {facts['hosts']}")
    path = Path(folder) / f"hosts-{facts['name']}-{ranks}"
    lines = [f"{facts['prefix']}{i}:{min(per, ranks - i * per)}" for i in range(nodes)]
    path.write_text("\n".join(lines) + "\n")
    return path


UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
BYTES = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
# A row of `kdacp plan`'s table: method, knob, exact, time, unit, peak, unit.
PLAN_ROW = re.compile(r"^(\w+)((?: [wc]=\d+)?)\s+(yes|no)\s+([\d.]+) (ns|us|ms|s)\s+[\d.]+x\s+([\d.]+) "
                      r"(B|KiB|MiB|GiB|TiB)")


# Tokens per rank of `kdacp bench exchange`'s stream (its --docs-mean cuts it
# into documents): a plan with a layout needs the stream's length.
BENCH_RANK_TOKENS = 4096


def plan_rows(kdacp, facts, ranks, heads, layout="contiguous"):
    """The configurations `kdacp plan` weighs, with the model's time and
    memory, and auto's exact pick, for `layout` without cuts (the sweep's
    documents are bench exchange's, which plan does not draw; each run's model
    time, and with documents auto's pick, are bench's own, cuts included)."""
    extra = [] if layout == "contiguous" else ["--layout", layout, "--tokens", str(ranks * BENCH_RANK_TOKENS)]
    out = subprocess.run([str(kdacp), "plan", "-P", str(ranks), "-H", str(heads), *extra,
                          "--calibration", str(facts["cost"])], capture_output=True, text=True)
    if out.returncode != 0:
        fail(f"kdacp plan failed: {out.stderr.strip()}")
    rows, auto = [], None
    for line in out.stdout.splitlines():
        m = PLAN_ROW.match(line)
        if m:
            knob = m.group(2).strip()
            rows.append({"method": m.group(1), "knob": knob, "label": (m.group(1) + " " + knob).strip(),
                         "exact": m.group(3) == "yes", "model_s": float(m.group(4)) * UNITS[m.group(5)],
                         "model_peak": float(m.group(6)) * BYTES[m.group(7)]})
        m = re.match(r"^auto \(exact\): (\w+(?: [wc]=\d+)?),", line)
        if m:
            auto = m.group(1)
    if not rows or auto is None:
        fail(f"could not read kdacp plan's table:\n{out.stdout}")
    return rows, auto


def host_speed(kdacp, heads):
    """This core's fold speed (GFLOP/s) at the sweep's shape, one thread."""
    out = subprocess.run([str(kdacp), "bench", "kernels", "--dims", "128", "--chains", "4", "--threads", "1",
                          "--bh", str(heads), "--direction", "forward", "--json", "-q", "--min-time", "0.5"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]["gflops"]


# Folded runs (KDACP_SMPI_FOLD=1, src/comm/smpi/fold.hpp): every large
# buffer maps the same pages (SMPI's global shared malloc, in blocks of
# 1 GiB so that a rank's buffers take few of the kernel's vm.max_map_count
# mappings), each fold step is charged as its flops at the platform's speed,
# and nothing else this host does is: the clock is the network's and the
# fold steps', the same on every run (a real run's other host work, measured
# and scaled, adds 3-10 % at P = 16 and varies with this host's load).
FOLD_OPTIONS = ["--cfg=smpi/shared-malloc:global", "--cfg=smpi/shared-malloc-blocksize:1073741824",
                "--cfg=smpi/simulate-computation:no"]


def allgather_algorithm(members, heads):
    """The all-gather of `members` packed summaries that kdacp-smpi runs:
    SMPI's recursive doubling ("rdb", which kdacp-smpi counts in 8-byte words;
    in bytes its int counts overflowed), or, where a round's message reaches
    2 GiB, kdacp-smpi's own recursive doubling with the same rounds and each
    message in pieces under 1 GiB ("kdacp-rdb"; SMPI's failed: at P = 1024,
    H = 32 it filled this host's memory). Its own needs a power-of-two member
    count: None otherwise. SMPI's other bandwidth-optimal algorithms do not
    stand in: the neighbour exchange crashed inside SMPI after 15 minutes at
    P = 1024 on both platforms, the ring with a segmentation fault, the 2-D
    mesh took 3.9x the model at P = 64."""
    slot = heads * 128 * (128 + 128) * 4
    if (members // 2) * slot < 2**31:
        return "rdb"
    return None if members & (members - 1) else "kdacp-rdb"


def gathered_members(row, ranks, auto_pick):
    """How many summaries the run's widest all-gather gathers (0: none)."""
    label = auto_pick if row["method"] == "auto" and auto_pick else row["label"]
    method, _, knob = label.partition(" ")
    if method == "allgather":
        return ranks
    if method.startswith("grouped_allgather") and knob.startswith("w="):
        return int(knob[2:])
    return 0


def smpirun(facts, ranks, folder, speed_gf, argv, timeout, folded=False, allgather="rdb", env_extra=None):
    hosts = hostfile(facts, ranks, folder)
    options = [o if not o.startswith("--cfg=smpi/allgather:") else f"--cfg=smpi/allgather:{allgather}"
               for o in SMPI_OPTIONS]
    cmd = ["smpirun", *options, *(FOLD_OPTIONS if folded else []), f"--cfg=smpi/host-speed:{speed_gf:.6g}Gf",
           "-platform", str(facts["xml"]), "-hostfile", str(hosts), "-np", str(ranks), *map(str, argv)]
    # The simulated ranks share this process's buffer cache (kdacp/memory.hpp),
    # whose 1 GiB limit stands for one rank's: past P ~ 128 at H = 32 their idle
    # blocks outgrew it, and the buffers allocated again on the chain's
    # critical path faulted their pages in (pipelined_p2p at P = 256 on
    # Ethernet: 1.37x the model, 1.03x with a cache per rank). A GiB per rank.
    env = dict(os.environ, KDACP_BUFFER_CACHE_MB=str(1024 * ranks), KDACP_SMPI_FOLD="1" if folded else "0",
               **(env_extra or {}))
    t0 = time.monotonic()
    try:
        # In the temporary folder: smpirun leaves its unrolled hostfile in
        # the working directory when a run fails.
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=folder, env=env)
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - t0, f"took over {timeout} s of real time"
    wall = time.monotonic() - t0
    if out.returncode != 0:
        # SimGrid's abort ends in a backtrace of "  -> N# address" frames:
        # the message is above them.
        said = [l for l in out.stderr.strip().splitlines() if not l.lstrip().startswith("->")]
        tail = "\n".join(said[-6:])
        return None, wall, f"smpirun exited {out.returncode}: {tail}"
    return out.stdout, wall, None


def bench_args(row, heads, cost, repeat, warmup, layout="contiguous", docs_mean=0, tokens_per_rank=0):
    method = "auto" if row["method"] == "ulysses" else row["method"]
    args = ["bench", "exchange", "--backend", "mpi", "--protocol", method, "--heads", heads,
            "--calibration", cost, "--repeat", repeat, "--warmup", warmup, "--threads", 1, "--timeout", 86400,
            "--layout", layout, "--docs-mean", docs_mean, "--json"]
    if row["knob"].startswith("w="):
        args += ["--group-size", row["knob"][2:]]
    if row["knob"].startswith("c="):
        args += ["--segments", row["knob"][2:]]
    if row["knob"].startswith("U=") and row["knob"] != "U=1":
        args += ["--ulysses", row["knob"][2:], "--tokens-per-rank", tokens_per_rank]
    return args


def input_bytes(ranks, heads):
    # Per rank: S, M, G and the two returned states, H·K·V floats each.
    return ranks * 5 * heads * 128 * 128 * 4


# A folded rank's own memory: its thread, small buffers and the simulator's
# bookkeeping. Measured for the P = 1024 chain at H = 32: the host's used
# memory rose by about 1.3 GiB (ps counts 8.7 GiB resident, every mapping of
# the shared pages once), 1.3 MiB per rank; 4 MiB per rank is the bound used here.
FOLDED_RANK_BYTES = 4 << 20


def sweep(a):
    kdacp, smpi = Path(a.kdacp), Path(a.kdacp_smpi)
    speed = a.host_speed or host_speed(kdacp, a.heads)
    print(f"simulate: this core folds at {speed:.1f} GFLOP/s (smpi/host-speed)", file=sys.stderr)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = a.max_memory * (1 << 30)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in a.ranks:
            for name in a.platforms:
                facts = platform_facts(name, a.platform_dir)
                rows, auto_pick = plan_rows(kdacp, facts, p, a.heads, a.layout)
                # auto runs its pick: it needs that configuration's memory
                # (with documents it weighs bench's cuts, which plan has not
                # seen: any exact row's).
                if a.docs_mean:
                    auto_pick = None
                    pick_peak = max(r["model_peak"] for r in rows if r["exact"])
                else:
                    pick_peak = next((r["model_peak"] for r in rows if r["label"] == auto_pick), 0)
                rows.append({"method": "auto", "knob": "", "label": "auto", "exact": True, "model_s": None,
                             "model_peak": pick_peak})
                if a.ulysses:
                    # Ulysses x state CP at each U (dividing H and P): the
                    # all-to-alls and the model's exchange over P/U ranks;
                    # U = 1 is the plain auto.
                    peak = max(r["model_peak"] for r in rows if r["exact"])
                    rows = [{"method": "ulysses", "knob": f"U={u}", "label": f"ulysses U={u}", "exact": True,
                             "model_s": None, "model_peak": peak}
                            for u in a.ulysses if p % u == 0 and a.heads % u == 0]
                elif a.knobs == "all":
                    # plan lists pipelined_p2p at its model-best segment count;
                    # every count is a knob (bench prices each run itself).
                    extra = []
                    for r in rows:
                        if r["method"] == "pipelined_p2p" and r["knob"].startswith("c="):
                            for c in range(1, 128 // 16 + 1):
                                if f"c={c}" != r["knob"]:
                                    extra.append(dict(r, knob=f"c={c}", label=f"pipelined_p2p c={c}", model_s=None))
                    rows = rows[:-1] + extra + rows[-1:]  # auto stays last
                elif a.knobs == "best":
                    # Each protocol at its model-best knob (what auto weighs
                    # it by), and auto.
                    best = {}
                    for r in rows:
                        if r["method"] not in best or (r["model_s"] or 0) < (best[r["method"]]["model_s"] or 0):
                            best[r["method"]] = r
                    rows = [r for r in rows if best.get(r["method"]) is r]
                for row in rows:
                    if a.protocols and row["method"] not in a.protocols:
                        continue
                    if a.configurations and row["label"] not in a.configurations:
                        continue
                    rec = {"platform": name, "ranks": p, "heads": a.heads, "layout": a.layout,
                           "docs_mean": a.docs_mean, **row, "auto_pick": auto_pick}
                    need = input_bytes(p, a.heads) + p * row["model_peak"]
                    rec["memory_need_bytes"] = need
                    folded = a.fold == "always" or (a.fold == "auto" and need > budget)
                    if folded:
                        need = p * FOLDED_RANK_BYTES
                    rec["folded"] = folded
                    members = gathered_members(row, p, auto_pick)
                    algorithm = allgather_algorithm(members, a.heads) if members else "rdb"
                    rec["smpi_allgather"] = algorithm or "rdb"
                    if algorithm is None:
                        rec["skipped"] = (f"this all-gather of {members} summaries sends 2 GiB or more in a round, "
                                          "which SMPI 3.32 cannot, and kdacp-smpi's own recursive doubling needs a "
                                          "power-of-two member count")
                    if "skipped" in rec:
                        pass
                    elif need > budget:
                        rec["skipped"] = (f"needs ~{need / (1 << 30):.0f} GiB ("
                                          f"{'folded ranks' if folded else 'P x (inputs + model peak)'}), over "
                                          f"--max-memory {a.max_memory:g} GiB")
                    else:
                        stdout, wall, err = smpirun(facts, p, tmp, speed,
                                                    [smpi, *bench_args(row, a.heads, facts["cost"], a.repeat,
                                                                       a.warmup, a.layout, a.docs_mean,
                                                                       a.tokens_per_rank)],
                                                    a.timeout, folded,
                                                    "rdb")
                        rec["real_seconds"] = wall
                        if err:
                            rec["skipped"] = err
                        else:
                            r = json.loads(stdout.strip().splitlines()[-1])
                            rec.update(sim_forward_s=r["forward_seconds"], sim_backward_s=r["backward_seconds"],
                                       model_s=r["predicted_seconds"], ran=r["label"],
                                       peak_bytes=max(r["forward_peak_bytes"], r["backward_peak_bytes"]),
                                       parts=r.get("parts"), cuts=r.get("cuts"))
                            if row["method"] == "auto":
                                rec["auto_pick"] = r["label"]
                            if row["method"] == "ulysses":
                                rec["tokens_per_rank"] = a.tokens_per_rank
                                rec["all_to_all_sim_s"] = r.get("all_to_all_forward_seconds", 0.0)
                                rec["all_to_all_model_s"] = r.get("predicted_all_to_all_seconds", 0.0)
                                rec["exchange_model_s"] = r.get("predicted_exchange_seconds", r["predicted_seconds"])
                            rec["ratio"] = rec["sim_forward_s"] / rec["model_s"]
                    records.append(rec)
                    shown = (f"{rec['sim_forward_s'] * 1e3:9.3f} ms sim, model {rec['model_s'] * 1e3:9.3f} ms, "
                             f"ratio {rec['ratio']:.2f} ({rec['real_seconds']:.0f} s real"
                             f"{', folded' if folded else ''})") \
                        if "ratio" in rec else f"skipped: {rec['skipped']}"
                    print(f"simulate: {name} P={p}{case_label(rec)} {row['label']}: {shown}", file=sys.stderr,
                          flush=True)
                    write_atomic(out / "results.json", json.dumps(meta(a, speed, records), indent=1))
    write_table(out, meta(a, speed, records))
    write_plot(out, records)
    if a.configurations:
        unknown = sorted(set(a.configurations) - {r["label"] for r in records})
        if unknown:
            print(f"simulate: no configuration named {', '.join(map(repr, unknown))} at any P and platform "
                  "swept (names as in the table: 'grouped_allgather_rd w=512', 'pipelined_p2p c=8', 'auto')",
                  file=sys.stderr)
            return 2
    return 0


def meta(a, speed, records):
    return {"date": datetime.date.today().isoformat(), "heads": a.heads, "repeat": a.repeat, "warmup": a.warmup,
            "host_speed_gflops": speed, "smpi_options": SMPI_OPTIONS, "fold_options": FOLD_OPTIONS,
            "records": records}


def case_of(r):
    """A record's layout and documents (records of older sweeps have neither:
    contiguous, no cuts)."""
    return r.get("layout", "contiguous"), r.get("docs_mean", 0)


# `kdacp plan`'s row order, which a merged table keeps whatever order its
# runs came in: protocol, then the knob's value (auto last).
PLAN_ORDER = ["p2p", "pipelined_p2p", "allgather", "grouped_allgather_p2p", "recursive_doubling",
              "grouped_allgather_rd"]


def row_order(r):
    method = r["method"]
    rank = PLAN_ORDER.index(method) if method in PLAN_ORDER else len(PLAN_ORDER) + (method == "auto")
    knob = re.match(r"^[wc]=(\d+)$", r.get("knob") or "")
    return rank, int(knob.group(1)) if knob else 0


def case_label(r):
    layout, docs = case_of(r)
    parts = ([] if layout == "contiguous" else [layout]) + ([f"docs {docs}"] if docs else [])
    return f" [{', '.join(parts)}]" if parts else ""


def summarize(records):
    """Per platform, P and case (layout, documents): agreement counts and auto
    against the simulated best."""
    out = []
    keys = sorted({(r["platform"], r["ranks"], case_of(r)) for r in records}, key=lambda k: (k[0], k[1], k[2]))
    for plat, p, case in keys:
        rs = [r for r in records if r["platform"] == plat and r["ranks"] == p and case_of(r) == case
              and "ratio" in r]
        rows = [r for r in rs if r["method"] != "auto"]
        auto = next((r for r in rs if r["method"] == "auto"), None)
        within = sum(1 for r in rows if abs(r["ratio"] - 1) <= 0.3)
        s = {"platform": plat, "ranks": p, "case": case_label({"layout": case[0], "docs_mean": case[1]}),
             "rows": len(rows), "within_30": within,
             "skipped": sum(1 for r in records if r["platform"] == plat and r["ranks"] == p and case_of(r) == case
                            and "skipped" in r)}
        exact = [r for r in rows if r["exact"]]
        if exact and auto:
            best = min(exact, key=lambda r: r["sim_forward_s"])
            # auto runs its pick's configuration: where the sweep has that
            # row, its time is the pick's (one measurement per configuration);
            # auto's own run otherwise.
            same = next((r for r in exact if r["label"] == auto["ran"]), auto)
            pick_s = same["sim_forward_s"]
            order = sorted(r["sim_forward_s"] for r in exact)
            s.update(auto=auto["ran"], auto_s=pick_s, best=best["label"], best_s=best["sim_forward_s"],
                     auto_over_best=pick_s / best["sim_forward_s"],
                     auto_rank=1 + sum(1 for t in order if t < pick_s * (1 - 1e-9)), ranked=len(order))
        out.append(s)
    return out


def write_table(out, m):
    recs = m["records"]
    folded = sum(1 for r in recs if r.get("folded"))
    speed = (f"this core folds at {m['host_speed_gflops']:.0f} GFLOP/s (smpi/host-speed of the runs not folded)"
             if folded < len(recs) else "every run folded (the fold steps charged at the platform's speed)")
    lines = [f"Simulated {m['date']}: H = {m['heads']}, K = V = 128, {m['repeat']} timed calls after "
             f"{m['warmup']} untimed; {speed}."
             + (" A configuration marked (folded) ran with folded memory and compute (scripts/simulate.py)."
                if 0 < folded < len(recs) else ""), "",
             "| platform | P | configuration | simulated fwd | simulated bwd | model | sim/model | peak/rank |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in recs:
        if "ratio" in r:
            mark = " (folded)" if r.get("folded") and folded < len(recs) else ""
            lines.append(f"| {r['platform']} | {r['ranks']} | {r['label'] if r['method'] != 'auto' else 'auto -> ' + r['ran']}{case_label(r)}{mark} "
                         f"| {r['sim_forward_s'] * 1e3:.3f} ms | {r['sim_backward_s'] * 1e3:.3f} ms "
                         f"| {r['model_s'] * 1e3:.3f} ms | {r['ratio']:.2f} | {r['peak_bytes'] / (1 << 20):.0f} MiB |")
        else:
            why = " ".join(str(r["skipped"]).split()).replace("|", "/")
            lines.append(f"| {r['platform']} | {r['ranks']} | {r['label']}{case_label(r)} | not run: {why} | | "
                         f"{'' if r['model_s'] is None else format(r['model_s'] * 1e3, '.3f') + ' ms'} | | |")
    lines += ["", "| platform | P | rows within ±30 % | not run | auto's pick | its sim | best sim (exact) | pick/best | pick's rank |",
              "|---|---:|---:|---:|---|---:|---|---:|---:|"]
    for s in summarize(recs):
        if "auto" in s:
            lines.append(f"| {s['platform']} | {s['ranks']}{s['case']} | {s['within_30']} of {s['rows']} | {s['skipped']} | "
                         f"{s['auto']} | {s['auto_s'] * 1e3:.3f} ms | {s['best']} {s['best_s'] * 1e3:.3f} ms | "
                         f"{s['auto_over_best']:.2f} | {s['auto_rank']} of {s['ranked']} |")
        else:
            lines.append(f"| {s['platform']} | {s['ranks']}{s['case']} | {s['within_30']} of {s['rows']} | {s['skipped']} | | | | | |")
    write_atomic(out / "table.md", "\n".join(lines) + "\n")


def write_plot(out, records):
    """Simulated forward time (points, solid) and the model (dashed) per
    configuration family against P, one panel per platform (gnuplot)."""
    if shutil.which("gnuplot") is None:
        print("simulate: gnuplot not found, no plot", file=sys.stderr)
        return
    # The plain case only (one part per rank, no cuts): the table has the rest.
    records = [r for r in records if case_of(r) == ("contiguous", 0)]
    plats = sorted({r["platform"] for r in records})
    fams = sorted({r["method"] for r in records if "ratio" in r and r["method"] != "auto"})
    data = out / "plot.dat"
    with open(data, "w") as f:
        for plat in plats:
            for fam in fams:
                # The fastest simulated configuration of the family at each P.
                f.write(f"# {plat} {fam}\n")
                for p in sorted({r["ranks"] for r in records}):
                    rs = [r for r in records if r["platform"] == plat and r["method"] == fam and r["ranks"] == p
                          and "ratio" in r]
                    if rs:
                        b = min(rs, key=lambda r: r["sim_forward_s"])
                        f.write(f"{p} {b['sim_forward_s'] * 1e3:.6g} {b['model_s'] * 1e3:.6g}\n")
                f.write("\n\n")
    script = [f"set terminal svg size 1100,450 dynamic noenhanced", f"set output '{out / 'plot.svg'}'",
              f"set multiplot layout 1,{len(plats)}", "set logscale xy", "set xlabel 'P (ranks)'",
              "set ylabel 'forward ms (best configuration of each protocol)'", "set key top left font ',9'",
              "set grid"]
    for i, plat in enumerate(plats):
        script.append(f"set title '{plat}: simulated (solid) and model (dashed)'")
        plots = []
        for j, fam in enumerate(fams):
            idx = i * len(fams) + j
            plots.append(f"'{data}' index {idx} using 1:2 with linespoints lw 2 lc {j + 1} title '{fam}'")
            plots.append(f"'{data}' index {idx} using 1:3 with lines dt 2 lc {j + 1} notitle")
        script.append("plot " + ", ".join(plots))
    script.append("unset multiplot")
    (out / "plot.gp").write_text("\n".join(script) + "\n")
    subprocess.run(["gnuplot", str(out / "plot.gp")], check=False)


# check(): the folded run with cuts (zigzag and documents) runs at this P.
CUTS_CHECK_RANKS = 32


def check(a):
    """make test's small simulation: bitwise equality with the in-process
    backend and agreement with the model (see the module docstring)."""
    kdacp, smpi = Path(a.kdacp), Path(a.kdacp_smpi)
    speed = a.host_speed or host_speed(kdacp, a.heads)
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.platforms:
            facts = platform_facts(name, a.platform_dir)
            for p in a.ranks:
                for proto in a.protocols:
                    base = ["--protocol", proto, "--heads", str(a.heads), "--seed", "7", "--repeat", "1"]
                    ref, sim = Path(tmp) / f"ref-{name}-{p}-{proto}", Path(tmp) / f"sim-{name}-{p}-{proto}"
                    r = subprocess.run([str(kdacp), "exchange", "--backend", "inprocess", "-P", str(p), *base,
                                        "--out", str(ref)], capture_output=True, text=True)
                    if r.returncode != 0:
                        problems.append(f"in-process {proto} P={p} failed: {r.stderr.strip()}")
                        continue
                    _, _, err = smpirun(facts, p, tmp, speed, [smpi, "exchange", "--backend", "mpi", *base,
                                                               "--timeout", 86400, "--out", sim], a.timeout)
                    if err:
                        problems.append(f"{name} {proto} P={p}: kdacp-smpi exchange: {err}")
                        continue
                    for f in ("incoming.npy", "final_grad.npy"):
                        if (ref / f).read_bytes() != (sim / f).read_bytes():
                            problems.append(f"{name} {proto} P={p}: {f} differs from the in-process backend's")
                    row = {"method": proto, "knob": ""}
                    stdout, _, err = smpirun(facts, p, tmp, speed,
                                             [smpi, *bench_args(row, a.heads, facts["cost"], a.repeat, a.warmup)],
                                             a.timeout)
                    if err:
                        problems.append(f"{name} {proto} P={p}: kdacp-smpi bench exchange: {err}")
                        continue
                    res = json.loads(stdout.strip().splitlines()[-1])
                    ratio = res["forward_over_predicted"]
                    verdict = "ok" if abs(ratio - 1) <= a.tolerance else "OUTSIDE"
                    print(f"check: {name} P={p} {proto}: bytes equal to in-process: "
                          f"{'no' if any(name in x and proto in x for x in problems) else 'yes'}; simulated "
                          f"{res['forward_seconds'] * 1e3:.4f} ms, model {res['predicted_seconds'] * 1e3:.4f} ms, "
                          f"ratio {ratio:.3f} ({verdict})")
                    if verdict != "ok":
                        problems.append(f"{name} {proto} P={p}: simulated/model = {ratio:.3f}, expected within "
                                        f"±{a.tolerance:g}")
                    # kdacp-smpi's own recursive doubling (past 2 GiB per round
                    # in the sweeps) forced on every all-gather: the same bytes
                    # as in process, and SMPI's recursive doubling's time.
                    if proto == "allgather":
                        own = {"KDACP_SMPI_OWN_ALLGATHER_FROM": "1"}
                        sim_own = Path(tmp) / f"own-{name}-{p}"
                        _, _, err = smpirun(facts, p, tmp, speed, [smpi, "exchange", "--backend", "mpi", *base,
                                                                   "--timeout", 86400, "--out", sim_own], a.timeout,
                                            env_extra=own)
                        if err:
                            problems.append(f"{name} P={p}: kdacp-smpi's own all-gather: {err}")
                            continue
                        same_bytes = all((ref / f).read_bytes() == (sim_own / f).read_bytes()
                                         for f in ("incoming.npy", "final_grad.npy"))
                        stdout, _, err = smpirun(facts, p, tmp, speed,
                                                 [smpi, *bench_args(row, a.heads, facts["cost"], a.repeat,
                                                                    a.warmup)], a.timeout, folded=True, env_extra=own)
                        if err:
                            problems.append(f"{name} P={p}: kdacp-smpi's own all-gather, folded: {err}")
                            continue
                        folded_rdb = smpirun(facts, p, tmp, speed,
                                             [smpi, *bench_args(row, a.heads, facts["cost"], a.repeat, a.warmup)],
                                             a.timeout, folded=True)
                        if folded_rdb[2]:
                            problems.append(f"{name} P={p}: folded all-gather: {folded_rdb[2]}")
                            continue
                        t_own = json.loads(stdout.strip().splitlines()[-1])["forward_seconds"]
                        t_rdb = json.loads(folded_rdb[0].strip().splitlines()[-1])["forward_seconds"]
                        close = abs(t_own / t_rdb - 1) <= 0.02
                        print(f"check: {name} P={p} kdacp-smpi's own recursive doubling: bytes equal to in-process: "
                              f"{'yes' if same_bytes else 'no'}; folded {t_own * 1e3:.4f} ms, SMPI's "
                              f"{t_rdb * 1e3:.4f} ms ({'ok' if close else 'OUTSIDE 2 %'})")
                        if not same_bytes:
                            problems.append(f"{name} P={p}: kdacp-smpi's own all-gather differs from in-process")
                        if not close:
                            problems.append(f"{name} P={p}: kdacp-smpi's own all-gather simulated {t_own!r} s, "
                                            f"SMPI's {t_rdb!r} s, expected within 2 %")
                    # The first protocol's run folded, twice: it must say it
                    # was folded, time within --tolerance of the model, and
                    # give the same simulated time both times (no host time
                    # enters it). Its ratio to the real run is shown: the real
                    # run also charges kdacp's other host work, scaled, which
                    # a busy host inflates.
                    if proto != a.protocols[0]:
                        continue
                    if res.get("folded") is not False:
                        problems.append(f"{name} {proto} P={p}: the real run says folded={res.get('folded')}")
                    folds = []
                    for _ in range(2):
                        stdout, _, err = smpirun(facts, p, tmp, speed,
                                                 [smpi, *bench_args(row, a.heads, facts["cost"], a.repeat, a.warmup)],
                                                 a.timeout, folded=True)
                        if err:
                            problems.append(f"{name} {proto} P={p}: folded kdacp-smpi bench exchange: {err}")
                            break
                        folds.append(json.loads(stdout.strip().splitlines()[-1]))
                    if len(folds) < 2:
                        continue
                    fold = folds[0]
                    if not all(f.get("folded") is True for f in folds):
                        problems.append(f"{name} {proto} P={p}: KDACP_SMPI_FOLD=1 but the run says "
                                        f"folded={fold.get('folded')}")
                    fratio = fold["forward_over_predicted"]
                    same = folds[0]["forward_seconds"] == folds[1]["forward_seconds"]
                    fverdict = "ok" if abs(fratio - 1) <= a.tolerance and same else "OUTSIDE"
                    print(f"check: {name} P={p} {proto} folded: simulated {fold['forward_seconds'] * 1e3:.4f} ms, "
                          f"ratio {fratio:.3f} to the model, {fold['forward_seconds'] / res['forward_seconds']:.3f} "
                          f"x the real run, the same in two runs: {'yes' if same else 'no'} ({fverdict})")
                    if abs(fratio - 1) > a.tolerance:
                        problems.append(f"{name} {proto} P={p}: folded simulated/model = {fratio:.3f}, expected "
                                        f"within ±{a.tolerance:g}")
                    if not same:
                        problems.append(f"{name} {proto} P={p}: two folded runs simulated "
                                        f"{folds[0]['forward_seconds']!r} and {folds[1]['forward_seconds']!r} s")
            def folded_within(p, label, args, tol, extra=""):
                """One folded run of `kdacp bench exchange args` at P = p:
                its ratio to the model within ±tol, else a problem."""
                stdout, _, err = smpirun(facts, p, tmp, speed, [smpi, *args], a.timeout, folded=True)
                if err:
                    problems.append(f"{name} P={p} {label}: {err}")
                    return None
                res = json.loads(stdout.strip().splitlines()[-1])
                ratio = res["forward_over_predicted"]
                ok = abs(ratio - 1) <= tol
                print(f"check: {name} P={p} {label} folded{extra.format(**res)}: simulated "
                      f"{res['forward_seconds'] * 1e3:.4f} ms, ratio {ratio:.3f} to the model "
                      f"({'ok' if ok else 'OUTSIDE'})")
                if not ok:
                    problems.append(f"{name} P={p} {label}, folded: simulated/model = {ratio:.3f}, expected "
                                    f"within ±{tol:g}")
                return res

            # Cuts in a folded run: the grouped relay decides from the cut
            # flags it gathered which runs it sends at once, and folded
            # buffers map the same pages on every rank, so the flags must
            # stay each rank's own (core/flagged_buffer.hpp). When they did
            # not, this run read 2.3x the model on both platforms (H = 4;
            # 3x at P = 64, H = 32, docs/scale.md); deterministic, as every
            # folded run is.
            res = folded_within(CUTS_CHECK_RANKS, "grouped_allgather_p2p w=2 [zigzag, docs 8192]",
                                bench_args({"method": "grouped_allgather_p2p", "knob": "w=2"}, a.heads, facts["cost"],
                                           a.repeat, a.warmup, "zigzag", 8192),
                                a.tolerance, " ({cuts} cuts of {parts} parts)")
            if res is not None and not res.get("cuts", 0) > 0:
                problems.append(f"{name} P={CUTS_CHECK_RANKS} grouped_allgather_p2p w=2 [zigzag, docs 8192]: "
                                "the run has no cuts")
            # Stretches side by side: p2p with zigzag and documents, where
            # cut parts send at once and two of their states reach one rank's
            # port together (ChainProfile::port_waits). Before the model
            # priced the shared ports this read 1.38 on Ethernet at P = 16,
            # H = 4 (1.65 with H = 32); 1.00 now, nvlink-ib 0.95.
            folded_within(a.ranks[0], "p2p [zigzag, docs 8192]",
                          bench_args({"method": "p2p", "knob": ""}, a.heads, facts["cost"], a.repeat, a.warmup,
                                     "zigzag", 8192),
                          a.tolerance)
            # Streams side by side: pipelined_p2p c = 2 with zigzag and
            # documents, H = 32 (segments of 1 MiB), where two streams'
            # segments cross one rank's NIC (stream_nic_waits). Before the
            # model priced that this read 1.52 on Ethernet at P = 16 (0.99
            # now); nvlink-ib 0.76 with and without.
            folded_within(a.ranks[0], "pipelined_p2p c=2 [zigzag, docs 8192] H=32",
                          bench_args({"method": "pipelined_p2p", "knob": "c=2"}, 32, facts["cost"], a.repeat,
                                     a.warmup, "zigzag", 8192),
                          a.tolerance)
            # Latency-bound collectives, folded: the all-gather with one head,
            # where each collective's agreement (ceil(log2 m) latencies before
            # it, add_agreement) is a third of the time. Before the model
            # priced it this read 1.29 (nvlink-ib) and 1.34 (Ethernet) at
            # P = 16; the α-β terms are exact here, so ±10 %.
            folded_within(a.ranks[0], "allgather H=1",
                          bench_args({"method": "allgather", "knob": ""}, 1, facts["cost"], a.repeat, a.warmup),
                          min(a.tolerance, 0.1))
            # Ulysses x state CP, folded: the all-to-alls and the exchange
            # over P/U beside the model's figures.
            for p in a.ranks:
                for u in a.ulysses:
                    if u == 1 or p % u or a.heads % u:
                        continue
                    row = {"method": "ulysses", "knob": f"U={u}"}
                    stdout, _, err = smpirun(facts, p, tmp, speed,
                                             [smpi, *bench_args(row, a.heads, facts["cost"], a.repeat, a.warmup,
                                                                tokens_per_rank=a.tokens_per_rank)],
                                             a.timeout, folded=True)
                    if err:
                        problems.append(f"{name} Ulysses U={u} P={p}: kdacp-smpi bench exchange: {err}")
                        continue
                    res = json.loads(stdout.strip().splitlines()[-1])
                    ratio = res["forward_over_predicted"]
                    a2a = res["all_to_all_forward_seconds"] / res["predicted_all_to_all_seconds"]
                    ok = abs(ratio - 1) <= a.tolerance and abs(a2a - 1) <= a.tolerance
                    print(f"check: {name} P={p} {res['label']} folded: simulated {res['forward_seconds'] * 1e3:.4f} "
                          f"ms, ratio {ratio:.3f} to the model, all-to-alls {a2a:.3f} ({'ok' if ok else 'OUTSIDE'})")
                    if not ok:
                        problems.append(f"{name} Ulysses U={u} P={p}: simulated/model = {ratio:.3f} (all-to-alls "
                                        f"{a2a:.3f}), expected within ±{a.tolerance:g}")
    for x in problems:
        print(f"check: FAIL: {x}", file=sys.stderr)
    return 1 if problems else 0


# docs/scale.md's tables, read back (--check-doc): a results row, its case
# label, its times printed in ms to three decimals.
def doc_ms(cell):
    return float(cell.split()[0]) / 1e3


def parse_doc_row(cells, exact_of):
    plat, p, label = cells[0], int(cells[1]), cells[2]
    layout, docs = "contiguous", 0
    m = re.match(r"^(.*?) \[(.*)\]$", label)
    if m:
        label = m.group(1)
        for part in m.group(2).split(", "):
            if part == "zigzag":
                layout = "zigzag"
            elif part.startswith("docs "):
                docs = int(part[5:])
            else:
                raise ValueError(f"unknown case '{part}'")
    r = {"platform": plat, "ranks": p, "layout": layout, "docs_mean": docs}
    if label.startswith("auto -> "):
        r.update(method="auto", knob="", label="auto", ran=label[len("auto -> "):], exact=True)
    else:
        method, _, knob = label.partition(" ")
        if method not in exact_of:
            raise ValueError(f"'{method}' is no row of kdacp plan")
        r.update(method=method, knob=knob, label=label, exact=exact_of[method])
    if cells[3].startswith("not run: "):
        r["skipped"] = cells[3][len("not run: "):]
    else:
        r.update(sim_forward_s=doc_ms(cells[3]), model_s=doc_ms(cells[5]), ratio=float(cells[6]))
    return r


def check_doc(a):
    """Every results table of a page like docs/scale.md against itself: no
    configuration twice, each sim/model the ratio of its two times, and each
    summary row what summarize() gives for the rows above it (the page's
    tables are merged from many runs, some by hand). Printed values are
    rounded, so each comparison allows its rounding."""
    out = subprocess.run([a.kdacp, "plan", "-P", "8"], capture_output=True, text=True)
    exact_of = {m.group(1): m.group(3) == "yes" for m in map(PLAN_ROW.match, out.stdout.splitlines()) if m}
    if out.returncode != 0 or not exact_of:
        fail(f"kdacp plan -P 8 failed or printed no rows: {out.stderr.strip()}")
    try:
        text = Path(a.check_doc).read_text()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"--check-doc {a.check_doc}: cannot read it ({e})")
    errors, tables, half = [], 0, 0.0005e-3  # half a printed microsecond
    for block, body in re.findall(r"<!-- (\w+):begin -->\n(.*?)<!-- \1:end -->", text, re.S):
        if "| configuration | simulated fwd |" not in body:
            continue
        tables += 1
        rows, seen, summary = [], set(), []
        for line in body.splitlines():
            if not line.startswith("| ") or line.startswith("| platform |"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 9:
                summary.append((line, cells))
                continue
            try:
                r = parse_doc_row(cells, exact_of)
            except (ValueError, IndexError) as e:
                errors.append(f"{block}: cannot read '{line}': {e}")
                continue
            key = (r["platform"], r["ranks"], cells[2])
            if key in seen:
                errors.append(f"{block}: listed twice: {' '.join(map(str, key))}")
            seen.add(key)
            if "ratio" in r:
                f, mo = r["sim_forward_s"], r["model_s"]
                lo, hi = (f - half) / (mo + half), (f + half) / max(mo - half, 1e-15)
                if not lo - 0.005 <= r["ratio"] <= hi + 0.005:
                    errors.append(f"{block}: {' '.join(map(str, key))}: sim/model {r['ratio']:.2f}, "
                                  f"but {f * 1e3:.3f} / {mo * 1e3:.3f} ms is {f / mo:.3f}")
            rows.append(r)
        expect = {(s["platform"], f"{s['ranks']}{s['case']}"): s for s in summarize(rows)}
        for line, c in summary:
            s = expect.pop((c[0], c[1]), None)
            if s is None:
                errors.append(f"{block}: summary '{c[0]} {c[1]}' has no rows above it")
                continue
            want = [f"{s['within_30']} of {s['rows']}", str(s["skipped"])]
            if [c[2], c[3]] != want:
                errors.append(f"{block}: {c[0]} {c[1]}: says '{c[2]}', '{c[3]} not run'; the rows give "
                              f"'{want[0]}', '{want[1]} not run'")
            if "auto" not in s:
                if any(c[4:]):
                    errors.append(f"{block}: {c[0]} {c[1]}: names auto's pick '{c[4]}', but no auto row is above")
                continue
            exact = sorted(r["sim_forward_s"] for r in rows if r["platform"] == s["platform"]
                           and r["ranks"] == s["ranks"] and case_label(r) == s["case"] and r["exact"]
                           and r["method"] != "auto" and "ratio" in r)
            pick, best = s["auto_s"], s["best_s"]
            ranks = (1 + sum(1 for t in exact if t < pick - 2 * half), sum(1 for t in exact if t <= pick + 2 * half))
            m = re.match(r"^(\d+) of (\d+)$", c[8])
            try:
                ok = (c[4] == s["auto"] and abs(doc_ms(c[5]) - pick) <= half
                      and abs(float(c[6].split()[-2]) / 1e3 - best) <= half
                      and (pick - 2 * half) / (best + 2 * half) - 0.005 <= float(c[7])
                      <= (pick + 2 * half) / max(best - 2 * half, 1e-15) + 0.005
                      and m is not None and ranks[0] <= int(m.group(1)) <= ranks[1]
                      and int(m.group(2)) == len(exact))
            except (ValueError, IndexError):
                ok = False
            if not ok:
                errors.append(f"{block}: {c[0]} {c[1]}: says auto {c[4]} {c[5]}, best {c[6]}, {c[7]}, rank {c[8]}; "
                              f"the rows give auto {s['auto']} {pick * 1e3:.3f} ms, best {s['best']} "
                              f"{s['best_s'] * 1e3:.3f} ms, rank {ranks[0]}..{ranks[1]} of {len(exact)}")
        for (plat, p) in expect:
            errors.append(f"{block}: rows of {plat} {p} but no summary row")
    if tables == 0:
        errors.append(f"{a.check_doc}: no results table between <!-- name:begin --> and <!-- name:end -->")
    for e in errors:
        print("check-doc:", e, file=sys.stderr)
    if errors:
        return 1
    print(f"check-doc: {tables} tables of {a.check_doc}: tables agree with their rows")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    build = ROOT / "build" / "release" / "tools"
    ap.add_argument("--kdacp", default=str(build / "kdacp"), help="the kdacp program (plan, the reference runs)")
    ap.add_argument("--kdacp-smpi", default=str(build / "kdacp-smpi"), help="the SMPI build of kdacp")
    ap.add_argument("--platform-dir", default=str(ROOT / "build" / "release" / "platforms"),
                    help="where the build put the .so platforms")
    ap.add_argument("--platforms", nargs="+", default=["nvlink-ib", "ethernet"], help="names in platforms/")
    ap.add_argument("--ranks", "-P", nargs="+", type=int, default=[8, 64, 256, 1024])
    ap.add_argument("--heads", "-H", type=int, default=32)
    ap.add_argument("--protocols", nargs="*", default=[], help="only these methods (default: every row and auto)")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per run (median of the slowest rank)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    ap.add_argument("--max-memory", type=float, default=16, help="GiB a run may need (P x (inputs + peak))")
    ap.add_argument("--timeout", type=float, default=1800, help="real seconds one smpirun may take")
    ap.add_argument("--host-speed", type=float, default=0, help="GFLOP/s of this core (default: measured)")
    ap.add_argument("--out", default="build/simulate", help="folder of results.json, table.md, plot.svg")
    ap.add_argument("--check", action="store_true", help="the test mode (module docstring)")
    ap.add_argument("--render", metavar="RESULTS", nargs="+",
                    help="only write table.md and plot.svg into --out from results.json files (interrupted or "
                    "partial sweeps); a later file's record replaces an earlier one of the same platform, P and "
                    "configuration")
    ap.add_argument("--check-doc", metavar="PAGE",
                    help="only check the results tables of PAGE (docs/scale.md) against themselves: no row twice, "
                    "each ratio its times', each summary row its rows' (needs --kdacp)")
    ap.add_argument("--tolerance", type=float, default=0.3, help="--check: allowed |simulated/model - 1|")
    ap.add_argument("--configurations", nargs="+", metavar="LABEL",
                    help="only these configurations, named as in the table (e.g. 'grouped_allgather_rd w=512'): "
                         "the rows an earlier sweep did not reach")
    ap.add_argument("--knobs", choices=["all", "best"], default="all",
                    help="every group width and segment count kdacp plan weighs, or each protocol's model-best one")
    ap.add_argument("--ulysses", type=int, nargs="*", default=[],
                    help="instead of the rows: Ulysses x state CP at these U (an all-to-all over U ranks, the "
                    "exchange over P/U; 1: plain auto), each U dividing H and P")
    ap.add_argument("--tokens-per-rank", type=int, default=4096, help="--ulysses: T/P, the tokens the all-to-alls move")
    ap.add_argument("--layout", choices=["contiguous", "zigzag"], default="contiguous",
                    help="parts per rank of every run: one (contiguous) or two (zigzag: r and 2P-1-r)")
    ap.add_argument("--docs-mean", type=int, default=0,
                    help="cut every run's stream where documents of this mean length start (bench exchange's "
                    f"--docs-mean, {BENCH_RANK_TOKENS} tokens per rank); 0: no cuts")
    ap.add_argument("--fold", choices=["auto", "always", "never"], default="always",
                    help="fold memory and compute: always (times independent of this host's load), where a run "
                    "would exceed --max-memory (auto), never")
    a = ap.parse_args()
    if a.check_doc:
        sys.exit(check_doc(a))
    if a.render:
        m, merged = None, {}
        for path in a.render:
            try:
                part = json.loads(Path(path).read_text())
                records = part["records"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                fail(f"--render {path}: expected a results.json of this script ({e})")
            m = m or part
            for r in records:
                key = (r["platform"], r["ranks"], case_of(r), r["label"])
                # A run that did not happen never hides one that did.
                if "ratio" in r or key not in merged or "ratio" not in merged[key]:
                    merged[key] = r
        m["records"] = sorted(merged.values(), key=lambda r: (r["ranks"], r["platform"] != "nvlink-ib", case_of(r),
                                                             *row_order(r)))
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        write_table(out, m)
        write_plot(out, m["records"])
        sys.exit(0)
    for p in a.ranks:
        if p < 1 or p > 4096:
            fail(f"--ranks {p}: expected 1..4096")
    if a.heads < 1 or a.repeat < 1 or a.warmup < 0 or a.max_memory <= 0 or a.timeout <= 0 or a.docs_mean < 0:
        fail("--heads and --repeat must be >= 1, --warmup and --docs-mean >= 0, --max-memory and --timeout > 0")
    if shutil.which("smpirun") is None:
        fail("smpirun not found: install libsimgrid-dev (scripts/install-deps.sh)")
    # Absolute: smpirun runs in a temporary folder.
    a.kdacp, a.kdacp_smpi = str(Path(a.kdacp).resolve()), str(Path(a.kdacp_smpi).resolve())
    a.platform_dir = str(Path(a.platform_dir).resolve())
    for prog in (a.kdacp, a.kdacp_smpi):
        if not Path(prog).is_file():
            fail(f"{prog} not found: build first (cmake --build --preset release)")
    if a.check and not a.protocols:
        fail("--check needs --protocols")
    sys.exit(check(a) if a.check else sweep(a))


if __name__ == "__main__":
    main()
