"""`pip install .` and `pip wheel .` (pyproject.toml, scikit-build-core): the
package installs from the source tree with pip and nothing downloaded, and its
wheel installs and runs where no compiler, build tree or non-system shared
library of the build machine is at hand.

    pip_install.py PYTHON SOURCE_DIR BUILD_DIR

PYTHON has torch, scikit-build-core and pybind11 (build/venv, at the versions
scripts/python-constraints.txt pins). Two fresh venvs of PYTHON's base
interpreter in a temporary directory see PYTHON's packages through a .pth file
(a venv of a venv sees only the base's), after their own. BUILD_DIR/pip-wheel is scikit-build-core's
build tree for both builds (its build-dir setting), kept between runs, so that
only what changed is compiled again.

1. `pip install --no-build-isolation --no-index .` into the first venv;
2. `pip wheel --no-build-isolation --no-index .`, then the wheel alone into
   the second venv, with PATH holding nothing but that venv's bin/ (no compiler,
   no cmake) from then on.

The wheel's shared objects need nothing beyond the C and C++ runtimes and the
libraries the wheel itself holds (readelf: NEEDED, RUNPATH $ORIGIN, no libtorch
or libc10 entry and no at::/c10::/torch:: symbol). In each venv, from the temporary directory, with no PYTHONPATH:
kdacp and every library it loads that is not a system one come from the venv;
the installed metadata's version is kdacp.__version__ and CMake's project
version; kt.kda forward and backward on a tiny float64 problem (two packed
sequences, GVA, h0) and kt.chunk_kda's forward equal an inline recurrence and
its autograd gradients within 1e-10. The temporary directory is removed at the end.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

CHECK = r'''
import importlib.metadata, pathlib, sys
import torch

def mapped_libraries():
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if ".so" in line.split()[-1]}

before = mapped_libraries()
import kdacp, kdacp.torch as kt

venv, version = pathlib.Path(sys.argv[1]).resolve(), sys.argv[2]
assert pathlib.Path(kdacp.__file__).resolve().is_relative_to(venv), (kdacp.__file__, venv)
meta = importlib.metadata.version("kdacp")
assert meta == kdacp.__version__ == version, (meta, kdacp.__version__, version)
package = pathlib.Path(kdacp.__file__).resolve().parent
mapped = mapped_libraries()
ours = [p for p in mapped if pathlib.Path(p).resolve().parent == package]
assert any("_kdacp" in p for p in ours), ("the module is not mapped from the venv", sorted(mapped))
# What kdacp's import brought in comes from the package. (A library of the
# same soname that torch had loaded already is the one the loader reuses.)
for name in ("libkdacp", "libhwy", "libfmt"):
    outside = [p for p in mapped - before if pathlib.Path(p).name.startswith(name) and p not in ours]
    assert not outside, f"{name} loaded from outside the installed package: {outside}"

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

def relative_error(got, want):
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-300)

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
with torch.no_grad():
    co, cht = kt.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                           cu_seqlens=torch.tensor(cu))
for name, got, want in [("o", o, ro), ("ht", ht, rht), ("chunk_kda o", co, ro),
                        ("chunk_kda ht", cht, rht)] + list(
        zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads, rgrads)):
    err = relative_error(got, want)
    assert torch.isfinite(got).all() and err <= 1e-10, f"{name}: relative error {err:.3e} > 1e-10"
print(f"kdacp {kdacp.__version__} from {package} under torch {torch.__version__}: kda forward "
      f"and backward, chunk_kda forward within 1e-10 of the recurrence; loaded from the package: "
      f"{sorted(pathlib.Path(p).name for p in ours)}")
'''

# The C and C++ runtimes every Linux system has; anything else a shared object
# of the wheel needs must be in the wheel.
SYSTEM = re.compile(r"(ld-linux.*|libc|libm|libmvec|libstdc\+\+|libgcc_s|libpthread|libdl|librt|libutil)\.so(\.\d+)*")
TORCH_LIB = re.compile(r"torch|c10", re.I)
# Itanium-mangled names in namespaces at::, c10:: and torch:: (e.g. _ZN3c106detail...).
TORCH_SYMBOL = re.compile(r"_ZN(?:K|NK)?(?:2at|3c10|5torch)\d")


def run(cmd, **kwargs):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        sys.exit(f"FAILED ({proc.returncode}): {' '.join(str(c) for c in cmd)}\n"
                 f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc.stdout


def check_wheel(wheel, unpacked):
    """The wheel's shared objects need only the system's runtimes and each other,
    and find each other through $ORIGIN, their only RUNPATH."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(unpacked)
    objects = sorted(unpacked / n for n in names if re.search(r"\.so(\.\d+)*$", n))
    if not any(p.name.startswith("_kdacp") for p in objects):
        sys.exit(f"FAILED: no _kdacp module in {wheel.name}: {names}")
    bundled = {p.name for p in objects}
    for so in objects:
        if so.parent != unpacked / "kdacp":
            sys.exit(f"FAILED: {so.relative_to(unpacked)} is not in kdacp/ of the wheel")
        dynamic = run(["readelf", "-d", "-W", so])
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
        paths = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library (?:runpath|rpath): \[([^\]]*)\]", dynamic)
        undefined = [line.split()[-1] for line in run(["nm", "-D", "--undefined-only", so]).splitlines() if line.strip()]
        if not any(n.startswith("libc.so") for n in needed) or not undefined:
            sys.exit(f"FAILED: readelf/nm read nothing useful from {so}: NEEDED {needed}")
        foreign = [n for n in needed if not SYSTEM.fullmatch(n) and n not in bundled]
        if foreign:
            sys.exit(f"FAILED: {so.name} needs {foreign}, neither a system runtime nor in the wheel")
        if any(n in bundled for n in needed) and paths != ["$ORIGIN"]:
            sys.exit(f"FAILED: {so.name} needs libraries of the wheel but its RUNPATH is {paths}, not $ORIGIN")
        if any(p != "$ORIGIN" for p in paths):
            sys.exit(f"FAILED: {so.name} has RUNPATH {paths}: only $ORIGIN may be there")
        bad = [n for n in needed if TORCH_LIB.search(n)] + [s for s in undefined if TORCH_SYMBOL.match(s)]
        if bad:
            sys.exit(f"FAILED: {so.name} depends on libtorch's C++ ABI: {bad[:10]}")
        print(f"{so.name}: NEEDED {', '.join(needed)}; RUNPATH {':'.join(paths) or '-'}; "
              f"{len(undefined)} undefined symbols, none of libtorch/libc10")
    return names


def make_venv(base, where, site, env):
    """A fresh venv of `base` that also sees the directories `site` (a .pth
    file, after its own site-packages), and its python."""
    run([base, "-m", "venv", where], env=env)
    python = where / "bin" / "python"
    platlib = run([python, "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"], env=env).strip()
    (pathlib.Path(platlib) / "kdacp_test_base.pth").write_text("".join(f"{p}\n" for p in site))
    return python


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    python, source, build = sys.argv[1], pathlib.Path(sys.argv[2]).resolve(), pathlib.Path(sys.argv[3]).resolve()
    cmake = (source / "CMakeLists.txt").read_text()
    version = re.search(r"project\(\s*kdacp\s+VERSION\s+(\S+)", cmake).group(1)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "LD_LIBRARY_PATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PYTHONDONTWRITEBYTECODE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    # PYTHON's base interpreter, and the directories of its sys.path beyond the
    # standard library (its site-packages and what .pth files there add).
    base, *site = run([python, "-c", "import os, sys, sysconfig; print(sys._base_executable); "
                       "std = sysconfig.get_path('stdlib'); print(*(p for p in sys.path "
                       "if p and os.path.isdir(p) and not p.startswith(std)), sep='\\n')"],
                      env=env).splitlines()
    missing = run([python, "-c", "import importlib.util as u; print(' '.join(m for m in "
                   "('torch', 'scikit_build_core', 'pybind11') if u.find_spec(m) is None))"], env=env).strip()
    if missing:
        sys.exit(f"FAILED: {python} lacks {missing}: build/venv has them (scripts/python-env.sh)")
    pip_args = ["--no-build-isolation", "--no-index", "--no-cache-dir",
                f"--config-settings=build-dir={build / 'pip-wheel'}"]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kdacp-pip-"))
    try:
        # 1. pip install . (builds, or brings up to date, BUILD_DIR/pip-wheel).
        venv = tmp / "install"
        start = time.monotonic()
        vpython = make_venv(base, venv, site, env)
        # --no-deps: torch and numpy are there already, seen through the .pth file,
        # but pip would also check torch's own requirements against the venv's setuptools.
        run([vpython, "-m", "pip", "install", "--no-deps", *pip_args, source], env=env, cwd=tmp)
        print(f"pip install .: {time.monotonic() - start:.1f} s")
        print(run([vpython, "-c", CHECK, venv, version], env=env, cwd=tmp), end="")

        # 2. pip wheel . (the same tree, up to date: configure and install only),
        # installed where PATH has no compiler.
        start = time.monotonic()
        dist = tmp / "dist"
        run([python, "-m", "pip", "wheel", "--no-deps", "-w", dist, *pip_args, source], env=env, cwd=tmp)
        wheel, = dist.glob("kdacp-*.whl")
        print(f"pip wheel .: {time.monotonic() - start:.1f} s, {wheel.name}, {wheel.stat().st_size} bytes")
        check_wheel(wheel, tmp / "unpacked")
        venv = tmp / "wheel"
        vpython = make_venv(base, venv, site, env)
        bare = dict(env, PATH=str(venv / "bin"))
        if shutil.which("c++", path=bare["PATH"]) or shutil.which("cmake", path=bare["PATH"]):
            sys.exit("FAILED: the wheel's venv has a compiler or cmake on its PATH")
        run([vpython, "-m", "pip", "install", "--no-index", "--no-deps", wheel], env=bare, cwd=tmp)
        print(run([vpython, "-c", CHECK, venv, version], env=bare, cwd=tmp), end="")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("pip install, pip wheel: OK")


if __name__ == "__main__":
    main()
