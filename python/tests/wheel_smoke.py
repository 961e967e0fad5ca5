"""The installed wheel, alone in a clean venv (scripts/python-wheel.sh): a two-process transfer
over TCP with p2p metadata, byte-verified, an efa transfer on a software provider, and a store
put/get. Not a pytest file: it runs against whatever `te` the interpreter imports, and exits
non-zero on any mismatch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np

import te
from te import umbp

MiB = 1 << 20
ENV = {"TE_METADATA": "p2p", "TE_TRANSPORTS": "tcp", "TE_TCP_LISTEN": "127.0.0.1:0",
       "TE_TCP_ADVERTISE": "127.0.0.1"}

CHILD = """
import sys, numpy as np, te
env = {"TE_METADATA": "p2p", "TE_P2P_LISTEN": "127.0.0.1:" + sys.argv[1], "TE_TRANSPORTS": "tcp",
       "TE_TCP_LISTEN": "127.0.0.1:0", "TE_TCP_ADVERTISE": "127.0.0.1"}
e = te.TransferEngine("wheel-child", env=env)
dst = np.zeros(1 << 20, dtype=np.uint8)
r = e.register(dst)
print("READY", r.addr, flush=True)
note = e.recv_notification(timeout=60)
want = (np.arange(1 << 20, dtype=np.uint64) * 7 % 251).astype(np.uint8)
print("MISMATCHED", int((dst != want).sum()), note.payload.decode() if note else None, flush=True)
"""


def efa_smoke() -> None:
    """The efa transport from the wheel, on libfabric's tcp;ofi_rxm provider, when the host has
    libfabric (opened at run time; TE_REQUIRE=libfabric makes its absence a failure)."""
    env = {"TE_FABRIC_PROVIDER": "tcp;ofi_rxm"}
    try:
        a = te.TransferEngine("wheel-efa-a", transports=["efa"], env=env)
        b = te.TransferEngine("wheel-efa-b", transports=["efa"], env=env)
    except te.NotAvailableError as e:
        if "libfabric" in os.environ.get("TE_REQUIRE", "").split(","):
            raise
        print(f"wheel smoke: efa not available here, not tried: {e}")
        return
    src = (np.arange(MiB, dtype=np.uint64) * 13 % 251).astype(np.uint8)
    dst = np.zeros(MiB, dtype=np.uint8)
    rs, rd = a.register(src), b.register(dst)
    seg = a.open_segment(b.segment_name)
    a.write(seg, rs.addr, rd.addr, MiB)
    assert np.array_equal(src, dst), "efa write"
    a.shutdown()
    b.shutdown()
    print("wheel smoke: efa (tcp;ofi_rxm) transfer ok")


def main() -> int:
    assert te.__version__, "te.__version__"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        ready = child.stdout.readline().split()
        assert ready and ready[0] == "READY", ready
        e = te.TransferEngine("wheel-parent", env={**ENV, "TE_P2P_LISTEN": "127.0.0.1:0"})
        seg = e.open_segment(f"wheel-child@127.0.0.1:{port}")
        src = (np.arange(MiB, dtype=np.uint64) * 7 % 251).astype(np.uint8)
        rs = e.register(src)
        e.write(seg, rs.addr, int(ready[1]), MiB, notify=b"done")
        assert child.stdout.readline().split() == ["MISMATCHED", "0", "done"]
        assert child.wait(timeout=30) == 0
        e.shutdown()
    finally:
        child.kill()
    efa_smoke()
    with umbp.Store(dram_capacity=16 << 20, ssd_dirs=[]) as store:
        page = (np.arange(8192, dtype=np.uint64) % 253).astype(np.uint8)
        back = np.zeros_like(page)
        rp, rb = store.register(page), store.register(back)
        assert store.batch_put_ranges(["page"], page.size, 0, 0, page.size, rp.addr) == [None]
        assert store.batch_get_ranges(["page"], 0, 0, page.size, rb.addr) == [page.size]
        assert np.array_equal(page, back)
    print(f"wheel smoke: te {te.__version__} on Python {sys.version.split()[0]}: transfer and store ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
