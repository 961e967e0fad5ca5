#!/usr/bin/env bash
# The `te-transfer-engine` wheel as users get it: built with `maturin build --zig` (links against
# glibc 2.28, so pip takes it on RHEL 8, Debian 10+, Ubuntu 18.10+), stripped; `auditwheel show`
# must report the manylinux_2_28 tag; then installed alone into a clean venv of every CPython
# 3.11+ found here (this machine's python3, and pyenv's 3.12 / 3.13 when present), where it runs a
# two-process transfer, an efa transfer on libfabric's tcp;ofi_rxm provider (libfabric opened at
# run time) and a store put/get (python/tests/wheel_smoke.py), and `umbp-server --help`.
#
# `--release` builds the release profile (what is published); the default dev profile shares the
# build with scripts/python-tests.sh and checks the same packaging.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=()
[ "${1:-}" = --release ] && profile=(--release)
tools=target/py-wheel-tools
if [ ! -x "$tools/bin/maturin" ] || [ ! -x "$tools/bin/auditwheel" ] || [ ! -x "$tools/bin/python-zig" ]; then
  echo "== wheel: tools (maturin, ziglang, auditwheel) into $tools"
  python3 -m venv "$tools"
  "$tools/bin/python" -m pip install -q maturin ziglang auditwheel
  # maturin --zig runs `python-zig`, or `python -m ziglang` of the python it finds on PATH.
  printf '#!/bin/sh\nexec "%s/bin/python" -m ziglang "$@"\n' "$PWD/$tools" >"$tools/bin/python-zig"
  chmod +x "$tools/bin/python-zig"
fi
out=target/wheels
rm -rf "$out"
echo "== wheel: maturin build --zig ${profile[*]:-(dev profile)}"
PATH="$PWD/$tools/bin:$PATH" maturin build -q --zig --compatibility manylinux_2_28 -m python/Cargo.toml -i python3 \
  -o "$out" "${profile[@]}"
wheel=$(ls "$out"/*.whl)
echo "$wheel: $(du -h "$wheel" | cut -f1)"
shown=$("$tools/bin/auditwheel" show "$wheel")
echo "$shown"
grep -q 'manylinux_2_28_x86_64' <<<"$shown" || { echo "python-wheel.sh: $wheel is not manylinux_2_28" >&2; exit 1; }
case "$wheel" in *manylinux_2_28*) ;; *) echo "python-wheel.sh: $wheel is not tagged manylinux_2_28" >&2; exit 1 ;; esac

pythons=(python3)
for v in 3.12 3.13; do
  p=$(ls -d /root/.pyenv/versions/$v.*/bin/python3 2>/dev/null | tail -1 || true)
  if [ -n "$p" ]; then pythons+=("$p"); else echo "== wheel: no CPython $v here (pyenv), not tried"; fi
done
for py in "${pythons[@]}"; do
  venv=$(mktemp -d)/venv
  "$py" -m venv "$venv"
  echo "== wheel: $("$venv/bin/python" -V) in a clean venv: pip install $wheel (numpy from its dependencies)"
  "$venv/bin/python" -m pip install -q "$wheel"
  (cd "$(dirname "$venv")" && "$venv/bin/python" "$OLDPWD/python/tests/wheel_smoke.py")
  "$venv/bin/umbp-server" --help >/dev/null
  rm -rf "$(dirname "$venv")"
done
echo "== wheel: ok"
