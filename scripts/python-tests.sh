#!/usr/bin/env bash
# The `te` Python package (python/): a virtual environment under target/py-venv (maturin, numpy,
# pytest and pytest-timeout from PyPI, installed only when missing), the extension built once into it with
# `maturin develop` (dev profile; the wheel's default features: no efa, so no libfabric is
# linked), then the pytest suite under python/tests, which also runs the README's Python examples
# and a byte-verified smoke run of the benchmark. The suite starts its own etcd (TE_ETCD_BIN) and
# umbp servers; TE_REQUIRE=etcd turns the distributed test's skip into a failure.
#
# `--release` builds the release profile instead (for `python -m te.bench`); extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=()
if [ "${1:-}" = --release ]; then
  profile=(--release)
  shift
fi
venv=target/py-venv
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  echo "== python: creating $venv"
  "$python" -m venv "$venv"
fi
missing=()
for pkg in maturin numpy pytest pytest-timeout; do
  "$venv/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== python: installing ${missing[*]} into $venv"
  "$venv/bin/python" -m pip install -q "${missing[@]}"
fi
# The released Mooncake wheel, the oracle of te.compat's differential tests
# (python/tests/test_compat_*.py), at the version scripts/peers-versions.txt pins for every peer
# comparison. Without PyPI the install fails and those tests skip, saying so.
mooncake_pin=$(grep -m1 '^mooncake-transfer-engine-non-cuda==' scripts/peers-versions.txt | cut -d' ' -f1)
if ! "$venv/bin/python" -m pip show "${mooncake_pin%%==*}" 2>/dev/null | grep -qx "Version: ${mooncake_pin##*==}"; then
  echo "== python: installing $mooncake_pin into $venv (te.compat's reference)"
  "$venv/bin/python" -m pip install -q --timeout 20 --retries 1 "$mooncake_pin" \
    || echo "== python: $mooncake_pin not installed (PyPI unreachable?): the differential tests skip"
fi
echo "== python: maturin develop ${profile[*]:-(dev profile)}"
VIRTUAL_ENV="$PWD/$venv" PATH="$PWD/$venv/bin:$PATH" \
  maturin develop -q -m python/Cargo.toml "${profile[@]}"
echo "== python: pytest python/tests"
# A hang guard, not a verdict: a test still running after 15 minutes is stopped with every
# thread's stack printed (the thread method: a wait in native code never sees a Python signal).
"$venv/bin/python" -m pytest -q -ra --timeout=900 --timeout-method=thread python/tests "$@"
