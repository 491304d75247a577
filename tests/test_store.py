"""The store's contract on both stores (atomic claims, fencing, checkpoints, history, trigger, pause,
cancel, processes), then what only the SQLite file has: its schema and mode, errors that name the
file, locks, a full disk, the lease board and the liveness sockets."""

import asyncio
import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ManualClock, Process, needs_faketime, run, wait_for, wall_clock_ahead
from schedulers import backlog, count_records

import anarchon_lite as al
from anarchon_lite import Scheduler, StoreError

OWNER = "a"
OTHER = "b"


def declared(s):
    """``s`` with the job ``job`` declared."""
    s.register([al._Declared("job", "every 1h", 0, 3_600_000, "every 1h", "test")])
    return s


def sqlite_store(db, **kw):
    return declared(al._SQLiteStore(db, **kw))


@pytest.fixture
def process(store, clock):
    """One process on the test's store (SQLite, whose leases are on ``clock``, or PostgreSQL)."""
    p = Process(store, clock)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def s(process):
    """A store of that process, as its scheduler's backend opens it, with the job ``job`` declared."""
    return declared(process.open())


def claim_due(s, owner, expected=0, slot=1000):
    return s.claim_due(owner, slot, al._Due("job", expected, slot, slot + 1000, [], True, 1, 30))


# -- the contract, on both stores ----------------------------------------------------------------


def test_exactly_one_claim_wins_across_connections(process):
    declared(process.open())
    stores = [process.open() for _ in range(8)]
    results = []
    barrier = threading.Barrier(8)

    def contender(i):
        barrier.wait()
        results.append(claim_due(stores[i], f"p{i}"))

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(isinstance(r, al._Claim) for r in results) == 1
    assert results.count(al._NotClaimed.MOVED) == 7


def test_fencing_refuses_a_superseded_attempt(s):
    first = claim_due(s, OWNER)
    assert first.attempt == 1
    row = s.runs()[0]
    # b takes over (as if a's lease ran out)
    second = s.claim(row, OTHER, 30, 2000, 10, 1, "lease expired")
    assert second.attempt == 2
    assert s.renew_all("a", [first]) == [first]
    assert s.checkpoint_write("job", 1000, '"stale"', 0, (1, "a")) is False
    assert s.checkpoint_get("job", 1000, (1, "a"))[0] is False  # reads are fenced too
    assert s.checkpoint_get("job", 1000, (2, "b"))[0] is True
    assert s.report_progress(first, "a", (5, 10)) is None and s.runs()[0].progress_done is None
    assert s.set_process_group(first, "a", "[1]") is False and s.process_group("job", 1000) is None
    assert s.finish("a", al._End(first, "succeeded", None, 3000)) is False
    assert s.checkpoint_write("job", 1000, '"fresh"', 0, (2, "b")) is True
    assert s.finish("b", al._End(second, "succeeded", None, 3000)) is True
    assert s.checkpoint_get("job", 1000) == (True, '"fresh"')
    assert [(r.attempt, r.status) for r in reversed(s.history("job", 10))] == [(1, "interrupted"), (2, "succeeded")]
    # the row a saw is gone: its compare-and-set claim does nothing
    assert s.claim(row, OWNER, 30, 4000, 10, 1) is None


def test_a_renewed_lease_cannot_be_taken_over(process, s):
    claim = claim_due(s, OWNER)
    seen = s.runs()[0]
    if not process.postgres:  # (the renewal comes later on the lease clock: the server's moves by itself)
        process.backend._clock.advance(1.0)
    assert s.renew_all("a", [claim]) == []
    s.report_progress(claim, "a", (3, 10))
    assert s.claim(seen, OTHER, 30, 2000, 10, 1, "lease expired") is None
    assert s.runs()[0].progress_done == 3


def test_missed_records_and_watermark_are_one_transaction(s):
    missed = [(1000, None), (2000, "and 5 more")]
    assert s.claim_due(OWNER, 5000, al._Due("job", 0, 3000, 4000, missed, False, 1, 0)) is al._NotClaimed.RECORDED
    assert s.job("job").last_slot == 3000
    assert [(r.slot, r.status, r.error) for r in reversed(s.history("job", 10))] == [
        (1000, "missed", None),
        (2000, "missed", "and 5 more"),
    ]
    # a stale watermark writes nothing
    assert s.claim_due(OWNER, 5000, al._Due("job", 0, 3000, 4000, [(1000, None)], True, 1, 0)) is al._NotClaimed.MOVED


def test_a_lease_runs_out_on_the_stores_clock(process, s):
    """``lease_left`` counts down on the store's lease clock (the injected one on SQLite, the
    server's on PostgreSQL); a renewal gives the whole lease again."""
    claim = s.claim_due(OWNER, 1000, al._Due("job", 0, 1000, 2000, [], True, 1, 0.5))
    assert 0 < s.runs()[0].lease_left <= 0.5
    if process.postgres:
        deadline = time.monotonic() + 10
        while s.runs()[0].lease_left >= 0:
            assert time.monotonic() < deadline, "the lease never ran out"
            time.sleep(0.05)
    else:
        process.backend._clock.advance(0.6)
        assert s.runs()[0].lease_left < 0
    assert s.renew_all(OWNER, [claim]) == []  # nobody took it: still held
    assert 0 < s.runs()[0].lease_left <= 0.5


def test_checkpoints_are_saved_read_and_deleted_for_every_process(process, s):
    other = process.open()
    assert s.checkpoint_get("job", 1000) == (True, None)
    assert s.checkpoint_write("job", 1000, '{"at": 1}', 0, None) is True
    assert other.checkpoint_get("job", 1000) == (True, '{"at": 1}')  # visible once written
    assert other.checkpoint_write("job", 1000, '{"at": 2}', 0, None) is True
    assert s.checkpoint_get("job", 1000) == (True, '{"at": 2}')
    assert s.checkpoint_get("job", 2000) == (True, None)  # one checkpoint per (job, slot)
    assert s.checkpoint_write("job", 1000, None, 0, None) is True
    assert other.checkpoint_get("job", 1000) == (True, None)
    # a fenced write for an attempt that holds no run is refused
    assert s.checkpoint_write("job", 1000, '"x"', 0, (1, OWNER)) is False
    claim = claim_due(s, OWNER)
    assert s.checkpoint_write("job", 1000, '"mine"', 0, (claim.attempt, OWNER)) is True
    assert other.checkpoint_get("job", 1000, (claim.attempt, OWNER)) == (True, '"mine"')


def test_trigger_records_a_pending_run_at_the_next_free_millisecond(s):
    assert s.trigger("job", 5000) == 5000
    assert s.trigger("job", 5000) == 5001
    assert [(r.slot, r.state, r.attempt) for r in s.runs()] == [(5000, "pending", 0), (5001, "pending", 0)]
    with pytest.raises(al.JobNotFound):
        s.trigger("nope", 5000)
    row = s.runs()[0]
    claim = s.claim(row, OWNER, 30, 6000, 10, None)
    assert (claim.slot, claim.attempt) == (5000, 1)


def test_pause_and_resume_reach_every_process_and_resume_moves_the_watermark(process, s):
    other = process.open()
    assert s.set_paused("job", True, 10_000) is True
    assert other.job("job").paused == 1
    assert s.set_paused("job", False, 20_000) is True
    row = other.job("job")
    assert row.paused == 0 and row.last_slot == 20_000  # a pause is not downtime
    assert s.set_paused("nope", True, 0) is False


def test_a_paused_job_is_not_claimed_by_a_process_that_has_not_read_the_pause(s):
    """The claim's compare-and-set refuses a paused job (``MOVED``: read before claiming again):
    a process reads a change told by another up to half a second later, and its claim meanwhile
    must not run a job just paused (seen in test_cli.py's pause, once in a full run)."""
    s.set_paused("job", True, 500)
    assert claim_due(s, OWNER) is al._NotClaimed.MOVED
    assert s.runs() == [] and s.history("job", 10) == []
    s.set_paused("job", False, 500)  # (resuming moves the watermark to 500)
    assert isinstance(claim_due(s, OWNER, expected=500), al._Claim)


def test_cancel_ends_pending_runs_at_once_and_asks_running_ones(s):
    claim = claim_due(s, OWNER)
    s.trigger("job", 9000)
    assert s.cancel("job", 9500) == 2
    (running,) = s.runs()
    assert (running.slot, running.cancel) == (1000, True)
    assert [(r.slot, r.status) for r in s.history("job", 10) if r.status == "cancelled"] == [(9000, "cancelled")]
    assert s.finish(OWNER, al._End(claim, "cancelled", "cancelled", 9600)) is True
    assert s.runs() == [] and s.cancel("job", 9700) == 0


def test_history_is_newest_first_limited_and_pruned_to_the_retention(s):
    s.retention = 3
    expected = 0
    for n in range(5):
        slot = 1000 * (n + 1)
        claim = s.claim_due(OWNER, slot, al._Due("job", expected, slot, slot + 1000, [], True, 1, 30))
        assert s.finish(OWNER, al._End(claim, "failed" if n == 2 else "succeeded", "boom" if n == 2 else None, slot))
        expected = slot
    records = s.history("job", 10)
    assert [(r.slot, r.attempt, r.status, r.instance) for r in records] == [
        (5000, 1, "succeeded", OWNER),
        (4000, 1, "succeeded", OWNER),
        (3000, 1, "failed", OWNER),
    ]
    assert records[2].error == "boom" and records[0].finished_at.tzinfo is not None
    assert [r.slot for r in s.history(None, 2)] == [5000, 4000]
    figures = {f.job: f for f in s.figures()}
    assert figures["job"].records["succeeded"] == 4 and figures["job"].records["failed"] == 1  # kept past pruning


def test_ends_look_whether_the_history_is_due_a_prune_once_a_hundredth_of_the_retention(s, monkeypatch):
    """At the default retention (1000) an end looks whether its job's history is due a prune (a
    look steps through 1,100 records) at this store's first end of the job, then at one end in ten,
    not at every end; below 200, at every end (the test above: pruned to 3 at once)."""
    looks = []
    prune = al._SQLStore._prune
    monkeypatch.setattr(al._SQLStore, "_prune", lambda store, conn, job: (looks.append(job), prune(store, conn, job)))
    expected = 0
    for n in range(25):
        slot = 1000 * (n + 1)
        claim = s.claim_due(OWNER, slot, al._Due("job", expected, slot, slot + 1000, [], True, 1, 30))
        assert s.finish(OWNER, al._End(claim, "succeeded", None, slot))
        expected = slot
    assert looks == ["job"] * 3  # the ends 1, 11 and 21
    assert len(s.history("job", 100)) == 25
    # An attempt that another follows writes its record too: 4 since the look, and 6 retried, the
    # run's end looks (the records between two looks: at most ten and one run's attempts)
    slot = 26_000
    claim = s.claim_due(OWNER, slot, al._Due("job", expected, slot, slot + 1000, [], True, 1, 30))
    for _ in range(6):
        assert s.finish(OWNER, al._End(claim, "failed", "boom", slot, al._AfterEnd.RETRY, 0))
        (pending,) = s.runs()
        claim = s.claim(pending, OWNER, 30, slot, 99, None)
    assert s.finish(OWNER, al._End(claim, "failed", "boom", slot)) and looks == ["job"] * 4


def test_an_end_counts_towards_the_next_look_only_once_committed(s, monkeypatch):
    """An end whose transaction failed (here in its look at the history) wrote nothing, and moves
    nothing towards the next look: written again, as the runner writes it, it looks. (Counted
    while the transaction ran, a failed or retried one skipped the look, and a look failing each
    time let the history grow without bound.)"""

    class Boom(Exception):
        pass

    looks, failures = [], [Boom("the look failed")]
    prune = al._SQLStore._prune

    def failing_once(store, conn, job):
        looks.append(job)
        if failures:
            raise failures.pop()
        prune(store, conn, job)

    monkeypatch.setattr(al._SQLStore, "_prune", failing_once)
    claim = claim_due(s, OWNER, slot=1000)
    with pytest.raises(Boom):
        s.finish(OWNER, al._End(claim, "succeeded", None, 1000))
    assert [r.slot for r in s.runs()] == [1000]  # (rolled back: the run still held)
    assert s.finish(OWNER, al._End(claim, "succeeded", None, 1000))
    assert looks == ["job", "job"] and s.runs() == []


def test_an_end_is_written_whether_or_not_its_job_recorded_others_since(s):
    """A short run's record is still its job's newest when it ends: the end changes it in place, in
    one statement with the fence. A longer run's job has newer records by then: its record is
    written again as the newest (pruning keeps the newest). Either way the run is over and an end
    written again is refused."""
    long = s.claim_due(OWNER, 1000, al._Due("job", 0, 1000, 2000, [], True, None, 30))
    short = s.claim_due(OTHER, 2000, al._Due("job", 1000, 2000, 3000, [], True, None, 30))
    assert s.finish(OTHER, al._End(short, "succeeded", None, 2500))
    assert [r.slot for r in s.runs()] == [1000]
    assert s.finish(OWNER, al._End(long, "failed", "boom", 3000))
    assert [(r.slot, r.status, r.error) for r in s.history("job", 10)] == [
        (1000, "failed", "boom"),
        (2000, "succeeded", None),
    ]
    assert s.runs() == []
    assert s.finish(OWNER, al._End(long, "succeeded", None, 3500)) is False
    assert s.finish(OTHER, al._End(short, "failed", None, 3500)) is False
    assert [(r.slot, r.status) for r in s.history("job", 10)] == [(1000, "failed"), (2000, "succeeded")]


def test_the_writes_of_a_process_of_the_previous_schema_version_still_work(s):
    """A process of the release before (schema version 7) still running on the file while the
    next one migrated it: its claim writes the record the trigger wrote, its end deletes the run
    before ending the record, its takeover ends the attempt before interrupted before taking the
    run (what the trigger on a record's end leaves alone: that attempt still holds the run)."""
    claim = claim_due(s, OWNER)  # a claim of this version, taken over by one of version 7

    def old_takeover(conn):
        ended = {"status": "interrupted", "finished_at": 1500, "error": "lease expired", "output": None}
        conn.execute(al._SQL_END_ATTEMPT, {**ended, "job": "job", "slot": 1000, "attempt": 1})
        conn.execute(al._SQL_TAKE_RUN, s._holder("job", 1000, OTHER, 30, 1500))
        attempt, _ = conn.execute(al._SQL_ATTEMPT, ("job", 1000)).fetchone()
        conn.execute(al._SQL_RECORD, al._record("job", 1000, attempt, "running", OTHER, started_at=1500))
        return attempt

    assert s._write(old_takeover) == 2
    assert s.finish(OWNER, al._End(claim, "succeeded", None, 1600)) is False

    def old_end(conn):
        conn.execute(al._SQL_DELETE_HELD, al._held_by("job", 1000, 2, OTHER))
        ended = {"status": "succeeded", "finished_at": 1700, "error": None, "output": None}
        conn.execute(al._SQL_END_NEWEST, {**ended, "job": "job", "slot": 1000, "attempt": 2})

    s._write(old_end)

    def old_claim(conn):
        advance = {"slot": 2000, "next_slot": 3000, "job": "job", "expected_last": 1000}
        assert conn.execute(al._SQL_ADVANCE, advance).rowcount == 1
        holder = {**s._holder("job", 2000, OTHER, 30, 2000), "overlap": 1}
        assert conn.execute(al._SQL_INSERT_DUE_RUNNING, holder).rowcount == 1
        conn.execute(al._SQL_RECORD, al._record("job", 2000, 1, "running", OTHER, started_at=2000))

    s._write(old_claim)
    (pending,) = s.runs()
    taken = s.claim(pending, OWNER, 30, 2500, 10, 1, "lease expired")  # taken over by this version
    assert taken.attempt == 2 and s.finish(OWNER, al._End(taken, "succeeded", None, 2600))
    assert s.runs() == []
    assert [(r.slot, r.attempt, r.status, r.instance) for r in reversed(s.history("job", 10))] == [
        (1000, 1, "interrupted", OWNER),
        (1000, 2, "succeeded", OTHER),
        (2000, 1, "interrupted", OTHER),
        (2000, 2, "succeeded", OWNER),
    ]


def test_a_backlog_past_the_retention_is_pruned_a_bounded_batch_at_a_time(store, s, monkeypatch):
    """An end prunes at most ``_PRUNE_BATCH`` records, the oldest (a backlog of a million held
    the write lock for seconds), and notes the rest; ``tidy`` prunes it batch by batch, each in a
    transaction of its own, until the retention is reached. The counters keep every record."""
    monkeypatch.setattr(al, "_PRUNE_BATCH", 40)
    s.retention = 10
    backlog(store, "job", 100)
    assert not s.untidy
    claim = claim_due(s, OWNER, slot=10_000)
    assert s.finish(OWNER, al._End(claim, "succeeded", None, 10_000))
    assert count_records(store, "job") == 101 - 40 and s.backlog == {"job"} and s.untidy
    steps = 0
    while s.backlog and steps < 10:
        assert s.tidy() is True
        steps += 1
    assert steps == 2 and count_records(store, "job") == 10  # 61 -> 21 -> 10
    assert [r.slot for r in s.history("job", 1)] == [10_000]  # the newest kept
    figures = {f.job: f for f in s.figures()}["job"]
    assert figures.records["failed"] == 100 and figures.records["succeeded"] == 1


def test_processes_their_declarations_and_forget(process, s):
    assert s.join("one", 1000, ["job"]) is True  # the first of a group
    assert s.join("two", 1000, []) is False
    assert sorted((p.instance, p.jobs) for p in s.processes()) == [("one", 1), ("two", 0)]
    assert s.undeclared() == [] and s.undeclared("job") == []
    assert "declares it" in s.forget("job")
    s.leave("one")
    assert [p.instance for p in s.processes()] == ["two"] and s.undeclared() == ["job"]
    s.trigger("job", 5000)
    assert "unfinished run" in s.forget("job")
    s.cancel("job", 5001)
    assert s.forget("job") is None and s.jobs() == []
    with pytest.raises(al.JobNotFound):
        s.forget("job")
    s.leave("two")
    assert s.processes() == []


# -- what only the SQLite file has ----------------------------------------------------------------


@pytest.mark.sqlite_only  # (the file's mode, WAL and PRAGMA user_version (the schema's: test_postgres.py))
def test_schema_wal_and_mode(db):
    old = os.umask(0o022)
    try:
        sqlite_store(db).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == al.SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"jobs", "runs", "history", "checkpoints"} <= tables


@pytest.mark.sqlite_only  # (a file that is not SQLite)
def test_not_a_database(db):
    with open(db, "wb") as handle:
        handle.write(b"this is my shopping list, not a database" * 100)
    before = Path(db).read_bytes()
    with pytest.raises(StoreError) as info:
        run(Scheduler(db).history())
    assert info.value.path == db and db in str(info.value) and "not an SQLite database" in str(info.value)
    assert Path(db).read_bytes() == before


@pytest.mark.sqlite_only  # (the file's PRAGMA user_version (PostgreSQL's: test_postgres.py))
def test_newer_schema_is_refused_untouched(db):
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE future (x)")
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="newer") as info:
        run(Scheduler(db).history())
    assert info.value.path == db
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 99
    assert {r[0] for r in conn.execute("SELECT name FROM sqlite_master")} == {"future"}


@pytest.mark.sqlite_only  # (paths of the file system)
@pytest.mark.parametrize("where", ["missing-dir/jobs.db", "a-file/jobs.db"])
def test_unwritable_paths(tmp_path, where):
    (tmp_path / "a-file").write_text("x")
    path = str(tmp_path / where)
    with pytest.raises(StoreError) as info:
        run(Scheduler(path).history())
    assert info.value.path == path


@pytest.mark.sqlite_only  # (a read-only file (a read-only server: test_postgres.py))
def test_read_only_file_names_the_file(tmp_path):
    path = str(tmp_path / "ro.db")
    sqlite_store(path).close()
    if os.geteuid() == 0:
        # root ignores permission bits; an immutable view of the file is a read-only connection
        conn = al._SQLiteStore(path)
        conn._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
        with pytest.raises(StoreError, match="read-only") as info:
            conn.trigger("job", 1)
    else:
        os.chmod(path, 0o400)
        with pytest.raises(StoreError) as info:
            al._SQLiteStore(path).trigger("job", 1)
    assert info.value.path == path


@pytest.mark.sqlite_only  # (the file's page cap (a full disk of the server is the server's))
def test_full_disk_damages_nothing(db):
    s = sqlite_store(db)
    s.checkpoint_write("job", 1, '"kept"', 0, None)
    conn = s._connect()
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages + 4}")
    with pytest.raises(StoreError, match="disk full") as info:
        for slot in range(2, 1000):
            s.checkpoint_write("job", slot, '"' + "x" * 4000 + '"', 0, None)
    assert info.value.path == db
    assert s.checkpoint_get("job", 1) == (True, '"kept"')
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.execute("PRAGMA max_page_count = 1000000")
    assert s.checkpoint_write("job", 5000, '"after"', 0, None)  # the fault went away


@pytest.mark.sqlite_only  # (SQLite's one write lock and its busy wait)
@pytest.mark.parametrize("lock_poll", [None, al._LOCK_POLL])  # (SQLite's busy handler; the store's own looks)
def test_writes_wait_for_the_lock_instead_of_failing(db, lock_poll):
    sqlite_store(db).close()
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    threading.Timer(0.5, holder.execute, ["COMMIT"]).start()
    s = al._SQLiteStore(db, busy_timeout=10, lock_poll=lock_poll)
    started = time.monotonic()
    assert isinstance(claim_due(s, OWNER), al._Claim)
    assert time.monotonic() - started >= 0.4


@pytest.mark.sqlite_only  # (SQLite's one write lock and its busy wait)
@pytest.mark.parametrize("lock_poll", [None, al._LOCK_POLL])
def test_lock_held_past_the_busy_timeout_is_a_store_error(db, lock_poll):
    sqlite_store(db).close()
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreError, match="locked") as info:
            claim_due(al._SQLiteStore(db, busy_timeout=0.2, lock_poll=lock_poll), OWNER)
        assert info.value.path == db
    finally:
        holder.execute("ROLLBACK")


@pytest.mark.sqlite_only  # (SQLite's busy handler)
@pytest.mark.parametrize("read_only", [False, True])
def test_a_store_that_looks_for_the_lock_itself_leaves_sqlites_busy_wait_off(db, read_only):
    """A read that meets a busy file waits in ``_read``'s own looks, up to ``busy_timeout``; a
    read-only store (the command line's status, the status page) kept SQLite's busy handler on as
    well, and waited twice the timeout (found by a review: SQLITE_BUSY_RECOVERY, 2.0 s for 1.0)."""
    sqlite_store(db).close()
    s = al._SQLiteStore(db, busy_timeout=1.0, lock_poll=al._LOCK_POLL, read_only=read_only)
    assert s._read("PRAGMA busy_timeout") == [(0,)]
    s.close()


@pytest.mark.sqlite_only  # (SQLite's write lock, looked for in pauses)
@needs_faketime
def test_a_write_waiting_for_the_lock_under_a_faked_wall_clock_waits_and_tells_the_lock(db):
    """A heartbeat's write looks for the lock itself, pausing between tries. In a process under
    libfaketime (a box whose clock is wrong) ``time.sleep`` fails with EINVAL from Python 3.11 on:
    such a pause killed the heartbeat (and, on PostgreSQL, a scheduler racing another at start)."""
    s = sqlite_store(db)
    claim = claim_due(s, OWNER)
    s.close()
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    script = (
        "import sys, anarchon_lite as al\n"
        "s = al._SQLiteStore(sys.argv[1], busy_timeout=0.3, lock_poll=0.01)\n"
        "try:\n"
        f"    s.renew_all({OWNER!r}, [al._Claim({claim.job!r}, {claim.slot}, {claim.attempt})])\n"
        "except al.StoreError as exc:\n"
        "    print('StoreError:', exc)\n"
    )
    try:
        done = subprocess.run(
            [*wall_clock_ahead("+1h"), sys.executable, "-c", script, db],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(al.__file__).parent,
        )
    finally:
        holder.execute("ROLLBACK")
    assert done.returncode == 0, done.stderr
    assert "StoreError:" in done.stdout and "locked" in done.stdout, done.stdout


@pytest.mark.sqlite_only  # (POSIX locks on the file and its WAL)
def test_opening_more_connections_keeps_this_process_locks(db):
    """A second connection in this process must not drop the first one's POSIX locks; if it did,
    another process closing the file would delete the WAL that this process still writes to."""
    import subprocess
    import sys

    first = sqlite_store(db)
    second = al._SQLiteStore(db)
    second.data_version()
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sqlite3; sqlite3.connect({db!r}).execute('SELECT count(*) FROM runs').fetchall()",
        ],
        check=True,
        timeout=30,
    )
    assert os.path.exists(db + "-wal")
    first.trigger("job", 123)
    fresh = sqlite3.connect(db)
    assert fresh.execute("SELECT slot FROM runs").fetchall() == [(123,)]


@pytest.mark.sqlite_only  # (the switch to WAL of a new file (the schema's: test_postgres.py))
def test_many_processes_creating_one_file_at_once(tmp_path):
    """Opening a new file from several processes at once: every one ends up in WAL mode with the
    schema, none fails (switching to WAL does not wait on the busy handler by itself)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for round_ in range(5):
        path = str(tmp_path / f"new-{round_}.db")
        code = f"import sys; sys.path.insert(0, {root!r}); import anarchon_lite as al; al._SQLiteStore({path!r}).data_version()"
        procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(6)]
        assert [p.wait(timeout=60) for p in procs] == [0] * 6


@pytest.mark.sqlite_only  # (liveness sockets beside the file (PostgreSQL: advisory locks))
def test_liveness_sockets_tell_an_ended_owner_at_once_and_keep_no_descriptor_behind(tmp_path):
    db = str(tmp_path / "jobs.db")
    me = al._this_owner("")

    def owner(name, **changed):
        return al.dataclasses.replace(me, instance=name, **changed)

    async def main():
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        watcher = al._Liveness(db, loop, woken.set)
        watcher.listen(owner("watcher"))
        owners = {}
        for i in range(20):
            owners[i] = al._Liveness(db, loop, lambda: None)
            owners[i].listen(owner(f"o{i}"))
        # (descriptors are told by the socket objects: the test process's own count moves with
        # whatever the garbage collector closes meanwhile)
        assert all(watcher.gone(owner(f"o{i}")) is None for i in owners)  # alive: connected once each
        socks = [w.sock for w in watcher._watched.values()]
        assert len(socks) == 20 and all(s is not None and s.fileno() >= 0 for s in socks)
        assert watcher.gone(owner("o0")) is None  # asked again: the same connection, no new descriptor
        assert [w.sock for w in watcher._watched.values()] == socks
        # the same pid started at another time (a reused pid), or an owner that never listened: unknown
        assert watcher.gone(owner("o1", start=(me.start or 0) + 1)) is None
        assert watcher.gone(owner("never")) is None

        for i in range(10):  # these end cleanly (their names are removed) ...
            owners.pop(i).close()
        for i in range(10, 15):  # ... these as a kill -9 leaves them: the socket closed, its name left
            dead = owners.pop(i)
            dead._listener.close()
            os.close(dead._dir_fd)
        await asyncio.wait_for(woken.wait(), 5)
        await wait_for(lambda: all(watcher.gone(owner(f"o{i}")) for i in range(15)), message="every end seen")
        assert "exited" in watcher.gone(owner("o3")) and "exited" in watcher.gone(owner("o12"))
        assert all(watcher.gone(owner(f"o{i}")) is None for i in range(15, 20))
        # a later scheduler of the same instance name in the same process is alive again
        again = al._Liveness(db, loop, lambda: None)
        again.listen(owner("o3"))
        assert watcher.gone(owner("o3")) is None
        again.close()
        # the watcher removed the names the killed ones left; a new listener sweeps away the others
        folder = str(tmp_path / "jobs.db-live")
        assert len(os.listdir(folder)) == 1 + 5  # the watcher's and the live ones'
        unwatched = al._Liveness(db, loop, lambda: None)
        unwatched.listen(owner("unwatched"))
        unwatched._listener.close()
        os.close(unwatched._dir_fd)
        assert len(os.listdir(folder)) == 1 + 5 + 1
        sweeper = al._Liveness(db, loop, lambda: None)
        sweeper.listen(owner("sweeper"))
        assert len(os.listdir(folder)) == 1 + 5 + 1  # the unwatched one's name gone, the sweeper's there
        sweeper.close()
        for live in owners.values():
            live.close()
        await wait_for(lambda: all(watcher.gone(owner(f"o{i}")) for i in range(20)), message="every end seen")
        watcher.close()
        assert all(s.fileno() == -1 for s in socks) and not watcher._watched  # every connection closed
        listeners = [watcher, again, sweeper, unwatched, *owners.values()]
        assert all(x._listener is None or x._listener.fileno() == -1 for x in listeners)
        assert all(x._dir_fd is None or x is unwatched for x in listeners)
        assert os.listdir(folder) == []

    run(main())


def wal_frames(db):
    """The WAL's size in frames (a frame: a 24-byte header and one page)."""
    page = sqlite3.connect(db).execute("PRAGMA page_size").fetchone()[0]
    return os.path.getsize(db + "-wal") // (24 + page), page


@pytest.mark.sqlite_only  # (the file's pages in its WAL)
def test_a_short_occurrence_writes_at_most_ten_pages_of_1_kib(db):
    """What reaches the disk for an occurrence is the pages its two commits (claim, end) change,
    each whole: at most ten of a new file's 1 KiB pages (a job row and its change index, a run row,
    a history record and its two indexes, then the run row, the record and the job row, which
    keeps the newest record's status, again). It was sixteen pages of 4 KiB: two indexes on runs,
    sqlite_sequence, and an end that moved the record to a new id through every index."""
    clock = ManualClock()
    done = []

    async def main():
        s = Scheduler(db, clock=clock, poll=0.02)
        s.every("tick", "1s", lambda ctx: done.append(ctx.slot))
        async with s:
            clock.advance(1.0)
            await wait_for(lambda: len(done) == 1, message="the first occurrence")
            await wait_for(lambda: has_ended(db, done[-1]), message="its end written")
            before, page = wal_frames(db)
            for count in range(2, 7):
                clock.advance(1.0)
                await wait_for(lambda count=count: len(done) == count, message=f"occurrence {count}")
                await wait_for(lambda: has_ended(db, done[-1]), message="its end written")
            after, _ = wal_frames(db)
        return page, (after - before) / 5

    page, frames = run(main())
    assert page == 1024
    assert frames <= 10, f"{frames} pages an occurrence"


def test_a_backlog_behind_an_unfinished_runs_records_is_pruned_past_them(store, s, monkeypatch):
    """The records of a run still unfinished are never pruned (it writes its end there); a batch
    is counted among the others, so that a thousand such records at the oldest end (a run retried
    for ever, many runs side by side) do not stop pruning for good."""
    monkeypatch.setattr(al, "_PRUNE_BATCH", 40)
    s.retention = 10
    claim_due(s, OWNER, slot=1000)  # running: its record, and 60 older attempts' of the same slot
    backlog(store, "job", 60, slot=1000)
    backlog(store, "job", 100)  # slots 1 to 100, newer records
    skipped = s.claim_due(OWNER, 2000, al._Due("job", 1000, 2000, 3000, [], True, 1, 30))
    assert skipped is al._NotClaimed.RECORDED  # (skipped: the run is unfinished) and pruned
    steps = 0
    while s.tidy() and steps < 10:
        steps += 1
    # 162 records: the run's 61 kept, the newest 10 kept (the skipped one and slots 92-100)
    assert count_records(store, "job") == 162 - 91 and not s.backlog
    assert {r.slot for r in s.history("job", 1000)} == {1000, 2000, *range(92, 101)}


@pytest.mark.sqlite_only  # (statements counted by SQLite's trace callback; PostgreSQL writes an end in its writers' turn)
def test_a_claim_is_two_statements_in_a_transaction_and_a_short_runs_end_one(db):
    """A claim advances the job's watermark and inserts its run (a trigger writes the attempt's
    record); a short run's end is one statement, its own transaction (a trigger lets go of the
    run). They were five and four statements with their BEGIN and COMMIT."""
    s = sqlite_store(db)
    first = claim_due(s, OWNER)
    assert s.finish(OWNER, al._End(first, "succeeded", None, 1500))  # (its first end looks at the history)
    said = []  # (the callback is told a trigger's statements: as "-- ..." before Python 3.10, else the
    # statement that fired it again, at the start of each trigger)
    s._connect().set_trace_callback(lambda sql: not sql.startswith("--") and said[-1:] != [sql] and said.append(sql))
    claim = claim_due(s, OWNER, expected=1000, slot=2000)
    assert [sql.split()[:3] for sql in said] == [
        ["BEGIN", "IMMEDIATE"],
        ["UPDATE", "jobs", "SET"],
        ["INSERT", "INTO", "runs"],
        ["COMMIT"],
    ]
    del said[:]
    assert s.finish(OWNER, al._End(claim, "succeeded", None, 2500))
    assert [sql.split()[:3] for sql in said] == [["UPDATE", "history", "SET"]]
    assert s.runs() == [] and [(r.slot, r.status) for r in s.history("job", 1)] == [(2000, "succeeded")]


@pytest.mark.sqlite_only  # (the file's free pages: a PostgreSQL server vacuums its own)
def test_a_pruned_backlog_gives_the_files_free_pages_back(db, monkeypatch):
    """Once a backlog is pruned, ``tidy`` gives the file's free pages back a bounded number at a
    time (an incremental vacuum: a new file keeps the page map it needs), until under a quarter of
    its pages are free; the file is cut short as its WAL is written back. It used to keep every
    page it ever held."""
    monkeypatch.setattr(al, "_PRUNE_BATCH", 2_000)
    monkeypatch.setattr(al, "_SHRINK_PAGES", 500)
    s = sqlite_store(db)
    s.retention = 10
    backlog(db, "job", 5_000, error="x" * 500)
    full = os.path.getsize(db) + os.path.getsize(db + "-wal")
    claim = claim_due(s, OWNER, slot=10_000)
    assert s.finish(OWNER, al._End(claim, "succeeded", None, 10_000))
    steps = 0
    while s.tidy() and steps < 100:
        steps += 1
    assert not s.untidy and count_records(db, "job") == 10
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
        pages, free = (conn.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "freelist_count"))
    finally:
        conn.close()
    assert free * 4 < pages, (free, pages)
    assert steps > 2  # a step at a time: more than the two batches of records pruned
    assert os.path.getsize(db) < full / 4, (os.path.getsize(db), full)


def has_ended(db, slot):
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT status FROM history WHERE slot = ?", (slot,)).fetchone() == ("succeeded",)


@pytest.mark.sqlite_only  # (PRAGMA synchronous of the file)
@pytest.mark.parametrize(("given", "pragma"), [({}, 1), ({"durability": "normal"}, 1), ({"durability": "full"}, 2)])
def test_durability_sets_how_the_file_syncs_and_a_bad_value_is_refused(db, given, pragma):
    """durability="normal" (the default) syncs the WAL at checkpoints (synchronous=NORMAL);
    "full" every commit (FULL)."""
    s = Scheduler(db, **given)
    assert run(s._link.call(lambda store: store._read("PRAGMA synchronous")))[0][0] == pragma
    with pytest.raises(al.ConfigError, match="durability"):
        Scheduler(db, durability="fast")


# -- the lease board -----------------------------------------------------------------------------


def on_board(db, clock, board_dir, instance):
    """A store of a process that has joined the file as ``instance``, its lease board in ``board_dir``."""
    board_dir.mkdir(exist_ok=True)
    s = al._SQLiteStore(db, clock=clock, board_dir=str(board_dir))
    s.register([al._Declared("job", "every 1h", 0, 3_600_000, "every 1h", "test")])
    s._me = al._Owner("", os.getpid(), 1, f"pid:[{instance}]", "boot")  # as a process of its own
    s.join(instance, 0, ["job"])
    return s


def commits(db):
    """A number that changes whenever a connection commits to the file (``PRAGMA data_version``
    as seen by a connection of its own, which never commits)."""
    conn = sqlite3.connect(db)
    return lambda: conn.execute("PRAGMA data_version").fetchone()[0]


@pytest.mark.sqlite_only  # (the lease board in /dev/shm)
def test_renewals_are_made_on_the_lease_board_and_write_nothing_to_the_file(db, clock, tmp_path):
    """While every process of the file shares the board, a renewal (and a progress report) is
    written there, not to the file; the others see the lease and the progress on the board, and take
    the run over only once the board's lease has run out; the owner's next renewal finds it lost."""
    a = on_board(db, clock, tmp_path / "shm", OWNER)
    b = on_board(db, clock, tmp_path / "shm", OTHER)
    claim = claim_due(a, OWNER)
    version = commits(db)
    before = version()
    clock.advance(10)
    assert a.renew_all(OWNER, [claim]) == []
    a.report_progress(claim, OWNER, (3, 10))
    assert version() == before, "a renewal or a progress report was written to the file"
    seen = b.runs()[0]
    assert seen.lease_until - clock.monotonic() == pytest.approx(20)  # the file still has the claim's lease
    assert seen.lease_left == pytest.approx(30) and (seen.progress_done, seen.progress_total) == (3, 10)
    clock.advance(25)  # past the file's lease, not the board's
    seen = b.runs()[0]
    assert seen.lease_left == pytest.approx(5)
    assert b.claim(seen, OTHER, 30, 2000, 10, 1, "lease expired") is None
    clock.advance(6)
    assert b.runs()[0].lease_left < 0
    taken = b.claim(seen, OTHER, 30, 2000, 10, 1, "lease expired")
    assert taken is not None and taken.attempt == 2
    assert a.renew_all(OWNER, [claim]) == [claim]


@pytest.mark.sqlite_only  # (the lease board in /dev/shm)
def test_a_renewal_made_after_its_lease_ran_out_is_made_in_the_file(db, clock, tmp_path):
    """A renewal on the board counts only if it was written while the lease it extends held: one
    written later (the owner frozen in between) may come after a taker read the board, so it is
    made in the file, where the claim's compare-and-set decides between them."""
    a = on_board(db, clock, tmp_path / "shm", OWNER)
    on_board(db, clock, tmp_path / "shm", OTHER)
    claim = claim_due(a, OWNER)
    version = commits(db)
    clock.advance(20)
    before = version()
    assert a.renew_all(OWNER, [claim]) == []  # on the board, until 50 s after the claim
    assert version() == before
    clock.advance(31)
    assert a.renew_all(OWNER, [claim]) == []  # still held (nobody took it), but in the file
    assert version() != before
    assert a.runs()[0].lease_until - clock.monotonic() == pytest.approx(30)


@pytest.mark.sqlite_only  # (the lease board in /dev/shm)
def test_a_process_not_on_the_board_makes_owners_renew_in_the_file(db, clock, tmp_path):
    """A process that cannot see the board (a container with a /dev/shm of its own) joins: owners
    renew in the file from their next renewal on, and until then the newcomer holds their runs as
    leased for a whole lease from its join, whatever the file's older lease says."""
    a = on_board(db, clock, tmp_path / "shm", OWNER)
    claim = claim_due(a, OWNER)
    clock.advance(20)
    version = commits(db)
    before = version()
    assert a.renew_all(OWNER, [claim]) == []
    assert version() == before  # alone on its board: renewed there
    clock.advance(15)  # the file's lease ran out 5 s ago; the board's holds 15 s more
    b = on_board(db, clock, tmp_path / "other-shm", OTHER)
    seen = b.runs()[0]
    assert seen.lease_until < clock.monotonic()
    assert seen.lease_left == pytest.approx(30)  # from b's join
    assert b.claim(seen, OTHER, 30, 2000, 10, 1, "lease expired") is None
    before = version()
    assert a.renew_all(OWNER, [claim]) == []
    assert version() != before  # b is no member of a's board: renewed in the file
    clock.advance(31)  # the owner stopped renewing
    seen = b.runs()[0]
    assert seen.lease_left < 0
    assert b.claim(seen, OTHER, 30, 2000, 10, 1, "lease expired").attempt == 2


@pytest.mark.sqlite_only  # (the lease board in /dev/shm)
def test_the_leases_of_ended_attempts_leave_the_board_a_minute_after_they_expire(db, clock, tmp_path):
    """Nothing is written to the board when an attempt ends: its lease expires, and a round of
    renewals a minute later deletes it, so the board does not grow with the runs."""
    a = on_board(db, clock, tmp_path / "shm", OWNER)
    first = claim_due(a, OWNER)
    assert a.renew_all(OWNER, [first]) == []
    assert a.finish(OWNER, al._End(first, "succeeded", None, 2000))
    board = a._the_board()
    assert set(board.leases()) == {("job", 1000, 1)}  # (left to expire)
    second = claim_due(a, OWNER, expected=1000, slot=2000)
    clock.advance(30 + 61)
    assert a.renew_all(OWNER, [second]) == []  # (still held; its lease had run out: renewed in the file)
    assert set(board.leases()) == {("job", 2000, 1)}


@pytest.mark.sqlite_only  # (the race to switch a new file to WAL)
def test_a_transient_io_error_while_opening_a_new_file_is_tried_again(db, monkeypatch):
    """Processes opening a new file at once race to switch it to WAL, and the loser can get a
    "disk I/O error" (once in CI: a load-test worker died of it at start). The opening is tried
    again with a new connection; an error that lasts is still reported, naming the file."""
    real = al._switch_to_wal
    failures = [2]

    def racing(conn, path, timeout):
        if failures[0]:
            failures[0] -= 1
            raise sqlite3.OperationalError("disk I/O error")
        real(conn, path, timeout)

    monkeypatch.setattr(al, "_switch_to_wal", racing)
    s = sqlite_store(db)
    assert failures == [0] and s.jobs()[0].name == "job"
    s.close()
    failures[0] = 10**6
    monkeypatch.setattr(al, "_OPEN_RETRY", 0.2)
    with pytest.raises(StoreError, match="disk I/O error") as info:
        sqlite_store(db)
    assert info.value.path == db


JOBS = [f"j{i}" for i in range(8)]


def batch_store(db):
    s = al._SQLiteStore(db)
    s.register([al._Declared(name, "every 1h", 0, 3_600_000, "every 1h", "test") for name in JOBS])
    return s


def batch_due(job, expected=0, slot=1000, overlap=1):
    return al._Due(job, expected, slot, slot + 1000, [], True, overlap, 30)


def claim_a_batch_in_turn(db, set_claims, monkeypatch):
    """Claims of the eight jobs as one batch, after another process claimed j2, j5 was paused, j3
    runs an earlier occurrence (skipped) and j4 too (overlap allowed: claimed); then the same batch
    again (every job moved), and the next occurrences of four of them once their runs ended.
    Returns what each claim answered and what the file holds."""
    monkeypatch.setattr(al, "_SET_CLAIMS", set_claims)
    s = batch_store(db)
    claimed = s.claim_due_many(OTHER, 500, [batch_due("j2"), batch_due("j3", slot=500), batch_due("j4", slot=500)])
    assert all(isinstance(c, al._Claim) for c in claimed)
    assert s.set_paused("j5", True, 500)
    due = [batch_due(job, 500 if job in ("j3", "j4") else 0, overlap=None if job == "j4" else 1) for job in JOBS]
    answers = [s.claim_due_many(OWNER, 1000, due), s.claim_due_many(OWNER, 1000, due)]
    again = ("j0", "j1", "j6", "j7")
    ended = [al._End(c, "succeeded", None, 1500) for c in answers[0] if isinstance(c, al._Claim) and c.job in again]
    assert s.finish_many(OWNER, ended) == [True] * 4
    answers.append(s.claim_due_many(OWNER, 2000, [batch_due(job, 1000, slot=2000) for job in again]))
    conn = sqlite3.connect(db)
    try:
        files = [
            conn.execute("SELECT name, last_slot, next_slot, paused FROM jobs ORDER BY name").fetchall(),
            conn.execute(
                "SELECT job, slot, attempt, state, owner, started_at, lease FROM runs ORDER BY job, slot"
            ).fetchall(),
            conn.execute(
                "SELECT job, slot, attempt, status, instance FROM history ORDER BY job, slot, attempt"
            ).fetchall(),
        ]
        changed = [row[0] for row in conn.execute("SELECT changed FROM jobs")]
    finally:
        conn.close()
    assert len(set(changed)) == len(changed), changed  # (every job changed since registered: a number each)
    return [[(c if isinstance(c, al._NotClaimed) else (c.job, c.slot, c.attempt)) for c in a] for a in answers], files


@pytest.mark.sqlite_only  # (PostgreSQL claims a job at a time: a statement of a batch is SQLite's)
@pytest.mark.skipif(sqlite3.sqlite_version_info < (3, 33), reason="a batch at once needs UPDATE ... FROM (SQLite 3.33)")
def test_a_batch_claimed_at_once_answers_as_claims_made_one_job_at_a_time(tmp_path, monkeypatch):
    """A batch of due jobs to run, none missed, is claimed in a few statements for the batch
    (``_SQLiteStore._claim_all_due``); jobs another process moved, paused jobs, and batches whose
    jobs have runs answer and leave the file as claims made one job at a time do."""
    one_by_one = claim_a_batch_in_turn(str(tmp_path / "one.db"), False, monkeypatch)
    at_once = claim_a_batch_in_turn(str(tmp_path / "all.db"), True, monkeypatch)
    assert at_once == one_by_one
    answers, _ = at_once
    assert answers[0][2] is answers[0][5] is al._NotClaimed.MOVED  # (claimed by OTHER; paused)
    assert answers[0][3] is al._NotClaimed.RECORDED  # (skipped: j3's earlier run is unfinished)
    assert answers[0][4] == ("j4", 1000, 1)
    assert set(answers[1]) == {al._NotClaimed.MOVED}
    assert answers[2] == [(job, 2000, 1) for job in ("j0", "j1", "j6", "j7")]


@pytest.mark.sqlite_only  # (statements counted by SQLite's trace callback)
@pytest.mark.skipif(sqlite3.sqlite_version_info < (3, 33), reason="a batch at once needs UPDATE ... FROM (SQLite 3.33)")
def test_a_batch_of_claims_is_a_few_statements_whatever_its_size(db):
    """A hundred jobs due at once (a burst) are claimed in six statements with BEGIN and COMMIT, not
    three a job: each is one call into SQLite, during which the event loop's thread can work."""
    s = al._SQLiteStore(db)
    names = [f"b{i}" for i in range(100)]
    s.register([al._Declared(name, "every 1h", 0, 3_600_000, "every 1h", "test") for name in names])
    said = []
    s._connect().set_trace_callback(lambda sql: not sql.startswith("--") and said[-1:] != [sql] and said.append(sql))
    claims = s.claim_due_many(OWNER, 1000, [batch_due(name) for name in names])
    assert [(c.job, c.slot, c.attempt) for c in claims] == [(name, 1000, 1) for name in names]
    assert len(said) <= 6, [sql[:60] for sql in said]
    assert [r.job for r in s.runs()] == sorted(names)
