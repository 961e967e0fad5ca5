"""The import hook: ``mooncake.engine``, ``mooncake.store`` and ``mori.umbp`` resolved to
te.compat's modules, for the peers named when it was installed.

A finder placed first on ``sys.meta_path`` answers only the names of the peers it was given. A
real installed ``mooncake`` (or ``mori``) is never shadowed silently: importing it then raises
ImportError naming both ways out, unless the peer is also listed in ``shadow``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

# peer -> {module name under the peer's package: te.compat module}
PEERS = {
    "mooncake": {"engine": "te.compat.mooncake", "store": "te.compat.mooncake_store"},
    "mori": {"umbp": "te.compat.mori_umbp"},
}


class _AliasLoader(importlib.abc.Loader):
    """Returns te.compat's module object itself under the peer's name (one module, two names)."""

    def __init__(self, target: str | None):
        self.target = target

    def create_module(self, spec):
        if self.target is None:  # the peer's top-level package: an empty package of ours
            module = types.ModuleType(spec.name, f"{spec.name} provided by te.compat")
            module.__path__ = []
            return module
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass


class CompatFinder(importlib.abc.MetaPathFinder):
    def __init__(self, peers: list[str], shadow: list[str]):
        self.peers = peers
        self.shadow = shadow

    def find_spec(self, fullname, path=None, target=None):
        top, _, sub = fullname.partition(".")
        if top not in self.peers:
            return None
        if not sub:
            self._refuse_shadowing(top)
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(None), is_package=True)
        modules = PEERS[top]
        if sub not in modules:
            raise ImportError(f"{fullname}: te.compat provides only {', '.join(top + '.' + m for m in modules)}",
                              name=fullname)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(modules[sub]))

    def _refuse_shadowing(self, peer: str) -> None:
        real = importlib.machinery.PathFinder.find_spec(peer)
        if real is not None and peer not in self.shadow:
            where = real.origin or (list(real.submodule_search_locations or []) or ["?"])[0]
            raise ImportError(
                f"TE_COMPAT asks te to stand in for {peer!r}, but the real {peer!r} is installed ({where}); "
                f"uninstall it, drop {peer!r} from TE_COMPAT, or set TE_COMPAT_SHADOW={peer} to shadow it",
                name=peer)


def install(peers: list[str], shadow: list[str]) -> CompatFinder:
    unknown = [p for p in peers + shadow if p not in PEERS]
    if unknown:
        raise ValueError(f"TE_COMPAT: unknown peer(s) {unknown}; known: {sorted(PEERS)}")
    for finder in sys.meta_path:
        if isinstance(finder, CompatFinder):
            finder.peers = sorted(set(finder.peers) | set(peers))
            finder.shadow = sorted(set(finder.shadow) | set(shadow))
            return finder
    finder = CompatFinder(list(peers), list(shadow))
    sys.meta_path.insert(0, finder)
    return finder
