"""examples/train_fla_kda.py, briefly, so it cannot rot: fla's
KDAForCausalLM trained through kdacp.torch.use_with_fla at CP 1 and 2 over
gloo gives the same loss curve (float64), and its bad flags are named.
Skipped where flash-linear-attention is not importable."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("fla") is None:
    pytest.skip("flash-linear-attention is not importable", allow_module_level=True)

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_fla_kda.py")


def test_the_example_trains_alike_at_cp_1_and_2(tmp_path):
    """examples/train_fla_kda.py, briefly (float64: the curves agree to 1e-9)."""
    out = tmp_path / "curves.json"
    proc = subprocess.run([sys.executable, EXAMPLE, "--worlds", "1,2", "--steps", "4",
                           "--seq-len", "64", "--max-doc", "24", "--dtype", "float64",
                           "--json-out", str(out)], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "max rel diff" in proc.stdout and "within the tolerance 1e-09" in proc.stdout
    with open(out) as f:
        got = json.load(f)
    one, two = got["worlds"]["1"], got["worlds"]["2"]
    assert len(one) == len(two) == 4 and got["max_rel_diff"] <= 1e-9
    assert one[-1] < one[0] - 0.2, one


def test_the_examples_bad_flags_are_named():
    proc = subprocess.run([sys.executable, EXAMPLE, "--worlds", "1,x"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--worlds '1,x'" in proc.stderr
    proc = subprocess.run([sys.executable, EXAMPLE, "--worlds", "4", "--layout", "zigzag",
                           "--seq-len", "7"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "at least one token per rank" in proc.stderr
