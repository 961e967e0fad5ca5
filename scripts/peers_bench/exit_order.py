"""After SIGKILL of a process holding N MiB of touched memory: when does process_vm_readv on it
fail (ESRCH) and when does its end of a socket pair report the hang-up? Medians of R runs.
  python3 scripts/peers_bench/exit_order.py N_MIB R  (issue 40: the killed-peer row over shm)"""
import ctypes, os, select, signal, socket, statistics as st, sys, time
libc = ctypes.CDLL(None, use_errno=True)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
N = int(sys.argv[1]) << 20
R = int(sys.argv[2])
esrch, hup = [], []
for _ in range(R):
    a, b = socket.socketpair()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        a.close()
        buf = ctypes.create_string_buffer(N)  # touched (zeroed by ctypes)
        ctypes.memset(buf, 1, N)
        os.write(w, str(ctypes.addressof(buf)).encode().ljust(32))
        while True:
            time.sleep(1)
    b.close()
    addr = int(os.read(r, 32))
    local = ctypes.create_string_buffer(4096)
    li = iovec(ctypes.addressof(local), 4096); ri = iovec(addr, 4096)
    assert libc.process_vm_readv(pid, ctypes.byref(li), 1, ctypes.byref(ri), 1, 0) == 4096
    p = select.poll(); p.register(a, select.POLLIN | select.POLLHUP)
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    te = th = None
    while te is None or th is None:
        if te is None and libc.process_vm_readv(pid, ctypes.byref(li), 1, ctypes.byref(ri), 1, 0) < 0:
            te = time.perf_counter() - t0
        if th is None and p.poll(0):
            th = time.perf_counter() - t0
        time.sleep(0.0001)
    os.waitpid(pid, 0)
    esrch.append(te * 1e3); hup.append(th * 1e3)
    a.close(); os.close(r); os.close(w)
print(f"{N >> 20} MiB: process_vm_readv fails after {st.median(esrch):.2f} ms, the socket hangs up after {st.median(hup):.2f} ms (medians of {R}; load {open('/proc/loadavg').read().split()[0]})")
