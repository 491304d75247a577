"""The control API and the lifecycle: pause, resume, trigger, cancel; stopping and handing
over; leases running out and takeover; a store that fails or cannot be used; listeners."""

import asyncio
import ctypes
import logging
import os
import select
import sqlite3
import threading
import time

import pytest
from conftest import QUIET, ManualClock, coalesced, counting_looks, faulty, run, wait_for
from schedulers import (
    HOUR,
    aligned,
    expire,
    has,
    looks_pass,
    make,
    next_slot,
    statuses,
)

import anarchon_lite
from anarchon_lite import (
    Cancelled,
    ConfigError,
    JobNotFound,
    LeaseLost,
    Scheduler,
    StoreError,
)


@pytest.fixture
def db(store):
    """Every test here runs on both stores (``store``), unless marked ``sqlite_only``."""
    return store


def test_pause_resume_trigger_cancel(db, clock):
    aligned(clock, 60)
    seen = []

    async def main():
        counted, looks = counting_looks()
        s = make(db, clock, store=counted)
        gate = asyncio.Event()

        @s.every("p", "1m")
        async def handler(ctx):
            seen.append(ctx.slot)
            try:
                await ctx.signal.run(gate.wait())
            except Cancelled:
                seen.append("cancelled")
                raise

        other = make(db, clock)  # a process that only inspects and controls the file
        async with s:
            await other.pause("p")
            clock.advance(120)
            await looks_pass(s, looks)
            assert seen == []
            status = {j.name: j for j in await other.status()}
            assert status["p"].paused
            await other.resume("p")
            next_slot(clock, 60)
            await wait_for(lambda: len(seen) == 1)
            assert not await has(s, "p", "missed")  # a pause is not downtime
            status = {j.name: j for j in await other.status()}
            assert status["p"].runs[0].state == "running" and status["p"].runs[0].attempt == 1
            await other.cancel("p")
            await wait_for(lambda: has(s, "p", "cancelled"))
            gate.set()
            slot = await other.trigger("p")
            await wait_for(lambda: slot in seen)
            await wait_for(lambda: has(s, "p", "succeeded"))
        assert seen[1] == "cancelled"
        for call in (other.pause, other.resume, other.trigger):  # a distinct error: a web app's 404
            with pytest.raises(JobNotFound, match="'nope'"):
                await call("nope")
        assert issubclass(JobNotFound, ConfigError)

    run(main())


def test_trigger_slots_are_unique(db, clock):
    async def main():
        s = make(db, clock)
        s.every("t", "1h", lambda ctx: None)
        slots = [await s.trigger("t") for _ in range(3)]
        assert slots == [slots[0], slots[0] + 1, slots[0] + 2]
        assert slots[0] == int(clock.time() * 1000)

    run(main())


def test_a_trigger_on_the_next_scheduled_millisecond_fails_no_claim(db, clock):
    """A run triggered at the very millisecond of the job's next occurrence is that occurrence's
    run (one run, not a failed claim), and the claims made beside it go on: an unrelated job due in
    the same look runs, not ``missed``; the job's next occurrence is not ``skipped``."""
    aligned(clock, HOUR)
    ran = []

    async def main():
        s = make(db, clock)
        s.every("t", "1h", lambda ctx: ran.append(("t", ctx.slot)))
        s.every("other", "1h", lambda ctx: ran.append(("other", ctx.slot)))
        await s.status()  # the jobs are in the store, from half a second before the hour
        clock.advance(0.5)  # the very millisecond of the next occurrence, before any look
        boundary = int(clock.time() * 1000)
        assert boundary % 3_600_000 == 0
        assert await s.trigger("t") == boundary
        async with s:
            await wait_for(lambda: _ended(s, 2), message="two ends")
            next_slot(clock, HOUR)
            await wait_for(lambda: _ended(s, 4), message="the next hour's two ends")
            records = await s.history(limit=100)
        later = boundary + 3_600_000
        assert sorted(ran) == [("other", boundary), ("other", later), ("t", boundary), ("t", later)]
        assert sorted((r.job, r.slot, r.status) for r in records) == [
            ("other", boundary, "succeeded"),
            ("other", later, "succeeded"),
            ("t", boundary, "succeeded"),
            ("t", later, "succeeded"),
        ]

    run(main())


async def _ended(s, count):
    return sum(r.status == "succeeded" for r in await s.history(limit=100)) >= count


def test_graceful_stop_hands_over_with_checkpoint(db):
    log = []

    async def main():
        a, b = make(db, instance="a"), make(db, instance="b")
        for s in (a, b):

            @s.every("export", "24h", offset=QUIET, lease="30s")
            async def export(ctx):
                after = await ctx.checkpoint.get(0)
                log.append((ctx.instance, ctx.attempt, "start", after))
                while after < 10:
                    ctx.signal.throw_if_aborted()
                    await asyncio.sleep(0.02)
                    after += 1
                    await ctx.checkpoint.set(after)
                    if ctx.instance == "a" and after == 4:
                        await asyncio.sleep(30)
                await ctx.checkpoint.delete()
                log.append((ctx.instance, ctx.attempt, "done", after))

        async with a:
            await a.trigger("export")
            await wait_for(lambda: any(e[2] == "start" for e in log))
            await wait_for(lambda: a._loop.runner.running)
            slot = next(iter(a._loop.runner.running))[1]

            async def at_four():  # where a's attempt stops to wait (30 s)
                return await a.checkpoints.get("export", slot) == 4

            await wait_for(at_four, message="the checkpoint at 4")
            async with b:
                await a.stop(grace=5)
                await wait_for(lambda: any(e[2] == "done" for e in log))
        assert log[0][:2] == ("a", 1) and log[1] == ("b", 2, "start", 4) and log[2] == ("b", 2, "done", 10)
        assert [st for _, _, st in await statuses(b)] == ["interrupted", "succeeded"]
        assert await b.checkpoints.get("export", slot) is None

    run(main())


def test_stop_without_peer_leaves_the_run_for_the_next_start(db):
    async def main():
        a = make(db, instance="a")

        @a.every("job", "24h", offset=QUIET)
        async def job(ctx):
            if ctx.attempt == 1:
                await asyncio.sleep(60)

        async with a:
            await a.trigger("job")
            await wait_for(lambda: a._loop.runner.running)
            await a.stop(grace="200ms")
        assert [st for _, _, st in await statuses(a)] == ["interrupted"]
        b = make(db, instance="b")
        b.every("job", "24h", job, offset=QUIET)
        async with b:
            await wait_for(lambda: has(b, "job", "succeeded"))
        assert [(at, st) for _, at, st in await statuses(b)] == [(1, "interrupted"), (2, "succeeded")]

    run(main())


def test_plain_function_handler_ignoring_shutdown_is_fenced_off(db):
    finished = threading.Event()
    results = []

    async def main():
        a = make(db, instance="a")

        @a.every("stuck", "24h", offset=QUIET, grace="100ms")
        def stuck(ctx):
            time.sleep(0.8)
            try:
                ctx.checkpoint.set_sync("late write")
            except LeaseLost as exc:
                results.append(exc)
            finished.set()

        async with a:
            await a.trigger("stuck")
            await wait_for(lambda: a._loop.runner.running)
            await a.stop(grace="100ms")
            assert [st for _, _, st in await statuses(a)] == ["interrupted"]
            await asyncio.get_running_loop().run_in_executor(None, finished.wait, 10)
        assert len(results) == 1

    # the handler's thread outlives the scheduler's loop here; give it one of its own to call into
    run(main())


def test_a_handler_swallowing_cancellation_is_closed_and_the_stop_hands_it_over(db):
    closed = []

    async def main():
        a, b = make(db, instance="a"), make(db, instance="b")

        async def stubborn(ctx):
            if ctx.instance == "b":
                return
            try:
                while True:
                    try:
                        await asyncio.sleep(60)
                    except asyncio.CancelledError:
                        pass  # carries on, every time
            finally:
                closed.append(ctx.attempt)

        for s in (a, b):
            s.every("stubborn", "24h", stubborn, offset=QUIET, grace="200ms")
        async with a:
            await a.trigger("stubborn")
            await wait_for(lambda: a._loop.runner.running)
            async with b:
                started = time.monotonic()
                await a.stop(grace="200ms")
                stopped = time.monotonic() - started
                await wait_for(lambda: has(b, "stubborn", "succeeded"))
        assert closed == [1] and stopped < 10
        assert [(att, st) for _, att, st in await statuses(b)] == [(1, "interrupted"), (2, "succeeded")]
        # nothing of it is left for asyncio.run to wait for at exit
        assert not [t for t in asyncio.all_tasks() if "stubborn" in repr(t) or "_await" in repr(t)]

    run(main())


def test_lease_expiry_takeover_fences_the_old_attempt(db, lease_clock):
    clock, events = lease_clock, []
    lease = 30 if isinstance(clock, ManualClock) else 1

    async def main():
        a, b = make(db, clock, instance="a"), make(db, clock, instance="b")
        go = asyncio.Event()
        for s in (a, b):

            @s.every("work", "1h", lease=lease)
            async def work(ctx):
                events.append((ctx.instance, ctx.attempt))
                if ctx.instance == "a":
                    await go.wait()
                    try:
                        await ctx.checkpoint.set("stale")
                    except LeaseLost:
                        events.append(("a", "refused", ctx.signal.reason.__class__.__name__))
                        raise
                else:
                    await ctx.checkpoint.set("fresh")

        async with a:
            await a.trigger("work")
            await wait_for(lambda: events == [("a", 1)])
            a._loop.heartbeats.stop()  # a freezes: no more renewals
            async with b:
                await expire(clock, lease + 1)
                await wait_for(lambda: ("b", 2) in events)
                await wait_for(lambda: has(b, "work", "succeeded"))
                go.set()
                await wait_for(lambda: len(events) == 3)
        assert events[2] == ("a", "refused", "LeaseLost")
        slot = (await b.history("work"))[0].slot
        assert await b.checkpoints.get("work", slot) == "fresh"
        assert [(at, st) for _, at, st in await statuses(b)] == [(1, "interrupted"), (2, "succeeded")]

    run(main())


async def freeze_its_run(b):
    """Trigger ``job`` on ``b`` and, once its attempt runs, stop ``b``'s renewals: a frozen owner."""
    await b.trigger("job")
    await wait_for(lambda: b._loop.runner.running)
    b._loop.heartbeats.stop()


async def taken_over(c, clock, done, message="the takeover"):
    """Run ``c`` until, its lease run out, the frozen owner's run is ended and ``done()`` holds."""
    async with c:
        await expire(clock, 2)
        await wait_for(done, message=message)


def test_max_attempts(db, lease_clock):
    clock = lease_clock

    async def main():
        a = make(db, clock, instance="a")
        a.every("job", "1h", lambda ctx: None, max_attempts=1)
        async with a:
            await a.trigger("job")
            # simulate a crash of attempt 1: hand the row back as if its owner vanished
            await wait_for(lambda: has(a, "job", "succeeded"))
        b = make(db, clock, instance="b")
        gate = threading.Event()
        b.every("job", "1h", lambda ctx: gate.wait(5), max_attempts=1, lease="1s")
        c = make(db, clock, instance="c")
        c.every("job", "1h", lambda ctx: None, max_attempts=1, lease="1s")
        async with b:
            await freeze_its_run(b)
            await taken_over(c, clock, lambda: has(c, "job", "failed"))
            gate.set()
        records = [r for r in await c.history("job") if r.status == "failed"]
        assert "max_attempts" in records[0].error

    run(main())


def test_a_run_failed_for_good_by_max_attempts_on_takeover_is_told_once_by_the_process_that_ended_it(db, lease_clock):
    """Attempt 1 stops renewing (frozen); the process that finds its lease run out ends the run
    ``failed`` (max_attempts=1) and alone tells ``on_failure``; the frozen attempt's own end,
    later, is refused and tells nothing."""
    clock = lease_clock
    told = {"b": [], "c": []}

    async def main():
        b = make(db, clock, instance="b")
        gate = threading.Event()

        def frozen(ctx):
            gate.wait(5)
            raise RuntimeError("woke up failed")  # (its end, were it written, would be told)

        b.every("job", "24h", frozen, offset=QUIET, max_attempts=1, lease="1s", on_failure=told["b"].append)
        c = make(db, clock, instance="c")
        c.every("job", "24h", lambda ctx: None, offset=QUIET, max_attempts=1, lease="1s", on_failure=told["c"].append)
        async with b:
            await freeze_its_run(b)
            await taken_over(c, clock, lambda: told["c"], "c tells of the failure")
            gate.set()
        (record,) = told["c"]
        assert (record.attempt, record.status, record.instance) == (1, "failed", "b")
        assert "max_attempts" in record.error
        assert told["b"] == []  # (b's attempt failed after its run was ended: its end was refused, not told)

    run(main())


def test_a_run_failed_by_max_attempts_is_told_though_pruning_drops_its_record(db, lease_clock):
    """The run's last attempt is an old record (newer ``skipped`` ones came while it ran); ending
    the run prunes the history (``retention=1``) and drops it. The end is still told, and the
    looks go on (reading the record back after the prune failed every look from then on: the run
    stayed ``running`` for ever)."""
    clock = lease_clock
    told = []

    async def main():
        b = make(db, clock, instance="b")
        gate = threading.Event()
        b.every("job", "24h", lambda ctx: gate.wait(5), offset=QUIET, max_attempts=1, lease="1s")
        c = make(db, clock, instance="c", retention=1)
        c.every("job", "24h", lambda ctx: None, offset=QUIET, max_attempts=1, lease="1s", on_failure=told.append)
        async with b:
            await freeze_its_run(b)
            for _ in range(2):
                await b.trigger("job")
            await wait_for(lambda: has(b, "job", "skipped", 2), message="two newer records")
            await taken_over(c, clock, lambda: told, "c tells of the failure")
            (job,) = await c.status()
            assert job.runs == ()
            gate.set()
        (record,) = told
        assert (record.attempt, record.status) == (1, "failed") and "max_attempts" in record.error

    run(main())


def test_transient_store_failures_do_not_stop_the_scheduler(db, caplog):
    failures = {"finish_many": 2, "renew_all": 2, "claim_due_many": 1}

    def flaky(name):
        def method(original, *args, **kwargs):
            if failures[name] > 0:
                failures[name] -= 1
                raise StoreError(db, "disk I/O error (injected)")
            return original(*args, **kwargs)

        return method

    async def main():
        s = make(db, store=faulty(**{name: flaky(name) for name in failures}))

        @s.every("steady", "24h", offset=QUIET, lease="1s", overlap="allow")
        async def steady(ctx):
            await asyncio.sleep(1.2)  # several renewals (every 1/3 s), the first two of which fail (retried in 0.2 s)

        @s.every("often", "200ms")
        async def often(ctx):
            return None

        async with s:
            await s.trigger("steady")
            await wait_for(lambda: has(s, "steady", "succeeded"))
            await wait_for(lambda: has(s, "often", "succeeded"))
        assert failures == {"finish_many": 0, "renew_all": 0, "claim_due_many": 0}
        assert [(at, st) for _, at, st in await statuses(s, "steady")] == [(1, "succeeded")]

    with caplog.at_level(logging.WARNING, logger="anarchon_lite"):
        run(main())
    assert any("injected" in r.getMessage() for r in caplog.records)


# (SQLite only: files that cannot be used; a server that cannot be used is in test_postgres.py)
def test_a_file_that_cannot_be_used_fails_run_at_once(tmp_path):
    path = tmp_path / "junk.db"
    path.write_bytes(b"not a database at all" * 200)

    async def main():
        s = Scheduler(str(path))
        s.every("j", "1h", lambda ctx: None)
        with pytest.raises(StoreError) as info:
            async with s:
                pass
        assert info.value.path == str(path)

    run(main())


def test_an_idle_scheduler_is_woken_by_other_processes_writes(db):
    """Without ``poll``, changes to the file wake the scheduler (inotify) instead of polling."""

    async def main():
        worker = Scheduler(db)  # default: woken by writes to the file
        ran = []
        worker.every("woken", "24h", lambda ctx: ran.append(time.monotonic()), offset=QUIET)
        controller = Scheduler(db)
        async with worker:
            await asyncio.sleep(0.2)
            started = time.monotonic()
            await controller.trigger("woken")
            await wait_for(lambda: ran)
        # a polling scheduler would have needed up to its poll interval; the watch is immediate
        assert ran[0] - started < 1.0

    run(main())


@pytest.mark.parametrize("write", ["trigger", "cancel", "pause", "resume"])
def test_what_another_process_asks_is_read_at_once_however_long_reads_are_coalesced(db, monkeypatch, write):
    """A trigger, a cancel, a pause or a resume that another process (or the command line) writes
    is read at once by a running process, not with the others' claims and ends it reads together
    (every ``coalesce``, made an hour here): the store tells it apart (SQLite: the database file's
    times touched; PostgreSQL: the notification's payload)."""
    coalesced(monkeypatch, 3600.0)
    started, aborted = [], []

    async def main():
        worker, controller = make(db, poll=None), make(db)  # (told of changes, not polling)

        @worker.every("long", "24h", offset=QUIET)
        async def long(ctx):
            started.append(ctx.slot)
            try:
                await ctx.signal.wait()
            finally:
                aborted.append(type(ctx.signal.reason).__name__)

        worker.every("idle", "24h", lambda ctx: None, offset=QUIET)

        def paused():
            return worker._loop._agenda.rows["idle"].paused

        async with worker:
            await wait_for(lambda: worker._loop.ready is not None and worker._loop.ready.is_set())
            if write == "cancel":
                await worker.trigger("long")  # (its own write: read at once)
                await wait_for(lambda: started, message="the long run, started")
            if write == "resume":
                await worker.pause("idle")
                await wait_for(paused, message="idle, paused by the worker")
            await getattr(controller, write)("long" if write in ("trigger", "cancel") else "idle")
            if write == "trigger":
                await wait_for(lambda: started, message="the run triggered, started")
            elif write == "cancel":
                await wait_for(lambda: aborted == ["Cancelled"], message="the run, cancelled")
            else:
                await wait_for(lambda: paused() == (write == "pause"), message=f"the {write}, read")

    run(main(), timeout=60)


def test_changes_told_in_a_burst_are_read_together(db):
    """A process told of a hundred pauses and resumes in a burst (on PostgreSQL every commit is told
    to every process, NOTIFY; what is asked of every process is told apart on both stores) reads
    them at most once every 50 ms, not once each, and still sees the last of them. (Not triggers:
    a process reads and claims each run triggered of its jobs as it comes.)"""
    reads = []

    def counted(original, *args):
        reads.append(time.monotonic())
        return original(*args)

    async def main():
        a = make(db, instance="a", poll=None)
        b = make(db, instance="b", poll=None, store=faulty(runs=counted))
        for s in (a, b):
            s.every("burst", "24h", lambda ctx: None, offset=QUIET)
        async with b:
            await wait_for(lambda: b._loop.ready is not None and b._loop.ready.is_set(), message="b ready")
            began = time.monotonic()
            for n in range(100):
                await (a.pause if n % 2 == 0 else a.resume)("burst")
            ended = time.monotonic()
            await wait_for(lambda: reads and reads[-1] > ended, message="b to read the last")
        during = [t for t in reads if began <= t <= ended]
        assert len(during) <= (ended - began) / 0.05 + 2, f"{len(during)} reads in {ended - began:.2f} s"

    run(main(), timeout=60)


@pytest.mark.parametrize("draining", [False, True], ids=["", "while it drains another run"])
def test_a_run_handed_over_is_read_at_once_by_a_process_whose_changes_are_held(db, monkeypatch, draining):
    """A stopping process hands each run over as its handler returns, and another process reads
    it at once, though the changes told it wait for the coalescing (here an hour): on PostgreSQL it
    read them only then, or at its next read of the runs, and a hand-over took 0.33 s (p50), up to
    0.51 s; on SQLite, only when the stopping process's liveness socket closed, after it drained its
    other runs (found by a review). (PostgreSQL: the notification's payload; SQLite: the file's
    times touched, and the liveness socket.)"""
    coalesced(monkeypatch, 3600.0)
    clock = ManualClock()  # (no read of the runs comes due by itself)
    started = []

    async def export(ctx):
        started.append((ctx.instance, ctx.attempt))
        if ctx.attempt == 1:
            await ctx.signal.sleep(3600)  # (raises Shutdown at the stop: handed over)

    async def main():
        release = asyncio.Event()  # (made on the running loop: Python 3.9 binds it at birth)

        async def slow(ctx):
            if ctx.instance == "a":
                try:
                    await ctx.signal.wait()
                finally:
                    await release.wait()  # (its grace, taken until the test lets it go)

        a = make(db, instance="a", clock=clock, poll=None)
        b = make(db, instance="b", clock=clock, poll=None)
        for s in (a, b):
            s.every("export", "24h", export, offset=QUIET)
            s.every("slow", "24h", slow, offset=QUIET, grace="1h")  # (not cancelled after the 10 s default)
        try:
            async with a:
                await a.trigger("export")
                if draining:
                    await a.trigger("slow")
                await wait_for(lambda: len(a._loop.runner.running) == 1 + draining, message="the runs on a")
                async with b:
                    await wait_for(lambda: b._loop.ready is not None and b._loop.ready.is_set(), message="b read")
                    stopping = asyncio.ensure_future(a.stop(grace=60))
                    await wait_for(lambda: ("b", 2) in started, message="attempt 2 of export on b (slow still on a)")
                    release.set()
                    await stopping
        finally:
            release.set()

    run(main(), timeout=60)


def _inotify_descriptors() -> int:
    """How many inotify descriptors this process holds."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}") == "anon_inode:inotify"
        except OSError:
            pass
    return count


@pytest.mark.sqlite_only  # (the file watch is SQLite's)
def test_a_start_refused_leaves_no_watch_open(tmp_path):
    """A scheduler refused as it starts (here its liveness directory may be written by every user)
    leaves no inotify descriptor open, nor reading on the event loop: each refused start left two
    (found by a review)."""
    db = str(tmp_path / "jobs.db")
    anarchon_lite._SQLiteStore(db).close()
    os.mkdir(db + "-live")
    os.chmod(db + "-live", 0o777)

    async def main():
        s = make(db, poll=None)
        s.every("x", "24h", lambda ctx: None, offset=QUIET)
        before = _inotify_descriptors()
        for _ in range(3):
            with pytest.raises(StoreError, match="liveness"):
                await s.run()
        assert _inotify_descriptors() == before

    run(main())


@pytest.mark.sqlite_only  # (the file watch is SQLite's)
def test_a_process_without_a_second_inotify_descriptor_keeps_the_watch_of_the_wal(tmp_path, monkeypatch):
    """Without a second inotify descriptor (the user's ``max_user_instances`` reached), the watch
    of what another process asks is gone, not the watch of the -wal: the process is still woken by
    commits, and reads the others' changes every 0.5 s, as before they were told apart."""
    db = str(tmp_path / "jobs.db")
    anarchon_lite._SQLiteStore(db).close()
    real = ctypes.CDLL(None, use_errno=True)

    class SecondRefused:  # (libc, whose second inotify_init1 fails: EMFILE)
        made = 0

        def inotify_init1(self, flags):
            self.made += 1
            return -1 if self.made == 2 else real.inotify_init1(flags)

        def __getattr__(self, name):
            return getattr(real, name)

    libc = SecondRefused()
    monkeypatch.setattr(ctypes, "CDLL", lambda *args, **kwargs: libc)
    loop = asyncio.new_event_loop()
    try:
        changes = anarchon_lite._SQLiteChanges(db, anarchon_lite.Clock(), loop, lambda: None, False, "me")
        try:
            assert changes.pushed and not changes._files.asks
            assert changes.coalesce == 0.5 and anarchon_lite._SQLiteChanges.coalesce == 0.8
        finally:
            changes.close()
    finally:
        loop.close()


def test_what_is_asked_waits_for_the_back_off_of_a_failing_process(db):
    """While its looks fail, a process backs off (0.5 s doubling to 5 s) whatever the others write;
    what another process asks (here a pause) waits for the back-off too: it planned a look of its
    own, and a failing process looked about five times a second (found by a review)."""
    failing, planned = [], []

    def runs(original, *args):
        if failing:
            raise StoreError(db, "the runs cannot be read (injected)")
        return original(*args)

    async def main():
        b = make(db, instance="b", poll=None, store=faulty(runs=runs))
        a = make(db, instance="a")
        for s in (a, b):
            s.every("x", "24h", lambda ctx: None, offset=QUIET)
        asked = b._loop._asked

        def noted():
            asked()
            planned.append(b._loop._asking is not None)

        b._loop._asked = noted  # (before it starts: the watch is given the method)
        async with b:
            await wait_for(lambda: b._loop.ready is not None and b._loop.ready.is_set(), message="b looking")
            failing.append(1)
            b._loop.poke()
            await wait_for(lambda: b._loop._backing_off, message="b backing off")
            await a.pause("x")
            await wait_for(lambda: planned, message="the pause, told to b")
            failing.clear()
        assert planned[0] is False

    run(main(), timeout=60)


@pytest.mark.sqlite_only  # (the file watch is SQLite's)
def test_other_files_written_in_the_directory_do_not_wake_the_watch(tmp_path):
    """Only the database's own files wake a scheduler: an app's log or data file beside it, written
    all the time, queues nothing on the watch (inotify queues an event as the write returns)."""
    db, neighbour = tmp_path / "jobs.db", tmp_path / "app.log"
    neighbour.write_text("")
    conn = sqlite3.connect(db, isolation_level=None)
    loop = asyncio.new_event_loop()
    told = []
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE t (x)")
        watch = anarchon_lite._FileWatch.start(str(db), loop, lambda: told.append(1))
        assert watch is not None
        try:
            with open(neighbour, "a") as log:
                for n in range(50):
                    log.write(f"line {n}\n")
                    log.flush()
            assert select.select([watch._fd], [], [], 0)[0] == []
            conn.execute("INSERT INTO t VALUES (1)")  # a commit: the -wal grows
            assert select.select([watch._fd], [], [], 5)[0] == [watch._fd]
            watch._read()
            assert told == [1]
        finally:
            watch.close()
    finally:
        loop.close()
        conn.close()


def test_a_stop_while_starting_is_kept(db):
    """SIGTERM can arrive while the scheduler is still joining the file: it must still stop."""
    joining = threading.Event()

    def slow_join(join, *args):
        joining.set()
        time.sleep(0.3)  # the join's transaction, still in progress when the stop comes
        return join(*args)

    async def main():
        s = make(db, store=faulty(join=slow_join))
        s.every("job", "1h", lambda ctx: None)
        runner = asyncio.ensure_future(s.run())
        await wait_for(joining.is_set, message="the join to start")
        await s.stop()
        await asyncio.wait_for(runner, 10)

    run(main())


def test_on_event_tells_listeners_what_happens_to_runs_and_survives_a_failing_one(db, clock, caplog):
    aligned(clock, 60)
    events = []

    def broken_listener(event):
        raise RuntimeError("the metrics server is down")

    async def main():
        s = make(db, clock)
        s.every("ok", "1m", lambda ctx: None)
        s.every("bad", "1m", lambda ctx: 1 / 0)
        s.on_event(broken_listener)
        remove = s.on_event(events.append)
        async with s:
            clock.advance(1)
            await wait_for(lambda: has(s, "ok", "succeeded"))
            await wait_for(lambda: has(s, "bad", "failed"))
            await wait_for(lambda: len(events) >= 4)
            remove()
            await s.trigger("ok")
            await wait_for(lambda: has(s, "ok", "succeeded", 2))
        return s.instance

    with caplog.at_level(logging.ERROR, logger="anarchon_lite"):
        instance = run(main())
    kinds = sorted((e.job, e.kind) for e in events)
    assert kinds == [("bad", "failed"), ("bad", "started"), ("ok", "started"), ("ok", "succeeded")], kinds
    failed = next(e for e in events if e.kind == "failed")
    assert "ZeroDivisionError" in failed.error and failed.duration >= 0 and failed.instance == instance
    assert failed.attempt == 1 and failed.slot % 60_000 == 0
    assert any("on_event listener failed" in r.getMessage() for r in caplog.records)
