#!/usr/bin/env bash
# Installs kiln's build dependencies from Debian's packages (only those missing) and builds kiln
# into build/ (the CUDA backend too when nvcc is found, e.g. /usr/local/cuda/bin/nvcc).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake ninja-build g++ libboost1.81-dev libboost-program-options1.81-dev libtomlplusplus-dev doctest-dev
          nlohmann-json3-dev libxxhash-dev libpcre2-dev libutf8proc-dev libopenmpi-dev openmpi-bin)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "kiln setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_UNITY_BUILD=ON "$@"
cmake --build build -j "$jobs"
