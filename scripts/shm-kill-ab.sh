#!/bin/bash
# Kill to error on the shm route, two builds side by side (issue 40, "a peer that dies"): ROUNDS
# interleaved rounds (old, new, old, new...) of transports/shm/examples/kill_to_error.rs, each a
# 1 GiB write batch of 1 MiB requests to a target process SIGKILLed once an eighth of it landed;
# one JSON line per round tagged with its arm, then the median per arm.
#   scripts/shm-kill-ab.sh ROUNDS OLD_BIN NEW_BIN [PAGES] > ab.jsonl
# OLD_BIN / NEW_BIN: `cargo build -p te-transport-shm --example kill_to_error` of each commit,
# copied aside. PAGES: thp (default, as numpy's buffers) or 4k.
set -eu
rounds=$1 old=$2 new=$3 pages=${4:-thp}
rows=$(mktemp)
trap 'rm -f "$rows"' EXIT
for r in $(seq 0 $((rounds - 1))); do
  for arm in old new; do
    bin=$old; [ $arm = new ] && bin=$new
    line=$(timeout 300 "$bin" 1 $((1 << 30)) shm,tcp "$pages")
    echo "{\"arm\":\"$arm\",\"round_of_ab\":$r,\"load\":\"$(cut -d' ' -f1 /proc/loadavg)\",${line#\{}" | tee -a "$rows"
  done
done
python3 - "$rows" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for arm in ("old", "new"):
    xs = [r["kill_to_error_s"] for r in rows if r["arm"] == arm]
    print(json.dumps({"arm": arm, "rounds": len(xs), "median_kill_to_error_s": statistics.median(xs),
                      "min_s": min(xs), "max_s": max(xs)}))
PY
