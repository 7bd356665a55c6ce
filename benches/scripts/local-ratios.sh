#!/usr/bin/env bash
# LocalStore against governor, as ratios (LocalStore time / governor time, same criterion group,
# same run), repeated: `benches/scripts/local-ratios.sh [rounds] [criterion filter]`.
# Each round is one `cargo bench --bench local` run; the table gives every round's ratio and
# their median. Rounds alternate which limiter runs first in each criterion group (odd rounds
# LocalStore first, even rounds governor first: `LOCAL_BENCH_ORDER`), marked `G` in the table.
# Two-thread groups on this shared 2-vCPU VM are bimodal between runs (the host places the two
# threads differently), so one run's ratio is not enough to judge them.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-3}
FILTER=${2:-}
TARGET=${CARGO_TARGET_DIR:-target}
OUT=$(mktemp -d)
for r in $(seq "$ROUNDS"); do
  ORDER=tollgate-first; [ $((r % 2)) -eq 0 ] && ORDER=governor-first
  touch "$OUT/start$r"
  LOCAL_BENCH_ORDER=$ORDER cargo bench -q -p tollgate-benches --bench local -- --warm-up-time 1 \
    --measurement-time 3 ${FILTER:+"$FILTER"} >"$OUT/round$r.log" 2>&1
  for g in "$TARGET"/criterion/local_*; do
    [ -f "$g/tollgate/new/estimates.json" ] || continue
    # only groups this round measured (not a group an older bench left in the target dir)
    [ "$g/tollgate/new/estimates.json" -nt "$OUT/start$r" ] && [ "$g/governor/new/estimates.json" -nt "$OUT/start$r" ] || continue
    [ -z "$FILTER" ] || [[ "$(basename "$g")" == *"${FILTER//\//_}"* ]] || continue
    echo "$(basename "$g") $r $(python3 -c '
import json,sys
t=json.load(open(sys.argv[1]))["mean"]["point_estimate"]
g=json.load(open(sys.argv[2]))["mean"]["point_estimate"]
print(f"{t:.1f} {g:.1f}")' "$g/tollgate/new/estimates.json" "$g/governor/new/estimates.json")"
  done >>"$OUT/all.txt"
done
python3 - "$OUT/all.txt" "$ROUNDS" <<'PY'
import collections, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    group, _, t, g = line.split()
    rows[group].append((float(t), float(g)))
print("| group | " + " | ".join(f"round {i+1}{' G' if i % 2 else ''} (ns: LocalStore / governor = ratio)" for i in range(int(sys.argv[2]))) + " | median ratio |")
print("|---|" + "---|" * int(sys.argv[2]) + "---:|")
for group in sorted(rows):
    cells = [f"{t:.1f} / {g:.1f} = {t/g:.2f}" for t, g in rows[group]]
    med = statistics.median(t / g for t, g in rows[group])
    print(f"| {group} | " + " | ".join(cells) + f" | **{med:.2f}** |")
PY
rm -rf "$OUT"
