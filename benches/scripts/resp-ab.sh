#!/usr/bin/env bash
# The store's default RESP3 against RESP2 (`?protocol=resp2`), one binary, one fresh loopback
# redis-server: throughput (64 tasks, one multiplexed connection, one runtime thread, 100,000
# keys, 200,000 requests) in alternating order, and p50 one call at a time (20,000 requests).
# Usage: benches/scripts/resp-ab.sh [rounds]   (after cargo build --release -p tollgate-cli)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
T=${T:-$TOLLGATE_BIN}; PORT=${PORT:-7811}; R=${1:-3}
D=$(mktemp -d)
start_redis "$PORT" "$D"
trap 'redis-cli -p $PORT shutdown nosave >/dev/null 2>&1; rm -rf $D' EXIT
# tp URL: decisions/s; lat URL: p50 µs one call at a time. A run with errors stops the script.
tp() { $T load --threads 1 --redis "$1" --policy token-bucket:capacity=100,rate=50 --tasks 64 --requests 200000 --keys 100000 --multiplexed --json | load_figure "resp-ab.sh: $1" "round(d['decisions_per_sec'])"; }
lat() { $T load --threads 1 --redis "$1" --policy token-bucket:capacity=100,rate=50 --tasks 1 --requests 20000 --keys 100000 --json | load_figure "resp-ab.sh: $1" "d['latency_us']['p50']"; }
U3="redis://127.0.0.1:$PORT"; U2="redis://127.0.0.1:$PORT/?protocol=resp2"
tp $U3 >/dev/null; tp $U2 >/dev/null
for r in $(seq $R); do
  if [ $((r % 2)) = 1 ]; then a=$(tp $U2); b=$(tp $U3); else b=$(tp $U3); a=$(tp $U2); fi
  la=$(lat $U2); lb=$(lat $U3)
  echo "round $r: resp2 $a/s resp3 $b/s ratio $(python3 -c "print(round($b/$a,3))")  p50 resp2 $la us resp3 $lb us"
done
