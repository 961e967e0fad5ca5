"""te.compat.mooncake against the released Mooncake wheel: each scenario runs once on our layer
and once on the wheel (pinned and installed by scripts/python-tests.sh), same inputs, and both
must give the documented observations: return codes, bytes delivered, errors on bad input.
Where te deliberately differs, the expected value names the difference (``DIFFERS``).

Then vLLM's call sequence between two processes through the import hook (TE_COMPAT=mooncake),
and the hook's own rules (never active unless asked; never shadows a real mooncake silently)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import te.compat
from te.compat import mooncake as ours

KiB = 1 << 10


def wheel_engine():
    """The released wheel's TransferEngine class, or skip naming why."""
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("the Mooncake wheel is not installed in this venv (scripts/python-tests.sh installs its "
                    "pinned version from PyPI; PyPI unreachable?)")
    from mooncake.engine import TransferEngine

    return TransferEngine


@pytest.fixture(params=["te", "mooncake"], scope="module")
def impl(request):
    """(name, a pair of initialized engines on loopback tcp with P2PHANDSHAKE)."""
    cls = ours.TransferEngine if request.param == "te" else wheel_engine()
    a, b = cls(), cls()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return request.param, a, b


def pattern(n: int, seed: int) -> np.ndarray:
    i = np.arange(n, dtype=np.uint64)
    return ((i * 2654435761 + seed) >> np.uint64(7)).astype(np.uint8)


class Pair:
    """Engine a with a registered source, engine b with a registered destination."""

    def __init__(self, impl, n=64 * KiB):
        self.name, self.a, self.b = impl
        self.src, self.dst = pattern(n, 3), np.zeros(n, np.uint8)
        self.sp, self.dp = self.src.ctypes.data, self.dst.ctypes.data
        assert self.a.register_memory(self.sp, n) == 0
        assert self.b.register_memory(self.dp, n) == 0
        self.peer = f"127.0.0.1:{self.b.get_rpc_port()}"

    def close(self):
        assert self.a.unregister_memory(self.sp) == 0
        assert self.b.unregister_memory(self.dp) == 0


@pytest.fixture
def pair(impl):
    p = Pair(impl)
    yield p
    p.close()


def test_rpc_port_names_the_peer_and_its_first_buffer(pair):
    assert 0 < pair.b.get_rpc_port() < 65536
    assert pair.a.get_rpc_port() != pair.b.get_rpc_port()
    assert pair.a.get_first_buffer_address(pair.peer) == pair.dp


def test_sync_write_and_read_deliver_the_bytes(pair):
    assert pair.a.transfer_sync_write(pair.peer, pair.sp + 100, pair.dp + 5000, 4096) == 0
    assert np.array_equal(pair.dst[5000:5000 + 4096], pair.src[100:100 + 4096])
    pair.dst[:] = pattern(pair.dst.size, 11)
    assert pair.a.transfer_sync_read(pair.peer, pair.sp, pair.dp + 7, 1000) == 0
    assert np.array_equal(pair.src[:1000], pattern(pair.dst.size, 11)[7:1007])


def test_batch_sync_write_and_read_scatter(pair):
    offs = [i * 1728 for i in range(30)]
    assert pair.a.batch_transfer_sync_write(pair.peer, [pair.sp + o for o in offs],
                                            [pair.dp + 60000 - o - 1728 for o in offs], [1728] * 30) == 0
    for o in offs:
        assert np.array_equal(pair.dst[60000 - o - 1728:60000 - o], pair.src[o:o + 1728])
    got = np.zeros(30 * 100, np.uint8)
    assert pair.a.register_memory(got.ctypes.data, got.nbytes) == 0
    try:
        assert pair.a.batch_transfer_sync_read(pair.peer, [got.ctypes.data + i * 100 for i in range(30)],
                                               [pair.dp + i * 1000 for i in range(30)], [100] * 30) == 0
        for i in range(30):
            assert np.array_equal(got[i * 100:(i + 1) * 100], pair.dst[i * 1000:i * 1000 + 100])
    finally:
        assert pair.a.unregister_memory(got.ctypes.data) == 0


def test_transfer_sync_with_an_opcode(pair):
    op = ours.TransferOpcode if pair.name == "te" else sys.modules["mooncake.engine"].TransferOpcode
    assert pair.a.transfer_sync(pair.peer, pair.sp, pair.dp, 512, op.Write) == 0
    assert np.array_equal(pair.dst[:512], pair.src[:512])
    assert pair.a.batch_transfer_sync(pair.peer, [pair.sp + 512], [pair.dp + 512], [512], op.Write) == 0
    assert np.array_equal(pair.dst[:1024], pair.src[:1024])


def test_async_batches_then_get_batch_transfer_status(pair):
    ids = [pair.a.batch_transfer_async_write(pair.peer, [pair.sp + i * 4096], [pair.dp + i * 4096], [4096])
           for i in range(4)]
    assert all(i != 0 for i in ids) and len(set(ids)) == 4
    assert pair.a.get_batch_transfer_status(ids) == 0
    assert np.array_equal(pair.dst[:4 * 4096], pair.src[:4 * 4096])
    pair.dst[:] = 0
    rid = pair.a.batch_transfer_async_read(pair.peer, [pair.sp + 100], [pair.dp], [64])
    assert rid != 0
    assert pair.a.get_batch_transfer_status([rid]) == 0
    assert not pair.src[100:164].any()


def test_submit_write_then_check_status_until_done(pair):
    bid = pair.a.transfer_submit_write(pair.peer, pair.sp, pair.dp + 8192, 32 * KiB)
    assert bid >= 0
    deadline = time.monotonic() + 60  # hang guard only
    while (status := pair.a.transfer_check_status(bid)) == 0:
        assert time.monotonic() < deadline, "transfer_check_status never reported completion"
        time.sleep(0.001)
    assert status == 1
    assert np.array_equal(pair.dst[8192:8192 + 32 * KiB], pair.src[:32 * KiB])


def test_a_batch_past_its_deadline_checks_as_timed_out(monkeypatch):
    """te only: TE_TRANSFER_TIMEOUT_MS (read at initialize) cuts a 128 MiB loopback write that
    needs tens of ms, and transfer_check_status reports -2 (timed out), not -1."""
    monkeypatch.setenv("TE_TRANSFER_TIMEOUT_MS", "1")
    a, b = ours.TransferEngine(), ours.TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    n = 128 * 1024 * KiB
    src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    assert a.register_memory(src.ctypes.data, n) == 0 and b.register_memory(dst.ctypes.data, n) == 0
    bid = a.transfer_submit_write(f"127.0.0.1:{b.get_rpc_port()}", src.ctypes.data, dst.ctypes.data, n)
    assert bid >= 0
    deadline = time.monotonic() + 60  # hang guard only
    while (status := a.transfer_check_status(bid)) == 0:
        assert time.monotonic() < deadline, "transfer_check_status never reported completion"
        time.sleep(0.001)
    assert status == -2
    assert a.unregister_memory(src.ctypes.data) == 0 and b.unregister_memory(dst.ctypes.data) == 0


def test_registration_codes(impl):
    name, a, _ = impl
    bufs = [np.zeros(4096, np.uint8) for _ in range(3)]
    ptrs, lens = [b.ctypes.data for b in bufs], [b.nbytes for b in bufs]
    assert a.batch_register_memory(ptrs, lens) == 0
    assert a.register_memory(ptrs[1], 4096) == -7            # the same region again: overlapped
    assert a.register_memory(ptrs[1] + 100, 100) == -7       # inside a registered region
    assert a.batch_unregister_memory(ptrs) == 0
    assert a.unregister_memory(ptrs[0]) == -3                # unregistered twice
    assert a.unregister_memory(12345) == -3                  # never registered


def test_bad_input_gives_mooncakes_codes(pair):
    # buffers, addresses and lengths of different lengths
    assert pair.a.batch_transfer_sync_write(pair.peer, [pair.sp, pair.sp], [pair.dp], [1, 1]) == -1
    # an empty batch is nothing to do
    assert pair.a.batch_transfer_sync_write(pair.peer, [], [], []) == 0
    # remote range beyond the peer's registered memory
    assert pair.a.transfer_sync_write(pair.peer, pair.sp, pair.dp + pair.dst.size - 10, 100) == -1
    # a peer nobody listens on
    assert pair.a.transfer_sync_write("127.0.0.1:1", pair.sp, pair.dp, 100) < 0
    assert pair.a.get_first_buffer_address("127.0.0.1:1") == 0


# Deliberate differences: te refuses what the wheel's tcp transport lets through.
DIFFERS = {
    # The wheel's tcp transport never checks local memory (rdma would fail); te refuses an
    # unregistered local buffer before any byte moves.
    "unregistered local buffer": {"te": -1, "mooncake": 0},
    # te refuses a zero-length request (typed ZeroLength error); the wheel does nothing and says 0.
    "zero length": {"te": -1, "mooncake": 0},
    # The wheel registers only as many buffers as both lists hold and says 0; te refuses the call.
    "batch_register_memory lists of different lengths": {"te": -1, "mooncake": 0},
}


def test_named_differences(pair):
    junk = np.zeros(4096, np.uint8)
    got = {
        "unregistered local buffer": pair.a.transfer_sync_write(pair.peer, junk.ctypes.data, pair.dp, 100),
        "zero length": pair.a.transfer_sync_write(pair.peer, pair.sp, pair.dp, 0),
        "batch_register_memory lists of different lengths": pair.a.batch_register_memory([junk.ctypes.data], [1, 2]),
    }
    pair.a.unregister_memory(junk.ctypes.data)  # the wheel registered it; ours did not
    assert got == {what: codes[pair.name] for what, codes in DIFFERS.items()}


def test_our_errors_are_logged_with_te_s_text(caplog):
    pair = Pair(("te", *(_engines())))
    try:
        with caplog.at_level("ERROR", logger="te.compat.mooncake"):
            assert pair.a.transfer_sync_write(pair.peer, pair.sp, pair.dp + pair.dst.size, 1) == -1
        assert "outside every buffer exported" in caplog.text and "transfer_sync_write" in caplog.text
    finally:
        pair.close()


def _engines():
    a, b = ours.TransferEngine(), ours.TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return a, b


def test_initialize_refuses_what_it_cannot_map(caplog):
    e = ours.TransferEngine()
    assert e.register_memory(4096, 4096) == -1  # before initialize
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "carrier-pigeon", "") == -1
    from conftest import free_port

    # An HTTP metadata server that is not there: initialize fails naming why.
    assert e.initialize("127.0.0.1", f"http://127.0.0.1:{free_port()}/metadata", "tcp", "") == -1
    assert "http metadata" in caplog.text and "Connection refused" in caplog.text
    assert e.initialize("127.0.0.1", "https://127.0.0.1:1/metadata", "tcp", "") == -1  # no TLS
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # twice
    with pytest.raises(ours.UnsupportedError, match="get_engine_ptr"):
        e.get_engine_ptr()


def test_unknown_batch_ids_fail_instead_of_blocking():
    # The wheel blocks (or reads freed memory) on an id it already let go; te says -1.
    a, _ = _engines()
    assert a.get_batch_transfer_status([424242]) == -1
    assert a.transfer_check_status(424242) == -1


def test_notifications_carry_name_and_message():
    a, b = _engines()
    dst = np.zeros(64, np.uint8)
    src = pattern(64, 1)
    assert b.register_memory(dst.ctypes.data, 64) == 0 and a.register_memory(src.ctypes.data, 64) == 0
    note = ours.TransferNotify("req-7", "done")
    assert a.transfer_sync(f"127.0.0.1:{b.get_rpc_port()}", src.ctypes.data, dst.ctypes.data, 64,
                           ours.TransferOpcode.Write, note) == 0
    deadline = time.monotonic() + 30  # hang guard only
    while not (got := b.get_notifies()):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert [(n.name, n.msg) for n in got] == [("req-7", "done")]
    assert np.array_equal(dst, src)


# -- the import hook ------------------------------------------------------------------------------

def run_hooked(code: str, *args: str, env_extra=None, **kw) -> subprocess.Popen:
    env = {**os.environ, "TE_COMPAT": "mooncake", "TE_COMPAT_SHADOW": "mooncake",
           "PYTHONPATH": os.pathsep.join([te.compat.boot_dir(), os.environ.get("PYTHONPATH", "")])}
    env.update(env_extra or {})
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


# vLLM's connector, as it calls Mooncake: constructor, initialize with P2PHANDSHAKE, rpc port,
# batch_register_memory of the KV blocks, batch_transfer_sync_write to "host:rpc_port".
VLLM_RECEIVER = r"""
import sys, numpy as np
from mooncake.engine import TransferEngine
assert TransferEngine.__module__ == "te.compat.mooncake", TransferEngine.__module__
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
kv = [np.zeros(16 * 4096, np.uint8) for _ in range(2)]
assert engine.batch_register_memory([t.ctypes.data for t in kv], [t.nbytes for t in kv]) == 0
print("READY", engine.get_rpc_port(), *[t.ctypes.data for t in kv], flush=True)
sys.stdin.readline()
i = np.arange(16 * 4096, dtype=np.uint64)
want = [((i * 31 + layer) % 251).astype(np.uint8) for layer in range(2)]
blocks = [3, 5, 6, 11]
bad = sum(int((kv[l][b * 4096:(b + 1) * 4096] != want[l][b * 4096:(b + 1) * 4096]).sum()) for l in range(2) for b in blocks)
untouched = sum(int(kv[l][b * 4096:(b + 1) * 4096].any()) for l in range(2) for b in range(16) if b not in blocks)
print("MISMATCHED", bad, "UNTOUCHED_WRITTEN", untouched, flush=True)
"""

VLLM_SENDER = r"""
import sys, numpy as np
from mooncake.engine import TransferEngine
port, bases = sys.argv[1], [int(x) for x in sys.argv[2:]]
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
assert engine.get_rpc_port() > 0
i = np.arange(16 * 4096, dtype=np.uint64)
kv = [((i * 31 + layer) % 251).astype(np.uint8) for layer in range(2)]
assert engine.batch_register_memory([t.ctypes.data for t in kv], [t.nbytes for t in kv]) == 0
blocks = [3, 5, 6, 11]
srcs = [kv[l].ctypes.data + b * 4096 for l in range(2) for b in blocks]
dsts = [bases[l] + b * 4096 for l in range(2) for b in blocks]
print("RC", engine.batch_transfer_sync_write(f"127.0.0.1:{port}", srcs, dsts, [4096] * len(srcs)), flush=True)
"""


def test_vllm_call_sequence_between_two_processes_through_the_hook():
    receiver = run_hooked(VLLM_RECEIVER, stdin=subprocess.PIPE)
    try:
        ready = receiver.stdout.readline().split()
        assert ready and ready[0] == "READY", (ready, receiver.stderr.read() if receiver.poll() is not None else "")
        sender = run_hooked(VLLM_SENDER, *ready[1:])
        out, err = sender.communicate(timeout=120)
        assert out.split() == ["RC", "0"], err
        receiver.stdin.write("go\n")
        receiver.stdin.flush()
        assert receiver.stdout.readline().split() == ["MISMATCHED", "0", "UNTOUCHED_WRITTEN", "0"]
        assert receiver.wait(timeout=60) == 0
    finally:
        receiver.kill()


def test_the_hook_is_off_unless_asked_for():
    probe = "import importlib.util as u; s = u.find_spec('mooncake'); print('ours' if s and 'te.compat' in repr(s.loader) else 'not-ours')"
    off = run_hooked(probe, env_extra={"TE_COMPAT": ""})
    assert off.communicate(timeout=60)[0].split() == ["not-ours"]
    import te  # noqa: F401 - importing te changes no import
    assert "mooncake.engine" not in sys.modules or "te.compat" not in repr(sys.modules["mooncake.engine"])


def test_the_hook_refuses_to_shadow_a_real_mooncake_silently(tmp_path):
    fake = tmp_path / "mooncake"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    code = "import mooncake.engine"
    p = run_hooked(code, env_extra={"TE_COMPAT_SHADOW": "", "PYTHONPATH": os.pathsep.join(
        [te.compat.boot_dir(), str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0
    assert "the real 'mooncake' is installed" in err and "TE_COMPAT_SHADOW=mooncake" in err


def test_the_hook_chains_an_existing_sitecustomize(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import builtins; builtins.CHAINED = True\n")
    code = "import builtins, mooncake.engine as m; print(getattr(builtins, 'CHAINED', False), m.__name__)"
    p = run_hooked(code, env_extra={"PYTHONPATH": os.pathsep.join(
        [te.compat.boot_dir(), str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    out, err = p.communicate(timeout=60)
    assert out.split() == ["True", "te.compat.mooncake"], err


def test_install_rejects_unknown_peers():
    with pytest.raises(ValueError, match="unknown peer"):
        te.compat.install(["redis"])


def test_addresses_that_are_not_u64_give_a_code_not_a_crash(caplog):
    # (The wheel raises TypeError from its argument conversion; te returns -1 and logs why.)
    a, b = _engines()
    assert a.batch_transfer_sync_write(f"127.0.0.1:{b.get_rpc_port()}", [-1], [0], [8]) == -1
    assert "not a 64-bit unsigned integer" in caplog.text
    assert a.batch_transfer_async_write(f"127.0.0.1:{b.get_rpc_port()}", [1 << 64], [0], [8]) == 0


def test_etcd_metadata_finds_the_peer_by_its_hostname(etcd):
    # Mooncake's non-P2P mode: both sides name one metadata URL; the target is the peer's
    # local_hostname, published as its segment name in te's etcd backend.
    a, b = ours.TransferEngine(), ours.TransferEngine()
    tag = os.urandom(4).hex()
    assert a.initialize(f"127.0.0.1:{tag}-a", f"etcd://{etcd}", "tcp", "") == -1  # a host that resolves nowhere
    assert a.initialize(f"127.0.0.1:17{os.getpid() % 1000:03d}", f"etcd://{etcd}", "tcp", "") == 0
    assert b.initialize(f"127.0.0.1:18{os.getpid() % 1000:03d}", f"etcd://{etcd}", "tcp", "") == 0
    src, dst = pattern(4096, 5), np.zeros(4096, np.uint8)
    assert a.register_memory(src.ctypes.data, 4096) == 0 and b.register_memory(dst.ctypes.data, 4096) == 0
    assert a.transfer_sync_write(f"127.0.0.1:18{os.getpid() % 1000:03d}", src.ctypes.data, dst.ctypes.data,
                                 4096) == 0
    assert np.array_equal(src, dst)


def test_mooncakes_http_metadata_server_lets_two_engines_find_each_other():
    # The metadata server Mooncake's users run (shipped in its wheel): both engines name only its
    # URL; te's http backend speaks its GET / PUT / DELETE protocol.
    wheel_engine()
    server_bin = os.path.join(os.path.dirname(sys.executable), "mooncake_http_metadata_server")
    if not os.path.exists(server_bin):
        pytest.skip(f"{server_bin} is not installed (the Mooncake wheel ships it)")
    from conftest import free_port

    port = free_port()
    server = subprocess.Popen([server_bin, "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/metadata"
        a, b = ours.TransferEngine(), ours.TransferEngine()
        deadline = time.monotonic() + 30
        # The server takes a moment to listen; te's engine publishes at initialize.
        while a.initialize(f"127.0.0.1:19{os.getpid() % 1000:03d}", url, "tcp", "") != 0:
            assert time.monotonic() < deadline, "the metadata server never answered"
            time.sleep(0.1)
        assert b.initialize(f"127.0.0.1:20{os.getpid() % 1000:03d}", url, "tcp", "") == 0
        src, dst = pattern(4096, 9), np.zeros(4096, np.uint8)
        assert a.register_memory(src.ctypes.data, 4096) == 0 and b.register_memory(dst.ctypes.data, 4096) == 0
        assert a.transfer_sync_write(f"127.0.0.1:20{os.getpid() % 1000:03d}", src.ctypes.data, dst.ctypes.data,
                                     4096) == 0
        assert np.array_equal(src, dst)
        assert a.transfer_sync_write("127.0.0.1:1", src.ctypes.data, dst.ctypes.data, 16) < 0, "unknown peer"
    finally:
        server.kill()
        server.wait()


# initialize's protocol argument picks te's transport (mooncake._TRANSPORTS): "efa" runs here on
# libfabric's tcp;ofi_rxm provider (as on any host without an EFA device); "rdma" needs a device.

def _transfer_on(protocol: str, device: str = ""):
    """Two engines initialized with ``protocol``, a byte-verified batch write and a read back
    through te.compat; returns the transports that carried the segment."""
    a, b = ours.TransferEngine(), ours.TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, device) == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, device) == 0
    n = 256 * KiB
    src, dst, back = pattern(n, 21), np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    assert a.batch_register_memory([src.ctypes.data, back.ctypes.data], [n, n]) == 0
    assert b.register_memory(dst.ctypes.data, n) == 0
    peer = f"127.0.0.1:{b.get_rpc_port()}"
    offs = [i * 16 * KiB for i in range(16)]
    assert a.batch_transfer_sync_write(peer, [src.ctypes.data + o for o in offs], [dst.ctypes.data + o for o in offs],
                                       [16 * KiB] * len(offs)) == 0
    assert np.array_equal(src, dst)
    assert a.transfer_sync_read(peer, back.ctypes.data, dst.ctypes.data, n) == 0
    assert np.array_equal(back, src)
    return [r[0] for r in a._engine.routes(a._segment(peer))]


def test_efa_protocol_moves_bytes_on_libfabrics_software_provider(monkeypatch):
    monkeypatch.setenv("TE_FABRIC_PROVIDER", "tcp;ofi_rxm")  # passed through like every TE_ variable
    try:
        te.TransferEngine(f"efa-probe-{os.getpid()}", transports=["efa"], env={"TE_FABRIC_PROVIDER": "tcp;ofi_rxm"})
    except te.NotAvailableError as e:
        from conftest import skip_or_fail

        skip_or_fail("libfabric", str(e))
    assert _transfer_on("efa") == ["efa"]


def test_rdma_protocol_is_rdma_or_a_code_naming_what_is_missing(caplog):
    a = ours.TransferEngine()
    rc = a.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "")
    if rc == 0:  # an RDMA device here (soft-RoCE, a NIC): a real transfer on it
        assert _transfer_on("rdma") == ["rdma"]
        return
    # No device: Mooncake's code and te's typed error in the log, and nothing after it pretends
    # to work.
    assert rc == -1
    assert "initialize('127.0.0.1', 'P2PHANDSHAKE', 'rdma', '') failed" in caplog.text
    assert "rdma" in caplog.text.lower() and "not available" in caplog.text, caplog.text
    buf = np.zeros(4096, np.uint8)
    assert a.register_memory(buf.ctypes.data, 4096) == -1
    assert a.transfer_sync_write("127.0.0.1:1", buf.ctypes.data, buf.ctypes.data, 64) == -1
    assert a.batch_transfer_sync_write("127.0.0.1:1", [buf.ctypes.data], [buf.ctypes.data], [64]) == -1
    assert a.batch_transfer_async_write("127.0.0.1:1", [buf.ctypes.data], [buf.ctypes.data], [64]) == 0
    # a named device that is not here: the code again, the device named in the log
    caplog.clear()
    assert ours.TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_9") == -1
    assert "not available" in caplog.text, caplog.text


def test_address_lists_convert_exactly_like_the_c_api():
    # te._native.u64_lists reads small ints from the objects themselves (CPython 3.11-3.13's
    # layout) and everything else through the C API: both must give array('Q')'s values.
    import array

    from te._native import u64_lists

    class Sub(int):
        pass

    edges = [0, 1, 2, (1 << 30) - 1, 1 << 30, (1 << 30) + 1, (1 << 60) - 1, 1 << 60, (1 << 63) + 5,
             (1 << 64) - 1, True, Sub(7), Sub(1 << 40), 0x7F00DEADBEEF]
    repeated = [1 << 33] * 5 + [1 << 33, 5, 5]           # one object repeated, then equal values
    for values in (edges, repeated, list(range(1000))):
        n = len(values)
        got = memoryview(u64_lists(values, values[::-1], [64] * n)).cast("Q")
        assert got.tolist() == array.array("Q", values + values[::-1] + [64] * n).tolist()
    for bad in (-1, 1 << 64, 1.0, "1", None, np.uint64(3)):
        with pytest.raises(te.InvalidArgument, match=r"list 1\[2\]: not a 64-bit unsigned integer"):
            u64_lists([1, 2, 3], [1, 2, bad])
    with pytest.raises(te.ShapeError):
        u64_lists([1, 2], [1])
    assert u64_lists() == b"" and u64_lists([], []) == b""
