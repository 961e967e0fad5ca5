#!/usr/bin/env bash
# Runs in the soft-RoCE guest of scripts/rdma-vm.sh (as a step; ./te-bench beside it): the
# registration caps sweep on real pinned host memory through the rdma transport, and a
# byte-verified te-bench write beside perftest's ib_write_bw on the same device with the same
# message size and one QP. Soft-RoCE under QEMU's TCG emulation: the figures show the paths work
# on a real verbs stack and compare like with like on it, not what a NIC does.
#   bash rdma-bench.sh DEVICE
set -euo pipefail
dev=${1:?device}
echo "rdma-bench: soft-RoCE ($dev) under emulation; figures are not NIC performance"
echo "--- te-bench register --transport rdma: 8 x 64 MiB pinned host buffers, caps 1, 2, unset"
TE_RDMA_DEVICES=$dev ./te-bench register --transport rdma --ranks 1 --caps 1,2,unset --orders ascending \
  --sizes 8x64MiB --location host --repeat 1
echo "--- te-bench transfer --transport rdma: 1 MiB writes, 64 MiB per repetition, every byte verified"
TE_RDMA_DEVICES=$dev ./te-bench transfer --transport rdma --op write --block-bytes 1M --total-bytes 64M \
  --repeat 3 --verify
echo "--- ib_write_bw (perftest): 1 MiB messages, 200 iterations, 1 QP, same device"
timeout 120 ib_write_bw -d "$dev" -x 1 -s 1048576 -n 200 -F >/tmp/ib_write_bw.server 2>&1 &
server=$!
client=""
for _ in $(seq 50); do
  if client=$(timeout 60 ib_write_bw -d "$dev" -x 1 -s 1048576 -n 200 -F 127.0.0.1 2>&1); then break; fi
  client=""
  sleep 0.2
done
wait "$server" || true
[ -n "$client" ] || { echo "rdma-bench: ib_write_bw did not run" >&2; cat /tmp/ib_write_bw.server >&2; exit 1; }
echo "$client" | grep -A1 "#bytes"
