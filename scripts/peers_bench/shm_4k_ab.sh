#!/bin/bash
# The 4 KiB same-host A/B of docs/PERFORMANCE.md (peers section): Python rows, 4K:16M write and
# read, ROUNDS interleaved rounds of ours on shm as configured by default (batches above
# TE_SHM_INLINE_BYTES handed to copy threads, which the submitting thread helps), ours with
# TE_SHM_INLINE_BYTES=16M (the submitting thread copies the batch) and NIXL's prepared path; one
# JSON line per row on stdout, tagged with the arm, busy or quiet, and the load. Needs
# target/peers-venv (scripts/peers-bench.sh makes it).
#   scripts/peers_bench/shm_4k_ab.sh ROUNDS [busy] > ab.jsonl
# With `busy`, each round runs the arms twice: quiet, then with one busy loop per core
# (`taskset -c N yes > /dev/null`, started before the arms and ended after them) beside them.
# ARMS (default "ours2 inline nixl-prep") picks the arms; `ct1` is ours with one copy thread
# (TE_SHM_COPY_THREADS=1).
set -u
cd "$(dirname "$0")/../.."
P=target/peers-venv/bin/python; S=scripts/peers_bench/p2p.py
modes=quiet; [ "${2:-}" = busy ] && modes="quiet busy"
spinners=()
stop_spinners() {
  for p in "${spinners[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  spinners=()
}
trap stop_spinners EXIT
for r in $(seq 0 $(($1-1))); do
  for mode in $modes; do
    if [ "$mode" = busy ]; then
      for c in $(seq 0 $(($(nproc)-1))); do taskset -c "$c" yes >/dev/null & spinners+=($!); done
    fi
    for arm in ${ARMS:-ours2 inline nixl-prep}; do
      case $arm in
        ct1) out=$(TE_SHM_COPY_THREADS=1 timeout 300 $P $S --engine ours --ours-transports shm,tcp --shapes 4K:16M --ops write,read --repeat 3 --round $r 2>/dev/null);;
        ours2) out=$(timeout 300 $P $S --engine ours --ours-transports shm,tcp --shapes 4K:16M --ops write,read --repeat 3 --round $r 2>/dev/null);;
        inline) out=$(TE_SHM_INLINE_BYTES=16M timeout 300 $P $S --engine ours --ours-transports shm,tcp --shapes 4K:16M --ops write,read --repeat 3 --round $r 2>/dev/null);;
        nixl-prep) out=$(env -u UCX_TLS timeout 300 $P $S --engine nixl-prep --shapes 4K:16M --ops write,read --repeat 3 --round $r 2>/dev/null);;
      esac
      echo "$out" | grep '^{' | sed "s/^{/{\"arm\": \"$arm\", \"mode\": \"$mode\", \"load\": \"$(cut -d' ' -f1 /proc/loadavg)\", /"
    done
    stop_spinners
  done
done
