#!/usr/bin/env bash
# Runs every `cargo run --example` program of the workspace as a user would, and fails if one
# fails. The two-process examples start their server in the background, read the address (or
# wait for the segment) it prints, run the client, then wait for the server's own verdict.
# Expects etcd on PATH (scripts/test.sh installs etcd-server) for the etcd example.
set -euo pipefail
cd "$(dirname "$0")/.."

build() { cargo build -q --all-features -p "$1" --examples; }
bin() { echo "${CARGO_TARGET_DIR:-target}/debug/examples/$1"; }
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# Waits (at most 60 s) until file $1 has a line, printing it; fails early if process $2 exits.
first_line() {
  for _ in $(seq 600); do
    if [ -s "$1" ]; then head -n1 "$1"; return 0; fi
    kill -0 "$2" 2>/dev/null || { cat "$1"; return 1; }
    sleep 0.1
  done
  echo "run-examples: nothing in $1 within 60 s" >&2
  return 1
}

# Prints a port nothing listens on (etcd cannot pick its own): random in 10000-31999, below the
# kernel's ephemeral range, so no outgoing connection takes it before the server binds it.
unused_port() {
  local p
  while :; do
    p=$((10000 + RANDOM % 22000))
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return 0; }
  done
}

# Waits (at most 30 s) until something listens on 127.0.0.1:$1.
listening() {
  for _ in $(seq 300); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "run-examples: nothing listens on port $1 within 30 s" >&2
  return 1
}

build te-core
build umbp

echo "== example restore_prefix (umbp)"
"$(bin restore_prefix)"

echo "== example raw_scatter"
"$(bin raw_scatter)"

echo "== example tcp_p2p (two processes)"
"$(bin tcp_p2p)" serve >"$work/p2p.out" 2>&1 &
server=$!
pids+=("$server")
line=$(first_line "$work/p2p.out" "$server")
echo "$line"
"$(bin tcp_p2p)" client "${line##* }"
wait "$server"
tail -n +2 "$work/p2p.out"

echo "== example tcp_etcd (two processes and etcd)"
port=$(unused_port)
peer_port=$(unused_port)
etcd --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$port" \
  --advertise-client-urls "http://127.0.0.1:$port" --listen-peer-urls "http://127.0.0.1:$peer_port" \
  >"$work/etcd.log" 2>&1 &
pids+=($!)
listening "$port"
endpoint="http://127.0.0.1:$port"
"$(bin tcp_etcd)" serve "$endpoint" >"$work/etcd-example.out" 2>&1 &
server=$!
pids+=("$server")
first_line "$work/etcd-example.out" "$server"
"$(bin tcp_etcd)" client "$endpoint"
wait "$server"
tail -n +2 "$work/etcd-example.out"
