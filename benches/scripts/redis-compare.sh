#!/usr/bin/env bash
# The Redis-path figures of BENCHMARKS.md, measured side by side in one run on one fresh
# loopback redis-server: tollgate's decisions/s at several concurrencies and connection kinds
# against redis-benchmark running the same script by EVALSHA (the ceiling), the PING baseline
# for latency, batching, the deny cache, and MEMORY USAGE per idle key.
#
# Usage: benches/scripts/redis-compare.sh [requests-per-run]   (prints Markdown to stdout)
# THREADS: worker threads of the load tool's runtime (default 1: on this 2-vCPU machine the
# single-threaded redis-server then keeps a core of its own; a section below measures 1 vs 2).
set -euo pipefail
cd "$(dirname "$0")/../.."
source benches/scripts/lib.sh
needs redis-server redis-server
needs redis-tools redis-cli redis-benchmark
needs python3 python3
N=${1:-100000}
CSV=${CSV:-/dev/null}   # also write the throughput table as CSV (for benches/scripts/chart.py)
PORT=${PORT:-7790}
THREADS=${THREADS:-1}
cargo build --release -q -p tollgate-cli
B=$TOLLGATE_BIN
DIR=$(mktemp -d)
# serve PORT: a fresh loopback redis-server on a free port (the script-cost section starts
# three more); only the servers started here are shut down at the end
STARTED=()
serve() {
  start_redis "$1" "$DIR/$1"
  STARTED+=("$1")
}
trap 'for p in "${STARTED[@]}"; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done; rm -rf "$DIR"' EXIT
serve "$PORT"
URL="redis://127.0.0.1:$PORT"
TB="token-bucket:capacity=100,rate=50"
FW="fixed-window:limit=100,window=1m"
SL="sliding-log:limit=100,window=1m"

j() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
# load ARGS...: `tollgate load ARGS --json` (pinned to CPU $PIN_CPU if set), its JSON on stdout.
# A run in which any call got no decision (timeout, store error) stops the whole script, naming
# the run: its throughput would not be a measure of decisions, and no row is printed from it.
load() {
  local out
  out=$(${PIN_CPU:+taskset -c "$PIN_CPU"} $B load "$@" --json) || { echo "redis-compare.sh: failed: tollgate load $*" >&2; return 1; }
  echo "$out" | python3 -c "
import json, sys
d = json.load(sys.stdin)
if d['errors']:
    sys.exit('redis-compare.sh: %d of %d requests got no decision (first error: %s) in: tollgate load %s'
             % (d['errors'], d['requests'], d['first_error'], sys.argv[1]))" "$*" || return 1
  echo "$out"
}

echo "## Redis path ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, redis $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/'), $N requests per run, load tool runtime threads: $THREADS)"
echo
echo "### Throughput against the same script in redis-benchmark (100,000 keys)"
echo
echo "| policy | connection | tasks | tollgate decisions/s | p50 µs | p99 µs | ceiling -P 1 | ratio | ceiling -P 16 | ratio |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
echo "policy,connection,tasks,tollgate,ceiling_p1,ceiling_p16" > "$CSV"
# SKIP_THROUGHPUT=1 skips this table (the longest part) to re-run the sections after it
POLICIES=("$TB" "$FW" "$SL"); [ -n "${SKIP_THROUGHPUT:-}" ] && POLICIES=()
for P in "${POLICIES[@]}"; do
  for conn in multiplexed pool16; do
    for tasks in 1 4 16 64; do
      extra="--multiplexed"; [ "$conn" = pool16 ] && extra="--pool 16"
      # each row on an empty server: the 1-minute keys of earlier rows (three runs' worth each)
      # would otherwise expire, and the tables grow, under this one
      redis-cli -p "$PORT" flushall >/dev/null
      out=$(load --threads "$THREADS" --redis "$URL" --policy "$P" --tasks "$tasks" --requests "$N" --keys 100000 $extra --compare-redis-benchmark)
      echo "$out" | j "'| ${P%%:*} | $conn | $tasks | %.0f | %.1f | %.1f | %.0f | %.2f | %.0f | %.2f |' % (d['decisions_per_sec'], d['latency_us']['p50'], d['latency_us']['p99'], d['redis_benchmark'][0]['requests_per_sec'], d['redis_benchmark'][0]['tollgate_ratio'], d['redis_benchmark'][1]['requests_per_sec'], d['redis_benchmark'][1]['tollgate_ratio'])"
      echo "$out" | j "'${P%%:*},$conn,$tasks,%.0f,%.0f,%.0f' % (d['decisions_per_sec'], d['redis_benchmark'][0]['requests_per_sec'], d['redis_benchmark'][1]['requests_per_sec'])" >> "$CSV"
    done
  done
done
echo
SC=$((4 * N))
echo "### Script cost: tollgate's token bucket vs the source text's (-c 64 -P 16, 100,000 keys, $SC requests per run; 5 rounds, interleaved)"
echo
echo "Both scripts driven by one client, \`tollgate ceiling\` (redis-benchmark's loop over raw"
echo "connections: redis-benchmark itself cannot send tollgate's binary argument), and the source"
echo "text's also by redis-benchmark, as a check on that driver. One unrecorded pass of each first;"
echo "then the two scripts' order alternates between rounds. Each run is four times the other"
echo "sections' (~3 s): a run of 100,000 requests lasts under a second, of which the clients'"
echo "start is a visible part. Each script (and the redis-benchmark check) has a fresh redis-server"
echo "of its own: the source text's keys live 2 s after a run, and on a shared server their expiry"
echo "would fall in the next run of another script (tollgate's keys live ~20 ms). Beside the throughput, each server's own CPU time (user + system,"
echo "from /proc) per request in each run: what each script costs the server, whatever the client does."
echo
SRC_PORT=$((PORT + 1)) OUR_PORT=$((PORT + 2)) RB_PORT=$((PORT + 3))
serve "$SRC_PORT"; serve "$OUR_PORT"; serve "$RB_PORT"
SEED_SHA=$(redis-cli -p "$RB_PORT" script load "$(cat benches/scripts/seed_token_bucket.lua)")
pid() { redis-cli -p "$1" info server | tr -d '\r' | sed -n 's/^process_id://p'; }
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# costed PORT CMD...: one run of CMD (which prints requests/s) against the server on PORT:
# "<requests/s> <that server's CPU ns per request>"
costed() {
  local p t0 rps
  p=$(pid "$1"); shift
  t0=$(ticks "$p"); rps=$("$@"); echo "$rps $((($(ticks "$p") - t0) * 10000000 / SC))"
}
rb() { redis-benchmark -p "$RB_PORT" -c 64 -P 16 -n "$SC" -r 100000 --csv "$@" | tail -1 | cut -d, -f2 | tr -d '"'; }
ceil() { $B ceiling --clients 64 --pipeline 16 --requests "$SC" --keys 100000 --json "$@" | j "d['requests_per_sec']"; }
# the source text's keys take a prefix as long as tollgate's, so both key sets are alike; one
# unrecorded pass of each first (the key sets' first growth), then rounds in alternating order
src() { ceil --redis "redis://127.0.0.1:$SRC_PORT" --script benches/scripts/seed_token_bucket.lua --arg 100 --arg 50 --arg 1 --prefix seedtext:; }
ours() { ceil --redis "redis://127.0.0.1:$OUR_PORT" --policy "$TB"; }
src >/dev/null; ours >/dev/null; rb EVALSHA "$SEED_SHA" 1 'seed:{k__rand_int__}' 100 50 1 >/dev/null
seeds=(); seedsd=(); tg=()
for r in 1 2 3 4 5; do
  seeds+=("$(costed "$RB_PORT" rb EVALSHA "$SEED_SHA" 1 'seed:{k__rand_int__}' 100 50 1)")
  if [ $((r % 2)) -eq 1 ]; then
    seedsd+=("$(costed "$SRC_PORT" src)"); tg+=("$(costed "$OUR_PORT" ours)")
  else
    tg+=("$(costed "$OUR_PORT" ours)"); seedsd+=("$(costed "$SRC_PORT" src)")
  fi
done
python3 - "${seeds[*]}" "${seedsd[*]}" "${tg[*]}" <<'PY'
import statistics as st, sys
def pairs(text):
    v = [float(x) for x in text.split()]
    return list(zip(v[0::2], v[1::2]))
s, d, o = (pairs(a) for a in sys.argv[1:4])
print('| script (driver) | requests/s, each round | median | server CPU µs per request, each round | median |')
print('|---|---|---:|---|---:|')
def row(name, v):
    print('| %s | %s | %.0f | %s | %.2f |' % (name, ', '.join('%.0f' % x for x, _ in v),
          st.median(x for x, _ in v), ', '.join('%.2f' % (c / 1000) for _, c in v),
          st.median(c / 1000 for _, c in v)))
row("source text's token bucket (HGET x2, HSET, PEXPIRE; redis-benchmark)", s)
row("source text's token bucket (tollgate ceiling)", d)
row('tollgate token bucket (TIME, GET, SET PX; tollgate ceiling)', o)
def ratio(label, f):
    r = [f(x, y) for x, y in zip(o, d)]
    print('\n%s (median of the per-round ratios): %.2f (rounds: %s)' % (label, st.median(r), ', '.join('%.2f' % x for x in r)))
ratio('ceiling ratio tollgate/source text, one driver', lambda x, y: x[0] / y[0])
ratio('server CPU per request, source text/tollgate', lambda x, y: y[1] / x[1])
print("\nagainst redis-benchmark driving the source text's: %.2f" % st.median(x[0] / y[0] for x, y in zip(o, s)))
PY
for p in "$SRC_PORT" "$OUR_PORT" "$RB_PORT"; do redis-cli -p "$p" shutdown nosave >/dev/null; done
echo
echo "### Connections: multiplexed vs bb8 pools (token bucket, 100,000 keys; 3 rounds each)"
echo
echo "A pool connects on demand, as the library does in a service (a connection is made only when"
echo "a call finds none idle: on one runtime thread a pool keeps the one connection it starts with);"
echo '`all` rows pass `--connect-all`: every connection made before the clock, and every one deciding.'
echo
echo "| runtime threads | connection | tasks | decisions/s, each round | median | p50 µs (median) | p99 µs (median) |"
echo "|---:|---|---:|---|---:|---:|---:|"
for threads in 1 2; do
for tasks in 16 64; do
  for conn in multiplexed 4 16 64 4all 16all 64all; do
    case $conn in
      multiplexed) extra="--multiplexed"; label=multiplexed ;;
      *all) extra="--pool ${conn%all} --connect-all"; label="pool(${conn%all}), all" ;;
      *) extra="--pool $conn"; label="pool($conn)" ;;
    esac
    rates=(); p50s=(); p99s=()
    for _ in 1 2 3; do
      out=$(load --threads "$threads" --redis "$URL" --policy "$TB" --tasks "$tasks" --requests "$N" --keys 100000 $extra)
      rates+=("$(echo "$out" | j "round(d['decisions_per_sec'])")")
      p50s+=("$(echo "$out" | j "d['latency_us']['p50']")")
      p99s+=("$(echo "$out" | j "d['latency_us']['p99']")")
    done
    python3 -c "
import statistics as st
r=[$(IFS=,; echo "${rates[*]}")]; a=[$(IFS=,; echo "${p50s[*]}")]; b=[$(IFS=,; echo "${p99s[*]}")]
print('| $threads | $label | $tasks | %s | %d | %.1f | %.1f |' % (', '.join(str(x) for x in r), st.median(r), st.median(a), st.median(b)))"
  done
done
done
echo
echo "### Client runtime threads (token bucket, multiplexed, 64 tasks, 100,000 keys; 3 rounds, interleaved)"
echo
echo "The tool's tasks, its connection and the ceiling driver share the runtime's worker threads,"
echo "which share the machine's $(nproc) vCPUs with redis-server."
echo
echo "| threads | tollgate decisions/s, each round | ceiling -P 16, each round | median ratio |"
echo "|---:|---|---|---:|"
declare -A TR TC TQ
for _ in 1 2 3; do
  for t in 1 2; do
    out=$(load --threads "$t" --redis "$URL" --policy "$TB" --tasks 64 --requests "$N" --keys 100000 --multiplexed --compare-redis-benchmark)
    TR[$t]+="$(echo "$out" | j "round(d['decisions_per_sec'])") "
    TC[$t]+="$(echo "$out" | j "round(d['redis_benchmark'][1]['requests_per_sec'])") "
    TQ[$t]+="$(echo "$out" | j "d['redis_benchmark'][1]['tollgate_ratio']") "
  done
done
for t in 1 2; do
  python3 -c "
import statistics as st
r='${TR[$t]}'.split(); c='${TC[$t]}'.split(); q=[float(x) for x in '${TQ[$t]}'.split()]
print('| $t | %s | %s | %.2f |' % (', '.join(r), ', '.join(c), st.median(q)))"
done
echo
echo "### Latency, one call at a time (token bucket; same tool; 5 rounds, interleaved)"
echo
echo "A lone request-response loop across the VM's two vCPUs is bimodal (a halted vCPU takes"
echo "tens of µs to wake: PING p50 swings between 9 and 60 µs), so for this section redis-server"
echo "and the tool are pinned to one CPU (taskset), the same for every probe. The floors are"
echo "scripts from benches/scripts/latency/ run by a bare EVALSHA (--eval-file) on the same keys:"
echo "what any script that reads Redis TIME, reads the key and (to admit) writes it with an expiry"
echo "pays before doing any work of its own. 100,000 keys: nearly every call admits (the bucket of"
echo "the last visit has refilled and expired); one key: nearly every call is denied."
echo
echo "| probe | p50 µs, each round | median p50 µs | ratio to PING |"
echo "|---|---|---:|---:|"
RPID=$(redis-cli -p "$PORT" info server | tr -d '\r' | sed -n 's/^process_id://p')
taskset -pc 0 "$RPID" >/dev/null
declare -A LAT
p50() { PIN_CPU=0 load --redis "$URL" --policy "$TB" --tasks 1 --requests $((N / 5)) "$@" | j "d['latency_us']['p50']"; }
for _ in 1 2 3 4 5; do
  LAT[ping]+="$(p50 --ping) "
  for f in empty time read write; do
    # the store's key shape, under a prefix as long as tollgate's: write.lua's values (60 s)
    # must not be the records the decisions below find
    LAT[$f]+="$(p50 --keys 100000 --prefix floorkey: --eval-file "benches/scripts/latency/$f.lua") "
  done
  LAT[bare]+="$(p50 --keys 100000 --bare-script) "
  LAT[dec]+="$(p50 --keys 100000 --multiplexed) "
  LAT[bare1]+="$(p50 --keys 1 --bare-script) "
  LAT[dec1]+="$(p50 --keys 1 --multiplexed) "
done
taskset -pc "0-$(($(nproc) - 1))" "$RPID" >/dev/null
python3 -c "
import statistics as st
rows = [('PING', '${LAT[ping]}'),
        ('floor: EVALSHA of return 1 (latency/empty.lua)', '${LAT[empty]}'),
        ('floor: TIME (latency/time.lua)', '${LAT[time]}'),
        ('floor: TIME + GET, what a denial needs (latency/read.lua)', '${LAT[read]}'),
        ('floor: TIME + GET + SET PX, what an admission needs (latency/write.lua)', '${LAT[write]}'),
        ('bare EVALSHA of the same script (--bare-script), 100,000 keys', '${LAT[bare]}'),
        ('tollgate decision (Limiter, multiplexed), 100,000 keys', '${LAT[dec]}'),
        ('bare EVALSHA of the same script, one key (denied)', '${LAT[bare1]}'),
        ('tollgate decision, one key (denied)', '${LAT[dec1]}')]
base = st.median(float(x) for x in rows[0][1].split())
for name, vals in rows:
    v = [float(x) for x in vals.split()]
    print('| %s | %s | %.1f | %.2f |' % (name, ', '.join('%.1f' % x for x in v), st.median(v), st.median(v) / base))"
echo
echo "### Batching (token bucket, 4 tasks, 100,000 keys)"
echo
echo "| keys per call | decisions/s |"
echo "|---:|---:|"
for b in 1 16; do
  load --threads "$THREADS" --redis "$URL" --policy "$TB" --tasks 4 --requests "$N" --keys 100000 --batch $b | j "'| $b | %.0f |' % d['decisions_per_sec']"
done
echo
echo "### Hot abusive key (fixed window, limit 10 per hour, one key, 64 tasks, 3 s; the runtime's default threads, as a service would run)"
echo
echo "| deny cache | decisions/s | decisions | scripts the server ran |"
echo "|---|---:|---:|---:|"
# scripts_run: EVALSHA + EVAL calls the server has executed (INFO commandstats), so the table
# shows the cached run's decisions cost (nearly) no round trip
scripts_run() {
  redis-cli -p "$PORT" info commandstats | tr -d '\r' \
    | sed -n 's/^cmdstat_\(evalsha\|eval\):calls=\([0-9]*\),.*/\2/p' | awk '{n += $1} END {print n + 0}'
}
redis-cli -p "$PORT" flushall >/dev/null
for cache in off on; do
  extra=(); [ "$cache" = on ] && extra=(--deny-cache 10000)
  before=$(scripts_run)
  row=$(load --redis "$URL" --policy "fixed-window:limit=10,window=1h" --tasks 64 --duration 3s --keys 1 "${extra[@]}" | j "'%.0f %d' % (d['decisions_per_sec'], d['requests'])")
  read -r rate calls <<<"$row"
  printf '| %s | %s | %s | %s |\n' "$cache" "$rate" "$calls" "$(( $(scripts_run) - before ))"
  [ "$cache" = off ] && a=$rate || bb=$rate
done
printf '\nratio on/off: %s\n' "$(python3 -c "print(round($bb/$a, 1))")"
echo
echo "### MEMORY USAGE per idle key"
echo
redis-cli -p "$PORT" flushall >/dev/null
# slow refill / long windows so the keys stay (a token bucket expires once full again)
i=0
for P in "token-bucket:capacity=100,rate=100,period=1m" "token-bucket:capacity=100,rate=1,period=1h" "$FW" "$SL"; do
  i=$((i + 1))
  $B check --redis "$URL" --policy "$P" --key "api:user-1234$i" >/dev/null
done
echo "| key | value bytes | MEMORY USAGE bytes |"
echo "|---|---:|---:|"
for k in $(redis-cli -p "$PORT" --scan | sort); do
  echo "| \`$k\` | $(redis-cli -p "$PORT" strlen "$k") | $(redis-cli -p "$PORT" memory usage "$k") |"
done
echo
echo "### MEMORY USAGE of a sliding log at its bound (limit reached: one entry per admitted call)"
echo
echo "| policy | admitted / denied | value bytes | MEMORY USAGE bytes |"
echo "|---|---:|---:|---:|"
for L in 10 100 1000; do
  # one task, one call at a time: every admission at its own microsecond, so none merge
  ad=$(load --redis "$URL" --policy "sliding-log:limit=$L,window=1h" --keys 1 --tasks 1 --requests $((L + 5)) --prefix "bound$L:" | j "'%d / %d' % (d['allowed'], d['denied'])")
  k="bound$L:{load:k0}"
  echo "| sliding-log:limit=$L,window=1h | $ad | $(redis-cli -p "$PORT" strlen "$k") | $(redis-cli -p "$PORT" memory usage "$k") |"
done
