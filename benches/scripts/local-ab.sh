#!/usr/bin/env bash
# Timings of in-process examples against each other, interleaved: each round runs every
# command once, in the order given, and the commands' "N ns per call" lines are collected.
# Prints each label's minimum and median over the rounds. For an A/B of two builds of the
# `hot_key` example (copy each build's target/release/examples/hot_key first) with governor
# as the same run's baseline:
#
#   benches/scripts/local-ab.sh 12 \
#     "old::/tmp/hot_key.old allow_resident 100000 2000000 1" \
#     "new::/tmp/hot_key.new allow_resident 100000 2000000 1" \
#     "gov::/tmp/hot_key.new allow_resident 100000 2000000 1 governor"
#
# Usage: benches/scripts/local-ab.sh ROUNDS "LABEL::COMMAND" ...  (a command may set
# environment variables: "off::NAME=1 /path/to/bin args")
set -euo pipefail
ROUNDS=$1
shift
declare -A res=()
for _ in $(seq "$ROUNDS"); do
  for spec in "$@"; do
    label=${spec%%::*}
    cmd=${spec#*::}
    ns=$(eval "$cmd" | grep -o '[0-9.]* ns per call' | head -1 | cut -d' ' -f1)
    [ -n "$ns" ] || { echo "local-ab.sh: no 'ns per call' from: $cmd" >&2; exit 1; }
    res[$label]+="$ns "
  done
done
for spec in "$@"; do
  label=${spec%%::*}
  # shellcheck disable=SC2086 # one argument per figure
  echo "$label: $(python3 -c "import statistics, sys; v = sorted(map(float, sys.argv[1:])); print(f'min {v[0]:.1f} median {statistics.median(v):.1f} n={len(v)}')" ${res[$label]})"
done
