"""The scheduler in one process: schedules, overlap, timeouts, retries, catch-up, clocks, control."""

import asyncio
import logging
import os
import sqlite3
import threading
import time

import pytest
from conftest import QUIET, ManualClock, counting_looks, faulty, run, wait_for

import anarchon_lite as al
from anarchon_lite import (
    Cancelled,
    Clock,
    ConfigError,
    JobNotFound,
    LeaseLost,
    RunTimeout,
    Scheduler,
    StoreError,
)

HOUR = 3600.0


@pytest.fixture
def lease_clock(store, clock):
    """For tests of leases running out: the injected clock on SQLite, whose leases are on it; on
    PostgreSQL, whose leases are on the server's clock, the real one (see ``expire``)."""
    return clock if store.endswith(".db") else Clock()


async def expire(clock, seconds):
    """Let ``seconds`` pass for the leases: moved by hand, or waited out."""
    if isinstance(clock, ManualClock):
        clock.advance(seconds)
    else:
        await asyncio.sleep(seconds)


def make(db, clock=None, **kw):
    kw.setdefault("poll", 0.02)
    return Scheduler(db, clock=clock, **kw)


async def statuses(s, job=None):
    return [(r.slot, r.attempt, r.status) for r in reversed(await s.history(job, limit=1000))]


async def has(s, job, status, count=1):
    return sum(1 for r in await s.history(job, limit=1000) if r.status == status) >= count


async def last_succeeded(s, job, slot):
    return any(r.slot == slot and r.status == "succeeded" for r in await s.history(job, limit=1000))


def aligned(clock, interval):
    """Move the manual clock to just before the next multiple of ``interval``."""
    now = clock.time()
    clock.advance((now // interval + 1) * interval - now - 0.5)


def next_slot(clock, interval):
    """Move the manual clock to just after the next multiple of ``interval`` (nothing in between
    comes due, so the scheduler sees no downtime)."""
    aligned(clock, interval)
    clock.advance(0.6)


@pytest.fixture
def db(store):
    """Every test here runs on both stores (``store``), unless marked ``sqlite_only``."""
    return store


def test_every_runs_each_slot_once_across_two_schedulers(db, clock):
    aligned(clock, HOUR)
    seen = []

    async def main():
        a, b = make(db, clock, instance="a"), make(db, clock, instance="b")
        for s in (a, b):
            s.every("hourly", "1h", lambda ctx: seen.append((ctx.slot, ctx.instance, ctx.attempt)))
        async with a, b:
            for n in range(1, 4):
                next_slot(clock, HOUR)
                # wait for the record, not only the handler: moving the clock an hour while the run
                # is still open would (rightly) expire its lease and let the other scheduler take it
                await wait_for(lambda n=n: has(a, "hourly", "succeeded", n), message=f"run {n}")
            await asyncio.sleep(0.2)
        assert len(seen) == 3 and len({slot for slot, _, _ in seen}) == 3
        assert all(slot % 3_600_000 == 0 and attempt == 1 for slot, _, attempt in seen)
        assert [st for _, _, st in await statuses(a)] == ["succeeded"] * 3

    run(main())


def test_context_fields(db, clock):
    aligned(clock, 60)
    got = {}

    async def main():
        s = make(db, clock, instance="me")

        @s.every("ctx", "1m", offset="0s")
        async def handler(ctx):
            got.update(job=ctx.job, slot=ctx.slot, at=ctx.scheduled_at, attempt=ctx.attempt, instance=ctx.instance)
            ctx.log.info("hello")
            return 1

        async with s:
            clock.advance(1)
            await wait_for(lambda: got)
        assert got["job"] == "ctx" and got["attempt"] == 1 and got["instance"] == "me"
        assert got["slot"] % 60_000 == 0 and got["at"].timestamp() * 1000 == got["slot"]
        assert got["at"].tzinfo is not None

    run(main())


def test_overlap_skip_and_allow(db, clock):
    aligned(clock, 60)

    async def main():
        s = make(db, clock)
        gate = asyncio.Event()
        started = []

        async def slow(ctx):
            started.append((ctx.job, ctx.slot))
            await gate.wait()

        s.every("skip", "1m", slow)
        s.every("allow", "1m", slow, overlap="allow")
        async with s:
            clock.advance(1)
            await wait_for(lambda: len(started) == 2)
            next_slot(clock, 60)
            await wait_for(lambda: has(s, "skip", "skipped"))
            await wait_for(lambda: len(started) == 3)
            gate.set()
            await wait_for(lambda: has(s, "allow", "succeeded", 2))
            await wait_for(lambda: has(s, "skip", "succeeded", 1))
        assert [j for j, _ in started].count("allow") == 2 and [j for j, _ in started].count("skip") == 1
        skipped = [r for r in await s.history("skip") if r.status == "skipped"]
        assert skipped[0].attempt == 0

    run(main())


def test_every_run_is_logged_with_its_fields(db, clock, caplog):
    """A start and a success at INFO, a failure at ERROR with the handler's error, a skipped
    occurrence at WARNING; each record carries job, slot, attempt, status (and duration at the end)."""
    aligned(clock, 60)

    async def main():
        s = make(db, clock)
        gate = asyncio.Event()

        async def slow(ctx):
            await gate.wait()

        def broken(ctx):
            raise ValueError("no such table")

        s.every("slow", "1m", slow)
        s.every("broken", "1m", broken)
        async with s:
            clock.advance(1)
            await wait_for(lambda: has(s, "broken", "failed"))
            next_slot(clock, 60)
            await wait_for(lambda: has(s, "slow", "skipped"))
            gate.set()
            await wait_for(lambda: has(s, "slow", "succeeded"))

    with caplog.at_level(logging.INFO, logger="anarchon_lite"):
        run(main())
    runs = [r for r in caplog.records if hasattr(r, "status")]
    by = {(r.job, r.status): r for r in runs}
    assert by[("slow", "running")].levelno == logging.INFO and by[("slow", "running")].attempt == 1
    done = by[("slow", "succeeded")]
    assert done.levelno == logging.INFO and done.duration >= 0 and "succeeded after" in done.getMessage()
    failed = by[("broken", "failed")]
    assert failed.levelno == logging.ERROR and "ValueError: no such table" in failed.getMessage()
    skipped = by[("slow", "skipped")]
    assert skipped.levelno == logging.WARNING and skipped.slot == done.slot + 60_000 and skipped.attempt == 0


def test_timeout_aborts_signal_and_records_timed_out(db):
    reasons = []

    async def main():
        s = make(db)

        @s.every("slow", "1s", timeout="200ms")
        async def slow(ctx):
            try:
                await ctx.signal.sleep(30)
            except RunTimeout as exc:
                reasons.append(exc)
                raise

        async with s:
            await wait_for(lambda: has(s, "slow", "timed_out"))
        assert isinstance(reasons[0], TimeoutError)

    run(main())


def test_timeout_wins_however_the_handler_ends(db):
    async def main():
        s = make(db)

        @s.every("swallow", "1s", timeout="100ms")
        async def swallow(ctx):
            try:
                await ctx.signal.sleep(30)
            except RunTimeout:
                return "ignored it"

        async with s:
            await wait_for(lambda: has(s, "swallow", "timed_out"))
        assert not await has(s, "swallow", "succeeded")

    run(main())


def test_handler_ignoring_its_signal_is_cancelled_after_grace(db):
    cancelled = []

    async def main():
        s = make(db)

        @s.every("stubborn", "24h", offset=QUIET, timeout="100ms", grace="200ms")
        async def stubborn(ctx):
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        async with s:
            await s.trigger("stubborn")
            await wait_for(lambda: has(s, "stubborn", "timed_out"))
        assert cancelled == [True]

    run(main())


def test_retries_with_backoff_then_failed(db):
    attempts = []

    async def main():
        s = make(db)

        @s.every("flaky", "24h", offset=QUIET, retries=2, retry_delay="100ms")
        def flaky(ctx):
            attempts.append((ctx.attempt, time.monotonic()))
            raise ValueError(f"boom {ctx.attempt}")

        async with s:
            await s.trigger("flaky")
            await wait_for(lambda: len(attempts) == 3)
            await wait_for(lambda: has(s, "flaky", "failed", 3))
            await asyncio.sleep(0.3)
        assert [a for a, _ in attempts] == [1, 2, 3]
        # backoff doubles: 100 ms, then 200 ms
        assert attempts[2][1] - attempts[1][1] >= 0.19 and attempts[1][1] - attempts[0][1] >= 0.09
        records = [r for r in await s.history("flaky") if r.status == "failed"]
        assert "ValueError: boom 3" in records[0].error

    run(main())


def test_retry_succeeds(db):
    async def main():
        s = make(db)

        @s.every("second-time", "24h", offset=QUIET, retries=1, retry_delay="50ms")
        async def handler(ctx):
            if ctx.attempt == 1:
                raise RuntimeError("first")

        async with s:
            await s.trigger("second-time")
            await wait_for(lambda: has(s, "second-time", "succeeded"))
        assert [st for _, _, st in await statuses(s)] == ["failed", "succeeded"]

    run(main())


def test_catch_up_after_a_forward_jump(db, clock):
    aligned(clock, HOUR)
    seen = []

    async def main():
        s = make(db, clock)
        s.every("recent", "1h", lambda ctx: seen.append(("recent", ctx.slot)), catch_up="45m")
        s.every("none", "1h", lambda ctx: seen.append(("none", ctx.slot)))
        async with s:
            await wait_for(lambda: s._main is not None)
            await asyncio.sleep(0.1)
            start = clock.time() + 0.5
            clock.jump(3 * HOUR + 1200)  # 3 h 20 m later, all at once
            await wait_for(lambda: has(s, "none", "missed", 4))
            await wait_for(lambda: any(j == "recent" for j, _ in seen))
            await asyncio.sleep(0.2)
        # slots start, +1h, +2h, +3h are late; only +3h (20 minutes old) is inside the window
        assert seen == [("recent", int((start + 3 * HOUR) * 1000))]
        assert [st for _, _, st in await statuses(s, "recent")] == ["missed"] * 3 + ["succeeded"]
        assert [st for _, _, st in await statuses(s, "none")] == ["missed"] * 4

    run(main())


def test_a_long_outage_writes_at_most_100_missed_records(db, clock):
    aligned(clock, 60)

    async def main():
        s = make(db, clock)
        s.every("minutely", "1m", lambda ctx: None)
        async with s:
            await asyncio.sleep(0.1)
            clock.jump(30 * 86400)
            await wait_for(lambda: has(s, "minutely", "missed", 100))
            await asyncio.sleep(0.1)
        records = await s.history("minutely", limit=1000)
        assert len(records) == 100
        assert "43100 more" in records[0].error

    run(main())


def test_backward_jump_runs_nothing_twice_and_warns_once(db, clock, caplog):
    aligned(clock, 60)
    seen = []

    async def main():
        s = make(db, clock)
        s.every("m", "1m", lambda ctx: seen.append(ctx.slot))
        async with s:
            clock.advance(1)
            await wait_for(lambda: len(seen) == 1)
            next_slot(clock, 60)
            await wait_for(lambda: len(seen) == 2)
            clock.jump(-HOUR)
            await asyncio.sleep(0.3)
            clock.jump(HOUR - 1)  # back to just before where it was
            await asyncio.sleep(0.3)
            clock.advance(1)  # past the slot that already ran: it does not run twice
            await asyncio.sleep(0.3)
            assert len(seen) == 2
            next_slot(clock, 60)
            await wait_for(lambda: len(seen) == 3)
        assert len(set(seen)) == 3 and seen == sorted(seen)

    with caplog.at_level(logging.WARNING, logger="anarchon_lite"):
        run(main())
    assert sum("earlier than the newest occurrence" in r.message for r in caplog.records) == 1


def test_device_booting_in_1970(db, clock):
    aligned(clock, HOUR)
    seen = []

    async def main():
        s = make(db, clock)
        s.every("h", "1h", lambda ctx: seen.append(ctx.slot), catch_up="2h")
        async with s:
            clock.advance(1)
            await wait_for(lambda: len(seen) == 1)
        real_now = clock.time()
        clock.jump(-real_now + 86400)  # the device boots on 2 January 1970
        s2 = make(db, clock)
        s2.every("h", "1h", lambda ctx: seen.append(ctx.slot), catch_up="2h")
        async with s2:
            clock.advance(3 * HOUR)
            await asyncio.sleep(0.3)
            assert len(seen) == 1  # nothing runs while the clock is plainly unset
            clock.jump(real_now - clock.time() + HOUR + 60)  # NTP corrects it, an hour later
            await wait_for(lambda: len(seen) == 2)
        assert seen[1] - seen[0] == 3_600_000

    run(main())


def test_pause_resume_trigger_cancel(db, clock):
    aligned(clock, 60)
    seen = []

    async def main():
        s = make(db, clock)
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
            await asyncio.sleep(0.3)
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
            await wait_for(
                lambda: (
                    a.checkpoints.get("export", log[0][3] if False else next(iter(a._loop.runner.running))[1])
                    if a._loop.runner.running
                    else False
                )
            )
            await asyncio.sleep(0.3)
            slot = next(iter(a._loop.runner.running))[1]
            assert await a.checkpoints.get("export", slot) == 4
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
            await b.trigger("job")
            await wait_for(lambda: b._loop.runner.running)
            b._loop.heartbeats.stop()
            async with c:
                await expire(clock, 2)
                await wait_for(lambda: has(c, "job", "failed"))
            gate.set()
        records = [r for r in await c.history("job") if r.status == "failed"]
        assert "max_attempts" in records[0].error

    run(main())


def test_history_retention(db, clock):
    async def main():
        s = make(db, clock, retention=5)
        s.every("r", "1h", lambda ctx: None, overlap="allow")
        async with s:
            slots = []
            for _ in range(8):
                slots.append(await s.trigger("r"))
                await wait_for(lambda: has(s, "r", "succeeded", min(len(slots), 5)))
                await wait_for(lambda: last_succeeded(s, "r", slots[-1]))
        records = await s.history("r")
        assert [r.slot for r in reversed(records)] == slots[-5:]

    run(main())


def test_checkpoints_outside_a_run_and_json_only(db):
    async def main():
        s = make(db)
        await s.checkpoints.set("export", 1, {"after": [1, 2, 3]})
        assert await s.checkpoints.get("export", 1) == {"after": [1, 2, 3]}
        with pytest.raises(TypeError):
            await s.checkpoints.set("export", 1, object())
        with pytest.raises(TypeError):
            await s.checkpoints.set("export", 1, float("nan"))
        assert await s.checkpoints.get("export", 1) == {"after": [1, 2, 3]}
        await s.checkpoints.delete("export", 1)
        assert await s.checkpoints.get("export", 1, default=0) == 0

    run(main())


def test_shutdown_is_not_swallowed_by_except_exception(db):
    seen = []

    async def main():
        s = make(db)

        @s.every("batch", "24h", offset=QUIET)
        async def batch(ctx):
            for _ in range(1000):
                try:
                    await ctx.signal.sleep(0.05)
                except Exception as exc:  # noqa: BLE001 - a loop that logs and carries on
                    seen.append(exc)
            seen.append("finished")

        async with s:
            await s.trigger("batch")
            await wait_for(lambda: s._loop.runner.running)
            await s.stop(grace=2)
        assert seen == [] and [st for _, _, st in await statuses(s)] == ["interrupted"]

    run(main())


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
    assert warnings and "job hog" in warnings[0] and "test_scheduler.py" in warnings[0]


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


# -- what careless handlers and declarations must not do ----------------------------------------


@pytest.mark.parametrize("escape", [SystemExit(3), KeyboardInterrupt(), GeneratorExit()], ids=type)
@pytest.mark.parametrize("kind", ["async", "thread"])
def test_a_handler_raising_a_base_exception_fails_its_attempt_only(db, escape, kind):
    async def main():
        s = make(db)

        async def async_handler(ctx):
            if ctx.attempt == 1:
                raise escape

        def thread_handler(ctx):
            if ctx.attempt == 1:
                raise escape

        handler = async_handler if kind == "async" else thread_handler
        s.every("escape", "24h", handler, offset=QUIET, retries=1, retry_delay="50ms")
        async with s:
            await s.trigger("escape")
            await wait_for(lambda: has(s, "escape", "succeeded"))
        assert [st for _, _, st in await statuses(s)] == ["failed", "succeeded"]
        failed = next(r for r in await s.history("escape") if r.status == "failed")
        assert type(escape).__name__ in failed.error and "process carried on" in failed.error

    run(main())


def test_a_thread_handler_raising_stop_iteration_ends_its_attempt(db):
    async def main():
        s = make(db)
        s.every("empty", "24h", lambda ctx: next(iter([])), offset=QUIET, overlap="skip")
        async with s:
            await s.trigger("empty")
            await wait_for(lambda: has(s, "empty", "failed"), timeout=5)
            await s.trigger("empty")  # not skipped: the first run is over
            await wait_for(lambda: has(s, "empty", "failed", 2), timeout=5)
        records = await s.history("empty")
        assert [r.status for r in records] == ["failed", "failed"] and "StopIteration" in records[0].error

    run(main())


def test_sync_checkpoint_calls_from_an_async_handler_fail_at_once(db):
    errors = []

    async def main():
        s = make(db)

        @s.every("wrong-door", "24h", offset=QUIET)
        async def wrong_door(ctx):
            for call in (ctx.checkpoint.get_sync, lambda: ctx.checkpoint.set_sync(1), ctx.checkpoint.delete_sync):
                try:
                    call()
                except RuntimeError as exc:
                    errors.append(str(exc))
            await ctx.checkpoint.set(2)  # the loop was never blocked

        async with s:
            slot = await s.trigger("wrong-door")
            await wait_for(lambda: has(s, "wrong-door", "succeeded"), timeout=5)
        assert len(errors) == 3 and all("await ctx.checkpoint" in e for e in errors)
        assert await s.checkpoints.get("wrong-door", slot) == 2

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


def test_late_occurrences_found_in_one_look_run_once(db, clock):
    async def main():
        first = make(db, clock)
        first.every("fast", "300ms", lambda ctx: None)
        async with first:  # the job is registered: its watermark is now
            pass
        since = int(clock.time() * 1000)
        clock.advance(1.5)  # a restart that took 1.5 s: five occurrences came due meanwhile
        now = int(clock.time() * 1000)
        due = [slot for slot in range(since // 300 * 300 + 300, now + 1, 300)]
        for catch_up in (None, "1h"):
            second = make(db, clock)
            second.every("fast", "300ms", lambda ctx: None, catch_up=catch_up)
            runs = 1 if catch_up is None else 2
            async with second:
                await wait_for(lambda s=second, n=runs: has(s, "fast", "succeeded", n))
            if catch_up is None:
                assert await statuses(second) == [(s, 0, "missed") for s in due[:-1]] + [(due[-1], 1, "succeeded")]
                clock.advance(0.9)  # three more, all on time; again only the newest runs
                since, now = now, int(clock.time() * 1000)
                due = [slot for slot in range(since // 300 * 300 + 300, now + 1, 300)]
        assert [st for _, _, st in (await statuses(second))[-3:]] == ["missed", "missed", "succeeded"]

    run(main())


def test_history_pruning_keeps_the_record_of_a_run_in_progress(db, clock):
    release = threading.Event()

    async def main():
        s = make(db, clock, retention=2)
        s.every("long", "1h", lambda ctx: release.wait(10), overlap="skip")
        async with s:
            slot = await s.trigger("long")
            await wait_for(lambda: s._loop.runner.running)
            for _ in range(5):  # skipped, one after another, while the run goes on
                await s.trigger("long")
            await wait_for(lambda: has(s, "long", "skipped", 2))
            await asyncio.sleep(0.1)
            release.set()
            await wait_for(lambda: last_succeeded(s, "long", slot))
        with pytest.raises(ConfigError, match="retention"):
            Scheduler(db, retention=0)

    run(main())


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


@pytest.mark.sqlite_only  # (the file's connections: what Python 3.13 warns of when one is left unclosed)
def test_a_web_app_s_calls_then_close_leave_nothing_unclosed_under_dev_mode(db):
    """Under ``-X dev`` with ResourceWarning an error: a scheduler started in a thread, control
    calls, ``close()``, and the interpreter's exit print no warning and exit 0."""
    import os
    import subprocess
    import sys
    from pathlib import Path

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
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": root},
        cwd=root,
        check=False,
    )
    assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr


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


def execute(store, statement, args=()):
    """One statement (``?`` placeholders) on the store's tables, as another program writes them."""
    if store.startswith("postgresql://"):
        import pgserver

        return pgserver.query(store, statement.replace("?", "%s"), args)
    conn = sqlite3.connect(store, isolation_level=None)
    try:
        return conn.execute(statement, args).fetchall()
    finally:
        conn.close()


def test_status_shows_each_jobs_newest_record_whoever_wrote_it(store):
    """Each job's row keeps its newest record's status and start, which ``status`` reads (one scan
    of the jobs, not a search of the history per job); the store keeps them whoever writes the
    record: a process of this version, of the version before, or a person with a SQL shell. A
    change to an older record leaves them alone."""

    async def main():
        s = make(store)
        s.every("export", "24h", lambda ctx: None, offset=QUIET)
        async with s:
            slot = await s.trigger("export")
            await wait_for(lambda: last_succeeded(s, "export", slot), message="its record")
        return slot

    slot = run(main())

    def newest():
        (job,) = run(make(store).status())
        return job.last_status, None if job.last_at is None else int(job.last_at.timestamp() * 1000)

    assert newest()[0] == "succeeded"
    record = (
        "INSERT INTO history (job, slot, attempt, status, instance, started_at) VALUES ('export', ?, ?, ?, 'old', ?)"
    )
    execute(store, record, (1000, 1, "running", 2000))
    assert newest() == ("running", 2000)
    execute(store, "UPDATE history SET status = 'interrupted' WHERE job = 'export' AND slot = ?", (slot,))
    assert newest() == ("running", 2000)
    execute(store, "UPDATE history SET status = 'failed' WHERE job = 'export' AND slot = 1000")
    assert newest() == ("failed", 2000)
    execute(store, record, (3000, 0, "missed", None))
    assert newest() == ("missed", 3000)
    assert execute(store, "SELECT last_status, last_at FROM jobs") == [("missed", 3000)]
    execute(store, "UPDATE jobs SET last_status = 'cancelled'")  # (what status shows is the row's, not a search)
    assert newest() == ("cancelled", 3000)


@pytest.mark.sqlite_only  # (the file written as a process of schema version 3 writes it)
def test_a_watermark_moved_by_an_older_version_is_read_and_not_claimed_again_and_again(db, clock):
    """A process of an older version claims an occurrence without giving the job row a change
    number: this one's claim finds the watermark moved, reads that row by name, and does not try
    again at every look (it would spin) nor run the occurrence."""
    import sqlite3

    aligned(clock, HOUR)
    claims, seen = [], []

    def counted(claim_due_many, *args):
        claims.append(args[2])
        return claim_due_many(*args)

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


def test_the_installed_wheel_is_typed_and_decorated_handlers_keep_their_types(tmp_path):
    """The wheel installs a typed package (py.typed), so mypy --strict on a user script sees the
    library's types: every/cron/rrule, as decorators and as calls, give the handler back with its
    type (overloads), and the names a user script needs are exported (not even
    --disallow-any-decorated finds anything). The script is checked against the wheel built from
    this checkout and installed, not against the source file."""
    pytest.importorskip("mypy")  # (not installable on Python 3.9: pyproject's test extra skips it there)
    import os
    import shutil
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    source = tmp_path / "source"  # (a copy: building in the checkout would leave build/ and egg-info there)
    source.mkdir()
    for name in ("pyproject.toml", "anarchon_lite.py", "README.md", "LICENSE"):
        shutil.copy(root / name, source / name)
    shutil.copytree(root / "wheel", source / "wheel", symlinks=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)], check=True)
    (wheel,) = tmp_path.glob("anarchon_lite-*.whl")
    assert "anarchon_lite/py.typed" in zipfile.ZipFile(wheel).namelist()
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "user.py").write_text(
        "import asyncio\n"
        "from anarchon_lite import Checkpoint, RunContext, Scheduler\n"
        "scheduler = Scheduler('jobs.db')\n\n"
        "@scheduler.every('export', '1h', timeout='50m')\n"
        "async def export(ctx: RunContext) -> int:\n"
        "    checkpoint: Checkpoint = ctx.checkpoint\n"
        "    await checkpoint.set(1)\n"
        "    return 1\n\n"
        "@scheduler.cron('backup', '0 3 * * *')\n"
        "def backup(ctx: RunContext) -> str:\n"
        "    return ctx.job\n\n"
        "def report(ctx: RunContext) -> None:\n"
        "    return None\n\n"
        "same = scheduler.rrule('report', 'FREQ=DAILY', report)\n"
        "count: int = asyncio.run(export(ctx=None))  # type: ignore[arg-type]\n"
        "name: str = backup(ctx=None)  # type: ignore[arg-type]\n"
        "scheduler.close()\n"
        "wrong: str = scheduler.instance + 1  # type: ignore[operator]\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--disallow-any-decorated", "--warn-unused-ignores", "user.py"],
        cwd=user,  # (no anarchon_lite.py beside it: mypy must find the installed package)
        env={**env, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    imported = subprocess.run(
        [sys.executable, "-c", "import anarchon_lite; print(anarchon_lite.__file__)"],
        cwd=user,
        env={**env, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported.stdout.strip() == str(site / "anarchon_lite" / "__init__.py")


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


def metric(text, name, **labels):
    """The value of one sample in a Prometheus text, or None."""
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_the_metrics_file_counts_runs_by_status_through_pruning_and_tells_times(db, tmp_path):
    """metrics_file= is rewritten (whole: no temporary file stays) after runs end: counters of
    runs by status that pruning the history does not lower (retention 2, 4 successes: 4), the newest
    start, success, failure and duration, the attempts running, and this process's renewal
    lateness; prometheus() returns the same figures."""
    path = tmp_path / "metrics" / "anarchon.prom"
    path.parent.mkdir()

    async def slow(ctx):
        await asyncio.sleep(2.5)  # renewed a few times under its short lease

    def fails(ctx):
        raise RuntimeError("no")

    async def main():
        s = make(db, retention=2, metrics_file=path)
        s.every("ok", "1d", lambda ctx: None, overlap="allow")
        s.every("bad", "1d", fails)
        s.every("slow", "1d", slow, lease="0.6s")

        def figure(name, **labels):
            return metric(path.read_text() if path.exists() else "", name, **labels)

        async with s:
            await wait_for(lambda: figure("anarchon_job_running", job="ok") == 0, message="the first figures")
            for _ in range(4):
                await s.trigger("ok")
            await s.trigger("bad")
            await s.trigger("slow")
            await wait_for(lambda: figure("anarchon_job_running", job="slow") == 1, timeout=20)
            await wait_for(lambda: figure("anarchon_job_runs_total", job="ok", status="succeeded") == 4, timeout=20)
            await wait_for(lambda: figure("anarchon_job_runs_total", job="slow", status="succeeded") == 1, timeout=20)
            await wait_for(lambda: figure("anarchon_job_running", job="slow") == 0, timeout=20)
            assert len(await s.history("ok")) == 2  # pruned to the retention; the counter kept 4
            text = path.read_text()
            assert metric(text, "anarchon_job_runs_total", job="bad", status="failed") == 1
            assert metric(text, "anarchon_job_runs_total", job="bad", status="succeeded") == 0
            assert metric(text, "anarchon_job_last_success_timestamp_seconds", job="bad") is None
            now = time.time()
            assert now - 60 < metric(text, "anarchon_job_last_failure_timestamp_seconds", job="bad") <= now
            assert now - 60 < metric(text, "anarchon_job_last_success_timestamp_seconds", job="ok") <= now
            assert 2.4 < metric(text, "anarchon_job_last_duration_seconds", job="slow") < 30
            started = metric(text, "anarchon_job_last_start_timestamp_seconds", job="slow")
            assert now - 60 < started <= metric(text, "anarchon_job_last_success_timestamp_seconds", job="slow")
            assert 0 <= metric(text, "anarchon_lease_renewal_lateness_p99_seconds", instance=s.instance) < 30
            assert "# TYPE anarchon_job_runs_total counter" in text
            figures = await s.prometheus()
            assert metric(figures, "anarchon_job_runs_total", job="ok", status="succeeded") == 4
        assert sorted(p.name for p in path.parent.iterdir()) == ["anarchon.prom"]
        assert metric(path.read_text(), "anarchon_job_running", job="slow") == 0

    run(main())


def test_history_is_pruned_once_it_holds_a_tenth_more_than_the_retention(db):
    """retention=20 keeps 20 records, pruned when a 23rd comes (a tenth more, 2, is let pass):
    one prune each so many records rather than a write at every one; the counters keep them all."""

    async def main():
        s = make(db, retention=20)
        s.every("r", "1d", lambda ctx: None, overlap="allow")
        sizes = []
        async with s:
            for count in range(1, 24):
                slot = await s.trigger("r")
                await wait_for(lambda slot=slot: last_succeeded(s, "r", slot), message=f"run {count}")
                sizes.append(len(await s.history("r", limit=1000)))
            figures = await s.prometheus()
        assert sizes == [*range(1, 23), 20]
        assert 'anarchon_job_runs_total{job="r",status="succeeded"} 23' in figures.splitlines()

    run(main())
