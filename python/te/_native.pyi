"""Type stubs of the native module ``te._native`` (PyO3). Import the names from ``te`` and
``te.umbp``; errors are the classes of ``te.errors``."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Generator, Iterator, Mapping, Sequence
from typing import Any, Union

import numpy as np
import numpy.typing as npt

#: Transports compiled into this build, in order of preference.
COMPILED_TRANSPORTS: list[str]
#: True when UMBP's distributed mode is compiled in.
DISTRIBUTED: bool
__version__: str

#: A 1-D C-contiguous array of 8-byte integers (numpy uint64, or int64), or one int that
#: applies to every request/range.
U64s = Union[int, npt.NDArray[np.uint64], npt.NDArray[np.int64]]
#: Memory that can be registered: a writable buffer-protocol object (numpy array, bytearray,
#: memoryview, mmap), or an object with ``__dlpack__`` or ``__cuda_array_interface__``.
Registrable = Any
SegmentLike = Union["Segment", int]

def device_plugins() -> list[tuple[str, str | None]]:
    """The device plugins compiled in: ``(name, None)`` when loaded, else ``(name, reason)``."""

def server_flags() -> list[tuple[str, str | None, str, str]]:
    """``umbp-server``'s flags, from umbp's settings tables: ``(flag, value name or None for a
    switch, the variable it stands for, doc line)``."""

def u64_bytes(values: list[int]) -> bytes:
    """A list of 64-bit unsigned ints as native-endian 8-byte values in one ``bytes``
    (``memoryview(b).cast("Q")``); ``te.InvalidArgument`` names the first bad index."""

def u64_lists(*lists: list[int]) -> bytes:
    """Several lists of one length ``n`` as native-endian 8-byte values in one ``bytes``: list
    ``j`` at ``[j * n, (j + 1) * n)`` of ``memoryview(b).cast("Q")``. Lists of different
    lengths raise ``te.ShapeError``; a bad value ``te.InvalidArgument`` naming list and index."""

class TransferEngine:
    """A transfer engine. Unset options come from the ``TE_*`` variables (of ``env`` when given,
    which then replaces the process environment); a malformed one raises ``te.ConfigError``."""

    def __init__(
        self,
        segment_name: str | None = None,
        *,
        transports: Sequence[str] | None = None,
        phase_timing: bool | None = None,
        auth_key_file: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None: ...
    @property
    def segment_name(self) -> str: ...
    @property
    def instance(self) -> int: ...
    def transports(self) -> list[tuple[str, str | None]]:
        """Every compiled-in transport: ``(name, None)`` when it runs here, else why not."""
    def register(self, obj: Registrable, *, device: str | None = None, export: bool = True) -> Registration:
        """Registers ``obj``'s memory without copying (read-only raises ``te.ReadOnlyBufferError``,
        non-contiguous ``te.NotContiguousError``). The object stays alive until the engine has
        released the region, whatever Python collects meanwhile. Memory inside a region already
        registered (a tensor view of a registered pool) shares that registration (the engine's
        registration cache, ``TE_REGISTRATION_CACHE``); other options than the region's raise
        ``te.InvalidArgument`` (kind ``registration_mismatch``), a partial overlap
        ``te.AlreadyRegisteredError``."""
    def register_ptr(self, ptr: int, length: int, device: str | None = None, *, export: bool = True) -> Registration:
        """Registers raw memory; the caller keeps it valid until the registration (and every
        registration inside it, which shares it) is closed and its transfers completed.
        ``device``: "host" (default), "cuda:N", "rocm:N"."""
    def register_ptrs(
        self, ptrs: U64s, lengths: U64s, device: str | None = None, *, export: bool = True
    ) -> list[Registration]:
        """``register_ptr`` for many regions in one call: one descriptor update for all of them
        (one by one, each republishes it). Nothing is registered if one is refused."""
    def open_segment(self, name: str) -> Segment: ...
    def open_segment_async(self, name: str) -> Awaitable[Segment]: ...
    def warm_up(self, segment: Segment) -> list[tuple[str, int, float]]: ...
    def routes(self, segment: Segment) -> list[tuple[str, str, bool, int]]:
        """``(transport, "active" | "paused" | "probing", connected, pauses)`` per route, in order
        of preference."""
    def unreached_routes(self, segment: Segment) -> list[tuple[str, str]]:
        """``(transport, why)`` for each transport that reaches the segment but refused to connect."""
    def close_segment(self, segment: SegmentLike) -> None: ...
    def submit_write(
        self,
        segment: SegmentLike,
        local_addrs: U64s,
        remote_addrs: U64s,
        lengths: U64s,
        *,
        deadline: float | None = None,
        background: bool = False,
        notify: bytes | None = None,
    ) -> Batch:
        """Submits writes (local to remote). ``deadline`` in seconds (default
        ``TE_TRANSFER_TIMEOUT_MS``); ``notify`` is sent to the target once every request
        completed. Malformed requests raise before anything starts. Releases the GIL while the
        engine submits: a transport may copy on this thread before it returns (the same-host
        transport copies small batches whole here)."""
    def submit_read(
        self,
        segment: SegmentLike,
        local_addrs: U64s,
        remote_addrs: U64s,
        lengths: U64s,
        *,
        deadline: float | None = None,
        background: bool = False,
        notify: bytes | None = None,
    ) -> Batch: ...
    def write(
        self,
        segment: SegmentLike,
        local_addrs: U64s,
        remote_addrs: U64s,
        lengths: U64s,
        *,
        deadline: float | None = None,
        notify: bytes | None = None,
    ) -> BatchReport:
        """``submit_write(...).wait()``, the GIL released while submitting and waiting."""
    def read(
        self,
        segment: SegmentLike,
        local_addrs: U64s,
        remote_addrs: U64s,
        lengths: U64s,
        *,
        deadline: float | None = None,
        notify: bytes | None = None,
    ) -> BatchReport: ...
    def notify(self, segment: Segment, payload: bytes) -> None: ...
    def notify_async(self, segment: Segment, payload: bytes) -> Awaitable[None]: ...
    def notifications(self) -> Notifications: ...
    def recv_notification(self, timeout: float | None = None) -> Notification | None: ...
    def shutdown(self) -> None: ...
    def __enter__(self) -> TransferEngine: ...
    def __exit__(self, *exc: object) -> bool: ...

class Registration:
    """A registered region; closing it (or its collection) deregisters it, deferred until its
    in-flight transfers completed."""

    @property
    def addr(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def location(self) -> str: ...
    @property
    def exported(self) -> bool: ...
    @property
    def open(self) -> bool: ...
    def address(self, offset: int = 0) -> int:
        """``addr + offset``, checked (``te.ClosedError``, ``te.OutOfBoundsError``)."""
    def close(self) -> bool:
        """True when released now; False when deferred until in-flight transfers complete."""
    def __enter__(self) -> Registration: ...
    def __exit__(self, *exc: object) -> bool: ...

class Segment:
    @property
    def id(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def buffers(self) -> list[tuple[int, int, str]]:
        """``(base, length, location)`` of each exported buffer when opened."""
    def events(self) -> SegmentEvents: ...

class SegmentEvent:
    kind: str  # "changed", "restarted", "gone", "closed", "lagged"
    buffers: list[tuple[int, int, str]]
    missed: int

class SegmentEvents:
    def next(self, timeout: float | None = None) -> SegmentEvent | None: ...
    def __aiter__(self) -> AsyncIterator[SegmentEvent]: ...
    def __anext__(self) -> Awaitable[SegmentEvent]: ...

class BatchReport:
    requests: int
    bytes: int

class Batch:
    """A submitted batch."""

    def wait(self, timeout: float | None = None) -> BatchReport:
        """Blocks with the GIL released; raises ``te.BatchFailedError`` (each failed request in
        ``failures``) or, past ``timeout``, ``te.WaitTimeoutError`` (the batch keeps running)."""
    def wait_async(self) -> Awaitable[BatchReport]: ...
    def __await__(self) -> Generator[Any, None, BatchReport]: ...
    def done(self) -> bool: ...
    def progress(self) -> dict[str, int]: ...
    def cancel(self) -> None: ...
    def __len__(self) -> int: ...

class Notification:
    sender: str
    payload: bytes

class Notifications:
    def try_recv(self) -> Notification | None: ...
    def recv(self, timeout: float | None = None) -> Notification | None: ...
    def recv_async(self) -> Awaitable[Notification | None]: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Notification]: ...
    def __next__(self) -> Notification: ...
    def __aiter__(self) -> AsyncIterator[Notification]: ...
    def __anext__(self) -> Awaitable[Notification]: ...

class Store:
    """A UMBP store; keyword options are the Rust ``StoreBuilder``'s setters: segment_name; the
    local-mode settings, named in the "builder / Python" column of docs/configuration.md's
    "UMBP, local mode" table (dram_capacity, ssd_dirs, eviction ("lru", "prefix", "prefix:N"),
    write_through, ...: sizes and counts as int, fractions as float, switches as bool, ssd_dirs
    as a list of paths, the others as the variable's text); the workers' standalone-mode
    settings, named in the "Python" column of the "UMBP, standalone mode" table where its line
    is not marked "Server:" (connect: the server's socket, a path; key_handle_slots, ...); local
    (local mode whatever UMBP_STANDALONE_SOCKET says); and the distributed-mode settings, named
    in the "Python"
    column of the "UMBP, distributed mode" table: cluster ("etcd://host:port[/prefix]":
    distributed mode), cluster_listen ("ip:port"), cluster_lease_ttl_s, cluster_directory
    ("sharded", "etcd"), ... (used only with cluster, over their defaults: a cluster= store
    reads no UMBP_CLUSTER_* variable)."""

    def __init__(self, *, env: Mapping[str, str] | None = None, **options: Any) -> None: ...
    @property
    def mode(self) -> str: ...
    @property
    def config(self) -> dict[str, Any]: ...
    def alloc_buffer(self, len: int) -> KvBuffer: ...
    def free_buffer(self, buf: KvBuffer) -> None: ...
    def register(self, obj: Registrable) -> StoreBuffer: ...
    def exists(self, key: str) -> bool: ...
    def batch_exists_consecutive(self, keys: Sequence[str]) -> int: ...
    def remove(self, key: str) -> bool: ...
    def batch_get_ranges(
        self, keys: Sequence[str], key_index: U64s, offsets: U64s, lengths: U64s, addrs: U64s
    ) -> list[int | BaseException]:
        """Per key: bytes delivered, or that key's exception (``te.NotFoundError``...)."""
    def batch_put_ranges(
        self,
        keys: Sequence[str],
        object_lens: U64s,
        key_index: U64s,
        offsets: U64s,
        lengths: U64s,
        addrs: U64s,
        depths: Sequence[int] | None = None,
    ) -> list[None | BaseException]: ...
    def batch_get_whole(self, keys: Sequence[str], addrs: U64s, capacities: U64s) -> list[int | BaseException]:
        """Each whole object into ``addrs[i]`` (at most ``capacities[i]`` bytes). Per key: its
        length, or that key's exception (``te.BufferTooSmallError``, ``te.NotFoundError``)."""
    def object_lens(self, keys: Sequence[str]) -> list[int | None]:
        """The objects' lengths in bytes, None where absent."""
    def stats(self) -> Any: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Store: ...
    def __exit__(self, *exc: object) -> bool: ...

class StoreBuffer:
    """Memory registered with a store. The store keeps the array alive until the buffer is
    closed (or collected) and the last call using it ended."""

    @property
    def addr(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def open(self) -> bool: ...
    def close(self) -> bool:
        """True when released now; False when a running call still uses it (released when it
        ends; the buffer refuses new calls at once)."""
    def __enter__(self) -> StoreBuffer: ...
    def __exit__(self, *exc: object) -> bool: ...

class KvBuffer:
    """A sealed memfd mapping; supports the buffer protocol (``np.frombuffer(buf, np.uint8)``)."""

    @property
    def addr(self) -> int: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

class Server:
    """A standalone server in this process (what ``umbp-server`` runs), until ``stop()``: on
    ``socket`` (else the ``connect`` keyword, else ``UMBP_STANDALONE_SOCKET``), owning a local
    store configured as ``Store``'s keywords, plus the server's settings: the "Python" column of
    docs/configuration.md's "UMBP, standalone mode" table where its line is not marked
    "Workers:" (allow_gid, key_handle_capacity, server_max_frame, ...)."""

    def __init__(
        self,
        socket: str | os.PathLike[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        **options: Any,
    ) -> None: ...
    @property
    def socket(self) -> str: ...
    def stop(self) -> None: ...
    def serve_forever(self) -> None: ...
    def __enter__(self) -> Server: ...
    def __exit__(self, *exc: object) -> bool: ...

def rust_write_loop(
    engine: TransferEngine, segment: Segment, local_addr: int, remote_addr: int, length: int, iters: int
) -> float:
    """Benchmark support: ns per one-request write (submit + wait) timed in Rust."""

def rust_get_ranges_loop(
    store: Store, keys: Sequence[str], key_index: U64s, offsets: U64s, lengths: U64s, addrs: U64s, iters: int
) -> float:
    """Benchmark support: ns per ``batch_get_ranges`` call timed in Rust."""
