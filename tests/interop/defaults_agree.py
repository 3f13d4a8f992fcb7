"""The defaults are one set (kdacp/defaults.hpp): the C++ constants (through
kdacp.defaults(), the binding of the header), the CLI's --help of every
command that takes the flag, and kdacp.torch's own defaults agree. Usage:
defaults_agree.py <kdacp> with the build's python/ on PYTHONPATH."""

import inspect
import re
import subprocess
import sys

import kdacp
import kdacp._kdacp
import kdacp.torch as kt
from kdacp import _common

kdacp_cli = sys.argv[1]
failures = []


def check(what, got, want):
    if got != want:
        failures.append(f"{what}: {got!r}, expected {want!r} (kdacp/defaults.hpp)")


def help_text(command):
    r = subprocess.run([kdacp_cli, *command.split(), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (command, r.stderr)
    return re.sub(r"\s+", " ", r.stdout)


def shown_default(text, flag, command):
    """The default CLI11 prints after `flag` and its type name: `--timeout FLOAT=120`."""
    m = re.search(re.escape(flag) + r" \S*?=(\S+)", text)
    if not m:
        failures.append(f"kdacp {command} --help shows no default for {flag}")
        return None
    return m.group(1)


d = kdacp.defaults()
check("kdacp.defaults() keys", sorted(d), ["algorithm", "deterministic", "keep_forward", "timeout"])
check("C++ default algorithm", d["algorithm"], "chunk")
check("C++ default keep_forward", d["keep_forward"], True)
check("C++ default timeout", d["timeout"], 120.0)
check("C++ default deterministic", d["deterministic"], False)

# The CLI: --algorithm and --recompute where the layer runs, --timeout wherever ranks run.
for command in ("run", "kda"):
    text = help_text(command)
    check(f"kdacp {command} --algorithm", shown_default(text, "--algorithm", command), d["algorithm"])
    m = re.search(r"--recompute .*?default: (on|off)", text)
    if not m:
        failures.append(f"kdacp {command} --help does not say --recompute's default")
    else:
        check(f"kdacp {command} keep_forward (not --recompute)", m.group(1) == "off", d["keep_forward"])
text = help_text("bench layer")
m = re.search(r"--recompute .*?default: (on|off)", text)
check("kdacp bench layer keep_forward (not --recompute)", bool(m) and m.group(1) == "off", d["keep_forward"])
for command in ("run", "kda", "exchange", "calibrate"):
    shown = shown_default(help_text(command), "--timeout", command)
    check(f"kdacp {command} --timeout", None if shown is None else float(shown), d["timeout"])

# Python: kdacp.torch.kda's signature, its timeout option, and the binding's defaults.
params = inspect.signature(kt.kda).parameters
check("kdacp.torch.kda algorithm", params["algorithm"].default, d["algorithm"])
check("kdacp.torch.kda keep_forward", params["keep_forward"].default, d["keep_forward"])
check("kdacp.torch timeout", _common._timeout({}), d["timeout"])
check("kdacp.torch.kda deterministic", params["deterministic"].default, d["deterministic"])
doc = re.sub(r"\s+", " ", kdacp._kdacp.KdaLayer.forward.__doc__)
check("KdaLayer.forward algorithm", re.search(r"algorithm: str = '(\w+)'", doc).group(1), d["algorithm"])
check("KdaLayer.forward keep_forward", re.search(r"keep_forward: bool = (\w+)", doc).group(1),
      str(d["keep_forward"]))
check("KdaLayer.forward deterministic", re.search(r"deterministic: bool = (\w+)", doc).group(1),
      str(d["deterministic"]))
# The CLI's --deterministic is a flag: off unless given, i.e. the default.
for command in ("run", "kda"):
    if "--deterministic" not in help_text(command):
        failures.append(f"kdacp {command} --help has no --deterministic")
    elif d["deterministic"]:
        failures.append(f"kdacp {command} --deterministic is a flag (off by default), but "
                        "kdacp/defaults.hpp turns the mode on")

if failures:
    print("defaults disagree:\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"defaults agree: algorithm {d['algorithm']}, keep_forward {d['keep_forward']}, "
      f"deterministic {d['deterministic']}, timeout {d['timeout']} s")
