"""README.md's Python block, run as a user would: two gloo ranks against one
process. The block must run, print its errors, and stay within float32
rounding; the default it states for kt.kda's algorithm must be the
signature's."""

import inspect
import os
import re
import subprocess
import sys

import kdacp.torch as kt

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def _readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_python_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", _readme(), re.S)
    assert len(blocks) == 1, "README.md should hold exactly one python block"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240, env=os.environ.copy())
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"max \|o - one process\| (\S+), max \|dq - one process\| (\S+)", out.stdout)
    assert m, out.stdout
    assert float(m.group(1)) <= 2e-5 and float(m.group(2)) <= 2e-5, out.stdout


def test_stated_algorithm_default_is_the_signatures():
    m = re.search(r'`kt\.kda` uses `algorithm="(\w+)"`', _readme())
    assert m, "README.md no longer states kt.kda's default algorithm as the test expects"
    assert inspect.signature(kt.kda).parameters["algorithm"].default == m.group(1)
