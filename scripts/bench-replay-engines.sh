#!/usr/bin/env bash
# TTFT with kv routing against round-robin on a Mooncake trace replayed
# over real engines: two engine servers on the default model, each behind a
# Turbine worker (--engine external), a router and a gateway, all started
# afresh (empty caches) for each policy; `turbine bench replay --gateway`
# drives the trace. Results in target/bench-replay-engines[-vllm].
#
# ENGINE=llama-cpp (the default): llama.cpp's servers
# (scripts/install-llama-cpp.sh); they publish no KV events, so the kv
# router runs --kv-approximate. ENGINE=vllm: vLLM's CPU build
# (scripts/install-vllm.sh, the model converted by scripts/gguf-to-hf.py,
# both under target/engines as the test command leaves them), each
# publishing its KV events to its worker: the kv router is exact
# (docs/engines.md). vLLM caches blocks of 32 tokens: pass --block-size 32.
#
#   [ENGINE=vllm] scripts/bench-replay-engines.sh [FLAGS OF turbine bench replay ...]
#   e.g. scripts/bench-replay-engines.sh --trace ../shared/data/traces/mooncake_conversation_trace.jsonl \
#          --shrink 32 --limit 1000 --conversations-every 5 --speedup 0.6 --block-size 16
#   (one conversation in five of the first 1,000 requests: their reuse
#   minutes apart, at a load two engines on two cores keep up with)
set -euo pipefail
cd "$(dirname "$0")/.."

turbine="${TURBINE:-target/release/turbine}"
engine_kind="${ENGINE:-llama-cpp}"
server="${TURBINE_LLAMA_SERVER:-target/engines/llama-cpp/bin/llama-server}"
vllm_python="${TURBINE_VLLM_PYTHON:-target/engines/vllm/bin/python}"
vllm_model="${TURBINE_VLLM_MODEL:-target/engines/smollm2-135m-hf}"
slots="${SLOTS:-4}"
case "$engine_kind" in
  llama-cpp) out=target/bench-replay-engines ;;
  vllm) out=target/bench-replay-engines-vllm ;;
  *) echo "ENGINE is llama-cpp or vllm, not $engine_kind" >&2; exit 2 ;;
esac
mkdir -p "$out"
model="$("$turbine" model pull smollm2-135m | sed -n 's/.* ready at //p')"

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# Waits (up to SECONDS, default a minute) until URL answers 2xx.
wait_http() {
  local seconds="${2:-60}"
  for _ in $(seq 1 $((seconds * 10))); do
    if curl -sf -o /dev/null "$1"; then return 0; fi
    sleep 0.1
  done
  echo "$1 did not answer within $seconds s" >&2
  return 1
}
pids=()
stop() {
  # A vLLM server leads its own process group (setsid), with its engine
  # core in it: the group goes.
  for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
trap stop EXIT

for policy in kv round-robin; do
  redis_port=$(free_port)
  redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no >"$out/$policy-redis.log" 2>&1 &
  pids+=($!)
  redis="redis://127.0.0.1:$redis_port/"
  admins=()
  engines=()
  for engine in 0 1; do
    port=$(free_port)
    engines+=("$port")
    case "$engine_kind" in
      llama-cpp)
        "$server" --model "$model" --alias smollm2-135m --host 127.0.0.1 --port "$port" --metrics \
          --parallel "$slots" --ctx-size $((slots * 4096)) --threads 1 --no-webui >"$out/$policy-engine-$engine.log" 2>&1 &
        pids+=($!)
        ;;
      vllm)
        # Settings for two cores (shared/PLATFORM.md); its KV events go to
        # the port its worker binds (a concrete host: vLLM connects). Both
        # engines start at once (each takes 25-60 s).
        events_port=$(free_port)
        replay_port=$(free_port)
        eval "events_$engine=tcp://127.0.0.1:$events_port"
        eval "replay_$engine=tcp://127.0.0.1:$replay_port"
        VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \
          VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 setsid "$vllm_python" -m vllm.entrypoints.openai.api_server \
          --host 127.0.0.1 --port "$port" --model "$vllm_model" --served-model-name smollm2-135m \
          --dtype float32 --max-model-len 4096 --max-num-seqs "$slots" --enforce-eager --enable-prefix-caching \
          --block-size 32 --enable-prompt-tokens-details \
          --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:$events_port\", \"replay_endpoint\": \"tcp://127.0.0.1:$replay_port\", \"topic\": \"kv-events\"}" \
          >"$out/$policy-engine-$engine.log" 2>&1 &
        pids+=($!)
        ;;
    esac
  done
  for engine in 0 1; do
    port="${engines[$engine]}"
    admin=$(free_port)
    admins+=("$admin")
    upstream=(--upstream-kind "$engine_kind" --upstream "http://127.0.0.1:$port")
    if [ "$engine_kind" = vllm ]; then
      events="events_$engine" replay="replay_$engine"
      upstream+=(--model "$vllm_model" --served-model-name smollm2-135m --upstream-kv-events "${!events}" --upstream-kv-replay "${!replay}")
    fi
    # The worker binds the events port before the engine's first step;
    # it waits for the engine's server itself (--upstream-wait-secs).
    "$turbine" worker --engine external "${upstream[@]}" --upstream-wait-secs 180 \
      --worker-id "$engine_kind-$engine" --redis "$redis" --grpc-addr "127.0.0.1:$(free_port)" --admin-addr "127.0.0.1:$admin" \
      >"$out/$policy-worker-$engine.log" 2>&1 &
    pids+=($!)
  done
  for port in "${engines[@]}"; do wait_http "http://127.0.0.1:$port/health" 180; done
  approximate=()
  if [ "$policy" = kv ] && [ "$engine_kind" = llama-cpp ]; then approximate=(--kv-approximate); fi
  router_port=$(free_port)
  "$turbine" router --policy "$policy" "${approximate[@]}" --redis "$redis" --grpc-addr "127.0.0.1:$router_port" \
    --admin-addr "127.0.0.1:$(free_port)" >"$out/$policy-router.log" 2>&1 &
  pids+=($!)
  http_port=$(free_port)
  "$turbine" gateway --router "http://127.0.0.1:$router_port" --http-addr "127.0.0.1:$http_port" \
    --grpc-addr "127.0.0.1:$(free_port)" --admin-addr "127.0.0.1:$(free_port)" >"$out/$policy-gateway.log" 2>&1 &
  pids+=($!)
  base="http://127.0.0.1:$http_port"
  for _ in $(seq 1 600); do
    if curl -sf "$base/v1/models" | grep -q smollm2-135m; then break; fi
    sleep 0.1
  done
  # Both workers ready (registered), and the path answers.
  for admin in "${admins[@]}"; do wait_http "http://127.0.0.1:$admin/readyz" 180; done
  curl -sf "$base/v1/completions" -H 'content-type: application/json' \
    -d '{"model": "smollm2-135m", "prompt": "warm up", "max_tokens": 1}' >/dev/null
  echo "== $policy" >&2
  "$turbine" bench replay --gateway "$base" --json "$out/$policy.json" "$@" | tee "$out/$policy.txt"
  stop
done
