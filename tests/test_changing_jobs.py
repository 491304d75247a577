"""Jobs that change while the scheduler runs (declared, removed, rescheduled, from its loop or
another thread) and one-shot jobs (``at``): run once, kept across restarts, late ones caught up or
recorded missed. (Two real processes: test_multiprocess.py.)"""

import datetime as dt
import threading

import pytest
from conftest import QUIET, counting_looks, run, wait_for
from schedulers import HOUR, has, looks_pass, make, statuses

from anarchon_lite import ConfigError, JobNotFound, Scheduler


@pytest.fixture
def db(store):
    """Every test here runs on both stores (``store``), unless marked ``sqlite_only``."""
    return store


def test_a_one_shot_job_runs_once_at_its_time_and_not_again_after_a_restart(db, clock):
    when = clock.time() + 30
    seen = []

    async def main():
        first = make(db, clock)
        first.at("once", dt.datetime.fromtimestamp(when, dt.timezone.utc), lambda ctx: seen.append(ctx.slot))
        async with first:
            assert first.upcoming("once", 3) == [dt.datetime.fromtimestamp(when, dt.timezone.utc)]
            (job,) = await first.status()
            assert job.state == "active" and job.schedule.startswith("at ") and job.next_at.timestamp() == when
            clock.advance(31)
            await wait_for(lambda: has(first, "once", "succeeded"))
        counted, looks = counting_looks()
        again = make(db, clock, store=counted)  # restarted: the same declaration, the same time
        again.at("once", when, lambda ctx: seen.append(ctx.slot))
        async with again:
            clock.advance(HOUR)
            await looks_pass(again, looks)
            (job,) = await again.status()
            assert (job.state, job.next_at) == ("done", None)
        assert seen == [int(when * 1000)]
        assert await statuses(again) == [(int(when * 1000), 1, "succeeded")]

    run(main())


def test_a_one_shot_job_found_late_is_caught_up_or_recorded_missed(db, clock):
    """Its time passed while nothing ran (or before it was first declared): within ``catch_up``
    it runs, with its own time as the slot; later than that it is recorded ``missed``; no more
    than 5 s late it is on time."""
    seen = []

    async def main():
        now = clock.time()
        s = make(db, clock)
        s.at("late", now - 60, lambda ctx: seen.append(("late", ctx.slot)))
        s.at("caught", now - 60, lambda ctx: seen.append(("caught", ctx.slot)), catch_up="5m")
        s.at("in-time", now - 3, lambda ctx: seen.append(("in-time", ctx.slot)))
        async with s:
            await wait_for(lambda: has(s, "caught", "succeeded"))
            await wait_for(lambda: has(s, "in-time", "succeeded"))
            await wait_for(lambda: has(s, "late", "missed"))
            assert {job.name: job.state for job in await s.status()} == {
                "late": "done",
                "caught": "done",
                "in-time": "done",
            }
        assert sorted(seen) == [("caught", int((now - 60) * 1000)), ("in-time", int((now - 3) * 1000))]

    run(main())


def test_one_shot_times_are_read_as_documented_and_bad_ones_refused():
    s = Scheduler(":memory:")
    s.at("utc", "2030-01-02T03:04:05Z", lambda ctx: None)
    s.at("athens", "2030-01-02 03:04", lambda ctx: None, tz="Europe/Athens")  # naive: in its tz
    s.at("epoch", 1_900_000_000.5, lambda ctx: None)
    aware = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone(dt.timedelta(hours=-5)))
    s.at("aware", aware, lambda ctx: None)
    after = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    assert s.upcoming("utc", 2, after) == [dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)]
    assert s.upcoming("athens", 1, after) == [dt.datetime(2030, 1, 2, 1, 4, tzinfo=dt.timezone.utc)]
    assert s.upcoming("epoch", 1, after)[0].timestamp() == 1_900_000_000.5
    assert s.upcoming("aware", 1, after) == [aware]
    assert s.describe("utc") == "at 2030-01-02T03:04:05.000Z"
    for bad in ("tomorrow", None, True, float("nan"), [2030]):
        with pytest.raises(ConfigError) as info:
            s.at("bad", bad, lambda ctx: None)
        assert (info.value.job, info.value.option) == ("bad", "when")
    assert "bad" not in s.declared()


def test_jobs_declared_removed_and_rescheduled_while_running(db, clock):
    """``every`` and ``at`` called in a running scheduler take effect at its next look, and the
    store records them (``trigger`` accepts them at once after); ``remove`` stops them, running
    attempts carrying on; ``reschedule`` keeps the handler and options and goes on from now: the
    occurrences the new schedule had before now are not recorded missed."""
    seen = []

    async def main():
        s = make(db, clock)
        s.every("first", "24h", lambda ctx: seen.append(("first", ctx.slot)), offset=QUIET)
        async with s:
            s.every("added", "24h", lambda ctx: seen.append(("added", ctx.slot)), offset=QUIET, retries=2)
            await wait_for(lambda: _declared_in_store(s, "added"), message="added recorded")
            slot = await s.trigger("added")
            await wait_for(lambda: ("added", slot) in seen)
            clock.advance(600)  # ten minutes: nothing of either daily job comes due
            s.reschedule("first", every="1m")
            await wait_for(lambda: _schedule_in_store(s, "first", "every 1m"), message="the new schedule recorded")
            minute = (int(clock.time()) // 60 + 1) * 60
            clock.advance(minute - clock.time() + 0.5)
            await wait_for(lambda: ("first", minute * 1000) in seen, message="the new schedule's next minute")
            await wait_for(lambda: has(s, "first", "succeeded"), message="its end recorded")  # (after the handler)
            assert await statuses(s, "first") == [(minute * 1000, 1, "succeeded")]  # (nothing recorded missed)
            s.remove("added")
            await wait_for(lambda: _undeclared_in_store(s, "added"), message="added no longer declared")
            with pytest.raises(ConfigError, match="no running process declares it"):
                await s.trigger("added")
            assert s.declared() == ["first"]

    run(main())


def test_jobs_declared_from_another_thread_while_it_runs_in_a_thread(db):
    """``start_in_thread``, then ``every`` from the application's thread: the job runs, and
    another process's view of the store has it declared (it ran while ``status`` called it
    ``undeclared``, nothing having told the running process to record it)."""
    s = make(db)
    ran = threading.Event()
    s.every("first", "24h", lambda ctx: None, offset=QUIET)
    s.start_in_thread()
    try:
        s.every("later", "200ms", lambda ctx: ran.set())
        assert ran.wait(10), "the job declared from another thread did not run"
        run(wait_for(lambda: _declared_in_store(Scheduler(db), "later"), message="later declared in the store"))
    finally:
        s.stop_thread(grace=5)


def test_bad_changes_are_refused_and_change_nothing():
    s = Scheduler(":memory:")
    s.every("job", "1h", lambda ctx: None)
    with pytest.raises(JobNotFound):
        s.remove("nope")
    with pytest.raises(JobNotFound):
        s.reschedule("nope", every="1h")
    for kinds in ({}, {"every": "1h", "cron": "* * * * *"}):
        with pytest.raises(ConfigError) as info:
            s.reschedule("job", **kinds)
        assert (info.value.job, info.value.option) == ("job", "schedule")
    with pytest.raises(ConfigError) as info:
        s.reschedule("job", cron="61 * * * *")
    assert info.value.job == "job"
    assert s.describe("job") == "every 1h"
    s.reschedule("job", cron="0 3 * * *", tz="UTC")
    assert s.describe("job") == "cron 0 3 * * * UTC"


async def _declared_in_store(s, name):
    return any(job.name == name and job.state == "active" for job in await s.status())


async def _schedule_in_store(s, name, schedule):
    return any(job.name == name and job.schedule == schedule for job in await s.status())


async def _undeclared_in_store(s, name):
    return any(job.name == name and job.state == "undeclared" for job in await s.status())


def test_handlers_and_options_are_typed_for_a_type_checker(tmp_path):
    """A user script with three mistakes a type checker should catch (a handler without ``ctx``,
    a misspelt option, a duration that is a list): mypy --strict finds those three lines and no
    other (paths may be ``pathlib.Path``s). The options are checked for Python 3.11 and newer,
    where ``typing.Unpack`` is (the file imports nothing for it before): the check says so."""
    pytest.importorskip("mypy")  # (not installable on Python 3.9: pyproject's test extra skips it there)
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "user.py").write_text(
        "from pathlib import Path\n"
        "from anarchon_lite import Control, RunContext, Scheduler\n"
        "scheduler = Scheduler(Path('jobs.db'))\n"
        "control = Control(Path('jobs.db'))\n\n"
        "@scheduler.every('ok', '1h', retries=2, overlap='skip')\n"
        "async def ok(ctx: RunContext) -> None: ...\n\n"
        "def no_context() -> None: ...\n\n"
        "scheduler.every('one', '1h', no_context)\n"  # 1: a handler without ctx
        "scheduler.cron('two', '0 3 * * *', ok, retrys=2)\n"  # 2: a misspelt option
        "scheduler.at('three', '2030-01-01T00:00Z', ok, timeout=[5])\n"  # 3: a duration that is a list
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--python-version", "3.11", "user.py"],
        cwd=tmp_path,
        env={**env, "MYPYPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert sorted({int(line.split(":")[1]) for line in errors}) == [11, 12, 13], done.stdout + done.stderr


@pytest.mark.parametrize("change", [{"interval": "30m"}, {"interval": "1h", "jitter": "1s"}])
def test_a_schedule_changed_between_two_runs_of_the_program_keeps_its_catch_up(db, clock, change):
    """A deploy that changes a job (another interval, or only a jitter) while nothing ran: at the
    next start the job goes on from the watermark the store holds, so the occurrence missed while
    nothing ran is caught up (``catch_up``) and the older ones are recorded ``missed``; only a
    change made while the scheduler runs goes on from that moment."""
    from schedulers import aligned

    aligned(clock, HOUR)
    hour = int(clock.time() + 0.5) * 1000

    async def main():
        first = make(db, clock)
        first.every("job", "1h", lambda ctx: None, catch_up="2h")
        async with first:
            pass
        clock.advance(HOUR)
        second = make(db, clock)
        interval = change["interval"]
        second.every(
            "job", interval, lambda ctx: None, catch_up="2h", **{k: v for k, v in change.items() if k != "interval"}
        )
        async with second:
            await wait_for(lambda: has(second, "job", "succeeded"), message="the missed occurrence caught up")
        return await statuses(second, "job")

    found = run(main())
    if change["interval"] == "30m":
        assert found == [(hour, 0, "missed"), (hour + 1_800_000, 1, "succeeded")]
    else:
        assert found == [(hour, 1, "succeeded")]


def test_a_one_shot_job_paused_across_its_time_is_caught_up_or_recorded_missed_when_resumed(db, clock):
    """Resuming moves a job's watermark to now (what came due during the pause is not run); a
    one-shot job's time would then be lost without a trace, and the job called ``done``. Resumed,
    it is found late instead: run within ``catch_up``, else recorded ``missed``."""
    seen = []

    async def main():
        when = clock.time() + 60
        s = make(db, clock)
        s.at("caught", when, lambda ctx: seen.append("caught"), catch_up="1h")
        s.at("missed", when, lambda ctx: seen.append("missed"))
        async with s:
            for name in ("caught", "missed"):
                await s.pause(name)
            clock.advance(120)
            for name in ("caught", "missed"):
                await s.resume(name)
            await wait_for(lambda: has(s, "caught", "succeeded"))
            await wait_for(lambda: has(s, "missed", "missed"))
            assert {job.name: job.state for job in await s.status()} == {"caught": "done", "missed": "done"}
        assert seen == ["caught"]

    run(main())


def test_the_command_line_reads_a_one_shot_jobs_stored_schedule(db):
    """``next`` lists a one-shot job's time (it could not read ``at ...`` and left the job out)."""
    import subprocess
    import sys
    from pathlib import Path

    async def declare():
        s = Scheduler(db)
        s.at("launch", "2030-01-02T03:04:05Z", lambda ctx: None)
        await s.status()

    run(declare())
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run(
        [sys.executable, "-m", "anarchon_lite", "--db", db, "next", "-n", "3", "--utc"],
        env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.splitlines()[0] == "launch: at 2030-01-02T03:04:05.000Z"
    assert "2030-01-02 03:04:05 UTC" in done.stdout and done.stderr == "", done.stdout + done.stderr


def test_jobs_declared_from_many_threads_at_once_are_all_declared(db):
    """Eight threads declaring while the scheduler runs in its own, with the interpreter switching
    threads as often as it can: every declaration that returned is declared (a check, a copy and a
    replace with no lock lost a third of them)."""
    import sys

    s = make(db)
    s.every("first", "24h", lambda ctx: None, offset=QUIET)
    s.start_in_thread()
    switching = sys.getswitchinterval()
    try:
        sys.setswitchinterval(1e-6)

        def declare(thread):
            for n in range(200):
                s.every(f"job-{thread}-{n}", "24h", lambda ctx: None, offset=QUIET)

        threads = [threading.Thread(target=declare, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switching)
        s.stop_thread(grace=5)
    assert len(s.declared()) == 1 + 8 * 200
