#!/usr/bin/env bash
# Two builds of the load tool against each other on one fresh loopback redis-server: token
# bucket, 64 tasks, one multiplexed connection, one runtime thread, 100,000 keys, 200,000
# requests per run; one unrecorded pass of each, then R rounds in alternating order. Prints
# per round "A's decisions/s, B's, B/A, A's client CPU µs per decision, B's" (user + system
# time of the load tool's process, by GNU time: what the client costs whatever the server
# does). For a change's effect on the Redis path's client.
#
# Usage: benches/scripts/ab.sh OLD_BINARY NEW_BINARY [rounds]   (copy each target/release/tollgate
# first; needs /usr/bin/time)
set -euo pipefail
A=$1; B=$2; R=${3:-5}; PORT=${PORT:-7800}
D=$(mktemp -d)
source "$(dirname "$0")/lib.sh"
start_redis "$PORT" "$D"
trap 'redis-cli -p $PORT shutdown nosave >/dev/null 2>&1; rm -rf $D' EXIT
# run BINARY: "<decisions/s> <client CPU µs per decision>"; a run with errors stops the script
run() {
  local out
  out=$(/usr/bin/time -f 'cpu %U %S' "$1" load --threads 1 --redis redis://127.0.0.1:$PORT --policy token-bucket:capacity=100,rate=50 --tasks 64 --requests 200000 --keys 100000 --multiplexed --json 2>&1) \
    || { echo "ab.sh: $1 load failed: $out" >&2; return 1; }
  echo "$out" | load_figure "ab.sh: $1" "'%d %.2f' % (round(d['decisions_per_sec']), sum(map(float, [l for l in text.splitlines() if l.startswith('cpu ')][-1].split()[1:3])) * 1e6 / 200000)"
}
run "$A" >/dev/null; run "$B" >/dev/null
for r in $(seq $R); do
  if [ $((r % 2)) = 1 ]; then a=($(run "$A")); b=($(run "$B")); else b=($(run "$B")); a=($(run "$A")); fi
  echo "${a[0]} ${b[0]} $(python3 -c "print(round(${b[0]}/${a[0]},3))") ${a[1]} ${b[1]}"
done
