"""docs/configuration.md's local-mode UMBP table, read as a Python user reads it: every name in
its "builder / Python" column is a ``te.umbp.Store`` keyword, typed (a value of the wrong type
raises ``te.InvalidArgument`` naming it); every variable in it is read (a malformed one raises
``te.ConfigError`` naming it); and a keyword wins over its variable."""

from __future__ import annotations

import pathlib

import pytest

import te
from te import umbp

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def rows() -> list[tuple[str, str]]:
    """(variable, Python keyword) of each row of the local-mode table."""
    section = DOC.read_text().split("## UMBP, local mode (the core)", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip("|").split(" | ")]
        if line.startswith("| `UMBP_"):
            out.append((cells[0], cells[2]))
    return out


ROWS = rows()


def test_the_table_is_there():
    assert len(ROWS) >= 16, ROWS
    assert ("UMBP_DRAM_CAPACITY", "dram_capacity") in ROWS


@pytest.mark.parametrize("var,keyword", ROWS)
def test_each_documented_keyword_is_a_typed_option(var, keyword):
    with pytest.raises(te.InvalidArgument, match=keyword) as e:
        umbp.Store(**{keyword: object()})
    assert "unknown option" not in str(e.value)


@pytest.mark.parametrize("var,keyword", ROWS)
def test_each_documented_variable_is_read(var, keyword, tmp_path):
    # An empty value is malformed for every kind of setting; the configuration is refused before
    # anything opens. SSD settings are read only with an SSD tier.
    options = {"dram_capacity": 16 << 20, "ssd_dirs": [str(tmp_path)]}
    options.pop(keyword, None)
    with pytest.raises(te.ConfigError, match=var):
        umbp.Store(env={var: ""}, **options)


def test_a_keyword_wins_over_its_variable():
    with umbp.Store(env={"UMBP_EVICTION": "random", "UMBP_DRAM_CAPACITY": "lots"}, eviction="lru",
                    dram_capacity=16 << 20, ssd_dirs=[]) as store:
        assert store.config["core"]["eviction"] == "Lru"
        assert store.config["core"]["dram_capacity"] == 16 << 20
