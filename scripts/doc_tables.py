#!/usr/bin/env python3
"""The measured tables of docs/*.md, generated from their data files.

    python3 scripts/doc_tables.py [--root REPO] [--check]

Every file docs/results/AREA/NAME.json (docs/results/scale/ excepted: scripts/simulate.py
owns those) holds one table: the page it belongs to, how it was measured ("about": the
command, the host, the date and the commit), its columns and its rows. Each column is a
title, a cell template (Python's str.format over the row's fields, with two extra format
specs, below) and an optional "align": "right". The page holds the table between

    <!-- table:NAME:begin -->
    <!-- table:NAME:end -->

Without --check the tables are written into the pages. With --check nothing is written: it
fails, naming the page, the table and the first differing line, when a page's table is not
what its data generates, when a page has markers without data or data has no markers, or
when a row lacks a field its template reads. The check also proves on itself that a changed
cell would be caught, so that it cannot pass by comparing nothing.

Extra format specs: "{x:dur}" writes seconds as µs, ms or s; "{x:range}" a list of
measurements as lowest–highest (integers with thousands separators, others with two
decimals); "{x:pick}" a Ulysses choice, 1 (plain state CP is fastest) or [U, seconds,
speed-up over U = 1].
A field that is null prints as "–".
"""

import argparse
import difflib
import glob
import json
import os
import re
import string
import sys

# scripts/simulate.py generates and checks docs/scale.md's tables from docs/results/scale/.
OWNED_ELSEWHERE = ("scale",)
MARKERS = re.compile(r"<!-- table:([\w-]+):begin -->\n(.*?)<!-- table:\1:end -->", re.S)
ANY_MARKER = re.compile(r"<!-- table:([\w-]+):(begin|end) -->")


def duration(seconds):
    """Seconds in three significant digits and the unit a reader compares: 51.7 µs, 568 µs,
    1.22 ms, 15.1 ms, 2.24 s."""
    for scale, unit in ((1e-6, "µs"), (1e-3, "ms"), (1, "s")):
        if seconds < scale * 1000 or unit == "s":
            return f"{seconds / scale:#.3g}".rstrip(".") + f" {unit}"


def number(x):
    return f"{x:,}" if isinstance(x, int) else f"{x:.2f}"


def range_text(values):
    """A list of measurements as its lowest–highest (one value when they agree)."""
    low, high = min(values), max(values)
    return number(low) if low == high else f"{number(low)}–{number(high)}"


class CellFormatter(string.Formatter):
    def format_field(self, value, spec):
        if value is None:
            return "–"
        if spec == "dur":
            return duration(value)
        if spec == "range":
            return range_text(value)
        if spec == "pick":
            if value == 1:
                return "1"
            u, seconds, speedup = value
            return f"**{u}**: {duration(seconds)}, {speedup:.2f}×"
        return super().format_field(value, spec)


FORMATTER = CellFormatter()


class TableError(Exception):
    pass


def render(table, source):
    """The Markdown of one table: header, alignment row, one line per row."""
    columns = table.get("columns")
    rows = table.get("rows")
    if not columns or not isinstance(rows, list) or not rows:
        raise TableError(f"{source}: needs non-empty \"columns\" and \"rows\"")
    head = "| " + " | ".join(c["title"] for c in columns) + " |"
    rule = "|" + "|".join("---:" if c.get("align") == "right" else "---" for c in columns) + "|"
    lines = [head, rule]
    for i, row in enumerate(rows):
        cells = []
        for c in columns:
            try:
                cells.append(FORMATTER.format(c["cell"], **row))
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise TableError(f"{source}: row {i + 1}, column \"{c['title']}\": "
                                 f"{type(e).__name__}: {e}") from None
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def load_tables(root):
    """NAME -> (page, markdown, data file) for every data file this script owns."""
    tables = {}
    pattern = os.path.join(root, "docs", "results", "*", "*.json")
    for path in sorted(glob.glob(pattern)):
        area = os.path.basename(os.path.dirname(path))
        if area in OWNED_ELSEWHERE:
            continue
        source = os.path.relpath(path, root)
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise TableError(f"{source}: not JSON: {e}") from None
        name = os.path.splitext(os.path.basename(path))[0]
        if name in tables:
            raise TableError(f"{source}: table name {name} is also {tables[name][2]}")
        page = data.get("page")
        if not page or not os.path.isfile(os.path.join(root, page)):
            raise TableError(f"{source}: \"page\" {page!r} is no file of the repository")
        if not data.get("about", {}).get("command"):
            raise TableError(f"{source}: \"about\" must name the command that measured it")
        tables[name] = (page, render(data, source), source)
    return tables


def pages_of(root, tables):
    pages = {page for page, _, _ in tables.values()}
    for path in glob.glob(os.path.join(root, "docs", "*.md")) + [os.path.join(root, "README.md")]:
        with open(path, encoding="utf-8") as f:
            if ANY_MARKER.search(f.read()):
                pages.add(os.path.relpath(path, root))
    return sorted(pages)


def first_difference(have, want):
    diff = [l for l in difflib.unified_diff(have.splitlines(), want.splitlines(), "page",
                                            "data", lineterm="", n=0) if l[:1] in "+-"]
    return "; ".join(diff[2:4]) if len(diff) > 2 else "(whitespace)"


def compare(root, tables, pages, write):
    """Problems found; with write, the pages brought up to date instead."""
    problems = []
    seen = set()
    for page in pages:
        path = os.path.join(root, page)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        begins = [m.group(1) for m in ANY_MARKER.finditer(text) if m.group(2) == "begin"]
        blocks = {m.group(1) for m in MARKERS.finditer(text)}
        for name in begins:
            if name not in blocks:
                problems.append(f"{page}: table {name}: begin marker without its end marker")

        def replace(m):
            name, have = m.group(1), m.group(2)
            seen.add(name)
            if name not in tables:
                problems.append(f"{page}: table {name} has no data file "
                                f"docs/results/*/{name}.json")
                return m.group(0)
            want_page, want, source = tables[name]
            if want_page != page:
                problems.append(f"{page}: table {name} belongs to {want_page} ({source})")
                return m.group(0)
            if have != want and not write:
                problems.append(f"{page}: table {name} differs from {source}: "
                                f"{first_difference(have, want)}; run scripts/doc_tables.py")
            return f"<!-- table:{name}:begin -->\n{want}<!-- table:{name}:end -->"

        new = MARKERS.sub(replace, text)
        if write and new != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
            print(f"wrote {page}")
    for name, (page, _, source) in sorted(tables.items()):
        if name not in seen:
            problems.append(f"{source}: {page} has no <!-- table:{name}:begin/end --> markers")
    return problems


def self_check(root, tables, pages):
    """A changed cell must be reported: compare a page whose table lost a digit."""
    name, (page, want, _) = sorted(tables.items())[0]
    digit = re.search(r"\d", want.split("\n", 2)[2])
    if not digit:
        return f"self-check: table {name} has no digit to change"
    at = len(want.split("\n", 2)[0]) + len(want.split("\n", 2)[1]) + 2 + digit.start()
    changed = want[:at] + str((int(want[at]) + 1) % 10) + want[at + 1:]
    mutated = dict(tables)
    mutated[name] = (page, changed, tables[name][2])
    if not any(name in p for p in compare(root, mutated, [page], write=False)):
        return f"self-check: a changed cell of table {name} went unnoticed"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--check", action="store_true",
                    help="write nothing; fail when a page's table is not what its data generates")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    try:
        tables = load_tables(root)
    except TableError as e:
        print(e)
        return 1
    if not tables:
        print("no data files under docs/results/")
        return 1
    pages = pages_of(root, tables)
    problems = compare(root, tables, pages, write=not args.check)
    if args.check and not problems:
        failed = self_check(root, tables, pages)
        if failed:
            problems.append(failed)
    for p in problems:
        print(p)
    if problems:
        print(f"doc tables: {len(problems)} problem(s)")
        return 1
    print(f"doc tables agree with their data: {len(tables)} tables on {len(pages)} pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
