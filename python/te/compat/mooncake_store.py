"""Mooncake's ``mooncake.store.MooncakeDistributedStore`` on the UMBP store, for the KV-cache
connectors written against it (vLLM's MooncakeStoreConnector, SGLang HiCache, LMCache).

``setup(...)`` (positional or dict form) opens a ``te.umbp.Store``: the master address chooses
the mode (``etcd://host:port[/prefix]``: distributed; ``unix:///path`` or ``/path``: a node's
standalone umbp-server; ``local://`` or empty: in this process), ``global_segment_size`` is the
DRAM tier, ``ssd_offload_path`` the SSD tier, ``local_buffer_size`` the registered staging
buffer of the byte calls (``put`` / ``get``), as in Mooncake. Calls return Mooncake's codes (bytes
read, ``0``, or a negative error) and log te's typed error text on ``te.compat.mooncake``.

A plain ``host:port`` master (Mooncake's ``mooncake_master``) has no meaning here: setup refuses
it, saying which addresses work. The table of calls is in docs/python.md.
"""

from __future__ import annotations

import array
import bisect
import ctypes
import functools
import logging
import threading
from typing import Optional

from te import errors, umbp

from .mooncake import UnsupportedError, _columns2, _u64s

log = logging.getLogger("te.compat.mooncake")

# Mooncake Store's error codes (its ErrorCode numbering) that consumers see.
OK = 0
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200
INVALID_KEY = -400
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704

DEFAULT_SEGMENT = 16 << 20  # Mooncake's default global_segment_size and local_buffer_size


def _arg(v):
    # One int for every range, or an array already made, stays as it is; a list becomes an array
    # the store reads in place.
    return v if isinstance(v, (int, array.array, memoryview)) else _u64s(v)


def _seq(v) -> list:
    return v if type(v) is list else list(v)



@functools.lru_cache(maxsize=64)
def _key_index(n: int) -> array.array:
    """0..n-1: one range per key, key i's range at i (cached: read-only for the store)."""
    return array.array("Q", range(n))


def code_of(e: BaseException) -> int:
    """Mooncake's code for one of te's store errors."""
    if isinstance(e, errors.NotFoundError):
        return OBJECT_NOT_FOUND
    if isinstance(e, errors.NoSpaceError):
        return NO_AVAILABLE_HANDLE
    if isinstance(e, errors.BadKeyError):
        return INVALID_KEY
    if isinstance(e, (errors.InvalidArgument, errors.RangeError, errors.BufferTooSmallError,
                      errors.StoreUnregisteredError, errors.TooLargeError)):
        return INVALID_PARAMS
    return INTERNAL_ERROR


def remote_lens(store: umbp.Store, keys: list, probe_addr: int) -> list:
    """Distributed mode: the lengths of objects other peers own (None where none does), from
    their owners without moving a byte: a one-byte range (into registered ``probe_addr``) at an
    offset past any object's end comes back as the key's RangeError carrying the object's
    length."""
    got = store.batch_get_ranges(keys, array.array("Q", range(len(keys))), 1 << 62, 1, probe_addr)
    out = []
    for r in got:
        if isinstance(r, errors.RangeError) and getattr(r, "object_len", None) is not None:
            out.append(r.object_len)
        elif isinstance(r, errors.NotFoundError):
            out.append(None)
        elif isinstance(r, BaseException):
            raise r
        else:  # a byte read at offset 2**62: no object is that large
            raise errors.ProtocolError(f"a length probe read {r} bytes")
    return out


def get_remote(call: str, store: umbp.Store, keys, ptrs, sizes, got: list, probe_addr: int) -> None:
    """Distributed mode: the keys this peer does not hold (``got[i]`` a NotFoundError) read from
    the peers that own them, whole, into their registered buffers; ``got`` updated in place
    (the length read, or the key's error: BufferTooSmallError when the buffer is smaller)."""
    missing = [i for i, r in enumerate(got) if isinstance(r, errors.NotFoundError)]
    if not missing:
        return
    try:
        lens = remote_lens(store, [keys[i] for i in missing], probe_addr)
    except errors.TeError as e:
        log.error("%s: asking the cluster for %d keys: %s", call, len(missing), e)
        return
    want = []
    for i, n in zip(missing, lens):
        if n is None:
            continue
        if n > sizes[i]:
            got[i] = errors.BufferTooSmallError(f"key {keys[i]!r}: object of {n} bytes, buffer of {sizes[i]} bytes")
        else:
            want.append((i, n))
    if not want:
        return
    try:
        read = store.batch_get_ranges([keys[i] for i, _ in want], array.array("Q", range(len(want))), 0,
                                      array.array("Q", [n for _, n in want]), array.array("Q", [ptrs[i] for i, _ in want]))
    except (errors.TeError, OverflowError) as e:
        read = [e] * len(want)
    for (i, _), r in zip(want, read):
        got[i] = r


class ReplicateConfig:
    """Mooncake's replication settings: te keeps one copy, so only ``replica_num=1`` is done."""

    def __init__(self):
        self.replica_num = 1
        self.with_soft_pin = False
        self.preferred_segment = ""


def _options(master: str, global_segment_size: int, ssd_path: str) -> dict:
    """te.umbp.Store options for Mooncake's setup arguments (ValueError when unmappable)."""
    opts: dict = {}
    if master.startswith("etcd://"):
        opts["cluster"] = master
    elif master.startswith("unix://") or master.startswith("/"):
        return {"connect": master.removeprefix("unix://")}
    elif master in ("", "local://"):
        pass
    else:
        raise ValueError(f"master_server_addr {master!r}: te has no Mooncake master; give etcd://host:port[/prefix] "
                         "(distributed UMBP), unix:///path (a node's umbp-server) or local:// (in this process)")
    opts["dram_capacity"] = int(global_segment_size) or DEFAULT_SEGMENT
    opts["ssd_dirs"] = [ssd_path] if ssd_path else []
    return opts


class MooncakeDistributedStore:
    """``mooncake.store.MooncakeDistributedStore`` on UMBP (see the module docstring)."""

    def __init__(self):
        self._store: Optional[umbp.Store] = None
        self._hostname = ""
        # start address -> (length, StoreBuffer); Mooncake unregisters by start address.
        self._bufs: dict[int, tuple[int, umbp.StoreBuffer]] = {}
        self._starts: list[int] = []
        self._staging = None  # a writable buffer (bytearray, or a view of a KV buffer)
        self._staging_reg = None
        self._staging_lock = threading.Lock()
        self._mode = ""  # the store's mode: "local", "standalone" or "distributed"
        self._probe_reg = None  # distributed mode: one registered byte for length probes

    # -- setup ----------------------------------------------------------------------------------

    def setup(self, *args, **kwargs) -> int:
        if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
            cfg = args[0]
            if "local_hostname" not in cfg or "metadata_server" not in cfg:
                log.error("setup(config): local_hostname and metadata_server are required")
                return INVALID_PARAMS
            return self._setup(cfg["local_hostname"], cfg["metadata_server"],
                               cfg.get("global_segment_size", DEFAULT_SEGMENT),
                               cfg.get("local_buffer_size", DEFAULT_SEGMENT), cfg.get("protocol", "tcp"),
                               cfg.get("rdma_devices", ""), cfg.get("master_server_addr", ""),
                               ssd_offload_path=cfg.get("ssd_offload_path", "") if cfg.get("enable_ssd_offload") else "")
        return self._setup(*args, **kwargs)

    def _setup(self, local_hostname: str, metadata_server: str, global_segment_size: int = DEFAULT_SEGMENT,
               local_buffer_size: int = DEFAULT_SEGMENT, protocol: str = "tcp", rdma_devices: str = "",
               master_server_addr: str = "", engine=None, enable_ssd_offload: bool = False,
               ssd_offload_path: str = "", **_ignored) -> int:
        if self._store is not None:
            log.error("setup: this store is already set up")
            return INVALID_PARAMS
        if engine is not None:
            log.error("setup: sharing a Mooncake TransferEngine (engine=) has no meaning on te")
            return INVALID_PARAMS
        try:
            opts = _options(master_server_addr, global_segment_size, ssd_offload_path)
            store = umbp.Store(**opts)
            self._mode = store.mode
            staging, staging_reg, _ = self._scratch(store, int(local_buffer_size)) if local_buffer_size \
                else (None, None, None)
            probe = self._scratch(store, 8)[1] if self._mode == "distributed" else None
        except (errors.TeError, ValueError, TypeError) as e:
            log.error("setup(%r, master_server_addr=%r) failed: %s", local_hostname, master_server_addr, e)
            return INVALID_PARAMS
        self._store, self._hostname = store, local_hostname
        self._staging, self._staging_reg, self._probe_reg = staging, staging_reg, probe
        return OK

    def _scratch(self, store: umbp.Store, n: int):
        """A registered buffer of ``n`` bytes this layer owns: (writable buffer, registration,
        release). In standalone mode the server can map only memory from ``alloc_buffer`` (a
        sealed memfd), so the buffer comes from there; elsewhere it is a bytearray."""
        if self._mode != "standalone":
            buf = bytearray(max(n, 1))
            reg = store.register(buf)
            return buf, reg, reg.close
        kv = store.alloc_buffer(max(n, 1))
        view = memoryview(kv)
        try:
            reg = store.register(view)
        except BaseException:
            view.release()
            store.free_buffer(kv)
            raise

        def release():
            reg.close()
            view.release()
            store.free_buffer(kv)

        return view, reg, release

    def _ready(self) -> umbp.Store:
        if self._store is None:
            raise errors.ClosedError("MooncakeDistributedStore: setup() was not called (or failed, or close() was)")
        return self._store

    def get_hostname(self) -> str:
        return self._hostname

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed (Mooncake's codes)."""
        return 0 if self._store is not None else 1

    def close(self) -> int:
        store, self._store = self._store, None
        if store is None:
            return OK
        for _, reg in self._bufs.values():
            reg.close()
        self._bufs.clear()
        self._starts.clear()
        try:
            store.close()
        except errors.TeError as e:
            log.error("close: %s", e)
            return code_of(e)
        return OK

    # -- buffers --------------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        i = bisect.bisect_right(self._starts, buffer_ptr)
        if (i > 0 and self._starts[i - 1] + self._bufs[self._starts[i - 1]][0] > buffer_ptr) or \
                (i < len(self._starts) and self._starts[i] < buffer_ptr + max(size, 1)):
            log.error("register_buffer(%#x, %d): overlaps a registered buffer", buffer_ptr, size)
            return INVALID_PARAMS
        try:
            # The caller's raw memory as a buffer-protocol object the store can hold on to.
            view = (ctypes.c_ubyte * size).from_address(buffer_ptr)
            reg = self._ready().register(view)
        except (errors.TeError, ValueError, TypeError) as e:
            log.error("register_buffer(%#x, %d): %s", buffer_ptr, size, e)
            return code_of(e)
        self._bufs[buffer_ptr] = (size, reg)
        bisect.insort(self._starts, buffer_ptr)
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        entry = self._bufs.pop(buffer_ptr, None)
        if entry is None:
            log.error("unregister_buffer(%#x): no registered buffer starts there", buffer_ptr)
            return INVALID_PARAMS
        self._starts.remove(buffer_ptr)
        entry[1].close()
        return OK

    # -- existence, size, removal ---------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list) -> list:
        """Per key: 1 stored, 0 absent, -1 error."""
        try:
            lens = self._lens(_seq(keys))
        except errors.TeError as e:
            log.error("batch_is_exist: %s", e)
            return [-1] * len(keys)
        if all(lens):  # all present (a restore's usual answer; no object is empty): no loop per key
            return [1] * len(lens)
        return [0 if n is None else 1 for n in lens]

    def _lens(self, keys: list) -> list:
        """The object length of each key, None where absent. In distributed mode a key this peer
        does not hold is asked of the cluster (the store's own lookup reads this peer's tiers)."""
        lens = self._ready().object_lens(keys)
        if self._mode == "distributed" and None in lens:
            missing = [i for i, n in enumerate(lens) if n is None]
            for i, n in zip(missing, self._remote_lens([keys[i] for i in missing])):
                lens[i] = n
        return lens

    def _remote_lens(self, keys: list) -> list:
        return remote_lens(self._ready(), keys, self._probe_reg.addr)

    def get_size(self, key: str) -> int:
        try:
            n = self._lens([key])[0]
        except errors.TeError as e:
            log.error("get_size(%r): %s", key, e)
            return code_of(e)
        return OBJECT_NOT_FOUND if n is None else n

    def remove(self, key: str, force: bool = False) -> int:
        try:
            return OK if self._ready().remove(key) else OBJECT_NOT_FOUND
        except errors.TeError as e:
            log.error("remove(%r): %s", key, e)
            return code_of(e)

    def batch_remove(self, keys: list, force: bool = False) -> list:
        return [self.remove(k, force) for k in keys]

    # -- puts from registered memory ------------------------------------------------------------

    def _replicas_ok(self, call: str, config: Optional[ReplicateConfig]) -> bool:
        if config is not None and getattr(config, "replica_num", 1) > 1:
            log.error("%s: replica_num=%d asked, but te's store keeps one copy per key", call, config.replica_num)
            return False
        return True

    def _put_ranges(self, call, keys, object_lens, key_index, offsets, lengths, addrs) -> list:
        """The ranges as ints or arrays already (``_arg``)."""
        try:
            got = self._ready().batch_put_ranges(keys, object_lens, key_index, offsets, lengths, addrs)
        except (errors.TeError, TypeError, OverflowError) as e:
            log.error("%s: %s", call, e)
            return [code_of(e)] * len(keys)
        if got.count(None) == len(got):  # all stored: no loop per key
            return [OK] * len(got)
        out = []
        for key, r in zip(keys, got):
            if r is None:
                out.append(OK)
            else:
                log.error("%s(%r): %s", call, key, r)
                out.append(code_of(r))
        return out

    def put_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: list, buffer_ptrs: list, sizes: list,
                       config: Optional[ReplicateConfig] = None) -> list:
        if not self._replicas_ok("batch_put_from", config):
            return [INVALID_PARAMS] * len(keys)
        n = len(keys)
        if n != len(buffer_ptrs) or n != len(sizes):
            log.error("batch_put_from: %d keys, %d buffers, %d sizes", n, len(buffer_ptrs), len(sizes))
            return [INVALID_PARAMS] * n
        if n == 0:
            return []
        try:
            lens, addrs = _columns2(_seq(sizes), _seq(buffer_ptrs))
        except (errors.TeError, TypeError, OverflowError) as e:
            log.error("batch_put_from: %s", e)
            return [code_of(e)] * n
        return self._put_ranges("batch_put_from", _seq(keys), lens, _key_index(n), 0, lens, addrs)

    def batch_put_from_multi_buffers(self, keys: list, all_buffer_ptrs: list, all_sizes: list,
                                     config: Optional[ReplicateConfig] = None) -> list:
        """Each key's object is its buffers one after the other."""
        if not self._replicas_ok("batch_put_from_multi_buffers", config):
            return [INVALID_PARAMS] * len(keys)
        shape = self._multi_shape("batch_put_from_multi_buffers", keys, all_buffer_ptrs, all_sizes)
        if shape is None:
            return [INVALID_PARAMS] * len(keys)
        try:
            key_index, offsets, lengths, addrs, totals = (_arg(v) for v in shape)
        except (errors.TeError, TypeError, OverflowError) as e:
            log.error("batch_put_from_multi_buffers: %s", e)
            return [code_of(e)] * len(keys)
        return self._put_ranges("batch_put_from_multi_buffers", list(keys), totals, key_index, offsets, lengths, addrs)

    @staticmethod
    def _multi_shape(call, keys, all_ptrs, all_sizes):
        if len(keys) != len(all_ptrs) or len(keys) != len(all_sizes) or \
                any(len(p) != len(s) for p, s in zip(all_ptrs, all_sizes)):
            log.error("%s: keys, buffer lists and size lists differ in shape", call)
            return None
        key_index, offsets, lengths, addrs, totals = [], [], [], [], []
        for k, (ptrs, sizes) in enumerate(zip(all_ptrs, all_sizes)):
            at = 0
            for p, s in zip(ptrs, sizes):
                key_index.append(k)
                offsets.append(at)
                lengths.append(s)
                addrs.append(p)
                at += s
            totals.append(at)
        return key_index, offsets, lengths, addrs, totals

    # -- gets into registered memory ------------------------------------------------------------

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: list, buffer_ptrs: list, sizes: list) -> list:
        """Per key: the object's length once it is in the buffer, or a negative code."""
        n = len(keys)
        if n != len(buffer_ptrs) or n != len(sizes):
            log.error("batch_get_into: %d keys, %d buffers, %d sizes", n, len(buffer_ptrs), len(sizes))
            return [INVALID_PARAMS] * n
        if n == 0:
            return []
        try:
            got = self._ready().batch_get_whole(_seq(keys), *_columns2(_seq(buffer_ptrs), _seq(sizes)))
        except (errors.TeError, TypeError, OverflowError) as e:
            log.error("batch_get_into: %s", e)
            return [code_of(e)] * n
        try:
            sum(got)  # every key read (only ints add up; one exception raises TypeError)
            return got
        except TypeError:
            pass
        if self._mode == "distributed":
            self._get_remote("batch_get_into", _seq(keys), _seq(buffer_ptrs), _seq(sizes), got)
        return [self._bytes_or_code("batch_get_into", k, r) for k, r in zip(keys, got)]

    def _get_remote(self, call, keys, ptrs, sizes, got) -> None:
        get_remote(call, self._ready(), keys, ptrs, sizes, got, self._probe_reg.addr)

    @staticmethod
    def _bytes_or_code(call, key, r) -> int:
        if isinstance(r, int):
            return r
        if not isinstance(r, errors.NotFoundError):  # a miss is an answer, not a fault
            log.error("%s(%r): %s", call, key, r)
        return code_of(r)

    def batch_get_into_multi_buffers(self, keys: list, all_buffer_ptrs: list, all_sizes: list,
                                     prefer_alloc_in_same_node: bool = False) -> list:
        """Per key: the object scattered over its buffers in order; its length, or a code."""
        shape = self._multi_shape("batch_get_into_multi_buffers", keys, all_buffer_ptrs, all_sizes)
        if shape is None:
            return [INVALID_PARAMS] * len(keys)
        try:
            lens = self._lens(list(keys))
        except errors.TeError as e:
            log.error("batch_get_into_multi_buffers: %s", e)
            return [code_of(e)] * len(keys)
        key_index, offsets, lengths, addrs, totals = shape
        out: list = [None] * len(keys)
        want_keys, ki, off, ln, ad = [], [], [], [], []
        slot: dict[int, int] = {}
        for i, k in enumerate(key_index):
            obj = lens[k]
            if obj is None:
                out[k] = OBJECT_NOT_FOUND
            elif totals[k] < obj:
                if out[k] is None:
                    log.error("batch_get_into_multi_buffers(%r): object of %d bytes, buffers hold %d",
                              keys[k], obj, totals[k])
                out[k] = INVALID_PARAMS
            elif offsets[i] < obj:  # buffers past the object's end stay untouched
                if k not in slot:
                    slot[k] = len(want_keys)
                    want_keys.append(keys[k])
                ki.append(slot[k])
                off.append(offsets[i])
                ln.append(min(lengths[i], obj - offsets[i]))
                ad.append(addrs[i])
        if want_keys:
            try:
                got = self._ready().batch_get_ranges(want_keys, _u64s(ki), _u64s(off), _u64s(ln), _u64s(ad))
            except errors.TeError as e:
                log.error("batch_get_into_multi_buffers: %s", e)
                got = [e] * len(want_keys)
            for k, j in slot.items():
                out[k] = self._bytes_or_code("batch_get_into_multi_buffers", keys[k], got[j])
        return [OBJECT_NOT_FOUND if o is None else o for o in out]  # a key with no buffers: nothing read

    def get_into_ranges(self, buffer_ptrs: list, all_keys: list, all_dst_offsets: list, all_src_offsets: list,
                        all_sizes: list) -> list:
        """For buffer i, key j, range r: ``all_sizes[i][j][r]`` bytes at object offset
        ``all_src_offsets[i][j][r]`` land at ``buffer_ptrs[i] + all_dst_offsets[i][j][r]``.
        Result per range: its size once delivered, or its key's code."""
        out = []
        for i, base in enumerate(buffer_ptrs):
            keys = all_keys[i]
            ki, off, ln, ad = [], [], [], []
            shape_ok = len(all_dst_offsets[i]) == len(keys) == len(all_src_offsets[i]) == len(all_sizes[i])
            for j in range(len(keys) if shape_ok else 0):
                d, s, n = all_dst_offsets[i][j], all_src_offsets[i][j], all_sizes[i][j]
                if not len(d) == len(s) == len(n):
                    shape_ok = False
                    break
                ki += [j] * len(n)
                off += s
                ln += n
                ad += [base + x for x in d]
            if not shape_ok:
                log.error("get_into_ranges: buffer %d: keys, offsets and sizes differ in shape", i)
                out.append([[INVALID_PARAMS] * len(n) for n in all_sizes[i]])
                continue
            try:
                got = self._ready().batch_get_ranges(list(keys), _u64s(ki), _u64s(off), _u64s(ln), _u64s(ad))
            except (errors.TeError, TypeError, OverflowError) as e:
                got = [e] * len(keys)  # logged per key below
            row = []
            for j, r in enumerate(got):
                code = r if isinstance(r, int) else self._bytes_or_code("get_into_ranges", keys[j], r)
                row.append(list(all_sizes[i][j]) if isinstance(r, int) else [code] * len(all_sizes[i][j]))
            out.append(row)
        return out

    # -- bytes through the staging buffer -------------------------------------------------------

    def put(self, key: str, value, config: Optional[ReplicateConfig] = None) -> int:
        return self.put_batch([key], [value], config)

    def put_batch(self, keys: list, values: list, config: Optional[ReplicateConfig] = None) -> int:
        """0 when every value is stored, else the first failure's code."""
        if len(keys) != len(values):
            log.error("put_batch: %d keys, %d values", len(keys), len(values))
            return INVALID_PARAMS
        for key, value in zip(keys, values):
            data = memoryview(value).cast("B")
            if len(data) == 0:
                log.error("put(%r): an empty value", key)
                return INVALID_PARAMS
            try:
                with self._staged(len(data)) as (buf, addr):
                    buf[:len(data)] = data
                    rc = self.batch_put_from([key], [addr], [len(data)], config)[0]
            except errors.TeError as e:  # not set up, or no staging memory
                log.error("put(%r): %s", key, e)
                return code_of(e)
            if rc != OK:
                return rc
        return OK

    def get(self, key: str) -> bytes:
        """The object's bytes; b"" when absent or on error (Mooncake's convention)."""
        for _ in range(8):  # the object may grow between the size lookup and the read
            n = self.get_size(key)
            if n < 0:
                return b""
            try:
                with self._staged(n) as (buf, addr):
                    got = self.batch_get_into([key], [addr], [n])[0]
                    if got >= 0:
                        return bytes(buf[:got])
            except errors.TeError as e:  # not set up, or no staging memory
                log.error("get(%r): %s", key, e)
                return b""
            if got != INVALID_PARAMS:
                return b""
        return b""

    def get_batch(self, keys: list) -> list:
        return [self.get(k) for k in keys]

    def _staged(self, n: int):
        return _Staging(self, n)

    # -- upserts: UMBP's put replaces, which is Mooncake's upsert --------------------------------

    def upsert(self, key: str, value, config: Optional[ReplicateConfig] = None) -> int:
        return self.put(key, value, config)

    def upsert_batch(self, keys: list, values: list, config: Optional[ReplicateConfig] = None) -> int:
        return self.put_batch(keys, values, config)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        return self.put_from(key, buffer_ptr, size, config)

    def batch_upsert_from(self, keys: list, buffer_ptrs: list, sizes: list,
                          config: Optional[ReplicateConfig] = None) -> list:
        return self.batch_put_from(keys, buffer_ptrs, sizes, config)


class _Staging:
    """The registered staging buffer while one byte call uses it, or a temporary registered
    buffer when the value is larger (or the staging buffer is busy on another thread)."""

    def __init__(self, owner: MooncakeDistributedStore, n: int):
        self.owner, self.n = owner, n
        self.locked = False
        self.temp = None

    def __enter__(self):
        o = self.owner
        if o._staging is not None and self.n <= len(o._staging) and o._staging_lock.acquire(blocking=False):
            self.locked = True
            return o._staging, o._staging_reg.addr
        buf, reg, self.temp = o._scratch(o._ready(), self.n)
        return buf, reg.addr

    def __exit__(self, *exc):
        if self.locked:
            self.owner._staging_lock.release()
        if self.temp is not None:
            self.temp()
        return False


# Calls of the 0.3.13.post1 wheel with no meaning on UMBP: each raises UnsupportedError naming it.
_REFUSED = {
    "tensor calls (te stores bytes; serialize the tensor, or use put_from / get_into on its data_ptr)": [
        "put_tensor", "get_tensor", "batch_put_tensor", "batch_get_tensor", "pub_tensor", "batch_pub_tensor",
        "put_tensor_from", "get_tensor_into", "batch_put_tensor_from", "batch_get_tensor_into",
        "get_tensor_into_cuda", "batch_get_tensor_into_cuda", "put_tensor_with_tp", "get_tensor_with_tp",
        "batch_put_tensor_with_tp", "batch_get_tensor_with_tp", "put_tensor_with_tp_from",
        "get_tensor_with_tp_into", "batch_put_tensor_with_tp_from", "batch_get_tensor_with_tp_into",
        "pub_tensor_with_tp", "batch_pub_tensor_with_tp", "put_tensor_with_parallelism",
        "get_tensor_with_parallelism", "batch_put_tensor_with_parallelism", "batch_get_tensor_with_parallelism",
        "put_tensor_with_parallelism_from", "get_tensor_with_parallelism_into",
        "batch_put_tensor_with_parallelism_from", "batch_get_tensor_with_parallelism_into", "upsert_tensor",
        "batch_upsert_tensor", "upsert_tensor_from", "batch_upsert_tensor_from", "upsert_pub_tensor",
        "batch_upsert_pub_tensor", "upsert_tensor_with_parallelism", "batch_upsert_tensor_with_parallelism",
        "upsert_tensor_with_parallelism_from", "batch_upsert_tensor_with_parallelism_from",
        "load_tensor_from_safetensor", "save_tensor_to_safetensor"],
    "Mooncake's replica, segment and task management (UMBP places data itself)": [
        "get_replica_desc", "batch_get_replica_desc", "batch_replica_clear", "create_copy_task",
        "create_move_task", "query_task", "mount_segment", "unmount_segment", "allocate_and_mount_segment",
        "unmount_and_free_segment", "unmount_local_disk_segment", "get_offload_rpc_read_count"],
    "put and get sessions (use batch_put_from / get_into_ranges: a put is one call)": [
        "batch_put_session_start", "batch_put_session_end", "batch_put_session_revoke", "batch_get_session_start",
        "batch_get_session_end", "batch_put_from_multi_buffer_ranges", "batch_get_into_multi_buffer_ranges"],
    "Mooncake's own buffer handles and memory pool (register your memory with register_buffer)": [
        "get_buffer", "batch_get_buffer", "alloc_from_mem_pool", "put_from_with_metadata", "put_parts",
        "upsert_parts", "setup_dummy", "init_all", "_get_pyclient_capsule"],
    "key enumeration (UMBP has no key listing)": ["remove_all", "remove_by_regex"],
}


def _refused(name: str, why: str):
    def call(self, *args, **kwargs):
        raise UnsupportedError(f"MooncakeDistributedStore.{name}: not available on te: {why}")
    call.__name__ = name
    return call


for _why, _names in _REFUSED.items():
    for _name in _names:
        setattr(MooncakeDistributedStore, _name, _refused(_name, _why))

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "UnsupportedError"]
