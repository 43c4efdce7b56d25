#!/usr/bin/env bash
# A Mooncake trace replayed through Turbine as separate processes (Redis,
# mocker workers, a kv-index, a router asking it, a gateway) while the
# kv-index is SIGKILLed and restarted, and later Redis is killed and
# restarted. Prints the replay's summary and its hit-rate timeline; the
# JSON report goes to $OUT. Needs release binaries (cargo build --release
# --bins) and redis-server.
#
#   scripts/kv-failover-replay.sh            # defaults below
#   KILL_KV_AT=10 KV_DOWN=5 scripts/kv-failover-replay.sh
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-target/release}
TRACE=${TRACE:-../shared/data/traces/mooncake_conversation_trace.jsonl}
WORKERS=${WORKERS:-8}
LIMIT=${LIMIT:-1000}
SPEEDUP=${SPEEDUP:-8}                 # arrivals
ENGINE_SPEEDUP=${ENGINE_SPEEDUP:-1}   # mocker
KILL_KV_AT=${KILL_KV_AT:-12}          # seconds into the replay
KV_DOWN=${KV_DOWN:-3}
KILL_REDIS_AT=${KILL_REDIS_AT:-25}
REDIS_DOWN=${REDIS_DOWN:-2}
OUT=${OUT:-/tmp/kv-failover-replay.json}
# WINDOW: seconds per line of the hit-rate timeline (default 2)

if (( KILL_REDIS_AT < KILL_KV_AT + KV_DOWN )); then
  echo "KILL_REDIS_AT must come after the kv-index is back (KILL_KV_AT + KV_DOWN)" >&2; exit 2
fi
dir=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_for() { # URL
  for _ in $(seq 1 600); do curl -fs "$1" > /dev/null 2>&1 && return 0; sleep 0.1; done
  echo "timed out waiting for $1" >&2; exit 1
}
start_redis() {
  redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" >> "$dir/redis.log" 2>&1 &
  redis_pid=$!; pids+=("$redis_pid")
  for _ in $(seq 1 100); do redis-cli -p "$redis_port" ping > /dev/null 2>&1 && return 0; sleep 0.05; done
  echo "redis did not start" >&2; exit 1
}
start_kv_index() {
  "$BIN/turbine-kv-index" --redis "$redis" --namespace failover --grpc-addr "127.0.0.1:$kv_port" --admin-addr "127.0.0.1:$kv_admin" \
    --snapshot-interval-secs 1 >> "$dir/kv-index.log" 2>&1 &
  kv_pid=$!; pids+=("$kv_pid")
  wait_for "http://127.0.0.1:$kv_admin/livez"
}
elapsed() { echo "$(( $(date +%s%N) / 1000000 - replay_start_ms ))"; }

redis_port=$(free_port); redis="redis://127.0.0.1:$redis_port/"
start_redis
for i in $(seq 0 $((WORKERS - 1))); do
  "$BIN/turbine-worker" --engine mock --speedup "$ENGINE_SPEEDUP" --block-size 64 --num-blocks 131072 --context-length 262144 \
    --redis "$redis" --namespace failover --worker-id "worker-$i" --grpc-addr 127.0.0.1:0 --admin-addr 127.0.0.1:0 \
    >> "$dir/worker-$i.log" 2>&1 &
  pids+=("$!")
done
kv_port=$(free_port); kv_admin=$(free_port)
start_kv_index
router_port=$(free_port)
"$BIN/turbine-router" --redis "$redis" --namespace failover --policy kv --kv-index "http://127.0.0.1:$kv_port" \
  --grpc-addr "127.0.0.1:$router_port" --admin-addr 127.0.0.1:0 >> "$dir/router.log" 2>&1 &
pids+=("$!")
http_port=$(free_port)
"$BIN/turbine-gateway" --router "127.0.0.1:$router_port" --http-addr "127.0.0.1:$http_port" --grpc-addr 127.0.0.1:0 >> "$dir/gateway.log" 2>&1 &
pids+=("$!")
wait_for "http://127.0.0.1:$http_port/v1/models"
for _ in $(seq 1 600); do
  [ "$(grep -c 'worker ready' "$dir"/worker-*.log | awk -F: '{s += $2} END {print s}')" -ge "$WORKERS" ] && break; sleep 0.1
done
sleep 1 # one router poll after the last registration

replay_start_ms=$(( $(date +%s%N) / 1000000 ))
"$BIN/turbine" bench replay --gateway "http://127.0.0.1:$http_port" --trace "$TRACE" --limit "$LIMIT" --speedup "$SPEEDUP" \
  --block-size 64 --window-secs "${WINDOW:-2}" --json "$OUT" &
replay=$!
sleep "$KILL_KV_AT"
kill -9 "$kv_pid"; echo "+$(elapsed) ms: kv-index SIGKILLed"
sleep "$KV_DOWN"
start_kv_index; echo "+$(elapsed) ms: kv-index restarted (listening)"
sleep "$(( KILL_REDIS_AT - KILL_KV_AT - KV_DOWN ))"
kill -9 "$redis_pid"; echo "+$(elapsed) ms: Redis SIGKILLed"
sleep "$REDIS_DOWN"
start_redis; echo "+$(elapsed) ms: Redis restarted (empty)"
wait "$replay"
echo "process logs: kept in $dir until exit; router warnings:"
grep -E "WARN|kv-index answers|Redis restarted" "$dir/router.log" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-220 | head -20
