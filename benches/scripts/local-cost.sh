#!/usr/bin/env bash
# LocalStore against governor by counts rather than time: instructions, L1d misses and misses of
# a simulated 2 MiB L2 (this host's per-core L2) per decision, under cachegrind, for the
# `hot_key` example's scenarios. The counts do not move with the other tenants of a shared
# machine, so they tell a change's effect where the timings of one run cannot.
#
#   benches/scripts/local-cost.sh [calls] [scenario] [key counts...]
#   benches/scripts/local-cost.sh 1000000 allow_resident 1 1000 100000   # the defaults, ~3 min
#
# Each figure is (run with `calls` calls - run with 0 calls) / calls: the setup (building the
# keys, touching each once) is subtracted. One thread. Needs valgrind. Beside the two limiters,
# the `map_floor` example gives what the map alone costs (a `get_mut` and a write per call, same
# keys and hasher) with governor's 24-byte entries, LocalStore's 32-byte ones (a `Key` and its
# 16-byte bucket, since `94c0b59`), and the 48-byte ones it had before.
#
# Count `allow_resident` and `deny`, not `allow` over many keys: LocalStore's periodic sweep is
# gated by its real clock (`SWEEP_GAP_MS`, 100 ms), and at valgrind's ~50 x slowdown nearly
# every pass over 100,000 keys whose buckets expire between visits (`allow`) is swept and
# re-inserted, where a native run sweeps once per ~11 passes (at 3d1144b: 823.9 instructions
# and 2.93 L2 misses per call against governor's 407.1 and 2.08, a 2.02 x that the timed bench's
# 1.06 x does not show).
set -euo pipefail
cd "$(dirname "$0")/../.."
CALLS=${1:-1000000}
SCENARIO=${2:-allow_resident}
shift $(($# < 2 ? $# : 2))
KEYS=("$@")
[ ${#KEYS[@]} -gt 0 ] || KEYS=(1 1000 100000)
command -v valgrind >/dev/null || { echo "local-cost.sh: needs valgrind (apt-get install -y valgrind)" >&2; exit 1; }
cargo build -q --release -p tollgate-local --example hot_key --example map_floor
EXAMPLES=${CARGO_TARGET_DIR:-target}/release/examples

# Totals of one run of an example and its arguments: instructions, D1 misses, LL (2 MiB) misses.
counts() {
  local bin=$EXAMPLES/$1
  shift
  valgrind --tool=cachegrind --cache-sim=yes --LL=2097152,16,64 --cachegrind-out-file=/dev/null \
    "$bin" "$@" 2>&1 >/dev/null |
    awk '/ I *refs:/ {i=$4} / D1 *misses:/ {d=$4} / LLd misses:/ {l=$4} END {gsub(",","",i); gsub(",","",d); gsub(",","",l); print i, d, l}'
}

echo "| keys | limiter | instructions / call | L1d misses / call | 2 MiB L2 misses / call |"
echo "|---:|---|---:|---:|---:|"
for k in "${KEYS[@]}"; do
  declare -A per=()
  for who in tollgate governor; do
    extra=(); [ "$who" = governor ] && extra=(governor)
    read -r i0 d0 l0 < <(counts hot_key "$SCENARIO" "$k" 0 1 "${extra[@]}")
    read -r i1 d1 l1 < <(counts hot_key "$SCENARIO" "$k" "$CALLS" 1 "${extra[@]}")
    per[$who]=$(python3 -c "c=$CALLS; f=lambda a,b: max(a-b,0)/c; print(f'{f($i1,$i0):.1f} {f($d1,$d0):.2f} {f($l1,$l0):.2f}')")
    read -r pi pd pl <<<"${per[$who]}"
    echo "| $k | $who | $pi | $pd | $pl |"
  done
  read -r ti td tl <<<"${per[tollgate]}"
  read -r gi gd gl <<<"${per[governor]}"
  for entry in 24 32 48; do
    read -r i0 d0 l0 < <(counts map_floor "$entry" "$k" 0)
    read -r i1 d1 l1 < <(counts map_floor "$entry" "$k" "$CALLS")
    python3 -c "c=$CALLS; f=lambda a,b: max(a-b,0)/c; print(f'| $k | map only, $entry-byte entries | {f($i1,$i0):.1f} | {f($d1,$d0):.2f} | {f($l1,$l0):.2f} |')"
  done
  python3 -c "r=lambda a,b: f'{a/b:.2f}' if b else '-'; print(f'| $k | ratio LocalStore / governor | {r($ti,$gi)} | {r($td,$gd)} | {r($tl,$gl)} |')"
done
echo
echo "scenario $SCENARIO, $CALLS calls per run, commit $(git rev-parse --short HEAD)"
