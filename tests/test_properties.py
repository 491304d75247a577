"""Property tests: cron and rrule iteration against their oracles, and a stateful test of the store
(claim, renew, expire, take over, hand over, finish) against a model in which at most one attempt
holds a run at any moment, on both stores. Durations and the cancellation token have theirs in their
own files."""

import datetime as dt
import itertools
import os
import random
import shutil
import tempfile
import zoneinfo

from conftest import Process
from cronsim import CronSim
from dateutil import rrule as du
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

import anarchon_lite as al
from anarchon_lite import Scheduler

UTC = dt.timezone.utc
ORACLE_ZONES = ["UTC", "Europe/Athens", "America/New_York"]


def cron_field(low, high):
    """A strategy for one cron field: *, */n, a, a-b, a-b/n, or a list of those."""
    number = st.integers(low, high)
    span = st.tuples(number, number).map(sorted)
    single = st.one_of(
        st.just("*"),
        st.integers(1, high - low + 1).map(lambda n: f"*/{n}"),
        number.map(str),
        span.map(lambda ab: f"{ab[0]}-{ab[1]}"),
        # "a-b/n" with a < b (cronsim reads "a-a/n" as "a/n", cron as just a)
        st.tuples(span, st.integers(1, 5))
        .filter(lambda t: t[0][0] < t[0][1])
        .map(lambda t: f"{t[0][0]}-{t[0][1]}/{t[1]}"),
    )
    return st.one_of(single, st.lists(number, min_size=2, max_size=4, unique=True).map(lambda v: ",".join(map(str, v))))


CRON = st.tuples(cron_field(0, 59), cron_field(0, 23), cron_field(1, 28), cron_field(1, 12), cron_field(0, 6)).map(
    " ".join
)
MOMENTS = st.datetimes(dt.datetime(2001, 1, 1), dt.datetime(2037, 12, 31)).map(lambda d: d.replace(tzinfo=UTC))
# plain dateutil iterates from 2000 to get there: keep its moments near (ours stay fast at any date)
EARLY = st.datetimes(dt.datetime(2000, 1, 2), dt.datetime(2002, 12, 31)).map(lambda d: d.replace(tzinfo=UTC))


def ours(kind, text, tz, after, count):
    s = Scheduler(":memory:")
    getattr(s, kind)("j", text, lambda ctx: None, tz=tz)
    return s.upcoming("j", count, after)


def strictly_increasing(times):
    return all(a < b for a, b in zip(times, times[1:]))


@given(CRON, st.sampled_from(ORACLE_ZONES), MOMENTS)
@settings(max_examples=300, deadline=None)
def test_cron_agrees_with_cronsim_and_never_repeats(expr, tz, after):
    found = ours("cron", expr, tz, after, 6)
    assert strictly_increasing(found) and all(t > after for t in found)
    zone = zoneinfo.ZoneInfo(tz)
    expected = []
    for moment in CronSim(expr, after.astimezone(zone)):
        moment = moment.astimezone(UTC)
        if not expected or moment > expected[-1]:  # cronsim repeats the instant after a gap
            expected.append(moment)
        if len(expected) == len(found):
            break
    assert found == expected, expr


RRULE = st.builds(
    lambda freq, interval, hours, minutes, days: ";".join(
        [f"FREQ={freq}", f"INTERVAL={interval}"]
        + ([f"BYHOUR={','.join(map(str, hours))}"] if hours and freq != "HOURLY" else [])
        + [f"BYMINUTE={','.join(map(str, minutes))}"]
        + ([f"BYDAY={','.join(days)}"] if days else [])
    ),
    st.sampled_from(["HOURLY", "DAILY", "WEEKLY", "MONTHLY"]),
    st.integers(1, 5),
    st.lists(st.integers(0, 23), max_size=3, unique=True).map(sorted),
    st.lists(st.integers(0, 59), min_size=1, max_size=3, unique=True).map(sorted),
    st.lists(st.sampled_from(["MO", "TU", "WE", "TH", "FR", "SA", "SU"]), max_size=3, unique=True),
)


@given(RRULE, EARLY)
@settings(max_examples=150, deadline=None)
def test_rrule_agrees_with_dateutil_from_2000_and_never_repeats(rule, after):
    """In UTC, a rule without DTSTART is dateutil's own iteration from 2000-01-01T00:00."""
    found = ours("rrule", rule, "UTC", after, 5)
    assert strictly_increasing(found) and all(t > after for t in found)
    plain = du.rrulestr(rule, dtstart=dt.datetime(2000, 1, 1))
    expected = []
    moment = after.replace(tzinfo=None)
    while len(expected) < len(found):
        moment = plain.after(moment)
        expected.append(moment.replace(tzinfo=UTC))
    assert found == expected, rule


AGENDA_JOBS = 40
AGENDA_AT = 1_800_000_000_000  # (ms: a whole number of 10 s)


def agenda_jobs():
    """Jobs every 10 s, looked at from their due time (as the first process does)."""
    declared = Scheduler(os.path.join(tempfile.gettempdir(), "never-opened.db"))
    for i in range(AGENDA_JOBS):
        declared.every(f"job-{i}", "10s", lambda ctx: None)
    return declared._loop._declared.jobs


def agenda_row(i, last, paused):
    return al._JobRow(f"job-{i}", "every 10s", int(paused), AGENDA_AT + last * 10_000, None)


# (batches drawn as a size and a seed: hypothesis's own lists stay short, and the agenda sweeps its
# stale places out only once they are half of it)
AGENDA_BATCHES = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 2**32)), max_size=6)


def agenda_batch(size, seed):
    draw = random.Random(seed)
    return [agenda_row(draw.randrange(AGENDA_JOBS), draw.randint(-40, 40), draw.random() < 0.2) for _ in range(size)]


@given(AGENDA_BATCHES, st.integers(-40, 40))
@settings(max_examples=150, deadline=None)
def test_an_agenda_updated_in_batches_reads_as_one_made_afresh(batches, now):
    """The agenda a looking process keeps (places left behind stale, swept out once they are half
    of it) finds what is due, what comes next and the first occurrence as one made from its rows at
    once, after any batches of rows read again (moved, moved back, paused, resumed, unchanged)."""
    jobs = agenda_jobs()
    start = [agenda_row(i, i % 81 - 40, False) for i in range(AGENDA_JOBS)]
    agenda = al._Agenda(jobs, start, lambda name, at: at)
    now_ms = AGENDA_AT + now * 10_000

    def read(agenda):
        ready, wait = agenda.ready(now_ms, 1000.0)
        return [row for _, row in ready], wait, agenda.next_look(), agenda.first()

    for size, seed in batches:
        agenda.update(agenda_batch(size, seed))
        assert read(agenda) == read(al._Agenda(jobs, agenda.rows.values(), lambda name, at: at))


def test_a_look_goes_through_the_places_left_behind_once(monkeypatch):
    """The places a moved job left behind at the front of the agenda are gone after one look: each
    look after it starts at the first live place (a look that went through every place left behind
    since the last sweep made 10,000 jobs every minute cost 70% more CPU)."""
    jobs = agenda_jobs()
    agenda = al._Agenda(jobs, [agenda_row(i, i - AGENDA_JOBS, False) for i in range(AGENDA_JOBS)], lambda name, at: at)
    agenda.update(agenda_row(i, 40, False) for i in range(30))  # the 30 earliest run: each one's place is left behind
    looked = []
    live = al._Agenda._live
    monkeypatch.setattr(al._Agenda, "_live", lambda self, key: looked.append(key) or live(self, key))
    assert agenda.next_look() == AGENDA_AT + (30 - AGENDA_JOBS + 1) * 10_000  # job-30's next occurrence
    assert len(looked) == 31  # the 30 places left behind, then job-30's
    for read in (agenda.next_look, agenda.first, lambda: agenda.ready(AGENDA_AT, 1000.0)):
        looked.clear()
        read()
        assert len(looked) <= 2, read  # (the first place; for ready, the first after what is due too)
    fresh = al._Agenda(jobs, agenda.rows.values(), lambda name, at: at)
    assert (agenda.first(), agenda.next_look()) == (fresh.first(), fresh.next_look())


LEASE = 10.0
SLOT = 1_000_000


class _ModelClock(al.Clock):
    """The model's lease clock, which only its ``time_passes`` rule (and renewals) move."""

    def __init__(self, model):
        self._model = model

    def monotonic(self):
        return self._model.mono


class StoreMachine(RuleBasedStateMachine):
    """Three processes (three connections, three owners) contend for one run of one job.

    The model knows who holds the run and a version of its row that every change moves on; a
    process acts on the row as it last saw it (possibly stale), as the scheduler does. The store
    must agree with the model at every step, and at most one attempt ever holds the run.
    """

    claims = Bundle("claims")
    snapshots = Bundle("snapshots")

    def __init__(self):
        super().__init__()
        self.mono = 1000.0  # the model's lease clock (the SQLite stores' too)
        self.stores, self._close = self.open_stores(self)
        self.owners = [f"p{i}" for i in range(3)]
        self.holder = None  # (process, attempt) holding the run
        self.lease_until = 0.0
        self.version = 0  # moves on with every change to the run's row
        self.state = "none"  # none, running, pending, done
        self.attempts = 0
        self.granted = []  # (process, claim) for every claim the store granted

    @initialize()
    def register(self):
        self.stores[0].register([al._Declared("job", "every 1h", 0, None, "every 1h", "model")])

    def teardown(self):
        self._close()

    @staticmethod
    def open_stores(model):
        """Three stores of three processes on a fresh store, and what closes them (see the test)."""
        raise NotImplementedError

    def _grant(self, process, claim):
        self.attempts += 1
        assert claim is not None and claim.attempt == self.attempts
        self.holder, self.lease_until, self.state = (process, claim.attempt), self.mono + LEASE, "running"
        self.version += 1
        self.granted.append((process, claim))
        return (process, claim)

    @rule(target=claims, process=st.integers(0, 2))
    def claim_the_occurrence(self, process):
        got = self.stores[process].claim_due(
            self.owners[process], 1, al._Due("job", 0, SLOT, SLOT + 1000, [], True, 1, LEASE)
        )
        if self.state != "none":
            assert got is al._NotClaimed.MOVED  # the watermark moved: someone claimed it first
            return multiple()
        return self._grant(process, got)

    @rule(target=snapshots, process=st.integers(0, 2))
    def look(self, process):
        rows = self.stores[process].runs()
        assert len(rows) == (1 if self.state in ("running", "pending") else 0)
        return (process, rows[0] if rows else None, self.version, self.lease_until)

    @rule(seconds=st.floats(0.0, 2 * LEASE))
    def time_passes(self, seconds):
        self.mono += seconds

    @rule(entry=claims)
    def renew(self, entry):
        process, claim = entry
        self.mono += 0.001  # every renewal writes a new lease_until
        lost = self.stores[process].renew_all(self.owners[process], [claim])
        if self.holder == (process, claim.attempt):
            assert lost == []
            self.lease_until = self.mono + LEASE
            self.version += 1
        else:
            assert lost == [claim]

    @rule(target=claims, seen=snapshots, process=st.integers(0, 2))
    def take_over(self, seen, process):
        """Claim a pending run, or take over one whose lease ran out, as seen (maybe long ago). (The
        lease is the model's as it was then: the store's compare-and-set never looks at the lease.)"""
        _, row, version, lease_until = seen
        assume(row is not None and (row.state == "pending" or lease_until < self.mono))
        got = self.stores[process].claim(row, self.owners[process], LEASE, 1, 100, 1, "lease expired")
        if version != self.version:
            assert got is None  # the row changed since it was seen: compare-and-set refuses
            return multiple()
        assert self.state == "pending" or self.lease_until < self.mono
        return self._grant(process, got)

    @rule(entry=claims, then=st.sampled_from(["done", "handover"]))
    def finish(self, entry, then):
        process, claim = entry
        ok = self.stores[process].finish(
            self.owners[process], al._End(claim, "succeeded", None, 2, al._AfterEnd(then), 0)
        )
        assert ok == (self.holder == (process, claim.attempt))
        if ok:
            self.holder, self.state = None, ("done" if then == "done" else "pending")
            self.version += 1

    @rule(entry=claims, value=st.integers())
    def save_checkpoint(self, entry, value):
        process, claim = entry
        fence = (claim.attempt, self.owners[process])
        written = self.stores[process].checkpoint_write("job", SLOT, str(value), 3, fence)
        assert written == (self.holder == (process, claim.attempt))

    @invariant()
    def at_most_one_attempt_holds_the_run(self):
        holding = [
            (process, claim.attempt)
            for process, claim in self.granted
            if self.stores[0].checkpoint_get("job", SLOT, (claim.attempt, self.owners[process]))[0]
        ]
        assert len(holding) <= 1
        assert holding == ([self.holder] if self.holder else [])


_fresh = itertools.count()


def sqlite_stores(model):
    """Three connections to a new file, their leases on the model's clock (the file's own
    compare-and-set: no lease board, whose renewals do not change the row)."""
    directory = tempfile.mkdtemp(prefix="anarchon-model-")
    clock = _ModelClock(model)
    stores = [al._SQLiteStore(os.path.join(directory, "jobs.db"), busy_timeout=5, clock=clock) for _ in range(3)]

    def close():
        for store in stores:
            store.close()
        shutil.rmtree(directory, ignore_errors=True)

    return stores, close


def test_store_against_its_model(store, request):
    """On PostgreSQL, three processes (each holding its advisory lock) on a fresh schema per example;
    their leases are on the server's clock, which the store's compare-and-set never reads."""
    if store.endswith(".db"):
        opener = sqlite_stores
    else:
        server = request.getfixturevalue("pg_server")

        def opener(model):
            url = server.url(schema=f"m{os.getpid()}_{next(_fresh)}")
            processes = [Process(url) for _ in range(3)]
            return [p.open() for p in processes], lambda: [p.close() for p in processes]

    machine = type("StoreMachineOn", (StoreMachine,), {"open_stores": staticmethod(opener)})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=40,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
        ),
    )
