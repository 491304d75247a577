"""A peer scheduler process for the side-by-side benchmark (run inside the peer's own venv).

``python peer_worker.py aps3|aps4|aps4pg DB OUT SECONDS_IDLE [long]``: a job every second, declared the
same way by every process, as people deploy it under gunicorn; each run appends its scheduled second
and lateness to OUT. With SECONDS_IDLE > 0 the process instead holds ten hourly jobs and nothing due.
With ``long``, one hourly job whose first run is due at ``$PEER_AT`` (epoch seconds) and lasts an hour:
the run a takeover is measured on. With ``spread COUNT`` (APScheduler 4), COUNT jobs every minute,
their first runs spread over the minute from ``$PEER_AT``, handlers that return at once (the
``scale`` benchmark's busy workload). With ``sweep COUNT``, COUNT jobs every second, their slots
spread evenly over the second (the ``sweep`` benchmark's workload); each record names its job. ``aps4pg``: APScheduler 4 on PostgreSQL (DB is a
``postgresql://`` URL), with its asyncpg event broker.
"""

import asyncio
import datetime as dt
import json
import os
import signal
import sys
import time

KIND, DB, OUT = sys.argv[1:4]
IDLE = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
LONG = sys.argv[5:6] == ["long"]
SPREAD = int(sys.argv[6]) if sys.argv[5:6] == ["spread"] else 0  # COUNT jobs every minute, spread over it
SWEEP = int(sys.argv[6]) if sys.argv[5:6] == ["sweep"] else 0  # COUNT jobs every second, spread over it


def record(scheduled: float, job: str = "tick") -> None:
    now = time.time()
    line = json.dumps({"pid": os.getpid(), "job": job, "slot": round(scheduled, 3), "late": now - scheduled}) + "\n"
    fd = os.open(OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def tick_aps3() -> None:
    record(float(int(time.time())))  # the interval starts on a whole second: runs are due on them


def offset_aps3(job: str, offset: float) -> None:
    # (APScheduler 3 does not tell a job its scheduled time: the latest slot of its phase, runs
    # being less than a second late)
    now = time.time()
    record(int(now - offset) + offset, job)


async def tick_aps4() -> None:
    from apscheduler import current_job

    job = current_job.get()
    record(job.scheduled_fire_time.timestamp(), job.schedule_id or "tick")


async def long_aps4() -> None:
    await tick_aps4()
    await asyncio.sleep(3600)


def hourly() -> None:
    return None


def aligned() -> dt.datetime:
    return dt.datetime.fromtimestamp(int(time.time()) + 2, dt.timezone.utc)


def run_aps3() -> None:
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
    from apscheduler.schedulers.asyncio import AsyncIOScheduler

    async def main() -> None:
        scheduler = AsyncIOScheduler(jobstores={"default": SQLAlchemyJobStore(url=f"sqlite:///{DB}")})
        if IDLE:
            for i in range(10):
                scheduler.add_job(hourly, "interval", hours=1, id=f"hourly-{i}", replace_existing=True)
        elif SWEEP:
            start = aligned()
            for i in range(SWEEP):
                offset = i / SWEEP
                scheduler.add_job(
                    offset_aps3,
                    "interval",
                    seconds=1,
                    start_date=start + dt.timedelta(seconds=offset),
                    args=(f"job-{i}", offset),
                    id=f"job-{i}",
                    replace_existing=True,
                )
        else:
            scheduler.add_job(tick_aps3, "interval", seconds=1, start_date=aligned(), id="tick", replace_existing=True)
        scheduler.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print("ready", flush=True)
        await stop.wait()
        scheduler.shutdown(wait=False)

    asyncio.run(main())


def run_aps4() -> None:
    from apscheduler import AsyncScheduler, ConflictPolicy
    from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
    from apscheduler.triggers.interval import IntervalTrigger

    async def main() -> None:
        if KIND == "aps4pg":
            from apscheduler.eventbrokers.asyncpg import AsyncpgEventBroker
            from sqlalchemy.ext.asyncio import create_async_engine

            engine = create_async_engine(DB.replace("postgresql://", "postgresql+asyncpg://", 1))
            store, broker = SQLAlchemyDataStore(engine), AsyncpgEventBroker.from_async_sqla_engine(engine)
            opened = AsyncScheduler(store, broker)
        else:
            opened = AsyncScheduler(SQLAlchemyDataStore(f"sqlite+aiosqlite:///{DB}"))
        async with opened as scheduler:
            if LONG:
                at = dt.datetime.fromtimestamp(float(os.environ["PEER_AT"]), dt.timezone.utc)
                await scheduler.add_schedule(
                    long_aps4,
                    IntervalTrigger(hours=1, start_time=at),
                    id="long",
                    conflict_policy=ConflictPolicy.do_nothing,
                )
            elif SPREAD:
                at = float(os.environ["PEER_AT"])
                for i in range(SPREAD):
                    first = dt.datetime.fromtimestamp(at + i * 60 / SPREAD, dt.timezone.utc)
                    await scheduler.add_schedule(
                        tick_aps4,
                        IntervalTrigger(minutes=1, start_time=first),
                        id=f"job-{i}",
                        conflict_policy=ConflictPolicy.replace,
                    )
            elif SWEEP:
                start = aligned()
                for i in range(SWEEP):
                    await scheduler.add_schedule(
                        tick_aps4,
                        IntervalTrigger(seconds=1, start_time=start + dt.timedelta(seconds=i / SWEEP)),
                        id=f"job-{i}",
                        conflict_policy=ConflictPolicy.replace,
                    )
            elif IDLE:
                for i in range(10):
                    await scheduler.add_schedule(
                        hourly, IntervalTrigger(hours=1), id=f"hourly-{i}", conflict_policy=ConflictPolicy.replace
                    )
            else:
                await scheduler.add_schedule(
                    tick_aps4,
                    IntervalTrigger(seconds=1, start_time=aligned()),
                    id="tick",
                    conflict_policy=ConflictPolicy.replace,
                )
            asyncio.get_running_loop().add_signal_handler(
                signal.SIGTERM, lambda: asyncio.ensure_future(scheduler.stop())
            )
            print("ready", flush=True)
            await scheduler.run_until_stopped()

    asyncio.run(main())


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import peer_worker  # so that APScheduler 4 can refer to the job functions by module name

    peer_worker.run_aps3() if KIND == "aps3" else peer_worker.run_aps4()
