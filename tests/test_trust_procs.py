"""Trust, for processes and files: the scheduler signals only what it can prove it started, ends
what escapes a command's group but keeps its marker, writes files without following planted links,
and never blocks on a service manager that does not read."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys

from conftest import run, wait_for
from test_cli import ENV, anarchon, wait_until

from anarchon_lite import Scheduler


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


def test_the_metrics_file_is_written_without_following_a_planted_link(tmp_path):
    """Links planted in the metrics file's directory, at the temporary names an earlier version used
    (``PATH.<pid>.tmp``), at a guessable one and at PATH itself, all pointing at a file that must not
    change: the metrics land in PATH, a file of its own, and the target is untouched."""
    shared, target = tmp_path / "textfile", tmp_path / "root-only"
    shared.mkdir()
    target.write_text("not to be written\n")
    path = shared / "anarchon.prom"
    for name in (f"anarchon.prom.{os.getpid()}.tmp", "anarchon.prom.tmp", "anarchon.prom"):
        (shared / name).symlink_to(target)

    async def main():
        s = Scheduler(str(tmp_path / "jobs.db"), poll=0.02, metrics_file=str(path))
        s.every("ok", "1d", lambda ctx: None)
        async with s:
            await wait_for(
                lambda: not path.is_symlink() and "anarchon_job_running" in path.read_text(), message="metrics in PATH"
            )

    run(main())
    assert target.read_text() == "not to be written\n"
    assert "anarchon_job_running" in path.read_text() and not path.is_symlink()


def test_a_service_manager_that_does_not_read_never_stops_the_scheduler(tmp_path):
    """$NOTIFY_SOCKET names a datagram socket whose queue is full and that nobody reads: jobs keep
    running, the messages held back go out as one (READY=1 kept, the newest STATUS) once it reads,
    and SIGTERM ends the process promptly."""
    address, marks, crontab = str(tmp_path / "notify"), tmp_path / "marks", tmp_path / "crontab"
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(address)
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        for _ in range(100_000):
            filler.sendto(b"FILL=1", address)
    crontab.write_text(f"# name: tick\n@every 1s echo x >> {marks}\n")
    env = {**ENV, "NOTIFY_SOCKET": address, "WATCHDOG_USEC": "200000"}
    with open(tmp_path / "daemon.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "anarchon_lite", "--db", str(tmp_path / "jobs.db"), "crontab", str(crontab)],
            stdout=log,
            stderr=log,
            env=env,
        )
    try:
        wait_until(lambda: marks.exists() and len(marks.read_text().split()) >= 3, what="3 runs")
        manager.settimeout(0.1)
        received: list[bytes] = []

        def ready() -> bool:
            with contextlib.suppress(socket.timeout):
                received.append(manager.recv(4096))
            return any(b"READY=1" in m for m in received)

        wait_until(ready, what="READY=1, held back")
        held = next(m for m in received if b"READY=1" in m).decode().splitlines()
        assert held[0] == "READY=1" and sum(line.startswith("STATUS=") for line in held) == 1, held
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        manager.close()
        filler.close()
