#!/usr/bin/env bash
# Installs every Debian package kdacp needs to build, test and benchmark.
# Idempotent: packages already present are skipped, and apt is only asked
# when something is missing. Nothing is downloaded outside apt.
set -euo pipefail

packages=(
  build-essential cmake ninja-build g++ clang-14 libclang-rt-14-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev
  libhwy-dev libopenblas-dev
  libopenmpi-dev openmpi-bin libsimgrid-dev
  gnuplot-nox python3 python3-numpy
  python3-dev python3-pybind11 pybind11-dev python3-pytest python3-torch
  python3-venv python3-pip python3-setuptools python3-wheel
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
echo "install-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
