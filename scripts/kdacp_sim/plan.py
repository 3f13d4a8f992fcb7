"""What the simulation asks kdacp itself, as JSON: the configurations the
cost model weighs (`kdacp plan --json`) and this core's fold speed
(`kdacp bench kernels --json`)."""
import json
import subprocess

from .common import UsageError

# Tokens per rank of `kdacp bench exchange`'s stream (its --docs-mean cuts it
# into documents): a plan with a layout needs the stream's length.
BENCH_RANK_TOKENS = 4096


def plan_json(kdacp, ranks, heads, extra=()):
    """`kdacp plan --json` for P = ranks, H = heads and `extra` flags."""
    cmd = [str(kdacp), "plan", "--json", "-P", str(ranks), "-H", str(heads), *map(str, extra)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise UsageError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    try:
        return json.loads(out.stdout)
    except ValueError as e:
        raise UsageError(f"{' '.join(cmd)} printed no JSON ({e})") from e


def row_of(r):
    """One of plan's rows as a configuration of the sweep: method, knob (w=N,
    c=N or none: the rest of plan's label, which bench prints alike), the
    model's time and peak."""
    method, _, knob = r["protocol"].partition(" ")
    return {"method": method, "knob": knob, "label": r["protocol"], "exact": bool(r["exact"]),
            "model_s": r["seconds"], "model_peak": r["peak_extra_bytes"]}


def plan_rows(kdacp, cost, ranks, heads, layout="contiguous"):
    """The configurations `kdacp plan` weighs with the platform's cost
    parameters, with the model's time and memory, and auto's exact pick, for
    `layout` without cuts (the sweep's documents are bench exchange's, which
    plan does not draw; each run's model time, and with documents auto's
    pick, are bench's own, cuts included)."""
    extra = ["--calibration", cost]
    if layout != "contiguous":
        extra += ["--layout", layout, "--tokens", ranks * BENCH_RANK_TOKENS]
    plan = plan_json(kdacp, ranks, heads, extra)
    return [row_of(r) for r in plan["rows"]], plan["auto_exact"]["protocol"]


def protocols(kdacp):
    """Every method of the registry in its order (the order of plan's rows,
    which follows src/exchange/protocols.def; those plan leaves out of a
    layout after them), and whether each is exact."""
    plan = plan_json(kdacp, 8, 1)
    exact = {}
    for r in plan["rows"]:
        exact.setdefault(r["method"], bool(r["exact"]))
    for name in plan.get("not_listed", []):
        exact.setdefault(name, False)
    return exact


def host_speed(kdacp, heads):
    """This core's fold speed (GFLOP/s) at the sweep's shape, one thread."""
    out = subprocess.run([str(kdacp), "bench", "kernels", "--dims", "128", "--chains", "4", "--threads", "1",
                          "--bh", str(heads), "--direction", "forward", "--json", "-q", "--min-time", "0.5"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]["gflops"]
