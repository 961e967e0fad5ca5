#!/usr/bin/env bash
# Runs every test of the workspace. Installs the Debian packages the build and the tests need
# when they are missing (as root, or through sudo), then: rustfmt check, clippy with -D warnings
# on every target and feature, the whole test suite, and a byte-verified smoke run of te-bench.
#
# Tests that need something this host lacks (GPU, RDMA NIC) skip with a message. Set
# TE_REQUIRE=libfabric,etcd,netns (CI does) to turn skips of those into failures.
set -euo pipefail
cd "$(dirname "$0")/.."

# Build-time: libfabric headers (efa transport's C shim), protoc (etcd-client).
# Test-time: libfabric providers and fi_info, etcd, ip (network namespaces), taskset, verbs.h
# and gcc (the rdma ABI layout check compiles a C probe against the system header).
# autoconf automake libtool make: building the vendored libfabric 2.6 (vendor/README.md).
PACKAGES=(libfabric-dev libfabric-bin etcd-server protobuf-compiler libprotobuf-dev pkg-config iproute2 util-linux libibverbs-dev gcc
  autoconf automake libtool make)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "test.sh: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Keep the build within the machine: 2 cores, and debug info that does not balloon the disk.
export CARGO_TERM_COLOR=never
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
export CARGO_PROFILE_TEST_DEBUG=line-tables-only

echo "== cargo fmt --check"
cargo fmt --all --check

echo "== cargo clippy (all targets, all features, -D warnings)"
cargo clippy --workspace --all-targets --all-features -- -D warnings

echo "== cargo test (all features)"
cargo test --workspace --all-features --no-fail-fast

echo "== te-bench smoke: byte-verified local copy"
cargo run --release -q -p te-bench -- local-copy --fragments 512 --repeat 3 --verify
echo "== te-bench smoke: byte-verified two-process transfer with the in-run kernel-copy baseline"
cargo run --release -q -p te-bench -- transfer --transport tcp --block-bytes 64K --total-bytes 1M --batches 2 \
    --repeat 2 --latency-samples 10 --verify --baseline cma
