"""One scheduler process holding many jobs, none due while it is measured, for the ``scale``
benchmark: ``python _scale.py DB COUNT every|cron SECONDS``. Prints one JSON line: the time to
start (declare, join, first look), the CPU per look and per hour while idle, and how long
``status()`` and ``history(limit=20)`` take."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from anarchon_lite import Scheduler

DB, COUNT, KIND, SECONDS = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])


def declare(scheduler: Scheduler) -> None:
    """COUNT jobs that are not due for the next hours: daily, spread over the hours that follow."""
    hour = time.gmtime().tm_hour
    for i in range(COUNT):
        at = (hour + 2 + i % 20) % 24  # never this hour or the next
        if KIND == "cron":
            scheduler.cron(f"job-{i}", f"{i % 60} {at} * * *", handler, tz="UTC")
        else:
            scheduler.every(f"job-{i}", "24h", handler, offset=f"{at}h{i % 60}m")


def handler(ctx: Any) -> None:
    return None


async def main() -> None:
    began = time.monotonic()
    scheduler = Scheduler(DB)
    declare(scheduler)
    looks: list[float] = []
    tick = scheduler._tick

    async def measured(state: Any) -> None:
        start = time.thread_time()
        await tick(state)
        looks.append(time.thread_time() - start)

    scheduler._tick = measured  # type: ignore[method-assign]
    async with scheduler:
        started = time.monotonic() - began
        looks.clear()
        cpu = time.process_time()
        await asyncio.sleep(SECONDS)
        cpu = time.process_time() - cpu
        timings = {}
        for name, call in [("status", scheduler.status), ("history", lambda: scheduler.history(limit=20))]:
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                await call()
                samples.append(time.perf_counter() - start)
            timings[f"{name}_ms"] = statistics.median(samples) * 1000
    print(
        json.dumps(
            {
                "jobs": COUNT,
                "kind": KIND,
                "start_s": started,
                "looks": len(looks),
                "cpu_per_look_ms": statistics.median(looks) * 1000 if looks else None,
                "idle_cpu_s_per_hour": cpu / SECONDS * 3600,
                **timings,
            }
        ),
        flush=True,
    )


asyncio.run(main())
