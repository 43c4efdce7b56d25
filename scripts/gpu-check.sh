#!/usr/bin/env bash
# The GPU check, for the day a machine with an NVIDIA GPU is lent (the
# workplace's `device` tool; docs/testing.md, "GPU check"). Within about
# 10 minutes it prints one line per figure:
#
#   1. the CUDA build: the same `--features cuda` build the test command's
#      CUDA check compiles (scripts/check-cuda.sh), here linked;
#   2. the native engine's reference test on CUDA;
#   3. decode tokens/s of one greedy stream, Turbine on the GPU (`turbine
#      run --device cuda`) against vLLM on the same GPU and model (vLLM's
#      CUDA build installed from PyPI into target/engines/vllm-gpu; the
#      model converted from the GGUF, scripts/gguf-to-hf.py), the same
#      client for both (scripts/decode-speed.py);
#   4. UCX bandwidth from GPU memory: `ucx_perftest` with CUDA memory,
#      beside Turbine's KV transfer (`turbine bench transfer`, host pools:
#      its pools on the GPU move through the same UCX gets).
#
# Without a GPU it says so and exits 0.
#
#   scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: skipped: no NVIDIA GPU here (nvidia-smi finds none)"
  exit 0
fi
gpu="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1)"
echo "gpu-check: $gpu"
figure() { printf 'gpu-check: %-34s %s\n' "$1" "$2"; }
deadline=$((SECONDS + 600))
left() { echo $((deadline - SECONDS)); }

# 1. The CUDA build: the toolkit and kernel cache of the CUDA check
#    (scripts/cuda-env.sh; nvcc from PyPI when the machine has none), for
#    this GPU's generation, then linked.
start=$SECONDS
CUDA_COMPUTE_CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d .)"
export CUDA_COMPUTE_CAP
source scripts/cuda-env.sh
cargo build --release --locked -p turbine-cli --features cuda,ucx 2>&1 | tail -n 3
cargo test --release --locked -p turbine-native --features cuda --test reference --no-run 2>&1 | tail -n 1
figure "CUDA build" "ok ($((SECONDS - start)) s)"

# 2. The reference test on CUDA.
start=$SECONDS
if timeout "$(left)" cargo test --release --locked -p turbine-native --features cuda --test reference cuda 2>&1 | tail -n 3; then
  figure "reference test on CUDA" "passed ($((SECONDS - start)) s)"
else
  figure "reference test on CUDA" "FAILED"
fi

# 3. Decode speed, Turbine against vLLM on the same GPU and model.
model="$(./target/release/turbine model pull smollm2-135m | sed -n 's/.* ready at //p')"
venv=target/engines/vllm-gpu
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check vllm gguf accelerate
fi
"$venv/bin/python" scripts/gguf-to-hf.py "$model" target/engines/smollm2-135m-hf
port_turbine=18080 port_vllm=18081
./target/release/turbine run --device cuda --http-port "$port_turbine" --grpc-port 0 >target/gpu-check-turbine.log 2>&1 &
turbine_pid=$!
HF_HUB_OFFLINE=1 "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model target/engines/smollm2-135m-hf \
  --served-model-name smollm2-135m --host 127.0.0.1 --port "$port_vllm" --gpu-memory-utilization 0.3 >target/gpu-check-vllm.log 2>&1 &
vllm_pid=$!
trap 'kill "$turbine_pid" "$vllm_pid" 2>/dev/null || true' EXIT
for url in "http://127.0.0.1:$port_turbine/health" "http://127.0.0.1:$port_vllm/health"; do
  until curl -sf "$url" >/dev/null; do
    if ((SECONDS > deadline)); then echo "gpu-check: $url did not answer in time" >&2; exit 1; fi
    sleep 1
  done
done
turbine_speed="$(python3 scripts/decode-speed.py "http://127.0.0.1:$port_turbine" smollm2-135m)"
vllm_speed="$(python3 scripts/decode-speed.py "http://127.0.0.1:$port_vllm" smollm2-135m)"
figure "decode tokens/s, Turbine (CUDA)" "$turbine_speed"
figure "decode tokens/s, vLLM (same GPU)" "$vllm_speed"
figure "decode, Turbine / vLLM" "$(python3 -c "print(f'{$turbine_speed / $vllm_speed:.2f}x')")"
kill "$turbine_pid" "$vllm_pid" 2>/dev/null || true

# 4. UCX from GPU memory.
if command -v ucx_perftest >/dev/null 2>&1 && ucx_info -d 2>/dev/null | grep -q cuda; then
  ucx_perftest -p 18090 -m cuda >/dev/null 2>&1 &
  server=$!
  sleep 1
  bandwidth="$(ucx_perftest 127.0.0.1 -p 18090 -m cuda -t ucp_get -s 1048576 -n 2000 2>/dev/null | awk '/Final:/ {print $(NF-2)}')"
  wait "$server" || true
  figure "ucx_perftest get, CUDA memory" "${bandwidth:-n/a} MB/s"
else
  figure "ucx_perftest get, CUDA memory" "skipped: this UCX has no CUDA transport (ucx_info -d)"
fi
./target/release/turbine bench transfer --transport ucx --batches 5 2>&1 | tail -n 4 | sed 's/^/gpu-check: turbine bench transfer: /'
