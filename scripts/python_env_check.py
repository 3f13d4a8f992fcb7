#!/usr/bin/env python3
"""Checks that the running interpreter's environment is the pinned one.

    python scripts/python_env_check.py CONSTRAINTS [--docs PAGE] [--debian-python PY]

CONSTRAINTS (scripts/python-constraints.txt) holds one `name==version` per line
(comments and blank lines aside). Every distribution installed in this interpreter's
environment must be pinned there at its installed version, and every pin must be
installed; pip is the venv's own and is left out. scripts/python-env.sh runs this after
each install; the test python.env runs it with --docs and --debian-python as well.

--docs PAGE: the page must name the tested versions as `torch X`, `fla-core X`,
`flash-linear-attention X` and `numpy X` (in backticks), X each one's pin here, and
Debian's torch as `torch X.Y` (its major.minor), X.Y read from --debian-python's torch.

Exit 0 when everything agrees, else 1 with each disagreement on its own line.
"""

import argparse
import importlib.metadata
import re
import subprocess
import sys

NAMED = ("torch", "fla-core", "flash-linear-attention", "numpy")


def normalise(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path):
    pins, errors = {}, []
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
            if not m:
                errors.append(f"{path}:{number}: expected name==version, got {line!r}")
                continue
            name = normalise(m.group(1))
            if name in pins:
                errors.append(f"{path}:{number}: {m.group(1)} pinned twice")
            pins[name] = m.group(2)
    return pins, errors


def installed():
    have = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            have[normalise(name)] = dist.version
    have.pop("pip", None)
    return have


def compare(pins, have):
    errors = []
    for name in sorted(set(pins) | set(have)):
        if name not in have:
            errors.append(f"{name}=={pins[name]} is pinned but not installed")
        elif name not in pins:
            errors.append(f"{name} {have[name]} is installed but not pinned")
        elif have[name] != pins[name]:
            errors.append(f"{name} {have[name]} is installed, {pins[name]} pinned")
    return errors


def check_docs(page, pins, debian_python):
    with open(page, encoding="utf-8") as f:
        text = f.read()
    errors = []
    for name in NAMED:
        if name not in pins:
            errors.append(f"{name} is not pinned, so {page} cannot name its version")
        elif f"`{name} {pins[name]}`" not in text:
            errors.append(f"{page} does not name `{name} {pins[name]}`")
    if debian_python:
        out = subprocess.run([debian_python, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            errors.append(f"{debian_python} cannot import torch: {out.stderr.strip()}")
        else:
            major_minor = ".".join(out.stdout.strip().split(".")[:2])
            if f"`torch {major_minor}`" not in text:
                errors.append(f"{page} does not name Debian's `torch {major_minor}` "
                              f"({debian_python} has {out.stdout.strip()})")
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("constraints")
    parser.add_argument("--docs")
    parser.add_argument("--debian-python")
    args = parser.parse_args()
    pins, errors = read_pins(args.constraints)
    if sys.prefix == sys.base_prefix:
        errors.append(f"{sys.executable} is not a virtual environment's interpreter")
    errors += compare(pins, installed())
    if args.docs:
        errors += check_docs(args.docs, pins, args.debian_python)
    for e in errors:
        print(f"python_env_check: {e}", file=sys.stderr)
    if not errors:
        print(f"python_env_check: {len(pins)} pinned packages installed at their versions"
              + (f"; {args.docs} names the tested versions" if args.docs else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
