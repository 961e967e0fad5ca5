"""The README's Python examples, run as written (every ```python block of its "Python" section,
in order, in one namespace), so they cannot drift from the package."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def blocks() -> list[str]:
    text = README.read_text()
    section = text.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(found) >= 2, "the README's Python section lost its examples"
    return found


def test_readme_examples_run():
    namespace: dict = {"__name__": "readme"}
    for i, code in enumerate(blocks()):
        exec(compile(code, f"README.md python block {i}", "exec"), namespace)
