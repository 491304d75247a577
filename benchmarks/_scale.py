"""One scheduler process holding many jobs, for the ``scale`` benchmark. Prints one JSON line.

``python _scale.py idle DB COUNT every|cron SECONDS``: none of the jobs due while it is measured;
the time to start (declare, join, first look), the CPU per look and per hour, and how long
``status()`` and ``history(limit=20)`` take.

``python _scale.py spread DB COUNT SECONDS [INTERVAL]``: COUNT jobs ``every INTERVAL`` (seconds;
default 60), their offsets spread evenly over it, handlers that return at once; the CPU share of one
core, the CPU per occurrence and how late each occurrence started (from its scheduled time to its
handler's first line). With INTERVAL = COUNT / 10, ten occurrences fall due each second, one at a
time, whatever COUNT: what an occurrence costs beside how many jobs are declared.

``python _scale.py burst DB COUNT AT UNTIL``: COUNT daily jobs all due at the Unix second AT, run by
as many processes as the benchmark starts on one file; this one's starts, with how late each was, as
it sees them at the Unix second UNTIL, and its CPU (all threads, and the event loop's thread) from
0.3 s before AT until then.

``python _scale.py backlog DB COUNT SECONDS``: COUNT jobs every second (the benchmark has left a
backlog of records in the first one's history, past the default retention); this one's starts, with
how late each was, over SECONDS.

``python _scale.py history DB COUNT PER_JOB``: COUNT hourly jobs with PER_JOB records each in their
history (written straight into the file, as years of runs would have left them); how long
``status()``, ``history(limit=20)`` and ``history(job, limit=20)`` take in a process that only
looks at the file.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _history  # (this folder is on the path: the script's own)

from anarchon_lite import Scheduler

MODE, DB, COUNT = sys.argv[1], sys.argv[2], int(sys.argv[3])
starts: list[tuple[str, float]] = []  # (job, seconds from its slot to its handler's first line)


async def handler(ctx: Any) -> None:
    starts.append((ctx.job, time.time() - ctx.slot / 1000))


def declare_idle(scheduler: Scheduler, kind: str) -> None:
    """COUNT jobs that are not due for the next hours: daily, spread over the hours that follow."""
    hour = time.gmtime().tm_hour
    for i in range(COUNT):
        at = (hour + 2 + i % 20) % 24  # never this hour or the next
        if kind == "cron":
            scheduler.cron(f"job-{i}", f"{i % 60} {at} * * *", handler, tz="UTC")
        else:
            scheduler.every(f"job-{i}", "24h", handler, offset=f"{at}h{i % 60}m")


def lateness(values: list[float]) -> dict[str, float | None]:
    if len(values) < 2:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_ms": cuts[49] * 1000, "p99_ms": cuts[98] * 1000, "max_ms": max(values) * 1000}


async def idle(kind: str, seconds: float) -> dict[str, Any]:
    began = time.monotonic()
    scheduler = Scheduler(DB)
    declare_idle(scheduler, kind)
    looks: list[float] = []
    tick = scheduler._loop._tick

    async def measured() -> None:
        start = time.thread_time()
        await tick()
        looks.append(time.thread_time() - start)

    scheduler._loop._tick = measured  # type: ignore[method-assign]
    async with scheduler:
        started = time.monotonic() - began
        looks.clear()
        cpu = time.process_time()
        await asyncio.sleep(seconds)
        cpu = time.process_time() - cpu
        timings = await timed({"status": scheduler.status, "history": lambda: scheduler.history(limit=20)}, times=21)
    return {
        "jobs": COUNT,
        "kind": kind,
        "start_s": started,
        "looks": len(looks),
        "cpu_per_look_ms": statistics.median(looks) * 1000 if looks else None,
        "idle_cpu_s_per_hour": cpu / seconds * 3600,
        **timings,
    }


async def spread(seconds: float, interval: float) -> dict[str, Any]:
    scheduler = Scheduler(DB)
    every_ms = int(interval * 1000)
    for i in range(COUNT):
        scheduler.every(f"job-{i}", f"{every_ms}ms", handler, offset=f"{i * every_ms // COUNT}ms")
    async with scheduler:
        await asyncio.sleep(5)  # settled: the first look and the occurrences it found late
        starts.clear()
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(seconds)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        ran = [late for _, late in starts]
    return {
        "jobs": COUNT,
        "interval_s": interval,
        "occurrences": len(ran),
        "cpu_share": cpu / wall,
        "cpu_per_occurrence_ms": cpu / len(ran) * 1000 if ran else None,
        **lateness(ran),
    }


async def burst(at: float, until: float) -> dict[str, Any]:
    scheduler = Scheduler(DB)
    for i in range(COUNT):
        scheduler.every(f"job-{i}", "24h", handler, offset=f"{int(at) % 86_400}s")
    async with scheduler:
        await asyncio.sleep(max(0.0, at - 0.3 - time.time()))
        cpu, loop_cpu = time.process_time(), time.thread_time()  # (from just before the burst)
        await asyncio.sleep(max(0.0, until - time.time()))
        cpu, loop_cpu = time.process_time() - cpu, time.thread_time() - loop_cpu
    return {"pid": os.getpid(), "starts": starts, "cpu_s": cpu, "loop_cpu_s": loop_cpu}


async def backlog(seconds: float) -> dict[str, Any]:
    scheduler = Scheduler(DB)
    for i in range(COUNT):
        scheduler.every(f"job-{i}", "1s", handler)
    async with scheduler:
        print("ready", flush=True)
        await asyncio.sleep(seconds)
    return {"starts": [late for _, late in starts]}


async def timed(calls: dict[str, Any], times: int = 5) -> dict[str, float]:
    """The median duration of each call, in ms."""
    result = {}
    for name, call in calls.items():
        samples = []
        for _ in range(times):
            start = time.perf_counter()
            await call()
            samples.append(time.perf_counter() - start)
        result[f"{name}_ms"] = statistics.median(samples) * 1000
    return result


async def history(per_job: int) -> dict[str, Any]:
    declaring = Scheduler(DB, retention=per_job + 10)
    declare_idle(declaring, "every")
    async with declaring:
        pass
    now = int(time.time() * 1000)
    conn = sqlite3.connect(DB, isolation_level=None)
    conn.execute("BEGIN")
    conn.executemany(_history.INSERT, _history.hourly(COUNT, per_job, now))
    conn.execute("COMMIT")
    rows = conn.execute("SELECT count(*) FROM history").fetchone()[0]
    conn.close()
    looking = Scheduler(DB)
    return {
        "jobs": COUNT,
        "history_rows": rows,
        **await timed(
            {
                "status": looking.status,
                "history": lambda: looking.history(limit=20),
                "job_history": lambda: looking.history("job-7", limit=20),
            }
        ),
    }


if MODE == "idle":
    result = asyncio.run(idle(sys.argv[4], float(sys.argv[5])))
elif MODE == "history":
    result = asyncio.run(history(int(sys.argv[4])))
elif MODE == "backlog":
    result = asyncio.run(backlog(float(sys.argv[4])))
elif MODE == "spread":
    result = asyncio.run(spread(float(sys.argv[4]), float(sys.argv[5]) if len(sys.argv) > 5 else 60.0))
else:
    result = asyncio.run(burst(float(sys.argv[4]), float(sys.argv[5])))
print(json.dumps(result), flush=True)
