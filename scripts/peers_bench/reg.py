"""Registration wall time, one engine per process (the driver interleaves engines and rounds).

Shapes:
- ``seed001``: 182 host buffers from 2,560 B to 391 MB (te-bench register's kimi-k3 preset: 52 x
  2,560 B, 61 x 2.79 MB, 61 x 391 MB, 8 x 24 MB; 24.6 GB in all), registered in that order. The
  buffers are carved out of one anonymous MAP_NORESERVE mapping that nobody touches: on a host
  transport (TCP, UCX without a NIC) registration records ranges and pins nothing, and the
  machine could not hold 24.6 GB of touched memory. The row reports the process's resident
  growth, so an engine that touched or pinned the memory shows it.
- ``views``: one prefaulted 1 GiB pool cut into 1,265 page-aligned tensors back to back (what a
  framework's per-layer tensors over one allocation look like); each engine registers the 1,265
  tensors, not the pool. ``views-pool`` (ours only): the pool first, then the tensors, which the
  registration cache serves as views.

Calls, as each engine's users make them: ours ``register_ptrs`` once with every buffer (one
descriptor update); Mooncake ``batch_register_memory`` once; NIXL ``register_memory`` once with
every descriptor. Setup (engine start, the mapping) is not timed; neither is deregistration.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import sys
import time

import numpy as np

PAGE = mmap.PAGESIZE
SEED001 = [2_560] * 52 + [2_790_000] * 61 + [391_000_000] * 61 + [24_000_000] * 8


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / (1 << 20)


def ranges(shape: str, scale: float):
    """(base object kept alive, [(addr, len)], pool (addr, len) or None)."""
    if shape == "seed001":
        sizes = [max(PAGE, int(s * scale)) for s in SEED001]
        padded = [(s + PAGE - 1) // PAGE * PAGE for s in sizes]
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
        mm = mmap.mmap(-1, sum(padded), flags=flags)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        out, off = [], 0
        for s, p in zip(sizes, padded):
            out.append((base + off, s))
            off += p
        return mm, out, None
    pool_bytes = max(int((1 << 30) * scale), 1265 * PAGE)
    n = 1265
    pool = np.empty(pool_bytes + PAGE, dtype=np.uint8)
    pool[:] = 1  # prefaulted
    start = (pool.ctypes.data + PAGE - 1) // PAGE * PAGE
    view = pool_bytes // n // PAGE * PAGE
    return pool, [(start + i * view, view) for i in range(n)], (start, view * n)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, choices=["ours", "mooncake", "nixl"])
    p.add_argument("--shape", required=True, choices=["seed001", "views", "views-pool"])
    p.add_argument("--scale", type=float, default=1.0, help="sizes x this (CI smoke: small)")
    p.add_argument("--round", type=int, default=0)
    args = p.parse_args()
    row = {"bench": "peers-register", "engine": args.engine, "shape": args.shape, "round": args.round,
           "scale": args.scale}
    keep, regs, pool = ranges("seed001" if args.shape == "seed001" else "views", args.scale)
    row.update({"buffers": len(regs), "bytes": sum(n for _, n in regs)})
    try:
        if args.engine == "ours":
            import te

            e = te.TransferEngine(f"peers-reg-{os.getpid()}", env={
                "TE_METADATA": "p2p", "TE_P2P_LISTEN": "127.0.0.1:0", "TE_TRANSPORTS": "tcp",
                "TE_TCP_LISTEN": "127.0.0.1:0", "TE_TCP_ADVERTISE": "127.0.0.1"})
            handles = []
            rss0 = rss_mib()
            t0 = time.perf_counter()
            if args.shape == "views-pool":
                handles.append(e.register_ptr(pool[0], pool[1]))
            addrs = np.array([a for a, _ in regs], dtype=np.uint64)
            lens = np.array([n for _, n in regs], dtype=np.uint64)
            handles.extend(e.register_ptrs(addrs, lens))
            dt = time.perf_counter() - t0
            got = len(handles)
        elif args.engine == "mooncake":
            if args.shape == "views-pool":
                raise SystemExit("views-pool is ours only")
            from mooncake.engine import TransferEngine

            e = TransferEngine()
            if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("mooncake initialize failed")
            addrs, lens = [a for a, _ in regs], [n for _, n in regs]
            rss0 = rss_mib()
            t0 = time.perf_counter()
            rc = e.batch_register_memory(addrs, lens)
            dt = time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"batch_register_memory returned {rc}")
            got = len(regs)
        else:
            if args.shape == "views-pool":
                raise SystemExit("views-pool is ours only")
            from nixl_cu12._api import nixl_agent, nixl_agent_config

            a = nixl_agent(f"peers-reg-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
            rss0 = rss_mib()
            t0 = time.perf_counter()
            descs = a.register_memory(a.get_reg_descs([(x, n, 0, "") for x, n in regs], "DRAM"))
            dt = time.perf_counter() - t0
            if descs is None:
                raise RuntimeError("register_memory returned None")
            got = len(regs)
        row.update({"seconds": dt, "registered": got, "per_buffer_us": dt / got * 1e6,
                    "rss_growth_mib": rss_mib() - rss0, "ucx_tls": os.environ.get("UCX_TLS", "default")})
    except Exception as ex:
        row["error"] = f"{type(ex).__name__}: {ex}"
    print(json.dumps(row), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
