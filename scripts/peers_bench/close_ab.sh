#!/bin/bash
# Deregistering the source right after a killed peer, two builds of our wheel side by side
# (issue 40 item 1): ROUNDS interleaved rounds of kill.py --engine ours --no-next over tcp and
# over shm,tcp, each build in its own venv (numpy + the wheel). One JSON line per run on stdout,
# tagged with the arm and the load.
#   scripts/peers_bench/close_ab.sh ROUNDS VENV_A VENV_B > ab.jsonl
set -u
cd "$(dirname "$0")/../.."
S=scripts/peers_bench/kill.py
for r in $(seq 0 $(($1-1))); do
  for t in tcp shm,tcp; do
    after=0.2; [ "$t" = tcp ] || after=0.05
    for arm in a b; do
      venv=$2; [ $arm = b ] && venv=$3
      out=$(timeout 120 "$venv/bin/python" $S --engine ours --no-next --ours-transports $t --kill-after $after --round "$r" 2>/dev/null)
      echo "$out" | grep '^{' | sed "s|^{|{\"arm\": \"$arm\", \"venv\": \"$venv\", \"load\": \"$(cut -d' ' -f1 /proc/loadavg)\", |"
    done
  done
done
