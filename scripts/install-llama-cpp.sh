#!/usr/bin/env bash
# Builds llama.cpp's own server (llama-server), for the tests that run
# Turbine's workers in front of an external engine without KV events
# (docs/engines.md). The sources are the llama.cpp that PyPI's
# llama-cpp-python source package carries (vendor/llama.cpp). Idempotent:
# a finished build for this machine's CPU is left as it is.
#
#   scripts/install-llama-cpp.sh [DIR]      default DIR: target/engines/llama-cpp
#
# Built for the CPU it runs on without -march=native: AMX off (the
# hypervisor faults on it), AVX-512 only where /proc/cpuinfo lists it
# (shared/PLATFORM.md). ggml (the tensor kernels) at -O1: as fast as -O3
# here (the kernels are intrinsics) in half the CPU. The rest (the model
# graph, the server, its JSON, HTTP and chat templates; 90% of the build)
# at -O0: its compile time is mostly parsing headers, and serving speed is
# the same (decode 83-85 tok/s, prompt 215 tok/s at -O0 and -O1 on the
# default model); the build is 4.4 core-minutes (5.2 with all at -O1).
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.3.36
dir="${1:-target/engines/llama-cpp}"
avx512=OFF
if grep -qw avx512f /proc/cpuinfo; then avx512=ON; fi
stamp="$dir/.installed-$version-avx512-$avx512-ggml-O1"
if [ -e "$stamp" ] && "$dir/bin/llama-server" --version >/dev/null 2>&1; then
  exit 0
fi
rm -rf "$dir"
work="$dir/build"
mkdir -p "$work" "$dir/bin"
python3 -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --no-cache-dir cmake
"${pip[@]}" download --no-cache-dir --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$work"
tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
cmake="$work/venv/bin/cmake"
# ggml's own project() takes -O1 after the -O0 that everything else takes
# (CMake includes the file right after that call; the last -O wins).
echo 'add_compile_options(-O1)' >"$work/ggml-O1.cmake"
"$cmake" -S "$work/llama_cpp_python-$version/vendor/llama.cpp" -B "$work/out" \
  -DCMAKE_BUILD_TYPE=Release "-DCMAKE_C_FLAGS_RELEASE=-O0 -DNDEBUG" "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG" \
  "-DCMAKE_PROJECT_ggml_INCLUDE=$(realpath "$work")/ggml-O1.cmake" \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_OPENMP=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512="$avx512" \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF >"$work/configure.log" 2>&1 || { tail -40 "$work/configure.log" >&2; exit 1; }
# The compiler's warnings stay in the log; its last lines are shown when it fails.
"$cmake" --build "$work/out" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; exit 1; }
cp "$work/out/bin/llama-server" "$dir/bin/llama-server"
"$dir/bin/llama-server" --version 2>&1 | head -1 >&2
rm -rf "$work"
touch "$stamp"
