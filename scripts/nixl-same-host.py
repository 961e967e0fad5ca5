#!/usr/bin/env python3
"""NIXL's released wheel between two processes on one host, the same shapes te-bench transfer
measures for the shm transport: one batch of BLOCK-byte WRITEs covering TOTAL bytes, posted as one
NIXL transfer request and polled to DONE, timed; byte-verified by the target.

Setup (once):
    python3 -m venv target/nixl-venv
    target/nixl-venv/bin/pip install --no-deps nixl-cu12 numpy

Run (UCX with its default transports: shared memory and CMA between two local processes):
    target/nixl-venv/bin/python scripts/nixl-same-host.py --shapes 64K:64M,1M:64M,1728:9216x --repeat 5

A shape is BLOCK:TOTAL (contiguous blocks) or BLOCK:COUNTx (COUNT blocks, remote slots permuted as
te-bench's --scatter does, so nothing coalesces). One JSON object per shape on stdout (NIXL's own
log lines go there too; the JSON lines are the ones starting with '{').
"""

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np


def size(text):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1] in mult:
        return int(text[:-1]) * mult[text[-1]]
    return int(text)


def parse_shape(text):
    block, rest = text.split(":")
    block = size(block)
    if rest.endswith("x"):
        count = int(rest[:-1])
        return block, count, True
    total = size(rest)
    assert total % block == 0, f"{text}: TOTAL must be a multiple of BLOCK"
    return block, total // block, False


def slot(i, blocks, scatter):
    """te-bench's --scatter permutation (benches/src/transfer/cma.rs `slot`)."""
    if not scatter or blocks < 3:
        return i
    step = (blocks // 2) | 1
    while math.gcd(step, blocks) != 1:
        step += 2
    return (i * step) % blocks


def pattern(n, seed):
    return ((np.arange(n, dtype=np.uint64) * 131 + seed * 7919) & 0xFF).astype(np.uint8)


def agent(name):
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def target(conn, nbytes):
    a = agent("te-nixl-target")
    buf = np.zeros(nbytes, dtype=np.uint8)
    buf[:] = 1  # touched, not the zero page
    a.register_memory(a.get_reg_descs([(buf.ctypes.data, nbytes, 0, "")], "DRAM"))
    conn.send((a.get_agent_metadata(), buf.ctypes.data))
    while True:
        msg = conn.recv()
        if msg[0] == "verify":
            _, block, count, scatter, seed = msg
            src = pattern(block * count, seed)
            bad = 0
            for i in range(count):
                s = slot(i, count, scatter)
                bad += int(np.count_nonzero(buf[s * block:(s + 1) * block] != src[i * block:(i + 1) * block]))
            conn.send(bad)
        elif msg[0] == "exit":
            conn.send("bye")
            # The wheel's agent teardown at interpreter exit has crashed here; nothing is left
            # to release that the kernel does not.
            os._exit(0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64K:64M,256K:64M,1M:64M,4M:64M,1728:9216x,8448:2048x,37440:512x")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    most = max(b * c for b, c, _ in shapes)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, most))
    proc.start()
    meta, remote_base = parent.recv()
    a = agent("te-nixl-initiator")
    src = np.zeros(most, dtype=np.uint8)
    a.register_memory(a.get_reg_descs([(src.ctypes.data, most, 0, "")], "DRAM"))
    remote = a.add_remote_agent(meta)
    for seed, (block, count, scatter) in enumerate(shapes, start=3):
        total = block * count
        src[:total] = pattern(total, seed)
        local = np.array([(src.ctypes.data + i * block, block, 0) for i in range(count)], dtype=np.uint64)
        rem = np.array(
            [(remote_base + slot(i, count, scatter) * block, block, 0) for i in range(count)], dtype=np.uint64
        )
        ld = a.get_xfer_descs(local, "DRAM")
        rd = a.get_xfer_descs(rem, "DRAM")
        handle = a.initialize_xfer("WRITE", ld, rd, remote)

        def once():
            state = a.transfer(handle)
            while state == "PROC":
                state = a.check_xfer_state(handle)
            if state != "DONE":
                raise SystemExit(f"NIXL transfer failed: {state}")

        once()  # warm-up: connection, registration caches, page faults
        runs = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            once()
            runs.append(total / (time.perf_counter() - t0) / 1e9)
        parent.send(("verify", block, count, scatter, seed))
        bad = parent.recv()
        gbps = statistics.median(runs)
        print(
            json.dumps(
                {
                    "bench": "nixl-same-host",
                    "backend": "UCX",
                    "ucx_tls": os.environ.get("UCX_TLS", "default"),
                    "block_bytes": block,
                    "total_bytes": total,
                    "scatter": scatter,
                    "repeat": args.repeat,
                    "gbps": gbps,
                    "gbps_runs": runs,
                    "ns_per_request": block / gbps,
                    "mismatched_bytes": bad,
                }
            ),
            flush=True,
        )
        a.release_xfer_handle(handle)
    parent.send(("exit",))
    parent.recv()
    proc.join(10)
    sys.stdout.flush()
    # As in the target: skip the agent's teardown at interpreter exit, which has crashed.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
