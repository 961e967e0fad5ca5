#!/usr/bin/env bash
# Instructions per ranged call (valgrind callgrind), key handles on vs off, for the chunked-reader
# shape of `te-bench umbp --standalone`. Instruction counts repeat whatever the host's load, where
# wall time on a shared machine does not. Per arm, a fresh umbp-server under callgrind counts only
# inside its ranged-get handler (--toggle-collect) and the bench client under callgrind only
# inside the client's ranged get. Each arm runs twice, with 1 and with 3 timed passes after the
# warm-up pass (the pass that mints the handles); the difference over the 2 extra passes' calls is
# the steady-state cost of one call, with no warm-up or fill in it.
#
#   scripts/umbp-callgrind.sh KEYS CHUNK RANGES_PER_KEY [OUT_DIR]
# Prints one line per arm and side: instructions per steady-state call.
set -euo pipefail
keys=${1:?keys} chunk=${2:?chunk} rpk=${3:?ranges per key} out=${4:-target/callgrind}
bin=${BIN:-target/release}
mkdir -p "$out"
dram=$(( (keys * rpk * 64 * 2 + (64 << 20)) / 4096 * 4096 ))
chunks=$(( (keys + chunk - 1) / chunk ))
ir() { grep -m1 -E '^(totals|summary):' "$1" | awk '{print $2}'; }
for arm in on off; do
  for passes in 1 3; do
    dir=$(mktemp -d)
    sock="$dir/umbp.sock"
    valgrind --tool=callgrind --callgrind-out-file="$out/server-$arm-$passes.out" \
      --toggle-collect='*standalone::server::get_ranges*' \
      "$bin/umbp-server" --socket "$sock" --dram "$dram" 2>"$dir/server.log" &
    pid=$!
    for _ in $(seq 600); do [ -S "$sock" ] && break; sleep 0.1; done
    valgrind --tool=callgrind --callgrind-out-file="$out/client-$arm-$passes.out" \
      --toggle-collect='*standalone::client::Client::get_ranges*' \
      "$bin/te-bench" umbp --standalone --socket "$sock" --keys "$keys" --chunk "$chunk" \
      --ranges-per-key "$rpk" --threads 1 --reps 1 --passes "$passes" --key-handles "$arm" --json \
      >"$dir/bench.json" 2>"$dir/client.log"
    kill -TERM "$pid"
    wait "$pid" || true
    rm -rf "$dir"
  done
  for side in server client; do
    a=$(ir "$out/$side-$arm-1.out"); b=$(ir "$out/$side-$arm-3.out")
    echo "$side key_handles=$arm keys=$keys chunk=$chunk ranges_per_key=$rpk instructions_per_call=$(( (b - a) / (2 * chunks) ))"
  done
done
