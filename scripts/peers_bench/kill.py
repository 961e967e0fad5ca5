"""A peer that dies: the target process is SIGKILLed while a 1 GiB write batch (1 MiB requests)
to it runs. Measured: seconds from the kill until the engine's call returns an error (or that it
had not returned after --limit seconds, or that it returned success), and whether the source
buffer can be written at once after the call returned. One JSON line.

Each engine's own call: ours ``submit_write`` then ``Batch.wait()``; Mooncake
``batch_transfer_sync_write`` (blocking; run on a thread so a call that never returns can be
reported); NIXL ``initialize_xfer`` + ``transfer`` + ``check_xfer_state`` until it leaves PROC.
Then the target is restarted at the same address and the next transfer goes to it (next_transfer).
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
    p.add_argument("--restart-limit", type=float, default=90.0,
                   help="seconds to keep restarting a target that did not get the same address")
    p.add_argument("--ours-transports", default="tcp",
                   help="ours: TE_TRANSPORTS of both sides (shm,tcp: our same-host route, beside NIXL's default)")
    p.add_argument("--no-next", dest="next", action="store_false",
                   help="skip the transfer to a restarted target after the failure")
    args = p.parse_args()
    row = {"bench": "peers-kill", "engine": args.engine, "bytes": args.bytes, "block_bytes": args.block,
           "round": args.round, "kill_after_s": args.kill_after, "ucx_tls": os.environ.get("UCX_TLS", "default")}
    if args.engine == "ours":
        row["ours_transports"] = args.ours_transports
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    # Fixed addresses, so the restarted target can take them again (next_transfer).
    if args.engine == "ours":
        opts = {"port": engines.free_port(), "tcp_port": engines.free_port(), "name": f"peers-kill-{os.getpid()}",
                "ours_transports": args.ours_transports}
    elif args.engine == "nixl":
        opts = {"name": f"peers-kill-target-{os.getpid()}"}
    else:
        opts = {}
    proc = ctx.Process(target=p2p.target_main, args=(child, args.engine, args.bytes, opts), daemon=True)
    proc.start()
    status, info = parent.recv()
    if status != "ready":
        row["error"] = f"target failed: {info.strip().splitlines()[-1]}"
        print(json.dumps(row), flush=True)
        os._exit(1)
    buf = np.empty(args.bytes, dtype=np.uint8)
    buf[:] = 7
    ini = engines.make_initiator(args.engine, buf, info, {"ours_transports": args.ours_transports})
    ini.connect()
    n = args.bytes // args.block
    local = np.uint64(ini.base) + np.arange(n, dtype=np.uint64) * np.uint64(args.block)
    remote = np.uint64(info["addr"]) + np.arange(n, dtype=np.uint64) * np.uint64(args.block)
    lengths = np.full(n, args.block, dtype=np.uint64)
    # A small write first, so the connection exists before the big batch.
    ini.prepare("write", local[:1], remote[:1], lengths[:1])()
    if args.engine == "ours":
        row["route"] = next((r[0] for r in ini.routes() if r[2]), None)  # connected, preferred first
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
            result["free_start"] = time.perf_counter()
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
            result["free_end"] = time.perf_counter()
            freed.set()

        t1 = time.perf_counter()
        threading.Thread(target=free, daemon=True).start()
        if freed.wait(args.limit):
            # deregister_ms: from starting the freeing thread until the waiter saw it done (what a
            # caller waits); deregister_call_ms: the engine's call alone, on that thread.
            seen = time.perf_counter()
            row.update({"deregister": result["freed"], "deregister_ms": (seen - t1) * 1e3,
                        "deregister_call_ms": (result["free_end"] - result["free_start"]) * 1e3,
                        "deregister_wake_ms": (seen - result["free_end"]) * 1e3})
        else:
            row.update({"deregister": f"no return within {args.limit:.0f} s", "deregister_ms": None})
    if finished and args.next:
        if args.engine == "mooncake":
            opts = {"port": int(info["peer"].rsplit(":", 1)[1])}
        row.update(next_transfer(args, ini, buf, ctx, {"opts": opts, "info": info}))
    print(json.dumps(row), flush=True)
    os._exit(0)


def next_transfer(args, ini, buf, ctx, first):
    """After the failure: the target restarted (a new process) at the *same address* (ours: the
    same segment name and listeners; Mooncake: the same "127.0.0.1:<rpc port>"; NIXL: the same
    agent name), the source registered again, and a 64 MiB write to it through the same initiator
    engine and the same peer handle, byte-verified. Where that handle fails, the engine's way of
    reaching the peer afresh is tried and said (ours: open_segment; NIXL: remove_remote_agent +
    add_remote_agent)."""
    out = {}
    nbytes = 64 << 20
    same = {"ours": "segment", "mooncake": "peer", "nixl": "name"}[args.engine]
    proc = None
    try:
        # Mooncake's RPC port comes at random from a range of two: a target that got the other
        # one is stopped and started again (the tries are counted, for up to 90 s: the killed
        # target's port stays in TIME_WAIT about 60 s, and a listener without SO_REUSEADDR cannot
        # bind it until then).
        t_restart = time.perf_counter()
        got = []
        for tries in range(1, 1000):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=p2p.target_main, args=(child, args.engine, nbytes, first["opts"]), daemon=True)
            proc.start()
            if not parent.poll(120):
                raise RuntimeError("restarted target did not start within 120 s")
            status, info = parent.recv()
            if status != "ready":
                why = info.strip().splitlines()[-1]
                if args.engine != "mooncake" or time.perf_counter() - t_restart > args.restart_limit:
                    raise RuntimeError(f"restarted target failed ({tries} starts): {why}")
                got.append(why)  # e.g. "mooncake initialize returned -1": its port still taken
                proc.join()
                continue
            got.append(info.get(same))
            if info.get(same) == first["info"].get(same) or time.perf_counter() - t_restart > args.restart_limit:
                break
            proc.kill()
            proc.join()
        out["same_address"] = status == "ready" and info.get(same) == first["info"].get(same)
        out["restart_tries"] = tries
        out["restart_s"] = time.perf_counter() - t_restart
        if not out["same_address"]:
            out["restart_addresses"] = sorted(set(got))[:4]
            raise RuntimeError(f"the restarted target did not get the same address in {out['restart_s']:.0f} s "
                               f"({tries} starts; it got {', '.join(map(str, sorted(set(got))[:3]))})")
        shape = "1M:64M"
        n = nbytes // (1 << 20)
        local = np.uint64(ini.base) + np.arange(n, dtype=np.uint64) * np.uint64(1 << 20)
        remote = np.uint64(info["addr"]) + np.arange(n, dtype=np.uint64) * np.uint64(1 << 20)
        lengths = np.full(n, 1 << 20, dtype=np.uint64)
        buf[:nbytes] = p2p.pattern(nbytes, 77)
        steps = []

        def attempt(label, fn):
            t0 = time.perf_counter()
            try:
                fn()
                steps.append(f"{label}: ok")
                out["next_ms"] = (time.perf_counter() - t0) * 1e3
                return True
            except Exception as e:
                steps.append(f"{label}: {type(e).__name__}: {e}"[:200])
                return False

        if args.engine == "ours":
            ini.reg = ini.engine.register(buf)

            def again():
                ini.seg = ini.engine.open_segment(info["segment"])
                ini.engine.write(ini.seg, local, remote, lengths)

            attempt("same handle", lambda: ini.engine.write(ini.seg, local, remote, lengths)) or \
                attempt("after open_segment", again)
        elif args.engine == "mooncake":
            if ini.engine.register_memory(ini.base, buf.nbytes) != 0:
                raise RuntimeError("register_memory failed")

            def write():
                rc = ini.engine.batch_transfer_sync_write(ini.peer, [int(x) for x in local], [int(x) for x in remote],
                                                          [int(x) for x in lengths])
                if rc != 0:
                    raise RuntimeError(f"batch_transfer_sync_write returned {rc}")

            # The wheel's only way to reach a peer is its name; a second call is the retry its
            # users would make after a failure.
            attempt("same peer name", write) or attempt("same peer name, second call", write)
        else:
            a = ini.agent
            a.register_memory(a.get_reg_descs([(ini.base, buf.nbytes, 0, "")], "DRAM"))
            z = np.zeros(n, dtype=np.uint64)

            def write():
                h = a.initialize_xfer("WRITE", a.get_xfer_descs(np.stack([local, lengths, z], axis=1), "DRAM"),
                                      a.get_xfer_descs(np.stack([remote, lengths, z], axis=1), "DRAM"), ini.remote)
                state = a.transfer(h)
                while state == "PROC":
                    state = a.check_xfer_state(h)
                if state != "DONE":
                    raise RuntimeError(f"NIXL state {state}")

            def readd():
                a.remove_remote_agent(ini.remote)
                ini.remote = a.add_remote_agent(info["meta"])
                write()

            attempt("same agent (old metadata)", write) or \
                attempt("add_remote_agent(new metadata)", lambda: (a.add_remote_agent(info["meta"]), write())) or \
                attempt("remove_remote_agent + add_remote_agent", readd)
        out["next_steps"] = steps
        if "next_ms" not in out:
            raise RuntimeError("; ".join(steps))
        parent.send(("verify", shape, 8 << 20, 77))
        bad = parent.recv()
        out["next_transfer"] = ("ok" if bad == 0 else f"{bad} mismatched bytes") + f" ({steps[-1].split(':')[0]})"
    except Exception as e:
        out["next_transfer"] = f"{type(e).__name__}: {e}"[:300]
    if proc is not None:
        proc.kill()
    return out


if __name__ == "__main__":
    main()
