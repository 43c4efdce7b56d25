#!/usr/bin/env bash
# Checks that the `cuda` feature (the native engine on candle's CUDA backend)
# compiles, on any machine: a GPU and a CUDA installation are not needed.
#
# candle compiles its CUDA kernels to PTX with nvcc at build time; without a
# CUDA toolkit on PATH this fetches NVIDIA's nvcc (CUDA 13.0) from PyPI into
# the Turbine cache directory once. Linking a CUDA binary needs the CUDA
# libraries, so this type-checks (`cargo check`) rather than links; on a GPU
# machine build and test with:
#   cargo build --release -p turbine-cli --features cuda
#   cargo test -p turbine-native --features cuda --test reference cuda
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvcc >/dev/null 2>&1; then
  toolkit="${TURBINE_CUDA_TOOLKIT:-${TURBINE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/turbine}/cuda-13.0}"
  if ! "$toolkit/nvidia/cu13/bin/nvcc" --version >/dev/null 2>&1; then
    echo "fetching nvcc into $toolkit"
    rm -rf "$toolkit"
    python3 -m pip install --quiet --disable-pip-version-check --target "$toolkit" -r scripts/requirements-cuda.txt
  fi
  export PATH="$toolkit/nvidia/cu13/bin:$PATH" CUDA_HOME="$toolkit/nvidia/cu13"
fi
# candle's kernels compiled once per machine (scripts/nvcc-cache.py: the
# same nvcc, arguments and kernel sources give the same output); a fresh
# target directory reuses them. TURBINE_NVCC_CACHE=off compiles them anew.
nvcc_cache="${TURBINE_NVCC_CACHE:-${TURBINE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/turbine}/nvcc-objects}"
if [ "$nvcc_cache" != off ]; then
  real_nvcc="$(command -v nvcc)"
  toolkit_root="$(dirname "$(dirname "$(readlink -f "$real_nvcc")")")"
  # candle's build finds the toolkit's headers and libraries beside nvcc.
  shim="${CARGO_TARGET_DIR:-target}/nvcc-shim"
  case "$shim" in /*) ;; *) shim="$(pwd)/$shim" ;; esac
  rm -rf "$shim"
  mkdir -p "$shim/bin"
  for entry in "$toolkit_root"/*; do
    [ "$(basename "$entry")" = bin ] || ln -s "$entry" "$shim/"
  done
  printf '#!/bin/sh\nexec python3 %q "$@"\n' "$(pwd)/scripts/nvcc-cache.py" >"$shim/bin/nvcc"
  chmod +x "$shim/bin/nvcc"
  export TURBINE_NVCC="$real_nvcc" TURBINE_NVCC_CACHE="$nvcc_cache" NVCC="$shim/bin/nvcc" PATH="$shim/bin:$PATH"
fi
# The GPU generation to compile kernels for (no GPU here to ask): Hopper.
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
# Only the native engine has code behind `cuda` (turbine-worker and
# turbine-cli only pass the feature on): its library and its tests (the
# reference test's CUDA cases) are checked, not the whole workspace again.
cargo check --locked -p turbine-native --features cuda --lib --tests
