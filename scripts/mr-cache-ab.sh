#!/usr/bin/env bash
# Registration time with libfabric's registration caches off (the efa transport's default: it
# sets FI_MR_CACHE_MAX_COUNT=0 and FI_EFA_MR_CACHE_ENABLE=0 where unset) against on (the user
# sets FI_MR_CACHE_MAX_COUNT=1024 FI_EFA_MR_CACHE_ENABLE=1, which the transport keeps), through
# `te-bench register --transport efa`, rounds alternating the two arms so machine drift hits both.
# Prints the median over rounds of each run's median registration time, per shape.
# Usage: scripts/mr-cache-ab.sh TE_BENCH [PROVIDER] [ROUNDS]
set -euo pipefail
bench=$1 provider=${2:-"tcp;ofi_rxm"} rounds=${3:-7}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
run() { # arm count size
  local arm=$1 count=$2 size=$3 envs=()
  [ "$arm" = on ] && envs=(FI_MR_CACHE_MAX_COUNT=1024 FI_EFA_MR_CACHE_ENABLE=1)
  env -u FI_MR_CACHE_MAX_COUNT -u FI_EFA_MR_CACHE_ENABLE "${envs[@]}" TE_FABRIC_PROVIDER="$provider" \
    "$bench" register --transport efa --ranks 1 --caps unset --orders given --shape uniform \
    --uniform-count "$count" --uniform-size "$size" --repeat 5 --json 2>/dev/null | grep '^{' |
    while read -r json; do echo "{\"arm\":\"$arm\",\"shape\":\"${count}x$size\",\"result\":$json}"; done >>"$out"
}
for r in $(seq "$rounds"); do
  for arm in off on; do
    run $arm 4096 64KB
    run $arm 1024 1MB
  done
done
python3 - "$out" "$provider" "$rounds" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"provider {sys.argv[2]}, {sys.argv[3]} rounds, each the median of 5 runs (slowest_rank_s)")
for shape in sorted({r["shape"] for r in rows}):
    med = {}
    for arm in ("off", "on"):
        xs = [r["result"]["slowest_rank_s"] for r in rows if r["shape"] == shape and r["arm"] == arm]
        med[arm] = statistics.median(xs)
        print(f"  {shape:10} cache {arm:3}: median {med[arm]*1e3:8.2f} ms  (rounds: {', '.join(f'{x*1e3:.1f}' for x in xs)})")
    print(f"  {shape:10} off/on: {med['off']/med['on']:.3f}")
PY
