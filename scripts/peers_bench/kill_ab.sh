#!/bin/bash
# The same-host killed-peer A/B of docs/PERFORMANCE.md (peers section): ROUNDS interleaved rounds
# of a 1 GiB write (1 MiB requests) whose target is SIGKILLed 0.02 s in, ours over shm as
# configured by default (chunks of 1 MiB shared with the copy threads), ours with
# TE_SHM_INLINE_BYTES=2G (the submitting thread copies the batch, calls of up to 64 MiB), and
# NIXL's UCX default path; one JSON line per run on stdout, tagged with the arm.
#   scripts/peers_bench/kill_ab.sh ROUNDS > ab.jsonl
# P (default target/peers-venv/bin/python; scripts/peers-bench.sh makes it) picks the Python
# whose `te` is measured; ARMS (default "handoff inline nixl") picks the arms.
set -u
[ $# -ge 1 ] || { echo "usage: $0 ROUNDS > ab.jsonl" >&2; exit 2; }
cd "$(dirname "$0")/../.."
P=${P:-target/peers-venv/bin/python}; K=scripts/peers_bench/kill.py
common=(--round 0 --bytes 1G --kill-after 0.02 --restart-limit 5)
for r in $(seq 0 $(($1-1))); do
  common[1]=$r
  for arm in ${ARMS:-handoff inline nixl}; do
    case $arm in
      handoff) out=$(timeout 300 $P $K --engine ours --ours-transports shm,tcp "${common[@]}" 2>/dev/null);;
      inline) out=$(TE_SHM_INLINE_BYTES=2G timeout 300 $P $K --engine ours --ours-transports shm,tcp "${common[@]}" 2>/dev/null);;
      nixl) out=$(env -u UCX_TLS timeout 300 $P $K --engine nixl "${common[@]}" 2>/dev/null);;
      *) echo "kill_ab.sh: unknown arm '$arm' (handoff, inline, nixl)" >&2; exit 2;;
    esac
    [ -n "$out" ] || echo "{\"arm\": \"$arm\", \"round\": $r, \"error\": \"kill.py printed no row\"}"
    echo "$out" | grep '^{' | sed "s/^{/{\"arm\": \"$arm\", /"
  done
done
