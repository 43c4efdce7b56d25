# Sourced (not run) by scripts/check-cuda.sh and scripts/gpu-check.sh, from
# the repository root: puts an nvcc on PATH (NVIDIA's, from PyPI into the
# Turbine cache directory, when the machine has none), routes candle's
# kernel compiles through the kernel cache, and sets the GPU generation to
# compile for (CUDA_COMPUTE_CAP; Hopper unless set).
# shellcheck shell=bash
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
# The GPU generation to compile kernels for (unless set: Hopper).
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
