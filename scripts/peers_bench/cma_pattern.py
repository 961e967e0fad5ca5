"""CMA copy patterns, isolated: 16 MiB between two processes with process_vm_readv/writev, as
ours (4 MiB per call, the two halves of an 8 MiB batch on two threads) and as NIXL/UCX
(512 KiB per call, one thread) copy it. Interleaved rounds, median GB/s and CPU
seconds per GiB of this process. Run: target/peers-venv/bin/python scripts/peers_bench/cma_pattern.py [ROUNDS]"""
import ctypes, ctypes.util, os, statistics, sys, threading, time, multiprocessing as mp
import numpy as np
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc.process_vm_readv.restype = ctypes.c_ssize_t
libc.process_vm_writev.restype = ctypes.c_ssize_t
TOTAL = 16 << 20

def child(conn):
    b = np.ones(TOTAL, dtype=np.uint8)
    conn.send(b.ctypes.data)
    conn.recv()

def copy(fn, pid, local, remote, chunk, n):
    for off in range(0, n, chunk):
        l = iovec(local + off, chunk); r = iovec(remote + off, chunk)
        got = fn(pid, ctypes.byref(l), 1, ctypes.byref(r), 1, 0)
        assert got == chunk, (got, ctypes.get_errno())

def run(fn, pid, local, remote, chunk, threads, batch=8 << 20):
    # batches of 8 MiB, each split over `threads` threads, waited for before the next
    for b0 in range(0, TOTAL, batch):
        per = batch // threads
        if threads == 1:
            copy(fn, pid, local + b0, remote + b0, chunk, batch)
        else:
            ts = [threading.Thread(target=copy, args=(fn, pid, local + b0 + i * per, remote + b0 + i * per, chunk, per))
                  for i in range(threads)]
            [t.start() for t in ts]; [t.join() for t in ts]

if __name__ == "__main__":
    ctx = mp.get_context("spawn"); a, b = ctx.Pipe()
    p = ctx.Process(target=child, args=(b,)); p.start(); remote = a.recv()
    buf = np.zeros(TOTAL, dtype=np.uint8); local = buf.ctypes.data
    arms = {"4M x 2 threads (ours)": (4 << 20, 2), "512K x 1 thread (UCX)": (512 << 10, 1),
            "4M x 1 thread": (4 << 20, 1), "512K x 2 threads": (512 << 10, 2)}
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    for op, fn in (("read", libc.process_vm_readv), ("write", libc.process_vm_writev)):
        res = {k: [] for k in arms}; cpu = {k: [] for k in arms}
        for r in range(rounds):
            for k, (chunk, th) in arms.items():
                c0 = time.process_time(); t0 = time.perf_counter()
                run(fn, p.pid, local, remote, chunk, th)
                dt = time.perf_counter() - t0; dc = time.process_time() - c0
                if r: res[k].append(TOTAL / dt / 1e9); cpu[k].append(dc / (TOTAL / (1 << 30)))
        for k in arms:
            print(f"{op:5} {k:24} {statistics.median(res[k]):6.2f} GB/s  cpu {statistics.median(cpu[k]):.3f} s/GiB "
                  f"(min {min(res[k]):.2f} max {max(res[k]):.2f})", flush=True)
    a.send("bye"); p.join()
