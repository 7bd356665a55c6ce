#!/usr/bin/env bash
# What one decision costs the client: instructions of the `tollgate load` process per decision
# on the Redis path (cachegrind, no cache simulation: deterministic, unlike wall time on a
# shared machine). Each row is the difference of a run of BIG and one of SMALL requests,
# divided by BIG - SMALL, so start-up, connects and script loading cancel out. One runtime
# thread, 16 tasks, 100,000 keys, the token bucket; the multiplexed connection and the default
# pool of 4, ROUNDS rounds each, interleaved. Redis runs natively beside it.
#
# Usage: benches/scripts/client-cost.sh [rounds]   (needs valgrind, redis-server, python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
source benches/scripts/lib.sh
needs valgrind valgrind
needs redis-server redis-server
needs redis-tools redis-cli
needs python3 python3
ROUNDS=${1:-3}
SMALL=${SMALL:-2000}
BIG=${BIG:-22000}
PORT=${PORT:-7797}
DIR=$(mktemp -d)
cargo build --release -q -p tollgate-cli
start_redis "$PORT" "$DIR"
trap 'redis-cli -p "$PORT" shutdown nosave >/dev/null 2>&1 || true; rm -rf "$DIR"' EXIT

# instructions CONNECTION REQUESTS: the load tool's instructions for one run
instructions() {
  local out="$DIR/cg.out" conn=()
  [ "$1" = multiplexed ] && conn=(--multiplexed)
  redis-cli -p "$PORT" flushall >/dev/null
  valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file="$out" \
    "$TOLLGATE_BIN" load --redis "redis://127.0.0.1:$PORT" "${conn[@]}" --json \
    --threads 1 --tasks 16 --keys 100000 --requests "$2" --timeout 5s \
    --policy token-bucket:capacity=100,rate=50 >"$DIR/load.json" 2>"$DIR/valgrind.log"
  load_figure "client-cost.sh ($1, $2 requests)" "d['requests']" <"$DIR/load.json" >/dev/null
  grep -h '^summary:' "$out" | awk '{print $2}'
}

echo "| round | connection | instructions per decision |"
echo "|---:|---|---:|"
for round in $(seq "$ROUNDS"); do
  for conn in multiplexed pool4; do
    small=$(instructions "$conn" "$SMALL")
    big=$(instructions "$conn" "$BIG")
    echo "| $round | $conn | $(( (big - small) / (BIG - SMALL) )) |"
  done
done
