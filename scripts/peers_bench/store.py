"""The store beside Mooncake Store, whole objects: one batch put of --keys objects of --object
bytes from one registered buffer, then one batch get of the same keys into a second buffer;
every byte compared. One JSON line per engine run (median over --repeat passes, each with fresh
keys). Same DRAM budget on both sides (--dram).

- ``umbp``: our store in local mode (in this process), ``batch_put_ranges`` /
  ``batch_get_ranges`` with one whole-object range per key.
- ``mooncake``: ``mooncake_master`` (started here, with its HTTP metadata server) and one
  ``MooncakeDistributedStore`` client in this process mounting the DRAM budget as its global
  segment over protocol tcp; ``register_buffer`` on both buffers, ``batch_put_from`` /
  ``batch_get_into``.
Both keep the objects in this host's DRAM; Mooncake's put and get also pass its master (RPC).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pattern(n: int, seed: int) -> np.ndarray:
    i = np.arange(n, dtype=np.uint64)
    return ((i * np.uint64(2654435761) + np.uint64(seed * 7919)) >> np.uint64(5)).astype(np.uint8)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, choices=["umbp", "mooncake"])
    p.add_argument("--keys", type=int, default=256)
    p.add_argument("--object", type=int, default=61 * 1728, help="bytes per object (default: one page, 61 layers)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dram", type=int, default=512 << 20)
    p.add_argument("--round", type=int, default=0)
    args = p.parse_args()
    n, size = args.keys, args.object
    row = {"bench": "peers-store", "engine": args.engine, "keys": n, "object_bytes": size, "round": args.round,
           "repeat": args.repeat, "dram_bytes": args.dram}
    src = np.empty(n * size, dtype=np.uint8)
    dst = np.zeros(n * size, dtype=np.uint8)
    master = None
    try:
        if args.engine == "umbp":
            from te import umbp

            store = umbp.Store(dram_capacity=args.dram, ssd_dirs=[], segment_name=f"peers-store-{os.getpid()}")
            rs, rd = store.register(src), store.register(dst)
            idx = np.arange(n, dtype=np.uint64)
            offs = np.zeros(n, dtype=np.uint64)
            lens = np.full(n, size, dtype=np.uint64)
            sa = np.uint64(rs.addr) + idx * np.uint64(size)
            da = np.uint64(rd.addr) + idx * np.uint64(size)

            def put(keys):
                res = store.batch_put_ranges(keys, lens, idx, offs, lens, sa)
                bad = [r for r in res if r is not None]
                if bad:
                    raise RuntimeError(f"batch_put_ranges: {bad[0]!r}")

            def get(keys):
                res = store.batch_get_ranges(keys, idx, offs, lens, da)
                bad = [r for r in res if r != size]
                if bad:
                    raise RuntimeError(f"batch_get_ranges: {bad[0]!r}")
        else:
            from mooncake.store import MooncakeDistributedStore

            bindir = os.path.dirname(sys.executable)
            rpc, http = free_port(), free_port()
            master = subprocess.Popen([os.path.join(bindir, "mooncake_master"), f"--port={rpc}",
                                       "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.5)
            store = MooncakeDistributedStore()
            rc = store.setup("127.0.0.1", f"http://127.0.0.1:{http}/metadata", args.dram, 128 << 20, "tcp", "",
                             f"127.0.0.1:{rpc}")
            if rc != 0:
                raise RuntimeError(f"setup returned {rc}")
            for b in (src, dst):
                if store.register_buffer(b.ctypes.data, b.nbytes) != 0:
                    raise RuntimeError("register_buffer failed")
            sa = [src.ctypes.data + i * size for i in range(n)]
            da = [dst.ctypes.data + i * size for i in range(n)]
            sizes = [size] * n

            def put(keys):
                res = store.batch_put_from(keys, sa, sizes)
                bad = [r for r in res if r != 0]
                if bad:
                    raise RuntimeError(f"batch_put_from returned {bad[0]}")

            def get(keys):
                res = store.batch_get_into(keys, da, sizes)
                bad = [r for r in res if r != size]
                if bad:
                    raise RuntimeError(f"batch_get_into returned {bad[0]}")

        puts, gets = [], []
        for rep in range(args.repeat + 1):  # pass 0 untimed
            keys = [f"peers-r{args.round}-p{rep}-k{i}" for i in range(n)]
            src[:] = pattern(src.size, args.round * 100 + rep + 1)
            dst[:] = 0
            t0 = time.perf_counter()
            put(keys)
            t1 = time.perf_counter()
            get(keys)
            t2 = time.perf_counter()
            bad = int(np.count_nonzero(src != dst))
            if bad:
                raise RuntimeError(f"{bad} mismatched bytes")
            if rep:
                puts.append(t1 - t0)
                gets.append(t2 - t1)
        total = n * size
        row.update({"put_ms": statistics.median(puts) * 1e3, "get_ms": statistics.median(gets) * 1e3,
                    "put_gbps": total / statistics.median(puts) / 1e9, "get_gbps": total / statistics.median(gets) / 1e9,
                    "verified": True, "mismatched_bytes": 0})
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(row), flush=True)
    if master:
        master.kill()
    os._exit(0)


if __name__ == "__main__":
    main()
