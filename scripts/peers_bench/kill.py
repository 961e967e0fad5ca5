"""A peer that dies: the target process is SIGKILLed while a 1 GiB write batch (1 MiB requests)
to it runs. Measured: seconds from the kill until the engine's call returns an error (or that it
had not returned after --limit seconds, or that it returned success), and whether the source
buffer can be written at once after the call returned. One JSON line.

Each engine's own call: ours ``submit_write`` then ``Batch.wait()``; Mooncake
``batch_transfer_sync_write`` (blocking; run on a thread so a call that never returns can be
reported); NIXL ``initialize_xfer`` + ``transfer`` + ``check_xfer_state`` until it leaves PROC.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engines  # noqa: E402
import p2p  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, choices=["ours", "mooncake", "nixl"])
    p.add_argument("--bytes", type=p2p.size, default=p2p.size("1G"))
    p.add_argument("--block", type=p2p.size, default=p2p.size("1M"))
    p.add_argument("--kill-after", type=float, default=0.2, help="seconds after the submit")
    p.add_argument("--limit", type=float, default=60.0)
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--no-next", dest="next", action="store_false",
                   help="skip the transfer to a restarted target after the failure")
    args = p.parse_args()
    row = {"bench": "peers-kill", "engine": args.engine, "bytes": args.bytes, "block_bytes": args.block,
           "round": args.round, "kill_after_s": args.kill_after, "ucx_tls": os.environ.get("UCX_TLS", "default")}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=p2p.target_main, args=(child, args.engine, args.bytes, {}), daemon=True)
    proc.start()
    status, info = parent.recv()
    if status != "ready":
        row["error"] = f"target failed: {info.strip().splitlines()[-1]}"
        print(json.dumps(row), flush=True)
        os._exit(1)
    buf = np.empty(args.bytes, dtype=np.uint8)
    buf[:] = 7
    ini = engines.make_initiator(args.engine, buf, info, {})
    ini.connect()
    n = args.bytes // args.block
    local = np.uint64(ini.base) + np.arange(n, dtype=np.uint64) * np.uint64(args.block)
    remote = np.uint64(info["addr"]) + np.arange(n, dtype=np.uint64) * np.uint64(args.block)
    lengths = np.full(n, args.block, dtype=np.uint64)
    # A small write first, so the connection exists before the big batch.
    ini.prepare("write", local[:1], remote[:1], lengths[:1])()
    result = {}
    done = threading.Event()

    def call():
        try:
            if args.engine == "ours":
                b = ini.engine.submit_write(ini.seg, local, remote, lengths)
                result["submitted"] = time.perf_counter()
                b.wait()
            elif args.engine == "mooncake":
                rc = ini.engine.batch_transfer_sync_write(ini.peer, [int(x) for x in local],
                                                          [int(x) for x in remote], [int(x) for x in lengths])
                if rc != 0:
                    raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
            else:
                a = ini.agent
                z = np.zeros(n, dtype=np.uint64)
                ld = a.get_xfer_descs(np.stack([local, lengths, z], axis=1), "DRAM")
                rd = a.get_xfer_descs(np.stack([remote, lengths, z], axis=1), "DRAM")
                h = a.initialize_xfer("WRITE", ld, rd, ini.remote)
                state = a.transfer(h)
                while state == "PROC":
                    state = a.check_xfer_state(h)
                if state != "DONE":
                    raise RuntimeError(f"NIXL state {state}")
            result["outcome"] = "success"
        except Exception as e:
            result["outcome"] = "error"
            result["message"] = f"{type(e).__name__}: {e}"[:300]
        result["returned"] = time.perf_counter()
        done.set()

    t = threading.Thread(target=call, daemon=True)
    t0 = time.perf_counter()
    t.start()
    time.sleep(args.kill_after)
    killed_at = time.perf_counter()
    os.kill(proc.pid, signal.SIGKILL)
    finished = done.wait(args.limit)
    if not finished:
        row.update({"outcome": f"no return within {args.limit:.0f} s", "seconds_to_return": None})
    else:
        row.update({"outcome": result["outcome"], "message": result.get("message"),
                    "seconds_to_return": result["returned"] - killed_at,
                    "returned_before_kill": result["returned"] < killed_at,
                    "call_seconds": result["returned"] - t0})
        # Freeing the source at once: the engine's deregistration, timed (bounded by --limit).
        freed = threading.Event()

        def free():
            try:
                if args.engine == "ours":
                    ini.reg.close()
                elif args.engine == "mooncake":
                    rc = ini.engine.unregister_memory(ini.base)
                    if rc != 0:
                        raise RuntimeError(f"unregister_memory returned {rc}")
                else:
                    ini.agent.deregister_memory(ini.reg_descs)
                result["freed"] = "ok"
            except Exception as e:
                result["freed"] = f"{type(e).__name__}: {e}"[:200]
            freed.set()

        t1 = time.perf_counter()
        threading.Thread(target=free, daemon=True).start()
        if freed.wait(args.limit):
            row.update({"deregister": result["freed"], "deregister_ms": (time.perf_counter() - t1) * 1e3})
        else:
            row.update({"deregister": f"no return within {args.limit:.0f} s", "deregister_ms": None})
    if finished and args.next:
        row.update(next_transfer(args, ini, buf, ctx))
    print(json.dumps(row), flush=True)
    os._exit(0)


def next_transfer(args, ini, buf, ctx):
    """After the failure: a new target process (the restarted peer, at a new address), the source
    registered again, and a 64 MiB write to it through the same initiator engine, byte-verified."""
    out = {}
    parent, child = ctx.Pipe()
    nbytes = 64 << 20
    proc = ctx.Process(target=p2p.target_main, args=(child, args.engine, nbytes, {}), daemon=True)
    proc.start()
    try:
        status, info = parent.recv()
        if status != "ready":
            raise RuntimeError("restarted target failed to start")
        shape = "1M:64M"
        n = nbytes // (1 << 20)
        local = np.uint64(ini.base) + np.arange(n, dtype=np.uint64) * np.uint64(1 << 20)
        remote = np.uint64(info["addr"]) + np.arange(n, dtype=np.uint64) * np.uint64(1 << 20)
        lengths = np.full(n, 1 << 20, dtype=np.uint64)
        buf[:nbytes] = p2p.pattern(nbytes, 77)
        t0 = time.perf_counter()
        if args.engine == "ours":
            ini.reg = ini.engine.register(buf)
            seg = ini.engine.open_segment(info["segment"])
            ini.engine.write(seg, local, remote, lengths)
        elif args.engine == "mooncake":
            if ini.engine.register_memory(ini.base, buf.nbytes) != 0:
                raise RuntimeError("register_memory failed")
            rc = ini.engine.batch_transfer_sync_write(info["peer"], [int(x) for x in local], [int(x) for x in remote],
                                                      [int(x) for x in lengths])
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
        else:
            a = ini.agent
            a.register_memory(a.get_reg_descs([(ini.base, buf.nbytes, 0, "")], "DRAM"))
            remote_name = a.add_remote_agent(info["meta"])
            z = np.zeros(n, dtype=np.uint64)
            h = a.initialize_xfer("WRITE", a.get_xfer_descs(np.stack([local, lengths, z], axis=1), "DRAM"),
                                  a.get_xfer_descs(np.stack([remote, lengths, z], axis=1), "DRAM"), remote_name)
            state = a.transfer(h)
            while state == "PROC":
                state = a.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL state {state}")
        out["next_ms"] = (time.perf_counter() - t0) * 1e3
        parent.send(("verify", shape, 8 << 20, 77))
        bad = parent.recv()
        out["next_transfer"] = "ok" if bad == 0 else f"{bad} mismatched bytes"
    except Exception as e:
        out["next_transfer"] = f"{type(e).__name__}: {e}"[:200]
    proc.kill()
    return out


if __name__ == "__main__":
    main()
