"""One engine, two processes on this host: a target (spawned child) exporting one buffer, an
initiator (this process) moving shapes to or from it. One JSON object per (shape, op) on stdout.

A shape is either BLOCK:TOTAL (contiguous BLOCK-byte requests covering TOTAL bytes, in batches of
at most --batch-bytes) or kv:FRAGMENT (seed 000's layout: LAYERS x PAGES fragments of FRAGMENT
bytes, remote slots permuted so nothing coalesces, one batch per layer group of 8 layers).

Per (shape, op): one untimed pass (connection, page faults), then --repeat timed passes; before
each pass the source is filled with a fresh position-dependent pattern and after it every
destination byte is compared with it (outside the timed region). Reported: GB/s (median pass),
batch latency p50/p99 over every batch of every pass, CPU seconds per GiB moved on each side
(getrusage of each whole process over the timed passes: the engine's own threads included).
A failed run prints a row with "error" and no figure.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engines  # noqa: E402

LAYERS, PAGES, GROUP = 61, 32, 8


def size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1]] if text[-1] in mult else int(text)


def slot(i: int, blocks: int, scatter: bool) -> int:
    """The same permutation as te-bench's --scatter."""
    if not scatter or blocks < 3:
        return i
    step = (blocks // 2) | 1
    while math.gcd(step, blocks) != 1:
        step += 2
    return (i * step) % blocks


class Shape:
    def __init__(self, text: str, batch_bytes: int):
        self.text = text
        if text.startswith("kv:"):
            self.kind = "kv"
            self.block = size(text[3:])
            self.count = LAYERS * PAGES
            self.scatter = True
            # Fragment index = layer * PAGES + page; one batch per group of GROUP layers.
            self.batches = [list(range(l0 * PAGES, min(l0 + GROUP, LAYERS) * PAGES)) for l0 in range(0, LAYERS, GROUP)]
        else:
            self.kind = "block"
            b, t = text.split(":")
            self.block, total = size(b), size(t)
            assert total % self.block == 0, text
            self.count = total // self.block
            self.scatter = False
            per = max(1, batch_bytes // self.block)
            self.batches = [list(range(i, min(i + per, self.count))) for i in range(0, self.count, per)]
        self.total = self.block * self.count
        self.slots = np.array([slot(i, self.count, self.scatter) for i in range(self.count)], dtype=np.int64)


_RAMPS: dict[int, np.ndarray] = {}


def pattern(n: int, seed: int) -> np.ndarray:
    """Position- and seed-dependent bytes: a hashed ramp (computed once per length) plus the seed."""
    ramp = _RAMPS.get(n)
    if ramp is None:
        i = np.arange(n, dtype=np.uint64)
        ramp = _RAMPS[n] = ((i * np.uint64(2654435761)) >> np.uint64(5)).astype(np.uint8)
    return ramp + np.uint8((seed * 7919) % 251 + 1)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def switches() -> int:
    """Context switches of this whole process so far (voluntary + involuntary)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw + r.ru_nivcsw


def remote_view(buf: np.ndarray, shape: Shape) -> np.ndarray:
    """The target's bytes in initiator order: fragment i at slot(i)."""
    return buf[: shape.total].reshape(shape.count, shape.block)[shape.slots].reshape(-1)


def target_main(conn, engine: str, nbytes: int, opts: dict):
    try:
        buf = np.empty(nbytes, dtype=np.uint8)
        buf[:] = 1  # touched: not the zero page
        t = engines.make_target(engine, buf, opts)
        conn.send(("ready", t.info))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        os._exit(1)
    shapes = {}
    while True:
        msg = conn.recv()
        cmd = msg[0]
        if cmd == "fill":  # (fill, shape text, batch_bytes, seed): pattern in initiator order
            sh = shapes.setdefault(msg[1], Shape(msg[1], msg[2]))
            view = buf[: sh.total].reshape(sh.count, sh.block)
            view[sh.slots] = pattern(sh.total, msg[3]).reshape(sh.count, sh.block)
            conn.send("ok")
        elif cmd == "verify":
            sh = shapes.setdefault(msg[1], Shape(msg[1], msg[2]))
            bad = int(np.count_nonzero(remote_view(buf, sh) != pattern(sh.total, msg[3])))
            conn.send(bad)
        elif cmd == "clear":
            buf[:] = 0
            conn.send("ok")
        elif cmd == "cpu":
            conn.send(cpu_s())
        elif cmd == "switches":
            conn.send(switches())
        elif cmd == "exit":
            conn.send("bye")
            sys.stdout.flush()
            os._exit(0)  # NIXL's and Mooncake's teardown at exit are not what we measure


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def first_contact(args, ini, ask, base_row, t_connect, info):
    """The first 4 KiB write to a target this initiator never reached, then a second one."""
    row = {**base_row, "bench": "peers-first-contact", "mode": args.first_contact,
           "connect_ms": t_connect * 1e3}
    try:
        if args.first_contact == "warm":
            t0 = time.perf_counter()
            ini.warm_up()
            row["warm_up_ms"] = (time.perf_counter() - t0) * 1e3
        run = ini.prepare("write", np.array([ini.base], dtype=np.uint64), np.array([info["addr"]], dtype=np.uint64),
                          np.array([4096], dtype=np.uint64))
        times = []
        for seed in (1, 2):
            ini_buf = np.frombuffer((ctypes.c_uint8 * 4096).from_address(ini.base), dtype=np.uint8)
            ini_buf[:] = pattern(4096, seed)
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
            bad = ask("verify", "4K:4K", 4096, seed)
            if bad:
                raise RuntimeError(f"{bad} mismatched bytes")
        row.update({"first_ms": times[0], "second_ms": times[1], "verified": True, "mismatched_bytes": 0})
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(row), flush=True)
    try:
        ask("exit")
    except Exception:
        pass
    os._exit(0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, choices=["ours", "mooncake", "nixl", "nixl-prep", "compat"])
    p.add_argument("--shapes", default="4K:16M,64K:64M,1M:64M,4M:64M,kv:1728,kv:8448,kv:37440")
    p.add_argument("--ops", default="write,read")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch-bytes", type=size, default=size("8M"))
    p.add_argument("--ours-transports", default="tcp")
    p.add_argument("--mooncake-protocol", default="tcp")
    p.add_argument("--path", default="tcp", help="label for the row (tcp, same-host)")
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--per-request", action="store_true",
                   help="kv shapes: one batch per request (all layers' fragments in one call, as vLLM's "
                        "Mooncake connector calls batch_transfer_sync_write), not one per layer group")
    p.add_argument("--first-contact", choices=["cold", "warm"],
                   help="instead of shapes: time opening the peer and the first 4 KiB write to it, "
                        "without (cold) or after (warm) the engine's warm-up call")
    args = p.parse_args()
    if args.first_contact:
        args.shapes = "4K:4K"
        args.ops = "write"
    opts = {"ours_transports": args.ours_transports, "mooncake_protocol": args.mooncake_protocol}
    shapes = [Shape(s, args.batch_bytes) for s in args.shapes.split(",")]
    if args.per_request:
        for sh in shapes:
            if sh.kind == "kv":
                sh.batches = [list(range(sh.count))]
    ops = args.ops.split(",")
    most = max(s.total for s in shapes)
    base_row = {"bench": "peers-p2p", "engine": args.engine, "api": "python", "path": args.path,
                "ucx_tls": os.environ.get("UCX_TLS", "default"), "round": args.round,
                "batching": "per request" if args.per_request else "per layer group"}

    def fail(why, **extra):
        print(json.dumps({**base_row, **extra, "error": why}), flush=True)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target_main, args=(child, args.engine, most, opts), daemon=True)
    proc.start()
    if not parent.poll(120):
        fail("target did not start within 120 s")
        proc.kill()
        os._exit(1)
    status, info = parent.recv()
    if status != "ready":
        fail(f"target failed: {info.strip().splitlines()[-1]}")
        os._exit(1)

    def ask(*msg):
        parent.send(msg)
        if not parent.poll(300):
            raise RuntimeError(f"target did not answer {msg[0]} within 300 s")
        return parent.recv()

    try:
        buf = np.empty(most, dtype=np.uint8)
        buf[:] = 1
        ini = engines.make_initiator(args.engine, buf, info, opts)
        t_connect = time.perf_counter()
        ini.connect()
        t_connect = time.perf_counter() - t_connect
    except Exception as e:
        fail(f"initiator setup failed: {type(e).__name__}: {e}")
        os._exit(1)
    if args.first_contact:
        first_contact(args, ini, ask, base_row, t_connect, info)
    for sh in shapes:
        local_all = np.uint64(ini.base) + np.arange(sh.count, dtype=np.uint64) * np.uint64(sh.block)
        remote_all = np.uint64(info["addr"]) + sh.slots.astype(np.uint64) * np.uint64(sh.block)
        for op in ops:
            row = {**base_row, "shape": sh.text, "kind": sh.kind, "op": op, "block_bytes": sh.block,
                   "requests": sh.count, "total_bytes": sh.total, "batches": len(sh.batches),
                   "scatter": sh.scatter, "repeat": args.repeat}
            try:
                runs = [ini.prepare(op, local_all[b], remote_all[b], np.full(len(b), sh.block, dtype=np.uint64))
                        for b in sh.batches]
                secs, lat, bad = [], [], 0
                cpu_i = cpu_t = 0.0
                sw_i = sw_t = 0
                for rep in range(args.repeat + 1):  # pass 0 is the untimed warm-up
                    seed = args.round * 1000 + rep + 1
                    if op == "write":
                        buf[: sh.total] = pattern(sh.total, seed)
                        ask("clear")
                    else:
                        buf[: sh.total] = 0
                        ask("fill", sh.text, args.batch_bytes, seed)
                    t_cpu0 = ask("cpu")
                    t_sw0 = ask("switches")
                    c0 = cpu_s()
                    s0 = switches()
                    t0 = time.perf_counter()
                    for run in runs:
                        b0 = time.perf_counter()
                        run()
                        if rep:
                            lat.append(time.perf_counter() - b0)
                    dt = time.perf_counter() - t0
                    c1 = cpu_s()
                    s1 = switches()
                    t_sw1 = ask("switches")
                    t_cpu1 = ask("cpu")
                    if op == "write":
                        miss = ask("verify", sh.text, args.batch_bytes, seed)
                    else:
                        miss = int(np.count_nonzero(buf[: sh.total] != pattern(sh.total, seed)))
                    bad += miss
                    if rep:
                        secs.append(dt)
                        cpu_i += c1 - c0
                        cpu_t += t_cpu1 - t_cpu0
                        sw_i += s1 - s0
                        sw_t += t_sw1 - t_sw0
                gib = sh.total * args.repeat / (1 << 30)
                if bad:
                    fail(f"{bad} mismatched bytes", **{k: v for k, v in row.items() if k not in base_row},
                         mismatched_bytes=bad)
                    continue
                gbps = [sh.total / s / 1e9 for s in secs]
                row.update({
                    "gbps": statistics.median(gbps), "gbps_runs": gbps,
                    "batch_p50_us": pct(lat, 0.5) * 1e6, "batch_p99_us": pct(lat, 0.99) * 1e6,
                    "cpu_s_per_gib_initiator": cpu_i / gib, "cpu_s_per_gib_target": cpu_t / gib,
                    # getrusage of each whole process; the target's includes answering this pipe
                    "switches_per_batch_initiator": sw_i / (len(runs) * args.repeat),
                    "switches_per_batch_target": sw_t / (len(runs) * args.repeat),
                    "mismatched_bytes": 0, "verified": True,
                })
                if hasattr(ini, "routes"):
                    # The route taken: the connected ones, preferred first (te's routes()).
                    row["routes"] = ini.routes()
                    row["route"] = next((r[0] for r in row["routes"] if r[2]), None)
                print(json.dumps(row), flush=True)
            except Exception as e:
                fail(f"{type(e).__name__}: {e}", **{k: v for k, v in row.items() if k not in base_row})
    try:
        ask("exit")
    except Exception:
        proc.kill()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
