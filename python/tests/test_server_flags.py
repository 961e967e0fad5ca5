"""``python -m te.server``, read as a user of the ``umbp-server`` binary reads it: every flag in the
"umbp-server" columns of docs/configuration.md's UMBP tables is a flag of its parser (a switch
takes no value, the others one), each flag stands for its variable, a malformed value is refused
naming that variable, and the server it starts serves workers on the socket given."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from te import _native, server, umbp

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
TABLES = ["## UMBP, local mode (the core)", "## UMBP, standalone mode"]


def documented_flags() -> list[tuple[str, str, str | None]]:
    """(variable, flag, value name or None) of each row with an ``umbp-server`` flag."""
    out = []
    for title in TABLES:
        section = DOC.read_text().split(title, 1)[1].split("\n## ", 1)[0]
        lines = [line for line in section.splitlines() if line.startswith("|")]
        head = [c.strip() for c in lines[0].strip("|").split(" | ")]
        column = head.index("`umbp-server`")
        for line in lines[2:]:
            cells = [c.strip().strip("`").replace("\\|", "|") for c in line.strip("|").split(" | ")]
            if cells[column]:
                flag, _, value = cells[column].partition(" ")
                out.append((cells[0], flag, value or None))
    return out


FLAGS = documented_flags()


def test_the_flags_are_documented():
    flags = [f for _, f, _ in FLAGS]
    assert {"--socket", "--dram", "--write-through", "--allow-gid", "--key-handle-capacity"} <= set(flags), flags


@pytest.mark.parametrize("var,flag,value", FLAGS)
def test_each_documented_flag_is_the_parsers(var, flag, value):
    actions = {o: a for a in server._parser()._actions for o in a.option_strings}
    assert flag in actions, f"{flag} ({var}) is not a flag of python -m te.server"
    assert actions[flag].dest == var
    assert actions[flag].nargs == (0 if value is None else None), flag


def test_the_parser_has_exactly_the_binarys_flags():
    parsed = {o for a in server._parser()._actions for o in a.option_strings} - {"-h", "--help"}
    assert parsed == {f for f, *_ in _native.server_flags()}
    assert sorted(parsed) == sorted(f for _, f, _ in FLAGS)


def test_each_flag_stands_for_its_variable(tmp_path):
    argv = []
    want = {}
    for var, flag, value in FLAGS:
        if value is None:
            argv.append(flag)
            want[var] = "1"
        else:
            argv += [flag, f"v-{var}"]
            want[var] = f"v-{var}"
    env = server._env(server._parser().parse_args(argv))
    assert {k: env[k] for k in want} == want


def run_server(*argv: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UMBP_")}
    return subprocess.Popen([sys.executable, "-m", "te.server", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.parametrize("flag,var", [("--key-handle-capacity", "UMBP_KEY_HANDLE_CAPACITY"),
                                      ("--dram", "UMBP_DRAM_CAPACITY"),
                                      ("--allow-gid", "UMBP_SERVER_ALLOW_GID")])
def test_a_malformed_flag_is_refused_naming_its_variable(flag, var, tmp_path):
    p = run_server("--socket", str(tmp_path / "s.sock"), flag, "lots")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and var in err, err


def test_no_socket_is_refused():
    p = run_server("--dram", "16M")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "UMBP_STANDALONE_SOCKET" in err, err


def test_the_server_serves_on_the_socket_given(tmp_path):
    sock = str(tmp_path / "s.sock")
    p = run_server("--socket", sock, "--dram", "16M", "--key-handle-capacity", "0")
    try:
        line = p.stdout.readline()
        assert "serving on" in line, (line, p.stderr.read() if p.poll() is not None else "")
        with umbp.Store(connect=sock) as store:
            assert store.mode == "standalone"
            assert str(store.config["standalone"]["socket"]) == sock
    finally:
        p.terminate()
        p.wait(timeout=30)
    assert p.returncode == 0
