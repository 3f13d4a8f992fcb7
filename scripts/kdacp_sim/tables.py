"""Markdown tables from results records: the full table of every run (what
`simulate.py --table FILE` prints and a sweep writes to table.md), the
summaries docs/scale.md shows, and the page's generated blocks
(<!-- scale-table:NAME:begin --> ... end, NAME the data file
docs/results/scale/NAME.json)."""
import re
from pathlib import Path

from . import results
from .common import UsageError


def ms(seconds):
    return f"{seconds * 1e3:.3f} ms"


def span(lo_hi):
    if lo_hi is None:
        return ""
    lo, hi = lo_hi
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"


def is_ulysses(records):
    return any(r["method"] == "ulysses" for r in records)


def exchange_rows(records):
    """Every record as a row: times beside the model, or why it did not run."""
    lines = ["| platform | P | configuration | simulated fwd | simulated bwd | model | sim/model | peak/rank |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in records:
        label = r["label"] if r["method"] != "auto" or "ran" not in r else f"auto -> {r['ran']}"
        if "ratio" in r:
            bwd = ms(r["sim_backward_s"]) if "sim_backward_s" in r else ""
            peak = f"{r['peak_bytes'] / (1 << 20):.0f} MiB" if "peak_bytes" in r else ""
            lines.append(f"| {r['platform']} | {r['ranks']} | {label}{results.case_label(r)} | {ms(r['sim_forward_s'])} "
                         f"| {bwd} | {ms(r['model_s'])} | {r['ratio']:.2f} | {peak} |")
        else:
            why = " ".join(str(r["skipped"]).split()).replace("|", "/")
            model = "" if r.get("model_s") is None else ms(r["model_s"])
            lines.append(f"| {r['platform']} | {r['ranks']} | {label}{results.case_label(r)} | not run: {why} | "
                         f"| {model} | | |")
    return lines


def exchange_summary(records):
    """One row per platform, P and case (results.summarize)."""
    lines = ["| P | platform | layout | rows within ±30 % | sim/model | not run | auto's pick | its sim "
             "| best sim (exact) | pick/best | pick's rank |",
             "|---:|---|---|---:|---:|---:|---|---:|---|---:|---:|"]
    for s in results.summarize(records):
        auto = ["", "", "", "", ""]
        if "auto" in s:
            auto = [s["auto"], ms(s["auto_s"]), f"{s['best']} {ms(s['best_s'])}", f"{s['auto_over_best']:.2f}",
                    f"{s['auto_rank']} of {s['ranked']}"]
        lines.append("| " + " | ".join([str(s["ranks"]), s["platform"], results.case_text(s["case"]),
                                         f"{s['within_30']} of {s['rows']}", span(s["ratio_range"]),
                                         str(s["skipped"]), *auto]) + " |")
    return lines


def ulysses_rows(records):
    """Every Ulysses record: U, the exchange over P/U it ran, the forward
    (both all-to-alls and the exchange) beside the model, the all-to-alls'
    own times, and the speed-up over U = 1 of the same platform, P and T/P."""
    lines = ["| platform | P | T/P | U | exchange over P/U | sim | model | sim/model | all-to-alls sim / model "
             "| vs U = 1 (sim) |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    plain = {(r["platform"], r["ranks"], r.get("tokens_per_rank", 0)): r["sim_forward_s"]
             for r in records if r["knob"] == "U=1" and "ratio" in r}
    for r in records:
        u = r["knob"][2:]
        if "ratio" not in r:
            why = " ".join(str(r["skipped"]).split()).replace("|", "/")
            lines.append(f"| {r['platform']} | {r['ranks']} | {r.get('tokens_per_rank', '')} | {u} | not run: {why} "
                         "| | | | | |")
            continue
        exchange = r["ran"].split(" + ", 1)[-1]
        a2a = (f"{r['all_to_all_sim_s'] * 1e3:.3f} / {ms(r['all_to_all_model_s'])}"
               if r.get("all_to_all_model_s") else "—")
        base = plain.get((r["platform"], r["ranks"], r.get("tokens_per_rank", 0)))
        vs = f"{base / r['sim_forward_s']:.2f}×" if base else ""
        lines.append(f"| {r['platform']} | {r['ranks']} | {r.get('tokens_per_rank', '')} | {u} | {exchange} "
                     f"| {ms(r['sim_forward_s'])} | {ms(r['model_s'])} | {r['ratio']:.2f} | {a2a} | {vs} |")
    return lines


def ulysses_summary(records):
    lines = ["| platform | P | T/P | rows within ±30 % | sim/model | all-to-alls sim/model | model's U | its sim "
             "| simulated best | pick/best | best vs U = 1 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for s in results.summarize_ulysses(records):
        speedup = f"{s['speedup']:.2f}×" if s["speedup"] else ""
        lines.append(f"| {s['platform']} | {s['ranks']} | {s['tokens_per_rank']} | {s['within_30']} of {s['rows']} "
                     f"| {span(s['ratio_range'])} | {span(s['a2a_range'])} | {s['pick'][2:]} | {ms(s['pick_s'])} "
                     f"| U = {s['best'][2:]} {ms(s['best_s'])} | {s['pick_s'] / s['best_s']:.2f} | {speedup} |")
    return lines


def summary_table(records):
    """The summary docs/scale.md shows for a file's records."""
    return "\n".join(ulysses_summary(records) if is_ulysses(records) else exchange_summary(records)) + "\n"


def full_table(records):
    """Every row, then the summary (`--table`, a sweep's table.md)."""
    rows = ulysses_rows(records) if is_ulysses(records) else exchange_rows(records)
    return "\n".join(rows) + "\n\n" + summary_table(records)


BLOCK = re.compile(r"(<!-- scale-table:([\w-]+):begin -->\n)(.*?)(<!-- scale-table:\2:end -->)", re.S)


def page_blocks(page, data_dir, exact_of=None):
    """The page's text with every generated block as its data file gives
    it, the problems found in the data, and the data files the page names."""
    problems, named = [], set()

    def fill(m):
        name = m.group(2)
        path = Path(data_dir) / f"{name}.json"
        named.add(path.name)
        data = results.load(path)
        problems.extend(f"{path.name}: {p}" for p in results.validate(data["records"], exact_of))
        ran = sum(1 for r in data["records"] if "ratio" in r)
        note = (f"\n{len(data['records'])} configurations, {ran} run; every row: `scripts/simulate.py --table "
                f"docs/results/scale/{path.name}`.\n")
        return m.group(1) + summary_table(data["records"]) + note + m.group(4)

    return BLOCK.sub(fill, page), problems, named


def check_page(page_path, data_dir, exact_of=None, write=False):
    """Compares (or with `write`, rewrites) the page's generated blocks with
    what the data gives; every data file must have a block. The problems,
    as text."""
    try:
        text = Path(page_path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{page_path}: cannot read it ({e})") from e
    want, problems, named = page_blocks(text, data_dir, exact_of)
    if not named:
        problems.append(f"{page_path}: no block between <!-- scale-table:NAME:begin --> and its end marker")
    for path in sorted(Path(data_dir).glob("*.json")):
        if path.name not in named:
            problems.append(f"{path}: no <!-- scale-table:{path.stem}:begin --> block in {page_path} shows it")
    if write and not problems:
        if want != text:
            Path(page_path).write_text(want)
        return []
    if want != text:
        got = {m.group(2): m.group(3) for m in BLOCK.finditer(text)}
        for m in BLOCK.finditer(want):
            if got.get(m.group(2)) != m.group(3):
                old, new = got.get(m.group(2), "").splitlines(), m.group(3).splitlines()
                diff = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
                problems.append(f"{page_path}: block '{m.group(2)}' differs from {m.group(2)}.json's table at its "
                                f"line {diff + 1}:\n  page: {old[diff] if diff < len(old) else '(none)'}\n"
                                f"  data: {new[diff] if diff < len(new) else '(none)'}")
    return problems
