"""Per-call cost of te.compat (the Mooncake drop-in) against te's native Python API and the
released Mooncake wheel, for the calls connectors make, in one run (figures in docs/python.md,
"Switching from Mooncake / mori").

Part "layer": what the layer adds. The layer and the native call drive the same stand-in engine
or store, whose calls return at once, so the difference is the layer's own work (argument
checks, the connector's lists turned into arrays, codes and logging); the native call gets its
address arrays built beforehand, as te's API expects. Budget: 2 us per call + 20 ns per address.
Timed in the calling thread's CPU time (nothing here waits), so other processes on a shared
machine do not inflate it; the end-to-end parts are wall time.

Part "end to end": the same bytes moved over tcp on loopback between two engines of this
process, through te's native API, through the layer, and through the wheel's engine (when
importable: run it with the venv scripts/python-tests.sh builds); and the restore path's store
calls (batch_is_exist, batch_get_into of 4 KiB pages) through the layer on UMBP (local mode)
and through the wheel's store with a mooncake_master started from the wheel. Absolute and noisy
on a shared 2-core machine; compare within one run only.

Rounds are interleaved; each figure is the median over rounds of the mean per call.

With ``--baseline COMMIT`` the layer part also runs te.compat's Python modules as they were at
COMMIT (read with ``git show``, imported as a package of their own, on the same native module),
interleaved with the current ones: an A/B of a change to the layer in one run.

With ``--ab-pythonpath DIR`` the layer part runs in fresh processes, alternately with ``te`` (its
native module included) imported from DIR and from this process's path, ``--ab-runs`` times
each: an A/B of a change to the native module too (one process cannot load two of them). Each
figure is the median over the runs.

    target/py-venv/bin/python scripts/compat-overhead.py [--rounds 11] [--json] [--layer-only]
        [--baseline COMMIT] [--ab-pythonpath DIR [--ab-runs 5]]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
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
    read = submit_write


class StandInStore:
    """te.umbp.Store's calls the store layer makes, answering at once ('all present')."""

    def object_lens(self, keys):
        return [BLOCK] * len(keys)

    def batch_put_ranges(self, keys, object_lens, key_index, offsets, lengths, addrs, depths=None):
        return [None] * len(keys)

    def batch_get_whole(self, keys, addrs, capacities):
        return [BLOCK] * len(keys)


def per_call_us(fn, budget_s=0.02, max_calls=2000, clock=time.perf_counter_ns):
    """Mean microseconds per call over about budget_s (at least 3 calls), on ``clock``."""
    t0 = clock()
    fn()
    one = max(clock() - t0, 1)
    calls = int(max(3, min(max_calls, budget_s * 1e9 / one)))
    t = clock()
    for _ in range(calls):
        fn()
    return (clock() - t) / calls / 1000.0


def median_rows(cases: dict, rounds: int, clock=time.perf_counter_ns) -> dict:
    for fn in cases.values():
        fn()  # warm: segments open, connections up
    samples = {k: [] for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            samples[k].append(per_call_us(fn, clock=clock))
    return {k: statistics.median(v) for k, v in samples.items()}


def baseline_modules(commit: str):
    """te.compat's mooncake and mooncake_store modules as at ``commit``, imported as package
    ``te_compat_at_<commit>`` (their relative imports resolve inside it)."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    name = "te_compat_at_" + "".join(c for c in commit if c.isalnum())
    pkg = os.path.join(tempfile.mkdtemp(prefix="compat-ab-"), name)
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    for mod in ("mooncake", "mooncake_store"):
        src = subprocess.run(["git", "show", f"{commit}:python/te/compat/{mod}.py"], capture_output=True, text=True,
                             check=True, cwd=root).stdout
        with open(os.path.join(pkg, f"{mod}.py"), "w") as f:
            f.write(src)
    sys.path.insert(0, os.path.dirname(pkg))
    return importlib.import_module(f"{name}.mooncake"), importlib.import_module(f"{name}.mooncake_store")


def stand_ins(engine_mod, store_mod):
    eng = engine_mod.TransferEngine()
    eng._engine = StandInEngine()
    eng._segments["127.0.0.1:1"] = object()
    st = store_mod.MooncakeDistributedStore()
    st._store = StandInStore()
    return eng, st


def layer_rows(rounds: int, baseline=None) -> list:
    """The layer against the native call on stand-ins: the layer's own cost (and the layer as
    at the baseline commit, when given, in the same interleaved rounds)."""
    eng, st = stand_ins(compat, compat_store)
    peer = "127.0.0.1:1"
    native = eng._engine
    arms = {"layer": (eng, st)}
    if baseline is not None:
        arms["baseline"] = stand_ins(*baseline)
    rows = []
    for n in SIZES:
        s = [0x7F0000000000 + i * 2 * BLOCK for i in range(n)]
        d = [0x7E0000000000 + i * 2 * BLOCK for i in range(n)]
        lens = [BLOCK] * n
        keys = [f"page-{i:08x}" for i in range(n)]
        sa, da, la = (np.asarray(x, dtype=np.uint64) for x in (s, d, lens))
        seg = eng._segments[peer]
        sync = "transfer_sync_write" if n == 1 else "batch_transfer_sync_write"
        ki = np.arange(n, dtype=np.uint64)
        cases = {
            # te's blocking call, as a connector moving to te's API makes it (its report unread)
            (sync, "native"): (lambda: native.write(seg, s[0], d[0], BLOCK)) if n == 1
            else (lambda: native.write(seg, sa, da, la)),
            ("batch_transfer_async_write+status", "native"): lambda: native.submit_write(seg, sa, da, la).wait(),
            ("batch_is_exist", "native"): lambda: st._store.object_lens(keys),
            ("batch_put_from", "native"): lambda: st._store.batch_put_ranges(keys, la, ki, 0, la, sa),
            ("batch_get_into", "native"): lambda: st._store.batch_get_whole(keys, sa, la),
        }
        for arm, (e, t) in arms.items():
            cases[(sync, arm)] = (lambda e=e: e.transfer_sync_write(peer, s[0], d[0], BLOCK)) if n == 1 \
                else (lambda e=e: e.batch_transfer_sync_write(peer, s, d, lens))
            cases[("batch_transfer_async_write+status", arm)] = \
                lambda e=e: e.get_batch_transfer_status([e.batch_transfer_async_write(peer, s, d, lens)])
            cases[("batch_is_exist", arm)] = lambda t=t: t.batch_is_exist(keys)
            cases[("batch_put_from", arm)] = lambda t=t: t.batch_put_from(keys, s, lens)
            cases[("batch_get_into", arm)] = lambda t=t: t.batch_get_into(keys, s, lens)
        # The calling thread's CPU time: on stand-ins the layer and the native call never wait, so
        # this is their own work, and other processes taking the shared CPUs do not count.
        med = median_rows(cases, rounds, clock=time.thread_time_ns)
        for call in dict.fromkeys(c for c, _ in cases):
            over = med[(call, "layer")] - med[(call, "native")]
            row = {"part": "layer", "call": call, "addresses": n,
                   "native_us": round(med[(call, "native")], 3), "layer_us": round(med[(call, "layer")], 3),
                   "overhead_us": round(over, 3), "budget_us": round(2.0 + 0.02 * n, 3),
                   "within_budget": over <= 2.0 + 0.02 * n}
            if "baseline" in arms:
                row["baseline_us"] = round(med[(call, "baseline")], 3)
                row["baseline_overhead_us"] = round(med[(call, "baseline")] - med[(call, "native")], 3)
            rows.append(row)
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


def ab_rows(old_path: str, runs: int, rounds: int) -> list:
    """The layer part in fresh processes, alternately with te from ``old_path`` ("A") and from
    this process's path ("B"); per row the median over runs of each arm's added microseconds."""
    new_path = os.pathsep.join(p for p in sys.path if p)
    samples: dict = {}
    for _ in range(runs):
        for arm, path in (("A", old_path), ("B", new_path)):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--layer-only", "--json", "--rounds",
                                  str(rounds)], env={**os.environ, "PYTHONPATH": path}, capture_output=True,
                                 text=True, check=True).stdout
            for line in out.splitlines():
                r = json.loads(line)
                row = samples.setdefault((r["call"], r["addresses"]), {"budget_us": r["budget_us"]})
                row.setdefault(arm, []).append(r["overhead_us"])
                row.setdefault(arm + "_native", []).append(r["native_us"])
    rows = []
    for (call, n), v in samples.items():
        a, b = statistics.median(v["A"]), statistics.median(v["B"])
        rows.append({"part": "ab", "call": call, "addresses": n, "native_us": round(statistics.median(v["B_native"]), 3),
                     "a_overhead_us": round(a, 3), "b_overhead_us": round(b, 3), "b_over_a": round(b / a, 2),
                     "budget_us": v["budget_us"], "b_within_budget": b <= v["budget_us"]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layer-only", action="store_true")
    ap.add_argument("--baseline", metavar="COMMIT", help="also time the layer as at COMMIT (A/B)")
    ap.add_argument("--ab-pythonpath", metavar="DIR", help="A/B the layer part against te imported from DIR")
    ap.add_argument("--ab-runs", type=int, default=5)
    args = ap.parse_args()
    if args.ab_pythonpath:
        rows = ab_rows(args.ab_pythonpath, args.ab_runs, args.rounds)
        if args.json:
            for r in rows:
                print(json.dumps(r))
            return 0
        print(f"{'layer added us, A/B':36} {'addrs':>6} {'native us':>10} {'A added':>9} {'B added':>9} {'B/A':>5} "
              f"{'budget':>7}")
        for r in rows:
            print(f"{r['call']:36} {r['addresses']:6d} {r['native_us']:10.3f} {r['a_overhead_us']:9.3f} "
                  f"{r['b_overhead_us']:9.3f} {r['b_over_a']:5.2f} {r['budget_us']:7.2f}"
                  + ("" if r["b_within_budget"] else "  OVER"))
        return 0
    rows = layer_rows(args.rounds, baseline_modules(args.baseline) if args.baseline else None)
    if not args.layer_only:
        rows += end_to_end_rows(args.rounds)
        rows += store_rows(args.rounds)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    ab = args.baseline is not None
    print(f"{'layer vs native (stand-ins)':36} {'addrs':>6} {'native us':>10} {'layer us':>10} {'added us':>9} "
          f"{'budget':>7}" + (f" {'baseline added us':>18}" if ab else ""))
    for r in rows:
        if r["part"] == "layer":
            print(f"{r['call']:36} {r['addresses']:6d} {r['native_us']:10.3f} {r['layer_us']:10.3f} "
                  f"{r['overhead_us']:9.3f} {r['budget_us']:7.2f}"
                  + (f" {r['baseline_overhead_us']:18.3f}" if ab else "")
                  + ("" if r["within_budget"] else "  OVER"))
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
