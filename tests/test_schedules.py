"""Schedule math: every, cron and rrule, checked against cronsim and dateutil as oracles."""

import datetime as dt
import random
import time
import zoneinfo

import pytest
from cronsim import CronSim
from dateutil import rrule as du
from hypothesis import given, settings
from hypothesis import strategies as st

from anarchon_lite import ConfigError, Scheduler

UTC = dt.timezone.utc
ZONES = ["UTC", "Europe/Athens", "America/New_York", "Australia/Lord_Howe"]
# cronsim mis-steps around Lord Howe's 30-minute shift (it skips 02:00-02:29 after the fall back,
# though those local times exist), so that zone is checked by the hand-written tests below.
ORACLE_ZONES = ZONES[:3]


def handler(ctx):
    return None


def upcoming_cron(expr, tz, after, count):
    s = Scheduler(":memory:")
    s.cron("j", expr, handler, tz=tz)
    return s.upcoming("j", count, after)


def oracle_cron(expr, tz, after, count):
    zone = zoneinfo.ZoneInfo(tz)
    found = []
    for moment in CronSim(expr, after.astimezone(zone)):
        moment = moment.astimezone(UTC)
        if found and moment <= found[-1]:
            continue  # cronsim repeats the instant after a gap for each swallowed time
        found.append(moment)
        if len(found) == count:
            break
    return found


def random_field(rng, low, high, names=()):
    kind = rng.randrange(7)
    if kind == 0:
        return "*"
    if kind == 1:
        return f"*/{rng.randint(1, high - low + 1)}"
    a = rng.randint(low, high)
    if kind == 2:
        return str(a)
    b = rng.randint(a, high)
    if kind == 3:
        return f"{a}-{b}"
    if kind == 4 and b > a:  # cronsim reads "a-a/n" as "a/n"; Vixie cron as just a
        return f"{a}-{b}/{rng.randint(1, 5)}"
    if kind == 5 and names:
        return rng.choice(names)
    return ",".join(str(rng.randint(low, high)) for _ in range(rng.randint(2, 4)))


def random_cron(rng):
    return " ".join(
        [
            random_field(rng, 0, 59),
            random_field(rng, 0, 23),
            random_field(rng, 1, 28),
            random_field(rng, 1, 12, ("JAN", "MAR", "JUN", "DEC")),
            random_field(rng, 0, 6, ("MON", "FRI", "SUN", "MON-FRI")),
        ]
    )


@pytest.mark.parametrize("seed", range(4))
def test_cron_agrees_with_oracle_on_thousands_of_expressions(seed):
    rng = random.Random(seed)
    checked = 0
    for _ in range(500):
        expr = random_cron(rng)
        tz = rng.choice(ORACLE_ZONES)
        after = dt.datetime(2024, 1, 1, tzinfo=UTC) + dt.timedelta(seconds=rng.randrange(4 * 365 * 86400))
        assert upcoming_cron(expr, tz, after, 5) == oracle_cron(expr, tz, after, 5), (expr, tz, after)
        checked += 1
    assert checked == 500


@pytest.mark.parametrize("tz", ORACLE_ZONES[1:])
@pytest.mark.parametrize(
    "expr",
    [
        "*/15 * * * *",
        "30 * * * *",
        "0 */3 * * *",
        "30 2 * * *",
        "0 1-5 * * *",
        "45 3 * * *",
        "* * * * *",
        "0,30 2,3 * * *",
    ],
)
def test_dst_transitions_agree_with_oracle(tz, expr):
    zone = zoneinfo.ZoneInfo(tz)
    for year in (2025, 2026):
        for month in range(1, 13):
            start = dt.datetime(year, month, 1, tzinfo=UTC)
            end = start + dt.timedelta(days=32)
            # find the transition day and look around it
            day = start
            while day < end:
                a = day.astimezone(zone).utcoffset()
                b = (day + dt.timedelta(days=1)).astimezone(zone).utcoffset()
                if a != b:
                    after = day - dt.timedelta(hours=2)
                    count = 200 if expr.startswith("*") else 30
                    assert upcoming_cron(expr, tz, after, count) == oracle_cron(expr, tz, after, count), (expr, tz, day)
                day += dt.timedelta(days=1)


def local(tz, *args, fold=0):
    return dt.datetime(*args, tzinfo=zoneinfo.ZoneInfo(tz), fold=fold).astimezone(UTC)


def test_spring_forward_wall_clock_fires_once_after_the_gap():
    # Athens 2026-03-29: 03:00 becomes 04:00. 03:30 does not exist; it fires at 04:00 local.
    got = upcoming_cron("30 3 * * *", "Europe/Athens", local("Europe/Athens", 2026, 3, 28, 12), 2)
    assert got == [local("Europe/Athens", 2026, 3, 29, 4, 0), local("Europe/Athens", 2026, 3, 30, 3, 30)]
    # Several times in the gap fire together, once.
    got = upcoming_cron("0,15,30 3 * * *", "Europe/Athens", local("Europe/Athens", 2026, 3, 29, 1), 2)
    assert got == [local("Europe/Athens", 2026, 3, 29, 4, 0), local("Europe/Athens", 2026, 3, 30, 3, 0)]


def test_spring_forward_elapsed_skips_the_gap():
    got = upcoming_cron("*/30 * * * *", "America/New_York", local("America/New_York", 2026, 3, 8, 1, 15), 3)
    assert got == [
        local("America/New_York", 2026, 3, 8, 1, 30),
        local("America/New_York", 2026, 3, 8, 3, 0),
        local("America/New_York", 2026, 3, 8, 3, 30),
    ]


def test_fall_back_elapsed_fires_twice_and_wall_once():
    start = local("America/New_York", 2026, 11, 1, 0, 50)
    elapsed = upcoming_cron("30 * * * *", "America/New_York", start, 3)
    assert elapsed == [
        local("America/New_York", 2026, 11, 1, 1, 30),
        local("America/New_York", 2026, 11, 1, 1, 30, fold=1),
        local("America/New_York", 2026, 11, 1, 2, 30),
    ]
    wall = upcoming_cron("30 1 * * *", "America/New_York", start, 2)
    assert wall == [local("America/New_York", 2026, 11, 1, 1, 30), local("America/New_York", 2026, 11, 2, 1, 30)]


def test_lord_howe_half_hour_shift():
    # Lord Howe: 2026-04-05 02:00 becomes 01:30 (fall back by 30 minutes).
    start = local("Australia/Lord_Howe", 2026, 4, 5, 1, 0)
    elapsed = upcoming_cron("*/15 * * * *", "Australia/Lord_Howe", start, 6)
    assert [m.astimezone(zoneinfo.ZoneInfo("Australia/Lord_Howe")).strftime("%H:%M") for m in elapsed] == [
        "01:15",
        "01:30",
        "01:45",
        "01:30",
        "01:45",
        "02:00",
    ]
    assert all(b - a == dt.timedelta(minutes=15) for a, b in zip(elapsed, elapsed[1:]))
    wall = upcoming_cron("45 1 * * *", "Australia/Lord_Howe", start, 1)
    assert wall == [local("Australia/Lord_Howe", 2026, 4, 5, 1, 45)]


def test_day_of_month_or_day_of_week():
    after = dt.datetime(2026, 6, 1, tzinfo=UTC)
    got = upcoming_cron("0 0 13 * FRI", "UTC", after, 4)
    assert [d.day for d in got] == [5, 12, 13, 19]
    # a field starting with * counts as unrestricted: day 1-7 AND Sunday = first Sunday
    got = upcoming_cron("0 0 1-7 * */7", "UTC", after, 3)
    assert [d.date() for d in got] == [dt.date(2026, 6, 7), dt.date(2026, 7, 5), dt.date(2026, 8, 2)]


@pytest.mark.parametrize(
    "nick, plain",
    [
        ("@hourly", "0 * * * *"),
        ("@daily", "0 0 * * *"),
        ("@weekly", "0 0 * * 0"),
        ("@monthly", "0 0 1 * *"),
        ("@yearly", "0 0 1 1 *"),
    ],
)
def test_nicknames(nick, plain):
    after = dt.datetime(2026, 2, 3, 4, 5, tzinfo=UTC)
    assert upcoming_cron(nick, "UTC", after, 3) == upcoming_cron(plain, "UTC", after, 3)


def test_names_and_sunday_as_seven():
    after = dt.datetime(2026, 1, 1, tzinfo=UTC)
    assert upcoming_cron("0 12 * JAN,MAR mon-fri", "UTC", after, 40) == upcoming_cron(
        "0 12 * 1,3 1-5", "UTC", after, 40
    )
    assert upcoming_cron("0 0 * * 7", "UTC", after, 5) == upcoming_cron("0 0 * * 0", "UTC", after, 5)
    # SUN at a range's end is 7, as cronie reads it: MON-SUN is every day, FRI-SUN the weekend
    assert upcoming_cron("0 0 * * MON-SUN", "UTC", after, 10) == upcoming_cron("0 0 * * *", "UTC", after, 10)
    assert upcoming_cron("0 0 * * fri-sun", "UTC", after, 9) == upcoming_cron("0 0 * * 5-7", "UTC", after, 9)


@pytest.mark.parametrize(
    "expr, needle",
    [
        ("61 * * * *", "minute"),
        ("* 24 * * *", "hour"),
        ("* * 0 * *", "day of month"),
        ("* * * 13 *", "month"),
        ("* * * * 8", "day of week"),
        ("* * * *", "5 fields"),
        ("*/0 * * * *", "step"),
        ("5-1 * * * *", "backwards"),
        ("0 0 30 2 *", "never"),
        ("x * * * *", "minute"),
        ("@sometimes", "5 fields"),
    ],
)
def test_bad_cron_names_job_and_field(expr, needle):
    s = Scheduler(":memory:")
    with pytest.raises(ConfigError) as info:
        s.cron("backup", expr, handler)
    assert info.value.job == "backup" and needle in str(info.value)


def upcoming_rrule(rule, tz, after, count):
    s = Scheduler(":memory:")
    s.rrule("j", rule, handler, tz=tz)
    return s.upcoming("j", count, after)


@pytest.mark.parametrize(
    "rule",
    [
        "FREQ=MONTHLY;BYDAY=-1FR;BYHOUR=17;BYMINUTE=0",
        "FREQ=WEEKLY;INTERVAL=2;BYDAY=MO,TH;BYHOUR=9",
        "FREQ=DAILY;INTERVAL=3;BYHOUR=6,18",
        "FREQ=YEARLY;BYMONTH=2;BYMONTHDAY=29",
        "FREQ=MONTHLY;BYMONTHDAY=31",
        "FREQ=HOURLY;INTERVAL=5;BYMINUTE=10",
    ],
)
def test_rrule_agrees_with_plain_dateutil_from_2000(rule):
    after = dt.datetime(2026, 5, 17, 13, 14, 15, tzinfo=UTC)
    oracle = du.rrulestr(rule, dtstart=dt.datetime(2000, 1, 1))
    expected, cursor = [], after.replace(tzinfo=None)
    for _ in range(6):
        cursor = oracle.after(cursor)
        expected.append(cursor.replace(tzinfo=UTC))
    assert upcoming_rrule(rule, "UTC", after, 6) == expected


@pytest.mark.parametrize("rule, step", [("FREQ=MINUTELY;INTERVAL=7", 420), ("FREQ=SECONDLY;INTERVAL=45", 45)])
def test_fine_rrules_keep_their_phase_from_2000(rule, step):
    # dateutil itself would walk millions of steps from 2000 here; the phase is plain arithmetic
    after = dt.datetime(2026, 5, 17, 13, 14, 15, tzinfo=UTC)
    origin = dt.datetime(2000, 1, 1, tzinfo=UTC)
    first = origin + dt.timedelta(seconds=((after - origin).total_seconds() // step + 1) * step)
    assert upcoming_rrule(rule, "UTC", after, 4) == [first + dt.timedelta(seconds=step * i) for i in range(4)]


def test_rrule_stays_fast_with_an_old_start():
    s = Scheduler(":memory:")
    s.rrule("j", "FREQ=SECONDLY;INTERVAL=7", handler, tz="UTC")
    started = time.perf_counter()
    s.upcoming("j", 10, dt.datetime(2026, 1, 1, tzinfo=UTC))
    assert time.perf_counter() - started < 2.0  # unshifted, dateutil would walk 100 million seconds


def test_rrule_dtstart_and_zone():
    rule = "DTSTART;TZID=Europe/Athens:20260301T090000\nRRULE:FREQ=DAILY;COUNT=3"
    got = upcoming_rrule(rule, None, dt.datetime(2026, 1, 1, tzinfo=UTC), 5)
    assert got == [local("Europe/Athens", 2026, 3, d, 9) for d in (1, 2, 3)]
    got = upcoming_rrule(
        du.rrule(du.WEEKLY, dtstart=dt.datetime(2026, 1, 5, 8)), "UTC", dt.datetime(2026, 1, 6, tzinfo=UTC), 2
    )
    assert got == [dt.datetime(2026, 1, 12, 8, tzinfo=UTC), dt.datetime(2026, 1, 19, 8, tzinfo=UTC)]


def test_rrule_daylight_saving_rules():
    # daily follows the wall clock: 02:30 inside New York's spring gap fires at 03:00
    got = upcoming_rrule(
        "FREQ=DAILY;BYHOUR=2;BYMINUTE=30", "America/New_York", local("America/New_York", 2026, 3, 7, 12), 2
    )
    assert got == [local("America/New_York", 2026, 3, 8, 3, 0), local("America/New_York", 2026, 3, 9, 2, 30)]
    # hourly follows elapsed time: 01:00 happens twice on the fall-back night
    got = upcoming_rrule("FREQ=HOURLY", "America/New_York", local("America/New_York", 2026, 11, 1, 0, 30), 3)
    assert all(b - a == dt.timedelta(hours=1) for a, b in zip(got, got[1:]))


@pytest.mark.parametrize("bad", ["FREQ=SOMETIMES", "BYHOUR=3", "FREQ=DAILY;BYHOUR=25", 42])
def test_bad_rrule(bad):
    with pytest.raises(ConfigError) as info:
        Scheduler(":memory:").rrule("report", bad, handler)
    assert info.value.job == "report"


def test_an_rrule_that_would_never_run_or_fail_obscurely_says_why():
    """Without a DTSTART a rule starts at 2000-01-01: its COUNT would be long used up (the job never
    ran, silently), and an UNTIL in UTC failed with dateutil's words about a DTSTART never written."""
    with pytest.raises(ConfigError, match="COUNT and no DTSTART"):
        Scheduler(":memory:").rrule("r", "FREQ=DAILY;COUNT=5", handler)
    with pytest.raises(ConfigError, match="UNTIL in UTC"):
        Scheduler(":memory:").rrule("r", "FREQ=DAILY;UNTIL=20300101T000000Z", handler)
    s = Scheduler(":memory:")
    s.rrule("counted", "DTSTART:20300101T000000\nRRULE:FREQ=DAILY;COUNT=2", handler, tz="UTC")
    s.rrule("until", "FREQ=DAILY;UNTIL=20300103T000000", handler, tz="UTC")
    after = dt.datetime(2029, 12, 31, tzinfo=UTC)
    assert s.upcoming("counted", 5, after) == [dt.datetime(2030, 1, d, tzinfo=UTC) for d in (1, 2)]
    assert s.upcoming("until", 9, after)[-1] == dt.datetime(2030, 1, 3, tzinfo=UTC)


def test_unknown_zone():
    with pytest.raises(ConfigError) as info:
        Scheduler(":memory:").cron("c", "* * * * *", handler, tz="Mars/Olympus")
    assert info.value.option == "tz"


@given(st.integers(1, 10**7), st.integers(0, 10**6), st.integers(0, 4 * 10**12))
@settings(max_examples=300)
def test_every_is_epoch_aligned(interval_ms, offset_ms, after_ms):
    s = Scheduler(":memory:")
    s.every("e", interval_ms / 1000, handler, offset=offset_ms / 1000 if offset_ms else 0)
    after = dt.datetime.fromtimestamp(after_ms / 1000, UTC)
    got = s.upcoming("e", 3, after)
    ms = [round(g.timestamp() * 1000) for g in got]
    assert all(m > after_ms for m in ms)
    assert all((m - offset_ms % interval_ms) % interval_ms == 0 for m in ms)
    assert ms[1] - ms[0] == interval_ms and ms[0] - after_ms <= interval_ms


@given(
    st.integers(0, 3 * 10**9),
    st.sampled_from(ZONES),
    st.sampled_from(["*/7 * * * *", "0 3 * * *", "30 1-4 * * *", "15 */2 * * 1-5"]),
)
@settings(max_examples=200, deadline=None)
def test_cron_strictly_increasing(after_s, tz, expr):
    got = upcoming_cron(expr, tz, dt.datetime.fromtimestamp(1_600_000_000 + after_s / 10, UTC), 8)
    assert len(got) == 8 and all(a < b for a, b in zip(got, got[1:]))


def test_upcoming_takes_naive_after_as_utc():
    s = Scheduler(":memory:")
    s.every("e", "1h", handler)
    naive = dt.datetime(2026, 5, 1, 10, 30)
    assert s.upcoming("e", 2, naive) == s.upcoming("e", 2, naive.replace(tzinfo=UTC))
    assert s.upcoming("e", 1, naive)[0].tzinfo is not None


_WITHOUT_DATEUTIL = """
import asyncio, sys
if sys.argv[2] == "hidden":
    sys.modules["dateutil"] = None  # as on a box where python-dateutil is not installed
import anarchon_lite
scheduler = anarchon_lite.Scheduler(sys.argv[1])
scheduler.every("a", "1m", print)
scheduler.cron("b", "0 3 * * *", print, tz="UTC")
print(len(scheduler.upcoming("b", 3)), len(asyncio.run(scheduler.status())))
print(sorted(name for name, module in sys.modules.items() if module and name.startswith(("dateutil", "argparse"))))
try:
    scheduler.rrule("c", "FREQ=DAILY;BYHOUR=5", print)
except anarchon_lite.ConfigError as exc:
    print(exc)
else:
    print(scheduler.upcoming("c", 1)[0].hour)
"""


@pytest.mark.parametrize("dateutil", ["hidden", "installed"])
def test_only_rrule_schedules_need_dateutil_and_nothing_imports_it_before(tmp_path, dateutil):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_DATEUTIL, str(tmp_path / "jobs.db"), dateutil],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["3 2", "[]"]  # every and cron declared, upcoming and status work; neither module imported
    if dateutil == "hidden":
        assert lines[2] == "job 'c', option 'rrule': rrule schedules need python-dateutil: pip install python-dateutil"
    else:
        assert lines[2] == "5"


_WITHOUT_HASHLIB = """
import asyncio, sys
import anarchon_lite
scheduler = anarchon_lite.Scheduler(sys.argv[1])
ran = []
scheduler.every("a", "200ms", lambda ctx: ran.append(ctx.slot), jitter="100ms")
async def main():
    async with scheduler:
        while len(ran) < 2:
            await asyncio.sleep(0.01)
asyncio.run(main())
print(sorted(name for name in sys.modules if name in ("hashlib", "_hashlib")))
print(anarchon_lite._digest("a\\0b"), anarchon_lite._blake2b(b"a", digest_size=8).hexdigest())
"""


def test_a_running_scheduler_hashes_without_loading_hashlib_and_its_digests_are_hashlibs(tmp_path):
    """Jitter, liveness names and the lease board's name are hashed with the hashes Python builds in,
    not ``hashlib``, whose OpenSSL binding costs a process 0.7 MB; the names stay what they were.
    (SQLite only: psycopg loads that binding itself.)"""
    import hashlib
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_HASHLIB, str(tmp_path / "jobs.db")],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    loaded, digests = done.stdout.splitlines()
    assert loaded == "[]"
    assert digests.split() == [
        hashlib.sha256(b"a\0b").hexdigest()[:32],
        hashlib.blake2b(b"a", digest_size=8).hexdigest(),
    ]


def test_jitter_delays_each_start_alike_everywhere_within_its_bound_and_before_the_next_occurrence():
    """A jittered start is the slot plus a delay in [0, jitter) that depends only on the job's name
    and the slot (two declarations, as in two processes, agree), spread across the range, and
    never reaching the next occurrence (a cron job's delay is cut to the gap before it)."""
    import anarchon_lite as al

    def starts(name, schedule, jitter, slots):
        s = Scheduler(":memory:")
        getattr(s, schedule[0])(name, *schedule[1:], handler, jitter=jitter)
        return [s._declared.job(name).schedule.start_of(slot) - slot for slot in slots]

    hourly = [3_600_000 * n for n in range(1, 401)]
    delays = starts("export", ("every", "1h"), "10m", hourly)
    assert delays == starts("export", ("every", "1h"), "10m", hourly)  # (another process: the same)
    assert all(0 <= d < 600_000 for d in delays)
    assert min(delays) < 60_000 and max(delays) > 540_000 and len(set(delays)) > 390
    assert delays != starts("import", ("every", "1h"), "10m", hourly)  # (another job: spread apart)
    s = Scheduler(":memory:")
    s.cron("minutely", "* * * * *", handler, tz="UTC", jitter="1h")  # an hour's jitter on a minute's gap
    schedule = s._declared.job("minutely").schedule
    assert isinstance(schedule, al._Jittered) and schedule.next_after(0) == 60_000  # (the slots stay)
    minutes = [60_000 * n for n in range(1, 200)]
    assert all(0 <= schedule.start_of(m) - m < 60_000 for m in minutes)
    assert max(schedule.start_of(m) - m for m in minutes) > 50_000
