"""One scheduler process for the benchmarks: ``python _worker.py SCENARIO DB OUT [ARGS...]``.

Scenarios write JSON lines to OUT: ``ready`` (with the path of the anarchon_lite module imported),
one line per handler start, and at exit the heartbeat lateness samples of this process
(``heartbeats``); ``pgcost_busy`` keeps its starts and writes them at exit (``starts``).

The worktree's anarchon_lite is imported, unless ``$PYTHONPATH`` names a folder holding another (an
older commit's file, measured by the same benchmark).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import os
import signal
import sqlite3
import sys
import threading
import time
from typing import Any

# after this folder and the $PYTHONPATH entries: a folder named there comes first
_GIVEN = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
sys.path.insert(1 + len(_GIVEN), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _spin  # (this folder is on the path: the script's own)

STATEMENTS = itertools.count()  # with $BENCH_STATEMENTS: SQL statements run on SQLite connections
if os.environ.get("BENCH_STATEMENTS"):
    _connect = sqlite3.connect

    class _Counted(sqlite3.Connection):
        """Counts each statement run once, each row of an ``executemany`` as one. (A trace callback
        is called again at the start of every trigger a statement fires: it counted an INSERT
        that fires two triggers three times.)"""

        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:  # type: ignore[override]
            next(STATEMENTS)
            return super().execute(sql, *args)

        def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:  # type: ignore[override]
            rows = list(rows)
            for _ in rows:
                next(STATEMENTS)
            return super().executemany(sql, rows)

    def _counted_connect(*args: object, **kwargs: object) -> sqlite3.Connection:
        return _connect(*args, factory=_Counted, **kwargs)  # type: ignore[arg-type,misc]

    sqlite3.connect = _counted_connect  # type: ignore[assignment]
    # SIGUSR1: emit how many so far (the benchmark asks at both ends of what it measures)
    signal.signal(signal.SIGUSR1, lambda *_: emit("statements", count=next(STATEMENTS)))

import anarchon_lite
from anarchon_lite import Aborted, Scheduler

SCENARIO, DB, OUT = sys.argv[1:4]
ARGS = sys.argv[4:]
STARTS: list[tuple[str, int, float, float]] = []  # pgcost_busy: (job, slot, when, seconds late)


def emit(kind: str, **fields: object) -> None:
    line = json.dumps({"event": kind, "pid": os.getpid(), "t": time.time(), **fields}) + "\n"
    fd = os.open(OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def compute(seconds: float) -> int:
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += sum(range(200))
    return n


def timed_sum(items: int) -> float:
    """Seconds taken by ``sum(range(items))``: one C call that never lets go of the GIL."""
    begin = time.perf_counter()
    sum(range(items))
    return time.perf_counter() - begin


async def started(ctx) -> None:
    emit("start", job=ctx.job, slot=ctx.slot, attempt=ctx.attempt, late=time.time() - ctx.slot / 1000)


async def wait_out(ctx, duration: float) -> None:
    """Hold the run (its lease renewing) for ``duration``, or until the scheduler stops."""
    try:
        await ctx.signal.sleep(duration)
    except Aborted:
        pass


def declare(scheduler: Scheduler) -> None:
    duration = float(ARGS[0]) if ARGS else 10.0
    mode = SCENARIO.removesuffix("_5ms")  # the same, with the interpreter's switch interval left at 5 ms

    if mode in ("idle", "contended"):  # contended: the same, in four processes at once

        @scheduler.every("hb", "24h", lease="1s", overlap="allow")
        async def idle(ctx):
            await started(ctx)
            await wait_out(ctx, duration)

    elif mode == "chunks":

        @scheduler.every("hb", "24h", lease="1s", overlap="allow")
        async def chunks(ctx):
            await started(ctx)
            end = time.monotonic() + duration
            while time.monotonic() < end and not ctx.signal.aborted:
                compute(0.001)
                await asyncio.sleep(0)

    elif mode in ("thread", "busy_cores"):

        @scheduler.every("hb", "24h", lease="1s", overlap="allow")
        def thread(ctx):
            emit("start", job=ctx.job, slot=ctx.slot, attempt=ctx.attempt, late=0)
            end = time.monotonic() + duration
            while time.monotonic() < end and not ctx.signal.aborted:
                compute(0.05)

    elif mode == "gil_held":  # the limit: one C call holding the GIL for 2.5 leases stops every thread
        per_item = timed_sum(10**6) / 10**6
        items = int(2.5 / per_item)

        @scheduler.every("hb", "24h", lease="1s", overlap="allow")
        async def gil_held(ctx):
            await started(ctx)
            if ctx.attempt == 1:
                emit("gil_held", seconds=timed_sum(items))
            await wait_out(ctx, duration)

    elif mode == "process":
        pool = concurrent.futures.ProcessPoolExecutor(1)

        @scheduler.every("hb", "24h", lease="1s", overlap="allow")
        async def process(ctx):
            await started(ctx)
            loop = asyncio.get_running_loop()
            end = time.monotonic() + duration
            while time.monotonic() < end and not ctx.signal.aborted:
                await loop.run_in_executor(pool, compute, 0.1)

    elif mode == "blocking":

        @scheduler.every("hb", "24h", lease="1s", overlap="allow")
        async def blocking(ctx):
            await started(ctx)
            compute(duration)  # never yields: the event loop is blocked the whole time

    elif mode == "two_threads":  # the switch interval's price: two threads computing, the lease renewing

        @scheduler.every("hb", "24h", lease="1s", overlap="allow")
        def two_threads(ctx):
            emit("work", iterations=_spin.two_threads(duration))

    elif mode in ("export", "export_5s"):  # takeover and hand-over: a long job with a 30 s (5 s) lease

        @scheduler.every("export", "24h", lease="5s" if mode == "export_5s" else "30s")
        async def export(ctx):
            await started(ctx)
            await ctx.signal.sleep(3600)

    elif mode == "every":  # start lateness: a job every second

        @scheduler.every("tick", "1s")
        async def tick(ctx):
            await started(ctx)

    elif mode == "pgcost_hold":  # DURATION COUNT AT: COUNT jobs due at the Unix second AT, each run held

        async def hold(ctx):
            await wait_out(ctx, duration)

        count, at = int(ARGS[1]), int(ARGS[2])
        for i in range(count):
            scheduler.every(f"hold-{i}", "24h", hold, offset=f"{at % 86_400}s")

    elif mode == "pgcost_busy":  # DURATION COUNT INTERVAL: COUNT jobs every INTERVAL s, spread evenly over it

        async def record(ctx):
            now = time.time()
            STARTS.append((ctx.job, ctx.slot, now, now - ctx.slot / 1000))

        count, every_ms = int(ARGS[1]), round(float(ARGS[2]) * 1000)
        for i in range(count):
            scheduler.every(f"tick-{i}", f"{every_ms}ms", record, offset=f"{i * every_ms // count}ms")

    elif mode == "idle_cost":  # nothing may come due while it is measured (up to ten minutes)
        first = (int(time.time()) + 1800) % 3600  # the first of them half an hour from now
        for i in range(10):
            scheduler.every(f"hourly-{i}", "1h", lambda ctx: None, offset=(first + 60 * i) % 3600)


async def main() -> None:
    scheduler = Scheduler(DB, switch_interval=None if SCENARIO.endswith("_5ms") else 0.0005)
    declare(scheduler)
    duration = float(ARGS[0]) if ARGS else 10.0

    @scheduler.every("companion", "24h", lease="1s", overlap="allow")
    async def companion(ctx):  # more leases renewing under the same load, for more samples
        await wait_out(ctx, duration)

    runner = asyncio.ensure_future(scheduler.run())
    while scheduler._loop.ready is None or not scheduler._loop.ready.is_set():
        await asyncio.sleep(0.01)
    emit("ready", module=anarchon_lite.__file__)
    suffix = f"-{scheduler._loop.instance}"  # (the scheduler's threads are named after the process)
    emit("threads", names={t.native_id: t.name.replace(suffix, "") for t in threading.enumerate()})
    await runner
    if STARTS:
        emit("starts", starts=STARTS)
    heartbeats = scheduler._loop.heartbeats
    samples = heartbeats.lateness.samples if heartbeats else []
    emit("heartbeats", samples=samples, lost=heartbeats.lateness.lost if heartbeats else 0)


asyncio.run(main())
