"""The package installs with `cmake --install <build> --prefix P` and imports
from P with nothing of the build tree on the path."""

import os
import pathlib
import subprocess
import sys
import tempfile

import kdacp._kdacp


def test_install_into_prefix_and_import():
    module = pathlib.Path(kdacp._kdacp.__file__).resolve()
    build_dir = module.parents[2]  # <build>/python/kdacp/_kdacp*.so
    assert (build_dir / "CMakeCache.txt").exists(), build_dir
    cache = (build_dir / "CMakeCache.txt").read_text()
    rel = next(line.split("=", 1)[1] for line in cache.splitlines()
               if line.startswith("KDACP_PYTHON_INSTALL_DIR:"))
    with tempfile.TemporaryDirectory() as prefix:
        subprocess.run(["cmake", "--install", str(build_dir), "--prefix", prefix],
                       check=True, capture_output=True, text=True)
        site = pathlib.Path(prefix) / rel
        assert (site / "kdacp" / "torch.py").exists()
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
        env["PYTHONPATH"] = str(site)
        code = ("import kdacp, kdacp.torch as kt, torch\n"
                "print(kdacp.__file__)\n"
                "s = torch.ones(2, 1, 1, 16, 16); m = torch.zeros(2, 1, 1, 16, 16)\n"
                "print(float(kt.merge_affine_summaries(s, m, 1).sum()))\n")
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=prefix, check=True,
                             capture_output=True, text=True).stdout.split()
        assert out[0].startswith(str(site)), out
        assert float(out[1]) == 256.0

