#!/usr/bin/env bash
# Two engines in two processes over RDMA on one host: a `te-bench transfer --serve` target and a
# byte-verified `te-bench transfer` initiator, a write run then a read run, each against a fresh
# target (so the read checks the target's own pattern). Each side is DEVICE or DEVICE:MTU, the
# MTU capping that side's path MTU (TE_RDMA_MTU), so the two sides negotiate for real.
# scripts/rdma-vm.sh runs it in its soft-RoCE guest (scripts/test.sh).
#
#   bash scripts/rdma-pair.sh TARGET[:MTU] INITIATOR[:MTU] [BLOCK_BYTES [TOTAL_BYTES]]
#
# te-bench is $TE_BENCH, or te-bench on PATH.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 TARGET[:MTU] INITIATOR[:MTU] [BLOCK_BYTES [TOTAL_BYTES]]" >&2; exit 2; }
block=${3:-1M} total=${4:-16M}
BENCH=${TE_BENCH:-te-bench}
# The environment of one side: TE_RDMA_DEVICES, and TE_RDMA_MTU when the spec names one.
side_env() {
  echo "TE_RDMA_DEVICES=${1%%:*}"
  [[ $1 != *:* ]] || echo "TE_RDMA_MTU=${1#*:}"
}
mapfile -t target_env < <(side_env "$1")
mapfile -t initiator_env < <(side_env "$2")

ready=$(mktemp)
target=""
stop_target() {
  [ -z "$target" ] || { kill "$target" 2>/dev/null || true; wait "$target" 2>/dev/null || true; }
  target=""
}
trap 'stop_target; rm -f "$ready"' EXIT
for op in write read; do
  : >"$ready"
  env "${target_env[@]}" "$BENCH" transfer --serve --transport rdma --listen 127.0.0.1:0 \
    --total-bytes "$total" --block-bytes "$block" >"$ready" &
  target=$!
  for _ in $(seq 1 240); do
    grep -q '^READY ' "$ready" && break
    kill -0 "$target" 2>/dev/null || { echo "rdma-pair: the target (${target_env[*]}) exited before READY" >&2; exit 1; }
    sleep 0.5
  done
  addr=$(sed -n 's/^READY //p' "$ready")
  [ -n "$addr" ] || { echo "rdma-pair: the target (${target_env[*]}) did not start within 120 s" >&2; exit 1; }
  echo "rdma-pair: $op: target (${target_env[*]}) at $addr, initiator (${initiator_env[*]}), $block blocks, $total per repetition, every byte verified"
  env "${initiator_env[@]}" "$BENCH" transfer --transport rdma --peer "$addr" --op "$op" \
    --block-bytes "$block" --total-bytes "$total" --repeat 2 --latency-samples 20 --verify
  stop_target
done
