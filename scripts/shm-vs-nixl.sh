#!/usr/bin/env bash
# te-bench transfer --transport shm (with its in-run cma and memcpy loop baselines) and NIXL's
# released wheel (UCX, default transports) between two processes on this host, on the same
# shapes, rounds interleaved (ours, then NIXL, ROUNDS times); per shape the median over rounds of
# each round's median. Both byte-verified.
#
#   scripts/shm-vs-nixl.sh [OUT_DIR]        (default target/shm-vs-nixl)
#
# Needs a release te-bench (or BENCH=path) and the NIXL venv (see scripts/nixl-same-host.py).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-target/shm-vs-nixl}
rounds=${ROUNDS:-5}
repeat=${REPEAT:-3}
bench=${BENCH:-target/release/te-bench}
py=target/nixl-venv/bin/python
mkdir -p "$dir"
: >"$dir/ours.jsonl"
: >"$dir/nixl.jsonl"
for round in $(seq "$rounds"); do
  "$bench" transfer --transport shm --block-sizes 64K,256K,1M,4M --total-bytes 64M --verify \
    --baseline cma --also-baseline memcpy --repeat "$repeat" --latency-samples 50 --json >>"$dir/ours.jsonl"
  for frag in 1728:9216 8448:2048 37440:512; do
    size=${frag%%:*}
    count=${frag##*:}
    "$bench" transfer --transport shm --block-bytes "$size" --total-bytes $((size * count)) --scatter --verify \
      --baseline cma --also-baseline memcpy --repeat "$repeat" --latency-samples 50 --json >>"$dir/ours.jsonl"
  done
  # The wheel has been seen to crash at interpreter exit, after its rows were printed; a round
  # that printed no row shows up as a missing NIXL figure below.
  "$py" scripts/nixl-same-host.py --repeat "$repeat" 2>>"$dir/nixl.err" >>"$dir/nixl.jsonl" ||
    echo "round $round: nixl-same-host.py exited with $?" >&2
  echo "round $round done, $(uptime)" >&2
done
python3 - "$dir" <<'PY'
import json, statistics, sys
d = sys.argv[1]
ours, nixl = {}, {}
for line in open(f"{d}/ours.jsonl"):
    r = json.loads(line)
    ours.setdefault(r["block_bytes"], []).append(r)
for line in open(f"{d}/nixl.jsonl"):
    if not line.startswith("{"):
        continue  # NIXL's own log lines
    r = json.loads(line)
    nixl.setdefault(r["block_bytes"], []).append(r)
med = statistics.median
print(f"{'block':>8} {'shm':>7} {'cma':>7} {'memcpy':>7} {'nixl':>7} {'/cma':>6} {'/best':>6} {'/nixl':>6} "
      f"{'shm ns':>9} {'cma ns':>9} {'memcpy ns':>9} {'nixl ns':>9} {'bad':>4}")
for block in sorted(ours, key=lambda b: (b % 4096 == 0, b)):
    o = ours[block]
    n = nixl.get(block, [])
    g = med(r["gbps"] for r in o)
    c = med(r["baseline"]["gbps"] for r in o)
    m = med(r["baseline_also"]["gbps"] for r in o)
    x = med(r["gbps"] for r in n) if n else float("nan")
    bad = sum(r["mismatched_bytes"] for r in o) + sum(r["mismatched_bytes"] for r in n)
    print(f"{block:>8} {g:>7.3f} {c:>7.3f} {m:>7.3f} {x:>7.3f} {med(r['ratio_gbps_paired'] for r in o):>6.2f} "
          f"{med(r['ratio_gbps_best'] for r in o):>6.2f} {g / x:>6.2f} {block / g:>9.0f} {block / c:>9.0f} "
          f"{block / m:>9.0f} {block / x:>9.0f} {bad:>4}")
PY
