#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs on a GPU machine (no Rust toolchain, no network there) and
# collects it in one directory: the CUDA plugin's test executables, the local transport's GPU test
# executable, a release te-bench (with its cuda feature: local-copy --location cuda), the check
# script and a manifest. Ship the directory and run `bash <dir>/gpu-check.sh` on the GPU host.
#
#   scripts/gpu-bundle.sh [DEST]        # DEST defaults to target/gpu-bundle
#
# Environment: TE_BENCH_FEATURES (default "cuda"): cargo features for te-bench; when te-bench has
# none of them yet, it is built without and the manifest says so.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dest=${1:-target/gpu-bundle}
features=${TE_BENCH_FEATURES-cuda}

rm -rf "$dest"
mkdir -p "$dest/bin"

# Copies the test executables of a release `cargo test --no-run` build into $dest/bin, named
# <prefix>-<target> ("unit" for the library's own tests); only the targets listed, or all.
bundle_tests() { # bundle_tests PACKAGE PREFIX [TARGET...]
    local package=$1 prefix=$2
    shift 2
    cargo test -p "$package" --release --no-run --message-format=json-render-diagnostics >"$dest/build-tests.json"
    python3 - "$dest" "$prefix" "$@" <<'EOF'
import json, shutil, sys, os
dest, prefix, wanted = sys.argv[1], sys.argv[2], set(sys.argv[3:])
for line in open(os.path.join(dest, "build-tests.json")):
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable") or not msg["profile"]["test"]:
        continue
    target = msg["target"]
    name = "unit" if "lib" in target["kind"] else target["name"]
    if wanted and name not in wanted:
        continue
    out = os.path.join(dest, "bin", f"{prefix}-{name}")
    shutil.copy2(msg["executable"], out)
    print(f"   {out}")
EOF
    rm -f "$dest/build-tests.json"
}

echo "== building the CUDA plugin's tests (release)"
# One executable per test target: the unit tests ("unit"), tests/gpu.rs, tests/no_driver.rs.
bundle_tests te-plugin-cuda te-plugin-cuda

echo "== building the local transport's GPU tests (release)"
# tests/gpu.rs only: device copies through the transport with the CUDA plugin and through the
# engine (te-core with the local transport and the cuda feature).
bundle_tests te-transport-local te-transport-local gpu

echo "== building te-bench (release)"
bench_features=""
if [ -n "$features" ]; then
    known=$(cargo metadata --no-deps --format-version 1 |
        python3 -c 'import json,sys; m=json.load(sys.stdin); print(" ".join(next(p for p in m["packages"] if p["name"]=="te-bench")["features"]))')
    for f in ${features//,/ }; do
        if [[ " $known " == *" $f "* ]]; then bench_features+="$f,"; fi
    done
    bench_features=${bench_features%,}
fi
bench_args=(-p te-bench --release)
if [ -n "$bench_features" ]; then
    bench_args+=(--features "$bench_features")
else
    echo "   te-bench has none of the features '$features' yet: building it without"
fi
# The plugin tests are worth shipping on their own, so a te-bench that does not build is reported,
# not fatal.
if cargo build "${bench_args[@]}"; then
    cp target/release/te-bench "$dest/te-bench"
    bench_status="built with features: ${bench_features:-none}"
else
    bench_status="NOT INCLUDED: cargo build ${bench_args[*]} failed"
    echo "   te-bench $bench_status"
fi

cp scripts/gpu-check.sh "$dest/gpu-check.sh"
chmod +x "$dest"/gpu-check.sh "$dest"/bin/*
# Debug info is not needed there and the device machine's transfer limit is 64 MiB.
binaries=("$dest"/bin/*)
[ -f "$dest/te-bench" ] && binaries+=("$dest/te-bench")
strip --strip-debug "${binaries[@]}"

# The newest glibc symbol version any binary needs: the GPU host's glibc must be at least that.
glibc=$(objdump -T "${binaries[@]}" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
{
    echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(rustc -V)"
    echo "te-bench: $bench_status"
    echo "requires: ${glibc} or newer (ldd --version), an NVIDIA driver (libcuda.so.1); no CUDA toolkit"
    echo "files:"
    (cd "$dest" && find . -type f ! -name MANIFEST | sort | xargs ls -l | awk '{print "  " $5 "  " $9}')
} >"$dest/MANIFEST"
cat "$dest/MANIFEST"
echo "== bundle ready: $dest ($(du -sh "$dest" | cut -f1)); run: bash $dest/gpu-check.sh"
