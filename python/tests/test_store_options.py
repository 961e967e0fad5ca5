"""docs/configuration.md's local-mode UMBP table, read as a Python user reads it: every name in
its "builder / Python" column is a ``te.umbp.Store`` keyword, typed (a value of the wrong type
raises ``te.InvalidArgument`` naming it); every variable in it is read (a malformed one raises
``te.ConfigError`` naming it); and a keyword wins over its variable. Likewise the distributed-mode
table's "Python" column: each is a typed keyword, a malformed value is refused naming its
variable, and a ``cluster=`` store takes its keywords over the defaults, reading no
``UMBP_CLUSTER_*`` variable. And the standalone-mode table's: a worker's ``Store`` takes the
keywords whose line is not marked "Server:", a ``Server`` those not marked "Workers:", each
typed, and each side refuses a malformed variable of its own naming it."""

from __future__ import annotations

import pathlib

import pytest

import te
from te import umbp
from conftest import skip_or_fail, unique

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def rows(title: str = "## UMBP, local mode (the core)") -> list[tuple[str, str]]:
    """(variable, Python keyword) of each row of the section's table (rows without a keyword
    left out)."""
    section = DOC.read_text().split(title, 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip("|").split(" | ")]
        if line.startswith("| `UMBP_") and cells[2]:
            out.append((cells[0], cells[2]))
    return out


ROWS = rows()
CLUSTER_ROWS = rows("## UMBP, distributed mode")


def standalone_rows() -> list[tuple[str, str, str]]:
    """(variable, Python keyword or "", meaning) of each row of the standalone-mode table."""
    section = DOC.read_text().split("## UMBP, standalone mode", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip("|").split(" | ")]
        if line.startswith("| `UMBP_"):
            out.append((cells[0], cells[2], cells[-1]))
    return out


STANDALONE_ROWS = standalone_rows()
WORKER_ROWS = [(v, k) for v, k, meaning in STANDALONE_ROWS if not meaning.startswith("Server:")]
SERVER_ROWS = [(v, k) for v, k, meaning in STANDALONE_ROWS if not meaning.startswith("Workers:")]
NOWHERE = "etcd://127.0.0.1:1/nowhere"


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


def test_the_cluster_table_is_there():
    assert len(CLUSTER_ROWS) >= 9, CLUSTER_ROWS
    assert CLUSTER_ROWS[:2] == [("UMBP_CLUSTER", "cluster"), ("UMBP_CLUSTER_LISTEN", "cluster_listen")]


@pytest.mark.parametrize("var,keyword", CLUSTER_ROWS)
def test_each_documented_cluster_keyword_is_a_typed_option(var, keyword):
    if not umbp.DISTRIBUTED:
        pytest.skip("this build of te has no distributed mode")
    options = {"cluster": NOWHERE, keyword: object()}
    with pytest.raises(te.InvalidArgument, match=keyword) as e:
        umbp.Store(**options)
    assert "unknown option" not in str(e.value)


@pytest.mark.parametrize("keyword,value,var", [
    ("cluster", "http://127.0.0.1:1", "UMBP_CLUSTER"),
    ("cluster_lease_ttl_s", 1, "UMBP_CLUSTER_LEASE_TTL_S"),
    ("cluster_timeout_ms", 0, "UMBP_CLUSTER_TIMEOUT_MS"),
    ("cluster_compact_s", 86401, "UMBP_CLUSTER_COMPACT_S"),
])
def test_a_malformed_cluster_keyword_is_refused_naming_its_variable(keyword, value, var):
    if not umbp.DISTRIBUTED:
        pytest.skip("this build of te has no distributed mode")
    options = {"cluster": NOWHERE, keyword: value}
    with pytest.raises(te.ConfigError, match=var):
        umbp.Store(dram_capacity=16 << 20, ssd_dirs=[], **options)


def test_a_bad_cluster_choice_is_refused_naming_its_keyword():
    if not umbp.DISTRIBUTED:
        pytest.skip("this build of te has no distributed mode")
    for keyword, value in [("cluster_listen", "nowhere"), ("cluster_directory", "gossip")]:
        with pytest.raises(te.InvalidArgument, match=keyword):
            umbp.Store(cluster=NOWHERE, **{keyword: value})


def test_a_cluster_store_takes_its_keywords_and_reads_no_cluster_variable(etcd):
    if not umbp.DISTRIBUTED:
        skip_or_fail("etcd", "this build of te has no distributed mode (cargo feature distributed)")
    url = f"etcd://{etcd}/" + unique("py-options")
    env = {"UMBP_CLUSTER_LEASE_TTL_S": "nonsense", "UMBP_CLUSTER_TIMEOUT_MS": "0"}
    with umbp.Store(env=env, cluster=url, cluster_lease_ttl_s=3, cluster_listen="127.0.0.1:0",
                    dram_capacity=16 << 20, ssd_dirs=[], segment_name=unique("peer")) as store:
        c = store.config["cluster"]
        assert (c["lease_ttl_s"], c["timeout"], c["listen"].split(":")[0]) == (3, 3.0, "127.0.0.1")


def test_the_standalone_table_is_there():
    assert len(STANDALONE_ROWS) >= 13, STANDALONE_ROWS
    assert ("UMBP_STANDALONE_SOCKET", "connect") in WORKER_ROWS
    assert ("UMBP_KEY_HANDLE_SLOTS", "key_handle_slots") in WORKER_ROWS
    assert ("UMBP_SERVER_ALLOW_GID", "allow_gid") in SERVER_ROWS
    assert ("UMBP_KEY_HANDLE_CAPACITY", "key_handle_capacity") in SERVER_ROWS


@pytest.mark.parametrize("var,keyword", [r for r in WORKER_ROWS if r[1]])
def test_each_documented_worker_keyword_is_a_typed_store_option(var, keyword):
    with pytest.raises(te.InvalidArgument, match=keyword) as e:
        umbp.Store(**{keyword: object()})
    assert "unknown option" not in str(e.value)


@pytest.mark.parametrize("var,keyword", [r for r in SERVER_ROWS if r[1] and r not in WORKER_ROWS])
def test_a_server_keyword_is_not_a_store_option(var, keyword):
    with pytest.raises(te.InvalidArgument, match="unknown option"):
        umbp.Store(**{keyword: 1})


@pytest.mark.parametrize("var,keyword", [r for r in SERVER_ROWS if r[1]])
def test_each_documented_server_keyword_is_a_typed_server_option(var, keyword, tmp_path):
    with pytest.raises(te.InvalidArgument, match=keyword) as e:
        umbp.Server(str(tmp_path / "s.sock"), dram_capacity=16 << 20, ssd_dirs=[], **{keyword: object()})
    assert "unknown option" not in str(e.value)


@pytest.mark.parametrize("var,keyword", WORKER_ROWS)
def test_each_documented_worker_variable_is_read(var, keyword):
    # Empty is malformed for every setting; refused before anything connects.
    with pytest.raises(te.ConfigError, match=var):
        umbp.Store(env={"UMBP_STANDALONE_SOCKET": "/nonexistent/umbp.sock", var: ""},
                   dram_capacity=16 << 20, ssd_dirs=[])


@pytest.mark.parametrize("var,keyword", SERVER_ROWS)
def test_each_documented_server_variable_is_read(var, keyword, tmp_path):
    env = {"UMBP_STANDALONE_SOCKET": str(tmp_path / "s.sock"), var: ""}
    with pytest.raises(te.ConfigError, match=var):
        umbp.Server(env=env, dram_capacity=16 << 20, ssd_dirs=[])


def test_a_server_keyword_wins_over_its_variable(tmp_path):
    sock = str(tmp_path / "s.sock")
    env = {"UMBP_KEY_HANDLE_CAPACITY": "lots", "UMBP_SERVER_ALLOW_GID": "wheel", "UMBP_STANDALONE_SOCKET": ""}
    with umbp.Server(env=env, connect=sock, key_handle_capacity=0, allow_gid=0, dram_capacity=16 << 20,
                     ssd_dirs=[]) as server:
        assert str(server.socket) == sock
        with umbp.Store(connect=sock, key_handle_slots=0, standalone_timeout_ms=5000) as store:
            assert store.config["standalone"]["timeout"] == 5.0
            assert store.config["standalone"]["key_handle_slots"] == 0
