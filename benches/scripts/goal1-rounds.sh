#!/usr/bin/env bash
# Goal 1 of issue 7 in interleaved rounds: tollgate's decisions/s at 64 tasks on 100,000 keys
# as a ratio to the -P 16 ceiling on the same script, keys and order (`tollgate load
# --compare-redis-benchmark`), for every algorithm and both connection kinds, ROUNDS times in
# turn on one fresh loopback redis-server. On this shared 2-vCPU host one table's rows swing
# with the host (a ceiling moved 72k-160k between rows of one run); the median of several
# rounds, each ratio taken within its own run, is the figure to read.
#
# Usage: benches/scripts/goal1-rounds.sh [rounds] [requests-per-run]   (prints Markdown)
set -euo pipefail
cd "$(dirname "$0")/../.."
source benches/scripts/lib.sh
ROUNDS=${1:-5}
N=${2:-100000}
PORT=${PORT:-7796}
cargo build --release -q -p tollgate-cli
B=$TOLLGATE_BIN
DIR=$(mktemp -d)
start_redis "$PORT" "$DIR"
trap 'redis-cli -p "$PORT" shutdown nosave >/dev/null 2>&1 || true; rm -rf "$DIR"' EXIT
URL="redis://127.0.0.1:$PORT"
POLICIES=("token-bucket:capacity=100,rate=50" "fixed-window:limit=100,window=1m" "sliding-log:limit=100,window=1m")
OUT="$DIR/rows.txt"
for r in $(seq "$ROUNDS"); do
  for P in "${POLICIES[@]}"; do
    for conn in multiplexed pool16; do
      extra="--multiplexed"; [ "$conn" = pool16 ] && extra="--pool 16"
      # each invocation on an empty server: a window's keys (1 minute) of earlier runs would
      # otherwise expire, and the tables grow, under whichever run comes next
      redis-cli -p "$PORT" flushall >/dev/null
      out=$($B load --threads 1 --redis "$URL" --policy "$P" --tasks 64 --requests "$N" --keys 100000 $extra --json --compare-redis-benchmark)
      echo "$out" | python3 -c "
import json, sys
d = json.load(sys.stdin)
if d['errors']:
    sys.exit('goal1-rounds.sh: %d requests got no decision in round $r, $P, $conn' % d['errors'])
print('${P%%:*} $conn $r %.0f %.0f %.3f' % (d['decisions_per_sec'], d['redis_benchmark'][1]['requests_per_sec'], d['redis_benchmark'][1]['tollgate_ratio']))" >>"$OUT"
    done
  done
done
echo "### Goal 1 in $ROUNDS interleaved rounds ($(date -u +%Y-%m-%dT%H:%MZ), $(git rev-parse --short HEAD), 64 tasks, 100,000 keys, $N requests per run, load tool on one runtime thread)"
echo
echo "| policy | connection | tollgate / ceiling -P 16, each round (decisions/s / ceiling) | median ratio |"
echo "|---|---|---|---:|"
python3 - "$OUT" <<'PY'
import collections, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    p, c, r, t, ceil, q = line.split()
    rows[(p, c)].append((float(q), t, ceil))
for (p, c), v in rows.items():
    cells = ', '.join('%.2f (%dk / %dk)' % (q, round(float(t) / 1000), round(float(ceil) / 1000)) for q, t, ceil in v)
    print('| %s | %s | %s | **%.2f** |' % (p, c, cells, statistics.median(q for q, _, _ in v)))
PY
