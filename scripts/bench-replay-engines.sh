#!/usr/bin/env bash
# TTFT with kv routing against round-robin on a Mooncake trace replayed
# over real engines: two llama.cpp servers (scripts/install-llama-cpp.sh)
# on the default model, each behind a Turbine worker (--engine external
# --upstream-kind llama-cpp), a router and a gateway, all started afresh
# (empty caches) for each policy; `turbine bench replay --gateway` drives
# the trace. llama.cpp publishes no KV events: the kv router runs
# --kv-approximate (docs/engines.md). Results in target/bench-replay-engines.
#
#   scripts/bench-replay-engines.sh [FLAGS OF turbine bench replay ...]
#   e.g. scripts/bench-replay-engines.sh --trace ../shared/data/traces/mooncake_conversation_trace.jsonl \
#          --shrink 32 --limit 1000 --conversations-every 5 --speedup 0.6 --block-size 16
#   (one conversation in five of the first 1,000 requests: their reuse
#   minutes apart, at a load two engines on two cores keep up with)
set -euo pipefail
cd "$(dirname "$0")/.."

turbine="${TURBINE:-target/release/turbine}"
server="${TURBINE_LLAMA_SERVER:-target/engines/llama-cpp/bin/llama-server}"
slots="${SLOTS:-4}"
out=target/bench-replay-engines
mkdir -p "$out"
model="$("$turbine" model pull smollm2-135m | sed -n 's/.* ready at //p')"

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# Waits (up to a minute) until URL answers 2xx.
wait_http() {
  for _ in $(seq 1 600); do
    if curl -sf -o /dev/null "$1"; then return 0; fi
    sleep 0.1
  done
  echo "$1 did not answer within a minute" >&2
  return 1
}
pids=()
stop() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
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
  for engine in 0 1; do
    port=$(free_port)
    admin=$(free_port)
    admins+=("$admin")
    "$server" --model "$model" --alias smollm2-135m --host 127.0.0.1 --port "$port" --metrics \
      --parallel "$slots" --ctx-size $((slots * 4096)) --threads 1 --no-webui >"$out/$policy-llama-$engine.log" 2>&1 &
    pids+=($!)
    wait_http "http://127.0.0.1:$port/health"
    "$turbine" worker --engine external --upstream-kind llama-cpp --upstream "http://127.0.0.1:$port" \
      --worker-id "llama-$engine" --redis "$redis" --grpc-addr "127.0.0.1:$(free_port)" --admin-addr "127.0.0.1:$admin" \
      >"$out/$policy-worker-$engine.log" 2>&1 &
    pids+=($!)
  done
  approximate=()
  if [ "$policy" = kv ]; then approximate=(--kv-approximate); fi
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
  for admin in "${admins[@]}"; do wait_http "http://127.0.0.1:$admin/readyz"; done
  curl -sf "$base/v1/completions" -H 'content-type: application/json' \
    -d '{"model": "smollm2-135m", "prompt": "warm up", "max_tokens": 1}' >/dev/null
  echo "== $policy" >&2
  "$turbine" bench replay --gateway "$base" --json "$out/$policy.json" "$@" | tee "$out/$policy.txt"
  stop
done
