#!/usr/bin/env bash
# A/B of `te-bench umbp` in its three modes between two builds, each invocation alternating old
# and new so drift of the machine hits both alike. OLD_DIR and NEW_DIR each hold a te-bench and
# the umbp-server it starts in standalone mode. Prints the median of each arm per figure.
# Usage: scripts/umbp-ab.sh OLD_DIR NEW_DIR [ROUNDS]
set -euo pipefail
old=$1 new=$2 rounds=${3:-5}
out=$(mktemp)
POOLS='c4:30:37440:2/2;c4_indexer:30:8448:2/2;c128:31:1728:0,1,3,5,7,9,11,13,15,17,19,21,23,25,27,29,31,33,35,37,39,41,43,45,47,49,51,53,55,57,59'
run() { # arm bench dir args...
  local arm=$1 bench=$2 dir=$3; shift 3
  UMBP_SERVER_BIN="$dir/umbp-server" "$dir/te-bench" umbp "$@" --json 2>/dev/null | grep '^{' |
    while read -r json; do echo "{\"arm\":\"$arm\",\"bench\":\"$bench\",\"result\":$json}"; done >>"$out"
}
for r in $(seq "$rounds"); do
  # The order flips every round, so a position effect (the first arm warming caches and
  # frequencies for the second) hits both arms alike.
  order="old new"; [ $((r % 2)) = 0 ] && order="new old"
  for arm in $order; do
    dir=$([ $arm = old ] && echo "$old" || echo "$new")
    run $arm local-dram "$dir" --pages 32 --layer-group 8 --ranks 1 --requests 9 --verify
    run $arm standalone-reader "$dir" --standalone --keys 8192 --chunk 1024 --ranges-per-key 8 --threads 1 --reps 5 --verify
    run $arm distributed-tcp "$dir" --distributed --pools "$POOLS" --pages 32 --layer-group 8 --requests 9 --verify --transport tcp
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def figures(bench, r):
    if bench == "standalone-reader":
        return [(f"call us p50 (key handles {r.get('key_handles')})", r.get("call_us_p50"))]
    if "load_ms_p50" in r:
        return [("load ms p50", r["load_ms_p50"])]
    return []
table = {}
bad = 0
for row in rows:
    r = row["result"]
    bad += r.get("mismatched_bytes", 0) or 0
    for name, v in figures(row["bench"], r):
        if v is not None:
            table.setdefault((row["bench"], name), {}).setdefault(row["arm"], []).append(v)
print(f"{'bench':<20} {'figure (lower is better)':<36} {'old':>9} {'new':>9} {'new/old':>8}  n")
for (bench, name), arms in table.items():
    o, n = statistics.median(arms.get("old", [0])), statistics.median(arms.get("new", [0]))
    print(f"{bench:<20} {name:<36} {o:>9.3f} {n:>9.3f} {n / o if o else 0:>8.3f}  {len(arms.get('old', []))}/{len(arms.get('new', []))}")
print(f"mismatched bytes over every run: {bad}")
PY
