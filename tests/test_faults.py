"""Store faults under a running scheduler. On both stores, injected through the store interface
(``conftest.faulty``, handed in as ``Scheduler(store=...)``): renewals failing for part of a lease, checkpoint writes failing. On the SQLite
file, the faults only a file has: a lock held past the busy timeout, a full disk, a read-only
location, the file deleted or replaced, and a file of a previous schema version.

Each fault gives an error that names the store, damages nothing already stored, and the scheduler
carries on once the fault goes away.
"""

import asyncio
import contextlib
import logging
import os
import sqlite3
import subprocess
import threading
import time

import pytest
from conftest import QUIET, faulty, run, wait_for

import anarchon_lite as al
from anarchon_lite import LeaseLost, Scheduler, StoreError

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def make(db, **kw):
    kw.setdefault("poll", 0.02)
    return Scheduler(db, **kw)


async def records(s, job):
    return [(r.slot, r.attempt, r.status) for r in reversed(await s.history(job, limit=1000))]


async def finished(s, job):
    """The records of ``job``, once there is one and none is still running."""
    found = await records(s, job)
    return found if found and all(status != "running" for _, _, status in found) else None


def integrity(path):
    conn = sqlite3.connect(path)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


class LockHolder:
    """Another connection that takes the write lock and holds it until released."""

    def __init__(self, path):
        self._path = path
        self._taken, self._release = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._hold, daemon=True)

    def _hold(self):
        conn = sqlite3.connect(self._path, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            self._taken.set()
            self._release.wait(30)
            conn.execute("ROLLBACK")
        finally:
            conn.close()

    def __enter__(self):
        self._thread.start()
        assert self._taken.wait(10), "could not take the write lock"
        return self

    def __exit__(self, *exc_info):
        self._release.set()
        self._thread.join(10)


class Outage:
    """A fault of the store, through its interface: while ``on``, the wrapped methods raise a
    transient ``StoreError`` naming the store; ``calls`` counts those that went through."""

    def __init__(self, where, text="the store cannot be reached (injected)"):
        self.where, self.text, self.on = where, text, False
        self.failed, self.calls = 0, 0

    def __call__(self, original, *args, **kwargs):
        if self.on:
            self.failed += 1
            raise StoreError(self.where, self.text, transient=True)
        result = original(*args, **kwargs)
        self.calls += 1
        return result


def test_renewals_failing_for_half_a_lease_keep_it(store, caplog):
    """Every renewal of the owner fails for 1.5 s of the run's 3 s lease, while a second scheduler
    watches the run: the run keeps its lease and succeeds at attempt 1, never taken over; each
    failure is logged naming the store, and renewals land again once the fault is gone."""
    outage = Outage(Scheduler(store).path)

    async def main():
        a = make(store, instance="a", store=faulty(renew_all=outage))
        b = make(store, instance="b")
        done = asyncio.Event()
        seen = []

        async def work(ctx):
            seen.append((ctx.instance, ctx.attempt))
            await ctx.signal.run(done.wait())

        for s in (a, b):
            s.every("work", "24h", work, offset=QUIET, lease="3s")
        async with a:
            await a.trigger("work")
            await wait_for(lambda: len(seen) == 1, message="the run to start")
            async with b:
                await wait_for(lambda: outage.calls >= 1, message="a renewal")
                outage.on = True
                await asyncio.sleep(1.5)  # the fault lasts this long; nothing waits on it
                outage.on = False
                failed, renewed = outage.failed, outage.calls
                # renewals land again (two rounds: b watches the run meanwhile)
                await wait_for(lambda: outage.calls >= renewed + 2, message="renewals after the fault")
                done.set()
                await wait_for(lambda: finished(a, "work"), message="the record")
                assert [(at, st) for _, at, st in await records(a, "work")] == [(1, "succeeded")]
        assert seen == [("a", 1)] and failed >= 1

    with caplog.at_level(logging.WARNING, logger="anarchon_lite"):
        run(main())
    renewals = [r.getMessage() for r in caplog.records if "lease renewal failed" in r.getMessage()]
    assert renewals and all(outage.where in m and "injected" in m for m in renewals), renewals


def declare_writers(s, value):
    """The full-disk tests' jobs: ``first`` saves a small checkpoint; ``export``, once ``go`` is set,
    saves ``value`` until a write succeeds, keeping each failure in ``errors``. Returns (go, errors)."""
    go, errors = asyncio.Event(), []

    @s.every("first", "24h", offset=QUIET)
    async def first(ctx):
        await ctx.checkpoint.set({"kept": True})

    @s.every("export", "24h", offset=QUIET, lease="2s")
    async def export(ctx):
        await go.wait()
        while True:
            try:
                await ctx.checkpoint.set(value)
                return
            except StoreError as exc:
                errors.append(exc)
                await ctx.signal.sleep(0.05)

    return go, errors


def test_a_failing_checkpoint_write_names_the_store_and_the_attempt_succeeds_once_it_works(store):
    """A handler's checkpoint writes fail (as on a full disk) with an error naming the store; earlier
    records are intact, and once the store works again the same attempt saves and succeeds."""
    outage = Outage(Scheduler(store).path, "disk full (injected)")

    async def main():
        s = make(store, store=faulty(checkpoint_write=outage))
        go, errors = declare_writers(s, "x" * 200_000)

        async with s:
            await s.trigger("first")
            await wait_for(lambda: finished(s, "first"), message="the first record")
            slot = await s.trigger("export")
            await wait_for(lambda: s._loop.runner.running, message="the export to start")
            outage.on = True
            go.set()
            await wait_for(lambda: len(errors) >= 3, message="failed writes")
            outage.on = False
            await wait_for(lambda: finished(s, "export"), message="the export's record")
            assert [(at, st) for _, at, st in await records(s, "export")] == [(1, "succeeded")]
            assert await s.checkpoints.get("export", slot) == "x" * 200_000
            assert [st for _, _, st in await records(s, "first")] == ["succeeded"]
        assert all(e.path == outage.where and "disk full" in str(e) for e in errors), errors

    run(main())


@pytest.mark.sqlite_only  # (SQLite's one write lock, and the lease board)
@pytest.mark.parametrize("board", [True, False], ids=["lease-board", "no-board"])
def test_lock_held_past_the_busy_timeout_keeps_the_lease(db, caplog, monkeypatch, board):
    """Writes wait 0.3 s for the lock, which another connection holds for 1.5 s, inside the run's
    3 s lease: the run keeps its lease and succeeds at attempt 1, and a second scheduler does not
    take it over. On the lease board renewals never need the file's lock; without one they fail
    and are retried."""
    if not board:
        monkeypatch.setenv("ANARCHON_BOARD_DIR", "")

    async def main():
        a, b = make(db, instance="a", busy_timeout=0.3), make(db, instance="b", busy_timeout=0.3)
        done = asyncio.Event()
        seen = []

        async def work(ctx):
            seen.append((ctx.instance, ctx.attempt))
            await ctx.signal.run(done.wait())

        a.every("work", "24h", work, offset=QUIET, lease="3s")
        b.every("work", "24h", work, offset=QUIET, lease="3s")
        async with a:
            await a.trigger("work")
            await wait_for(lambda: len(seen) == 1, message="the run to start")
            async with b:
                await asyncio.get_running_loop().run_in_executor(None, hold_lock, db, 1.5)
                renewed = a._loop.heartbeats.lateness.samples
                before = len(renewed)
                # renewals land again once the lock is free (two rounds: b watches the run meanwhile)
                await wait_for(lambda: len(renewed) >= before + 2, message="renewals after the lock")
                done.set()
                await wait_for(lambda: finished(a, "work"), message="the record")
                assert [(at, st) for _, at, st in await records(a, "work")] == [(1, "succeeded")]
        assert seen == [("a", 1)]

    with caplog.at_level(logging.WARNING, logger="anarchon_lite"):
        run(main())
    renewals = [r.getMessage() for r in caplog.records if "lease renewal failed" in r.getMessage()]
    if board:
        assert renewals == []
    else:
        assert renewals and all(db in m and "locked" in m for m in renewals), renewals
    assert integrity(db) == "ok"


def hold_lock(path, seconds):
    with LockHolder(path):
        time.sleep(seconds)  # the fault lasts this long; nothing waits on it


class PageCap:
    """A full disk: every connection the store opens is capped at the file's size when ``fill`` is
    called (``PRAGMA max_page_count``), until ``free``."""

    def __init__(self, monkeypatch):
        self.cap = None
        self.conns = []
        prepare = al._SQLiteStore._prepare

        def capped(store, conn):
            prepare(store, conn)
            self.conns.append(conn)
            if self.cap is not None:
                conn.execute(f"PRAGMA max_page_count = {self.cap}")

        monkeypatch.setattr(al._SQLiteStore, "_prepare", capped)

    def _apply(self, cap):
        self.cap = cap
        for conn in self.conns:
            with contextlib.suppress(sqlite3.ProgrammingError):  # closed since
                conn.execute(f"PRAGMA max_page_count = {cap}")

    def fill(self):
        live = next(c for c in reversed(self.conns) if _open(c))
        self._apply(live.execute("PRAGMA page_count").fetchone()[0])

    def free(self):
        self._apply(1_073_741_823)


def _open(conn):
    try:
        conn.execute("SELECT 1")
        return True
    except sqlite3.ProgrammingError:
        return False


@pytest.mark.sqlite_only  # (the file's page cap, SQLite's own "disk full" (on both stores: the injected one above))
def test_full_disk_while_running(db, monkeypatch):
    """A handler's checkpoint write fails with an error naming the file while the disk is full;
    earlier records are intact, and once space returns the same attempt saves and succeeds."""
    disk = PageCap(monkeypatch)
    big = "x" * 200_000  # needs pages the capped file does not have

    async def main():
        s = make(db)
        go, errors = declare_writers(s, big)

        async with s:
            await s.trigger("first")
            await wait_for(lambda: finished(s, "first"), message="the first record")
            slot = await s.trigger("export")
            await wait_for(lambda: s._loop.runner.running, message="the export to start")
            disk.fill()
            go.set()
            await wait_for(lambda: len(errors) >= 3, message="failed writes")
            disk.free()
            await wait_for(lambda: finished(s, "export"), message="the export's record")
            assert [(at, st) for _, at, st in await records(s, "export")] == [(1, "succeeded")]
            assert await s.checkpoints.get("export", slot) == big
            assert [st for _, _, st in await records(s, "first")] == ["succeeded"]
        assert all(e.path == db and "disk full" in str(e) for e in errors), errors

    run(main())
    assert integrity(db) == "ok"


@contextlib.contextmanager
def read_only_directory(tmp_path):
    """A directory that even root cannot write: a read-only bind mount where mounting is allowed,
    else (not root) permission bits. Yields (directory, make_writable)."""
    source, view = tmp_path / "source", tmp_path / "view"
    source.mkdir()
    view.mkdir()
    if os.geteuid() != 0:
        os.chmod(source, 0o500)
        try:
            yield source, lambda: os.chmod(source, 0o700)
        finally:
            os.chmod(source, 0o700)
        return
    mounted = (
        subprocess.run(["mount", "--bind", str(source), str(view)], check=False, capture_output=True).returncode == 0
    )
    if not mounted:
        pytest.fail("as root, a read-only location needs a bind mount, and mount was refused")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True, capture_output=True)
        yield view, lambda: subprocess.run(["mount", "-o", "remount,bind,rw", str(view)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False, capture_output=True)


@pytest.mark.sqlite_only  # (a directory of the file system)
def test_read_only_directory_names_the_file_and_works_once_writable(tmp_path):
    with read_only_directory(tmp_path) as (directory, make_writable):
        path = str(directory / "jobs.db")
        s = make(path)
        s.every("job", "24h", lambda ctx: None, offset=QUIET)
        with pytest.raises(StoreError) as info:
            run(s.run())
        assert info.value.path == path and path in str(info.value)
        assert not os.path.exists(path)
        make_writable()
        assert run(s.trigger("job")) > 0  # the same scheduler object, once the fault is gone
        assert [r.status for r in run(s.history("job"))] == []
        assert os.stat(path).st_mode & 0o777 == 0o600


@pytest.mark.sqlite_only  # (the file deleted (a lost lock session: test_postgres.py))
def test_deleted_file_is_recreated_and_the_scheduler_carries_on(db, caplog):
    """The file is deleted under a running scheduler: it says so naming the file, aborts the attempt
    that was running on it (its run is gone), and carries on with a new file at the same path."""

    async def main():
        s = make(db)
        started, reasons = [], []

        @s.every("long", "24h", offset=QUIET, lease="2s")
        async def long(ctx):
            started.append(ctx.attempt)
            try:
                await ctx.signal.wait()
                ctx.signal.throw_if_aborted()
            except LeaseLost:
                reasons.append(str(ctx.signal.reason))
                raise

        @s.every("tick", "100ms")
        async def tick(ctx):
            return None

        async with s:
            await s.trigger("long")
            await wait_for(lambda: started, message="the long run to start")
            os.unlink(db)  # as ``rm jobs.db`` does: its -wal and -shm stay
            await wait_for(lambda: reasons, message="the running attempt to be aborted")
            await wait_for(lambda: os.path.exists(db), message="a new file")
            await wait_for(
                lambda: any(r.status == "succeeded" for r in run_history(s, "tick")), message="runs in the new file"
            )
        assert "deleted" in reasons[0] and db in reasons[0]

    with caplog.at_level(logging.ERROR, logger="anarchon_lite"):
        run(main())
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(db in m and "deleted" in m for m in errors), errors
    assert integrity(db) == "ok"


def run_history(s, job):
    """History read synchronously through a store of its own (the caller's loop is busy)."""
    store = al._SQLiteStore(s.path)
    try:
        return store.history(job, 100)
    finally:
        store.close()


@pytest.mark.sqlite_only  # (the file replaced by a rename)
def test_replaced_file_is_followed(tmp_path, caplog):
    """The file is replaced (a restore from a copy, by rename): the scheduler switches to the new
    file, registers its jobs there, and runs them in it; the old file is left as it was."""
    db, other = str(tmp_path / "jobs.db"), str(tmp_path / "restored.db")
    run(make(other).history())  # an empty, valid file to restore

    async def main():
        s = make(db)

        @s.every("tick", "100ms")
        async def tick(ctx):
            return None

        async with s:
            await wait_for(lambda: run_history(s, "tick"), message="runs in the first file")
            os.link(db, str(tmp_path / "old.db"))  # keep the old file, under another name
            os.replace(other, db)  # one atomic rename: the path never goes missing
            # (nothing else may open the path until the scheduler has let go of the old file: the
            # old -wal and -shm files keep their names, and a new connection would read them)
            await wait_for(lambda: replaced(caplog, db), message="the replacement to be noticed")
            await wait_for(lambda: run_history(s, "tick"), message="runs in the restored file")

    with caplog.at_level(logging.ERROR, logger="anarchon_lite"):
        run(main())
    assert integrity(db) == "ok" and integrity(str(tmp_path / "old.db")) == "ok"


def replaced(caplog, db):
    return any(db in r.getMessage() and "replaced" in r.getMessage() for r in caplog.records)


@pytest.mark.sqlite_only  # (a file of schema version 5, written as SQLite)
def test_a_file_of_the_previous_version_is_read_by_status_without_being_migrated(db):
    """``status`` (read-only) of the new release on a file of the release before it, whose
    processes still run: it reads it as it is, tells nothing undeclared (those processes record no
    declarations), and leaves the version alone."""
    from anarchon_lite import Control

    async def make_one():
        s = make(db)
        s.every("export", "24h", lambda ctx: None)
        async with s:
            await s.trigger("export")
            await wait_for(lambda: finished(s, "export"), message="a record")

    run(make_one())
    conn = sqlite3.connect(db, isolation_level=None)
    for statement in (  # (what versions 6 to 8 added, undone: a file of version 5)
        "DROP TRIGGER run_added",
        "DROP TRIGGER run_taken",
        "DROP TRIGGER history_ended",
        "DROP TRIGGER history_added",
        "DROP TRIGGER history_changed",
        "ALTER TABLE jobs DROP COLUMN last_status",
        "ALTER TABLE jobs DROP COLUMN last_at",
        "DROP TABLE declarations",
        "ALTER TABLE instances DROP COLUMN host",
        "ALTER TABLE instances DROP COLUMN declares",
        "INSERT INTO instances (instance, pid, start, namespace, boot_id, started_at) VALUES ('old', ?, NULL, NULL, NULL, 0)",
        "PRAGMA user_version = 5",
    ):
        conn.execute(statement, (os.getpid(),) if "?" in statement else ())
    conn.close()
    with Control(db, read_only=True) as control:
        (job,) = control.status()
        assert (job.name, job.state, job.last_status) == ("export", "active", "succeeded")
        assert [(p.instance, p.jobs) for p in control.processes()] == [("old", None)]
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 5
    finally:
        conn.close()


@pytest.mark.sqlite_only  # (a file of schema version 1 (a PostgreSQL schema's: test_postgres.py))
def test_a_file_of_the_previous_schema_is_migrated_in_place(db, caplog):
    """A file written by schema version 1, with a job, its history and a checkpoint, is migrated to
    the current version by the first scheduler that opens it; everything in it is kept."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    with open(os.path.join(DATA, "schema_v1.sql")) as handle:
        conn.executescript(handle.read())
    day = int(time.time() // 86400 * 86400 * 1000)  # today's occurrence of the daily job, already run
    conn.execute(
        "INSERT INTO jobs (name, schedule, last_slot, next_slot) VALUES ('export', 'every 24h', ?, ?)",
        (day, day + 86_400_000),
    )
    conn.execute(
        "INSERT INTO history (job, slot, attempt, status, instance, started_at, finished_at) "
        "VALUES ('export', ?, 1, 'succeeded', 'old', ?, ?)",
        (day, day, day + 500),
    )
    conn.execute(
        "INSERT INTO checkpoints (job, slot, value, updated_at) VALUES ('export', ?, '800', ?)", (day, day + 500)
    )
    conn.close()

    async def main():
        s = make(db)
        seen = []

        @s.every("export", "24h")  # the old file's record is of today's midnight slot
        async def export(ctx):
            seen.append(await ctx.checkpoint.get())
            await ctx.checkpoint.set(1200)

        async with s:
            assert await s.checkpoints.get("export", day) == 800
            (job,) = await s.status()  # (the newest record, as the migration copied it to the job's row)
            assert (job.last_status, job.last_at) == ("succeeded", al._utc_from_ms(day))
            slot = await s.trigger("export")
            await wait_for(lambda: seen, message="a run on the migrated file")
            await wait_for(lambda: finished(s, "export"), message="its record")
        old, new = reversed(await s.history("export"))
        assert (old.slot, old.attempt, old.status, old.instance) == (day, 1, "succeeded", "old")
        assert (new.slot, new.status) == (slot, "succeeded")
        return slot

    with caplog.at_level(logging.INFO, logger="anarchon_lite"):
        slot = run(main())
    assert any("migrating the schema from version 1" in r.getMessage() and db in r.getMessage() for r in caplog.records)
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == al.SCHEMA_VERSION
        rows = conn.execute("SELECT slot, value, attempt FROM checkpoints ORDER BY slot").fetchall()
        assert rows == [(day, "800", None), (slot, "1200", 1)]
    finally:
        conn.close()
    assert integrity(db) == "ok"


@contextlib.contextmanager
def small_filesystem(tmp_path, size="4m"):
    """A filesystem of ``size`` of its own (tmpfs), so that the disk really fills up."""
    if os.geteuid() != 0:
        pytest.skip("a small filesystem of its own needs root (mount -t tmpfs); CI runs as root")
    directory = tmp_path / "small"
    directory.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], check=True)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def fill(directory):
    """Write a file until the filesystem is full; return its path."""
    path = directory / "ballast"
    with open(path, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError:
            pass
    return path


@pytest.mark.sqlite_only  # (the file's own file system filled)
def test_a_full_disk_backs_off_logs_little_and_recovers(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="anarchon_lite")
    with small_filesystem(tmp_path) as directory:
        db = str(directory / "jobs.db")

        async def main():
            s = Scheduler(db)  # woken by inotify, as in production: its own failed writes touch the WAL
            s.every("tick", "100ms", lambda ctx: None, overlap="allow", retries=3, retry_delay="100ms")
            async with s:
                await wait_for(lambda: s.history("tick", limit=5), message="runs before the disk fills")
                ballast = fill(directory)
                await wait_for(
                    lambda: any(r.levelno >= logging.ERROR for r in caplog.records), timeout=30, message="an error"
                )
                caplog.clear()
                cpu, started = time.process_time(), time.monotonic()
                await asyncio.sleep(3.0)  # a window to measure, not a wait for a condition
                cpu, window = time.process_time() - cpu, time.monotonic() - started
                lines = len(caplog.records)
                os.remove(ballast)
                freed = int(time.time() * 1000)

                async def ran_again():
                    return any(r.status == "succeeded" and r.slot > freed for r in await s.history("tick", limit=50))

                await wait_for(ran_again, timeout=30, message="runs after space returns")
            return cpu, window, lines

        cpu, window, lines = run(main(), timeout=120)
        assert cpu < 0.5 * window, (cpu, window)
        assert lines <= 12, [r.getMessage() for r in caplog.records]
        assert os.path.getsize(db + "-wal") <= 2 * al._WAL_LIMIT if os.path.exists(db + "-wal") else True
        assert integrity(db) == "ok"


@pytest.mark.sqlite_only  # (the file's own file system filled)
def test_a_scheduler_that_cannot_start_on_a_full_disk_says_so(tmp_path):
    with small_filesystem(tmp_path) as directory:
        fill(directory)
        db = str(directory / "jobs.db")
        s = Scheduler(db)
        s.every("tick", "1h", lambda ctx: None)
        with pytest.raises(StoreError) as info:
            run(s.run())
        assert info.value.path == db and "full" in str(info.value), str(info.value)


@pytest.mark.sqlite_only  # (a path that is a symbolic link, and inotify)
def test_a_symlinked_file_is_watched_where_it_really_is(tmp_path, monkeypatch):
    monkeypatch.setattr(al, "_CLOCK_CHECK", 60.0)  # only the file watch can wake it in time
    (tmp_path / "real").mkdir()
    (tmp_path / "links").mkdir()
    target, link = tmp_path / "real" / "jobs.db", tmp_path / "links" / "jobs.db"
    os.symlink(target, link)  # dangling: the file does not exist yet

    async def main():
        s = Scheduler(str(link))
        started = []
        s.every("job", "24h", lambda ctx: started.append(ctx.slot), offset=QUIET)
        async with s:
            assert os.stat(target).st_mode & 0o777 == 0o600  # created where the link points, owner-only
            await asyncio.sleep(0.3)  # idle now, waiting on the file watch
            slot = await Scheduler(str(link)).trigger("job")  # another process's write
            await wait_for(lambda: started == [slot], timeout=20, message="the trigger to wake the scheduler")

    run(main())


@pytest.mark.sqlite_only  # (a path that is a symbolic link)
def test_a_symlink_of_another_user_in_a_world_writable_directory_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("making a link owned by another user needs root; CI runs as root")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    victim = tmp_path / "precious"
    victim.write_text("not a database")
    link = shared / "jobs.db"
    os.symlink(victim, link)
    os.lchown(link, 12345, 12345)
    s = Scheduler(str(link))
    s.every("job", "1h", lambda ctx: None)
    with pytest.raises(StoreError, match="symbolic link owned by uid 12345"):
        run(s.run())
    assert victim.read_text() == "not a database"
    os.lchown(link, 0, 0)  # a link of root's own is followed (and this file is then refused as not SQLite)
    with pytest.raises(StoreError, match="not an SQLite database"):
        run(Scheduler(str(link)).history())
