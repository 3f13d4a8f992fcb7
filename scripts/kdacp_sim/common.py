"""What every module of the simulation driver shares."""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


class UsageError(Exception):
    """A flag or an input file that cannot work: said in the flag's terms,
    before any simulation runs."""


def fail(msg):
    print(f"simulate.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def write_atomic(path, text):
    """Writes `path` whole or not at all: a temporary file beside it, renamed."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def results_text(meta, records):
    """A results file: the run's settings, then one record per line (a sweep
    rewrites it after every run; merged files stay diffable)."""
    head = {k: v for k, v in meta.items() if k != "records"}
    body = ",\n".join("  " + json.dumps(r) for r in records)
    return json.dumps(head, indent=1)[:-2] + ',\n "records": [\n' + body + ("\n" if records else "") + " ]\n}\n"
