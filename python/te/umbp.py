"""The UMBP store: local, standalone (a ``Server`` per node, workers sharing KV buffers as sealed
memfds) or distributed (peers in etcd), one API.

Options are the Rust ``StoreBuilder``'s setters as keyword arguments (unset ones come from the
``UMBP_*`` variables): ``Store(dram_capacity=1 << 30)`` is local mode, ``Store(connect=socket)``
standalone mode, ``Store(cluster="etcd://127.0.0.1:2379/umbp")`` distributed mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import _native
from ._native import KvBuffer, Server, StoreBuffer

__all__ = ["Store", "Server", "StoreBuffer", "KvBuffer", "StoreStats", "Stats", "DISTRIBUTED"]

#: True when this build has distributed mode (cargo feature ``distributed``).
DISTRIBUTED: bool = _native.DISTRIBUTED


class Stats:
    """A section of the store's counters, as attributes (``stats.core.dram_objects``)."""

    def __init__(self, fields: dict[str, Any]):
        self.__dict__.update(fields)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"Stats({inner})"


@dataclass(frozen=True)
class StoreStats:
    """Rust's ``StoreStats``: the tiers' counters (``core``; in standalone mode the server's), and
    the section of the mode in use (``standalone``, ``cluster``; None otherwise)."""

    core: Stats
    standalone: Stats | None = None
    cluster: Stats | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


class Store(_native.Store):
    """A UMBP store. See the module docstring for the modes; every data call releases the GIL."""

    def stats(self) -> StoreStats:  # type: ignore[override]
        raw = super().stats()
        section = lambda k: Stats(raw[k]) if raw.get(k) is not None else None  # noqa: E731
        return StoreStats(core=Stats(raw["core"]), standalone=section("standalone"), cluster=section("cluster"), raw=raw)
