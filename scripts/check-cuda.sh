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

# The toolkit (nvcc from PyPI when the machine has none), the kernel cache
# and the GPU generation: scripts/cuda-env.sh, which scripts/gpu-check.sh
# sources too, so the GPU check builds what this checks.
source scripts/cuda-env.sh
# Only the native engine has code behind `cuda` (turbine-worker and
# turbine-cli only pass the feature on): its library and its tests (the
# reference test's CUDA cases) are checked, not the whole workspace again.
cargo check --locked -p turbine-native --features cuda --lib --tests
