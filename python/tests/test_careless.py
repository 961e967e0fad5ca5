"""What a careless connector does, from the docs: release a buffer while another thread still
gets into it, cancel a receive just before a notification arrives, call after close, pass odd
arguments. Each test failed (or crashed the process) before the fix it guards."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import tempfile
import threading
import time

import numpy as np
import pytest

import te
from te import umbp
from conftest import unique

MiB = 1 << 20
ROUNDS = int(os.environ.get("TE_PY_RACE_ROUNDS", "20"))


# --- Store buffers: released while another thread's get writes into them -------------------------


def _object(store: umbp.Store, size: int) -> str:
    key = unique("big")
    src = np.full(size, 0x5A, dtype=np.uint8)
    reg = store.register(src)
    assert store.batch_put_ranges([key], size, 0, 0, size, reg.addr) == [None]
    reg.close()
    return key


def _getter(store, key, size, addr, started, results):
    started.set()
    for _ in range(4):
        try:
            results.append(store.batch_get_ranges([key], 0, 0, size, addr))
        except te.TeError as e:  # the buffer went away between calls: a typed refusal
            results.append(e)


@pytest.mark.parametrize("release", ["close", "del", "close_then_del_array"])
def test_a_store_buffer_released_during_another_threads_get_never_frees_memory_under_it(release):
    size = 16 * MiB
    with umbp.Store(dram_capacity=64 << 20, ssd_dirs=[]) as store:
        key = _object(store, size)
        for _ in range(ROUNDS):
            dst = np.zeros(size, dtype=np.uint8)
            reg = store.register(dst)
            addr = reg.addr
            started, results = threading.Event(), []
            t = threading.Thread(target=_getter, args=(store, key, size, addr, started, results))
            t.start()
            started.wait()
            released = True
            if release == "close":
                released = reg.close()  # True (released now) or False (when the get ends)
            elif release == "del":
                del reg
            else:
                reg.close()
                del reg
            # Drop every reference we hold to the array: only the store keeps it alive now.
            del dst
            gc.collect()
            # Churn the allocator so freed memory would be reused (and corrupted) at once.
            junk = [np.ones(size // 8, dtype=np.uint8) for _ in range(8)]
            t.join(timeout=60)
            assert not t.is_alive(), "the get never returned"
            del junk
            assert released in (True, False)
            for r in results:
                assert r == [size] or isinstance(r, te.TeError), r
        # The store works on afterwards, with nothing left registered.
        assert store.exists(key)


def test_closing_a_store_buffer_while_a_get_runs_reports_the_deferred_release():
    size = 32 * MiB
    with umbp.Store(dram_capacity=96 << 20, ssd_dirs=[]) as store:
        key = _object(store, size)
        deferred = 0
        for _ in range(ROUNDS):
            dst = np.zeros(size, dtype=np.uint8)
            reg = store.register(dst)
            started, results = threading.Event(), []
            t = threading.Thread(target=_getter, args=(store, key, size, reg.addr, started, results))
            t.start()
            started.wait()
            released_now = reg.close()
            deferred += released_now is False
            assert reg.close() is True  # closing twice does nothing
            t.join(timeout=60)
            for r in results:
                assert r == [size] or isinstance(r, te.TeError), r
        print(f"{deferred} of {ROUNDS} closes were deferred behind a running get")


def test_a_per_layer_view_of_a_kv_buffer_registers_in_standalone_mode():
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "umbp.sock")
        with umbp.Server(sock, dram_capacity=16 << 20, ssd_dirs=[]):
            with umbp.Store(connect=sock) as store:
                kv = store.alloc_buffer(4 * 4096)
                whole = np.frombuffer(kv, dtype=np.uint8)
                layers = [whole[i * 4096:(i + 1) * 4096] for i in range(4)]
                regs = [store.register(v) for v in layers]
                for i, v in enumerate(layers):
                    v[:] = i + 1
                key_index = np.arange(4, dtype=np.uint64)
                keys = [unique(f"l{i}") for i in range(4)]
                addrs = np.array([r.addr for r in regs], dtype=np.uint64)
                assert store.batch_put_ranges(keys, 4096, key_index, 0, 4096, addrs) == [None] * 4
                whole[:] = 0
                assert store.batch_get_ranges(keys[::-1], key_index, 0, 4096, addrs) == [4096] * 4
                for i, v in enumerate(layers):
                    assert (v == 4 - i).all(), i
                # Closing one view keeps the others usable; the last one unmaps the buffer.
                assert regs[0].close() is True
                assert store.batch_get_ranges(keys[:1], 0, 0, 4096, regs[1].addr) == [4096]
                for r in regs[1:]:
                    r.close()
                del layers, whole, v
                store.free_buffer(kv)


# --- Notifications: a cancelled receive never consumes the next one ----------------------------


def _pair():
    a = te.TransferEngine(unique("na"))
    b = te.TransferEngine(unique("nb"))
    return a, b, a.open_segment(b.segment_name)


def test_a_cancelled_recv_async_never_loses_the_next_notification():
    a, b, seg = _pair()

    async def main():
        inbox = b.notifications()
        for i in range(ROUNDS * 5):
            task = asyncio.ensure_future(inbox.recv_async())
            await asyncio.sleep(0)  # the receive is waiting now
            task.cancel()
            # The note arrives right after the cancel, while the receive may still be running.
            await a.notify_async(seg, f"n{i}".encode())
            with pytest.raises(asyncio.CancelledError):
                await task
            got = await asyncio.wait_for(inbox.recv_async(), 10)
            assert got.payload == f"n{i}".encode(), i

    asyncio.run(main())
    a.shutdown()
    b.shutdown()


def test_a_wait_for_timeout_and_leaving_async_for_never_lose_a_notification():
    a, b, seg = _pair()

    async def main():
        inbox = b.notifications()
        for i in range(ROUNDS * 5):
            # A timeout that fires just as the note is sent.
            send = asyncio.ensure_future(a.notify_async(seg, f"w{i}".encode()))
            try:
                got = await asyncio.wait_for(inbox.recv_async(), 0.0005)
                assert got.payload == f"w{i}".encode()
                await send
                continue
            except asyncio.TimeoutError:
                pass
            await send
            got = await asyncio.wait_for(inbox.recv_async(), 10)
            assert got.payload == f"w{i}".encode(), i
        for i in range(ROUNDS):
            await a.notify_async(seg, f"f{i}".encode())
            async for note in inbox:
                assert note.payload == f"f{i}".encode()
                break
            # Leave the loop while a receive waits, then a note arrives.
            it = inbox.__aiter__()
            pending = asyncio.ensure_future(it.__anext__())
            await asyncio.sleep(0)
            pending.cancel()
            await a.notify_async(seg, f"g{i}".encode())
            got = await asyncio.wait_for(inbox.recv_async(), 10)
            assert got.payload == f"g{i}".encode(), i

    asyncio.run(main())
    assert len(b.notifications()) == 0
    a.shutdown()
    b.shutdown()


def test_ctrl_c_during_a_blocking_receive_keeps_the_notification():
    a, b, seg = _pair()
    # Python's own Ctrl-C handler, whatever this process inherited: started in the background by
    # a shell without job control, SIGINT arrives ignored, and the receive below would wait forever.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for i in range(3):
            timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
            with pytest.raises(KeyboardInterrupt):
                timer.start()  # inside: however late the signal lands, it lands in this block
                b.recv_notification(timeout=None)
            timer.join()
            a.notify(seg, f"k{i}".encode())
            assert b.recv_notification(timeout=10).payload == f"k{i}".encode()
    finally:
        signal.signal(signal.SIGINT, inherited)


# --- Closed means closed; odd arguments are typed errors ----------------------------------------


def test_every_engine_call_after_shutdown_raises_closed():
    a = te.TransferEngine(unique("closed-a"))
    b = te.TransferEngine(unique("closed-b"))
    seg = a.open_segment(b.segment_name)
    buf = np.zeros(4096, dtype=np.uint8)
    a.shutdown()
    with pytest.raises(te.ClosedError):
        a.register(buf)
    with pytest.raises(te.ClosedError):
        a.open_segment(b.segment_name)
    with pytest.raises(te.ClosedError):
        a.notify(seg, b"x")
    with pytest.raises(te.ClosedError):
        a.write(seg, 1, 1, 1)
    b.shutdown()


def test_every_store_call_after_close_raises_closed():
    store = umbp.Store(dram_capacity=16 << 20, ssd_dirs=[])
    buf = np.zeros(4096, dtype=np.uint8)
    reg = store.register(buf)
    store.close()
    for call in (lambda: store.exists("k"), store.stats, lambda: store.batch_exists_consecutive(["k"]),
                 lambda: store.remove("k"), store.flush, lambda: store.register(buf),
                 lambda: store.batch_get_ranges(["k"], 0, 0, 16, reg.addr),
                 lambda: store.alloc_buffer(4096)):
        with pytest.raises(te.ClosedError):
            call()
    assert reg.close() is True  # released with the store


def test_negative_and_nan_timeouts_are_typed_errors():
    a = te.TransferEngine(unique("timeouts"))
    for t in (-1, float("nan"), float("-inf")):
        with pytest.raises(te.InvalidArgument, match="timeout"):
            a.recv_notification(timeout=t)
        with pytest.raises(te.InvalidArgument, match="timeout"):
            a.notifications().recv(timeout=t)
    a.shutdown()


def test_object_arrays_are_refused():
    a = te.TransferEngine(unique("objects"))
    objs = np.array([object() for _ in range(16)], dtype=object)
    with pytest.raises(te.DtypeError, match="object"):
        a.register(objs)
    with umbp.Store(dram_capacity=16 << 20, ssd_dirs=[]) as store:
        with pytest.raises(te.DtypeError, match="object"):
            store.register(objs)
    # A structured dtype whose field is called O... is data, and registers.
    named = np.zeros(4, dtype=[("Offset", np.uint64)])
    assert a.register(named).close() is True
    a.shutdown()


def test_a_second_engine_under_a_live_name_is_refused_by_name():
    name = unique("twin")
    first = te.TransferEngine(name)
    with pytest.raises(te.SegmentNameTakenError, match=name):
        te.TransferEngine(name)
    first.shutdown()
    second = te.TransferEngine(name)  # free again once the first shut down
    assert second.segment_name == name
    second.shutdown()


# --- Segments follow their peer: memory registered after the open is reachable ------------------


@pytest.mark.parametrize("metadata", ["in-process", "p2p"])
def test_a_buffer_the_peer_registers_after_the_open_is_reachable_at_once(metadata):
    from conftest import free_port
    if metadata == "p2p":
        port = free_port()
        env_b = {"TE_METADATA": "p2p", "TE_P2P_LISTEN": f"127.0.0.1:{port}", "TE_TRANSPORTS": "tcp",
                 "TE_TCP_LISTEN": "127.0.0.1:0", "TE_TCP_ADVERTISE": "127.0.0.1"}
        env_a = {**env_b, "TE_P2P_LISTEN": "127.0.0.1:0"}
        b = te.TransferEngine(unique("late-b"), env=env_b)
        a = te.TransferEngine(unique("late-a"), env=env_a)
        name = f"{b.segment_name}@127.0.0.1:{port}"
    else:
        a, b = te.TransferEngine(unique("late-a")), te.TransferEngine(unique("late-b"))
        name = b.segment_name
    src = np.arange(4096, dtype=np.uint8)
    rs = a.register(src)
    first = np.zeros(4096, dtype=np.uint8)
    b.register(first)
    seg = a.open_segment(name)
    for i in range(ROUNDS):
        late = np.zeros(4096, dtype=np.uint8)
        rl = b.register(late)  # after the open: the descriptor a holds does not have it
        assert a.write(seg, rs.addr, rl.addr, 4096).bytes == 4096, i
        assert np.array_equal(late, src), i
        rl.close()
    # Truly out of bounds is still the caller's error, after one refresh.
    with pytest.raises(te.OutOfBoundsError):
        a.write(seg, rs.addr, 8, 4096)
    a.shutdown()
    b.shutdown()


def test_memory_freed_under_register_ptr_is_blamed_on_this_process_not_the_peer():
    import ctypes
    import mmap
    a = te.TransferEngine(unique("freed-a"), transports=["tcp"])
    b = te.TransferEngine(unique("freed-b"), transports=["tcp"])
    dst = np.zeros(MiB, dtype=np.uint8)
    rd = b.register(dst)
    seg = a.open_segment(b.segment_name)
    m = mmap.mmap(-1, MiB)
    view = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(view)
    del view
    reg = a.register_ptr(addr, MiB)  # the caller promised to keep it mapped...
    m.close()  # ...and did not: unmapped under the registration
    with pytest.raises(te.BatchFailedError) as e:
        a.write(seg, addr, rd.addr, MiB)
    errors = [err for _, err in e.value.failures]
    assert all(isinstance(err, te.IoError) and not isinstance(err, te.PeerGoneError) for err in errors), errors
    assert "not mapped" in str(errors[0])
    reg.close()
    a.shutdown()
    b.shutdown()


def test_a_deadline_fails_only_its_own_batch():
    a = te.TransferEngine(unique("dl-a"), transports=["tcp"])
    b = te.TransferEngine(unique("dl-b"), transports=["tcp"])
    size = 128 * MiB
    src = (np.arange(size, dtype=np.uint64) % 251).astype(np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    small, small_dst = np.ones(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    rs, rd, rsm, rsd = a.register(src), b.register(dst), a.register(small), b.register(small_dst)
    seg = a.open_segment(b.segment_name)
    for _ in range(3):
        dst[:] = 0
        big = a.submit_write(seg, rs.addr, rd.addr, size)  # no deadline
        # Queued behind the big one on the same connection, with a deadline it cannot meet
        # while it waits there (or met, on a machine fast enough: either way it is its own).
        quick = a.submit_write(seg, rsm.addr, rsd.addr, 4096, deadline=0.001)
        try:
            quick.wait(timeout=60)
        except te.BatchFailedError as e:
            assert all(isinstance(err, te.TimeoutError) for _, err in e.failures), e.failures
        assert big.wait(timeout=120).bytes == size  # untouched by the other batch's deadline
        assert np.array_equal(dst, src)
    a.shutdown()
    b.shutdown()


def test_a_kv_buffer_freed_during_another_threads_get_is_refused_until_the_get_is_done():
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "umbp.sock")
        with umbp.Server(sock, dram_capacity=96 << 20, ssd_dirs=[]):
            with umbp.Store(connect=sock) as store:
                size = 16 * MiB
                kv = store.alloc_buffer(size)
                view = np.frombuffer(kv, dtype=np.uint8)
                view[:] = 3
                reg = store.register(view)
                assert store.batch_put_ranges(["kv"], size, 0, 0, size, reg.addr) == [None]
                for _ in range(ROUNDS):
                    started, results = threading.Event(), []
                    t = threading.Thread(target=_getter, args=(store, "kv", size, reg.addr, started, results))
                    t.start()
                    started.wait()
                    with pytest.raises(te.InFlightError):
                        store.free_buffer(kv)  # a view (registered, in use) still exists
                    t.join(timeout=60)
                    assert results and all(r == [size] for r in results), results
                reg.close()
                del view
                store.free_buffer(kv)


def test_closing_or_dropping_a_segment_during_another_threads_batch_keeps_the_batch_whole():
    a = te.TransferEngine(unique("seg-a"), transports=["tcp"])
    b = te.TransferEngine(unique("seg-b"), transports=["tcp"])
    size = 32 * MiB
    src = (np.arange(size, dtype=np.uint64) % 241).astype(np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    for how in ("close", "del"):
        for _ in range(ROUNDS // 4 + 1):
            dst[:] = 0
            seg = a.open_segment(b.segment_name)
            batch = a.submit_write(seg, rs.addr, rd.addr, size)
            if how == "close":
                a.close_segment(seg)  # in-flight requests finish; later submits are refused
                with pytest.raises(te.TeError):
                    a.write(seg, rs.addr, rd.addr, 16)
            else:
                del seg
                gc.collect()
            assert batch.wait(timeout=120).bytes == size
            assert np.array_equal(dst, src)
    a.shutdown()
    b.shutdown()
