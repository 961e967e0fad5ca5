#!/usr/bin/env bash
# GPU check: runs on an NVIDIA GPU host from a bundle made by scripts/gpu-bundle.sh (prebuilt x86-64
# binaries; the host needs only the driver, no Rust and no network). A few minutes at most.
#
#   bash gpu-check.sh            # from the bundle directory (or give its path)
#
# Steps: (1) what the host has; (2) the CUDA plugin's tests and the local transport's GPU tests
# (device copies through the transport and through the engine) with TE_REQUIRE=cuda, so a missing
# GPU fails instead of skipping; (3) the PCI bus id the plugin reports for the last GPU made visible
# alone through CUDA_VISIBLE_DEVICES, against nvidia-smi's (a wrong id sends traffic to the wrong
# NIC); (4) `te-bench local-copy --location cuda --verify --json` (h2d, d2h, d2d; with and without
# cuMemcpyBatchAsync) and the host figure for reference, when this te-bench has --location.
# Logs and JSON go to $OUT (or <bundle>/results), six files at most: host.txt, gpu-tests.log,
# bus-id-visible.log, local-copy.jsonl, local-copy.stderr, summary.txt.
# Exit status: number of failed steps.
set -u

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-$here/results}
mkdir -p "$out"
failures=0
summary=()

step() { printf '\n== %s\n' "$*"; }
record() { # record NAME RC
    if [ "$2" -eq 0 ]; then summary+=("PASS $1"); else summary+=("FAIL $1 (rc $2)"); failures=$((failures + 1)); fi
}
normalize_bus_id() { # 00000000:1B:00.0 -> 0000:1b:00.0
    tr 'A-F' 'a-f' | sed -E 's/^0*([0-9a-f]{4}):/\1:/'
}

step "host"
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    uname -a
    ldd --version 2>&1 | head -1
    grep '^requires' "$here/MANIFEST" 2>/dev/null
    grep '^commit' "$here/MANIFEST" 2>/dev/null
    echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}"
    nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,memory.total --format=csv 2>&1
    nvidia-smi topo -m 2>&1 | head -20
} 2>&1 | tee "$out/host.txt"

step "CUDA plugin and local transport GPU tests (TE_REQUIRE=cuda)"
# One log for all of them: the device tool brings back at most 8 files from $OUT.
: >"$out/gpu-tests.log"
for bin in "$here"/bin/te-plugin-cuda-* "$here"/bin/te-transport-local-*; do
    [ -x "$bin" ] || continue
    name=$(basename "$bin")
    echo "-- $name" | tee -a "$out/gpu-tests.log"
    TE_REQUIRE=cuda timeout 180 "$bin" --test-threads=1 --nocapture 2>&1 | tee -a "$out/gpu-tests.log"
    record "$name" "${PIPESTATUS[0]}"
done
for want in te-plugin-cuda te-transport-local; do
    if ! ls "$here"/bin/"$want"-* >/dev/null 2>&1; then
        echo "no $want test executables in $here/bin: rebuild the bundle"
        record "$want tests present" 1
    fi
done

step "PCI bus id under CUDA_VISIBLE_DEVICES"
gpu_bin="$here/bin/te-plugin-cuda-gpu"
count=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
if [ -x "$gpu_bin" ] && [ "$count" -gt 0 ]; then
    last=$((count - 1))
    want=$(nvidia-smi -i "$last" --query-gpu=pci.bus_id --format=csv,noheader | normalize_bus_id)
    # nvidia-smi numbers GPUs in PCI order; make CUDA do the same so both name the same device.
    got=$(CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=$last TE_REQUIRE=cuda timeout 60 \
        "$gpu_bin" bus_ids --test-threads=1 --nocapture 2>&1 | tee "$out/bus-id-visible.log" |
        sed -nE 's/.*cuda:0 at ([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]).*/\1/p' | head -1)
    echo "GPU $last alone: nvidia-smi says '$want', the plugin says cuda:0 at '$got'"
    [ -n "$got" ] && [ "$got" = "$want" ]
    record "bus id of GPU $last as cuda:0" $?
else
    echo "skipped: no GPU test executable or nvidia-smi sees no GPU"
    record "bus id check ran" 1
fi

step "te-bench local-copy --location cuda"
bench="$here/te-bench"
if [ -x "$bench" ] && "$bench" local-copy --help 2>/dev/null | grep -q -- '--location'; then
    : >"$out/local-copy.jsonl"
    : >"$out/local-copy.stderr"
    # 64 MiB per buffer by default (38,836 fragments of 1,728 B): past the last-level cache, and
    # the per-fragment cuMemcpy baseline stays well under a minute per direction.
    bench_run() { # bench_run LABEL TIMEOUT ARGS...
        local label=$1 limit=$2
        shift 2
        echo "-- te-bench local-copy $*" | tee -a "$out/local-copy.stderr"
        timeout "$limit" "$bench" local-copy --json "$@" >>"$out/local-copy.jsonl" 2>>"$out/local-copy.stderr"
        record "$label" $?
    }
    bench_run "te-bench local-copy --location cuda --verify (h2d, d2h, d2d)" 240 \
        --location cuda --direction all --verify --repeat 7
    bench_run "te-bench local-copy --location cuda --no-batch-memcpy --verify" 120 \
        --location cuda --direction all --no-batch-memcpy --verify --repeat 5 --fragment-bytes 1728
    bench_run "te-bench local-copy --location host (reference)" 60 --location host --repeat 7
    cat "$out/local-copy.jsonl"
    tail -20 "$out/local-copy.stderr"
else
    echo "skipped: this te-bench has no 'local-copy --location' (rebuild the bundle once it is wired)"
    summary+=("SKIP te-bench local-copy --location cuda")
fi

step "summary"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit "$failures"
