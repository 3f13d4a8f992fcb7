"""One `kdacp-smpi` run under smpirun: the settings every run shares, the
shared-memory mode's, and `kdacp bench exchange`'s arguments for one
configuration."""
import json
import os
import subprocess
import time

from .platforms import hostfile

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
    # collective).
    "--cfg=smpi/allgather:rdb",
    "--cfg=smpi/bcast:binomial_tree",
    "--cfg=smpi/allreduce:rdb",
    "--log=root.thres:warning",
]

# The shared-memory mode (KDACP_SMPI_SHARED_MEMORY=1, src/comm/smpi/): every
# large buffer maps the same pages (SMPI's global shared malloc, in blocks of
# 1 GiB so that a rank's buffers take few of the kernel's vm.max_map_count
# mappings), each fold step is charged as its flops at the platform's speed,
# and nothing else this host does is: the clock is the network's and the
# fold steps', the same on every run (a run with private memory also charges
# its other host work, measured and scaled: 3-10 % at P = 16, varying with
# this host's load).
SHARED_MEMORY_OPTIONS = ["--cfg=smpi/shared-malloc:global", "--cfg=smpi/shared-malloc-blocksize:1073741824",
                         "--cfg=smpi/simulate-computation:no"]
SHARED_MEMORY_ENV = "KDACP_SMPI_SHARED_MEMORY"

# A rank's own memory in the shared-memory mode: its thread, small buffers
# and the simulator's bookkeeping. Measured for the P = 1024 chain at H = 32:
# the host's used memory rose by about 1.3 GiB, 1.3 MiB per rank; 4 MiB per
# rank is the bound used here.
SHARED_RANK_BYTES = 4 << 20


def input_bytes(ranks, heads):
    """Every rank's S, M, G and the two returned states, H·K·V floats each
    (K = V = 128)."""
    return ranks * 5 * heads * 128 * 128 * 4


def allgather_algorithm(members, heads):
    """The all-gather of `members` packed summaries that kdacp-smpi runs:
    SMPI's recursive doubling ("rdb", which kdacp-smpi counts in 8-byte words;
    in bytes its int counts overflowed), or, where a round's message reaches
    2 GiB, kdacp-smpi's own recursive doubling with the same rounds and each
    message in pieces under 1 GiB ("kdacp-rdb"; SMPI's filled this host's
    memory at P = 1024, H = 32). Its own needs a power-of-two member count:
    None otherwise. SMPI's other bandwidth-optimal algorithms do not stand
    in: the neighbour exchange crashed inside SMPI at P = 1024, the ring with
    a segmentation fault, the 2-D mesh took 3.9x the model at P = 64."""
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


def smpirun(facts, ranks, folder, speed_gf, argv, timeout, shared=False, env_extra=None):
    """Runs argv (kdacp-smpi and its arguments) on P = ranks of platform
    `facts`: (stdout, real seconds, None), or (None, real seconds, what went
    wrong)."""
    hosts = hostfile(facts, ranks, folder)
    cmd = ["smpirun", *SMPI_OPTIONS, *(SHARED_MEMORY_OPTIONS if shared else []),
           f"--cfg=smpi/host-speed:{speed_gf:.6g}Gf", "-platform", str(facts["xml"]), "-hostfile", str(hosts),
           "-np", str(ranks), *map(str, argv)]
    # The simulated ranks share this process's buffer cache (kdacp/memory.hpp),
    # whose 1 GiB limit stands for one rank's: past P ~ 128 at H = 32 their idle
    # blocks outgrew it, and the buffers allocated again on the chain's
    # critical path faulted their pages in (pipelined_p2p at P = 256 on
    # Ethernet: 1.37x the model, 1.03x with a cache per rank). A GiB per rank.
    env = dict(os.environ, KDACP_BUFFER_CACHE_MB=str(1024 * ranks), **{SHARED_MEMORY_ENV: "1" if shared else "0"},
               **(env_extra or {}))
    t0 = time.monotonic()
    try:
        # In the temporary folder: smpirun leaves its unrolled hostfile in
        # the working directory when a run fails.
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=folder, env=env)
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - t0, f"took over {timeout:g} s of real time"
    wall = time.monotonic() - t0
    if out.returncode != 0:
        # SimGrid's abort ends in a backtrace of "  -> N# address" frames:
        # the message is above them.
        said = [line for line in out.stderr.strip().splitlines() if not line.lstrip().startswith("->")]
        return None, wall, f"smpirun exited {out.returncode}: " + "\n".join(said[-6:])
    return out.stdout, wall, None


def last_json(stdout):
    """The JSON object `kdacp bench exchange --json` prints last."""
    return json.loads(stdout.strip().splitlines()[-1])


def shared_memory_of(res):
    """Whether a bench run says it ran in the shared-memory mode (its JSON
    key, as kdacp-smpi names it)."""
    return res.get("shared_memory", res.get("folded"))


def bench_args(row, heads, cost, repeat, warmup, layout="contiguous", docs_mean=0, tokens_per_rank=0):
    """`kdacp bench exchange` for one configuration (method, knob)."""
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
