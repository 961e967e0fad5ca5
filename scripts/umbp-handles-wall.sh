#!/usr/bin/env bash
# Wall time of key handles on vs off (issue #14), for the two chunked-reader shapes of
# `te-bench umbp --standalone`: ROUNDS invocations of each shape per binary, the binaries and
# shapes interleaved so drift of this machine's speed hits all alike. Each invocation alternates
# the arms itself (median of REPS repetitions each); its figure is on/off of those medians.
# Prints every invocation's ratio, then per binary and shape the median, quartiles and range.
#
#   scripts/umbp-handles-wall.sh ROUNDS REPS TE_BENCH [TE_BENCH ...]
# Each te-bench starts the umbp-server beside it.
set -euo pipefail
rounds=${1:?rounds} reps=${2:?reps}
shift 2
bins=("$@")
out=$(mktemp)
for _ in $(seq "$rounds"); do
  for bin in "${bins[@]}"; do
    for shape in "512 1" "1024 8"; do
      read -r chunk rpk <<<"$shape"
      "$bin" umbp --standalone --keys 8192 --chunk "$chunk" --ranges-per-key "$rpk" --threads 1 \
        --reps "$reps" --json 2>/dev/null | grep '^{' |
        sed "s|^|{\"bin\":\"$bin\",\"row\":|; s|\$|}|" >>"$out"
    done
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
arms = {}
for line in open(sys.argv[1]):
    j = json.loads(line)
    r = j["row"]
    arms.setdefault((j["bin"], r["chunk"], r["ranges_per_key"]), []).append(r)
for (bin, chunk, rpk), rows in arms.items():
    # Rows come in pairs, one invocation's "on" and "off".
    by_call = [rows[i:i + 2] for i in range(0, len(rows), 2)]
    ratios = []
    for pair in by_call:
        p = {r["key_handles"]: r["call_us_p50"] for r in pair}
        ratios.append(p["on"] / p["off"])
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"{bin} chunk={chunk} ranges_per_key={rpk}: " + " ".join(f"{x:.3f}" for x in ratios))
    print(f"  n={len(ratios)} median={statistics.median(ratios):.3f} q1={q[0]:.3f} q3={q[2]:.3f} "
          f"min={min(ratios):.3f} max={max(ratios):.3f}")
PY
rm -f "$out"
