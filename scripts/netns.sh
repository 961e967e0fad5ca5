#!/usr/bin/env bash
# Runs `te-bench transfer` between two network namespaces joined by a veth pair: two "hosts" with
# separate network stacks on one machine (needs root and iproute2). The target runs
# `te-bench transfer --serve` in one namespace, the initiator `--peer` from the other.
#
#   scripts/netns.sh --op write --block-bytes 1M --lanes 1 --repeat 5 --verify --json
#
# TOTAL (default 256M) is the --total-bytes of both sides; TE_BENCH the binary
# (default target/release/te-bench). Namespaces are removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=${TE_BENCH:-target/release/te-bench}
TOTAL=${TOTAL:-256M}
tag="tebench$$"
a="$tag-a"
b="$tag-b"
out=$(mktemp)
server=""

cleanup() {
  [ -n "$server" ] && kill "$server" 2>/dev/null || true
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
  rm -f "$out"
}
trap cleanup EXIT

ip netns add "$a"
ip netns add "$b"
ip -n "$a" link add eth0 type veth peer name eth0 netns "$b"
ip -n "$a" addr add 10.214.0.1/24 dev eth0
ip -n "$b" addr add 10.214.0.2/24 dev eth0
for ns in "$a" "$b"; do
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
done

ip netns exec "$b" env TE_TCP_LISTEN=10.214.0.2:0 \
  "$BENCH" transfer --serve --listen 10.214.0.2:7100 --total-bytes "$TOTAL" >"$out" &
server=$!
for _ in $(seq 100); do
  grep -q READY "$out" && break
  sleep 0.1
done
grep -q READY "$out" || { echo "netns.sh: the target did not start" >&2; exit 1; }

ip netns exec "$a" env TE_TCP_LISTEN=10.214.0.1:0 \
  "$BENCH" transfer --peer 10.214.0.2:7100 --total-bytes "$TOTAL" "$@"
