"""The three engines behind one small interface, each driven through its own public Python API.

A *target* owns one exported buffer and answers its parent over a pipe; an *initiator* registers
its own buffer, reaches the target, and turns a batch (local addresses, remote addresses, lengths)
into the engine's own call. Everything an engine's users would build once (descriptor lists,
address lists, prepared handles) is built in `prepare`, outside the timed region; the timed
region is the per-batch call, waited for (`run`).

Engines:
- ``ours``: the `te` package (this repository's wheel), transport ``tcp`` (or what
  ``--ours-transports`` names), peer-to-peer metadata.
- ``mooncake``: ``mooncake.engine.TransferEngine``, P2PHANDSHAKE metadata, protocol ``tcp``;
  ``batch_transfer_sync_write`` / ``batch_transfer_sync_read``.
- ``nixl``: ``nixl_cu12._api.nixl_agent`` with the UCX backend; ``initialize_xfer`` per batch
  from descriptor lists built beforehand, then ``transfer`` and ``check_xfer_state`` until DONE.
- ``nixl-prep``: the same agent, ``prep_xfer_dlist`` over each side's whole buffer once, then
  ``make_prepped_xfer`` per batch with index lists.
- ``compat``: the Mooncake calls above on ``te.compat.mooncake.TransferEngine`` (our engine
  behind Mooncake's API, issue 41): the connector row, the same code on both.
UCX's transports come from ``UCX_TLS`` in the environment (the driver sets it).
"""

from __future__ import annotations

import importlib
import os
import socket

import numpy as np


def te_env(env: dict) -> dict:
    """``env`` over the process's own TE_* variables (a TransferEngine given ``env`` reads only
    that mapping), so e.g. TE_SHM_COPY_THREADS set around the harness reaches the engines."""
    return {**{k: v for k, v in os.environ.items() if k.startswith("TE_")}, **env}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------- ours


class OursTarget:
    def __init__(self, buf: np.ndarray, transports: str, opts: dict | None = None):
        import te

        opts = opts or {}
        # opts: "port" (the p2p listener), "tcp_port", "name": a restarted target at the same address.
        port = opts.get("port") or free_port()
        env = {"TE_METADATA": "p2p", "TE_P2P_LISTEN": f"127.0.0.1:{port}", "TE_TRANSPORTS": transports,
               "TE_TCP_LISTEN": f"127.0.0.1:{opts.get('tcp_port', 0)}", "TE_TCP_ADVERTISE": "127.0.0.1"}
        name = opts.get("name") or f"peers-target-{os.getpid()}"
        self.engine = te.TransferEngine(name, env=te_env(env))
        self.reg = self.engine.register(buf)
        self.info = {"segment": f"{name}@127.0.0.1:{port}", "addr": self.reg.addr}

    def close(self):
        self.engine.shutdown()


class OursInitiator:
    def __init__(self, buf: np.ndarray, info: dict, transports: str):
        import te

        env = {"TE_METADATA": "p2p", "TE_P2P_LISTEN": "127.0.0.1:0", "TE_TRANSPORTS": transports,
               "TE_TCP_LISTEN": "127.0.0.1:0", "TE_TCP_ADVERTISE": "127.0.0.1"}
        self.engine = te.TransferEngine(f"peers-initiator-{os.getpid()}", env=te_env(env))
        self.reg = self.engine.register(buf)
        self.base = self.reg.addr
        self.info = info
        self.seg = None

    def connect(self):
        self.seg = self.engine.open_segment(self.info["segment"])

    def warm_up(self):
        self.engine.warm_up(self.seg)

    def routes(self):
        """What carries the segment: [(transport, state, connected, pauses)], preferred first."""
        return [list(r) for r in self.engine.routes(self.seg)]

    def prepare(self, op, local, remote, lengths):
        la = np.ascontiguousarray(local, dtype=np.uint64)
        ra = np.ascontiguousarray(remote, dtype=np.uint64)
        ln = np.ascontiguousarray(lengths, dtype=np.uint64)
        call = self.engine.write if op == "write" else self.engine.read
        seg = self.seg

        def run():
            call(seg, la, ra, ln)

        return run

    def close(self):
        self.engine.shutdown()


# ------------------------------------------------------------------------------------ mooncake


class MooncakeTarget:
    def __init__(self, buf: np.ndarray, protocol: str, port: int | None = None, module: str = "mooncake.engine"):
        # The wheel picks its RPC port (the peer's name, "127.0.0.1:<port>") at random in
        # [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT] and its TCP transport's port there too, so one port
        # cannot be pinned (MIN=MAX: "Failed to install TCP transport"); `port` (a restarted target
        # at the same address) sets the range to [port, port + 1]: the caller retries a process
        # that got port + 1 (an engine of the wheel, deleted, keeps its ports).
        if port:  # read when the wheel loads: set before the import
            os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"] = str(port), str(port + 1)
        TransferEngine = importlib.import_module(module).TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise RuntimeError(f"mooncake initialize returned {rc}")
        rc = self.engine.register_memory(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_memory returned {rc}")
        self.info = {"peer": f"127.0.0.1:{self.engine.get_rpc_port()}", "addr": buf.ctypes.data}

    def close(self):
        pass


class MooncakeInitiator:
    def __init__(self, buf: np.ndarray, info: dict, protocol: str, module: str = "mooncake.engine"):
        TransferEngine = importlib.import_module(module).TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise RuntimeError(f"mooncake initialize returned {rc}")
        rc = self.engine.register_memory(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_memory returned {rc}")
        self.base = buf.ctypes.data
        self.peer = info["peer"]

    def connect(self):
        pass  # P2PHANDSHAKE: the first transfer opens the segment

    def warm_up(self):
        rc = self.engine.send_probe(self.peer)
        if rc != 0:
            raise RuntimeError(f"mooncake send_probe returned {rc}")

    def prepare(self, op, local, remote, lengths):
        la = [int(x) for x in local]
        ra = [int(x) for x in remote]
        ln = [int(x) for x in lengths]
        call = self.engine.batch_transfer_sync_write if op == "write" else self.engine.batch_transfer_sync_read
        peer = self.peer

        def run():
            rc = call(peer, la, ra, ln)
            if rc != 0:
                raise RuntimeError(f"mooncake batch_transfer_sync_{op} returned {rc}")

        return run

    def close(self):
        pass


# ---------------------------------------------------------------------------------------- nixl


def nixl_agent(name: str):
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


class NixlTarget:
    def __init__(self, buf: np.ndarray, name: str | None = None):
        name = name or f"peers-target-{os.getpid()}"
        self.agent = nixl_agent(name)
        self.descs = self.agent.register_memory(self.agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
        self.info = {"meta": self.agent.get_agent_metadata(), "addr": buf.ctypes.data, "len": buf.nbytes, "name": name}

    def close(self):
        pass  # the wheel's agent teardown has crashed at exit: the caller leaves with os._exit


class NixlInitiator:
    def __init__(self, buf: np.ndarray, info: dict, prepped: bool):
        self.agent = nixl_agent(f"peers-initiator-{os.getpid()}")
        self.reg_descs = self.agent.register_memory(
            self.agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
        self.base = buf.ctypes.data
        self.nbytes = buf.nbytes
        self.info = info
        self.prepped = prepped
        self.remote = None
        self.cache = {}

    def connect(self):
        self.remote = self.agent.add_remote_agent(self.info["meta"])

    def warm_up(self):
        if hasattr(self.agent, "make_connection"):
            self.agent.make_connection(self.remote)

    def _post(self, handle):
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")

    def _dlists(self, block):
        """Each side's whole buffer cut into `block`-byte descriptors, prepared once per block size."""
        if block not in self.cache:
            a = self.agent
            n_local = self.nbytes // block
            n_remote = self.info["len"] // block
            lo = np.array([(self.base + i * block, block, 0) for i in range(n_local)], dtype=np.uint64)
            ro = np.array([(self.info["addr"] + i * block, block, 0) for i in range(n_remote)], dtype=np.uint64)
            lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", a.get_xfer_descs(lo, "DRAM"))
            rh = a.prep_xfer_dlist(self.remote, a.get_xfer_descs(ro, "DRAM"))
            self.cache[block] = (lh, rh)
        return self.cache[block]

    def prepare(self, op, local, remote, lengths):
        a = self.agent
        op_name = "WRITE" if op == "write" else "READ"
        local = np.asarray(local, dtype=np.uint64)
        remote = np.asarray(remote, dtype=np.uint64)
        lengths = np.asarray(lengths, dtype=np.uint64)
        if self.prepped:
            block = int(lengths[0])
            assert (lengths == block).all(), "nixl-prep: one block size per batch"
            assert ((local - self.base) % block == 0).all() and ((remote - self.info["addr"]) % block == 0).all()
            lh, rh = self._dlists(block)
            li = [int(x) for x in (local - self.base) // block]
            ri = [int(x) for x in (remote - self.info["addr"]) // block]

            def run():
                h = a.make_prepped_xfer(op_name, lh, li, rh, ri)
                self._post(h)
                a.release_xfer_handle(h)

            return run
        zeros = np.zeros_like(lengths)
        ld = a.get_xfer_descs(np.stack([local, lengths, zeros], axis=1), "DRAM")
        rd = a.get_xfer_descs(np.stack([remote, lengths, zeros], axis=1), "DRAM")
        remote_name = self.remote

        def run():
            h = a.initialize_xfer(op_name, ld, rd, remote_name)
            self._post(h)
            a.release_xfer_handle(h)

        return run

    def close(self):
        pass


COMPAT = "te.compat.mooncake"


def make_target(engine: str, buf: np.ndarray, opts: dict):
    if engine == "ours":
        return OursTarget(buf, opts.get("ours_transports", "tcp"), opts)
    if engine == "mooncake":
        return MooncakeTarget(buf, opts.get("mooncake_protocol", "tcp"), opts.get("port"))
    if engine == "compat":
        return MooncakeTarget(buf, opts.get("mooncake_protocol", "tcp"), module=COMPAT)
    if engine in ("nixl", "nixl-prep"):
        return NixlTarget(buf, opts.get("name"))
    raise ValueError(engine)


def make_initiator(engine: str, buf: np.ndarray, info: dict, opts: dict):
    if engine == "ours":
        return OursInitiator(buf, info, opts.get("ours_transports", "tcp"))
    if engine == "mooncake":
        return MooncakeInitiator(buf, info, opts.get("mooncake_protocol", "tcp"))
    if engine == "compat":
        return MooncakeInitiator(buf, info, opts.get("mooncake_protocol", "tcp"), module=COMPAT)
    if engine == "nixl":
        return NixlInitiator(buf, info, prepped=False)
    if engine == "nixl-prep":
        return NixlInitiator(buf, info, prepped=True)
    raise ValueError(engine)
