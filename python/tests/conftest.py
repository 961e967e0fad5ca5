"""Shared helpers of the te package's tests: TE_REQUIRE (a missing service skips a test, or fails
it when TE_REQUIRE names it, as in the Rust tests), free ports, an etcd started for a test."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import pytest


def required(thing: str) -> bool:
    return thing in [t.strip() for t in os.environ.get("TE_REQUIRE", "").split(",")]


def skip_or_fail(thing: str, why: str) -> None:
    if required(thing):
        pytest.fail(f"TE_REQUIRE names {thing}, but: {why}")
    pytest.skip(f"{thing} not available: {why}")


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now, drawn below the kernel's ephemeral range: a port from bind(0) lies
    inside it, where any outgoing connection may take it before the server binds it. A host whose
    range leaves no room below it gets a port from bind(0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ceiling = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ceiling = 32768
    for _ in range(1000 if ceiling > 10100 else 0):
        port = random.randrange(10000, ceiling)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    # No room below the range (or every draw taken): what bind(0) gives, as before.
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("1,000 draws of bind(0) gave only ports already handed out")


def unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def etcd():
    """An etcd on free loopback ports (TE_ETCD_BIN, default /usr/bin/etcd): its endpoint."""
    binary = os.environ.get("TE_ETCD_BIN", "/usr/bin/etcd")
    if not os.path.exists(binary):
        skip_or_fail("etcd", f"{binary} missing (Debian package etcd-server)")
    client, peer = free_port(), free_port()
    data = tempfile.mkdtemp(prefix="te-py-etcd-")
    url, purl = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    proc = subprocess.Popen(
        [binary, "--data-dir", os.path.join(data, "d"), "--name", "te-py", "--listen-client-urls", url,
         "--advertise-client-urls", url, "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
         "--initial-cluster", f"te-py={purl}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", client), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                if b"true" in s.recv(4096):
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            skip_or_fail("etcd", "etcd did not become healthy within 30 s")
        time.sleep(0.05)
    try:
        yield f"127.0.0.1:{client}"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)
