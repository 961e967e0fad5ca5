"""A smoke run of the benchmark: it runs, and every byte it moved is right (times are reported by
the benchmark itself, never asserted in a test)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_runs_and_verifies_every_byte():
    out = subprocess.run([sys.executable, "-m", "te.bench", "--rounds", "2", "--iters", "40", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["bench"] for r in rows] == ["write-4k", "get-ranges-121"]
    assert rows[1]["ranges"] == 121
    assert all(r["mismatched_bytes"] == 0 for r in rows)
    assert all(r["python_ns"] > 0 and r["rust_ns"] > 0 for r in rows)
