"""Declaring jobs: bad declarations, the decorator and call forms, options, names, and what
the store records of them (disputes with other processes, jobs no process declares, change
numbers)."""

import logging
import sqlite3
from datetime import timedelta

import pytest
from conftest import QUIET, counting_looks, faulty, run, wait_for
from schedulers import (
    HOUR,
    aligned,
    has,
    make,
)

from anarchon_lite import (
    ConfigError,
    JobNotFound,
    Scheduler,
)


@pytest.fixture
def db(store):
    """Every test here runs on both stores (``store``), unless marked ``sqlite_only``."""
    return store


def test_bad_declarations():
    s = Scheduler(":memory:")
    s.every("dup", "1h", lambda ctx: None)
    with pytest.raises(ConfigError, match="already declared"):
        s.every("dup", "1h", lambda ctx: None)
    with pytest.raises(ConfigError, match="callable"):
        s.every("x", "1h", 42)
    with pytest.raises(ConfigError) as info:
        s.every("y", "1h", lambda ctx: None, overlap="sometimes")
    assert info.value.option == "overlap" and info.value.job == "y"
    with pytest.raises(ConfigError) as info:
        s.every("z", "1h", lambda ctx: None, colour="red")
    assert info.value.option == "colour"
    with pytest.raises(ConfigError) as info:
        s.every("w", "1x", lambda ctx: None)
    assert info.value.option == "interval"
    with pytest.raises(ConfigError) as info:
        s.every("v", "1h", lambda ctx: None, timeout="-5s")
    assert info.value.option == "timeout"
    with pytest.raises(ConfigError):
        s.every("u", "1h", lambda ctx: None, retries=-1)
    s.every("ok", "1h", lambda ctx: None, retries=1)  # (options are read once per set of values:
    with pytest.raises(ConfigError) as info:  # True equals 1, and is no count)
        s.every("t", "1h", lambda ctx: None, retries=True)
    assert (info.value.job, info.value.option) == ("t", "retries")
    assert set(s.declared()) == {"dup", "ok"}


def test_decorator_and_call_forms():
    s = Scheduler(":memory:")

    @s.cron("backup", "0 3 * * *", tz="Europe/Athens", timeout="50m")
    async def backup(ctx):
        return None

    s.every("export-2", "1h", backup, timeout=50 * 60)
    s.rrule("report", "FREQ=MONTHLY;BYDAY=-1FR;BYHOUR=17;BYMINUTE=0", backup)
    assert set(s._declared.jobs) == {"backup", "export-2", "report"} and s._declared.jobs["backup"].is_async


def test_leases_too_short_to_keep_and_durations_too_long_are_refused():
    s = Scheduler(":memory:")
    for options, option in (
        ({"lease": "1ms"}, "lease"),
        ({"lease": "200ms"}, "lease"),
        ({"retry_delay": "999999999999w"}, "retry_delay"),
        ({"timeout": 10**12}, "timeout"),
    ):
        with pytest.raises(ConfigError) as info:
            s.every("j", "1h", lambda ctx: None, **options)
        assert info.value.option == option and info.value.job == "j"
    with pytest.raises(ConfigError) as info:
        s.every("j", "999999999999w", lambda ctx: None)
    assert info.value.option == "interval" and "100 years" in str(info.value)
    s.every("j", "36500d", lambda ctx: None, lease="250ms", retries=10_000, retry_delay="36500d")
    assert s.upcoming("j", 1)


@pytest.mark.parametrize("name", ["two\nlines", "tab\there", "bell\a", "nul\0"])
def test_job_names_with_control_characters_are_refused(name):
    with pytest.raises(ConfigError, match="control character"):
        Scheduler(":memory:").every(name, "1h", lambda ctx: None)


def test_two_processes_declaring_one_job_differently_are_told(db, caplog):
    caplog.set_level(logging.WARNING, logger="anarchon_lite")

    async def main():
        a, b = make(db, instance="a"), make(db, instance="b")
        a.every("report", "1h", lambda ctx: None)
        b.every("report", "5m", lambda ctx: None)
        async with a:
            async with b:
                await wait_for(lambda: len([r for r in caplog.records if "declared differently" in r.message]) >= 2)
            (status,) = await a.status()
            assert status.definition == "every 5m" and status.declared_by == "b"
        texts = [r.message for r in caplog.records if "declared differently" in r.message]
        assert any("a declares 'every 1h', this one (b) 'every 5m'; the file now holds" in t for t in texts)
        assert any("b declares 'every 5m', this one (a) 'every 1h'; the file holds that" in t for t in texts)
        assert len(texts) == 2  # once each, not at every look

    run(main())


def test_many_jobs_declared_differently_are_told_in_a_few_lines(db, caplog):
    """A deploy that changes a whole set of jobs while the old processes still run: each process
    names the first three jobs declared otherwise and sums up the rest in one line (it was a line
    per job: 10,000 lines for 10,000 jobs)."""
    caplog.set_level(logging.WARNING, logger="anarchon_lite")

    def told():
        return [r.getMessage() for r in caplog.records if "declared differently" in r.getMessage()]

    async def main():
        read = []

        def reading(original, since):
            rows = original(since)
            read.extend(rows)
            return rows

        a, b = make(db, instance="a", store=faulty(jobs=reading)), make(db, instance="b")
        for i in range(50):
            a.every(f"job-{i:02}", "1h", lambda ctx: None, offset=QUIET)
            b.every(f"job-{i:02}", "2h", lambda ctx: None, offset=QUIET)
        async with a, b:
            await wait_for(lambda: len(told()) >= 8, message="both processes told")
            await b.pause("job-07")  # a change to a row in dispute, which ``a`` reads again
            await wait_for(lambda: any(row.name == "job-07" and row.paused for row in read), message="the change read")

    run(main())
    texts = told()
    assert len(texts) == 8, texts
    named = [t for t in texts if t.startswith("job ")]
    assert sum("this one (b) 'every 2h" in t and t.endswith("the file now holds this one's") for t in named) == 3
    assert sum("this one (a) 'every 1h" in t and t.endswith("the file holds that one's") for t in named) == 3
    rest = sorted(t for t in texts if not t.startswith("job "))
    assert rest == [
        f"47 more jobs are declared differently by another process than by this one ({me}): "
        f"'job-03', 'job-04', 'job-05', ...; the file {outcome}"
        for me, outcome in (("a", "holds that one's"), ("b", "now holds this one's"))
    ]


def test_jobs_no_running_process_declares_are_undeclared_refused_and_forgotten(db):
    """A job is ``undeclared`` once no running process declares it (its last declarer stopped):
    ``trigger`` refuses it, ``forget`` deletes it and its records; a declared one is not
    forgotten. With no process running at all nothing can be told: a trigger is kept for later."""
    from anarchon_lite import ProcessInfo

    async def main():
        both, one = make(db), make(db)
        for name in ("shared", "gone"):
            both.every(name, "24h", lambda ctx: None, offset=QUIET)
        one.every("shared", "24h", lambda ctx: None, offset=QUIET)
        async with one:
            async with both:
                await both.trigger("gone")
                await wait_for(lambda: has(one, "gone", "succeeded"), message="gone to run")
                assert {j.name: j.state for j in await one.status()} == {"gone": "active", "shared": "active"}
                assert sorted(p.instance for p in await one.processes()) == sorted([both.instance, one.instance])
            processes = await one.processes()
            assert [(p.instance, p.jobs) for p in processes] == [(one.instance, 1)]
            assert isinstance(processes[0], ProcessInfo)
            status = {j.name: j for j in await one.status()}
            assert status["gone"].state == "undeclared" and status["shared"].state == "active"
            assert status["gone"].last_status == "succeeded" and status["gone"].last_at is not None
            with pytest.raises(ConfigError, match="no running process declares it"):
                await one.trigger("gone")
            with pytest.raises(ConfigError, match="declares it"):
                await one.forget("shared")
            await one.forget("gone")
            assert [j.name for j in await one.status()] == ["shared"]
            assert await one.history("gone") == []
            with pytest.raises(JobNotFound):
                await one.forget("gone")
        assert await one.processes() == []
        assert (await one.status())[0].state == "active"
        await one.trigger("shared")  # (no process runs: the first to start runs it)

    run(main())


@pytest.mark.sqlite_only  # (the scheduler's part: with poll= it looks every 20 ms on SQLite)
def test_a_look_computes_a_jobs_next_occurrence_once_per_watermark(db):
    """Each look asks every job when it is next due; a cron schedule computes that once per
    occurrence, not once per look (thousands of jobs: the cost of a look would grow with them)."""
    calls = []

    async def main():
        looking, counted_looks = counting_looks()
        s = make(db, store=looking)  # a look every 20 ms
        s.cron("nightly", "0 3 * * *", lambda ctx: None)
        schedule = s._declared.jobs["nightly"].schedule
        original = schedule.next_after

        def counted(ms):
            calls.append(ms)
            return original(ms)

        schedule.next_after = counted
        async with s:
            await wait_for(lambda: len(counted_looks) >= 20, message="twenty looks")
            assert (await s.status())[0].next_at is not None
        return len(counted_looks)

    looks = run(main())
    assert looks >= 20 and len(calls) <= 3, f"{len(calls)} computations in {looks} looks"


def test_a_change_made_by_another_process_is_read_alone_not_with_every_job(store):
    """Another process pauses one job of a hundred: the running scheduler reads that job's row
    again, not all hundred (with thousands of jobs, every change would cost a read of them all)."""
    reads = []

    def counted(jobs, *args):
        rows = jobs(*args)
        reads.append(rows)
        return rows

    async def main():
        s = make(store, store=faulty(jobs=counted))
        for i in range(100):
            s.every(f"job-{i}", "24h", lambda ctx: None, offset=QUIET)
        async with s:
            await wait_for(lambda: any(len(rows) == 100 for rows in reads), message="the first read, whole")
            first = len(reads)
            await make(store).pause("job-7")
            await wait_for(
                lambda: any(row.name == "job-7" and row.paused for rows in reads[first:] for row in rows),
                message="the pause seen",
            )
            sizes = [len(rows) for rows in reads[first:]]
            assert next(j for j in await s.status() if j.name == "job-7").paused
        return sizes

    sizes = run(main())
    assert max(sizes) <= 2, f"rows per read after the first: {sizes}"


@pytest.mark.sqlite_only  # (the file written as a process of schema version 3 writes it)
def test_a_watermark_moved_by_an_older_version_is_read_and_not_claimed_again_and_again(db, clock):
    """A process of an older version claims an occurrence without giving the job row a change
    number: this one's claim finds the watermark moved, reads that row by name, and does not try
    again at every look (it would spin) nor run the occurrence."""

    aligned(clock, HOUR)
    claims, seen = [], []

    def counted(claim_due_many, *args):
        claimed = claim_due_many(*args)  # (a call on the loop that stepped back is not counted)
        claims.append(args[2])
        return claimed

    async def main():
        looking, looks = counting_looks(claim_due_many=counted)
        s = make(db, clock, store=looking)
        s.every("hourly", "1h", lambda ctx: seen.append(ctx.slot))
        async with s:
            await wait_for(lambda: len(looks) >= 3, message="the first looks")
            slot = (int(clock.time()) // HOUR + 1) * HOUR * 1000
            conn = sqlite3.connect(db, isolation_level=None)
            conn.execute("UPDATE jobs SET last_slot = ? WHERE name = 'hourly'", (slot,))  # no change number
            conn.close()
            clock.advance(0.6)
            await wait_for(lambda: claims, message="a claim")
            before = len(looks)
            await wait_for(lambda: len(looks) >= before + 30, message="thirty more looks")
        assert len(claims) == 1, f"{len(claims)} claims in {len(looks)} looks"
        assert seen == []

    run(main())


def test_what_a_front_end_of_its_own_needs_is_public(db):
    """The calls the command line makes, public: a crontab's ``@reboot`` job and its command as part
    of the declaration, what this process declares, and the declared jobs replaced on a reload
    (recorded in the store with the next call; the jobs no longer declared become undeclared)."""

    async def main():
        s = make(db, instance="s")
        s.every("a", "1h", lambda ctx: None, offset=QUIET)
        s.cron("b", "0 3 * * *", lambda ctx: None, tz="Europe/Athens")
        s.on_start("boot", lambda ctx: None)
        s.agree_on("a", "echo a")
        assert s.declared() == ["a", "b", "boot"]
        assert (s.describe("b"), str(s.zone("b")), s.describe("boot")) == (
            "cron 0 3 * * * Europe/Athens",
            "Europe/Athens",
            "@reboot",
        )
        with pytest.raises(JobNotFound):
            s.agree_on("nope", "echo")
        fresh = Scheduler(db)  # declared only, never run: what a reload reads
        fresh.every("a", "1h", lambda ctx: None, offset=QUIET)
        fresh.every("c", "2h", lambda ctx: None, offset=QUIET)
        async with s:
            definitions = {job.name: job.definition for job in await s.status()}
            assert definitions["a"] == s.describe("a") + ": echo a"
            s.replace_jobs(fresh)
            assert s.declared() == ["a", "c"]
            jobs = {job.name: job for job in await s.status()}
            assert jobs["c"].schedule == fresh.describe("c") and jobs["a"].definition == fresh.describe("a")

            async def rejoined():  # the next look records what this process declares with it
                return {job.name: job.undeclared for job in await s.status()}["b"]

            await wait_for(rejoined, message="b undeclared")

    run(main())


# (No store in the next three: a bad declaration fails before any store is opened.)
@pytest.mark.parametrize(
    ("options", "option", "said"),
    [
        ({"jitter": -5}, "jitter", "must not be negative"),
        ({"jitter": "1h"}, "jitter", "shorter than the interval"),
        ({"jitter": "1x"}, "jitter", "cannot read duration"),
        ({"overlap": True}, "overlap", "got True"),  # (True is an int, and no number of runs)
        ({"overlap": 0}, "overlap", ">= 1"),
        ({"overlap": "3"}, "overlap", "got '3'"),
        ({"on_failure": "mail ops"}, "on_failure", "must be callable"),
        ({"on_failure": print, "on_failure_every_attempt": 1}, "on_failure_every_attempt", "True or False"),
        ({"on_failure_every_attempt": True}, "on_failure_every_attempt", "without an on_failure"),
    ],
)
def test_bad_jitter_overlap_and_on_failure_name_the_job_and_the_option(options, option, said):
    s = Scheduler(":memory:")
    with pytest.raises(ConfigError, match=said) as info:
        s.every("j", "1h", lambda ctx: None, **options)
    assert (info.value.job, info.value.option) == ("j", option)
    assert s.declared() == []


def test_jitter_on_reboot_is_refused_and_zero_jitter_is_none():
    s = Scheduler(":memory:")
    with pytest.raises(ConfigError, match="no time to delay") as info:
        s.on_start("boot", lambda ctx: None, jitter="5s")
    assert (info.value.job, info.value.option) == ("boot", "jitter")
    s.every("none", "1h", lambda ctx: None, jitter=0)
    s.cron("nightly", "0 3 * * *", lambda ctx: None, tz="UTC", jitter="2h")  # (cut to each gap: a day)
    assert s.describe("none") == "every 1h"
    assert s.describe("nightly") == "cron 0 3 * * * UTC jitter 2h"


def test_jitter_and_a_number_of_overlapping_runs_show_in_the_stored_schedule():
    """What ``status`` shows in SCHEDULE (and what other processes must declare alike): the jitter,
    and an overlap that is a number other than one (``overlap=1`` is ``"skip"``)."""
    s = Scheduler(":memory:")
    s.every("a", "1h", lambda ctx: None, jitter="30s", overlap=3)
    s.every("b", "1h", lambda ctx: None, overlap=1)
    s.every("c", "1h", lambda ctx: None, overlap="allow", jitter=timedelta(minutes=5))
    assert [s.describe(name) for name in "abc"] == ["every 1h jitter 30s overlap 3", "every 1h", "every 1h jitter 5m"]
