#!/usr/bin/env python3
"""The include rule of docs/architecture.md, checked.

Every file under src/, include/, tools/ and python/src/ belongs to one module
(MODULE_OF below); each #include of a file of this repository must go to the
same module or to one the including module may use (MAY_USE). A few outside
headers are confined to the modules that own them (OUTSIDE). A violation is
printed as `file:line: module -> module (included path)` and fails the check,
unless it is listed in KNOWN_EXCEPTIONS; an exception that no longer occurs
fails too, so that removing a violation also removes it from the list.

    python3 tests/docs/check_includes.py [REPO_ROOT]
"""

import os
import re
import sys

# Which module may include which (beside itself). Lowest first; a module may
# use only modules listed before it. docs/architecture.md draws the same graph.
MAY_USE = {
    "core": [],
    "kernels": ["core"],
    "comm": ["core"],
    "mesh": ["comm", "core"],
    "layout": ["core"],
    "exchange": ["layout", "mesh", "comm", "kernels", "core"],
    "kda": ["layout", "kernels", "core"],
    "layer": ["kda", "exchange", "layout", "mesh", "comm", "kernels", "core"],
    "calibrate": ["exchange", "layout", "mesh", "comm", "kernels", "core"],
    "launch": ["comm", "core"],
    "mpi": ["launch", "comm", "core"],
    "conv": ["layout", "comm", "core"],
    "job": ["layer", "kda", "calibrate", "exchange", "layout", "mesh", "launch", "comm",
            "kernels", "core"],
    "testing": ["job", "conv", "layer", "kda", "calibrate", "exchange", "layout", "mesh", "launch",
                "comm", "kernels", "core"],
    "report": ["testing", "job", "conv", "layer", "kda", "calibrate", "exchange", "layout", "mesh",
               "launch", "comm", "kernels", "core"],
    "python": ["job", "conv", "layer", "kda", "calibrate", "exchange", "layout", "mesh", "launch",
               "comm", "kernels", "core"],
    # The CLI parses flags, calls the libraries and prints: what it runs is
    # `report`'s, never a test aid of `testing` directly.
    "tools": ["report", "mpi", "job", "conv", "layer", "kda", "calibrate", "exchange", "layout",
              "mesh", "launch", "comm", "kernels", "core"],
}

# The module of each public header (include/kdacp/testing/* is `testing`,
# include/kdacp/report/* is `report`).
# A new public header must be added here: the check fails until it is.
HEADER_MODULE = {
    "error.hpp": "core", "tensor.hpp": "core", "memory.hpp": "core",
    "thread_pool.hpp": "core", "npy.hpp": "core", "units.hpp": "core",
    "output.hpp": "core", "finite.hpp": "core", "summary.hpp": "core",
    "defaults.hpp": "core", "half.hpp": "core",
    "kernels.hpp": "kernels",
    "comm.hpp": "comm", "inprocess.hpp": "comm", "agreement.hpp": "comm",
    "mesh.hpp": "mesh",
    "layout.hpp": "layout",
    "exchange.hpp": "exchange", "protocol.hpp": "exchange", "cost_model.hpp": "exchange",
    "admission.hpp": "exchange",
    "kda.hpp": "kda",
    "kda_cp.hpp": "layer", "kda_ulysses.hpp": "layer", "layer.hpp": "layer",
    "calibrate.hpp": "calibrate",
    "launch.hpp": "launch",
    "mpi.hpp": "mpi", "launch_mpi.hpp": "mpi",
    "conv.hpp": "conv",
    "job.hpp": "job", "job_npy.hpp": "job", "job_plan.hpp": "job",
}

# Source files whose module is not their folder's.
FILE_MODULE = {}

# Outside headers only their owners include (prefix of the <...> path).
OUTSIDE = {
    "mpi.h": ["mpi"],
    "smpi_helpers_internal.h": ["mpi"],
    "simgrid/": ["mpi"],
    "pybind11/": ["python"],
    "torch/": ["python"],
    "CLI/": ["tools"],
    "gtest/": [],
}

# Violations of the rule that must stay for a while, each a (file, included
# file) pair, with the reason beside it. Delete an entry when its include
# goes; the check fails while a listed include no longer exists.
KNOWN_EXCEPTIONS = set()

SCANNED = ["src", "include", "tools", "python/src"]
SOURCE = re.compile(r"\.(h|hpp|cpp|cc|def)$")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def module_of(path):
    """The module of a repository path, or None when it has none."""
    if path in FILE_MODULE:
        return FILE_MODULE[path]
    if path.startswith("include/kdacp/testing/"):
        return "testing"
    if path.startswith("include/kdacp/report/"):
        return "report"
    if path.startswith("include/kdacp/"):
        return HEADER_MODULE.get(path[len("include/kdacp/"):])
    if path.startswith("src/comm/mpi/") or path.startswith("src/comm/smpi/"):
        return "mpi"
    if path.startswith("src/comm/"):
        return "comm"
    if path.startswith("src/"):
        folder = path.split("/")[1]
        return folder if folder in MAY_USE else None
    if path.startswith("tools/"):
        return "tools"
    if path.startswith("python/src/"):
        return "python"
    return None


def resolve(root, path, quote, name):
    """The repository path an include names, or None for an outside header."""
    bases = ([os.path.dirname(path)] if quote == '"' else []) + ["src", "include"]
    for base in bases:
        candidate = os.path.normpath(os.path.join(base, name))
        if os.path.isfile(os.path.join(root, candidate)):
            return candidate
    return None


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), "..", ".."))
    errors, seen, files = [], set(), 0
    for top in SCANNED:
        for folder, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(names):
                if not SOURCE.search(name):
                    continue
                path = os.path.relpath(os.path.join(folder, name), root)
                files += 1
                mod = module_of(path)
                if mod is None:
                    errors.append(f"{path}: belongs to no module; add its header to HEADER_MODULE "
                                  f"or its folder to MAY_USE in tests/docs/check_includes.py "
                                  f"and to docs/architecture.md")
                    continue
                with open(os.path.join(root, path), encoding="utf-8") as f:
                    lines = f.readlines()
                for number, line in enumerate(lines, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    quote, included = m.group(1), m.group(2)
                    target = resolve(root, path, quote, included)
                    if target is None:
                        for prefix, owners in OUTSIDE.items():
                            if included.startswith(prefix) and mod not in owners:
                                errors.append(f"{path}:{number}: {mod} includes <{included}>, "
                                              f"which only {', '.join(owners) or 'tests'} may")
                        continue
                    if path.startswith("include/") and target.startswith("src/"):
                        errors.append(f"{path}:{number}: a public header includes the private "
                                      f"{target}")
                        continue
                    to = module_of(target)
                    if to is None or to == mod or to in MAY_USE[mod]:
                        continue
                    if (path, target) in KNOWN_EXCEPTIONS:
                        seen.add((path, target))
                        continue
                    errors.append(f"{path}:{number}: {mod} -> {to} ({target}); "
                                  f"{mod} may use: {', '.join(MAY_USE[mod]) or 'nothing'}")
    for path, target in sorted(KNOWN_EXCEPTIONS - seen):
        errors.append(f"known exception no longer occurs: {path} -> {target}; "
                      f"delete it from KNOWN_EXCEPTIONS in tests/docs/check_includes.py")
    if files == 0:
        errors.append(f"no source files under {root}")
    for e in errors:
        print(e)
    if errors:
        print(f"include rule: {len(errors)} problem(s) in {files} files (docs/architecture.md)")
        return 1
    print(f"include rule holds in {files} files ({len(KNOWN_EXCEPTIONS)} known exceptions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
