#!/usr/bin/env python3
"""README.md and docs/ against the code they describe.

    python3 tests/docs/check_readme.py KDACP_BINARY REPO_ROOT

Checks, each failing with what to fix:
- README.md has at most 150 lines and starts (after its title) with the two
  commands `make run` and `make test`, which the Makefile defines;
- the defaults it quotes between <!-- defaults:begin --> and <!-- defaults:end -->
  (algorithm, protocol, timeout, whether the forward is kept) are those that
  `kdacp run --help` and `kdacp kda --help` print;
- it shows one example of every subcommand `kdacp --help` lists;
- every relative link of README.md and docs/*.md reaches a file, and a
  #fragment a heading of it;
- every "SPEC §N" in the code, tests and docs names a section of docs/spec.md,
  and nothing points to a spec outside the repository.
"""

import os
import re
import subprocess
import sys

MAX_README_LINES = 150


def run_help(kdacp, *args):
    out = subprocess.run([kdacp, *args, "--help"], capture_output=True, text=True, check=True)
    return out.stdout


def flag_default(help_text, flag):
    """The `=default` CLI11 prints after a flag's type, or None."""
    m = re.search(r"^\s+(?:-\w,)?" + re.escape(flag) + r"\s+\S*?=(\S+)", help_text, re.M)
    return m.group(1) if m else None


def keeps_forward(help_text, command):
    """Whether the chunk forward is kept for the backward by default."""
    recompute = re.search(r"^\s+--recompute\b", help_text, re.M)
    keep = re.search(r"^\s+--keep-forward\b(\s+\S*?=(\S+))?", help_text, re.M)
    if keep and keep.group(2):
        return keep.group(2).lower() in ("true", "1", "on", "yes")
    if recompute and not keep:
        return True
    if keep and not recompute:
        return False
    raise SystemExit(f"kdacp {command} --help: cannot tell whether the forward is kept by "
                     f"default (neither --recompute alone nor --keep-forward alone); update "
                     f"keeps_forward() in tests/docs/check_readme.py")


def cli_defaults(kdacp):
    """The defaults of `kdacp run` and `kdacp kda`, which must agree."""
    found = {}
    for command in ("run", "kda"):
        text = run_help(kdacp, command)
        values = {
            "algorithm": flag_default(text, "--algorithm"),
            "timeout": flag_default(text, "--timeout"),
            "keep_forward": keeps_forward(text, command),
        }
        if command == "kda":
            values["protocol"] = flag_default(text, "--protocol")
        for name, value in values.items():
            if value is None:
                raise SystemExit(f"kdacp {command} --help prints no default for {name}")
            if name in found and found[name][0] != value:
                raise SystemExit(f"kdacp run and kdacp kda disagree on the default {name}: "
                                 f"{found[name][0]} and {value}; the README quotes one")
            found.setdefault(name, (value, command))
    return {name: value for name, (value, _) in found.items()}


def readme_defaults(readme):
    m = re.search(r"<!-- defaults:begin -->\n(.*?)<!-- defaults:end -->", readme, re.S)
    if not m:
        raise SystemExit("README.md: the <!-- defaults:begin/end --> markers are missing")
    text = " ".join(m.group(1).split())
    quoted = {}
    for name, pattern in (("algorithm", r"algorithm `(\w+)`"),
                          ("protocol", r"protocol `(\w+)`"),
                          ("timeout", r"timeout ([0-9.]+) s\b")):
        hit = re.search(pattern, text)
        quoted[name] = hit.group(1) if hit else None
    kept = "forward kept for the backward" in text
    recomputed = "forward recomputed in the backward" in text
    quoted["keep_forward"] = True if kept and not recomputed else (
        False if recomputed and not kept else None)
    return quoted


def check_defaults(kdacp, readme, errors):
    want = cli_defaults(kdacp)
    have = readme_defaults(readme)
    phrases = {"algorithm": "algorithm `{}`", "protocol": "protocol `{}`",
               "timeout": "timeout {} s"}
    for name, value in want.items():
        if name == "keep_forward":
            phrase = ("forward kept for the backward" if value else
                      "forward recomputed in the backward")
            ok = have[name] == value
        else:
            shown = value
            if name == "timeout":
                shown = f"{float(value):g}"
                ok = have[name] is not None and float(have[name]) == float(value)
            else:
                ok = have[name] == value
            phrase = phrases[name].format(shown)
        if not ok:
            errors.append(f"README.md: the defaults paragraph must say \"{phrase}\" "
                          f"(kdacp run/kda --help), it says {have[name]!r}")
    return want


def check_start(root, readme, errors):
    lines = readme.split("\n")
    if len(lines) - (1 if readme.endswith("\n") else 0) > MAX_README_LINES:
        errors.append(f"README.md has {len(lines) - 1} lines, more than {MAX_README_LINES}")
    body = [l for l in lines[1:] if l.strip()]
    commands = [l.split("#")[0].strip() for l in body[1:3]]
    if not (lines[0].startswith("# ") and body[0] == "```sh" and commands == ["make run", "make test"]
            and body[3] == "```"):
        errors.append("README.md must start, after its title, with a sh block holding exactly "
                      "`make run` and `make test`")
    with open(os.path.join(root, "Makefile"), encoding="utf-8") as f:
        makefile = f.read()
    for target in ("run", "test"):
        if not re.search(rf"^{target}:", makefile, re.M):
            errors.append(f"Makefile has no `{target}` target, which README.md starts with")


def check_commands(kdacp, readme, errors):
    text = subprocess.run([kdacp, "--help"], capture_output=True, text=True, check=True).stdout
    section = text.split("Subcommands:", 1)[1] if "Subcommands:" in text else ""
    commands = re.findall(r"^\s{2}(\w+)\s", section, re.M)
    if not commands:
        errors.append("kdacp --help lists no subcommands")
    blocks = "\n".join(re.findall(r"```sh\n(.*?)```", readme, re.S))
    for command in commands:
        if not re.search(rf"(kdacp|\$K) {command}\b", blocks):
            errors.append(f"README.md shows no example of `kdacp {command}` in a sh block")


def slug(heading):
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def check_links(root, errors):
    pages = ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(
        os.path.join(root, "docs")) if n.endswith(".md"))
    for page in pages:
        with open(os.path.join(root, page), encoding="utf-8") as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            full = os.path.normpath(os.path.join(root, os.path.dirname(page), path)) if path \
                else os.path.join(root, page)
            if not os.path.exists(full):
                errors.append(f"{page}: link to {target}: no such file")
            elif fragment and full.endswith(".md") and fragment not in anchors(full):
                errors.append(f"{page}: link to {target}: no such heading in {path or page}")
        if "shared/SPEC" in text:
            errors.append(f"{page}: points to a spec outside the repository; cite docs/spec.md")


def check_spec_citations(root, errors):
    with open(os.path.join(root, "docs", "spec.md"), encoding="utf-8") as f:
        sections = {int(n) for n in re.findall(r"^## (\d+)\. ", f.read(), re.M)}
    if sections != set(range(1, max(sections, default=0) + 1)) or not sections:
        errors.append(f"docs/spec.md: sections must be numbered 1..N, found {sorted(sections)}")
    cited = 0
    for top in ("src", "include", "tools", "python", "tests", "bench", "fuzz", "docs",
                "README.md"):
        base = os.path.join(root, top)
        files = [base] if os.path.isfile(base) else [
            os.path.join(d, n) for d, _, ns in os.walk(base) for n in ns]
        for path in files:
            if not re.search(r"\.(h|hpp|cpp|cc|py|md|cmake|txt)$", path):
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            for m in re.finditer(r"SPEC\s+((?:§\d+(?:\s*[-–,]\s*|\s+and\s+)?)+)", text):
                for n in re.findall(r"§(\d+)", m.group(1)):
                    cited += 1
                    if int(n) not in sections:
                        line = text.count("\n", 0, m.start()) + 1
                        errors.append(f"{os.path.relpath(path, root)}:{line}: cites SPEC §{n}, "
                                      f"which docs/spec.md does not have")
    return cited


def main():
    kdacp, root = sys.argv[1], os.path.abspath(sys.argv[2])
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    errors = []
    check_start(root, readme, errors)
    defaults = check_defaults(kdacp, readme, errors)
    check_commands(kdacp, readme, errors)
    check_links(root, errors)
    cited = check_spec_citations(root, errors)
    for e in errors:
        print(e)
    if errors:
        print(f"docs check: {len(errors)} problem(s)")
        return 1
    print(f"docs agree with the code: README {len(readme.splitlines())} lines; defaults "
          f"{defaults}; {cited} SPEC citations resolve in docs/spec.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
