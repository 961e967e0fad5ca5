#!/usr/bin/env bash
# A/B of two te-bench binaries in one run (issue #17: "the benchmarks must not move"): the
# local-copy, tcp transfer and umbp benchmarks, each invocation alternating old and new so drift
# of this machine's speed hits both alike. Prints one JSON line per invocation (arm, bench, figure)
# and the median of each arm. Usage: scripts/ab-bench.sh OLD_TE_BENCH NEW_TE_BENCH [ROUNDS]
set -euo pipefail
old=$1 new=$2 rounds=${3:-3}
out=$(mktemp)
run() { # arm bench binary args...
  local arm=$1 bench=$2 bin=$3; shift 3
  local json
  json=$("$bin" "$@" --json 2>/dev/null | tail -n 1)
  echo "{\"arm\":\"$arm\",\"bench\":\"$bench\",\"result\":$json}" | tee -a "$out" >/dev/null
}
for r in $(seq "$rounds"); do
  # The order flips every round, so a position effect (the first arm warming caches and
  # frequencies for the second) hits both arms alike.
  order="old new"; [ $((r % 2)) = 0 ] && order="new old"
  for arm in $order; do
    bin=$([ $arm = old ] && echo "$old" || echo "$new")
    run $arm local-copy-1728-cache "$bin" local-copy --fragments 2048 --fragment-bytes 1728 --repeat 11
    run $arm local-copy-1728-dram "$bin" local-copy --fragment-bytes 1728 --repeat 5
    run $arm tcp-write-1M "$bin" transfer --transport tcp --op write --block-bytes 1M --total-bytes 256M --lanes 1 --repeat 5
    run $arm tcp-write-4K "$bin" transfer --transport tcp --op write --block-bytes 4K --total-bytes 8M --lanes 1 --repeat 5
    run $arm umbp-restore "$bin" umbp --pages 32 --layer-group 8 --ranks 1 --requests 9
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def figure(bench, r):
    if bench.startswith("local-copy"):
        return ("engine/memcpy-loop (higher is better)", r["ratio_vs_memcpy_loop"])
    if bench == "tcp-write-4K":
        return ("p50 latency us (lower is better)", r["p50_us"])
    if bench.startswith("tcp"):
        return ("GB/s", r["gbps"])
    return ("load ms p50 (lower is better)", r["load_ms_p50"])
table = {}
for row in rows:
    name, v = figure(row["bench"], row["result"])
    table.setdefault((row["bench"], name), {}).setdefault(row["arm"], []).append(v)
for (bench, name), arms in table.items():
    o, n = statistics.median(arms["old"]), statistics.median(arms["new"])
    print(f"{bench:24} {name:40} old {o:9.3f}  new {n:9.3f}  new/old {n/o:5.3f}  (old {['%.3f'%x for x in arms['old']]}, new {['%.3f'%x for x in arms['new']]})")
PY
