"""Per-call cost of te.compat (the Mooncake drop-in) against te's native Python API and the
released Mooncake wheel, for the calls connectors make, in one run (figures in docs/python.md,
"Switching from Mooncake / mori").

Part "layer": what the layer adds. The layer and the native call drive the same stand-in engine
or store, whose calls return at once, so the difference is the layer's own work (argument
checks, the connector's lists turned into arrays, codes and logging); the native call gets its
address arrays built beforehand, as te's API expects. Budget: 2 us per call + 20 ns per address.

Part "end to end": the same bytes moved over tcp on loopback between two engines of this
process, through te's native API, through the layer, and through the wheel's engine (when
importable: run it with the venv scripts/python-tests.sh builds); and the restore path's store
calls (batch_is_exist, batch_get_into of 4 KiB pages) through the layer on UMBP (local mode)
and through the wheel's store with a mooncake_master started from the wheel. Absolute and noisy
on a shared 2-core machine; compare within one run only.

Rounds are interleaved; each figure is the median over rounds of the mean per call.

    target/py-venv/bin/python scripts/compat-overhead.py [--rounds 11] [--json] [--layer-only]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import numpy as np

from te.compat import mooncake as compat
from te.compat import mooncake_store as compat_store

BLOCK = 64  # bytes per address: small, so bookkeeping is what is measured
SIZES = [1, 16, 256, 1024]


class _Done:
    def wait(self, timeout=None):
        return None


class StandInEngine:
    """te.TransferEngine's submit calls, answering at once."""

    def submit_write(self, seg, local, remote, lengths, **kw):
        return _Done()

    submit_read = submit_write
    write = submit_write


class StandInStore:
    """te.umbp.Store's calls the store layer makes, answering at once ('all present')."""

    def object_lens(self, keys):
        return [BLOCK] * len(keys)

    def batch_put_ranges(self, keys, object_lens, key_index, offsets, lengths, addrs, depths=None):
        return [None] * len(keys)

    def batch_get_whole(self, keys, addrs, capacities):
        return [BLOCK] * len(keys)


def per_call_us(fn, budget_s=0.02, max_calls=2000):
    """Mean microseconds per call over about budget_s (at least 3 calls)."""
    t0 = time.perf_counter_ns()
    fn()
    one = max(time.perf_counter_ns() - t0, 1)
    calls = int(max(3, min(max_calls, budget_s * 1e9 / one)))
    t = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t) / calls / 1000.0


def median_rows(cases: dict, rounds: int) -> dict:
    for fn in cases.values():
        fn()  # warm: segments open, connections up
    samples = {k: [] for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            samples[k].append(per_call_us(fn))
    return {k: statistics.median(v) for k, v in samples.items()}


def layer_rows(rounds: int) -> list:
    """The layer against the native call on stand-ins: the layer's own cost."""
    eng = compat.TransferEngine()
    eng._engine = StandInEngine()
    peer = "127.0.0.1:1"
    eng._segments[peer] = object()
    native = eng._engine
    st = compat_store.MooncakeDistributedStore()
    st._store = StandInStore()
    rows = []
    for n in SIZES:
        s = [0x7F0000000000 + i * 2 * BLOCK for i in range(n)]
        d = [0x7E0000000000 + i * 2 * BLOCK for i in range(n)]
        lens = [BLOCK] * n
        keys = [f"page-{i:08x}" for i in range(n)]
        sa, da, la = (np.asarray(x, dtype=np.uint64) for x in (s, d, lens))
        seg = eng._segments[peer]
        cases = {
            ("transfer_sync_write" if n == 1 else "batch_transfer_sync_write", "native"):
                (lambda: native.write(seg, s[0], d[0], BLOCK).wait()) if n == 1
                else (lambda: native.write(seg, sa, da, la).wait()),
            ("transfer_sync_write" if n == 1 else "batch_transfer_sync_write", "layer"):
                (lambda: eng.transfer_sync_write(peer, s[0], d[0], BLOCK)) if n == 1
                else (lambda: eng.batch_transfer_sync_write(peer, s, d, lens)),
            ("batch_transfer_async_write+status", "native"): lambda: native.submit_write(seg, sa, da, la).wait(),
            ("batch_transfer_async_write+status", "layer"):
                lambda: eng.get_batch_transfer_status([eng.batch_transfer_async_write(peer, s, d, lens)]),
            ("batch_is_exist", "native"): lambda: st._store.object_lens(keys),
            ("batch_is_exist", "layer"): lambda: st.batch_is_exist(keys),
            ("batch_put_from", "native"): lambda: st._store.batch_put_ranges(keys, la, np.arange(n, dtype=np.uint64),
                                                                             0, la, sa),
            ("batch_put_from", "layer"): lambda: st.batch_put_from(keys, s, lens),
            ("batch_get_into", "native"): lambda: st._store.batch_get_whole(keys, sa, la),
            ("batch_get_into", "layer"): lambda: st.batch_get_into(keys, s, lens),
        }
        med = median_rows(cases, rounds)
        for call in dict.fromkeys(c for c, _ in cases):
            over = med[(call, "layer")] - med[(call, "native")]
            rows.append({"part": "layer", "call": call, "addresses": n,
                         "native_us": round(med[(call, "native")], 3), "layer_us": round(med[(call, "layer")], 3),
                         "overhead_us": round(over, 3), "budget_us": round(2.0 + 0.02 * n, 3),
                         "within_budget": over <= 2.0 + 0.02 * n})
    return rows


def pair(cls, n_bytes):
    a, b = cls(), cls()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src = (np.arange(n_bytes, dtype=np.uint64) % 251).astype(np.uint8)
    dst = np.zeros(n_bytes, np.uint8)
    assert a.register_memory(src.ctypes.data, n_bytes) == 0
    assert b.register_memory(dst.ctypes.data, n_bytes) == 0
    return a, b, src, dst


def end_to_end_rows(rounds: int) -> list:
    n_bytes = max(SIZES) * BLOCK * 2
    spec = importlib.util.find_spec("mooncake")
    wheel_cls = None
    if spec is not None and "te.compat" not in repr(spec.loader):
        from mooncake.engine import TransferEngine as wheel_cls
    ours = pair(compat.TransferEngine, n_bytes)
    theirs = pair(wheel_cls, n_bytes) if wheel_cls else None
    rows = []
    for n in SIZES:
        a, b, src, dst = ours
        peer = f"127.0.0.1:{b.get_rpc_port()}"
        s = [src.ctypes.data + i * 2 * BLOCK for i in range(n)]
        d = [dst.ctypes.data + i * 2 * BLOCK for i in range(n)]
        lens = [BLOCK] * n
        engine, seg = a._engine, a._segment(peer)
        sa, da, la = (np.asarray(x, dtype=np.uint64) for x in (s, d, lens))
        call = "transfer_sync_write" if n == 1 else "batch_transfer_sync_write"
        if n == 1:
            cases = {"native": lambda: engine.write(seg, s[0], d[0], BLOCK),
                     "layer": lambda: a.transfer_sync_write(peer, s[0], d[0], BLOCK)}
        else:
            cases = {"native": lambda: engine.write(seg, sa, da, la),
                     "layer": lambda: a.batch_transfer_sync_write(peer, s, d, lens)}
        if theirs:
            wa, wb, wsrc, wdst = theirs
            wpeer = f"127.0.0.1:{wb.get_rpc_port()}"
            ws = [wsrc.ctypes.data + i * 2 * BLOCK for i in range(n)]
            wd = [wdst.ctypes.data + i * 2 * BLOCK for i in range(n)]
            cases["wheel"] = (lambda: wa.transfer_sync_write(wpeer, ws[0], wd[0], BLOCK)) if n == 1 else \
                (lambda: wa.batch_transfer_sync_write(wpeer, ws, wd, lens))
        med = median_rows(cases, rounds)
        assert np.array_equal(dst[:2 * n * BLOCK].reshape(n, 2, BLOCK)[:, 0], src[:2 * n * BLOCK].reshape(n, 2, BLOCK)[:, 0])
        rows.append({"part": "end_to_end", "call": call, "addresses": n, "bytes_per_address": BLOCK,
                     "native_us": round(med["native"], 1), "layer_us": round(med["layer"], 1),
                     "wheel_us": round(med["wheel"], 1) if "wheel" in med else None})
    return rows


def store_rows(rounds: int) -> list:
    """The restore path's store calls (existence, then pages into registered memory) through the
    layer on UMBP (local mode) and through the wheel's store with its mooncake_master."""
    import os
    import socket
    import subprocess

    spec = importlib.util.find_spec("mooncake")
    if spec is None or "te.compat" in repr(spec.loader):
        return []
    from mooncake.store import MooncakeDistributedStore as WheelStore

    def free_port():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    port = free_port()
    master = subprocess.Popen([os.path.join(list(spec.submodule_search_locations)[0], "mooncake_master"),
                               "-rpc_port", str(port), "-metrics_port", str(free_port())],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        n_max, page = max(SIZES), 4096
        stores = {"layer": (compat_store.MooncakeDistributedStore(), "local://"),
                  "wheel": (WheelStore(), f"127.0.0.1:{port}")}
        bufs = {}
        for name, (st, addr) in stores.items():
            assert st.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", addr) == 0
            buf = (np.arange(2 * n_max * page, dtype=np.uint64) % 251).astype(np.uint8)
            assert st.register_buffer(buf.ctypes.data, buf.nbytes) == 0
            keys = [f"page-{i}" for i in range(n_max)]
            ptrs = [buf.ctypes.data + i * page for i in range(n_max)]
            assert st.batch_put_from(keys, ptrs, [page] * n_max) == [0] * n_max
            bufs[name] = buf
        rows = []
        for n in SIZES:
            keys = [f"page-{i}" for i in range(n)]
            cases = {}
            for name, (st, _) in stores.items():
                dst = [bufs[name].ctypes.data + (n_max + i) * page for i in range(n)]
                cases[("batch_is_exist", name)] = lambda st=st: st.batch_is_exist(keys)
                cases[("batch_get_into", name)] = lambda st=st, dst=dst: st.batch_get_into(keys, dst, [page] * n)
            med = median_rows(cases, rounds)
            for call in ("batch_is_exist", "batch_get_into"):
                rows.append({"part": "store_end_to_end", "call": call, "addresses": n, "bytes_per_address": page,
                             "layer_us": round(med[(call, "layer")], 1), "wheel_us": round(med[(call, "wheel")], 1)})
        for name, (st, _) in stores.items():
            st.unregister_buffer(bufs[name].ctypes.data)
            st.close()
        return rows
    finally:
        master.kill()
        master.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layer-only", action="store_true")
    args = ap.parse_args()
    rows = layer_rows(args.rounds)
    if not args.layer_only:
        rows += end_to_end_rows(args.rounds)
        rows += store_rows(args.rounds)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{'layer vs native (stand-ins)':36} {'addrs':>6} {'native us':>10} {'layer us':>10} {'added us':>9} {'budget':>7}")
    for r in rows:
        if r["part"] == "layer":
            print(f"{r['call']:36} {r['addresses']:6d} {r['native_us']:10.3f} {r['layer_us']:10.3f} "
                  f"{r['overhead_us']:9.3f} {r['budget_us']:7.2f}{'' if r['within_budget'] else '  OVER'}")
    e2e = [r for r in rows if r["part"] == "end_to_end"]
    if e2e:
        print(f"\n{'end to end, tcp loopback':36} {'addrs':>6} {'native us':>10} {'layer us':>10} {'wheel us':>10}")
        for r in e2e:
            wheel = f"{r['wheel_us']:10.1f}" if r["wheel_us"] is not None else "         -"
            print(f"{r['call']:36} {r['addresses']:6d} {r['native_us']:10.1f} {r['layer_us']:10.1f} {wheel}")
    st = [r for r in rows if r["part"] == "store_end_to_end"]
    if st:
        print(f"\n{'store, 4 KiB pages (UMBP local vs wheel)':36} {'keys':>6} {'layer us':>10} {'wheel us':>10}")
        for r in st:
            print(f"{r['call']:36} {r['addresses']:6d} {r['layer_us']:10.1f} {r['wheel_us']:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
