#!/usr/bin/env python3
"""kdacp's state exchange on simulated clusters (SimGrid SMPI; docs/scale.md).

For each platform in platforms/ and each P, runs every configuration the cost
model weighs (the rows of `kdacp plan --json` with the platform's cost
parameters: every registry row, every group width, the model's segments) plus
`auto`, as `kdacp-smpi bench exchange` under smpirun: the real protocol and
communicator code, one simulated rank per process of the job. It writes
results.json, table.md (time beside the model, their ratio, auto's pick and
its rank) and plot.svg into --out.

Runs use the shared-memory mode by default (--shared-memory always;
KDACP_SMPI_SHARED_MEMORY=1): every rank's large buffers map the same pages and
each fold step is charged as its flops at the platform's speed instead of
running, so only the messages and the clock are real, and the clock does not
depend on this host's load. --shared-memory auto uses it only for the runs
whose ranks' memory would exceed --max-memory, never for none. The records say
which runs used it.

--check runs the small simulation of `make test` instead (kdacp_sim/check.py);
the exit status says whether all held. --render merges results files into
--out; --table prints one file's full table; --check-doc PAGE compares the
page's generated tables with the data files they name (docs/results/scale/),
and --write-doc PAGE rewrites them.

Standard library only; run it with any Python 3 (the build's kdacp and
kdacp-smpi do the work).
"""
import argparse
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kdacp_sim import plan, platforms, tables  # noqa: E402
from kdacp_sim.check import CUTS_CHECK_RANKS as CUTS_RANKS, check  # noqa: E402
from kdacp_sim.common import ROOT, UsageError, fail, results_text, write_atomic  # noqa: E402
from kdacp_sim.plot import write_plot  # noqa: E402
from kdacp_sim.results import load, merge  # noqa: E402
from kdacp_sim.sweep import sweep  # noqa: E402

MAX_RANKS = 4096
DEFAULT_KDACP = ROOT / "build" / "release" / "tools" / "kdacp"


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    build = ROOT / "build" / "release" / "tools"
    ap.add_argument("--kdacp", help=f"the kdacp program (plan, the reference runs; default {build / 'kdacp'})")
    ap.add_argument("--kdacp-smpi", default=str(build / "kdacp-smpi"), help="the SMPI build of kdacp")
    ap.add_argument("--platform-dir", default=str(ROOT / "build" / "release" / "platforms"),
                    help="where the build put the .so platforms")
    ap.add_argument("--platforms", nargs="+", default=["nvlink-ib", "ethernet"], help="names in platforms/")
    ap.add_argument("--ranks", "-P", nargs="+", type=int, default=[8, 64, 256, 1024], help=f"P, 1..{MAX_RANKS}")
    ap.add_argument("--heads", "-H", type=int, default=32)
    ap.add_argument("--protocols", nargs="+", default=[], help="only these methods (default: every row and auto)")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per run (median of the slowest rank)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    ap.add_argument("--max-memory", type=float, default=16, help="GiB a run may need (P x (inputs + peak))")
    ap.add_argument("--timeout", type=float, default=1800, help="real seconds one smpirun may take")
    ap.add_argument("--host-speed", type=float, default=0, help="GFLOP/s of this core (default: measured)")
    ap.add_argument("--out", default="build/simulate", help="folder of results.json, table.md, plot.svg")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="the test mode (module docstring)")
    mode.add_argument("--render", metavar="RESULTS", nargs="+",
                    help="only write results.json, table.md and plot.svg into --out from results files (interrupted "
                    "or partial sweeps); a later file's record replaces an earlier one of the same platform, P, "
                    "case and configuration")
    mode.add_argument("--table", metavar="RESULTS", help="only print the full table of a results file")
    mode.add_argument("--check-doc", metavar="PAGE",
                    help="only compare PAGE's generated tables with the data files they name (--data-dir), which "
                    "must hold no row twice and each ratio its times'")
    mode.add_argument("--write-doc", metavar="PAGE", help="only rewrite PAGE's generated tables from --data-dir")
    ap.add_argument("--data-dir", default=str(ROOT / "docs" / "results" / "scale"),
                    help="--check-doc/--write-doc: the folder of NAME.json for each <!-- scale-table:NAME --> block")
    ap.add_argument("--tolerance", type=float, default=0.3, help="--check: allowed |simulated/model - 1|, in (0, 1)")
    ap.add_argument("--configurations", nargs="+", metavar="LABEL",
                    help="only these configurations, named as in the table (e.g. 'grouped_allgather_rd w=512'): "
                         "the rows an earlier sweep did not reach")
    ap.add_argument("--knobs", choices=["all", "best"], default="all",
                    help="every group width and segment count kdacp plan weighs, or each protocol's model-best one")
    ap.add_argument("--ulysses", type=int, nargs="+", default=[],
                    help="instead of the rows: Ulysses x state CP at these U (an all-to-all over U ranks, the "
                    "exchange over P/U; 1: plain auto), each U dividing H and a P")
    ap.add_argument("--tokens-per-rank", type=int, default=4096, help="--ulysses: T/P, the tokens the all-to-alls move")
    ap.add_argument("--layout", choices=["contiguous", "zigzag"], default="contiguous",
                    help="parts per rank of every run: one (contiguous) or two (zigzag: r and 2P-1-r)")
    ap.add_argument("--docs-mean", type=int, default=0,
                    help="cut every run's stream where documents of this mean length start (bench exchange's "
                    f"--docs-mean, {plan.BENCH_RANK_TOKENS} tokens per rank); 0: no cuts")
    ap.add_argument("--shared-memory", choices=["auto", "always", "never"], default="always",
                    help="share the ranks' memory and charge compute as flops: always (times independent of this "
                    "host's load), where a run would exceed --max-memory (auto), never")
    return ap


def program(path, flag):
    """An absolute path (smpirun runs in a temporary folder) to a file."""
    p = Path(path).resolve()
    if not p.is_file():
        raise UsageError(f"{flag} {path}: no such file (build first: cmake --build --preset release)")
    return str(p)


def check_numbers(a):
    """Every numeric flag in its range, named as the user wrote it."""
    for p in a.ranks:
        if not 1 <= p <= MAX_RANKS:
            raise UsageError(f"--ranks {p}: expected 1..{MAX_RANKS}")
    for flag, value, lo in (("--heads", a.heads, 1), ("--repeat", a.repeat, 1), ("--warmup", a.warmup, 0),
                            ("--tokens-per-rank", a.tokens_per_rank, 1), ("--docs-mean", a.docs_mean, 0)):
        if value < lo:
            raise UsageError(f"{flag} {value}: expected an integer >= {lo}")
    for flag, value, zero_ok in (("--max-memory", a.max_memory, False), ("--timeout", a.timeout, False),
                                 ("--host-speed", a.host_speed, True)):
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise UsageError(f"{flag} {value:g}: expected a finite number " + (">= 0" if zero_ok else "> 0"))
    if not (math.isfinite(a.tolerance) and 0 < a.tolerance < 1):
        raise UsageError(f"--tolerance {a.tolerance:g}: expected a number in (0, 1), the allowed |simulated/model - 1|")
    for u in a.ulysses:
        if u < 1 or a.heads % u or not any(p % u == 0 for p in a.ranks):
            raise UsageError(f"--ulysses {u}: expected a divisor of --heads {a.heads} and of a --ranks value "
                             f"({' '.join(map(str, a.ranks))})")


def check_names(a, exact_of):
    """--protocols and --configurations against the registry's methods."""
    valid = [*exact_of, "auto"]
    for name in a.protocols:
        if name not in valid:
            raise UsageError(f"--protocols {name}: expected one of {', '.join(valid)}")
    for label in a.configurations or []:
        method, _, knob = label.partition(" ")
        if method not in valid or not (knob == "" or (knob[:2] in ("w=", "c=") and knob[2:].isdigit())):
            raise UsageError(f"--configurations '{label}': expected a method ({', '.join(valid)}), optionally "
                             "followed by w=N or c=N, as the table names it")


def check_out(out):
    """--out must be a folder this run can make or write into."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder (results.json, table.md and plot.svg go in it)")
    parent = next((q for q in [path, *path.parents] if q.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UsageError(f"--out {out}: {parent} is not a folder")


def render(a):
    order = list(plan.protocols(program(a.kdacp, "--kdacp")))
    m = merge([load(path, "--render") for path in a.render], order)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.json", results_text(m, m["records"]))
    write_atomic(out / "table.md", tables.full_table(m["records"]))
    write_plot(out, m["records"])
    return 0


def doc(a):
    """--check-doc / --write-doc: the exit status."""
    # Each record's exact flag against the registry's where kdacp is at hand
    # (docs.scale_tables names it; the tables themselves need only the data).
    exact_of = None
    if a.kdacp or DEFAULT_KDACP.is_file():
        exact_of = plan.protocols(program(a.kdacp or DEFAULT_KDACP, "--kdacp"))
    page = a.check_doc or a.write_doc
    problems = tables.check_page(page, a.data_dir, exact_of, write=bool(a.write_doc))
    for p in problems:
        print(f"check-doc: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"check-doc: {page}: {'rewritten from' if a.write_doc else 'tables agree with'} the data in {a.data_dir}")
    return 0


def run(a):
    if a.kdacp is None and not (a.check_doc or a.write_doc):
        a.kdacp = str(DEFAULT_KDACP)
    if a.check_doc or a.write_doc:
        return doc(a)
    if a.table:
        print(tables.full_table(load(a.table, "--table")["records"]), end="")
        return 0
    check_out(a.out)
    if a.render:
        return render(a)
    check_numbers(a)
    known = platforms.available()
    for name in a.platforms:
        if name not in known:
            raise UsageError(f"--platforms {name}: expected one of {', '.join(known)} (platforms/NAME.json with a "
                             "\"simulation\" object)")
    a.kdacp = program(a.kdacp, "--kdacp")
    check_names(a, plan.protocols(a.kdacp))
    a.kdacp_smpi = program(a.kdacp_smpi, "--kdacp-smpi")
    if a.check and not a.protocols:
        raise UsageError("--check needs --protocols")
    if not Path(a.platform_dir).is_dir():
        raise UsageError(f"--platform-dir {a.platform_dir}: no such folder")
    a.platform_dir = str(Path(a.platform_dir).resolve())
    facts_of = {name: platforms.facts(name, a.platform_dir) for name in a.platforms}
    for name, f in facts_of.items():
        for p in a.ranks + ([CUTS_RANKS] if a.check else []):
            if p > platforms.capacity(f):
                raise UsageError(f"--ranks {p}: platform {name} holds {platforms.capacity(f)} ranks")
    if shutil.which("smpirun") is None:
        raise UsageError("smpirun not found: install libsimgrid-dev (scripts/install-deps.sh)")
    return check(a, facts_of) if a.check else sweep(a, facts_of)


def main():
    a = parser().parse_args()
    try:
        sys.exit(run(a))
    except UsageError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
