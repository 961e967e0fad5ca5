"""The engine bindings: byte-verified transfers (one process and two), registration lifetime,
bad input, the GIL during waits, asyncio, notifications, segment events."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import select
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import te
from conftest import free_port, skip_or_fail, unique

MiB = 1 << 20


def pattern(n: int, seed: int) -> np.ndarray:
    """A position-dependent byte pattern."""
    i = np.arange(n, dtype=np.uint64)
    return ((i * 2654435761 + seed) >> np.uint64(7)).astype(np.uint8)


def tcp_pair():
    """Two engines in this process that reach each other over TCP only (a transfer that takes a
    while, unlike a local copy)."""
    a = te.TransferEngine(unique("tcp-a"), transports=["tcp"])
    b = te.TransferEngine(unique("tcp-b"), transports=["tcp"])
    return a, b


def test_many_regions_register_in_one_call_and_each_is_reachable():
    a, b = tcp_pair()
    pool = np.zeros(64 * 4096, dtype=np.uint8)
    base = pool.ctypes.data
    ptrs = base + np.arange(64, dtype=np.uint64) * 4096
    regs = b.register_ptrs(ptrs, 4096)
    assert [r.addr for r in regs] == ptrs.tolist() and all(r.length == 4096 for r in regs)
    src = pattern(4096, 5)
    rs = a.register(src)
    seg = a.open_segment(b.segment_name)
    a.write(seg, rs.addr, int(ptrs[63]), 4096)
    assert np.array_equal(pool[63 * 4096:], src)
    # Nothing is registered when one region is refused (a zero length).
    with pytest.raises(te.TeError):
        b.register_ptrs(np.array([base, base], dtype=np.uint64) + 8 * MiB, np.array([16, 0], dtype=np.uint64))
    assert all(r.close() for r in regs)
    assert "shm" in te.COMPILED_TRANSPORTS, "the wheel carries the same-host transport"


def test_routes_and_unreached_routes_say_what_carries_a_segment():
    a, b = tcp_pair()
    seg = a.open_segment(b.segment_name)
    assert a.routes(seg) == [("tcp", "active", True, 0)]
    assert a.unreached_routes(seg) == []
    a.close_segment(seg)
    with pytest.raises(te.TeError):
        a.routes(seg)


def test_warm_up_reports_each_route_and_leaves_the_memory_alone():
    a, b = tcp_pair()
    dst = pattern(64 * 1024, 3)
    before = dst.copy()
    rd = b.register(dst)
    seg = a.open_segment(b.segment_name)
    routes = a.warm_up(seg)
    assert [(t, n) for t, n, _ in routes] == [("tcp", 1)]
    assert all(s >= 0 for _, _, s in routes)
    assert np.array_equal(dst, before), "a warm-up only reads"
    assert rd.close() is True


def test_two_engines_move_a_numpy_array_byte_for_byte():
    a = te.TransferEngine(unique("a"))
    b = te.TransferEngine(unique("b"))
    src = pattern(4 * MiB, 1)
    back = np.zeros(4 * MiB, dtype=np.uint8)
    dst = np.zeros(4 * MiB, dtype=np.uint8)
    rs, rback, rd = a.register(src), a.register(back), b.register(dst)
    seg = a.open_segment(b.segment_name)
    assert seg.name == b.segment_name
    assert (rd.addr, rd.length, "host") in seg.buffers
    # 1,024 writes of 4 KiB from arrays; the lengths as one int for every request.
    offs = np.arange(1024, dtype=np.uint64) * 4096
    report = a.write(seg, rs.addr + offs, rd.addr + offs, 4096)
    assert (report.requests, report.bytes) == (1024, 4 * MiB)
    assert np.array_equal(src, dst)
    # Reads back, scattered in reverse order, lengths as an array.
    rev = offs[::-1].copy()
    batch = a.submit_read(seg, rback.addr + rev, rd.addr + offs, np.full(1024, 4096, dtype=np.uint64))
    assert len(batch) == 1024
    assert batch.wait().bytes == 4 * MiB
    assert batch.done()
    assert batch.progress()["done"] == 1024
    expect = src.reshape(1024, 4096)[::-1].reshape(-1)
    assert np.array_equal(back, expect)
    # int64 address arrays (numpy's default integer) are taken too.
    dst[:] = 0
    a.write(seg, (rs.addr + offs).astype(np.int64), (rd.addr + offs).astype(np.int64), 4096)
    assert np.array_equal(src, dst)
    for r in (rs, rback, rd):
        assert r.close() is True
        assert r.close() is True  # twice: nothing


CHILD = r"""
import sys, numpy as np, te
port = int(sys.argv[1])
env = {"TE_METADATA": "p2p", "TE_P2P_LISTEN": f"127.0.0.1:{port}", "TE_TRANSPORTS": "tcp",
       "TE_TCP_LISTEN": "127.0.0.1:0", "TE_TCP_ADVERTISE": "127.0.0.1"}
e = te.TransferEngine("child", env=env)
i = np.arange(1 << 20, dtype=np.uint64)
src = ((i * 2654435761 + 5) >> np.uint64(7)).astype(np.uint8)
dst = np.zeros(1 << 20, dtype=np.uint8)
rs, rd = e.register(src), e.register(dst)
print("READY", rs.addr, rd.addr, flush=True)
sys.stdin.readline()
expect = ((i * 2654435761 + 9) >> np.uint64(7)).astype(np.uint8)
print("MISMATCHED", int((dst != expect).sum()), flush=True)
note = e.recv_notification(timeout=10)
print("NOTE", note.sender if note else None, note.payload.decode() if note else None, flush=True)
"""


def test_two_processes_read_and_write_each_others_arrays():
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        assert line and line[0] == "READY", line
        remote_src, remote_dst = int(line[1]), int(line[2])
        env = {"TE_METADATA": "p2p", "TE_P2P_LISTEN": "127.0.0.1:0", "TE_TRANSPORTS": "tcp",
               "TE_TCP_LISTEN": "127.0.0.1:0", "TE_TCP_ADVERTISE": "127.0.0.1"}
        e = te.TransferEngine(unique("parent"), env=env)
        seg = e.open_segment(f"child@127.0.0.1:{port}")
        got = np.zeros(MiB, dtype=np.uint8)
        mine = pattern(MiB, 9)
        rg, rm = e.register(got), e.register(mine)
        offs = np.arange(256, dtype=np.uint64) * 4096
        e.read(seg, rg.addr + offs, remote_src + offs, 4096)
        assert int((got != pattern(MiB, 5)).sum()) == 0
        e.write(seg, rm.addr, remote_dst, MiB, notify=b"written")
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["MISMATCHED", "0"]
        assert child.stdout.readline().split() == ["NOTE", e.segment_name, "written"]
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()


def test_collecting_a_registration_while_a_batch_is_in_flight_keeps_the_memory():
    a, b = tcp_pair()
    n = 64 * MiB
    src = pattern(n, 3)
    expect = src.copy()
    dst = np.zeros(n, dtype=np.uint8)
    rd = b.register(dst)
    seg = a.open_segment(b.segment_name)
    rs = a.register(src)
    alive = weakref.ref(src)
    batch = a.submit_write(seg, rs.addr, rd.addr, n)
    in_flight = not batch.done()
    del rs, src
    gc.collect()
    # The array lives on while the engine holds the region, whatever Python collected (the
    # 64 MiB TCP transfer takes tens of ms; `done` covers a machine fast enough to finish it).
    assert alive() is not None or batch.done()
    batch.wait()
    assert np.array_equal(dst, expect)
    # Once the engine released the region, the array goes too.
    deadline = time.monotonic() + 10
    while alive() is not None:
        assert time.monotonic() < deadline, "the array was never released"
        a.transports()  # any call into the package releases queued buffer views
        gc.collect()
        time.sleep(0.01)
    assert in_flight, "the transfer finished before the collection: nothing was tested"


def test_closing_a_registration_in_flight_defers_the_release():
    a, b = tcp_pair()
    n = 64 * MiB
    src, dst = pattern(n, 4), np.zeros(n, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    seg = a.open_segment(b.segment_name)
    batch = a.submit_write(seg, rs.addr, rd.addr, n)
    closed_now = rs.close()
    assert not rs.open
    batch.wait()
    assert np.array_equal(src, dst)
    if not closed_now:
        # Deferred: the region refuses new transfers at once.
        with pytest.raises(te.UnregisteredError):
            a.write(seg, rs.addr, rd.addr, 4096)


def test_bad_input_raises_clear_exceptions():
    e = te.TransferEngine(unique("bad"))
    arr = np.zeros(MiB, dtype=np.uint8)
    reg = e.register(arr)
    seg = e.open_segment(e.segment_name)
    # Read-only memory.
    ro = np.zeros(4096, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(te.ReadOnlyBufferError, match="read-only"):
        e.register(ro)
    with pytest.raises(te.ReadOnlyBufferError):
        e.register(b"immutable bytes")
    # Non-contiguous memory and address arrays.
    with pytest.raises(te.NotContiguousError):
        e.register(np.zeros((64, 64), dtype=np.uint8)[:, ::2])
    addrs = np.arange(8, dtype=np.uint64) * 4096 + reg.addr
    with pytest.raises(te.NotContiguousError):
        e.write(seg, addrs[::2], addrs[::2], 16)
    # Wrong dtypes, dimensions and lengths.
    with pytest.raises(te.DtypeError, match="8-byte integers"):
        e.write(seg, addrs.astype(np.float64), addrs, 16)
    with pytest.raises(te.DtypeError):
        e.write(seg, addrs.astype(np.uint32), addrs, 16)
    with pytest.raises(te.DtypeError):
        e.write(seg, [reg.addr], addrs[:1], 16)
    with pytest.raises(te.ShapeError, match="1-D"):
        e.write(seg, addrs.reshape(2, 4), addrs.reshape(2, 4), 16)
    with pytest.raises(te.ShapeError, match="one length"):
        e.write(seg, addrs, addrs[:4], 16)
    with pytest.raises(te.InvalidArgument, match="64-bit"):
        e.write(seg, -1, reg.addr, 16)
    # The engine's own validation, with the Rust message and fields.
    with pytest.raises(te.ZeroLengthError):
        e.write(seg, reg.addr, reg.addr + 4096, 0)
    with pytest.raises(te.OutOfBoundsError, match="outside every buffer exported") as oob:
        e.write(seg, reg.addr, reg.addr + MiB - 8, 16)
    assert oob.value.kind == "out_of_bounds" and oob.value.segment == e.segment_name
    with pytest.raises(te.UnregisteredError, match="not registered"):
        e.write(seg, 0x1000, reg.addr, 16)
    with pytest.raises(te.UnknownSegmentError):
        e.open_segment(unique("nobody"))
    with pytest.raises(te.InvalidArgument, match="deadline"):
        e.write(seg, reg.addr, reg.addr + 4096, 16, deadline=-1.0)
    # The same array again shares the registration (the engine's registration cache); a range
    # running past its end overlaps it.
    again = e.register(arr)
    assert again.addr == reg.addr
    assert again.close()
    with pytest.raises(te.AlreadyRegisteredError):
        e.register_ptr(reg.addr + MiB - 8, 16)
    with pytest.raises(TypeError):
        e.register(object())
    with pytest.raises(te.InvalidArgument, match="unknown memory location"):
        e.register_ptr(reg.addr, 16, "gpu")
    # A closed handle.
    assert reg.close()
    with pytest.raises(te.ClosedError):
        reg.address(0)
    with pytest.raises(te.UnregisteredError):
        e.write(seg, reg.addr, reg.addr, 16)
    e.shutdown()
    with pytest.raises(te.ClosedError):
        e.write(seg, 0x1000, 0x1000, 16)


def test_a_malformed_variable_raises_at_construction_naming_it():
    with pytest.raises(te.ConfigError, match="TE_TRANSFER_TIMEOUT_MS") as err:
        te.TransferEngine(unique("cfg"), env={"TE_TRANSFER_TIMEOUT_MS": "soon"})
    assert err.value.var == "TE_TRANSFER_TIMEOUT_MS"
    with pytest.raises(te.ConfigError, match="TE_TRANSPORTS"):
        te.TransferEngine(unique("cfg"), transports=["carrier-pigeon"])


def test_dlpack_objects_and_raw_pointers_register_without_copying():
    class OnlyDlpack:
        """A producer seen only through __dlpack__ (as a torch CPU tensor would be)."""

        def __init__(self, a):
            self.a = a

        def __dlpack__(self, stream=None):
            return self.a.__dlpack__()

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    e = te.TransferEngine(unique("dl"))
    src = pattern(MiB, 7).view(np.float32)  # any dtype: registration is by bytes
    dst = np.zeros(MiB, dtype=np.uint8)
    rs = e.register(OnlyDlpack(src))
    assert (rs.addr, rs.length, rs.location) == (src.ctypes.data, MiB, "host")
    raw = ctypes.create_string_buffer(MiB)
    rp = e.register_ptr(ctypes.addressof(raw), MiB)
    rd = e.register(dst)
    seg = e.open_segment(e.segment_name)
    e.write(seg, rs.addr, rp.addr, MiB)
    e.write(seg, rp.addr, rd.addr, MiB)
    assert np.array_equal(dst, src.view(np.uint8))
    # Read-only arrays are refused by numpy's own DLPack export.
    ro = np.zeros(16, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises((te.ReadOnlyBufferError, BufferError)):
        e.register(OnlyDlpack(ro))
    rp.close()


def test_cuda_array_interface_objects_are_read_without_importing_a_framework():
    class FakeDeviceArray:
        def __init__(self, ptr, n, readonly=False):
            self.__cuda_array_interface__ = {"data": (ptr, readonly), "shape": (n,), "typestr": "|u1",
                                             "strides": None, "version": 3}

    e = te.TransferEngine(unique("cai"))
    host = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(te.ReadOnlyBufferError):
        e.register(FakeDeviceArray(host.ctypes.data, 4096, readonly=True))
    with pytest.raises(te.InvalidArgument, match="does not name the device"):
        e.register(FakeDeviceArray(host.ctypes.data, 4096))
    # Declared CUDA memory is checked by the CUDA plugin: here it is host memory, or no driver.
    with pytest.raises((te.NotAvailableError, te.WrongMemoryKindError)):
        e.register(FakeDeviceArray(host.ctypes.data, 4096), device="cuda:0")


def test_wait_releases_the_gil():
    a, b = tcp_pair()
    n = 128 * MiB
    src, dst = pattern(n, 11), np.zeros(n, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    seg = a.open_segment(b.segment_name)
    ticks = 0
    stop = threading.Event()

    def ticker():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.0005)

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.01)
    batch = a.submit_write(seg, rs.addr, rd.addr, n)
    before = ticks
    batch.wait()
    during = ticks - before
    stop.set()
    t.join()
    assert np.array_equal(src, dst)
    # A 128 MiB TCP transfer takes tens of ms here: a GIL held in wait() would give 0 ticks.
    assert during > 3, f"the other thread made {during} steps while wait() ran"


SHM_CHILD = r"""
import sys, numpy as np, te
env = {"TE_METADATA": "p2p", "TE_P2P_LISTEN": f"127.0.0.1:{sys.argv[1]}", "TE_TRANSPORTS": "shm"}
e = te.TransferEngine("shm-child", env=env)
dst = np.zeros(int(sys.argv[2]), dtype=np.uint8)
reg = e.register(dst)
print("READY", reg.addr, flush=True)
sys.stdin.readline()
print("SUM", int(dst[:: 4096].astype(np.uint64).sum()), flush=True)
"""


def line_within(proc: subprocess.Popen, seconds: float) -> list[str]:
    """The child's next stdout line, split; fails instead of hanging when none comes in time."""
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    assert ready, f"the child printed nothing within {seconds} s"
    return proc.stdout.readline().split()


def test_a_copy_done_while_submitting_releases_the_gil():
    # The same-host transport copies on the submitting thread inside submit: a batch up to
    # TE_SHM_INLINE_BYTES whole, and 1 MiB chunks of a larger one (up to 256 MiB) beside its copy
    # threads. Other Python threads must run meanwhile, as they do during wait().
    n = 128 * MiB
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", SHM_CHILD, str(port), str(n)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    stop = threading.Event()
    interval = sys.getswitchinterval()
    try:
        line = line_within(child, 120)
        assert line and line[0] == "READY", line
        remote = int(line[1])
        src = np.ones(n, dtype=np.uint8)
        offs = np.arange(n // MiB, dtype=np.uint64) * MiB
        env = {"TE_METADATA": "p2p", "TE_P2P_LISTEN": "127.0.0.1:0", "TE_TRANSPORTS": "shm"}
        # (engine, requests): the whole batch copied inside submit, then 128 requests of 1 MiB
        # shared between the submitting thread and the copy threads.
        arms = []
        for extra, whole in (({"TE_SHM_INLINE_BYTES": str(2 * n)}, True), ({}, False)):
            e = te.TransferEngine(unique("gil"), env={**env, **extra})
            rs = e.register(src)
            seg = e.open_segment(f"shm-child@127.0.0.1:{port}")
            if not e.routes(seg):
                skip_or_fail("shm", f"no shm route to a child process: {e.unreached_routes(seg)}")
            local, there = (rs.addr, remote) if whole else (rs.addr + offs, remote + offs)
            arms.append((e, seg, rs, local, there, n if whole else MiB))  # rs: kept registered
        ticks = 0
        started = threading.Event()

        def ticker():
            nonlocal ticks
            started.set()
            while not stop.is_set():
                ticks += 1
                os.sched_yield()  # lets the GIL go, so the main thread takes it back at once

        # The GIL then changes hands only where a thread lets it go: the ticker in sched_yield,
        # the engine where it releases it. Held through submit, the ticker cannot step at all.
        sys.setswitchinterval(60)
        t = threading.Thread(target=ticker, daemon=True)
        t.start()
        assert started.wait(60), "the ticker thread did not start"
        # Counted while submit alone runs (the copy threads may finish the batch during wait()).
        # Released, the ticker steps once it gets a core, so a few tries make a core-starved
        # machine no reason to fail.
        steps = []
        for e, seg, _, local, there, length in arms:
            steps.append([])
            for _ in range(5):
                before = ticks
                batch = e.submit_write(seg, local, there, length, deadline=120)
                steps[-1].append(ticks - before)
                assert batch.wait().bytes == n
                if steps[-1][-1] > 0:
                    break
        stop.set()
        t.join(60)
        assert all(max(s) > 0 for s in steps), \
            f"the other thread's steps while submit_write copied (whole batch, 1 MiB chunks): {steps}"
        child.stdin.write("go\n")
        child.stdin.flush()
        assert line_within(child, 120) == ["SUM", str(n // 4096)]
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        child.kill()
        child.wait(timeout=30)


def test_asyncio_tasks_interleave_with_awaited_batches():
    a, b = tcp_pair()
    n = 32 * MiB
    srcs = [pattern(n, s) for s in (21, 22)]
    dsts = [np.zeros(n, dtype=np.uint8) for _ in srcs]
    regs = [(a.register(s), b.register(d)) for s, d in zip(srcs, dsts)]

    async def main():
        seg = await a.open_segment_async(b.segment_name)
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        async def move(rs, rd):
            report = await a.submit_write(seg, rs.addr, rd.addr, n)
            return report.bytes

        tick = asyncio.create_task(ticker())
        got = await asyncio.gather(*(move(rs, rd) for rs, rd in regs))
        done.set()
        await tick
        return got, ticks

    got, ticks = asyncio.run(main())
    assert got == [n, n]
    assert ticks > 10, "the event loop was blocked while the batches ran"
    for s, d in zip(srcs, dsts):
        assert np.array_equal(s, d)


def test_a_deadline_fails_the_unfinished_requests_with_timeout():
    a, b = tcp_pair()
    n = 128 * MiB
    src, dst = np.ones(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    seg = a.open_segment(b.segment_name)
    # 128 MiB over TCP loopback takes tens of ms; the deadline is 1 ms.
    with pytest.raises(te.BatchFailedError) as err:
        a.write(seg, rs.addr, rd.addr, n, deadline=0.001)
    index, cause = err.value.failures[0]
    assert index == 0 and isinstance(cause, te.TimeoutError) and isinstance(cause, TimeoutError)
    assert "timed out" in str(cause)
    # The timed-out batch's connection was cut: the next request waits for the reconnect it
    # starts and goes on the new connection (no error, no reopening).
    assert a.write(seg, rs.addr, rd.addr, 4096).bytes == 4096


def test_batch_failed_lists_each_failed_request_once_built_and_pickles():
    """A batch whose deadline cuts most of its 2,048 requests: every request ``failures`` does not
    list has its bytes in place; the list is built once and kept (the same list from every
    thread), survives pickling, can be set, and a reference cycle through it is collected."""
    import pickle

    a, b = tcp_pair()
    count, block = 2048, 64 * 1024
    src, dst = pattern(count * block, 9), np.zeros(count * block, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    seg = a.open_segment(b.segment_name)
    offs = np.arange(count, dtype=np.uint64) * np.uint64(block)
    # 128 MiB over TCP loopback takes tens of ms; the deadline is 1 ms.
    with pytest.raises(te.BatchFailedError) as err:
        a.write(seg, rs.addr + offs, rd.addr + offs, np.full(count, block, dtype=np.uint64), deadline=0.001)
    e = err.value
    # A deadline fails what it cuts (none cancelled, none left pending): done + failed is every request.
    assert (e.cancelled, e.pending) == (0, 0) and e.done + e.failed == count and e.failed > 0
    assert e.timed_out is True, "a deadline's failures are timeouts, known before failures is built"
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(e.failures)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(seen) == 4 and not any(t.is_alive() for t in threads)
    first = e.failures
    assert first is e.failures, "built once, then kept"
    assert all(f == first for f in seen)
    failed = [i for i, _ in first]
    assert len(failed) == e.failed and failed == sorted(set(failed))
    assert all(isinstance(c, te.TimeoutError) and isinstance(c, te.TeError) for _, c in first)
    landed = np.ones(count, dtype=bool)
    landed[failed] = False
    got, want = dst.reshape(count, block), src.reshape(count, block)
    assert np.array_equal(got[landed], want[landed]), "a request not listed as failed did not land"
    back = pickle.loads(pickle.dumps(e))
    assert isinstance(back, te.BatchFailedError) and str(back) == str(e) and back.failed == e.failed
    assert back.timed_out is True and te.BatchFailedError("by hand").timed_out is False
    assert [(i, type(c), str(c)) for i, c in back.failures] == [(i, type(c), str(c)) for i, c in first]
    back.failures = []
    assert back.failures == [] and te.BatchFailedError("by hand").failures == []
    # A cycle through the list, as `raise cause` inside `except BatchFailedError` makes, is
    # collected.
    cause = first[0][1]
    cause.__context__ = e
    ref = weakref.ref(e)
    del e, err, first, seen, cause, back, threads
    gc.collect()
    assert ref() is None, "a failed batch's exception outlived every reference to it"


def test_failed_batches_raise_batch_failed_with_each_request():
    a, b = tcp_pair()
    src, dst = np.zeros(MiB, dtype=np.uint8), np.zeros(MiB, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    seg = a.open_segment(b.segment_name)
    b.shutdown()  # the peer goes away
    with pytest.raises(te.TeError) as err:
        a.write(seg, rs.addr, rd.addr, 4096)
    e = err.value
    if isinstance(e, te.BatchFailedError):
        assert e.failed == 1 and e.failures[0][0] == 0 and e.timed_out is False
        assert isinstance(e.failures[0][1], te.TeError)
    else:
        assert isinstance(e, (te.PeerGoneError, te.TransportError, te.NoTransportError)), e


def test_notifications_blocking_and_async():
    a = te.TransferEngine(unique("na"))
    b = te.TransferEngine(unique("nb"))
    src, dst = pattern(8192, 2), np.zeros(8192, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    seg = a.open_segment(b.segment_name)
    a.write(seg, rs.addr, rd.addr, 8192, notify=b"layer-0")
    n = b.recv_notification(timeout=5)
    assert (n.sender, n.payload) == (a.segment_name, b"layer-0")
    assert np.array_equal(src, dst)  # the message comes only after the bytes
    assert b.recv_notification(timeout=0.05) is None
    a.notify(seg, b"bare")
    assert b.notifications().try_recv().payload == b"bare"

    async def main():
        for i in range(3):
            await a.notify_async(seg, f"m{i}".encode())
        got = []
        async for note in b.notifications():
            got.append(note.payload)
            if len(got) == 3:
                break
        return got

    assert asyncio.run(main()) == [b"m0", b"m1", b"m2"]


def test_segment_events_report_changes_and_closing():
    a = te.TransferEngine(unique("ea"))
    b = te.TransferEngine(unique("eb"))
    seg = a.open_segment(b.segment_name)
    events = seg.events()
    mem = np.zeros(8192, dtype=np.uint8)
    reg = b.register(mem)
    ev = events.next(timeout=5)
    assert ev is not None and ev.kind == "changed"
    assert (reg.addr, reg.length, "host") in ev.buffers
    a.close_segment(seg)
    ev = events.next(timeout=5)
    assert ev is not None and ev.kind == "closed"
    with pytest.raises(te.TeError):
        a.write(seg, 0x1000, 0x1000, 16)


def test_engine_reports_its_transports():
    e = te.TransferEngine(unique("info"))
    names = [n for n, _ in e.transports()]
    assert "local" in names and "tcp" in names
    assert set(names) <= set(te.COMPILED_TRANSPORTS)
    assert "efa" in te.COMPILED_TRANSPORTS  # compiled in; libfabric is opened at run time
    assert isinstance(te.device_plugins(), list)


def test_efa_moves_bytes_over_a_software_provider_when_libfabric_is_here():
    """The efa transport from Python, on libfabric's tcp;ofi_rxm provider (as on any host without
    an EFA device): a write and a scattered read, byte-verified."""
    env = {"TE_FABRIC_PROVIDER": "tcp;ofi_rxm"}
    try:
        a = te.TransferEngine(unique("efa-a"), transports=["efa"], env=env)
        b = te.TransferEngine(unique("efa-b"), transports=["efa"], env=env)
    except te.NotAvailableError as e:
        skip_or_fail("libfabric", str(e))
    src, dst, back = pattern(4 * MiB, 11), np.zeros(4 * MiB, dtype=np.uint8), np.zeros(4 * MiB, dtype=np.uint8)
    rs, rd, rb = a.register(src), b.register(dst), a.register(back)
    seg = a.open_segment(b.segment_name)
    assert [t for t, _, _ in a.warm_up(seg)] == ["efa"]
    assert a.write(seg, rs.addr, rd.addr, 4 * MiB).bytes == 4 * MiB
    assert np.array_equal(src, dst)
    offs = np.arange(64, dtype=np.uint64) * 65536
    a.read(seg, rb.addr + offs, rd.addr + offs, 4096)
    for o in offs.tolist():
        assert np.array_equal(back[o:o + 4096], src[o:o + 4096])
    a.shutdown()
    b.shutdown()


SIGNALS_CHILD = """
import os, signal, sys, time
# Python's dispositions, whatever the test's process inherited (a background job of a shell
# without job control has SIGINT ignored); then loading te must leave them alone.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
import te
e = te.TransferEngine("signals-child")  # every compiled transport: libfabric is opened if here
print([n for n, why in e.transports() if why is None], flush=True)
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
    print("no KeyboardInterrupt", flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
"""


def test_ctrl_c_and_sigterm_behave_as_python_says_with_every_transport_loaded():
    # Debian's libfabric pulled in a library that took SIGINT and SIGTERM when loaded: the
    # process exited with status 1 on Ctrl-C, no KeyboardInterrupt.
    child = subprocess.run([sys.executable, "-c", SIGNALS_CHILD], capture_output=True, text=True, timeout=120)
    lines = child.stdout.splitlines()
    assert lines[1:] == ["KeyboardInterrupt"], (child.stdout, child.stderr)
    assert child.returncode == -15, ("SIGTERM's default action ends the process", child.returncode, child.stderr)


def test_the_extension_links_no_vendor_library_and_no_libpython():
    import shutil

    if shutil.which("ldd") is None:
        pytest.skip("no ldd on this host")
    out = subprocess.run(["ldd", te._native.__file__], capture_output=True, text=True, check=True).stdout
    for lib in ("libfabric", "libibverbs", "libcuda", "libamdhip64", "libpython"):
        assert lib not in out, f"te._native links {lib}:\n{out}"
