"""Clock faults and daylight-saving time through a running scheduler (the schedule math alone is in
test_schedules.py; jumps of the wall clock are in test_runs.py), and a real process whose
clock is set to 1970 and then corrected."""

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ManualClock, run, wait_for

from anarchon_lite import Scheduler

ATHENS = "Europe/Athens"
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def utc(text):
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.timezone.utc)


def ms(moment):
    return int(moment.timestamp() * 1000)


async def sweep(s, clock, jobs, until):
    """Move the clock from one due occurrence to the next (as a running device would see them) until
    ``until``, waiting at each for its runs to be recorded; return the slots each job ran."""
    while True:
        now = dt.datetime.fromtimestamp(clock.time(), dt.timezone.utc)
        due = min(s.upcoming(name, 1, after=now)[0] for name in jobs)
        if due > until:
            break
        clock.advance(due.timestamp() - clock.time() + 0.01)
        expected = [name for name in jobs if s.upcoming(name, 1, after=now)[0] == due]

        slot = ms(due)

        async def recorded(names=expected, slot=slot):
            done = {(r.job, r.slot) for r in await s.history(limit=1000) if r.status == "succeeded"}
            return all((name, slot) in done for name in names)

        await wait_for(recorded, message=f"the runs due at {due}")
    return {
        name: [r.scheduled_at for r in reversed(await s.history(name, limit=1000)) if r.status == "succeeded"]
        for name in jobs
    }


JOBS = {
    "wall_daily": ("cron", "30 3 * * *"),
    "wall_hours": ("cron", "0 1-5 * * *"),
    "elapsed": ("cron", "*/30 * * * *"),
    "rrule_hourly": ("rrule", "FREQ=HOURLY;BYMINUTE=15"),
    "rrule_daily": ("rrule", "FREQ=DAILY;BYHOUR=3;BYMINUTE=30"),
}


def declare(s):
    for name, (kind, text) in JOBS.items():
        getattr(s, kind)(name, text, lambda ctx: None, tz=ATHENS)


# (SQLite only: the sweep moves a manual clock step by step, and on PostgreSQL an idle look waits
# up to 5 s to be told of a change; what is under test is the schedule, whatever the store)
@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        pytest.param(
            # 29 March 2026: at 03:00 local (01:00 UTC) Athens moves to 04:00; 03:00-03:59 do not exist
            "2026-03-28T23:50:00",
            "2026-03-29T02:40:00",
            {
                "wall_daily": ["01:00"],  # 03:30 is in the gap: once, at the first instant after it
                "wall_hours": ["00:00", "01:00", "02:00"],  # 02:00, 03:00 with 04:00 (once), 05:00
                "elapsed": ["00:00", "00:30", "01:00", "01:30", "02:00", "02:30"],  # the gap is skipped
                "rrule_hourly": ["00:15", "01:15", "02:15"],  # 02:15, 04:15, 05:15 local
                "rrule_daily": ["01:00"],
            },
            id="spring-forward",
        ),
        pytest.param(
            # 25 October 2026: at 04:00 local (01:00 UTC) Athens goes back to 03:00; 03:00-03:59 twice
            "2026-10-24T23:50:00",
            "2026-10-25T02:40:00",
            {
                "wall_daily": ["00:30"],  # the repeated 03:30 fires once, at its first occurrence
                "wall_hours": ["00:00", "02:00"],  # 03:00 once (first), then 04:00 EET
                "elapsed": ["00:00", "00:30", "01:00", "01:30", "02:00", "02:30"],  # both 03:00 and 03:30
                "rrule_hourly": ["00:15", "01:15", "02:15"],  # 03:15 twice, 04:15
                "rrule_daily": ["00:30"],
            },
            id="fall-back",
        ),
    ],
)
def test_daylight_saving_through_a_running_scheduler(db, start, end, expected):
    clock = ManualClock(utc(start).timestamp())
    until = utc(end)

    async def main():
        s = Scheduler(db, clock=clock, poll=0.02)
        declare(s)
        async with s:
            ran = await sweep(s, clock, list(JOBS), until)
        day = until.date().isoformat()
        return {
            name: [t.strftime("%H:%M") for t in times if t.date().isoformat() == day] for name, times in ran.items()
        }

    assert run(main()) == expected


# (SQLite only: a manual clock's jumps; the same jump on both stores is in test_runs.py)
def test_forward_jump_of_three_hours_catches_up_once_and_floods_nothing(db):
    """A device suspended for three hours: each job's occurrences in between are recorded missed,
    except the most recent one inside its ``catch_up`` window, which runs once."""
    clock = ManualClock(utc("2026-06-01T09:59:59").timestamp())
    seen = []

    async def main():
        s = Scheduler(db, clock=clock, poll=0.02)
        s.every("minutely", "1m", lambda ctx: seen.append(("minutely", ctx.slot)), catch_up="5m")
        s.cron("hourly", "0 * * * *", lambda ctx: seen.append(("hourly", ctx.slot)), catch_up="30m", tz="UTC")
        async with s:
            clock.advance(1)
            await wait_for(lambda: len(seen) == 2, message="the 10:00 runs")
            clock.jump(3 * 3600 + 90)  # 13:01:30
            await wait_for(lambda: len(seen) == 4, message="the catch-up runs")

            async def accounted():
                records = await s.history(limit=1000)
                return sum(r.status == "missed" for r in records) == 100 + 2

            await wait_for(accounted, message="the missed records")
        return await s.history(limit=1000)

    records = run(main())
    assert sorted(seen[2:]) == [
        ("hourly", ms(utc("2026-06-01T13:00:00"))),
        ("minutely", ms(utc("2026-06-01T13:01:00"))),
    ]
    minutely = sorted((r.slot, r.status) for r in records if r.job == "minutely")
    # 10:01 .. 13:00 missed: 180 occurrences, at most 100 records, the last saying how many more
    assert [st for _, st in minutely] == ["succeeded"] + ["missed"] * 100 + ["succeeded"]
    assert any("80 more" in (r.error or "") for r in records if r.job == "minutely")
    hourly = sorted((r.slot, r.status) for r in records if r.job == "hourly")
    assert [st for _, st in hourly] == ["succeeded", "missed", "missed", "succeeded"]


class ClockWorker:
    """A real scheduler process (tests/worker.py, mode ``clock``) whose wall clock is the system's
    plus an offset read from a file, so that the test can set it wrong and correct it."""

    def __init__(self, tmp_path):
        self.db = str(tmp_path / "jobs.db")
        self.events = str(tmp_path / "events.jsonl")
        self.offset = self.events + ".offset"
        self.log = str(tmp_path / "worker.log")
        self.proc = None

    def set_offset(self, seconds):
        with open(self.offset + ".new", "w") as handle:
            handle.write(repr(seconds))
        os.replace(self.offset + ".new", self.offset)

    def start(self):
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, WORKER, self.db, self.events, "clock"], stderr=log)

    def read(self):
        if not os.path.exists(self.events):
            return []
        with open(self.events) as handle:
            return [json.loads(line) for line in handle if line.endswith("\n")]

    def wait(self, predicate, what, timeout=20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the worker exited with {self.proc.returncode}")
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}")

    def log_text(self):
        with open(self.log) as handle:
            return handle.read()

    def runs(self):
        return [e for e in self.read() if e["event"] == "run"]

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# (SQLite only: a real process under faketime; leases on PostgreSQL are on the server's clock)
def test_a_process_booting_with_its_clock_in_1970(tmp_path):
    """A device runs a 1 s job, powers off, and boots with its clock on 2 January 1970: the new
    process runs nothing and says so once; when the clock is corrected it carries on, and no
    occurrence ever runs twice."""
    w = ClockWorker(tmp_path)
    try:
        w.set_offset(0.0)
        w.start()
        w.wait(lambda: len(w.runs()) >= 2, "runs with the right clock")
        w.stop()
        before = len(w.runs())
        w.set_offset(86400 - time.time())  # 2 January 1970
        w.start()
        w.wait(lambda: any(e["event"] == "ready" for e in w.read()[before:]), "the second start")
        w.wait(lambda: "earlier than the newest occurrence" in w.log_text(), "the warning")
        ready_at = time.monotonic()
        w.wait(lambda: time.monotonic() - ready_at > 2.0, "two occurrences' time")  # nothing may run meanwhile
        assert len(w.runs()) == before
        w.set_offset(0.0)  # NTP corrects the clock
        w.wait(lambda: len(w.runs()) >= before + 2, "runs after the correction")
    finally:
        w.stop()
    slots = [e["slot"] for e in w.runs()]
    assert len(slots) == len(set(slots)) and slots == sorted(slots)
    assert w.log_text().count("earlier than the newest occurrence") == 1
    records = run(Scheduler(w.db).history("tick", limit=1000))
    assert all(r.status in ("succeeded", "missed", "skipped") for r in records), records
    assert len({(r.slot, r.attempt) for r in records}) == len(records)
