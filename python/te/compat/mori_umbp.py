"""mori's ``mori.umbp`` (``UMBPClient``, ``UMBPConfig``) on te's UMBP store, for code written
against mori's Python binding (SGLang HiCache's UMBP backend).

mori's client answers with booleans (``put_from_ptr`` / ``get_into_ptr`` / ``exists``, lists of
them for the batch calls) and, in its standalone mode, needs no registration: memory passed to a
call that is not inside a ``register_memory``-ed region is registered for that call here, so
the same program works, only slower than with registration. Failures log te's typed error text
on the ``te.compat.mori`` logger. The config's DRAM and SSD sections become the store's tiers;
``standalone_process.address`` connects to a node's umbp-server, ``distributed`` (with an
``etcd://`` master address) joins the UMBP cluster.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
from typing import Optional

from te import errors, umbp

from .mooncake import UnsupportedError, _u64s
from .mooncake_store import get_remote, remote_lens

log = logging.getLogger("te.compat.mori")


class _Section:
    """A config section: attributes settable like mori's pybind structs."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class UMBPDramConfig(_Section):
    def __init__(self):
        super().__init__(capacity_bytes=4 << 30, high_watermark=None, low_watermark=None)


class UMBPSsdConfig(_Section):
    def __init__(self):
        super().__init__(enabled=False, storage_dir="", capacity_bytes=None)


class UMBPEvictionConfig(_Section):
    def __init__(self):
        super().__init__(policy="lru", auto_promote_on_read=None)


class UMBPMasterClientConfig(_Section):
    def __init__(self):
        super().__init__(master_address="", node_id="", node_address="")


class UMBPDistributedConfig(_Section):
    def __init__(self):
        super().__init__(master_config=UMBPMasterClientConfig(), peer_service_port=0)


class UMBPStandaloneProcessConfig(_Section):
    def __init__(self):
        super().__init__(address="")


class UMBPConfig(_Section):
    """mori's client configuration; the sections te maps are listed in the module docstring."""

    def __init__(self):
        super().__init__(dram=UMBPDramConfig(), ssd=UMBPSsdConfig(), eviction=UMBPEvictionConfig(),
                         distributed=None, standalone_process=None)

    @staticmethod
    def from_environment() -> "UMBPConfig":
        # te's store reads its UMBP_* variables itself for every option not set here.
        return UMBPConfig()


def _options(cfg: UMBPConfig) -> dict:
    """te.umbp.Store options for a mori config (ValueError when unmappable)."""
    sp = cfg.standalone_process
    if sp is not None and sp.address:
        return {"connect": sp.address.removeprefix("unix://")}
    opts: dict = {"dram_capacity": int(cfg.dram.capacity_bytes)}
    for ours, theirs in (("high_watermark", cfg.dram.high_watermark), ("low_watermark", cfg.dram.low_watermark)):
        if theirs is not None:
            opts[ours] = theirs
    opts["ssd_dirs"] = [cfg.ssd.storage_dir] if cfg.ssd.enabled and cfg.ssd.storage_dir else []
    if cfg.ssd.enabled and cfg.ssd.capacity_bytes:
        opts["ssd_capacity"] = int(cfg.ssd.capacity_bytes)
    if cfg.eviction.auto_promote_on_read is not None:
        opts["promote_on_read"] = bool(cfg.eviction.auto_promote_on_read)
    if cfg.distributed is not None:
        master = cfg.distributed.master_config.master_address
        if not master.startswith("etcd://"):
            raise ValueError(f"distributed.master_config.master_address {master!r}: te's UMBP cluster lives in etcd; "
                             "give etcd://host:port[/prefix]")
        opts["cluster"] = master
    return opts


class UMBPClient:
    """mori's ``UMBPClient`` on te's store (see the module docstring)."""

    def __init__(self, config: Optional[UMBPConfig] = None):
        cfg = config if config is not None else UMBPConfig()
        # A config te cannot map raises here, as mori's constructor throws on a bad config.
        self._store = umbp.Store(**_options(cfg))
        self._distributed = cfg.distributed is not None
        # Distributed mode: the store's own lookups read this peer's tiers; keys other peers own
        # are asked of them (mooncake_store.remote_lens), with one registered byte for the probe.
        self._probe = self._store.register(bytearray(8)) if self._store.mode == "distributed" else None
        self._regs: dict[int, tuple[int, umbp.StoreBuffer]] = {}
        self._starts: list[int] = []
        self._keys: set[str] = set()  # what this client stored, for clear()

    # -- memory ---------------------------------------------------------------------------------

    def register_memory(self, ptr: int, size: int, loc=None, device: int = -1) -> bool:
        if loc is not None and "CPU" not in str(loc).upper():
            log.error("register_memory(%#x, %d): te's store registers host memory only (loc=%s)", ptr, size, loc)
            return False
        if self._inside(ptr, size):
            return True  # already covered: registered or not needed, as mori reads its True
        try:
            reg = self._store.register((ctypes.c_ubyte * size).from_address(ptr))
        except (errors.TeError, ValueError, TypeError) as e:
            log.error("register_memory(%#x, %d): %s", ptr, size, e)
            return False
        self._regs[ptr] = (size, reg)
        bisect.insort(self._starts, ptr)
        return True

    def deregister_memory(self, ptr: int) -> None:
        entry = self._regs.pop(ptr, None)
        if entry is not None:
            self._starts.remove(ptr)
            entry[1].close()

    def _inside(self, ptr: int, size: int) -> bool:
        i = bisect.bisect_right(self._starts, ptr)
        return i > 0 and ptr + size <= self._starts[i - 1] + self._regs[self._starts[i - 1]][0]

    def _cover(self, ptrs, sizes) -> list:
        """Temporary registrations for the spans of this call outside registered memory."""
        spans = sorted((p, p + s) for p, s in zip(ptrs, sizes) if s > 0 and not self._inside(p, s))
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return [self._store.register((ctypes.c_ubyte * (hi - lo)).from_address(lo)) for lo, hi in merged]

    # -- data -----------------------------------------------------------------------------------

    def put_from_ptr(self, key: str, src: int, size: int) -> bool:
        return self.batch_put_from_ptr([key], [src], [size])[0]

    def batch_put_from_ptr(self, keys: list, ptrs: list, sizes: list) -> list:
        return self._put("batch_put_from_ptr", keys, ptrs, sizes, None)

    def batch_put_from_ptr_with_depth(self, keys: list, ptrs: list, sizes: list, depths: list) -> list:
        # mori's -1 means "no depth" (plain LRU); te's depth 0 is the same.
        return self._put("batch_put_from_ptr_with_depth", keys, ptrs, sizes, [max(int(d), 0) for d in depths])

    def _put(self, call, keys, ptrs, sizes, depths) -> list:
        n = len(keys)
        if n != len(ptrs) or n != len(sizes) or (depths is not None and len(depths) != n):
            log.error("%s: keys, ptrs, sizes (and depths) differ in length", call)
            return [False] * n
        if n == 0:
            return []
        temps = []
        try:
            temps = self._cover(ptrs, sizes)
            got = self._store.batch_put_ranges(list(keys), _u64s(sizes), _u64s(range(n)), 0, _u64s(sizes),
                                               _u64s(ptrs), depths)
        except (errors.TeError, TypeError, OverflowError, ValueError) as e:
            log.error("%s: %s", call, e)
            return [False] * n
        finally:
            for t in temps:
                t.close()
        for key, r in zip(keys, got):
            if r is None:
                self._keys.add(key)
            else:
                log.error("%s(%r): %s", call, key, r)
        return [r is None for r in got]

    def get_into_ptr(self, key: str, dst: int, size: int) -> bool:
        return self.batch_get_into_ptr([key], [dst], [size])[0]

    def batch_get_into_ptr(self, keys: list, ptrs: list, sizes: list) -> list:
        """Per key: True once the whole object is in its buffer."""
        n = len(keys)
        if n != len(ptrs) or n != len(sizes):
            log.error("batch_get_into_ptr: keys, ptrs and sizes differ in length")
            return [False] * n
        if n == 0:
            return []
        temps = []
        try:
            temps = self._cover(ptrs, sizes)
            got = self._store.batch_get_whole(list(keys), _u64s(ptrs), _u64s(sizes))
            if self._probe is not None:
                get_remote("batch_get_into_ptr", self._store, list(keys), list(ptrs), list(sizes), got,
                           self._probe.addr)
        except (errors.TeError, TypeError, OverflowError, ValueError) as e:
            log.error("batch_get_into_ptr: %s", e)
            return [False] * n
        finally:
            for t in temps:
                t.close()
        for key, r in zip(keys, got):
            if not isinstance(r, int) and not isinstance(r, errors.NotFoundError):
                log.error("batch_get_into_ptr(%r): %s", key, r)
        return [isinstance(r, int) for r in got]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: list) -> list:
        try:
            keys = list(keys)
            lens = self._store.object_lens(keys)
            if self._probe is not None and None in lens:
                missing = [i for i, n in enumerate(lens) if n is None]
                for i, n in zip(missing, remote_lens(self._store, [keys[i] for i in missing], self._probe.addr)):
                    lens[i] = n
            return [n is not None for n in lens]
        except errors.TeError as e:
            log.error("batch_exists: %s", e)
            return [False] * len(keys)

    def batch_exists_consecutive(self, keys: list) -> int:
        try:
            if self._probe is not None:  # the cluster's keys too: the first miss ends the run
                found = self.batch_exists(keys)
                return found.index(False) if False in found else len(found)
            return self._store.batch_exists_consecutive(list(keys))
        except errors.TeError as e:
            log.error("batch_exists_consecutive: %s", e)
            return 0

    # -- lifecycle ------------------------------------------------------------------------------

    def flush(self) -> bool:
        try:
            self._store.flush()
        except errors.TeError as e:
            log.error("flush: %s", e)
            return False
        return True

    def clear(self) -> bool:
        """Removes what this client stored. True only in local mode, where that is the whole
        store; a shared server or cluster holds other clients' keys, which UMBP cannot list."""
        try:
            for key in list(self._keys):
                self._store.remove(key)
                self._keys.discard(key)
        except errors.TeError as e:
            log.error("clear: %s", e)
            return False
        if self._store.mode != "local":
            log.error("clear: removed this client's keys only; te's %s store cannot list other clients' keys",
                      self._store.mode)
            return False
        return True

    def close(self) -> None:
        for ptr in list(self._regs):
            self.deregister_memory(ptr)
        try:
            self._store.close()
        except errors.ClosedError:
            pass

    def is_distributed(self) -> bool:
        return self._distributed

    def get_deployment_mode(self) -> str:
        return {"local": "Local", "standalone": "StandaloneProcess", "distributed": "Distributed"}.get(
            self._store.mode, self._store.mode)

    def __getattr__(self, name: str):
        if name in _REFUSED:
            raise UnsupportedError(f"UMBPClient.{name}: not available on te ({_REFUSED[name]})")
        raise AttributeError(name)


_REFUSED = {
    "report_external_kv_blocks": "external KV block events have no counterpart in te's store",
    "revoke_external_kv_blocks": "external KV block events have no counterpart in te's store",
    "revoke_all_external_kv_blocks_at_tier": "external KV block events have no counterpart in te's store",
    "match_external_kv": "external KV block events have no counterpart in te's store",
    "get_external_kv_hit_counts": "external KV block events have no counterpart in te's store",
}

__all__ = ["UMBPClient", "UMBPConfig", "UMBPDramConfig", "UMBPSsdConfig", "UMBPEvictionConfig",
           "UMBPDistributedConfig", "UMBPMasterClientConfig", "UMBPStandaloneProcessConfig", "UnsupportedError"]
