"""The exceptions of the ``te`` package.

Every error of the Rust engine and store arrives as one of these classes. The message is the Rust
error's own text; ``kind`` names the Rust variant (``"out_of_bounds"``, ``"timeout"``, ...) and
further attributes carry its fields (``segment``, ``addr``, ``length``, ``peer``...). Classes also
derive from the closest builtin exception (``TimeoutError``, ``ConnectionError``, ``ValueError``,
``PermissionError``, ``OSError``, ``LookupError``), so generic handlers keep working.
"""

from __future__ import annotations

import builtins

__all__ = [
    "TeError", "InvalidArgument", "ReadOnlyBufferError", "NotContiguousError", "DtypeError", "ShapeError",
    "UnregisteredError", "AlreadyRegisteredError", "OutOfBoundsError", "LengthOverflowError", "ZeroLengthError",
    "NullAddressError", "UnknownSegmentError", "WrongMemoryKindError", "NoTransportError", "InFlightError",
    "ConfigError", "NotAvailableError", "UnauthenticatedError", "PeerGoneError", "PeerRestartedError",
    "TimeoutError", "WaitTimeoutError", "SegmentClosedError", "CancelledError", "InvalidDescriptorError",
    "RefusedError", "RegistrationFailedError", "TransportError", "BatchFailedError", "MetadataError", "IoError",
    "ClosedError", "SegmentNameTakenError", "NotificationQueueFullError", "NotificationTooLargeError",
    "StoreError", "RangeError", "StoreUnregisteredError", "BadKeyError", "NotFoundError", "CorruptError",
    "NoSpaceError", "BufferTooSmallError", "WriteConflictError", "TooLargeError", "StoreIoError", "ServerGoneError",
    "NotShareableError", "ProtocolError", "StoreRefusedError", "ServerError", "RemoteError", "ClusterError",
]


class TeError(Exception):
    """Base of every error the package raises. ``kind`` names the Rust error variant."""

    kind: str = "other"


# Bad input: caught before anything starts (in the binding or by the engine's validation).
class InvalidArgument(TeError, ValueError):
    """An argument is malformed."""


class ReadOnlyBufferError(InvalidArgument):
    """A read-only buffer was given where transfers may write."""


class NotContiguousError(InvalidArgument):
    """A non-contiguous array or view was given where one memory range is needed."""


class DtypeError(InvalidArgument, TypeError):
    """An array of the wrong element type (address arrays are 8-byte integers, numpy uint64)."""


class ShapeError(InvalidArgument):
    """Arrays of different lengths, or of more than one dimension."""


class UnregisteredError(InvalidArgument):
    """Local memory not (or only partly) registered with the engine."""


class AlreadyRegisteredError(InvalidArgument):
    """Memory overlapping a registered region."""


class OutOfBoundsError(InvalidArgument, IndexError):
    """A remote range outside every buffer the segment exports."""


class LengthOverflowError(InvalidArgument):
    """Address plus length overflows."""


class ZeroLengthError(InvalidArgument):
    """A request or registration of zero bytes."""


class NullAddressError(InvalidArgument):
    """A null address."""


class UnknownSegmentError(TeError, LookupError):
    """No segment of that name is published, or the id is not open."""


class WrongMemoryKindError(TeError):
    """The transport (or store) cannot serve this kind of memory."""


class NoTransportError(TeError):
    """No installed transport reaches the segment with these memory kinds."""


class InFlightError(TeError):
    """The memory still has transfers in flight."""


class ConfigError(TeError, ValueError):
    """A malformed configuration value; ``var`` names it (``TE_*``, ``UMBP_*``, an option)."""


class NotAvailableError(TeError):
    """A component is compiled in but cannot run on this host (no device, no library)."""


class UnauthenticatedError(TeError, PermissionError):
    """The peer did not prove the shared key."""


class PeerGoneError(TeError, ConnectionError):
    """The peer went away."""


class PeerRestartedError(PeerGoneError):
    """The peer restarted; requests in flight to the old instance failed."""


class TimeoutError(TeError, builtins.TimeoutError):  # noqa: A001 - mirrors the Rust variant
    """An operation (a batch past its deadline, a control call) did not complete in time."""


class WaitTimeoutError(TimeoutError):
    """``Batch.wait(timeout=...)`` returned before the batch completed (it keeps running)."""


class SegmentClosedError(TeError):
    """The segment was closed by this engine."""


class CancelledError(TeError):
    """The request was cancelled before it started."""


class InvalidDescriptorError(TeError):
    """A segment descriptor failed validation."""


class RefusedError(TeError):
    """The target refused the request."""


class RegistrationFailedError(TeError):
    """A registration failed on a transport; nothing stays registered."""


class TransportError(TeError):
    """A transport-level failure (the native library's error in the message)."""


class BatchFailedError(TeError):
    """Some requests of a batch failed. ``failures`` lists ``(request index, exception)``;
    ``done``, ``failed``, ``cancelled`` and ``pending`` count the requests by state;
    ``timed_out`` says whether any request failed with ``te.TimeoutError`` (its deadline passed),
    without building ``failures``.

    ``failures`` is built on first access (then kept): a batch whose peer died fails every request
    left, and making an exception for each before the caller even looks cost milliseconds of
    allocation and garbage collection on the error path."""

    done: int = 0
    failed: int = 0
    cancelled: int = 0
    pending: int = 0
    timed_out: bool = False

    @property
    def failures(self) -> list[tuple[int, TeError]]:
        d = self.__dict__
        if "_failures" not in d:
            source = d.get("_failures_source")
            d["_failures"] = source.materialize() if source is not None else []
            # The source keeps the list too, out of the garbage collector's sight: left here, a
            # cycle through the list (`raise e.failures[0][1]` inside `except e`) could never
            # be collected.
            d.pop("_failures_source", None)
        return d["_failures"]

    @failures.setter
    def failures(self, value: list[tuple[int, TeError]]) -> None:
        self.__dict__["_failures"] = value

    def __reduce__(self):
        # Pickled with the list itself (the Rust-held source does not pickle).
        state = {k: v for k, v in self.__dict__.items() if k != "_failures_source"}
        state["_failures"] = self.failures
        return (type(self), self.args, state)


class MetadataError(TeError):
    """The metadata service (etcd, p2p) failed."""


class IoError(TeError, OSError):
    """An operating-system I/O error."""


class ClosedError(TeError):
    """The engine, store, registration or buffer is closed."""


class SegmentNameTakenError(TeError, ValueError):
    """Another live engine of this process holds the segment name (``name``)."""


class NotificationQueueFullError(TeError):
    """The target's notification inbox is full."""


class NotificationTooLargeError(InvalidArgument):
    """The notification payload is larger than the target accepts."""


# The store.
class StoreError(TeError):
    """Base of the store's own errors."""


class RangeError(StoreError, InvalidArgument):
    """A range outside its object, overlapping another, of zero length, or a put's ranges that do
    not tile the object; ``key_index`` names the key."""


class StoreUnregisteredError(StoreError, InvalidArgument):
    """Caller memory not registered with the store."""


class BadKeyError(StoreError, InvalidArgument):
    """An empty, too long or repeated key."""


class NotFoundError(StoreError, LookupError):
    """The key is in no tier (``key`` names it)."""


class CorruptError(StoreError):
    """A damaged record."""


class NoSpaceError(StoreError):
    """No tier has room."""


class BufferTooSmallError(StoreError):
    """The destination is smaller than the object."""


class WriteConflictError(StoreError):
    """A concurrent put of the same key."""


class TooLargeError(StoreError, InvalidArgument):
    """An object larger than the store takes."""


class StoreIoError(StoreError, OSError):
    """A tier's I/O failed."""


class ServerGoneError(StoreError, ConnectionError):
    """Standalone mode: the server went away."""


class NotShareableError(StoreError, InvalidArgument):
    """Standalone mode: memory the server cannot map (use ``Store.alloc_buffer``)."""


class ProtocolError(StoreError):
    """Standalone mode: a malformed frame."""


class StoreRefusedError(StoreError):
    """The server or a peer refused the call."""


class ServerError(StoreError):
    """The server failed."""


class RemoteError(StoreError):
    """Distributed mode: a remote peer failed."""


class ClusterError(StoreError):
    """Distributed mode: membership or directory failure."""
