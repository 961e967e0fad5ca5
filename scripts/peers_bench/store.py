"""The store beside Mooncake Store: UMBP in its three modes and Mooncake Store, same DRAM budget
(--dram), every key resident on this node (seed 000's deployment), every byte compared.

Two tests per engine run, one JSON line each (medians over --repeat timed passes after one
untimed pass):

- ``whole``: one batch put of --keys objects of --object bytes from one registered buffer, then
  one batch get of the same keys into a second buffer (fresh keys each pass).
- ``restore``: seed 000's layer-wise restore. DeepSeek-V4-Pro's three pools (c4: 30 layers of
  37,440 B at layers 2, 4, ... 60; c4_indexer: 30 of 8,448 B at the same layers; c128: 31 of
  1,728 B at layers 0, 1, 3, ... 59), --pages pages, one object per (page, pool) holding that
  pool's layers back to back, the KV buffers laid out [pool layer][page] (so every layer of a
  page is its own fragment). Put: one batch per pool, each key gathered from its layer
  fragments. Restore: the 61 logical layers in groups of 8; per group one ranged batch call
  asking, for every page and every pool with layers in the group, that pool's layers of the
  group (Mooncake's get_into_ranges: one destination buffer per pool). TTFL: time until the
  first group's call returned; load: until the last one did (no simulated compute).
  The same bytes land on both sides: every fragment of every page, compared after each pass.

Engines, each driven through its public Python API:
- ``umbp``: local mode, in this process.
- ``umbp-standalone``: an ``umbp-server`` process (the wheel's console script) holding the DRAM
  budget; this process is a client over its Unix socket (buffers from ``alloc_buffer``).
- ``umbp-distributed``: distributed mode, an etcd started here, this process a peer (the DRAM
  budget is its arena; the peer's engine publishes it, and the directory is the cluster's).
- ``mooncake``: ``mooncake_master`` (started here, with its HTTP metadata server) and one
  ``MooncakeDistributedStore`` client in this process mounting the DRAM budget as its global
  segment over protocol tcp. Whole objects: ``batch_put_from`` / ``batch_get_into``; restore:
  ``batch_put_from_multi_buffers`` and ``get_into_ranges`` (the pinned wheel's
  ``batch_get_into_multi_buffer_ranges`` answers -600, INVALID_PARAMS, to every form tried;
  --mc-ranged batch_get_into_multi_buffer_ranges selects it).
UMBP: ``batch_put_ranges`` / ``batch_get_ranges`` (one range per key for whole objects).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engines import free_port  # noqa: E402

# name, layer bytes, logical layers (seed 000's POOLS)
POOLS = [("c4", 37440, list(range(2, 61, 2))), ("c4_indexer", 8448, list(range(2, 61, 2))),
         ("c128", 1728, [0] + list(range(1, 60, 2)))]
GROUP = 8
ENGINES = ["umbp", "umbp-standalone", "umbp-distributed", "mooncake"]


def pattern(n: int, seed: int) -> np.ndarray:
    i = np.arange(n, dtype=np.uint64)
    return ((i * np.uint64(2654435761) + np.uint64(seed * 7919)) >> np.uint64(5)).astype(np.uint8)


def wait_port(port: int, proc, what: str, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not listen on {port} within {timeout:.0f} s")
        time.sleep(0.05)


class Umbp:
    """UMBP in one of its modes; buffers from alloc_buffer (what standalone mode maps)."""

    def __init__(self, mode: str, dram: int, tmp: str, procs: list):
        from te import umbp

        name = f"peers-store-{os.getpid()}"
        if mode == "umbp":
            self.store = umbp.Store(dram_capacity=dram, ssd_dirs=[], segment_name=name)
        elif mode == "umbp-standalone":
            sock = os.path.join(tmp, "umbp.sock")
            server = os.path.join(os.path.dirname(sys.executable), "umbp-server")
            env = {k: v for k, v in os.environ.items() if not k.startswith("UMBP_")}
            procs.append(subprocess.Popen([server, "--socket", sock, "--dram", str(dram)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
            deadline = time.monotonic() + 30
            while not os.path.exists(sock):
                if procs[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("umbp-server did not create its socket within 30 s")
                time.sleep(0.02)
            self.store = umbp.Store(connect=sock)
        else:
            client, peer = free_port(), free_port()
            url, purl = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
            procs.append(subprocess.Popen(
                [shutil.which("etcd") or "/usr/bin/etcd", "--data-dir", os.path.join(tmp, "etcd"), "--name", "peers",
                 "--listen-client-urls", url, "--advertise-client-urls", url, "--listen-peer-urls", purl,
                 "--initial-advertise-peer-urls", purl, "--initial-cluster", f"peers={purl}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_port(client, procs[-1], "etcd")
            self.store = umbp.Store(cluster=f"etcd://127.0.0.1:{client}/peers{os.getpid()}", dram_capacity=dram,
                                    ssd_dirs=[], segment_name=name)
        self.mode = self.store.mode
        self.keep = []

    def buffer(self, n: int):
        kv = self.store.alloc_buffer(n)
        view = np.frombuffer(kv, dtype=np.uint8)
        reg = self.store.register(view)
        self.keep.append((kv, reg))
        return view, reg.addr

    def put_whole(self, keys, addrs, size):
        n = len(keys)
        lens = np.full(n, size, dtype=np.uint64)
        res = self.store.batch_put_ranges(keys, lens, np.arange(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64),
                                          lens, np.asarray(addrs, dtype=np.uint64))
        bad = [r for r in res if r is not None]
        if bad:
            raise RuntimeError(f"batch_put_ranges: {bad[0]!r}")

    def get_whole(self, keys, addrs, size):
        n = len(keys)
        res = self.store.batch_get_ranges(keys, np.arange(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64),
                                          np.full(n, size, dtype=np.uint64), np.asarray(addrs, dtype=np.uint64))
        bad = [r for r in res if r != size]
        if bad:
            raise RuntimeError(f"batch_get_ranges: {bad[0]!r}")

    def ranged_put(self, keys, object_len, frags):
        """frags[k]: (offset in the object, length, address) of key k's ranges."""
        ki, off, ln, ad = flat(frags)
        res = self.store.batch_put_ranges(keys, np.full(len(keys), object_len, dtype=np.uint64), ki, off, ln, ad)
        bad = [r for r in res if r is not None]
        if bad:
            raise RuntimeError(f"batch_put_ranges: {bad[0]!r}")

    def ranged_get_call(self, parts):
        """One call for a layer group: parts = [(keys, frags, buffer base)] per pool, keys of
        every pool in one list (UMBP takes absolute addresses)."""
        keys = [k for ks, _, _ in parts for k in ks]
        frags = [f for _, fs, _ in parts for f in fs]
        ki, off, ln, ad = flat(frags)
        want = [sum(f[1] for f in fr) for fr in frags]
        store = self.store

        def call():
            res = store.batch_get_ranges(keys, ki, off, ln, ad)
            if res != want:
                bad = next(r for r, w in zip(res, want) if r != w)
                raise RuntimeError(f"batch_get_ranges: {bad!r}")

        return call


def flat(frags):
    ki = np.array([k for k, fr in enumerate(frags) for _ in fr], dtype=np.uint64)
    off = np.array([f[0] for fr in frags for f in fr], dtype=np.uint64)
    ln = np.array([f[1] for fr in frags for f in fr], dtype=np.uint64)
    ad = np.array([f[2] for fr in frags for f in fr], dtype=np.uint64)
    return ki, off, ln, ad


class Mooncake:
    def __init__(self, dram: int, tmp: str, procs: list, ranged: str = "get_into_ranges"):
        from mooncake.store import MooncakeDistributedStore

        bindir = os.path.dirname(sys.executable)
        rpc, http = free_port(), free_port()
        procs.append(subprocess.Popen([os.path.join(bindir, "mooncake_master"), f"--port={rpc}",
                                       "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_port(rpc, procs[-1], "mooncake_master")
        wait_port(http, procs[-1], "mooncake_master's metadata server")
        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", f"http://127.0.0.1:{http}/metadata", dram, 128 << 20, "tcp", "",
                              f"127.0.0.1:{rpc}")
        if rc != 0:
            raise RuntimeError(f"setup returned {rc}")
        self.mode = "mooncake"
        self.keep = []
        # get_into_ranges: the ranged call Mooncake's own structured store makes (one destination
        # buffer, offsets into it). --mc-ranged batch_get_into_multi_buffer_ranges tries the other
        # one (0.3.13.post1 answers -600, INVALID_PARAMS, to one address per range).
        self.ranged_api = ranged

    def buffer(self, n: int):
        b = np.empty(n, dtype=np.uint8)
        if self.store.register_buffer(b.ctypes.data, b.nbytes) != 0:
            raise RuntimeError("register_buffer failed")
        self.keep.append(b)
        return b, b.ctypes.data

    def put_whole(self, keys, addrs, size):
        res = self.store.batch_put_from(keys, [int(a) for a in addrs], [size] * len(keys))
        bad = [r for r in res if r != 0]
        if bad:
            raise RuntimeError(f"batch_put_from returned {bad[0]}")

    def get_whole(self, keys, addrs, size):
        res = self.store.batch_get_into(keys, [int(a) for a in addrs], [size] * len(keys))
        bad = [r for r in res if r != size]
        if bad:
            raise RuntimeError(f"batch_get_into returned {bad[0]}")

    def ranged_put(self, keys, object_len, frags):
        # Each key's parts in object order (offsets ascending, back to back): the multi-buffer put.
        ptrs = [[int(f[2]) for f in fr] for fr in frags]
        sizes = [[int(f[1]) for f in fr] for fr in frags]
        res = self.store.batch_put_from_multi_buffers(keys, ptrs, sizes)
        bad = [r for r in res if r != 0]
        if bad:
            raise RuntimeError(f"batch_put_from_multi_buffers returned {bad[0]}")

    def ranged_get_call(self, parts):
        """One call for a layer group: parts = [(keys, frags, buffer base)] per pool."""
        store = self.store
        if self.ranged_api == "batch_get_into_multi_buffer_ranges":
            keys = [k for ks, _, _ in parts for k in ks]
            frags = [f for _, fs, _ in parts for f in fs]
            ptrs = [[int(f[2]) for f in fr] for fr in frags]
            sizes = [[int(f[1]) for f in fr] for fr in frags]
            offs = [[int(f[0]) for f in fr] for fr in frags]
            want = [sum(s) for s in sizes]

            def call():
                res = store.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offs)
                if list(res) != want:
                    bad = next(r for r, w in zip(res, want) if r != w)
                    raise RuntimeError(f"batch_get_into_multi_buffer_ranges returned {bad}")
        else:
            # get_into_ranges(buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes): per
            # destination buffer (a pool's KV buffer), its keys, and per key its ranges, the
            # destination an offset into that buffer (as Mooncake's own structured store calls it).
            bases = [int(b) for _, _, b in parts]
            keys = [list(ks) for ks, _, _ in parts]
            dst = [[[int(f[2]) - b for f in fr] for fr in fs] for _, fs, b in parts]
            src = [[[int(f[0]) for f in fr] for fr in fs] for _, fs, _ in parts]
            sizes = [[[int(f[1]) for f in fr] for fr in fs] for _, fs, _ in parts]

            def call():
                res = store.get_into_ranges(bases, keys, dst, src, sizes)
                if res != sizes:
                    raise RuntimeError(f"get_into_ranges returned {res[0][:1]}, wanted {sizes[0][:1]}")

        return call


def whole(st, args, row):
    n, size = args.keys, args.object
    src, sa0 = st.buffer(n * size)
    dst, da0 = st.buffer(n * size)
    sa = [sa0 + i * size for i in range(n)]
    da = [da0 + i * size for i in range(n)]
    puts, gets = [], []
    for rep in range(args.repeat + 1):  # pass 0 untimed
        keys = [f"peers-r{args.round}-p{rep}-k{i}" for i in range(n)]
        src[:] = pattern(src.size, args.round * 100 + rep + 1)
        dst[:] = 0
        t0 = time.perf_counter()
        st.put_whole(keys, sa, size)
        t1 = time.perf_counter()
        st.get_whole(keys, da, size)
        t2 = time.perf_counter()
        bad = int(np.count_nonzero(src != dst))
        if bad:
            raise RuntimeError(f"{bad} mismatched bytes")
        if rep:
            puts.append(t1 - t0)
            gets.append(t2 - t1)
    total = n * size
    row.update({"test": "whole", "keys": n, "object_bytes": size, "put_ms": statistics.median(puts) * 1e3,
                "get_ms": statistics.median(gets) * 1e3, "put_gbps": total / statistics.median(puts) / 1e9,
                "get_gbps": total / statistics.median(gets) / 1e9, "verified": True, "mismatched_bytes": 0})


def restore(st, args, row):
    pages = args.pages
    kv = []  # per pool: (view, addr, mirror)
    for pi, (_, lb, layers) in enumerate(POOLS):
        view, addr = st.buffer(len(layers) * pages * lb)
        view[:] = pattern(view.size, 1000 + pi + args.round)
        kv.append((view, addr, view.copy()))
    tag = f"peers-restore-r{args.round}"
    keys = [[f"{tag}/p{page}/{name}" for page in range(pages)] for name, _, _ in POOLS]

    def frags(pi, pool_layers):
        _, lb, _ = POOLS[pi]
        base = kv[pi][1]
        return [[(l * lb, lb, base + (l * pages + page) * lb) for l in pool_layers] for page in range(pages)]

    t0 = time.perf_counter()
    for pi, (_, lb, layers) in enumerate(POOLS):
        st.ranged_put(keys[pi], len(layers) * lb, frags(pi, range(len(layers))))
    put_s = time.perf_counter() - t0
    # The calls a connector builds once: per group, per pool with layers in it.
    groups = []
    for g0 in range(0, 61, GROUP):
        parts = []
        for pi, (_, _, layers) in enumerate(POOLS):
            pl = [i for i, lay in enumerate(layers) if g0 <= lay < g0 + GROUP]
            if pl:
                parts.append((keys[pi], frags(pi, pl), kv[pi][1]))
        groups.append([st.ranged_get_call(parts)])
    total = sum(len(layers) * pages * lb for _, lb, layers in POOLS)
    ttfl, load = [], []
    for rep in range(args.repeat + 1):
        for view, _, _ in kv:
            view[:] = 0
        t0 = time.perf_counter()
        first = None
        for calls in groups:
            for call in calls:
                call()
            if first is None:
                first = time.perf_counter() - t0
        dt = time.perf_counter() - t0
        bad = sum(int(np.count_nonzero(view != mirror)) for view, _, mirror in kv)
        if bad:
            raise RuntimeError(f"restore: {bad} mismatched bytes")
        if rep:
            ttfl.append(first)
            load.append(dt)
    row.update({"test": "restore", "pages": pages, "layer_group": GROUP, "groups": len(groups),
                "calls_per_restore": sum(len(c) for c in groups), "fragments": sum(len(l) for _, _, l in POOLS) * pages,
                "bytes": total, "put_ms": put_s * 1e3, "ttfl_us": statistics.median(ttfl) * 1e6,
                "load_ms": statistics.median(load) * 1e3, "load_gbps": total / statistics.median(load) / 1e9,
                "verified": True, "mismatched_bytes": 0})
    if isinstance(st, Mooncake):
        row["ranged_api"] = st.ranged_api


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, choices=ENGINES)
    p.add_argument("--tests", default="whole,restore")
    p.add_argument("--keys", type=int, default=256)
    p.add_argument("--object", type=int, default=61 * 1728, help="bytes per object (default: one page, 61 layers)")
    p.add_argument("--pages", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dram", type=int, default=512 << 20)
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--mc-ranged", default="get_into_ranges",
                   choices=["get_into_ranges", "batch_get_into_multi_buffer_ranges"],
                   help="Mooncake's ranged call for the restore")
    args = p.parse_args()
    base = {"bench": "peers-store", "engine": args.engine, "round": args.round, "repeat": args.repeat,
            "dram_bytes": args.dram}
    procs, tmp = [], tempfile.mkdtemp(prefix="peers-store-")
    st = None
    try:
        st = Umbp(args.engine, args.dram, tmp, procs) if args.engine.startswith("umbp") else \
            Mooncake(args.dram, tmp, procs, args.mc_ranged)
        base["mode"] = st.mode
    except Exception as e:
        for t in args.tests.split(","):
            print(json.dumps({**base, "test": t, "error": f"setup: {type(e).__name__}: {e}"[:300]}), flush=True)
    if st is not None:
        for t in args.tests.split(","):
            row = dict(base)
            try:
                (whole if t == "whole" else restore)(st, args, row)
            except Exception as e:
                row.update({"test": t, "error": f"{type(e).__name__}: {e}"[:300]})
            print(json.dumps(row), flush=True)
    for proc in procs:
        proc.kill()
        proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)
    os._exit(0)


if __name__ == "__main__":
    main()
