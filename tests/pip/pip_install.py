"""`pip install .` into a fresh virtual environment (issue 20): the package
installs from the source tree with pip and nothing downloaded, imports from
outside the source tree, computes, and does not depend on libtorch's C++ ABI.

    pip_install.py PYTHON SOURCE_DIR BUILD_DIR

PYTHON (the interpreter the build tree's module is for, with torch) creates a
venv with --system-site-packages in a temporary directory; the venv's pip
installs SOURCE_DIR with --no-build-isolation --no-index, reusing BUILD_DIR
through KDACP_CMAKE_BUILD_DIR (so nothing up to date is rebuilt). Then, from
the temporary directory and with no PYTHONPATH:
- kdacp and the libkdacp it loads come from the venv, and the installed
  metadata's version is kdacp.__version__ and CMake's project version;
- kt.kda forward and backward on a tiny float64 problem (two packed
  sequences, GVA, h0) equal an inline recurrence and its autograd gradients
  within 1e-10;
- the installed module and the libraries beside it have no libtorch/libc10
  among their NEEDED entries and no libtorch (at::, c10::, torch::) symbol
  among their undefined ones.
The temporary directory is removed at the end.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

CHECK = r'''
import importlib.metadata, pathlib, sys
import torch
import kdacp, kdacp.torch as kt

venv, version = pathlib.Path(sys.argv[1]).resolve(), sys.argv[2]
assert pathlib.Path(kdacp.__file__).resolve().is_relative_to(venv), (kdacp.__file__, venv)
meta = importlib.metadata.version("kdacp")
assert meta == kdacp.__version__ == version, (meta, kdacp.__version__, version)
with open("/proc/self/maps") as f:
    loaded = {line.split()[-1] for line in f if "libkdacp" in line}
outside = [p for p in loaded if not pathlib.Path(p).resolve().is_relative_to(venv)]
assert not outside, f"libkdacp loaded from outside the venv: {outside}"

def reference(q, k, v, g, beta, scale, h0, cu):
    # S_t = (I - b k k^T) Diag(exp g) S_{t-1} + b k v^T, o_t = scale S_t^T q_t;
    # value head i reads query/key head i // (HV / H).
    outs, finals = [], []
    for n in range(len(cu) - 1):
        s = h0[n]
        for t in range(cu[n], cu[n + 1]):
            kt_, qt = k[0, t].repeat_interleave(HV // H, 0), q[0, t].repeat_interleave(HV // H, 0)
            s = s * g[0, t].exp()[:, :, None]
            s = s + beta[0, t][:, None, None] * kt_[:, :, None] * (v[0, t] - (kt_[:, :, None] * s).sum(1))[:, None, :]
            outs.append(scale * (s * qt[:, :, None]).sum(1))
        finals.append(s)
    return torch.stack(outs)[None], torch.stack(finals)

gen = torch.Generator().manual_seed(7)
T, H, HV, K, V, cu = 12, 2, 4, 8, 4, [0, 5, 12]
d = dict(dtype=torch.float64, generator=gen)
q = torch.randn(1, T, H, K, **d)
k = torch.nn.functional.normalize(torch.randn(1, T, H, K, **d), dim=-1)
v = torch.randn(1, T, HV, V, **d)
g = -0.5 * torch.rand(1, T, HV, K, **d)
beta = torch.rand(1, T, HV, **d)
h0 = 0.3 * torch.randn(2, HV, K, V, **d)
inputs = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
do, dht = torch.randn(1, T, HV, V, **d), torch.randn(2, HV, K, V, **d)

o, ht = kt.kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
               cu_seqlens=torch.tensor(cu))
grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), inputs)
ro, rht = reference(q, k, v, g, beta, K ** -0.5, h0, cu)
rgrads = torch.autograd.grad((ro * do).sum() + (rht * dht).sum(), inputs)
for name, got, want in [("o", o, ro), ("ht", ht, rht)] + list(
        zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads, rgrads)):
    err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-300)
    assert torch.isfinite(got).all() and err <= 1e-10, f"{name}: relative error {err:.3e} > 1e-10"
print(f"kdacp {kdacp.__version__} from {pathlib.Path(kdacp.__file__).parent}: kda forward and "
      f"backward within 1e-10 of the recurrence; libkdacp {sorted(loaded) or 'linked in'}")
'''

TORCH_LIB = re.compile(r"torch|c10", re.I)
# Itanium-mangled names in namespaces at::, c10:: and torch:: (e.g. _ZN3c106detail...).
TORCH_SYMBOL = re.compile(r"_ZN(?:K|NK)?(?:2at|3c10|5torch)\d")


def run(cmd, **kwargs):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        sys.exit(f"FAILED ({proc.returncode}): {' '.join(str(c) for c in cmd)}\n"
                 f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc.stdout


def check_abi(package_dir):
    """No libtorch/libc10 NEEDED entry or symbol in the installed shared objects."""
    objects = sorted(p for p in package_dir.iterdir() if ".so" in p.name)
    if not any(p.name.startswith("_kdacp") for p in objects):
        sys.exit(f"FAILED: no _kdacp module in {package_dir}: {[p.name for p in objects]}")
    for so in objects:
        dynamic = run(["readelf", "-d", "-W", so])
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
        undefined = [line.split()[-1] for line in run(["nm", "-D", "--undefined-only", so]).splitlines() if line.strip()]
        bad = [n for n in needed if TORCH_LIB.search(n)]
        bad += [s for s in undefined if TORCH_SYMBOL.match(s)]
        if bad:
            sys.exit(f"FAILED: {so.name} depends on libtorch's C++ ABI: {bad[:10]}")
        # The checks saw real data: each of these objects needs libc and calls
        # into it (or, the module, into Python).
        if not any(n.startswith("libc.so") for n in needed) or not undefined:
            sys.exit(f"FAILED: readelf/nm read nothing useful from {so}: NEEDED {needed}")
        print(f"{so.name}: NEEDED {', '.join(needed)}; {len(undefined)} undefined symbols, "
              f"none of libtorch/libc10")


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    python, source, build = sys.argv[1], pathlib.Path(sys.argv[2]).resolve(), pathlib.Path(sys.argv[3]).resolve()
    cmake = (source / "CMakeLists.txt").read_text()
    version = re.search(r"project\(\s*kdacp\s+VERSION\s+(\S+)", cmake).group(1)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "LD_LIBRARY_PATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PYTHONDONTWRITEBYTECODE="1")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kdacp-pip-"))
    try:
        start = time.monotonic()
        venv = tmp / "venv"
        run([python, "-m", "venv", "--system-site-packages", venv], env=env, cwd=tmp)
        made = time.monotonic()
        run([venv / "bin" / "pip", "install", "--no-build-isolation", "--no-index", "--no-cache-dir",
             "--disable-pip-version-check", source],
            env=dict(env, KDACP_CMAKE_BUILD_DIR=str(build)), cwd=tmp)
        installed = time.monotonic()
        print(f"venv {made - start:.1f} s, pip install {installed - made:.1f} s")
        out = run([venv / "bin" / "python", "-c", CHECK, venv, version], env=env, cwd=tmp)
        print(out, end="")
        site = run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"],
                   env=env, cwd=tmp).strip()
        check_abi(pathlib.Path(site) / "kdacp")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("pip install: OK")


if __name__ == "__main__":
    main()
