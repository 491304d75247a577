"""Threads: the heartbeat thread and the event loop's renewals, a blocked loop, the GIL switch
interval, the store's thread, a scheduler in a thread of its own, and what is left after close."""

import asyncio
import contextlib
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import QUIET, faulty, run, wait_for
from schedulers import (
    HOUR,
    aligned,
    has,
    make,
    next_slot,
    statuses,
)

import anarchon_lite as al
from anarchon_lite import (
    ConfigError,
    JobNotFound,
)


@pytest.fixture
def db(store):
    """Every test here runs on both stores (``store``), unless marked ``sqlite_only``."""
    return store


def test_short_runs_one_after_another_share_one_watchdog_timer():
    """The blocked-loop watchdog plans a tick when a handler starts and lets it run out after the
    last ends: 100 short runs one after another plan one tick (each run planned one and cancelled
    it, waking the timer thread twice a run); the tick finding nothing running plans no other, and
    the next run plans one again. The loop sends the first ping itself, so the tick comes a whole
    threshold later (it came a quarter of it later, and a process running a short run now and then
    woke the timer thread twice for each). (No store: the watchdog alone, with a timer thread
    stand-in.)"""
    planned = []

    class Timers:
        def call_at(self, deadline, callback):
            planned.append((deadline, callback))
            return lambda: None

    loop, clock = asyncio.new_event_loop(), al.Clock()
    try:
        watchdog = al._Watchdog(loop, Timers(), clock, 1.0, str)
        for _ in range(100):
            watchdog.acquire()
            watchdog.release()
        assert len(planned) == 1 and planned[0][0] - clock.monotonic() > 0.5
        planned.pop()[1]()  # the tick: nothing runs
        assert planned == []
        watchdog.acquire()
        assert len(planned) == 1 and watchdog._sent is None
        watchdog.ping()  # (the loop's own, after the handler's first step)
        assert watchdog._sent is not None
        loop.run_until_complete(asyncio.sleep(0))
        assert watchdog._sent is None
        planned.pop()[1]()  # the tick: a handler runs, the ping was answered: a ping, and every quarter
        assert len(planned) == 1 and planned[0][0] - clock.monotonic() < 0.5
        watchdog.release()
    finally:
        loop.close()


def test_the_timer_thread_is_woken_only_for_a_deadline_sooner_than_all_it_has():
    """A deadline planned after the first (a run's ``timeout``, behind the watchdog's tick) wakes
    nobody: the thread wakes by the first and looks at the rest then. Each woke it, about four
    context switches of the thread an occurrence with 20 jobs a second, each with a timeout. A
    sooner one wakes it, and every deadline is kept. (No store: the timer thread alone.)"""
    clock = al.Clock()
    timers = al._Timers(clock, "test-timers")
    told = []
    notify = timers._cond.notify
    timers._cond.notify = lambda *args: told.append(1) or notify(*args)
    fired = []
    timers.start()
    try:
        now = clock.monotonic()
        timers.call_at(now + 60, lambda: fired.append("later"))
        assert len(told) == 1  # (the first: it slept with nothing planned)
        timers.call_at(now + 3600, lambda: fired.append("much later"))
        timers.call_at(now + 120, lambda: fired.append("after the first"))
        assert len(told) == 1
        timers.call_at(now + 0.05, lambda: fired.append("soon"))
        assert len(told) == 2
        run(wait_for(lambda: fired == ["soon"], message="the sooner deadline"))
        assert sorted(deadline for deadline, _, _ in timers._heap) == [now + 60, now + 120, now + 3600]
    finally:
        timers.stop()
        timers.join(timeout=10)


def test_blocked_loop_warning_names_the_job(db, caplog):
    async def main():
        s = make(db, blocked_warning=0.3)

        @s.every("hog", "24h", offset=QUIET)
        async def hog(ctx):
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                sum(range(1000))

        async with s:
            await s.trigger("hog")
            await wait_for(lambda: has(s, "hog", "succeeded"))

    with caplog.at_level(logging.WARNING, logger="anarchon_lite"):
        run(main())
    warnings = [r.message for r in caplog.records if "blocked" in r.message]
    assert warnings and "job hog" in warnings[0] and "test_threads.py" in warnings[0]


def test_progress_travels_with_the_heartbeat(db):
    async def main():
        s = make(db)
        gate = asyncio.Event()

        @s.every("long", "24h", offset=QUIET, lease="300ms")
        async def long(ctx):
            ctx.progress(3, 10)
            await gate.wait()

        async with s:
            await s.trigger("long")

            async def shown():
                runs = [r for j in await s.status() for r in j.runs]
                return runs and runs[0].progress == (3.0, 10.0)

            await wait_for(shown)
            gate.set()
            await wait_for(lambda: has(s, "long", "succeeded"))

    run(main())


def test_the_switch_interval_is_lowered_only_around_renewals(db):
    import sys

    before = sys.getswitchinterval()

    async def main():
        seen: set[float] = set()

        async def sample():
            while True:
                seen.add(sys.getswitchinterval())
                await asyncio.sleep(0.001)

        def rounds(s):
            return len(s._loop.heartbeats.lateness.samples) if s._loop.heartbeats else 0

        sampler = asyncio.ensure_future(sample())
        try:
            s, t = make(db, instance="s"), make(db, instance="t", switch_interval=None)
            for scheduler in (s, t):
                scheduler.every("job", "24h", lambda ctx: ctx.signal.sleep_sync(60), offset=QUIET, lease="0.3s")
            async with s:  # the body starts once s has looked at the file
                await asyncio.sleep(0.05)
                assert seen == {before}, "a scheduler with nothing running changed the switch interval"
                await s.trigger("job")
                await wait_for(lambda: seen == {before, 0.0005} and rounds(s) >= 2, message="both intervals")
            assert sys.getswitchinterval() == before
            seen.clear()
            async with t:  # switch_interval=None: renewals go on, the interval is never touched
                await t.trigger("job")
                await wait_for(lambda: rounds(t) >= 5, message="five renewals of t")
            assert seen == {before}
        finally:
            sampler.cancel()

    run(main())
    assert sys.getswitchinterval() == before


def test_a_short_lease_started_beside_a_long_one_is_renewed_in_time(db):
    """The next round of renewals is planned for the attempts already running; one with a shorter
    lease that starts meanwhile must be renewed before its own lease runs out (else the other
    process, watching, takes it over)."""
    started = []

    async def main():
        a, b = make(db, instance="a"), make(db, instance="b")
        go = asyncio.Event()
        for s in (a, b):

            @s.every("long", "24h", offset=QUIET, lease="30s")
            async def long(ctx):
                await go.wait()

            @s.every("short", "24h", offset=QUIET, lease="500ms")
            async def short(ctx):
                started.append((ctx.instance, ctx.attempt))
                await ctx.signal.sleep(1.5)  # three of its leases

        async with a:
            await a.trigger("long")
            await wait_for(lambda: a._loop.runner.running, message="the long run")
            await a.trigger("short")
            await wait_for(lambda: ("a", 1) in started, message="the short run on a")
            async with b:
                await wait_for(lambda: has(a, "short", "succeeded") or has(a, "short", "interrupted"), timeout=15)
            go.set()
        assert started == [("a", 1)]
        assert [r[1:] for r in await statuses(a, "short")] == [(1, "succeeded")]

    run(main())


def test_short_attempts_one_after_another_do_not_wake_the_heartbeat_thread_each(db, monkeypatch):
    """An attempt that ends before the heartbeat thread looks leaves its round planned: the next
    one, started before that round, is renewed by it without waking the thread (each such attempt
    woke it; in one task an attempt, tried and taken back, every attempt did: two wake-ups an
    occurrence)."""
    looks = []
    round_ = al._Heartbeats._round

    def counted(self):
        if threading.current_thread() is self:
            looks.append(time.monotonic())
        return round_(self)

    monkeypatch.setattr(al._Heartbeats, "_round", counted)
    ran = []

    async def main():
        s = make(db)

        @s.every("often", "100ms", lease="30s")
        async def often(ctx):
            ran.append(ctx.slot)

        async with s:
            await wait_for(lambda: len(ran) >= 2, message="the first runs")
            first = len(ran), len(looks)
            await wait_for(lambda: len(ran) >= first[0] + 20, timeout=30, message="twenty more runs")
            runs, thread_looks = len(ran) - first[0], len(looks) - first[1]
        assert thread_looks <= 3, f"the heartbeat thread looked {thread_looks} times in {runs} runs"

    run(main())


def test_leases_of_jobs_with_quotes_commas_and_braces_in_their_names_are_renewed(db):
    names = ['we"ird, {name}\\', "plain"]

    async def main():
        s = make(db)
        for name in names:
            s.every(name, "24h", offset=QUIET, lease="0.5s", handler=lambda ctx: time.sleep(1.6))
        async with s:
            for name in names:
                await s.trigger(name)
            for name in names:
                await wait_for(lambda name=name: has(s, name, "succeeded"), message=f"{name} to succeed")
            lost = s._loop.heartbeats.lateness.lost
        for name in names:
            assert [(a, st) for _, a, st in await statuses(s, name)] == [(1, "succeeded")]
        assert lost == 0

    run(main())


def test_calls_outside_a_run_leave_no_thread_or_connection_behind(db):
    """A web app that asks ``status()`` of a new ``Scheduler`` on every request must not leak a
    thread and a database connection per call."""

    async def main():
        s = make(db)
        s.every("job", "24h", lambda ctx: None, offset=QUIET)
        await s.trigger("job")
        for _ in range(5):
            await make(db).history()
            await make(db).status()
        await wait_for(
            lambda: not [t for t in threading.enumerate() if t.name.startswith("anarchon-store")],
            message="the store threads to end",
        )

    run(main())


def test_a_store_call_whose_caller_is_cancelled_completes_and_the_next_call_is_answered(db):
    """Cancelling the task that awaits a call to the store's thread does not cancel the call: its
    transaction completes (a claim won is recorded whatever the caller does), and the thread
    answers the calls queued after it."""
    began, finish, finished = threading.Event(), threading.Event(), []

    def slow(store):
        began.set()
        finish.wait(10)
        finished.append([row.name for row in store.jobs(-1)])
        return "slow"

    async def main():
        s = make(db)
        s.every("job", "24h", lambda ctx: None, offset=QUIET)
        link = s._link
        link.held = True  # (as while serving: the thread stays between calls)
        try:
            await link.call(lambda store: None)  # (the job recorded)
            caller = asyncio.ensure_future(link.call(slow))
            await asyncio.get_running_loop().run_in_executor(None, began.wait, 10)
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            after = asyncio.ensure_future(link.call(lambda store: [row.name for row in store.jobs(-1)]))
            finish.set()
            assert await asyncio.wait_for(after, 10) == ["job"]
            assert finished == [["job"]]
        finally:
            finish.set()
            link.held = False
            link.close(wait=True)

    run(main())


def python(script, *flags):
    """Run ``script`` in a Python process of its own (this checkout's module on its path), ended
    within a minute."""
    root = str(Path(__file__).resolve().parent.parent)
    return subprocess.run(
        [sys.executable, *flags, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": root},
        cwd=root,
        check=False,
    )


def test_a_process_that_never_closed_its_store_thread_exits_after_its_last_call(db):
    """A program that leaves without closing the store's thread (its scheduler's loop torn down
    before the stop ran) exits: the thread ends at the interpreter's exit, after the calls queued
    to it, which land."""
    script = (
        "import asyncio, anarchon_lite as al\n"
        f"s = al.Scheduler({db!r})\n"
        "s.every('job', '24h', lambda ctx: None)\n"
        "s._link.held = True\n"
        "async def main():\n"
        "    await s.trigger('job')\n"
        "    loop = asyncio.get_running_loop()\n"
        "    s._link._thread.submit(lambda store: store.set_paused('job', True, 0), loop, lambda result, exc: None)\n"
        "asyncio.run(main())\n"
        "print('left')\n"
    )
    done = python(script)
    assert (done.returncode, done.stdout) == (0, "left\n"), done.stderr
    assert [job.paused for job in run(make(db).status())] == [True]


@pytest.mark.sqlite_only  # (the file's connections: what Python 3.13 warns of when one is left unclosed)
def test_a_web_app_s_calls_then_close_leave_nothing_unclosed_under_dev_mode(db):
    """Under ``-X dev`` with ResourceWarning an error: a scheduler started in a thread, control
    calls, ``close()``, and the interpreter's exit print no warning and exit 0."""
    script = (
        "import anarchon_lite as al\n"
        f"s = al.Scheduler({db!r})\n"
        "s.every('job', '24h', lambda ctx: None)\n"
        "s.start_in_thread()\n"
        f"with al.Control({db!r}) as control:\n"
        "    control.trigger('job')\n"
        "    assert [j.name for j in control.status()] == ['job']\n"
        f"assert [j.name for j in al.Control({db!r}, read_only=True).status()] == ['job']\n"
        "s.close()\n"
    )
    done = python(script, "-X", "dev", "-W", "error::ResourceWarning")
    assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr


def anarchon_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("anarchon")]


def open_files(db):
    """The descriptors of this process open on the SQLite file ``db`` or its companions."""
    if not db.endswith(".db"):
        return []
    where = "/proc/self/fd"
    names = [os.readlink(f"{where}/{fd}") for fd in os.listdir(where) if os.path.exists(f"{where}/{fd}")]
    return [name for name in names if name.startswith(db)]


def test_close_stops_a_thread_scheduler_and_leaves_no_thread_or_file_open(db):
    """``close()`` ends a scheduler started in a thread and its store's thread and connection
    (a Flask app's teardown); ``Control`` closes as a context manager; a scheduler running on the
    caller's loop refuses to be closed under it."""
    from anarchon_lite import Control

    s = make(db)
    s.every("job", "24h", lambda ctx: None, offset=QUIET)
    s.start_in_thread()
    with Control(db) as control:
        assert [j.name for j in control.status()] == ["job"]
    s.close()
    assert anarchon_threads() == []
    assert open_files(db) == []
    s.close()  # (twice: nothing left to do)

    async def main():
        async with s:
            with pytest.raises(ConfigError, match="stop"):
                s.close()

    run(main())
    s.close()
    assert anarchon_threads() == []


@pytest.mark.sqlite_only  # (descriptors of the file)
def test_a_heartbeat_thread_that_first_runs_after_the_stop_leaves_no_connection_open(db, monkeypatch):
    """Under load a scheduler's heartbeat thread can first run after the scheduler stopped (seen
    once in CI): the connection it opens then for the event loop's renewals is closed too; it was
    left open until garbage collection, four descriptors of the file."""
    original = al._Heartbeats.run

    def late(self):
        with self._cond:
            assert self._cond.wait_for(lambda: self._stopped, timeout=30), "never stopped"
        original(self)

    monkeypatch.setattr(al._Heartbeats, "run", late)
    s = make(db)
    s.every("job", "24h", lambda ctx: None, offset=QUIET)
    s.start_in_thread()
    s.close()
    assert anarchon_threads() == []
    assert open_files(db) == []


def test_sync_code_runs_the_scheduler_in_a_thread_and_steers_it_with_control(db):
    """No event loop in sight: start_in_thread returns once the scheduler has joined, Control's
    plain calls trigger, pause and read it, and stop_thread hands over and ends the thread."""
    from anarchon_lite import Control

    seen = []
    s = make(db)
    s.every("sync", "24h", lambda ctx: seen.append(ctx.slot), offset=QUIET)
    s.start_in_thread()
    try:
        with pytest.raises(ConfigError, match="already runs in a thread"):
            s.start_in_thread()
        control = Control(db)
        slot = control.trigger("sync")
        deadline = time.monotonic() + 20
        while slot not in seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen == [slot]
        control.pause("sync")
        assert [j.paused for j in control.status()] == [True]
        assert control.history("sync")[0].status == "succeeded"
        with pytest.raises(JobNotFound):
            control.trigger("nope")
    finally:
        s.stop_thread(timeout=30)
    assert s._thread is None and not any(t.name == f"anarchon-{s.instance}" for t in threading.enumerate())


def test_the_loops_claims_and_ends_are_made_on_its_own_thread_when_the_store_needs_no_wait(db, clock):
    """A claim and an end, when the store's thread has nothing queued, are made on the event
    loop's own thread on SQLite (a write that finds the lock free: no hop to the store's thread and
    back); on PostgreSQL on the store's thread, whose calls wait for the network. (The runs are
    awaited through the scheduler's events: a test asking the store meanwhile would have a call
    queued on the thread now and then, and the scheduler's would go there too.)"""
    calls, done = [], []

    def noting(name):
        def inner(original, *args, **kwargs):
            made = original(*args, **kwargs)  # (where it was made: a call that stepped back, not)
            calls.append((name, threading.get_ident()))
            return made

        return inner

    async def main():
        loop_thread = threading.get_ident()
        s = make(db, clock, store=faulty(claim_due_many=noting("claim_due_many"), finish_many=noting("finish_many")))
        s.on_event(lambda event: done.append(event.slot) if event.kind == "succeeded" else None)
        aligned(clock, HOUR)
        s.every("job", "1h", lambda ctx: None)
        async with s:
            for n in (1, 2, 3):
                next_slot(clock, HOUR)
                await wait_for(lambda n=n: len(done) == n and [name for name, _ in calls].count("finish_many") == n)
        # (the first claim may meet the thread still busy with the process's start: the last ones)
        last = {name: thread for name, thread in calls}
        assert set(last) == {"claim_due_many", "finish_many"}
        on_loop = {name for name, thread in last.items() if thread == loop_thread}
        assert on_loop == (set() if db.startswith("postgresql://") else set(last)), calls

    run(main())


@contextlib.asynccontextmanager
async def _held_link(db):
    """The link to the store of a scheduler declaring one job, held as while it serves (its thread
    and connection stay between calls), its connection open."""
    s = make(db)
    s.every("job", "24h", lambda ctx: None, offset=QUIET)
    link = s._link
    link.held = True
    try:
        await link.call(lambda store: None)  # (the job recorded, the connection open)
        yield link
    finally:
        link.held = False
        link.close(wait=True)


def _holding_the_write_lock(path):
    """Another connection to the SQLite file at ``path``, holding its write lock."""
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    return other


@pytest.mark.sqlite_only  # (the write lock of a file, which another process holds)
def test_a_call_that_would_wait_for_the_write_lock_goes_to_the_stores_thread_and_the_loop_goes_on(db):
    """A write submitted to be made on the loop's thread that finds the write lock held is not
    waited for there: the store's thread makes it once the lock is free, and meanwhile the loop
    runs (a call that waited on the loop's thread would hold every handler and timer up to 30 s)."""

    async def main():
        async with _held_link(db) as link:
            other = _holding_the_write_lock(db)
            try:
                made = asyncio.ensure_future(
                    link.call(lambda store: (threading.get_ident(), store.trigger("job", 1000)), soon=True)
                )
                for _ in range(50):  # (the loop turns while the lock is held: the call cannot be done)
                    await asyncio.sleep(0)
                assert not made.done()
                other.execute("ROLLBACK")
                thread, slot = await asyncio.wait_for(made, 10)
            finally:
                other.close()
            assert thread != threading.get_ident() and slot == 1000
            assert [run.slot for run in await link.call(lambda store: store.runs())] == [1000]

    run(main())


@pytest.mark.sqlite_only  # (the write lock of a file, which another process holds)
def test_a_call_on_the_loops_thread_that_wrote_waits_rather_than_be_made_twice(db, monkeypatch):
    """A call made on the loop's thread that committed a write and then finds the write lock held
    waits for it there: handed to the store's thread, it would be made again from its start, its
    first write twice."""
    other, waited = [], []
    pause = al._pause

    def pausing(seconds):  # (the store waits for the lock: the other connection lets it go then)
        waited.append(threading.get_ident())
        if other:
            other.pop().execute("ROLLBACK")
        pause(seconds)

    monkeypatch.setattr(al, "_pause", pausing)
    made = []

    def both(store):
        made.append(threading.get_ident())
        first = store.trigger("job", 1000)
        other.append(_holding_the_write_lock(db))
        return first, store.trigger("job", 2000)

    async def main():
        async with _held_link(db) as link:
            assert await asyncio.wait_for(link.call(both, soon=True), 10) == (1000, 2000)
            loop_thread = threading.get_ident()
            assert made == [loop_thread] and loop_thread in waited
            assert sorted(run.slot for run in await link.call(lambda store: store.runs())) == [1000, 2000]

    run(main())


@pytest.mark.sqlite_only  # (SQLite's write-ahead log)
def test_the_wal_is_written_back_by_the_stores_thread_never_on_the_loops(db, monkeypatch):
    """Writes made on the loop's thread never write the WAL back into the file there (a checkpoint
    syncs the disk): once the WAL holds ``_WAL_LIMIT``, the next call goes to the store's thread,
    which does it after its commit, and the WAL stays within its bound."""
    monkeypatch.setattr(al, "_WAL_LIMIT", 64 * 1024)
    checkpoints = []

    async def main():
        async with _held_link(db) as link:
            conn = await link.call(lambda store: store._connect())
            conn.set_trace_callback(
                lambda sql: checkpoints.append(threading.get_ident()) if "wal_checkpoint" in sql else None
            )
            where, largest, loop_thread = [], 0, threading.get_ident()
            for i in range(300):
                made = await link.call(
                    lambda store, i=i: (store.trigger("job", i + 1), threading.get_ident()), soon=True
                )
                where.append(made[1])
                largest = max(largest, os.stat(db + "-wal").st_size)
        assert where.count(loop_thread) > 200  # (most of them)
        assert checkpoints and loop_thread not in checkpoints
        assert largest < 2 * al._WAL_LIMIT

    run(main())


def _wal_begun(path):
    """How many times the WAL beside ``path`` was begun anew (its header's checkpoint sequence)."""
    with open(path + "-wal", "rb") as wal:
        wal.seek(12)
        return int.from_bytes(wal.read(4), "big")


@pytest.mark.sqlite_only  # (SQLite's write-ahead log)
def test_a_commit_on_the_loops_thread_never_begins_the_wal_anew_after_another_process_wrote_it_back(db, monkeypatch):
    """The first commit into a WAL begun anew syncs its header (``synchronous = NORMAL``), and a
    commit made on the loop's thread must not wait for the disk: a process that writes the whole
    WAL back begins it anew itself at once (``_write_back``), so that the next commit of another
    process, made on its loop's thread, only adds to it. (Two schedulers of one process stand for
    two processes: each has a connection of its own.)"""
    monkeypatch.setattr(al, "_WAL_LIMIT", 32 * 1024)
    written_back = []

    async def main():
        async with _held_link(db) as a, _held_link(db) as b:
            conn = await b.call(lambda store: store._connect())
            conn.set_trace_callback(lambda sql: written_back.append(1) if "wal_checkpoint" in sql else None)
            loop_thread, after = threading.get_ident(), []
            for i in range(200):
                await b.call(lambda store, i=i: store.trigger("job", 10_000 + i))  # (on b's thread)
                back, begun = len(written_back), _wal_begun(db)
                thread = await a.call(lambda store, i=i: (store.trigger("job", i), threading.get_ident())[1], soon=True)
                after.append((back, thread, begun, _wal_begun(db)))
        looked = [(thread, before, now) for back, thread, before, now in after if thread == loop_thread]
        assert written_back and looked  # (b wrote the WAL back, a committed on its loop's thread)
        assert all(before == now for _, before, now in looked), after

    run(main())


@pytest.mark.sqlite_only  # (calls made on the loop's thread: SQLite's alone)
def test_a_call_whose_loop_closed_before_its_answer_leaves_the_next_calls_on_the_loops_thread(db):
    """A call from another event loop (a web request's ``asyncio.run`` asking ``status()`` with a
    timeout, while the scheduler runs in a thread of its own) whose loop is closed before the
    store's thread answers is counted off there: its answer never reaches a loop to count it, and
    no later call would be made on the loop's thread again (found by a review)."""
    let_go = threading.Event()

    async def main():
        async with _held_link(db) as link:
            here = threading.get_ident()
            assert await link.call(lambda store: threading.get_ident(), soon=True) == here

            def elsewhere():
                async def ask():
                    link.submit(lambda store: let_go.wait(10), lambda *answer: None)

                asyncio.run(ask())  # (its loop closed before the thread answers)
                let_go.set()

            other = threading.Thread(target=elsewhere)
            other.start()
            await asyncio.get_running_loop().run_in_executor(None, other.join)
            await wait_for(lambda: not link._thread._queued, message="the call counted off")
            assert [await link.call(lambda store: threading.get_ident(), soon=True) for _ in range(5)] == 5 * [here]

    run(main())


async def _answers_of_a_call_hit_by_a_signal(link, work):
    """Submit ``work`` to be made on the loop's thread, which it interrupts there with SIGUSR1,
    whose handler raises ``SystemExit`` (as an application's own SIGTERM handler may): the
    exception goes on, and the call's answers, once it has one, are returned."""

    def on_signal(signum, frame):
        raise SystemExit(0)

    answers, before = [], signal.signal(signal.SIGUSR1, on_signal)
    try:
        with pytest.raises(SystemExit):
            link.submit(work, lambda result, exc: answers.append((result, exc)), soon=True)
    finally:
        signal.signal(signal.SIGUSR1, before)
    await wait_for(lambda: answers, message="the call answered")
    return answers


@pytest.mark.sqlite_only  # (calls made on the loop's thread: SQLite's alone)
def test_a_signal_in_the_middle_of_a_call_made_on_the_loops_thread_does_not_lose_the_call(db):
    """A signal handler that raises (``sys.exit`` on SIGTERM, ``KeyboardInterrupt``) runs on the
    main thread, which may be in the middle of a store call made there: the exception goes on, and
    the call, rolled back, is made on the store's thread and answered (an end taken from the
    runner's queue would otherwise never be written; found by a review)."""
    hit = []

    def work(store):
        if threading.current_thread() is threading.main_thread() and not hit:
            hit.append(1)
            os.kill(os.getpid(), signal.SIGUSR1)  # (its handler runs on this thread at once)
        return store.trigger("job", 1000)

    async def main():
        async with _held_link(db) as link:
            assert await _answers_of_a_call_hit_by_a_signal(link, work) == [(1000, None)]
            assert hit  # (begun on the loop's thread, and the signal came then)

    run(main())


def test_a_look_that_reads_many_rows_reads_the_next_time_on_the_stores_thread(db):
    """A look's read is made on the loop's thread only after one that found few rows, and a read
    of every job never: thousands of rows read there would hold every handler and timer on the
    loop meanwhile (found by a review)."""
    where = []

    def noting(original, *args, **kwargs):
        where.append(threading.get_ident())
        return original(*args, **kwargs)

    async def main():
        s = make(db, store=faulty(jobs=noting))
        for i in range(1500):
            s.every(f"job{i}", "24h", lambda ctx: None, offset=QUIET)
        link = s._link
        link.held = True
        try:
            await link.call(lambda store: None)
            await s._loop._read()  # (every row, as at the start and every _FULL_READ)
            await s._loop._read()  # (the rows changed since: none, but the last read found many)
            assert threading.get_ident() not in where
        finally:
            link.held = False
            link.close(wait=True)

    run(main())


@pytest.mark.sqlite_only  # (calls made on the loop's thread: SQLite's alone)
def test_an_answer_left_in_a_loop_stopped_then_closed_holds_up_no_other_loop(db):
    """An answer handed to a loop that has stopped but is not yet closed is never counted there
    (the loop closes with it queued): the count is kept by loop, so that only that one's calls are
    held off the loop's thread (found by a review)."""
    let_go = threading.Event()

    async def main():
        async with _held_link(db) as link:
            here = threading.get_ident()

            def elsewhere():
                loop = asyncio.new_event_loop()

                async def ask():
                    link.submit(lambda store: let_go.wait(10), lambda *answer: None)

                loop.run_until_complete(ask())  # (stopped, not closed)
                let_go.set()
                deadline = time.monotonic() + 10
                while not loop._ready and time.monotonic() < deadline:  # (the answer handed to it)
                    let_go.wait(0.01)
                loop.close()

            other = threading.Thread(target=elsewhere)
            other.start()
            await asyncio.get_running_loop().run_in_executor(None, other.join)
            assert [await link.call(lambda store: threading.get_ident(), soon=True) for _ in range(5)] == 5 * [here]

    run(main())


@pytest.mark.sqlite_only  # (calls made on the loop's thread: SQLite's alone)
def test_a_signal_right_after_a_commit_on_the_loops_thread_does_not_have_the_call_made_again(db):
    """A signal's exception that comes once a call's commit has landed (before the store noted
    it) has the call answered with it, never made a second time (found by a review)."""
    hit = []

    def work(store):
        if threading.current_thread() is threading.main_thread() and not hit:
            committed = store._committed

            def after_commit():  # (COMMIT has returned: the first Python code run after it)
                del store._committed
                hit.append(1)
                os.kill(os.getpid(), signal.SIGUSR1)  # (as if it had come while COMMIT ran)
                committed()

            store._committed = after_commit
        return store.trigger("job", 1000)

    async def main():
        async with _held_link(db) as link:
            answers = await _answers_of_a_call_hit_by_a_signal(link, work)
            assert hit and [(result, type(exc)) for result, exc in answers] == [(None, SystemExit)]
            assert [run.slot for run in await link.call(lambda store: store.runs())] == [1000]

    run(main())
