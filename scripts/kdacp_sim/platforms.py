"""The simulated platforms: platforms/<name>.json holds a platform's cost
parameters (the model's --calibration) and, in its "simulation" object, the
SimGrid file (platforms/<name>.xml, or the .so CMake builds from
platforms/<name>.cpp), its hosts, ranks per host and host names."""
import json
import math
from pathlib import Path

from .common import ROOT, UsageError

SIMULATION_KEYS = ("file", "hosts", "ranks_per_host", "host_prefix")


def available():
    """The platforms this checkout describes: platforms/*.json with a
    "simulation" object."""
    names = []
    for cost in sorted((ROOT / "platforms").glob("*.json")):
        try:
            sim = json.loads(cost.read_text()).get("simulation")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(sim, dict):
            names.append(cost.stem)
    return names


def facts(name, platform_dir):
    """A platform's files and its hosts, for a name of available()
    (UsageError naming --platform-dir where its .so is not built)."""
    cost = ROOT / "platforms" / f"{name}.json"
    sim = json.loads(cost.read_text())["simulation"]
    if not all(k in sim for k in SIMULATION_KEYS):
        raise UsageError(f"platforms/{name}.json: expected a \"simulation\" object with {', '.join(SIMULATION_KEYS)}")
    path = ROOT / "platforms" / sim["file"]
    if sim["file"].endswith(".so"):
        path = Path(platform_dir) / sim["file"]
    if not path.is_file():
        raise UsageError(f"--platform-dir {platform_dir}: no {sim['file']} for platform '{name}' (the .so "
                         "platforms are built with kdacp-smpi)")
    return {"name": name, "xml": path, "cost": cost, "prefix": sim["host_prefix"], "hosts": int(sim["hosts"]),
            "per_host": int(sim["ranks_per_host"])}


def capacity(f):
    """The most ranks the platform holds."""
    return f["hosts"] * f["per_host"]


def hostfile(f, ranks, folder):
    """SMPI's hostfile for P = ranks on platform facts `f`: the hosts in
    order, each with its ranks."""
    per = f["per_host"]
    nodes = math.ceil(ranks / per)
    if nodes > f["hosts"]:
        raise ValueError(f"P = {ranks} needs {nodes} hosts, platform {f['name']} has {f['hosts']}")
    path = Path(folder) / f"hosts-{f['name']}-{ranks}"
    lines = [f"{f['prefix']}{i}:{min(per, ranks - i * per)}" for i in range(nodes)]
    path.write_text("\n".join(lines) + "\n")
    return path
