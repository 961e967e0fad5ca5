"""te: the transfer engine and the UMBP KV-cache store, from Python.

>>> import numpy as np, te
>>> a = te.TransferEngine("doc-a")
>>> src = np.arange(4096, dtype=np.uint8); dst = np.zeros(4096, dtype=np.uint8)
>>> rs, rd = a.register(src), a.register(dst)
>>> seg = a.open_segment("doc-a")
>>> a.write(seg, rs.addr, rd.addr, 4096).bytes
4096

Memory is registered without copying (buffer protocol, ``__dlpack__``,
``__cuda_array_interface__``, or ``register_ptr``); batched calls take numpy ``uint64`` arrays of
addresses and lengths, so a batch creates no Python object per request. Blocking calls release
the GIL; ``*_async`` methods and ``await batch`` are asyncio awaitables. Errors are the classes
of :mod:`te.errors`.
"""

from __future__ import annotations

from . import _native, errors
from ._native import (
    COMPILED_TRANSPORTS,
    Batch,
    BatchReport,
    Notification,
    Notifications,
    Registration,
    Segment,
    SegmentEvent,
    SegmentEvents,
    TransferEngine,
    device_plugins,
)
from .errors import *  # noqa: F401,F403 - the exception classes at top level: te.TimeoutError...

#: The package's version (the Rust crates').
__version__: str = _native.__version__

__all__ = [
    "COMPILED_TRANSPORTS",
    "Batch",
    "BatchReport",
    "Notification",
    "Notifications",
    "Registration",
    "Segment",
    "SegmentEvent",
    "SegmentEvents",
    "TransferEngine",
    "device_plugins",
    "errors",
    *errors.__all__,
]
