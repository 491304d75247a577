"""Trust, for processes and files: the scheduler signals only what it can prove it started, ends
what escapes a command's group but keeps its marker, writes files without following planted links,
and never blocks on a service manager that does not read."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys

from test_cli import anarchon


def test_crontab_given_a_database_file_says_so_in_one_line(tmp_path):
    """`crontab jobs.db` (the arguments swapped): one line naming --db, exit 2, nothing written."""
    db = tmp_path / "jobs.db"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("CREATE TABLE t (x)")
    before = db.read_bytes()
    for args in (["--db", str(tmp_path / "other.db"), "crontab", str(db)], ["crontab", "--check", str(db)]):
        done = anarchon(*args)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        assert "looks like a database" in done.stderr and f"--db {db}" in done.stderr, done.stderr
    assert db.read_bytes() == before and not (tmp_path / "other.db").exists()
