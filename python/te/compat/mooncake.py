"""Mooncake's ``mooncake.engine.TransferEngine`` on te's engine, for code written against it.

Mooncake's Python engine speaks integer return codes (``0`` done, negative failed) and names
peers ``"host:rpc_port"``; remote addresses are raw virtual addresses inside the peer's
registered memory. Here:

- ``initialize(hostname, "P2PHANDSHAKE", protocol, device)`` builds a te engine with p2p
  metadata listening on the rpc port (the port of ``hostname`` when it names one, else a free
  one), so ``"host:rpc_port"`` is the address of the peer's p2p metadata listener and
  ``open_segment`` takes it as it is. ``etcd://host:port`` (or ``host:port``) metadata maps onto
  te's etcd backend and ``http://host:port/metadata`` (Mooncake's HTTP metadata server) onto
  te's http backend, with the hostname as the segment name.
- remote addresses stay raw: te's segments describe the peer's buffers by virtual address;
- every failure returns the code Mooncake returns and logs te's typed error text on the
  ``te.compat.mooncake`` logger, the way Mooncake's own log line explains its code.

Calls with no meaning here raise :class:`UnsupportedError` naming them; nothing returns success
for work that was not done. The table of calls is in docs/python.md ("Switching from Mooncake /
mori").
"""

from __future__ import annotations

import array
import bisect
import ctypes
import enum
import ipaddress
import logging
import os
import socket
from typing import Optional

import te
from te import errors
from te._native import u64_bytes, u64_lists

log = logging.getLogger("te.compat.mooncake")

# Mooncake's codes (its transfer_engine error numbering); the Python layer returns -1 for every
# failed transfer, as the wheel does.
OK = 0
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7

# Mooncake protocol -> te transport.
_TRANSPORTS = {"tcp": "tcp", "rdma": "rdma", "efa": "efa"}
# Mooncake protocol -> the te variable its device list goes to (tcp takes none).
_DEVICE_VARS = {"rdma": "TE_RDMA_DEVICES", "efa": "TE_EFA_DEVICES"}


class UnsupportedError(NotImplementedError):
    """A Mooncake call that has no meaning on te's engine (named in the message)."""


class TransferOpcode(enum.IntEnum):
    """Mooncake's opcode (``TransferOpcode.Read`` / ``.Write``)."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write
_WRITE = int(TransferOpcode.Write)  # a plain int: compared on every transfer


class TransferNotify:
    """A notification sent after a transfer (``name``, ``msg``), as Mooncake's."""

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg

    def _payload(self) -> bytes:
        # name and message in one te notification payload, split again by get_notifies.
        return self.name.encode() + b"\0" + self.msg.encode()

    @classmethod
    def _from_payload(cls, payload: bytes) -> "TransferNotify":
        name, _, msg = payload.partition(b"\0")
        return cls(name.decode(errors="replace"), msg.decode(errors="replace"))

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


def _free_port(host: str) -> int:
    # The kernel's pick, released for te's p2p listener to bind. Mooncake instead draws at random
    # from MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (15000..17000) and keeps its socket; those variables
    # are not read here.
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _split_host_port(name: str) -> tuple[str, Optional[int]]:
    host, sep, port = name.rpartition(":")
    if sep and port.isdigit() and "]" not in port:
        return host.strip("[]"), int(port)
    return name.strip("[]"), None


def _seq(v) -> list:
    return v if type(v) is list else list(v)


def _u64s(values):
    """One 8-byte array the engine reads in place, from a connector's list (converted in Rust,
    one pass) or any other sequence of ints."""
    if isinstance(values, list):
        if len(values) == 1 and type(values[0]) is int:
            return values[0]  # one request: the native call takes one int as it is
        return memoryview(u64_bytes(values)).cast("Q")
    return values if isinstance(values, array.array) else array.array("Q", values)


def _columns3(a: list, b: list, c: list):
    """Arrays the engine reads in place for three lists of one length (a connector's local
    addresses, remote addresses and lengths): one Rust pass per list into one allocation
    (``te._native.u64_lists``). A one-request batch passes its ints as they are (the native
    calls take one int per argument)."""
    n = len(a)
    if n == 1:
        x, y, z = a[0], b[0], c[0]
        if type(x) is int and type(y) is int and type(z) is int:
            return x, y, z
    mv = memoryview(u64_lists(a, b, c)).cast("Q")
    return mv[:n], mv[n:2 * n], mv[2 * n:]


def _columns2(a: list, b: list):
    """``_columns3`` for two lists."""
    n = len(a)
    if n == 1:
        x, y = a[0], b[0]
        if type(x) is int and type(y) is int:
            return x, y
    mv = memoryview(u64_lists(a, b)).cast("Q")
    return mv[:n], mv[n:]


class TransferEngine:
    """``mooncake.engine.TransferEngine`` on te (see the module docstring)."""

    def __init__(self):
        self._engine: Optional[te.TransferEngine] = None
        self._rpc_port = 0
        self._segments: dict[str, te.Segment] = {}
        # start address -> (length, te.Registration); Mooncake unregisters by start address.
        self._regs: dict[int, tuple[int, te.Registration]] = {}
        self._starts: list[int] = []  # sorted keys of _regs, for the overlap check
        self._managed: dict[int, object] = {}
        self._batches: dict[int, te.Batch] = {}
        self._next_batch = 1

    # -- initialisation -------------------------------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        return self._initialize(local_hostname, metadata_server, protocol, device_name, None)

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                       metadata_type: str) -> int:
        return self._initialize(local_hostname, metadata_server, protocol, device_name, metadata_type)

    def _initialize(self, hostname, metadata_server, protocol, device_name, metadata_type) -> int:
        if self._engine is not None:
            log.error("initialize: this TransferEngine is already initialized")
            return ERR_INVALID_ARGUMENT
        try:
            name, env = self._config(hostname, metadata_server, protocol, device_name, metadata_type)
            engine = te.TransferEngine(name, env=env)
            # te builds an engine whose transport cannot run (it says why in transports());
            # Mooncake's initialize fails then, and so does this one: no engine that moves nothing.
            why = dict(engine.transports()).get(env["TE_TRANSPORTS"], "not compiled into this build")
            if why is not None:
                engine.shutdown()
                raise errors.NotAvailableError(f"{protocol} not available: {why}")
            self._engine = engine
        except (errors.TeError, ValueError, OSError) as e:
            log.error("initialize(%r, %r, %r, %r) failed: %s", hostname, metadata_server, protocol, device_name, e)
            return ERR_INVALID_ARGUMENT
        return OK

    def _config(self, hostname, metadata_server, protocol, device_name, metadata_type):
        """te's segment name and environment for Mooncake's initialize arguments (raises ValueError)."""
        transport = _TRANSPORTS.get(protocol)
        if transport is None:
            raise ValueError(f"protocol {protocol!r} is not one of {sorted(_TRANSPORTS)}")
        host, port = _split_host_port(hostname)
        try:
            ip = str(ipaddress.ip_address(host))
        except ValueError:
            ip = socket.gethostbyname(host)  # OSError (socket.gaierror) when the name is unknown
        # Variables the caller set pass through (TE_TCP_*, TE_AUTH_KEY_FILE...); initialize's
        # own arguments decide metadata and transport.
        env = {k: v for k, v in os.environ.items() if k.startswith("TE_")}
        env["TE_TRANSPORTS"] = transport
        if transport == "tcp":
            env.setdefault("TE_TCP_LISTEN", "0.0.0.0:0")
            env.setdefault("TE_TCP_ADVERTISE", ip)
        if device_name and protocol in _DEVICE_VARS:
            env[_DEVICE_VARS[protocol]] = device_name
        kind = (metadata_type or "").lower()
        if metadata_server == "P2PHANDSHAKE" or kind == "p2p":
            self._rpc_port = port if port is not None else _free_port(ip)
            env["TE_METADATA"] = "p2p"
            env["TE_P2P_LISTEN"] = f"0.0.0.0:{self._rpc_port}"
            return f"{host}:{self._rpc_port}", env
        if metadata_server.startswith(("http://", "https://")) or kind == "http":
            # Mooncake's HTTP metadata server (its /metadata?key= protocol): te's http backend.
            env["TE_METADATA"] = "http"
            env["TE_METADATA_URL"] = metadata_server
            self._rpc_port = port or 0
            return hostname, env
        endpoint = metadata_server.removeprefix("etcd://")
        if kind not in ("", "etcd") or "://" in endpoint or _split_host_port(endpoint)[1] is None:
            raise ValueError(f"metadata server {metadata_server!r} is neither P2PHANDSHAKE nor etcd://host:port")
        env["TE_METADATA"] = "etcd"
        env["TE_ETCD_ENDPOINTS"] = endpoint
        self._rpc_port = port or 0
        return hostname, env

    def _ready(self, call: str) -> te.TransferEngine:
        if self._engine is None:
            raise _NotInitialized(call)
        return self._engine

    def get_rpc_port(self) -> int:
        return self._rpc_port

    # -- memory ---------------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        if self._overlaps(buffer_addr, capacity):
            log.error("register_memory(%#x, %d): overlaps a registered region", buffer_addr, capacity)
            return ERR_ADDRESS_OVERLAPPED
        try:
            engine = self._ready("register_memory")
            device = None if location in ("*", "") or location.startswith("cpu") else location
            reg = engine.register_ptr(buffer_addr, capacity, device)
        except _NotInitialized as e:
            return e.code()
        except errors.AlreadyRegisteredError as e:
            log.error("register_memory(%#x, %d): %s", buffer_addr, capacity, e)
            return ERR_ADDRESS_OVERLAPPED
        except (errors.TeError, OverflowError, TypeError) as e:
            log.error("register_memory(%#x, %d): %s", buffer_addr, capacity, e)
            return ERR_INVALID_ARGUMENT
        self._regs[buffer_addr] = (capacity, reg)
        bisect.insort(self._starts, buffer_addr)
        return OK

    def _overlaps(self, addr: int, length: int) -> bool:
        # Mooncake refuses overlapping regions; te accepts a region registered twice, so check here.
        i = bisect.bisect_right(self._starts, addr)
        if i > 0:
            before = self._starts[i - 1]
            if before + self._regs[before][0] > addr:
                return True
        return i < len(self._starts) and self._starts[i] < addr + max(length, 1)

    def unregister_memory(self, buffer_addr: int) -> int:
        entry = self._regs.pop(buffer_addr, None)
        if entry is None:
            log.error("unregister_memory(%#x): no registration starts at this address", buffer_addr)
            return ERR_ADDRESS_NOT_REGISTERED
        self._starts.remove(buffer_addr)
        try:
            entry[1].close()
        except errors.TeError as e:
            log.error("unregister_memory(%#x): %s", buffer_addr, e)
            return ERR_INVALID_ARGUMENT
        return OK

    def batch_register_memory(self, buffer_addresses: list, capacities: list, location: str = "*") -> int:
        if len(buffer_addresses) != len(capacities):
            log.error("batch_register_memory: %d addresses but %d capacities",
                      len(buffer_addresses), len(capacities))
            return ERR_INVALID_ARGUMENT
        # One native call (one descriptor update); all or nothing, like the native call.
        spans = sorted(zip(buffer_addresses, capacities))
        for i, (addr, cap) in enumerate(spans):
            if self._overlaps(addr, cap) or (i and spans[i - 1][0] + spans[i - 1][1] > addr):
                log.error("batch_register_memory(%#x, %d): overlaps a registered region", addr, cap)
                return ERR_ADDRESS_OVERLAPPED
        try:
            engine = self._ready("batch_register_memory")
            device = None if location in ("*", "") or location.startswith("cpu") else location
            regs = engine.register_ptrs(_u64s(_seq(buffer_addresses)), _u64s(_seq(capacities)), device)
        except _NotInitialized as e:
            return e.code()
        except errors.AlreadyRegisteredError as e:
            log.error("batch_register_memory: %s", e)
            return ERR_ADDRESS_OVERLAPPED
        except (errors.TeError, OverflowError, TypeError) as e:
            log.error("batch_register_memory: %s", e)
            return ERR_INVALID_ARGUMENT
        for addr, cap, reg in zip(buffer_addresses, capacities, regs):
            self._regs[addr] = (cap, reg)
            bisect.insort(self._starts, addr)
        return OK

    def batch_unregister_memory(self, buffer_addresses: list) -> int:
        rc = OK
        for addr in buffer_addresses:
            rc = self.unregister_memory(addr) or rc
        return rc

    def allocate_managed_buffer(self, length: int) -> int:
        """Host memory allocated and registered here (Mooncake's pooled buffer); 0 on failure."""
        try:
            buf = (ctypes.c_ubyte * length)()
        except (ValueError, OverflowError, TypeError, MemoryError) as e:
            log.error("allocate_managed_buffer(%r): %s", length, e)
            return 0
        addr = ctypes.addressof(buf)
        if self.register_memory(addr, length) != OK:
            return 0
        self._managed[addr] = buf
        return addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        if buffer_addr not in self._managed:
            log.error("free_managed_buffer(%#x): not allocated by allocate_managed_buffer", buffer_addr)
            return ERR_INVALID_ARGUMENT
        rc = self.unregister_memory(buffer_addr)
        if rc == OK:
            del self._managed[buffer_addr]
        return rc

    def _inside_registered(self, addr: int, length: int) -> bool:
        i = bisect.bisect_right(self._starts, addr)
        if i == 0:
            return False
        start = self._starts[i - 1]
        return addr + length <= start + self._regs[start][0]

    def write_bytes_to_buffer(self, dest_address: int, src: bytes, length: int) -> int:
        # Raw pointer writes only inside registered memory (the wheel writes anywhere).
        if length > len(src) or length < 0 or not self._inside_registered(dest_address, length):
            log.error("write_bytes_to_buffer(%#x, %d): not inside registered memory or longer than the data",
                      dest_address, length)
            return ERR_INVALID_ARGUMENT
        ctypes.memmove(dest_address, src, length)
        return OK

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        if length < 0 or not self._inside_registered(source_address, length):
            raise ValueError(f"read_bytes_from_buffer({source_address:#x}, {length}): not inside registered memory")
        return ctypes.string_at(source_address, length)

    # -- peers ----------------------------------------------------------------------------------

    def _segment(self, target: str) -> te.Segment:
        seg = self._segments.get(target)
        if seg is None:
            seg = self._ready("open_segment").open_segment(target)
            self._segments[target] = seg
        return seg

    def get_first_buffer_address(self, segment_name: str) -> int:
        try:
            buffers = self._segment(segment_name).buffers
        except (errors.TeError, _NotInitialized) as e:
            log.error("get_first_buffer_address(%r): %s", segment_name, e)
            return 0
        return min(b[0] for b in buffers) if buffers else 0

    def send_probe(self, peer_server_name: str) -> int:
        """0 when the peer's metadata answers (its segment opens)."""
        try:
            self._segment(peer_server_name)
        except (errors.TeError, _NotInitialized) as e:
            log.error("send_probe(%r): %s", peer_server_name, e)
            return ERR_INVALID_ARGUMENT
        return OK

    def warmup_efa_segment(self, segment_name: str) -> int:
        try:
            self._ready("warmup_efa_segment").warm_up(self._segment(segment_name))
        except (errors.TeError, _NotInitialized) as e:
            log.error("warmup_efa_segment(%r): %s", segment_name, e)
            return ERR_INVALID_ARGUMENT
        return OK

    # -- transfers ------------------------------------------------------------------------------

    def _submit(self, call, target, opcode, buffers, peer_addrs, lengths, notify=None) -> te.Batch:
        """Submits one batch; raises _Failed (logged) on bad input or an unreachable peer."""
        try:
            engine = self._engine
            if engine is None:
                raise _NotInitialized(call)
            seg = self._segments.get(target) or self._segment(target)
            submit = engine.submit_write if opcode == _WRITE else engine.submit_read
            if type(buffers) is list:  # a batch call: one array per argument
                buffers, peer_addrs, lengths = _columns3(buffers, peer_addrs, lengths)
            if notify is not None:
                return submit(seg, buffers, peer_addrs, lengths, notify=notify._payload())
            return submit(seg, buffers, peer_addrs, lengths)
        except (errors.TeError, _NotInitialized, OverflowError, TypeError) as e:
            log.error("%s to %r failed: %s", call, target, e)
            raise _Failed from e

    def _sync(self, call, target, opcode, buffers, peer_addrs, lengths, notify=None) -> int:
        # The connector's hot path: one native call that submits and waits (no Batch object).
        try:
            engine = self._engine
            if engine is None:
                raise _NotInitialized(call)
            seg = self._segments.get(target) or self._segment(target)
            if type(buffers) is list:  # a batch call: one array per argument
                buffers, peer_addrs, lengths = _columns3(buffers, peer_addrs, lengths)
            run = engine.write if opcode == _WRITE else engine.read
            if notify is None:
                run(seg, buffers, peer_addrs, lengths)
            else:
                run(seg, buffers, peer_addrs, lengths, notify=notify._payload())
        except _NotInitialized as e:
            return e.code()
        except (errors.TeError, OverflowError, TypeError) as e:
            log.error("%s to %r failed: %s", call, target, e)
            return ERR_INVALID_ARGUMENT
        return OK

    def _sync_batch(self, call, target, opcode, buffers, peer_addrs, lengths, notify=None) -> int:
        n = len(buffers)
        if n != len(peer_addrs) or n != len(lengths):
            log.error("%s: buffers, peer_buffer_addresses and lengths differ in length (%d, %d, %d)",
                      call, n, len(peer_addrs), len(lengths))
            return ERR_INVALID_ARGUMENT
        if n == 0:
            return OK
        if type(buffers) is not list or type(peer_addrs) is not list or type(lengths) is not list:
            buffers, peer_addrs, lengths = list(buffers), list(peer_addrs), list(lengths)
        return self._sync(call, target, opcode, buffers, peer_addrs, lengths, notify)

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        return self._sync("transfer_sync_write", target_hostname, TransferOpcode.Write, buffer,
                          peer_buffer_address, length)

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        return self._sync("transfer_sync_read", target_hostname, TransferOpcode.Read, buffer,
                          peer_buffer_address, length)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                      opcode: TransferOpcode, notify: Optional[TransferNotify] = None, transport_hint: str = "") -> int:
        return self._sync("transfer_sync", target_hostname, TransferOpcode(opcode), buffer, peer_buffer_address,
                          length, notify)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: list, peer_buffer_addresses: list,
                                  lengths: list, transport_hint: str = "") -> int:
        return self._sync_batch("batch_transfer_sync_write", target_hostname, TransferOpcode.Write, buffers,
                                peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: list, peer_buffer_addresses: list,
                                 lengths: list, transport_hint: str = "") -> int:
        return self._sync_batch("batch_transfer_sync_read", target_hostname, TransferOpcode.Read, buffers,
                                peer_buffer_addresses, lengths)

    def batch_transfer_sync(self, target_hostname: str, buffers: list, peer_buffer_addresses: list, lengths: list,
                            opcode: TransferOpcode, notify: Optional[TransferNotify] = None,
                            transport_hint: str = "") -> int:
        return self._sync_batch("batch_transfer_sync", target_hostname, TransferOpcode(opcode), buffers,
                                peer_buffer_addresses, lengths, notify)

    def _keep(self, batch: te.Batch) -> int:
        batch_id = self._next_batch
        self._next_batch += 1
        self._batches[batch_id] = batch
        return batch_id

    def _async_batch(self, call, target, opcode, buffers, peer_addrs, lengths) -> int:
        # Mooncake's async batch calls return a batch id, 0 on failure.
        n = len(buffers)
        if n == 0 or n != len(peer_addrs) or n != len(lengths):
            log.error("%s: buffers, peer_buffer_addresses and lengths must be non-empty and of one length "
                      "(%d, %d, %d)", call, n, len(peer_addrs), len(lengths))
            return 0
        if type(buffers) is not list or type(peer_addrs) is not list or type(lengths) is not list:
            buffers, peer_addrs, lengths = list(buffers), list(peer_addrs), list(lengths)
        try:
            batch = self._submit(call, target, opcode, buffers, peer_addrs, lengths)
        except _Failed:
            return 0
        batch_id = self._next_batch
        self._next_batch = batch_id + 1
        self._batches[batch_id] = batch
        return batch_id

    def batch_transfer_async_write(self, target_hostname: str, buffers: list, peer_buffer_addresses: list,
                                   lengths: list, transport_hint: str = "") -> int:
        return self._async_batch("batch_transfer_async_write", target_hostname, TransferOpcode.Write, buffers,
                                 peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname: str, buffers: list, peer_buffer_addresses: list,
                                  lengths: list, transport_hint: str = "") -> int:
        return self._async_batch("batch_transfer_async_read", target_hostname, TransferOpcode.Read, buffers,
                                 peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname: str, buffers: list, peer_buffer_addresses: list, lengths: list,
                             opcode: TransferOpcode, transport_hint: str = "") -> int:
        return self._async_batch("batch_transfer_async", target_hostname, TransferOpcode(opcode), buffers,
                                 peer_buffer_addresses, lengths)

    def get_batch_transfer_status(self, batch_ids: list) -> int:
        """Waits for every batch; 0 when all delivered, -1 when any failed or is unknown."""
        rc = OK
        pop = self._batches.pop
        for batch_id in batch_ids:
            batch = pop(batch_id, None)
            if batch is None:
                log.error("get_batch_transfer_status: unknown batch id %r (never returned, or already waited for)",
                          batch_id)
                rc = ERR_INVALID_ARGUMENT
                continue
            try:
                batch.wait()
            except errors.TeError as e:
                log.error("get_batch_transfer_status: batch %d failed: %s", batch_id, e)
                rc = ERR_INVALID_ARGUMENT
        return rc

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        """A batch id, or -1 when the write could not be submitted."""
        try:
            batch = self._submit("transfer_submit_write", target_hostname, TransferOpcode.Write, buffer,
                                 peer_buffer_address, length)
        except _Failed:
            return ERR_INVALID_ARGUMENT
        return self._keep(batch)

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done, 0 in progress, -1 failed (or unknown id), -2 timed out; a finished id is let go."""
        batch = self._batches.get(batch_id)
        if batch is None:
            log.error("transfer_check_status: unknown batch id %r (never returned, or already finished)", batch_id)
            return ERR_INVALID_ARGUMENT
        if not batch.done():
            return 0
        del self._batches[batch_id]
        try:
            batch.wait()
        except errors.BatchFailedError as e:
            log.error("transfer_check_status: batch %d failed: %s", batch_id, e)
            return -2 if e.timed_out else -1
        except errors.TeError as e:
            log.error("transfer_check_status: batch %d failed: %s", batch_id, e)
            return -1
        return 1

    # -- notifications --------------------------------------------------------------------------

    def get_notifies(self) -> list:
        """Notifications received since the last call (``TransferNotify`` objects)."""
        if self._engine is None:
            return []
        queue = self._engine.notifications()
        out = []
        while (note := queue.try_recv()) is not None:
            out.append(TransferNotify._from_payload(note.payload))
        return out

    # -- no meaning here ------------------------------------------------------------------------

    def get_engine(self):
        raise UnsupportedError("get_engine: Mooncake's C++ engine object does not exist on te "
                               "(a Mooncake Store cannot share this engine)")

    def get_engine_ptr(self):
        raise UnsupportedError("get_engine_ptr: there is no Mooncake C++ engine pointer on te")

    def get_local_topology(self, device_name: Optional[str] = None):
        raise UnsupportedError("get_local_topology: te chooses NICs itself (TE_RDMA_DEVICES, TE_EFA_DEVICES); "
                               "its topology is not Mooncake's JSON")


class _Failed(Exception):
    """A submission that failed and was already logged."""


class _NotInitialized(Exception):
    def __init__(self, call: str):
        super().__init__(call)
        self.call = call

    def code(self) -> int:
        log.error("%s: TransferEngine.initialize() was not called (or failed)", self.call)
        return ERR_INVALID_ARGUMENT

    def __str__(self) -> str:
        return "TransferEngine.initialize() was not called (or failed)"


__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "UnsupportedError", "Read", "Write"]
