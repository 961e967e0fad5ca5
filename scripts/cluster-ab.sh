#!/usr/bin/env bash
# A/B of UMBP's distributed mode between two te-bench binaries (issue 38's check): the layer-wise
# restore over tcp (load time, vs_raw_transfer, wire bytes per delivered byte) and the cluster
# scale run at 4 and 16 peers (puts/s), both arms of each command back to back, the order
# flipping every round. Needs etcd (te-bench starts its own). Prints medians per arm and the
# median of the per-round new/old ratios.
# Usage: scripts/cluster-ab.sh OLD_TE_BENCH NEW_TE_BENCH [ROUNDS] [OUT.jsonl]
# SCALE=0 runs the restore alone.
set -euo pipefail
old=$1 new=$2 rounds=${3:-9} out=${4:-$(mktemp)}
POOLS='c4:30:37440:2/2;c4_indexer:30:8448:2/2;c128:31:1728:0,1,3,5,7,9,11,13,15,17,19,21,23,25,27,29,31,33,35,37,39,41,43,45,47,49,51,53,55,57,59'
run() { # round arm bench args...
  local round=$1 arm=$2 bench=$3; shift 3
  local bin; bin=$([ "$arm" = old ] && echo "$old" || echo "$new")
  local log; log=$(mktemp)
  # A failed run is kept as a row with its last error line, and the rounds go on.
  if ! "$bin" umbp "$@" --json >"$log.out" 2>"$log"; then
    local why; why=$(tail -n 1 "$log" | tr -d '"\\' | cut -c1-300)
    echo "{\"round\":$round,\"arm\":\"$arm\",\"bench\":\"$bench\",\"failed\":\"$why\",\"result\":{}}" >>"$out"
  fi
  grep '^{' "$log.out" |
    while read -r json; do echo "{\"round\":$round,\"arm\":\"$arm\",\"bench\":\"$bench\",\"result\":$json}"; done >>"$out" || true
  rm -f "$log" "$log.out"
}
for r in $(seq "$rounds"); do
  order="old new"; [ $((r % 2)) = 0 ] && order="new old"
  for arm in $order; do
    run "$r" "$arm" restore --distributed --pools "$POOLS" --pages 32 --layer-group 8 --requests 9 \
      --verify --transport tcp --calls-per-group pool
  done
  [ "${SCALE:-1}" = 0 ] && continue
  for arm in $order; do
    run "$r" "$arm" scale --cluster-scale --scale-peers 4,16 --scale-keys 20000 --scale-directory sharded
  done
done
echo "rows: $out"
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
fig = {}  # (figure) -> {arm: {round: value}}
bad = 0
for row in rows:
    r, arm, rnd = row["result"], row["arm"], row["round"]
    bad += r.get("mismatched_bytes", 0) or 0
    if row["bench"] == "restore":
        for k in ("load_ms_p50", "raw_transfer_ms_p50", "vs_raw_transfer", "wire_bytes_per_delivered_byte"):
            if r.get(k) is not None:
                fig.setdefault(f"restore {k}", {}).setdefault(arm, {})[rnd] = r[k]
    elif row["bench"] == "scale" and r.get("puts_per_s") is not None:
        fig.setdefault(f"scale N={r.get('peers')} puts_per_s", {}).setdefault(arm, {})[rnd] = r["puts_per_s"]
print(f"{'figure':<44} {'old':>10} {'new':>10} {'new/old':>8} {'paired':>8}  n")
for name, arms in fig.items():
    o, n = arms.get("old", {}), arms.get("new", {})
    if not o or not n:
        continue
    mo, mn = statistics.median(o.values()), statistics.median(n.values())
    pairs = [n[k] / o[k] for k in o if k in n and o[k]]
    paired = statistics.median(pairs) if pairs else float("nan")
    print(f"{name:<44} {mo:>10.4g} {mn:>10.4g} {mn / mo if mo else 0:>8.3f} {paired:>8.3f}  {len(o)}/{len(n)}")
print(f"mismatched bytes over every run: {bad}")
for row in rows:
    if row.get("failed"):
        print(f"failed: round {row['round']} {row['arm']} {row['bench']}: {row['failed']}")
PY
