#!/usr/bin/env bash
# The shm transport against the kernel's process_vm_writev loop and a memcpy loop, in one run per
# shape (te-bench transfer --baseline cma --also-baseline memcpy: each of our runs is followed by
# one run of each baseline, median of --repeat), two processes, byte-verified; then tcp on the
# same shapes for comparison. Block sizes 64K..4M as one 64 MiB batch; the KV fragment shapes of
# DeepSeek-V4-Pro's pools (1,728 / 8,448 / 37,440 B) as one batch of scattered fragments (remote
# slots permuted so nothing coalesces; the baselines use the same slots).
#
#   scripts/shm-bench.sh [OUT.jsonl]       (default target/shm-bench.jsonl)
#
# Needs a release te-bench: cargo build --release -p te-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/shm-bench.jsonl}
bench=${BENCH:-target/release/te-bench}
repeat=${REPEAT:-7}
: >"$out"
for transport in shm tcp; do
  "$bench" transfer --transport "$transport" --block-sizes 64K,256K,1M,4M --total-bytes 64M \
    --verify --baseline cma --also-baseline memcpy --repeat "$repeat" --latency-samples 200 --json >>"$out"
  for frag in 1728:9216 8448:2048 37440:512; do
    size=${frag%%:*}
    count=${frag##*:}
    "$bench" transfer --transport "$transport" --block-bytes "$size" --total-bytes $((size * count)) --scatter \
      --verify --baseline cma --also-baseline memcpy --repeat "$repeat" --latency-samples 200 --json >>"$out"
  done
done
python3 - "$out" <<'PY'
import json, sys
print(f"{'transport':>9} {'block':>8} {'GB/s':>7} {'cma':>7} {'memcpy':>7} {'/cma':>6} {'/best':>6} {'ns/req':>8} {'cma ns':>8} {'memcpy ns':>9} {'mismatch':>8}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    b, a = r["baseline"], r["baseline_also"]
    print(f"{r['transport']:>9} {r['block_bytes']:>8} {r['gbps']:>7.3f} {b['gbps']:>7.3f} {a['gbps']:>7.3f} "
          f"{r['ratio_gbps_paired']:>6.2f} {r['ratio_gbps_best']:>6.2f} {r['ns_per_request']:>8.0f} "
          f"{b['ns_per_request']:>8.0f} {a['ns_per_request']:>9.0f} {r['mismatched_bytes']:>8}")
PY
