#!/usr/bin/env bash
# What each script costs Redis, as instructions per EVALSHA executed by redis-server (callgrind:
# deterministic, unlike wall time on a shared machine). Runs redis-server under valgrind on a
# loopback port, drives each script with redis-benchmark (8 clients, -P 16, 1000 keys; a warm-up
# pass first so every key exists), zeroes the counters, runs N calls, dumps and divides.
# The figure includes Redis's own per-command work (reading the request, EVALSHA's setup,
# the reply): compare scripts with each other and with benches/scripts/floor.lua.
#
# Usage: benches/scripts/script-cost.sh [calls]   (needs valgrind, redis-server, redis-benchmark)
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${1:-5000}
PORT=${PORT:-7795}
DIR=$(mktemp -d)
valgrind --tool=callgrind --callgrind-out-file="$DIR/out.%p" \
  redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$DIR" \
  >"$DIR/valgrind.log" 2>&1 &
VG=$!
trap 'redis-cli -p "$PORT" shutdown nosave >/dev/null 2>&1 || true; wait $VG 2>/dev/null || true; rm -rf "$DIR"' EXIT
for _ in $(seq 100); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.2; done
S=crates/redis-backend/scripts
cost() { # name, script file(s), key, args...
  local name=$1 src=$2 key=$3; shift 3
  local sha
  sha=$(redis-cli -p "$PORT" script load "$(cat $src)")
  redis-benchmark -p "$PORT" -c 8 -P 16 -n "$N" -r 1000 EVALSHA "$sha" 1 "$key" "$@" >/dev/null
  callgrind_control -z "$VG" >/dev/null
  redis-benchmark -p "$PORT" -c 8 -P 16 -n "$N" -r 1000 EVALSHA "$sha" 1 "$key" "$@" >/dev/null
  rm -f "$DIR"/out.*.*
  callgrind_control -d "$VG" >/dev/null
  sleep 0.3
  local ir
  ir=$(grep -h '^summary:\|^totals:' "$DIR"/out.*.* | tail -1 | awk '{print $2}')
  echo "| $name | $((ir / N)) |"
}
echo "| script (policy) | instructions per call |"
echo "|---|---:|"
cost "floor: TIME + GET + SET PX, nothing else (benches/scripts/floor.lua)" benches/scripts/floor.lua 'f:{k__rand_int__}' 100 1000000 50 0 0 1 1 1
cost "source text's token bucket (100, 50/s)" benches/scripts/seed_token_bucket.lua 'seed:{k__rand_int__}' 100 50 1
cost "tollgate token bucket (100, 50/s)" "$S/prelude.lua $S/token_bucket.lua" 'tollgate:{k__rand_int__}:tb' 100 1000000 50 0 0 1 1 1
cost "tollgate fixed window (100 per 1 min)" "$S/prelude.lua $S/fixed_window.lua" 'tollgate:{k__rand_int__}:fw' 100 60000000 0 1 1 1
cost "tollgate sliding log (100 per 1 min; 5 entries per key by the end)" "$S/prelude.lua $S/sliding_log.lua" 'tollgate:{k__rand_int__}:sl' 100 60000000 0 1 1 1
