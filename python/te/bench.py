"""What Python adds to the engine and the store: ``python -m te.bench``.

Times, in one process and on the same engine, store and buffers, each call from Python and the
same call from a Rust loop (``te._native.rust_*_loop``), alternating rounds; reports the medians
and their difference, the Python overhead:

- ``write-4k``: a one-request 4 KiB local write (submit, then wait), engine on the local-copy
  transport;
- ``get-ranges-121``: a ``batch_get_ranges`` of 121 ranges of 1,728 B (11 pages x 11 layers of a
  layer group of DeepSeek-V4-Pro's smallest pool, as ``te-bench umbp`` asks them), from a local
  store's DRAM tier into per-layer buffers.

Targets: at most 3 us + 20 ns per range added per call; 0 mismatched bytes (every round checks
every byte against a position-dependent pattern). Build with ``--release`` for figures
(``bash scripts/python-tests.sh --release``); a dev build only checks the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from . import TransferEngine, _native
from .umbp import Store

LAYER = 1728
PAGES = 11
LAYERS = 11  # ranges per page in the group; 121 in all


def pattern(n: int, seed: int) -> np.ndarray:
    i = np.arange(n, dtype=np.uint64)
    return ((i * np.uint64(2654435761) + np.uint64(seed)) >> np.uint64(7)).astype(np.uint8)


def bench_write(rounds: int, iters: int) -> dict:
    e = TransferEngine(f"te-py-bench-{os.getpid()}", transports=["local"])
    src, dst = np.zeros(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    rs, rd = e.register(src), e.register(dst)
    seg = e.open_segment(e.segment_name)
    sa, da = rs.addr, rd.addr
    py, rust, mismatched = [], [], 0
    write = e.write
    for r in range(rounds):
        src[:] = pattern(4096, r)
        dst[:] = 0
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            write(seg, sa, da, 4096)
        py.append((time.perf_counter_ns() - t0) / iters)
        mismatched += int((src != dst).sum())
        src[:] = pattern(4096, r + 1000)
        rust.append(_native.rust_write_loop(e, seg, sa, da, 4096, iters))
        mismatched += int((src != dst).sum())
    rs.close()
    rd.close()
    e.shutdown()
    return summary("write-4k", 1, py, rust, mismatched)


def bench_get_ranges(rounds: int, iters: int) -> dict:
    store = Store(dram_capacity=64 << 20, ssd_dirs=[], segment_name=f"te-py-bench-store-{os.getpid()}")
    obj_len = LAYERS * LAYER
    keys = [f"bench-page-{p}" for p in range(PAGES)]
    pages = [pattern(obj_len, p) for p in range(PAGES)]
    regs = [store.register(p) for p in pages]
    put_addrs = np.array([r.addr for r in regs], dtype=np.uint64)
    assert store.batch_put_ranges(keys, obj_len, np.arange(PAGES, dtype=np.uint64), 0, obj_len, put_addrs) == [None] * PAGES
    # Destination: one buffer per layer, [page][LAYER]; range (page p, layer l) lands there.
    layers = [np.zeros(PAGES * LAYER, dtype=np.uint8) for _ in range(LAYERS)]
    lregs = [store.register(b) for b in layers]
    laddr = np.array([r.addr for r in lregs], dtype=np.uint64)
    ki = np.repeat(np.arange(PAGES, dtype=np.uint64), LAYERS)
    li = np.tile(np.arange(LAYERS, dtype=np.uint64), PAGES)
    offs = li * np.uint64(LAYER)
    lens = np.full(ki.size, LAYER, dtype=np.uint64)
    addrs = laddr[li] + ki * np.uint64(LAYER)
    expect = [np.concatenate([pages[p][l * LAYER:(l + 1) * LAYER] for p in range(PAGES)]) for l in range(LAYERS)]

    def check() -> int:
        bad = sum(int((layers[l] != expect[l]).sum()) for l in range(LAYERS))
        for b in layers:
            b[:] = 0
        return bad

    py, rust, mismatched = [], [], 0
    get = store.batch_get_ranges
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            get(keys, ki, offs, lens, addrs)
        py.append((time.perf_counter_ns() - t0) / iters)
        mismatched += check()
        rust.append(_native.rust_get_ranges_loop(store, keys, ki, offs, lens, addrs, iters))
        mismatched += check()
    for r in regs + lregs:
        r.close()
    store.close()
    return summary("get-ranges-121", int(ki.size), py, rust, mismatched)


def summary(name: str, ranges: int, py: list[float], rust: list[float], mismatched: int) -> dict:
    py_ns, rust_ns = statistics.median(py), statistics.median(rust)
    added = py_ns - rust_ns
    target = 3000 + 20 * ranges
    return {
        "bench": name,
        "ranges": ranges,
        "python_ns": round(py_ns, 1),
        "rust_ns": round(rust_ns, 1),
        "added_ns": round(added, 1),
        "target_added_ns": target,
        "within_target": added <= target,
        "python_ns_rounds": [round(x, 1) for x in py],
        "rust_ns_rounds": [round(x, 1) for x in rust],
        "mismatched_bytes": mismatched,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m te.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9, help="alternating Python/Rust rounds; medians reported")
    p.add_argument("--iters", type=int, default=2000, help="calls per round")
    p.add_argument("--json", action="store_true", help="one JSON object per bench")
    a = p.parse_args(argv)
    results = [bench_write(a.rounds, a.iters), bench_get_ranges(a.rounds, max(1, a.iters // 4))]
    for r in results:
        if a.json:
            print(json.dumps(r))
        else:
            print(f"{r['bench']:>15}: python {r['python_ns'] / 1000:8.2f} us  rust {r['rust_ns'] / 1000:8.2f} us  "
                  f"added {r['added_ns'] / 1000:6.2f} us (target <= {r['target_added_ns'] / 1000:.2f})  "
                  f"mismatched bytes {r['mismatched_bytes']}")
    return 1 if any(r["mismatched_bytes"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
