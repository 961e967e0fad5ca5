#!/usr/bin/env bash
# Builds the vendored libfabric 2.6 (vendor/libfabric-2.6.0.tar.gz, software providers only) into
# target/libfabric-2.6.0-<sha256 prefix>/ once, and prints that prefix. The tarball's hash is
# checked first; a prefix with a finished-build marker is reused, so a changed tarball (new hash)
# builds anew and an unchanged one costs nothing. Build recipe: vendor/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."

TARBALL=vendor/libfabric-2.6.0.tar.gz
SHA256=9ebdd886b483462bab555c275cedb1aa1ef8603d36aa18aab7c9c89c40e9a4ae

actual=$(sha256sum "$TARBALL" | cut -d' ' -f1)
if [ "$actual" != "$SHA256" ]; then
  echo "libfabric2.sh: $TARBALL has sha256 $actual, expected $SHA256" >&2
  exit 1
fi
PREFIX="$PWD/target/libfabric-2.6.0-${SHA256:0:12}"
if [ -f "$PREFIX/.built" ]; then
  echo "$PREFIX"
  exit 0
fi

BUILD=$(mktemp -d "${TMPDIR:-/tmp}/libfabric2-build.XXXXXX")
trap 'rm -rf "$BUILD"' EXIT
rm -rf "$PREFIX"
tar xzf "$TARBALL" -C "$BUILD"
(
  cd "$BUILD/libfabric-2.6.0"
  ./autogen.sh
  ./configure --prefix="$PREFIX" --disable-efa --disable-verbs --disable-psm2 --disable-psm3 \
    --disable-opx --disable-usnic --disable-cxi --enable-tcp --enable-shm --enable-rxm --enable-sockets
  make -j"$(nproc)"
  make install
) >"$BUILD/log" 2>&1 || { tail -40 "$BUILD/log" >&2; echo "libfabric2.sh: build failed" >&2; exit 1; }
touch "$PREFIX/.built"
echo "$PREFIX"
