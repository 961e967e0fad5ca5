"""Start-up hook of te.compat: on PYTHONPATH (``python -m te.compat pythonpath`` prints it), it
installs the import hook for the peers named in ``TE_COMPAT``, then runs the sitecustomize it
hides (the next one on sys.path), so the interpreter's own start-up is unchanged otherwise."""

import importlib.util
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_te_compat_next_sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if os.environ.get("TE_COMPAT"):
    import te.compat

    te.compat.install()
_chain()
