"""What the scheduler tests share: a scheduler that looks every 20 ms, the records of a job, a
manual clock moved to the next slot, and waiting for looks instead of for a fixed time."""

import asyncio
import sqlite3

from conftest import ManualClock, wait_for

from anarchon_lite import Scheduler

HOUR = 3600.0


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


def backlog(store, job, records, error="", slot=None):
    """``records`` old records of ``job`` written into the store's history at once, as a version
    that kept a larger retention left them (``error``: text each carries): of the occurrences 1, 2,
    ..., or of attempts 2, 3, ... of the occurrence ``slot``."""
    which = "?, i, 1" if slot is None else "?, ?, i + 1"
    execute(
        store,
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
        "INSERT INTO history (job, slot, attempt, status, instance, started_at, finished_at, error) "
        f"SELECT {which}, 'failed', 'old', i, i + 1, ? FROM n",
        (records, job, *([] if slot is None else [slot]), error),
    )


def count_records(store, job):
    return execute(store, "SELECT count(*) FROM history WHERE job = ?", (job,))[0][0]


async def looks_pass(s, looks, count=2, timeout=10.0):
    """Wait until scheduler ``s`` has begun ``count`` more looks (``looks``: from
    ``conftest.counting_looks``), waking it for each: with ``count`` >= 2 at least one whole look
    saw the state as of this call. How a test proves that nothing happened, without waiting a
    fixed time that a busy machine can outlast before the scheduler looked at all."""
    target = len(looks) + count

    def looked():
        s._loop.poke()
        return len(looks) >= target

    await wait_for(looked, timeout=timeout, message=f"{count} more looks")
