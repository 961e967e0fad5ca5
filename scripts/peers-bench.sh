#!/usr/bin/env bash
# Side by side with the engines users would pick instead, their released wheels, in one run
# (issue 40): Mooncake's Transfer Engine and NIXL, versions pinned in scripts/peers-versions.txt,
# against our `te` package (release build) and te-bench, rounds interleaved, every byte verified.
#
#   scripts/peers-bench.sh [--smoke] [--wheel FILE] [run.py options...]
#
# 1. a venv under target/peers-venv with the pinned peers (pip; reinstalls what differs from the pin);
# 2. our wheel: `maturin build --release -m python/Cargo.toml` into target/peers-wheel, installed
#    into that venv (--wheel FILE installs a wheel built elsewhere instead, e.g. the one
#    scripts/python-wheel.sh left in target/wheels);
# 3. scripts/peers_bench/run.py: the scenarios (see its --help), one JSON line per row into
#    target/peers-bench/rows.jsonl, a table per scenario (*.txt, also printed), an SVG plot per
#    scenario (peers-*.svg) and summary.jsonl (medians over rounds, ratios, versions, command).
#    te-bench rows need target/release/te-bench (`cargo build --release -p te-bench`).
#
# --smoke: tiny sizes, one round, one pass (CI: checks that the harness and the peers still run;
# its figures mean nothing). Exit status 3: a peer or PyPI could not be installed (the reason is
# printed); scripts/test.sh turns that into a skip unless TE_REQUIRE names peers.
#
# To run against newer peers: edit scripts/peers-versions.txt and rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never CARGO_PROFILE_DEV_DEBUG=line-tables-only CARGO_PROFILE_TEST_DEBUG=line-tables-only

smoke=0
wheel=
args=()
while [ $# -gt 0 ]; do
  case "$1" in
  --smoke) smoke=1 ;;
  --wheel) wheel=$2; shift ;;
  *) args+=("$1") ;;
  esac
  shift
done

venv=${PEERS_VENV:-target/peers-venv}
py=$venv/bin/python
if [ ! -x "$py" ]; then
  echo "== peers: creating $venv"
  "${PYTHON:-python3}" -m venv "$venv"
fi

# The pins: "name==version [--no-deps]" lines; installed unless pip already has that version.
versions="{"
while read -r req flags; do
  case "$req" in '' | '#'*) continue ;; esac
  name=${req%%==*}
  want=${req#*==}
  [ "$want" = "$req" ] && want=
  have=$("$py" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
  if [ -z "$have" ] || { [ -n "$want" ] && [ "$have" != "$want" ]; }; then
    echo "== peers: pip install $req $flags"
    # shellcheck disable=SC2086
    if ! "$py" -m pip install -q --retries 1 --timeout 30 $flags "$req" 2>&1 | tail -5; then
      echo "peers-bench: cannot install $req from PyPI (network or wheel unavailable)" >&2
      exit 3
    fi
    have=$("$py" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    if [ -z "$have" ]; then
      echo "peers-bench: $req did not install (PyPI unreachable or no wheel for this platform)" >&2
      exit 3
    fi
  fi
  versions+="\"$name\": \"$have\", "
done <scripts/peers-versions.txt

# Our package.
if [ -z "$wheel" ]; then
  "$py" -m pip show -q maturin >/dev/null 2>&1 || "$py" -m pip install -q --retries 1 --timeout 30 maturin || {
    echo "peers-bench: cannot install maturin from PyPI" >&2
    exit 3
  }
  echo "== peers: maturin build --release (our wheel)"
  rm -f target/peers-wheel/te_transfer_engine-*.whl
  "$venv/bin/maturin" build --release -q -m python/Cargo.toml -o target/peers-wheel
  wheel=$(ls -t target/peers-wheel/te_transfer_engine-*.whl | head -1)
fi
echo "== peers: installing $wheel"
"$py" -m pip install -q --force-reinstall --no-deps "$wheel"
ours=$("$py" -c 'import te; print(te.__version__, "transports:", ",".join(te.COMPILED_TRANSPORTS))')
versions+="\"te\": \"$ours\", \"te-bench\": \"$(git rev-parse --short HEAD 2>/dev/null || echo unknown)\"}"
echo "== peers: $versions; load $(cut -d' ' -f1-3 /proc/loadavg)"

if [ "$smoke" = 1 ]; then
  args=(--out target/peers-bench-smoke --rounds 1 --repeat 1 --shapes 64K:1M,kv:1728 --reg-scale 0.002
    --mc-duration 1 --batch-bytes 1M --kill-bytes 64M --kill-after 0.01 --kill-restart-limit 5 --store-keys 16 --store-pages 4 --verify "${args[@]}")
fi
exec "$py" scripts/peers_bench/run.py --versions "$versions" "${args[@]}"
