"""The sweep (make simulate): for each platform and P, every configuration
the cost model weighs, run by kdacp-smpi under smpirun beside the model's
prediction; results.json rewritten after every run, then table.md and
plot.svg."""
import datetime
import sys
import tempfile
from pathlib import Path

from . import plan, smpi, tables
from .common import results_text, write_atomic
from .plot import write_plot
from .results import case_label, row_order

# The most segments pipelined_p2p takes at V = 128: segments are whole units
# of 16 columns.
MAX_SEGMENTS = 128 // 16


def configurations(a, facts, p):
    """The rows to run at P = p on one platform (plan's, widened or narrowed
    by --knobs, or the Ulysses degrees), auto last, and auto's exact pick
    (None with documents: bench weighs its own cuts)."""
    rows, auto_pick = plan.plan_rows(a.kdacp, facts["cost"], p, a.heads, a.layout)
    # auto runs its pick: it needs that configuration's memory (with
    # documents it weighs bench's cuts, which plan has not seen: any exact
    # row's).
    exact_peak = max(r["model_peak"] for r in rows if r["exact"])
    if a.docs_mean:
        auto_pick, pick_peak = None, exact_peak
    else:
        pick_peak = next((r["model_peak"] for r in rows if r["label"] == auto_pick), 0)
    auto = {"method": "auto", "knob": "", "label": "auto", "exact": True, "model_s": None, "model_peak": pick_peak}
    if a.ulysses:
        # Ulysses x state CP at each U (dividing H and P): the all-to-alls and
        # the model's exchange over P/U ranks; U = 1 is the plain auto.
        return [{"method": "ulysses", "knob": f"U={u}", "label": f"ulysses U={u}", "exact": True, "model_s": None,
                 "model_peak": exact_peak} for u in a.ulysses if p % u == 0 and a.heads % u == 0], auto_pick
    if a.knobs == "all":
        # plan lists pipelined_p2p at its model-best segment count; every
        # count is a knob (bench prices each run itself).
        extra = [dict(r, knob=f"c={c}", label=f"pipelined_p2p c={c}", model_s=None)
                 for r in rows if r["method"] == "pipelined_p2p"
                 for c in range(1, MAX_SEGMENTS + 1) if f"c={c}" != r["knob"]]
        rows = rows + extra
    else:
        # Each protocol at its model-best knob (what auto weighs it by).
        best = {}
        for r in rows:
            if r["method"] not in best or r["model_s"] < best[r["method"]]["model_s"]:
                best[r["method"]] = r
        rows = [r for r in rows if best.get(r["method"]) is r]
    rows = [r for r in rows + [auto] if (not a.protocols or r["method"] in a.protocols)
            and (not a.configurations or r["label"] in a.configurations)]
    return rows, auto_pick


def run_one(a, facts, p, row, auto_pick, speed, tmp):
    """One configuration: its record, run or saying why not."""
    rec = {"platform": facts["name"], "ranks": p, "heads": a.heads, "layout": a.layout, "docs_mean": a.docs_mean,
           **row, "auto_pick": auto_pick}
    need = smpi.input_bytes(p, a.heads) + p * row["model_peak"]
    rec["memory_need_bytes"] = need
    budget = a.max_memory * (1 << 30)
    shared = a.shared_memory == "always" or (a.shared_memory == "auto" and need > budget)
    if shared:
        need = p * smpi.SHARED_RANK_BYTES
    rec["shared_memory"] = shared
    members = smpi.gathered_members(row, p, auto_pick)
    algorithm = smpi.allgather_algorithm(members, a.heads) if members else "rdb"
    rec["smpi_allgather"] = algorithm or "rdb"
    if algorithm is None:
        rec["skipped"] = (f"this all-gather of {members} summaries sends 2 GiB or more in a round, which SMPI 3.32 "
                          "cannot, and kdacp-smpi's own recursive doubling needs a power-of-two member count")
        return rec
    if need > budget:
        rec["skipped"] = (f"needs ~{need / (1 << 30):.0f} GiB ({'ranks sharing memory' if shared else 'P x (inputs + model peak)'}), "
                          f"over --max-memory {a.max_memory:g} GiB")
        return rec
    argv = [a.kdacp_smpi, *smpi.bench_args(row, a.heads, facts["cost"], a.repeat, a.warmup, a.layout, a.docs_mean,
                                           a.tokens_per_rank)]
    stdout, wall, err = smpi.smpirun(facts, p, tmp, speed, argv, a.timeout, shared)
    rec["real_seconds"] = wall
    if err:
        rec["skipped"] = err
        return rec
    r = smpi.last_json(stdout)
    rec.update(sim_forward_s=r["forward_seconds"], sim_backward_s=r["backward_seconds"], model_s=r["predicted_seconds"],
               ran=r["label"], peak_bytes=max(r["forward_peak_bytes"], r["backward_peak_bytes"]),
               parts=r.get("parts"), cuts=r.get("cuts"))
    if row["method"] == "auto":
        rec["auto_pick"] = r["label"]
    if row["method"] == "ulysses":
        rec["tokens_per_rank"] = a.tokens_per_rank
        rec["all_to_all_sim_s"] = r.get("all_to_all_forward_seconds", 0.0)
        rec["all_to_all_model_s"] = r.get("predicted_all_to_all_seconds", 0.0)
        rec["exchange_model_s"] = r.get("predicted_exchange_seconds", r["predicted_seconds"])
    rec["ratio"] = rec["sim_forward_s"] / rec["model_s"]
    return rec


def meta(a, speed):
    return {"date": datetime.date.today().isoformat(), "heads": a.heads, "key_dim": 128, "value_dim": 128,
            "repeat": a.repeat, "warmup": a.warmup, "host_speed_gflops": speed, "shared_memory": a.shared_memory,
            "smpi_options": smpi.SMPI_OPTIONS, "shared_memory_options": smpi.SHARED_MEMORY_OPTIONS}


def sweep(a, facts_of):
    """Runs the sweep `a` describes (simulate.py's flags, checked) on the
    platforms `facts_of` names; the exit status."""
    speed = a.host_speed or plan.host_speed(a.kdacp, a.heads)
    print(f"simulate: this core folds at {speed:.1f} GFLOP/s (smpi/host-speed)", file=sys.stderr)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    records, order = [], row_order(list(plan.protocols(a.kdacp)))
    with tempfile.TemporaryDirectory() as tmp:
        for p in a.ranks:
            for name in a.platforms:
                facts = facts_of[name]
                rows, auto_pick = configurations(a, facts, p)
                for row in rows:
                    rec = run_one(a, facts, p, row, auto_pick, speed, tmp)
                    records.append(rec)
                    records.sort(key=order)
                    shown = (f"{rec['sim_forward_s'] * 1e3:9.3f} ms sim, model {rec['model_s'] * 1e3:9.3f} ms, "
                             f"ratio {rec['ratio']:.2f} ({rec['real_seconds']:.0f} s real"
                             f"{', shared memory' if rec['shared_memory'] else ''})") \
                        if "ratio" in rec else f"skipped: {rec['skipped']}"
                    print(f"simulate: {name} P={p}{case_label(rec)} {row['label']}: {shown}", file=sys.stderr,
                          flush=True)
                    write_atomic(out / "results.json", results_text(meta(a, speed), records))
    write_atomic(out / "table.md", tables.full_table(records))
    write_plot(out, records)
    if a.configurations:
        unknown = sorted(set(a.configurations) - {r["label"] for r in records})
        if unknown:
            print(f"simulate: no configuration named {', '.join(map(repr, unknown))} at any P and platform "
                  "swept (names as in the table: 'grouped_allgather_rd w=512', 'pipelined_p2p c=8', 'auto')",
                  file=sys.stderr)
            return 2
    return 0
