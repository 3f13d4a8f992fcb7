#!/usr/bin/env bash
# Creates, or reuses, the virtual environment the Python tests run in: build/venv, made
# from Debian's /usr/bin/python3 (the interpreter kdacp's module is built for), with
# torch 2.x and flash-linear-attention (and pyproject.toml's build requirements) from PyPI
# at the versions pinned in scripts/python-constraints.txt. `make test` runs it before configuring, and CMake then
# runs the python.* tests with build/venv/bin/python (python/CMakeLists.txt).
#
# Reuse: the venv holds a stamp, the hash of the constraints file, of the packages asked
# for and of the base interpreter's version, written only after a complete, checked
# install; a venv whose stamp differs or is missing (an interrupted run), or whose
# interpreter cannot import the packages, is removed and built again. A lock serialises
# concurrent runs (make -j). The first install downloads about 3 GB (torch's CUDA
# libraries; see the constraints file) and takes a few minutes; the venv is about 5.5 GB.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv=$root/build/venv
constraints=$root/scripts/python-constraints.txt
base=/usr/bin/python3
packages=(torch fla-core flash-linear-attention numpy pytest scikit-build-core pybind11)
stamp=$venv/kdacp-stamp

say() { echo "python-env: $*" >&2; }

want=$({ cat "$constraints"; echo "${packages[*]}"; "$base" -c 'import sys; print(sys.version)'; } |
       sha256sum | cut -d' ' -f1)

mkdir -p "$root/build"
exec 9>"$root/build/venv.lock"
flock 9

# Reuse check: the stamp, every pin installed (metadata only) and torch importing
# (fla.ops.kda's import, a few seconds of Triton set-up, is checked after an install).
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] &&
   "$venv/bin/python" "$root/scripts/python_env_check.py" "$constraints" >/dev/null 2>&1 &&
   "$venv/bin/python" -c 'import torch, numpy, pytest' >/dev/null 2>&1; then
  say "reusing $venv"
  exit 0
fi

if [ -e "$venv" ]; then
  if [ -f "$stamp" ]; then
    say "$venv does not match $constraints, or lacks a package it pins: rebuilding it"
  else
    say "$venv has no stamp (an interrupted install?): rebuilding it"
  fi
  rm -rf "$venv"
fi

start=$(date +%s)
say "creating $venv from $base"
"$base" -m venv "$venv"

# pip's defaults (its index, its cache), with bounded waits: --retries per connection,
# --timeout per socket read, and the whole install tried twice (what the first try
# downloaded is in pip's cache for the second).
pip_install() {
  "$venv/bin/python" -m pip install --require-virtualenv --no-input --progress-bar off \
    --retries 5 --timeout 60 -c "$constraints" "${packages[@]}"
}
say "installing ${packages[*]} (versions: $constraints)"
if ! pip_install; then
  say "pip failed; trying once more"
  if ! pip_install; then
    say "ERROR: pip could not install ${packages[*]} into $venv; it stays without a stamp" \
        "and is rebuilt on the next run"
    exit 1
  fi
fi

if ! "$venv/bin/python" "$root/scripts/python_env_check.py" "$constraints"; then
  say "ERROR: $venv is not what $constraints pins (above)"
  exit 1
fi
if ! "$venv/bin/python" -c 'import torch, numpy, pytest, fla.ops.kda; torch.ones(3) @ torch.ones(3)' \
     >/dev/null 2>&1; then
  say "ERROR: $venv/bin/python cannot import torch, numpy, pytest and fla.ops.kda:"
  "$venv/bin/python" -c 'import torch, numpy, pytest, fla.ops.kda' || true
  exit 1
fi
echo "$want" >"$stamp"
say "ready in $(( $(date +%s) - start )) s: $venv ($(du -sh "$venv" | cut -f1))"
