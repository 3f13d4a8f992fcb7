"""Results files: what a sweep writes (results.json) and what docs/results/
keeps, read back, merged and summarized. A file is one JSON object: the
sweep's settings and "records", one per configuration run (or not run, with
"skipped" saying why)."""
import json
import math
import re
from pathlib import Path

from .common import UsageError

# What every record carries; a run that happened adds its times and ratio.
RECORD_KEYS = ("platform", "ranks", "heads", "method", "knob", "label", "exact")
RUN_KEYS = ("sim_forward_s", "model_s", "ratio", "ran")


def load(path, flag=""):
    """A results file's object, its records checked for the keys the tables
    read (UsageError naming the flag that gave it, the file and the record
    otherwise)."""
    name = f"{flag} {path}" if flag else str(path)
    try:
        data = json.loads(Path(path).read_text())
        records = data["records"]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{name}: cannot read it ({e})") from e
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{name}: expected a results JSON object with \"records\" ({e})") from e
    if not isinstance(records, list):
        raise UsageError(f"{name}: \"records\" is not a list")
    for i, r in enumerate(records):
        missing = [k for k in RECORD_KEYS if not isinstance(r, dict) or k not in r]
        if not missing and "skipped" not in r:
            missing = [k for k in RUN_KEYS if k not in r]
        if missing:
            raise UsageError(f"{name}: record {i} lacks {', '.join(missing)}")
    return data


def case_of(r):
    """A record's layout and documents (records without them: contiguous, no
    cuts)."""
    return r.get("layout", "contiguous"), r.get("docs_mean", 0)


def case_text(case):
    layout, docs = case
    return layout + (f", docs {docs}" if docs else "")


def case_label(r):
    """The case as the full table appends it to a configuration: ' [zigzag,
    docs 8192]', nothing for the plain case."""
    layout, docs = case_of(r)
    parts = ([] if layout == "contiguous" else [layout]) + ([f"docs {docs}"] if docs else [])
    return f" [{', '.join(parts)}]" if parts else ""


def key_of(r):
    """What one record measures: no file lists it twice."""
    return r["platform"], r["ranks"], case_of(r), r.get("tokens_per_rank", 0), r["label"]


def row_order(order):
    """A sort key in `kdacp plan`'s row order (`order`: the methods as plan
    lists them), then the knob's value, auto and Ulysses last; a merged file
    keeps it whatever order its runs came in."""
    def key(r):
        method = r["method"]
        rank = order.index(method) if method in order else len(order) + (method == "ulysses")
        knob = re.match(r"^[wcU]=(\d+)$", r.get("knob") or "")
        return (r["ranks"], r["platform"] != "nvlink-ib", case_of(r), r.get("tokens_per_rank", 0), rank,
                int(knob.group(1)) if knob else 0)
    return key


def merge(parts, order):
    """The records of several results objects, a later one's record replacing
    an earlier one's of the same key, except that a run that did not happen
    never hides one that did; the first object's settings."""
    merged = {}
    for part in parts:
        for r in part["records"]:
            key = key_of(r)
            if "ratio" in r or key not in merged or "ratio" not in merged[key]:
                merged[key] = r
    return dict(parts[0], records=sorted(merged.values(), key=row_order(order)))


def validate(records, exact_of=None):
    """What a results file must hold to be tabled: no configuration twice,
    each ratio its two times' (within their printed rounding: times in ms
    to three decimals, ratios to two), and with `exact_of` (method: exact,
    from kdacp plan) each record's exact flag the registry's. The problems,
    as text."""
    problems, seen = [], set()
    half = 0.0005e-3  # half a printed microsecond
    for r in records:
        key = key_of(r)
        name = f"{r['platform']} P={r['ranks']}{case_label(r)} {r['label']}"
        if key in seen:
            problems.append(f"{name}: listed twice")
        seen.add(key)
        if exact_of is not None and r["method"] in exact_of and r["exact"] != exact_of[r["method"]]:
            problems.append(f"{name}: exact {r['exact']}, but kdacp plan says {exact_of[r['method']]}")
        if exact_of is not None and r["method"] not in exact_of and r["method"] not in ("auto", "ulysses"):
            problems.append(f"{name}: '{r['method']}' is no method of kdacp plan")
        if "ratio" not in r:
            continue
        f, m, ratio = r["sim_forward_s"], r["model_s"], r["ratio"]
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in (f, m, ratio)):
            problems.append(f"{name}: expected positive finite times and ratio, got {f!r}, {m!r}, {ratio!r}")
            continue
        lo, hi = (f - half) / (m + half), (f + half) / max(m - half, 1e-15)
        if not lo - 0.005 <= ratio <= hi + 0.005:
            problems.append(f"{name}: sim/model {ratio:.3f}, but {f * 1e3:.3f} / {m * 1e3:.3f} ms is {f / m:.3f}")
    return problems


def pick_time(rows, auto):
    """auto's time: where the file has the configuration auto ran, that
    row's (one measurement per configuration), auto's own run otherwise."""
    same = next((r for r in rows if r["label"] == auto["ran"]), auto)
    return same["sim_forward_s"]


def summarize(records):
    """Per platform, P and case (layout, documents): how many rows the model
    predicts within ±30 %, their range of sim/model, and auto's pick against
    the simulated fastest exact configuration."""
    out = []
    groups = {}
    for r in records:
        groups.setdefault((r["platform"], r["ranks"], case_of(r)), []).append(r)
    for (plat, p, case), group in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0] != "nvlink-ib",
                                                                          kv[0][2])):
        ran = [r for r in group if "ratio" in r]
        rows = [r for r in ran if r["method"] != "auto"]
        auto = next((r for r in ran if r["method"] == "auto"), None)
        ratios = [r["ratio"] for r in rows]
        s = {"platform": plat, "ranks": p, "case": case, "rows": len(rows),
             "within_30": sum(1 for x in ratios if abs(x - 1) <= 0.3),
             "ratio_range": (min(ratios), max(ratios)) if ratios else None,
             "skipped": sum(1 for r in group if "skipped" in r)}
        exact = [r for r in rows if r["exact"]]
        if exact and auto:
            best = min(exact, key=lambda r: r["sim_forward_s"])
            pick_s = pick_time(exact, auto)
            s.update(auto=auto["ran"], auto_s=pick_s, best=best["label"], best_s=best["sim_forward_s"],
                     auto_over_best=pick_s / best["sim_forward_s"],
                     auto_rank=1 + sum(1 for r in exact if r["sim_forward_s"] < pick_s * (1 - 1e-9)),
                     ranked=len(exact))
        out.append(s)
    return out


def summarize_ulysses(records):
    """Per platform, P and T/P: the rows within ±30 % and their ranges (the
    whole forward, the all-to-alls), the model's U (its fastest prediction)
    against the simulated fastest U, and that one's speed-up over U = 1."""
    out = []
    groups = {}
    for r in records:
        if "ratio" in r:
            groups.setdefault((r["platform"], r["ranks"], r.get("tokens_per_rank", 0)), []).append(r)
    for (plat, p, tpr), rows in sorted(groups.items(), key=lambda kv: (kv[0][0] != "nvlink-ib", kv[0][1], kv[0][2])):
        ratios = [r["ratio"] for r in rows]
        a2a = [r["all_to_all_sim_s"] / r["all_to_all_model_s"] for r in rows if r.get("all_to_all_model_s")]
        pick = min(rows, key=lambda r: r["model_s"])
        best = min(rows, key=lambda r: r["sim_forward_s"])
        plain = next((r for r in rows if r["knob"] == "U=1"), None)
        out.append({"platform": plat, "ranks": p, "tokens_per_rank": tpr, "rows": len(rows),
                    "within_30": sum(1 for x in ratios if abs(x - 1) <= 0.3), "ratio_range": (min(ratios), max(ratios)),
                    "a2a_range": (min(a2a), max(a2a)) if a2a else None, "pick": pick["knob"],
                    "pick_s": pick["sim_forward_s"], "best": best["knob"], "best_s": best["sim_forward_s"],
                    "speedup": plain["sim_forward_s"] / best["sim_forward_s"] if plain else None})
    return out
