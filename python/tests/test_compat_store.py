"""te.compat's stores: ``mooncake.store.MooncakeDistributedStore`` on UMBP against the released
wheel (with ``mooncake_master`` from the wheel), same calls and same observations, named where
te deliberately differs; ``mori.umbp``'s client on UMBP; and HiCache-style page store and
restore through the import hook (``TE_COMPAT=mooncake,mori``), byte-verified."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

import te.compat
from conftest import free_port, skip_or_fail, unique
from te import umbp
from te.compat import mooncake_store, mori_umbp

MiB = 1 << 20


@pytest.fixture(scope="module")
def master():
    """A mooncake_master from the wheel on a free port: its address; skip naming why."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the Mooncake wheel is not installed in this venv (scripts/python-tests.sh installs its "
                    "pinned version from PyPI; PyPI unreachable?)")
    binary = os.path.join(list(spec.submodule_search_locations)[0], "mooncake_master")
    port = free_port()
    proc = subprocess.Popen([binary, "-rpc_port", str(port), "-metrics_port", str(free_port())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30  # hang guard only
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, "mooncake_master exited"
            assert time.monotonic() < deadline, "mooncake_master never listened"
            time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait()


@pytest.fixture(params=["te", "mooncake"])
def store(request):
    if request.param == "te":
        s, master_addr = mooncake_store.MooncakeDistributedStore(), "local://"
    else:
        master_addr = request.getfixturevalue("master")
        from mooncake.store import MooncakeDistributedStore

        s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 64 * MiB, 16 * MiB, "tcp", "", master_addr) == 0
    yield request.param, s
    assert s.close() == 0


def keyer():
    tag = uuid.uuid4().hex[:8]  # the wheel's master outlives one test: keys never repeat
    return lambda k: f"{tag}-{k}"


def test_bytes_calls_and_existence(store):
    name, s = store
    k = keyer()
    assert s.is_exist(k("nope")) == 0
    assert s.put(k("k1"), b"hello world") == 0
    assert s.get(k("k1")) == b"hello world"
    assert s.get(k("nope")) == b""
    assert s.is_exist(k("k1")) == 1
    assert s.batch_is_exist([k("k1"), k("nope")]) == [1, 0]
    assert s.get_size(k("k1")) == 11 and s.get_size(k("nope")) == -704
    assert s.put_batch([k("b1"), k("b2")], [b"x" * 10, b"y" * 20]) == 0
    assert s.get_batch([k("b1"), k("b2")]) == [b"x" * 10, b"y" * 20]
    assert s.remove(k("k1"), True) == 0
    assert s.remove(k("k1"), True) == -704
    assert s.is_exist(k("k1")) == 0


def test_registered_buffer_calls(store):
    name, s = store
    k = keyer()
    buf = np.zeros(MiB, np.uint8)
    p = buf.ctypes.data
    assert s.register_buffer(p, buf.nbytes) == 0
    try:
        assert s.register_buffer(p, buf.nbytes) == -600          # overlapping registration
        buf[:100] = 7
        buf[100:150] = 9
        assert s.put_from(k("k2"), p, 100) == 0
        assert s.get_into(k("k2"), p + 1000, 200) == 100           # bytes read
        assert (buf[1000:1100] == 7).all()
        assert s.get_into(k("k2"), p + 1000, 50) == -600           # buffer too small
        assert s.get_into(k("nope"), p + 1000, 50) == -704
        assert s.batch_put_from([k("a"), k("b")], [p, p + 100], [100, 50]) == [0, 0]
        assert s.batch_get_into([k("a"), k("b"), k("nope")], [p + 4000, p + 5000, p + 6000], [100, 50, 10]) == \
            [100, 50, -704]
        assert (buf[4000:4100] == 7).all() and (buf[5000:5050] == 9).all()
        assert s.batch_get_into([k("a")], [p + 4000], [10]) == [-600]
        # one object from two buffers, read back into two others
        assert s.batch_put_from_multi_buffers([k("m1")], [[p, p + 100]], [[10, 20]]) == [0]
        assert s.batch_get_into_multi_buffers([k("m1"), k("nope")], [[p + 8000, p + 9000], [p + 10000]],
                                              [[10, 20], [5]]) == [30, -704]
        assert (buf[8000:8010] == 7).all() and (buf[9000:9020] == 9).all()
        assert s.batch_get_into_multi_buffers([k("m1")], [[p + 8000, p + 9000]], [[15, 15]]) == [30]
        # ranges of objects into one buffer: per range its size, or its key's code
        buf[20000:20100] = 0
        assert s.get_into_ranges([p + 20000], [[k("a"), k("b")]], [[[0, 10], [20]]], [[[0, 50], [5]]],
                                 [[[10, 10], [5]]]) == [[[10, 10], [5]]]
        assert (buf[20000:20020] == 7).all() and (buf[20020:20025] == 9).all()
        assert s.get_into_ranges([p + 20000], [[k("a")]], [[[0]]], [[[95]]], [[[10]]]) == [[[-600]]]
        assert s.get_hostname().startswith("127.0.0.1")
    finally:
        assert s.unregister_buffer(p) == 0
    assert s.unregister_buffer(p) == -600


# Where te deliberately differs from the wheel (each named; docs/python.md says why).
DIFFERS = {
    # UMBP's put replaces the object (Mooncake's upsert); the wheel keeps the first value.
    "put over an existing key, then get": {"te": b"second", "mooncake": b"first"},
    # The wheel's tcp path reads and writes unregistered memory unchecked; te refuses it.
    "put_from unregistered memory": {"te": -600, "mooncake": 0},
    "get_into unregistered memory": {"te": -600, "mooncake": 5},
}


def test_named_differences(store):
    name, s = store
    k = keyer()
    assert s.put(k("x"), b"first") == 0
    s.put(k("x"), b"second")
    junk = np.zeros(64, np.uint8)
    got = {
        "put over an existing key, then get": s.get(k("x")),
        "put_from unregistered memory": s.put_from(k("junk"), junk.ctypes.data, 64),
        "get_into unregistered memory": s.get_into(k("x"), junk.ctypes.data, 64),
    }
    assert got == {what: v[name] for what, v in DIFFERS.items()}


def test_setup_dict_form_and_refusals(caplog):
    s = mooncake_store.MooncakeDistributedStore()
    assert s.setup({"local_hostname": "127.0.0.1"}) == -600          # metadata_server missing
    assert s.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                    "master_server_addr": "127.0.0.1:50051"}) == -600   # a Mooncake master: not here
    assert "te has no Mooncake master" in caplog.text
    assert s.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": 32 * MiB, "master_server_addr": "local://"}) == 0
    try:
        assert s.put("k", b"v") == 0 and s.get("k") == b"v"
        cfg = mooncake_store.ReplicateConfig()
        cfg.replica_num = 2
        assert s.put("k2", b"v", cfg) == -600                          # one copy only: refused
        assert s.is_exist("k2") == 0
        with pytest.raises(NotImplementedError, match="put_tensor"):
            s.put_tensor("t", None)
        with pytest.raises(NotImplementedError, match="remove_all"):
            s.remove_all()
    finally:
        assert s.close() == 0
    assert s.health_check() == 1
    assert s.put("k", b"v") < 0                                        # closed: a code, no crash


def test_mori_client_calls():
    cfg = mori_umbp.UMBPConfig()
    cfg.dram.capacity_bytes = 64 * MiB
    u = mori_umbp.UMBPClient(cfg)
    try:
        src = (np.arange(8192, dtype=np.uint64) % 251).astype(np.uint8)
        dst = np.zeros(8192, np.uint8)
        # no registration: mori's standalone client needs none, so neither does ours
        assert u.put_from_ptr("p0", src.ctypes.data, 4096) is True
        assert u.batch_put_from_ptr(["p1", "p2"], [src.ctypes.data + 4096, src.ctypes.data], [4096, 100]) == \
            [True, True]
        assert u.exists("p1") is True and u.exists("zz") is False
        assert u.batch_exists(["p0", "zz", "p2"]) == [True, False, True]
        assert u.batch_exists_consecutive(["p0", "p1", "zz", "p2"]) == 2
        assert u.register_memory(dst.ctypes.data, dst.nbytes) is True
        assert u.get_into_ptr("p1", dst.ctypes.data, 4096) is True
        assert np.array_equal(dst[:4096], src[4096:])
        assert u.batch_get_into_ptr(["p0", "zz", "p2"], [dst.ctypes.data, dst.ctypes.data + 4096,
                                                          dst.ctypes.data + 5000], [4096, 10, 50]) == \
            [True, False, False]  # a miss, and an object larger than its buffer
        assert np.array_equal(dst[:4096], src[:4096])
        assert u.batch_put_from_ptr_with_depth(["d"], [src.ctypes.data], [64], [-1]) == [True]
        assert u.flush() is True
        assert u.clear() is True
        assert u.batch_exists(["p0", "p1", "d"]) == [False, False, False]
        assert u.get_deployment_mode() == "Local" and u.is_distributed() is False
        with pytest.raises(NotImplementedError, match="match_external_kv"):
            u.match_external_kv(["h"])
    finally:
        u.close()


def test_mori_config_refuses_a_non_etcd_master():
    cfg = mori_umbp.UMBPConfig()
    cfg.distributed = mori_umbp.UMBPDistributedConfig()
    cfg.distributed.master_config.master_address = "10.0.0.1:50051"
    with pytest.raises(ValueError, match="etcd://"):
        mori_umbp.UMBPClient(cfg)


# The master address picks UMBP's mode (mooncake_store._options): a node's umbp-server over its
# unix socket, or the distributed store whose members meet in an etcd.
SERVER = r"""
import sys
from te import umbp
server = umbp.Server(sys.argv[1], dram_capacity=64 << 20, ssd_dirs=[])
print("LISTENING", flush=True)
server.serve_forever()
"""


@pytest.fixture
def umbp_server(tmp_path):
    """A umbp-server in its own process on a unix socket in tmp_path: (socket path, process)."""
    sock = str(tmp_path / "umbp.sock")
    server = subprocess.Popen([sys.executable, "-c", SERVER, sock], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "LISTENING"
        yield sock, server
    finally:
        server.kill()
        server.wait()


def setup_store(master: str, local_buffer_size: int = 1 * MiB):
    s = mooncake_store.MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 64 * MiB, local_buffer_size, "tcp", "", master) == 0
    return s


def test_standalone_server_over_its_unix_socket(umbp_server, caplog):
    sock, server = umbp_server
    # both spellings of the socket: unix:///path and the bare path
    a, b = setup_store(f"unix://{sock}"), setup_store(sock)
    try:
        assert a._store.mode == "standalone" and b._store.mode == "standalone"
        big = bytes(range(256)) * (2 * MiB // 256 + 7)     # larger than the 1 MiB staging buffer
        assert a.put("small", b"hello world") == 0
        assert a.put("big", big) == 0
        # the server holds the objects: the other client reads them
        assert b.get("small") == b"hello world" and b.get("big") == big
        assert b.is_exist("small") == 1 and b.is_exist("nope") == 0
        assert b.batch_is_exist(["big", "nope", "small"]) == [1, 0, 1]
        assert b.get_size("big") == len(big) and b.get_size("nope") == -704
        assert b.get("nope") == b""
        assert b.put_batch(["b1", "b2"], [b"x" * 10, b"y" * 20]) == 0
        assert a.get_batch(["b1", "b2"]) == [b"x" * 10, b"y" * 20]
        assert a.remove("small") == 0 and a.remove("small") == -704
        assert b.is_exist("small") == 0
        assert a.put("", b"v") == -400                      # a bad key: Mooncake's code
        # Caller memory the server cannot map (not from the store's alloc_buffer): refused with
        # a code and the reason in the log, never a registration that later fails silently.
        buf = np.zeros(4096, np.uint8)
        caplog.clear()
        assert a.register_buffer(buf.ctypes.data, buf.nbytes) < 0
        assert "cannot be shared with the umbp-server" in caplog.text
        assert a.put_from("k", buf.ctypes.data, 100) == -600
        # the server gone: codes, not a crash or a hang
        server.kill()
        server.wait()
        assert a.put("after", b"v") < 0
        assert a.get("big") == b""
        assert a.batch_is_exist(["big"]) == [-1]
    finally:
        a.close()
        b.close()


def test_standalone_master_whose_server_is_absent_is_a_code(tmp_path, caplog):
    s = mooncake_store.MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 64 * MiB, 1 * MiB, "tcp", "", f"unix://{tmp_path}/nothing.sock")
    if rc == 0:  # a store that connects on first use: the first call says it
        try:
            assert s.put("k", b"v") < 0
            assert s.is_exist("k") == -1
        finally:
            s.close()
    else:
        assert rc == -600
    assert "nothing.sock" in caplog.text or "umbp-server" in caplog.text, caplog.text


def test_distributed_umbp_through_an_etcd_master(etcd):
    if not umbp.DISTRIBUTED:
        skip_or_fail("etcd", "this build of te has no distributed mode (cargo feature distributed)")
    master = f"etcd://{etcd}/{unique('compat')}"
    a, b = setup_store(master), setup_store(master)
    try:
        assert a._store.mode == "distributed" and b._store.mode == "distributed"
        value = bytes(range(256)) * 40
        assert a.put("page-a", value) == 0
        deadline = time.monotonic() + 15  # hang guard: the directory entry reaches b's copy
        while b.is_exist("page-a") != 1:
            assert time.monotonic() < deadline, "b never saw a's key"
            time.sleep(0.05)
        # b reads the object a owns, through each read call
        assert b.batch_is_exist(["page-a", "nope"]) == [1, 0]
        assert b.get_size("page-a") == len(value) and b.get_size("nope") == -704
        assert b.get("page-a") == value and b.get("nope") == b""
        buf = np.zeros(64 * 1024, np.uint8)
        p = buf.ctypes.data
        assert b.register_buffer(p, buf.nbytes) == 0
        try:
            assert b.get_into("page-a", p, 32 * 1024) == len(value)
            assert bytes(buf[:len(value)]) == value
            assert b.get_into("page-a", p, 100) == -600                 # buffer too small
            assert b.get_into("nope", p, 100) == -704
            buf[:] = 0
            assert b.batch_get_into(["nope", "page-a"], [p, p + 20000], [100, len(value)]) == [-704, len(value)]
            assert bytes(buf[20000:20000 + len(value)]) == value
            # b's own keys and a's in one call
            buf[:100] = 5
            assert b.put_from("page-b", p, 100) == 0
            assert b.batch_get_into(["page-b", "page-a"], [p + 40000, p + 50000], [100, len(value)]) == \
                [100, len(value)]
            assert (buf[40000:40100] == 5).all() and bytes(buf[50000:50000 + len(value)]) == value
        finally:
            assert b.unregister_buffer(p) == 0
        assert a.get("page-b") == bytes([5]) * 100
        assert a.remove("page-a") == 0
        deadline = time.monotonic() + 15
        while b.is_exist("page-a") != 0:
            assert time.monotonic() < deadline, "b still sees a removed key"
            time.sleep(0.05)
        assert b.get("page-a") == b""
    finally:
        assert a.close() == 0
        assert b.close() == 0


def test_mori_client_distributed_through_an_etcd_master(etcd):
    if not umbp.DISTRIBUTED:
        skip_or_fail("etcd", "this build of te has no distributed mode (cargo feature distributed)")

    def client():
        cfg = mori_umbp.UMBPConfig()
        cfg.dram.capacity_bytes = 64 * MiB
        cfg.distributed = mori_umbp.UMBPDistributedConfig()
        cfg.distributed.master_config.master_address = master
        return mori_umbp.UMBPClient(cfg)

    master = f"etcd://{etcd}/{unique('mori')}"
    a, b = client(), client()
    try:
        assert a.is_distributed() and a.get_deployment_mode() == "Distributed"
        src = (np.arange(3 * 4096, dtype=np.uint64) % 249).astype(np.uint8)
        dst = np.zeros(3 * 4096, np.uint8)
        assert a.batch_put_from_ptr(["p0", "p1"], [src.ctypes.data, src.ctypes.data + 4096], [4096, 4096]) == \
            [True, True]
        deadline = time.monotonic() + 15  # hang guard: the directory entries reach b
        while b.batch_exists(["p0", "p1"]) != [True, True]:
            assert time.monotonic() < deadline, "b never saw a's keys"
            time.sleep(0.05)
        assert b.exists("zz") is False
        assert b.batch_exists_consecutive(["p0", "p1", "zz", "p0"]) == 2
        assert b.register_memory(dst.ctypes.data, dst.nbytes) is True
        assert b.batch_get_into_ptr(["p1", "zz", "p0"], [dst.ctypes.data, dst.ctypes.data + 4096,
                                                          dst.ctypes.data + 8192], [4096, 4096, 100]) == \
            [True, False, False]  # a's object, a miss, a's object larger than its buffer
        assert np.array_equal(dst[:4096], src[4096:8192])
        assert b.get_into_ptr("p0", dst.ctypes.data + 8192, 4096) is True
        assert np.array_equal(dst[8192:], src[:4096])
    finally:
        a.close()
        b.close()


def test_distributed_master_whose_etcd_is_absent_is_a_code(caplog):
    if not umbp.DISTRIBUTED:
        skip_or_fail("etcd", "this build of te has no distributed mode (cargo feature distributed)")
    from conftest import free_port

    s = mooncake_store.MooncakeDistributedStore()
    t0 = time.monotonic()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 64 * MiB, 1 * MiB, "tcp", "", f"etcd://127.0.0.1:{free_port()}") \
        == -600
    assert time.monotonic() - t0 < 60  # hang guard: bounded by the cluster timeout
    assert "etcd" in caplog.text
    assert s.put("k", b"v") < 0


def run_hooked(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TE_COMPAT": "mooncake,mori", "TE_COMPAT_SHADOW": "mooncake,mori",
           "PYTHONPATH": os.pathsep.join([te.compat.boot_dir(), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True, timeout=120)


# HiCache's shape: a host KV pool of pages registered once; pages stored under their hashes
# (MHA: a "_k" and a "_v" object per page), existence checked in one call, pages restored into
# freed pool slots.
HICACHE_MOONCAKE = r"""
import numpy as np
from mooncake.store import MooncakeDistributedStore
assert MooncakeDistributedStore.__module__ == "te.compat.mooncake_store"
page, pages = 4096, 16
pool = (np.arange(2 * pages * page, dtype=np.uint64) * 13 % 251).astype(np.uint8)
want = pool.copy()
base = pool.ctypes.data
store = MooncakeDistributedStore()
assert store.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": 64 << 20, "local_buffer_size": 0, "protocol": "tcp",
                    "master_server_addr": "local://"}) == 0
assert store.register_buffer(base, pool.nbytes) == 0
hashes = [f"h{i:04x}" for i in range(pages)]
keys = [h + s for h in hashes for s in ("_k", "_v")]
ptrs = [base + (2 * i + j) * page for i in range(pages) for j in range(2)]
assert store.batch_is_exist(keys) == [0] * len(keys)
assert store.batch_put_from(keys, ptrs, [page] * len(keys)) == [0] * len(keys)
pool[:] = 0
assert store.batch_is_exist(keys + ["h-missing_k"]) == [1] * len(keys) + [0]
assert store.batch_get_into(keys, ptrs, [page] * len(keys)) == [page] * len(keys)
assert np.array_equal(pool, want)
assert store.unregister_buffer(base) == 0 and store.close() == 0
print("OK")
"""

HICACHE_MORI = r"""
import numpy as np
from mori.umbp import UMBPClient, UMBPConfig
assert UMBPClient.__module__ == "te.compat.mori_umbp"
page, pages = 4096, 16
pool = (np.arange(pages * page, dtype=np.uint64) * 7 % 253).astype(np.uint8)
want = pool.copy()
base = pool.ctypes.data
cfg = UMBPConfig()
cfg.dram.capacity_bytes = 64 << 20
client = UMBPClient(cfg)
assert client.register_memory(base, pool.nbytes)
keys = [f"page-{i}" for i in range(pages)]
ptrs = [base + i * page for i in range(pages)]
assert client.batch_exists_consecutive(keys) == 0
assert client.batch_put_from_ptr_with_depth(keys, ptrs, [page] * pages, list(range(pages))) == [True] * pages
pool[:] = 0
assert client.batch_exists(keys) == [True] * pages
assert client.batch_exists_consecutive(keys) == pages
assert client.batch_get_into_ptr(keys, ptrs, [page] * pages) == [True] * pages
assert np.array_equal(pool, want)
assert client.flush()
client.close()
print("OK")
"""


@pytest.mark.parametrize("program", [HICACHE_MOONCAKE, HICACHE_MORI], ids=["mooncake.store", "mori.umbp"])
def test_hicache_page_store_and_restore_through_the_hook(program):
    done = run_hooked(program)
    assert done.stdout.split() == ["OK"], done.stderr
