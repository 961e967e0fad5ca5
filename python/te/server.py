"""``umbp-server``: the standalone UMBP server (one per node), as the Rust binary of that name runs
it, with the same flags. Unset options come from the ``UMBP_*`` variables; SIGINT or SIGTERM
stops it (flushing, unlinking the socket)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from . import _native, errors
from .umbp import Server


def _flags() -> list[tuple[str, str | None, str, str]]:
    """The Rust binary's flags, from umbp's settings tables: ``(flag, value name or None for a
    switch, the variable it stands for, doc line)``."""
    return _native.server_flags()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="umbp-server", description=__doc__)
    for flag, value, var, doc in _flags():
        # %% : argparse formats the help text with %.
        text = f"{doc} ({var})".replace("%", "%%")
        if value is None:
            p.add_argument(flag, dest=var, action="store_true", help=text)
        else:
            p.add_argument(flag, dest=var, metavar=value, help=text)
    return p


def _env(args: argparse.Namespace) -> dict[str, str]:
    """The process's ``UMBP_*`` and ``TE_*`` variables, each flag given over the variable it
    stands for."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("UMBP_", "TE_"))}
    for _flag, value, var, _doc in _flags():
        got = getattr(args, var)
        if value is None:
            if got:
                env[var] = "1"
        elif got is not None:
            env[var] = got
    return env


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The flags travel as the variables they stand for, so values parse exactly as the Rust
    # binary parses them; the process's other UMBP_* variables apply as well.
    env = _env(args)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server = Server(env=env)
    except errors.TeError as e:
        print(f"umbp-server: {e}", file=sys.stderr)
        return 2
    print(f"umbp-server: serving on {server.socket}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
