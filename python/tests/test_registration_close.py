"""Registration.close() releases the Python buffer before it returns: the view it exported is
given back by the closing call itself, under the GIL it takes back, not later by a thread the
engine starts for it (which also had to win the GIL from the caller; issue 40's deregistration
after a killed peer)."""

from __future__ import annotations

import pytest

import te
from conftest import unique


def test_close_gives_the_buffer_back_before_it_returns():
    e = te.TransferEngine(unique("close"), transports=["tcp"])
    try:
        for i in range(50):
            buf = bytearray(64 * 1024)
            reg = e.register(buf)
            with pytest.raises(BufferError):
                buf.extend(b"x")  # exported to the engine: Python refuses to resize it
            assert reg.close() is True
            # No GIL switch in between: the export is already released.
            buf.extend(b"x")
            assert len(buf) == 64 * 1024 + 1, i
    finally:
        e.shutdown()

