#!/usr/bin/env bash
# Two builds of the load tool against each other on one fresh loopback redis-server: token
# bucket, 64 tasks, one multiplexed connection, one runtime thread, 100,000 keys, 200,000
# requests per run; one unrecorded pass of each, then R rounds in alternating order. Prints
# "A's decisions/s, B's, B/A" per round. For a change's effect on the Redis path's client.
#
# Usage: benches/scripts/ab.sh OLD_BINARY NEW_BINARY [rounds]   (copy each target/release/tollgate first)
set -euo pipefail
A=$1; B=$2; R=${3:-5}; PORT=${PORT:-7800}
D=$(mktemp -d)
redis-server --port $PORT --bind 127.0.0.1 --save '' --appendonly no --dir $D --daemonize yes --logfile $D/log
sleep 0.5
trap 'redis-cli -p $PORT shutdown nosave >/dev/null 2>&1; rm -rf $D' EXIT
run() { $1 load --threads 1 --redis redis://127.0.0.1:$PORT --policy token-bucket:capacity=100,rate=50 --tasks 64 --requests 200000 --keys 100000 --multiplexed --json | python3 -c "import json,sys; print(round(json.load(sys.stdin)['decisions_per_sec']))"; }
run $A >/dev/null; run $B >/dev/null
for r in $(seq $R); do
  if [ $((r % 2)) = 1 ]; then a=$(run $A); b=$(run $B); else b=$(run $B); a=$(run $A); fi
  echo "$a $b $(python3 -c "print(round($b/$a,3))")"
done
