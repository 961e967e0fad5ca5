"""Drop-in modules for Python code written against Mooncake's and mori's APIs.

- :mod:`te.compat.mooncake`: ``TransferEngine`` as ``mooncake.engine`` has it;
- :func:`install`: makes ``import mooncake.engine`` (and the others) resolve to these modules in
  this interpreter; ``TE_COMPAT=mooncake,mori`` does it at start-up for an unmodified program
  (see docs/python.md, "Switching from Mooncake / mori").

Nothing here is active unless asked for: importing ``te`` or ``te.compat`` changes no import.
"""

from __future__ import annotations

import os

__all__ = ["install", "boot_dir"]


def _names(value: str | None) -> list[str]:
    return [n.strip() for n in (value or "").split(",") if n.strip()]


def install(peers: list[str] | None = None, *, shadow: list[str] | None = None):
    """Makes the peers' module names (``mooncake.engine``, ``mooncake.store``, ``mori.umbp``)
    import te.compat's modules in this interpreter.

    ``peers`` defaults to ``TE_COMPAT`` (comma-separated: ``mooncake``, ``mori``), ``shadow`` to
    ``TE_COMPAT_SHADOW``: a peer that is really installed is shadowed only when listed there;
    otherwise importing it raises ImportError saying so. Modules of the peer already imported
    stay as they are.
    """
    from . import _hook

    peers = _names(os.environ.get("TE_COMPAT")) if peers is None else list(peers)
    shadow = _names(os.environ.get("TE_COMPAT_SHADOW")) if shadow is None else list(shadow)
    return _hook.install(peers, shadow)


def boot_dir() -> str:
    """The directory whose ``sitecustomize.py`` calls :func:`install` at start-up when
    ``TE_COMPAT`` is set; put it first on PYTHONPATH."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
