"""``umbp-server``: the standalone UMBP server (one per node), as the Rust binary of that name runs
it, with the same flags. Unset options come from the ``UMBP_*`` variables; SIGINT or SIGTERM
stops it (flushing, unlinking the socket)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from . import errors
from .umbp import Server


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="umbp-server", description=__doc__)
    p.add_argument("--socket", required=True, help="the Unix socket workers connect to")
    p.add_argument("--dram", help="DRAM tier capacity, e.g. 64G (UMBP_DRAM_CAPACITY)")
    p.add_argument("--ssd-dirs", help="SSD tier directories, comma-separated (UMBP_SSD_DIRS)")
    p.add_argument("--ssd-capacity", help="SSD tier capacity, e.g. 2048G (UMBP_SSD_CAPACITY)")
    p.add_argument("--eviction", help="lru, prefix or prefix:N (UMBP_EVICTION)")
    p.add_argument("--write-through", action="store_true", help="write every put to SSD too")
    p.add_argument("--allow-gid", type=int, help="also accept workers of this group id")
    p.add_argument("--key-handle-capacity", type=int, help="key handles kept per server")
    return p


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The flags travel as the variables they stand for, so sizes parse exactly as the Rust
    # binary parses them; the process's other UMBP_* variables apply as well.
    env = {k: v for k, v in os.environ.items() if k.startswith(("UMBP_", "TE_"))}
    for value, var in ((args.dram, "UMBP_DRAM_CAPACITY"), (args.ssd_dirs, "UMBP_SSD_DIRS"),
                       (args.ssd_capacity, "UMBP_SSD_CAPACITY"), (args.eviction, "UMBP_EVICTION")):
        if value is not None:
            env[var] = value
    if args.write_through:
        env["UMBP_SSD_WRITE_THROUGH"] = "1"
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server = Server(args.socket, env=env, allow_gid=args.allow_gid,
                        key_handle_capacity=args.key_handle_capacity)
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
