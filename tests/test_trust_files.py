"""Files the scheduler must not trust (issue #23): a database, its -wal and -shm, the lease board and
the liveness directory that another user owns or that users other than the owner may write; a
foreign SQLite file; ``:memory:``; a directory given as the file; -wal and -shm deleted under a
running process; lease boards left behind.

Another user is the real user ``nobody`` (``setpriv``), so these tests need root (CI runs as root).
"""

import asyncio
import hashlib
import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import QUIET, run, stop_processes, wait_for

import anarchon_lite as al
from anarchon_lite import Scheduler, StoreError

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
NOBODY = 65534

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="acting as the user nobody needs root and setpriv"
)


def as_nobody(script: str) -> None:
    """Run a shell script as the user nobody (group nogroup), with umask 0."""
    subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c", f"umask 0; {script}"],
        check=True,
    )


@pytest.fixture
def sticky():
    """A directory like /tmp: every user may write it, sticky; removed (with what nobody left) after."""
    path = tempfile.mkdtemp(prefix="anarchon-trust-")
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def board_dir(monkeypatch):
    """A lease board directory of the test's own, sticky and writable by every user, as /dev/shm is."""
    path = tempfile.mkdtemp(prefix="anarchon-trust-boards-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.chmod(path, 0o1777)
    monkeypatch.setenv("ANARCHON_BOARD_DIR", path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def declared(db, **kw):
    s = Scheduler(db, poll=0.02, **kw)
    s.every("job", "24h", lambda ctx: None, offset=QUIET)
    return s


def make_file(db):
    """A good database file of ours at ``db``, closed (SQLite removes its -wal and -shm)."""
    s = declared(db)
    run(s.history())
    s.close()


def refused(db, **kw):
    """The StoreError a scheduler on ``db`` starts with."""
    with pytest.raises(StoreError) as info:
        run(declared(db, **kw).run())
    return info.value


def cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "anarchon_lite", *args], check=False, capture_output=True, text=True, timeout=60, env=env
    )


# -- the database file, its -wal and -shm ------------------------------------------------------------


# (file ownership and modes are the SQLite file's: PostgreSQL has no file)
@pytest.mark.sqlite_only
@needs_root
def test_an_empty_world_writable_file_another_user_made_in_a_sticky_directory_is_refused(sticky, store):
    """The issue's case: nobody makes an empty jobs.db that every user may write, in /tmp; root's
    scheduler and the command line refuse it in one line naming the file and the rule, and write
    nothing to it (nor a -wal or -shm beside it)."""
    db = os.path.join(sticky, "jobs.db")
    as_nobody(f": > {db}")
    error = refused(db)
    assert error.path == db and "owned by uid 65534 (nobody)" in str(error) and "refused" in str(error)
    result = cli("--db", db, "pause", "job")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and db in result.stderr and "owned by uid 65534" in result.stderr
    assert os.path.getsize(db) == 0 and sorted(os.listdir(sticky)) == ["jobs.db"]


@pytest.mark.sqlite_only  # (file modes are the SQLite file's)
@needs_root
@pytest.mark.parametrize(
    ("mode", "rule"), [(0o666, "may be written by every user"), (0o660, "may be written by its group, gid 0")]
)
def test_a_file_of_ours_that_others_may_write_is_refused(tmp_path, store, mode, rule):
    db = str(tmp_path / "jobs.db")
    make_file(db)  # a good file of ours
    os.chmod(db, mode)
    error = refused(db)
    assert error.path == db and rule in str(error)


@pytest.mark.sqlite_only  # (file ownership is the SQLite file's)
@needs_root
def test_shared_group_trusts_a_file_of_another_user_in_a_group_of_ours(tmp_path, store):
    """An app user and a deploy user share a group: with ``shared_group`` a file that another user
    owns, whose group is one of this process's and that the group may write, is used; one that
    every user may write never is; without the option, the same file is refused."""
    db = str(tmp_path / "jobs.db")
    make_file(db)
    os.chown(db, NOBODY, os.getegid())
    os.chmod(db, 0o660)
    assert "owned by uid 65534 (nobody)" in str(refused(db))
    s = declared(db, shared_group=True)
    assert run(s.trigger("job")) > 0
    s.close()
    result = cli("--db", db, "--shared-group", "pause", "job")
    assert result.returncode == 0, result.stderr
    os.chmod(db, 0o666)
    assert "may be written by every user" in str(refused(db, shared_group=True))


@pytest.mark.sqlite_only  # (the -wal and -shm files are SQLite's)
@needs_root
@pytest.mark.parametrize("suffix", ["-wal", "-shm"])
@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_wal_or_shm_file_another_user_made_is_refused(sticky, store, suffix, kind):
    """Our own good file in /tmp, and beside it a -wal or -shm that nobody made (a file every user
    may write, or a link to a file of root's): refused, naming it; the link's target is untouched."""
    db = os.path.join(sticky, "jobs.db")
    make_file(db)
    assert sorted(os.listdir(sticky)) == ["jobs.db"]  # (SQLite removed them when the file was closed)
    victim = os.path.join(sticky, "precious")
    with open(victim, "w") as handle:
        handle.write("root's")
    as_nobody(f": > {db}{suffix}" if kind == "file" else f"ln -s {victim} {db}{suffix}")
    error = refused(db)
    assert error.path == db + suffix and f"the database's {suffix} file" in str(error)
    assert ("owned by uid 65534" if kind == "file" else "is a symbolic link") in str(error)
    with open(victim) as handle:
        assert handle.read() == "root's"


@pytest.mark.sqlite_only  # (a path of the file system)
@needs_root
def test_a_database_path_linked_by_another_user_in_a_sticky_directory_is_not_followed(sticky, store, tmp_path):
    """nobody plants jobs.db in /tmp as a link to where root's file would be: nothing is created
    there (the kernel's protected_symlinks rule)."""
    target = str(tmp_path / "made-by-the-link.db")
    db = os.path.join(sticky, "jobs.db")
    as_nobody(f"ln -s {target} {db}")
    assert "symbolic link owned by uid 65534 (nobody)" in str(refused(db))
    assert not os.path.exists(target)


@pytest.mark.sqlite_only  # (the liveness directory is the SQLite store's)
@needs_root
@pytest.mark.parametrize("mode", ["700", "777"])
def test_a_liveness_directory_another_user_made_is_refused(sticky, store, mode):
    db = os.path.join(sticky, "jobs.db")
    make_file(db)
    as_nobody(f"mkdir -m {mode} {db}-live")
    error = refused(db)
    assert error.path == db + "-live" and "the liveness directory is owned by uid 65534" in str(error)


@pytest.mark.sqlite_only  # (the liveness directory is the SQLite store's)
@needs_root
def test_a_liveness_directory_of_ours_that_every_user_may_write_is_refused(tmp_path, store):
    db = str(tmp_path / "jobs.db")
    os.mkdir(db + "-live")
    os.chmod(db + "-live", 0o777)
    assert "the liveness directory may be written by every user" in str(refused(db))


# -- a file that is not ours, :memory:, a directory --------------------------------------------------


def _app_db(path, version):
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, title TEXT)")  # (a name of ours, by chance)
    conn.execute("INSERT INTO users (name) VALUES ('ada')")
    conn.execute(f"PRAGMA user_version = {version}")
    conn.commit()
    conn.close()


def _digest(path):
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


@pytest.mark.sqlite_only  # (an SQLite file of another application)
@pytest.mark.parametrize("version", [0, 3])
def test_another_applications_sqlite_file_is_refused_before_anything_is_written(tmp_path, store, version):
    """An application's own file given by mistake (rollback journal, tables of its own, a schema
    version of its own): refused in one line, byte for byte unchanged, still in its journal mode."""
    db = str(tmp_path / "app.db")
    _app_db(db, version)
    before = _digest(db)
    error = refused(db)
    assert error.path == db and "not an anarchon_lite database" in str(error) and "users" in str(error)
    assert "\n" not in str(error)
    result = cli("--db", db, "pause", "job")
    assert result.returncode == 2 and "not an anarchon_lite database" in result.stderr
    assert _digest(db) == before and sorted(os.listdir(tmp_path)) == ["app.db"]
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    conn.close()


@pytest.mark.sqlite_only  # (a file whose creation stopped: SQLite's WAL header, no schema yet)
def test_a_file_whose_creation_stopped_before_its_schema_is_used(tmp_path, store):
    db = str(tmp_path / "jobs.db")
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.close()
    s = declared(db)
    assert run(s.trigger("job")) > 0
    s.close()


@pytest.mark.sqlite_only  # (":memory:" is an SQLite name)
def test_memory_is_refused_at_once_and_makes_no_file(tmp_path, monkeypatch, store):
    """What an APScheduler user tries first in a test: refused at the first use of the store, in
    one line (declaring jobs on it opens nothing); no file named ``:memory:`` is made."""
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    with pytest.raises(StoreError, match=":memory:: not supported"):
        run(declared(":memory:").run())
    with pytest.raises(StoreError, match=":memory:: not supported"):
        run(Scheduler(":memory:").history())
    assert time.monotonic() - started < 2.0 and os.listdir(tmp_path) == []
    result = cli("--db", ":memory:", "crontab", os.devnull)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and ":memory:: not supported" in result.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.sqlite_only  # (a path of the file system)
@pytest.mark.parametrize("command", ["status", "pause"])
def test_a_directory_given_as_the_database_says_so(tmp_path, store, command):
    result = cli("--db", str(tmp_path), command, *([] if command == "status" else ["job"]))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"{tmp_path}: is a directory, not a database file" in result.stderr and "I/O" not in result.stderr
    assert "is a directory" in str(refused(str(tmp_path)))


# -- the lease board ----------------------------------------------------------------------------------


def _board_path(db, directory):
    status = os.stat(db)
    board = al._Board.of(directory, (status.st_dev, status.st_ino), al._this_owner("").boot_id)
    assert board is not None
    return board.path


@pytest.mark.sqlite_only  # (the lease board is the SQLite store's)
@needs_root
def test_a_lease_board_another_user_made_is_refused_and_leases_renewed_in_the_file(tmp_path, board_dir, caplog, store):
    """nobody pre-creates the board (its name is computable): root's scheduler says so at ERROR,
    once, naming it and the rule, and renews in the file: its run keeps its lease past the claim's."""
    db = str(tmp_path / "jobs.db")
    make_file(db)
    board = _board_path(db, board_dir)
    as_nobody(f": > {board}")

    async def main():
        s = Scheduler(db, poll=0.02)
        done = asyncio.Event()
        attempts = []

        async def work(ctx):
            attempts.append(ctx.attempt)
            await ctx.signal.run(done.wait())

        s.every("work", "24h", work, offset=QUIET, lease="1s")
        async with s:
            await s.trigger("work")
            await wait_for(lambda: attempts, message="the run to start")
            renewed = s._loop.heartbeats.lateness.samples
            await wait_for(lambda: len(renewed) >= 4, message="four renewals (two leases)")
            done.set()
            await wait_for(lambda: finished(s), message="the record")
        assert attempts == [1]

    async def finished(s):
        return [r.status for r in await s.history("work")] == ["succeeded"]

    with caplog.at_level(logging.DEBUG, logger="anarchon_lite"):
        run(main())
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len([m for m in errors if board in m]) >= 1, errors
    assert all("owned by uid 65534 (nobody)" in m and "renewed in the database file" in m for m in errors), errors
    assert os.path.getsize(board) == 0 and not os.path.exists(board + "-wal")


@pytest.mark.sqlite_only  # (the lease board is the SQLite store's)
def test_the_lease_board_is_removed_when_its_last_member_leaves(tmp_path, board_dir, store):
    """Two schedulers on one file share one board: it stays while one runs, and goes, -wal and
    -shm too, when the last one stops and closes."""
    db = str(tmp_path / "jobs.db")

    async def main():
        a, b = declared(db, instance="a"), declared(db, instance="b")
        async with a:
            async with b:
                board = _board_path(db, board_dir)
                assert os.path.exists(board)
            b.close()
            assert os.path.exists(board)  # a is still a member
        a.close()
        return board

    board = run(main())
    assert os.listdir(board_dir) == [], board


# -- -wal and -shm deleted under a running process -----------------------------------------------------


def _events(path):
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.endswith("\n")]


def _wait(what, condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.sqlite_only  # (the files of an SQLite database)
def test_the_files_are_compared_at_most_every_so_often_and_at_once_when_a_name_changes(tmp_path, store):
    """A busy process looks several times an occurrence; each look compared the files at the path
    with those opened (three stat calls). Now at most every ``_LOST_EVERY``, and at once when the
    directory watch holds news of one of the database's names made, renamed or deleted: also while
    the watch is held (changes told within 0.5 s of a read wait for it), when the loop does not
    read it, and the look that follows a release comes before the loop has."""
    db = str(tmp_path / "jobs.db")

    async def main():
        made = Scheduler(db)
        await made.status()  # (the file made)
        made.close()
        woke = asyncio.Event()
        changes = al._SQLiteChanges(db, al.Clock(), asyncio.get_running_loop(), woke.set, False, "t")
        try:
            changes._LOST_EVERY = 3600.0  # (only a name changing makes it compare again)
            compared = []
            file_changed = changes._store.file_changed
            changes._store.file_changed = lambda: compared.append(1) or file_changed()
            assert [changes.lost() for _ in range(100)] == [None] * 100
            assert len(compared) == 1
            changes.hold()
            os.unlink(db)
            assert changes.lost() == f"the database file {db} was deleted while in use"
            assert len(compared) == 2
            changes.release()
            await wait_for(woke.is_set, message="the change told after the look, as the watch would")
        finally:
            changes.close()

    run(main())


@pytest.mark.sqlite_only  # (the -wal and -shm files are SQLite's)
def test_wal_and_shm_deleted_under_a_running_process_split_nothing(tmp_path, store):
    """``rm jobs.db-wal jobs.db-shm`` under a running process, then a second process on the path:
    the first says so at ERROR (naming the file), writes its WAL back and opens the path again, so
    the two share one -wal and -shm; every 500 ms occurrence runs once."""
    db, events = str(tmp_path / "jobs.db"), str(tmp_path / "events.jsonl")
    procs, logs = [], []

    def start():
        log = open(tmp_path / f"worker{len(procs)}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, WORKER, db, events, "every"], stderr=log))
        pid = procs[-1].pid
        _wait("the worker ready", lambda: any(e["event"] == "ready" and e["pid"] == pid for e in _events(events)))

    def runs_after(moment):
        return [e for e in _events(events) if e["event"] == "run" and e["t"] > moment]

    try:
        start()
        _wait("two runs", lambda: len(runs_after(0)) >= 2)
        os.unlink(db + "-wal")
        os.unlink(db + "-shm")
        deleted = time.time()
        _wait("two runs after the deletion", lambda: len(runs_after(deleted)) >= 2)
        start()
        second = time.time()
        _wait("six runs with two processes", lambda: len(runs_after(second)) >= 6)
        stop_processes(procs)
        assert [p.returncode for p in procs] == [0, 0]
    finally:
        stop_processes(procs, signal.SIGKILL)
        for log in logs:
            log.close()
    slots = [e["slot"] for e in _events(events) if e["event"] == "run"]
    assert len(slots) == len(set(slots)), f"an occurrence ran twice: {sorted(slots)}"
    assert f"the -wal file of the database {db} was deleted while in use" in (tmp_path / "worker0.log").read_text()


@pytest.mark.sqlite_only  # (the -wal and -shm files are SQLite's)
@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_wal_file_deleted_or_replaced_is_told_at_error_and_the_file_opened_again(tmp_path, caplog, store, how):
    """The running attempt is aborted (its run may be claimed by a process on the new files), and
    the scheduler carries on in the file, where nothing it wrote before is lost: the records
    written only to the WAL whose name went are written back into the file first."""
    db = str(tmp_path / "jobs.db")

    async def main():
        s = Scheduler(db, poll=0.02)
        started, reasons = [], []

        @s.every("tick", "100ms")
        async def tick(ctx):
            return None

        @s.every("long", "24h", offset=QUIET, lease="2s")
        async def long(ctx):
            started.append(ctx.attempt)
            try:
                await ctx.signal.wait()
                ctx.signal.throw_if_aborted()
            except al.LeaseLost:
                reasons.append(str(ctx.signal.reason))
                raise

        async with s:
            slot = await s.trigger("long")
            await wait_for(lambda: started, message="the long run to start")
            await wait_for(lambda: ticks(s, 3), message="three ticks")
            before = await ticks(s, 3)
            if how == "deleted":
                os.unlink(db + "-wal")
            else:
                os.close(os.open(db + "-wal.new", os.O_WRONLY | os.O_CREAT, 0o600))
                os.replace(db + "-wal.new", db + "-wal")
            await wait_for(lambda: reasons, message="the running attempt to be aborted")
            await wait_for(lambda: ticks(s, len(before) + 3), message="ticks in the file opened again")
            assert set(before) <= set(await ticks(s, 0))
            assert [(r.slot, r.attempt) for r in await s.history("long")] == [(slot, 1)]
        conn = sqlite3.connect(db)
        try:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        finally:
            conn.close()

    async def ticks(s, count):
        found = [r.slot for r in await s.history("tick", limit=1000) if r.status == "succeeded"]
        return found if len(found) >= count else None

    with caplog.at_level(logging.ERROR, logger="anarchon_lite"):
        run(main())
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(f"the -wal file of the database {db} was {how} while in use" in m for m in errors), errors
