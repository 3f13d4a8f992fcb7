"""The setuptools side of `pip install --no-build-isolation .` (pyproject.toml).

The pure-Python files come from python/kdacp/; the extension kdacp._kdacp is
built by the project's CMake (target kdacp_python, python/CMakeLists.txt) for
the interpreter that runs this script, and copied beside them.

Environment:
  KDACP_CMAKE_BUILD_DIR  an existing, configured CMake build tree of this source
                         tree to build kdacp_python in (e.g. build/release):
                         nothing is rebuilt that is up to date there, and
                         setuptools' own staging goes into <tree>/setuptools.
                         Its Python must have this interpreter's extension
                         suffix (checked). Without it: a Release tree in
                         setuptools' build_temp (build/temp.*/cmake).
  CMAKE_BUILD_PARALLEL_LEVEL, CMAKE_GENERATOR  as for cmake itself.

Libraries of the build tree that the module needs at run time (libkdacp.so.0)
are copied beside it; the module finds them
through its RUNPATH's $ORIGIN. System libraries (libhwy, libfmt, libstdc++)
stay system libraries: the wheel is for the machine it was built on.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

SOURCE = pathlib.Path(__file__).resolve().parent
BUILD_DIR_VAR = "KDACP_CMAKE_BUILD_DIR"


def cmake_version():
    """The one version of the project: CMakeLists.txt's project(kdacp VERSION x.y.z)."""
    text = (SOURCE / "CMakeLists.txt").read_text()
    m = re.search(r"project\(\s*kdacp\s+VERSION\s+([0-9]+(?:\.[0-9]+)*)", text)
    if not m:
        sys.exit("setup.py: no `project(kdacp VERSION x.y.z ...)` in CMakeLists.txt")
    return m.group(1)


def run(cmd, **kwargs):
    print("setup.py:", " ".join(str(c) for c in cmd), flush=True)
    try:
        subprocess.run([str(c) for c in cmd], check=True, **kwargs)
    except FileNotFoundError:
        sys.exit(f"setup.py: `{cmd[0]}` not found; building kdacp needs it (scripts/install-deps.sh)")
    except subprocess.CalledProcessError as e:
        sys.exit(f"setup.py: `{' '.join(str(c) for c in cmd)}` failed with exit status {e.returncode}")


def cache_value(build_dir, name):
    """A variable of build_dir/CMakeCache.txt, or None."""
    for line in (build_dir / "CMakeCache.txt").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.split(":", 1)[0] == name:
            return value
    return None


def dynamic_section(path):
    """(NEEDED names, RUNPATH/RPATH entries) of an ELF file, by readelf."""
    try:
        out = subprocess.run(["readelf", "-d", "-W", str(path)], check=True,
                             capture_output=True, text=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        sys.exit(f"setup.py: cannot read the dynamic section of {path} with readelf: {e}")
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    paths = []
    for entry in re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library (?:runpath|rpath): \[([^\]]*)\]", out):
        paths += entry.split(":")
    return needed, paths


def resolved_libraries(path):
    """{soname: resolved path} of every shared library `path` loads (ldd)."""
    try:
        out = subprocess.run(["ldd", str(path)], check=True, capture_output=True, text=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        sys.exit(f"setup.py: `ldd {path}` failed: {e}")
    libs = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) => (.*?) \(0x", line)
        if m:
            if m.group(2) == "not found":
                sys.exit(f"setup.py: {path} needs {m.group(1)}, which the loader does not find")
            libs[m.group(1)] = pathlib.Path(m.group(2))
    return libs


def reused_tree():
    """The validated build tree of KDACP_CMAKE_BUILD_DIR, or None."""
    value = os.environ.get(BUILD_DIR_VAR)
    if not value:
        return None
    build_dir = pathlib.Path(value).resolve()
    if not (build_dir / "CMakeCache.txt").is_file():
        sys.exit(f"setup.py: {BUILD_DIR_VAR}={build_dir} is not a configured CMake build tree "
                 f"(no CMakeCache.txt); configure it first (cmake --preset release) or unset it")
    home = cache_value(build_dir, "CMAKE_HOME_DIRECTORY")
    if home is None or pathlib.Path(home).resolve() != SOURCE:
        sys.exit(f"setup.py: {BUILD_DIR_VAR}={build_dir} was configured from {home}, "
                 f"not from this source tree {SOURCE}")
    if cache_value(build_dir, "KDACP_WITH_PYTHON") in ("OFF", "0", "FALSE", "NO"):
        sys.exit(f"setup.py: {BUILD_DIR_VAR}={build_dir} has KDACP_WITH_PYTHON=OFF, "
                 f"so it has no kdacp_python target")
    return build_dir


REUSED_TREE = reused_tree()


class CMakeBuildExt(build_ext):
    """Builds kdacp._kdacp with CMake instead of compiling `sources`."""

    def build_extension(self, ext):
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        if REUSED_TREE is not None:
            build_dir = REUSED_TREE
        else:
            build_dir = pathlib.Path(self.build_temp).resolve() / "cmake"
            self.configure(build_dir)
        cmd = ["cmake", "--build", build_dir, "--target", "kdacp_python"]
        if self.parallel:
            cmd += ["--parallel", self.parallel]
        run(cmd)

        module = build_dir / "python" / "kdacp" / f"_kdacp{suffix}"
        if not module.is_file():
            found = sorted(p.name for p in (build_dir / "python" / "kdacp").glob("_kdacp*"))
            sys.exit(f"setup.py: {module} was not built (found {found or 'nothing'}): the build tree's "
                     f"Python (Python3_EXECUTABLE={cache_value(build_dir, 'Python3_EXECUTABLE')}) is not "
                     f"ABI-compatible with {sys.executable} (extension suffix {suffix}); reconfigure it "
                     f"with -DPython3_EXECUTABLE={sys.executable} or unset {BUILD_DIR_VAR}")
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(module, target)
        shutil.copymode(module, target)

        # The build tree's own shared libraries the module loads go beside it.
        copied = []
        for soname, path in resolved_libraries(module).items():
            if build_dir in path.resolve().parents:
                shutil.copyfile(path, target.parent / soname)
                copied.append(soname)
        if copied:
            for path in [target] + [target.parent / name for name in copied]:
                needed, runpath = dynamic_section(path)
                if set(needed) & set(copied) and "$ORIGIN" not in runpath:
                    sys.exit(f"setup.py: {path.name} needs {sorted(set(needed) & set(copied))} but its "
                             f"RUNPATH {runpath} lacks $ORIGIN: the installed module would load them "
                             f"from the build tree {build_dir}")

    def configure(self, build_dir):
        cmd = ["cmake", "-S", SOURCE, "-B", build_dir,
               "-DCMAKE_BUILD_TYPE=Release",
               f"-DPython3_EXECUTABLE={sys.executable}",
               "-DKDACP_WITH_PYTHON=ON",
               # Only what the package needs: no tests, benchmarks or MPI
               # backend; libkdacp shared as in every tree of the project (it
               # goes beside the module); a newer compiler's new warning is no
               # build error.
               "-DKDACP_BUILD_TESTS=OFF", "-DKDACP_BUILD_BENCH=OFF", "-DKDACP_WITH_MPI=OFF",
               "-DBUILD_SHARED_LIBS=ON", "-DKDACP_WERROR=OFF"]
        if not (build_dir / "CMakeCache.txt").exists() and "CMAKE_GENERATOR" not in os.environ \
                and shutil.which("ninja"):
            cmd += ["-G", "Ninja"]
        run(cmd)


class CleanBuildPy(build_py):
    """Starts the package's staging directory afresh, so that a file removed
    from python/kdacp/ (or a module of an older build) never reaches the wheel."""

    def run(self):
        shutil.rmtree(pathlib.Path(self.build_lib) / "kdacp", ignore_errors=True)
        super().run()


def staging_options():
    """setuptools' own staging (build/lib..., bdist..., egg-info): in the reused
    tree, or build/ of the source tree; never python/kdacp.egg-info."""
    base = REUSED_TREE / "setuptools" if REUSED_TREE is not None else SOURCE / "build"
    base.mkdir(parents=True, exist_ok=True)
    return {"build": {"build_base": str(base)}, "egg_info": {"egg_base": str(base)}}


setup(
    version=cmake_version(),
    package_dir={"": "python"},
    packages=["kdacp"],
    ext_modules=[Extension("kdacp._kdacp", sources=[])],
    cmdclass={"build_ext": CMakeBuildExt, "build_py": CleanBuildPy},
    options=staging_options(),
)
