"""``python -m te.compat pythonpath``: the PYTHONPATH that makes ``TE_COMPAT`` work in an
unmodified program (and in every Python process it starts)."""

import os
import sys

from te.compat import boot_dir


def main(argv: list[str]) -> int:
    if argv != ["pythonpath"]:
        print("usage: python -m te.compat pythonpath\n"
              "  prints the PYTHONPATH to export with TE_COMPAT=mooncake,mori", file=sys.stderr)
        return 2
    print(os.pathsep.join([boot_dir()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
