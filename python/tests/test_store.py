"""The UMBP bindings: the three modes, ranged puts and gets from numpy arrays, byte-verified."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import te
from te import umbp
from conftest import skip_or_fail, unique

LAYER = 1728  # DeepSeek-V4-Pro's smallest pool: one layer of one page
LAYERS = 4
PAGES = 8


def page_bytes(page: int) -> np.ndarray:
    i = np.arange(LAYERS * LAYER, dtype=np.uint64)
    return ((i * 2654435761 + page * 977) >> np.uint64(5)).astype(np.uint8)


def zeros(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.uint8)


def offload_and_restore(store: umbp.Store, alloc=zeros):
    """Offloads PAGES pages from per-layer buffers, restores layers 1..2 of every page into fresh
    per-layer buffers, checks every byte. `alloc(n)` gives a writable uint8 array."""
    keys = [unique("page") for _ in range(PAGES)]
    src = [alloc(PAGES * LAYER) for _ in range(LAYERS)]  # layer buffer: [page][LAYER bytes]
    for p in range(PAGES):
        for layer in range(LAYERS):
            src[layer][p * LAYER:(p + 1) * LAYER] = page_bytes(p)[layer * LAYER:(layer + 1) * LAYER]
    regs = [store.register(b) for b in src]
    # One put call: every page is an object tiled by its LAYERS ranges.
    key_index = np.repeat(np.arange(PAGES, dtype=np.uint64), LAYERS)
    layer_of = np.tile(np.arange(LAYERS, dtype=np.uint64), PAGES)
    offsets = layer_of * LAYER
    addrs = np.array([regs[int(l)].addr for l in layer_of], dtype=np.uint64) + key_index * LAYER
    put = store.batch_put_ranges(keys, LAYERS * LAYER, key_index, offsets, LAYER, addrs,
                                 depths=list(range(PAGES)))
    assert put == [None] * PAGES
    assert all(store.exists(k) for k in keys)
    assert store.batch_exists_consecutive(keys + [unique("absent")] + keys) == PAGES
    # Restore one layer group (layers 1 and 2) into per-layer destination buffers.
    group = [1, 2]
    dst = [alloc(PAGES * LAYER) for _ in group]
    dregs = [store.register(b) for b in dst]
    ki = np.repeat(np.arange(PAGES, dtype=np.uint64), len(group))
    gl = np.tile(np.arange(len(group), dtype=np.uint64), PAGES)
    offs = (gl + group[0]) * LAYER
    daddrs = np.array([dregs[int(g)].addr for g in gl], dtype=np.uint64) + ki * LAYER
    got = store.batch_get_ranges(keys, ki, offs, LAYER, daddrs)
    assert got == [len(group) * LAYER] * PAGES
    for gi, layer in enumerate(group):
        for p in range(PAGES):
            expect = page_bytes(p)[layer * LAYER:(layer + 1) * LAYER]
            assert np.array_equal(dst[gi][p * LAYER:(p + 1) * LAYER], expect), (layer, p)
    # A missing key is that key's result, not the call's.
    missing = store.batch_get_ranges([unique("nope")], 0, 0, LAYER, dregs[0].addr)
    assert isinstance(missing[0], te.NotFoundError)
    # Shape errors raise before any byte moves.
    with pytest.raises(te.RangeError):
        store.batch_get_ranges(keys[:1], 0, LAYERS * LAYER - 8, LAYER, dregs[0].addr)
    with pytest.raises(te.ShapeError, match="not consecutive"):
        store.batch_get_ranges(keys[:2], np.array([0, 1, 0], dtype=np.uint64), 0, 16,
                               np.array([dregs[0].addr, dregs[0].addr + 64, dregs[0].addr + 128], dtype=np.uint64))
    with pytest.raises(te.InvalidArgument, match="key_index"):
        store.batch_get_ranges(keys[:1], 5, 0, 16, dregs[0].addr)
    with pytest.raises(te.DtypeError):
        store.batch_get_ranges(keys[:1], 0, np.zeros(1, dtype=np.float32), 16, dregs[0].addr)
    assert store.remove(keys[0]) is True
    assert store.remove(keys[0]) is False
    assert not store.exists(keys[0])
    stats = store.stats()
    assert stats.core.puts_ok >= PAGES
    for r in regs + dregs:
        r.close()
    return stats


def test_local_mode():
    with umbp.Store(dram_capacity=64 << 20, ssd_dirs=[]) as store:
        assert store.mode == "local"
        assert store.config["core"]["dram_capacity"] == 64 << 20
        stats = offload_and_restore(store)
        assert stats.standalone is None and stats.cluster is None
        assert stats.core.dram_objects == PAGES - 1


def test_local_mode_with_an_ssd_tier():
    with tempfile.TemporaryDirectory() as d:
        with umbp.Store(dram_capacity=16 << 20, ssd_dirs=[d], write_through=True, ssd_direct="off") as store:
            stats = offload_and_restore(store)
            assert stats.core.ssd_written_bytes > 0


def test_bad_options_raise():
    with pytest.raises(te.ConfigError, match="UMBP_DRAM_PAGE_BYTES"):
        umbp.Store(dram_page_bytes=1000)
    with pytest.raises(te.InvalidArgument, match="unknown option"):
        umbp.Store(dram_capacty=1 << 20)
    with pytest.raises(te.InvalidArgument, match="eviction"):
        umbp.Store(eviction="random")
    with pytest.raises(te.ConfigError, match="UMBP_DRAM_CAPACITY"):
        umbp.Store(env={"UMBP_DRAM_CAPACITY": "lots"})
    with pytest.raises(te.ReadOnlyBufferError):
        with umbp.Store(dram_capacity=1 << 20) as s:
            s.register(b"read-only")


def test_a_collected_store_buffer_is_deregistered():
    import gc

    with umbp.Store(dram_capacity=16 << 20, ssd_dirs=[]) as store:
        buf = zeros(8192)
        handle = store.register(buf)
        with pytest.raises(te.AlreadyRegisteredError):
            store.register(buf)
        del handle
        gc.collect()
        deadline = time.monotonic() + 10
        while True:  # deregistered on the runtime: the memory can be registered again
            try:
                again = store.register(buf)
                break
            except te.AlreadyRegisteredError:
                assert time.monotonic() < deadline, "the collected buffer stayed registered"
                time.sleep(0.01)
        again.close()


SERVER = r"""
import sys
from te import umbp
server = umbp.Server(sys.argv[1], dram_capacity=64 << 20, ssd_dirs=[])
print("LISTENING", flush=True)
server.serve_forever()
"""


def test_standalone_mode_against_a_server_process():
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "umbp.sock")
        server = subprocess.Popen([sys.executable, "-c", SERVER, sock], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "LISTENING"
            with umbp.Store(connect=sock) as store:
                assert store.mode == "standalone"
                assert str(store.config["standalone"]["socket"]) == sock
                bufs = []

                def alloc(n):
                    kv = store.alloc_buffer(n)
                    bufs.append(kv)
                    return np.frombuffer(kv, dtype=np.uint8)

                stats = offload_and_restore(store, alloc)
                assert stats.standalone is not None
                assert stats.core.puts_ok >= PAGES
                # Memory the server cannot map is refused by name.
                with pytest.raises(te.TeError):
                    reg = store.register(np.zeros(4096, dtype=np.uint8))
                    store.batch_get_ranges(["x"], 0, 0, 16, reg.addr)
        finally:
            server.terminate()
            server.wait(timeout=20)


def test_an_in_process_server_stops_cleanly():
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "umbp.sock")
        with umbp.Server(sock, dram_capacity=16 << 20, ssd_dirs=[]):
            with umbp.Store(connect=sock) as store:
                kv = store.alloc_buffer(4096)
                view = np.frombuffer(kv, dtype=np.uint8)
                view[:] = 7
                reg = store.register(view)
                assert store.batch_put_ranges(["k"], 4096, 0, 0, 4096, reg.addr) == [None]
                view[:] = 0
                assert store.batch_get_ranges(["k"], 0, 0, 4096, reg.addr) == [4096]
                assert (view == 7).all()
                reg.close()
                with pytest.raises(te.InFlightError, match="views"):
                    store.free_buffer(kv)
                del view
                store.free_buffer(kv)
        assert not os.path.exists(sock)


def test_distributed_mode_reads_a_peers_pages(etcd):
    if not umbp.DISTRIBUTED:
        skip_or_fail("etcd", "this build of te has no distributed mode (cargo feature distributed)")
    prefix = "/" + unique("py")
    url = f"etcd://{etcd}{prefix}"
    with umbp.Store(cluster=url, dram_capacity=32 << 20, ssd_dirs=[], segment_name=unique("peer-a")) as a, \
         umbp.Store(cluster=url, dram_capacity=32 << 20, ssd_dirs=[], segment_name=unique("peer-b")) as b:
        assert a.mode == "distributed"
        assert a.config["cluster"]["prefix"] == prefix
        src = page_bytes(0)
        ra = a.register(src)
        assert a.batch_put_ranges(["shared-page"], src.size, 0, 0, src.size, ra.addr) == [None]
        dst = np.zeros(src.size, dtype=np.uint8)
        rb = b.register(dst)
        deadline = time.monotonic() + 15
        while True:
            got = b.batch_get_ranges(["shared-page"], 0, 0, src.size, rb.addr)
            if got == [src.size] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert got == [src.size]
        assert np.array_equal(src, dst)
        assert b.stats().cluster.remote_hits >= 1
