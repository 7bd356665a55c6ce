#!/usr/bin/env bash
# What each script costs Redis, as instructions per EVALSHA executed by redis-server (callgrind:
# deterministic, unlike wall time on a shared machine). Runs redis-server under valgrind on a
# loopback port, drives each script as `redis-benchmark -c 8 -P 16 -r 1000` would, with
# benches/scripts/pipeline.py (redis-benchmark cannot send tollgate's binary argument; every
# row uses the same driver), a warm-up pass first, zeroes the counters, runs N calls, dumps and
# divides. The figure includes Redis's own per-command work (reading the request, each argument,
# EVALSHA's setup, the reply): compare scripts with each other and with benches/scripts/floor.lua.
# A key is visited about every 0.3 s under valgrind, so a bucket whose expiry is shorter (the
# token bucket at 50/s, refilled 20 ms after one token) is gone at the next call and takes the
# missing-bucket path; the per-hour row keeps its record and takes the stored-bucket path.
#
# tollgate's rows run its one script (every algorithm), exactly as the store loads it
# (`tollgate ceiling --print-script`); each row has keys of its own, since one key holds a
# bucket whatever its algorithm.
#
# Usage: benches/scripts/script-cost.sh [calls]   (needs valgrind, redis-server, python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
source benches/scripts/lib.sh
needs valgrind valgrind callgrind_control
needs redis-server redis-server
needs redis-tools redis-cli
needs python3 python3
N=${1:-5000}
PORT=${PORT:-7795}
DIR=$(mktemp -d)
cargo build --release -q -p tollgate-cli
"$TOLLGATE_BIN" ceiling --policy token-bucket:capacity=1,rate=1 --print-script >"$DIR/tollgate.lua"
port_is_free "$PORT"
valgrind --tool=callgrind --callgrind-out-file="$DIR/out.%p" \
  redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$DIR" \
  >"$DIR/valgrind.log" 2>&1 &
VG=$!
trap 'redis-cli -p "$PORT" shutdown nosave >/dev/null 2>&1 || true; wait $VG 2>/dev/null || true; rm -rf "$DIR"' EXIT
for _ in $(seq 100); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.2; done
redis-cli -p "$PORT" ping >/dev/null 2>&1 || {
  echo "script-cost.sh: redis-server under valgrind did not answer on port $PORT in 20 s: $(tail -5 "$DIR/valgrind.log")" >&2
  exit 1
}
cost() { # name, script file(s), key, args...
  local name=$1 src=$2 key=$3; shift 3
  local sha
  sha=$(redis-cli -p "$PORT" script load "$(cat $src)")
  python3 benches/scripts/pipeline.py "$PORT" "$N" 8 16 1000 EVALSHA "$sha" 1 "$key" "$@"
  callgrind_control -z "$VG" >/dev/null 2>&1
  python3 benches/scripts/pipeline.py "$PORT" "$N" 8 16 1000 EVALSHA "$sha" 1 "$key" "$@"
  rm -f "$DIR"/out.*.*
  callgrind_control -d "$VG" >/dev/null 2>&1
  sleep 0.3
  local ir
  ir=$(grep -h '^summary:\|^totals:' "$DIR"/out.*.* | tail -1 | awk '{print $2}')
  echo "| $name | $((ir / N)) |"
}
echo "| script (policy) | instructions per call |"
echo "|---|---:|"
T=$DIR/tollgate.lua
# ARGV: tollgate's one argument, MessagePack: the record's head (tag, generation, 0, parameters),
# then transition, cost, commit (see crates/redis-backend/src/scripts.rs), exactly the bytes the
# store sends for the policy, printed by the tool in pipeline.py's mp: notation
arg() { "$TOLLGATE_BIN" ceiling --policy "$1" --print-arg; }
TB=$(arg token-bucket:capacity=100,rate=50)
cost "floor: TIME + GET + SET PX, nothing else (benches/scripts/floor.lua), 8 decimal arguments" benches/scripts/floor.lua 'f:{k__rand_int__}' 100 1000000 50 0 0 1 1 1
cost "floor, with tollgate's one argument (token bucket 100, 50/s)" benches/scripts/floor.lua 'f1:{k__rand_int__}' "$TB"
cost "source text's token bucket (100, 50/s)" benches/scripts/seed_token_bucket.lua 'seed:{k__rand_int__}' 100 50 1
cost "tollgate token bucket (100, 50/s; bucket expired at each call)" "$T" 'tollgate:{k__rand_int__}' "$TB"
cost "tollgate token bucket (100 per hour; bucket stored at each call)" "$T" 'tollgate:{h__rand_int__}' "$(arg token-bucket:capacity=100,rate=100,period=1h)"
cost "tollgate fixed window (100 per 1 min)" "$T" 'tollgate:{w__rand_int__}' "$(arg fixed-window:limit=100,window=1m)"
cost "tollgate sliding log (100 per 1 min; 5 entries per key by the end)" "$T" 'tollgate:{s__rand_int__}' "$(arg sliding-log:limit=100,window=1m)"
# one token per hour, cost 1: the warm-up pass takes each key's token, so every measured call
# is a denial on a stored bucket (a token-bucket denial writes nothing: GET, no SET)
cost "tollgate token bucket (1 per hour; denied at each call)" "$T" 'tollgate:{d__rand_int__}' "$(arg token-bucket:capacity=1,rate=1,period=1h)"
