"""Load: fifty jobs firing every 100 ms, declared by four processes sharing one file.

    python tests/load.py [--seconds 60] [--jobs 50] [--processes 4] [--json PATH]

Each process also runs one long job with a 1 s lease, so heartbeats are renewed throughout. Then
the jobs are paused, the processes stopped, and the file is judged: every occurrence of every
short job between the first and the last second is accounted for exactly once (``succeeded`` or
``skipped``, never run twice; ``missed`` only where the look that found it found the job's next
occurrence due too, as when every process stalled for an interval: of the occurrences found late in
one look only the newest runs, and those are at most 5% of them), no store error reached a log, no lease was lost, and
the heartbeats' lateness is reported (p50, p99, max). ``tests/test_load.py`` runs a shorter one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

INTERVAL_MS = 100


def worker(directory: str, jobs: int) -> None:
    import logging

    import anarchon_lite as al

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    scheduler = al.Scheduler(os.path.join(directory, "jobs.db"), instance=f"w{os.getpid()}", retention=1_000_000)

    async def short(ctx):
        await asyncio.sleep(0.002)

    async def long(ctx):
        await ctx.signal.wait()  # until the process stops: its lease is renewed all along

    for i in range(jobs):
        scheduler.every(f"job{i:02d}", f"{INTERVAL_MS}ms", short, lease="5s")
    scheduler.every(f"long-{os.getpid()}", "24h", long, lease="1s")

    async def serve():
        runner = asyncio.ensure_future(scheduler.run())
        while scheduler._loop.ready is None or not scheduler._loop.ready.is_set():
            if runner.done():
                break
            await asyncio.sleep(0.01)
        await scheduler.trigger(f"long-{os.getpid()}")
        with open(os.path.join(directory, f"ready-{os.getpid()}"), "w"):  # noqa: ASYNC230 - once
            pass
        await runner
        heartbeats = scheduler._loop.heartbeats
        report = {"samples": heartbeats.lateness.samples, "lost": heartbeats.lateness.lost} if heartbeats else {}
        with open(os.path.join(directory, f"heartbeats-{os.getpid()}.json"), "w") as handle:  # noqa: ASYNC230
            json.dump(report, handle)

    asyncio.run(serve())


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(directory: str, seconds: float, jobs: int = 50, processes: int = 4) -> dict:
    db = os.path.join(directory, "jobs.db")
    procs = []
    try:
        for i in range(processes):
            with open(os.path.join(directory, f"worker-{i}.log"), "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, os.path.abspath(__file__), "--worker", directory, "--jobs", str(jobs)],
                        stderr=log,
                    )
                )
        # The span starts once every worker has joined (on a loaded machine, starting four
        # interpreters can take seconds: occurrences before a job is declared are no one's to run).
        deadline = time.monotonic() + 120
        while sum(name.startswith("ready-") for name in os.listdir(directory)) < processes:
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"worker {proc.pid} exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not all start within 120 s")
            time.sleep(0.05)
        started = time.time()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"worker {proc.pid} exited with {proc.returncode}")
            time.sleep(0.1)
        ended = time.time()
        conn = sqlite3.connect(db, timeout=60, isolation_level=None)
        try:
            conn.execute("UPDATE jobs SET paused = 1 WHERE name LIKE 'job%'")
        finally:
            conn.close()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return judge(directory, started, ended, jobs, processes)


def judge(directory: str, started: float, ended: float, jobs: int, processes: int) -> dict:
    conn = sqlite3.connect(os.path.join(directory, "jobs.db"))
    try:
        history = conn.execute(
            "SELECT job, slot, attempt, status, finished_at FROM history WHERE job LIKE 'job%'"
        ).fetchall()
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()
    problems = [] if integrity == "ok" else [f"integrity_check: {integrity}"]
    low = (int(started) + 2) * 1000  # from two seconds after every process had joined ...
    high = (int(ended) - 1) * 1000  # ... to a second before the pause
    expected = list(range(low, high, INTERVAL_MS))
    counts = {"succeeded": 0, "skipped": 0, "missed": 0, "other": 0}
    by_job: dict[str, dict[int, list[str]]] = {}
    for job, slot, _attempt, status, finished_at in history:
        if status == "missed" and finished_at >= slot + INTERVAL_MS:
            status = "coalesced"  # recorded by a look that found the next occurrence due too
        by_job.setdefault(job, {}).setdefault(slot, []).append(status)
    for i in range(jobs):
        name = f"job{i:02d}"
        slots = by_job.get(name, {})
        for slot in expected:
            statuses = slots.get(slot, [])
            ended_as = [s for s in statuses if s != "interrupted"]
            if len(ended_as) != 1:
                problems.append(f"{name} slot {slot}: recorded as {statuses}")
                continue
            status = "missed" if ended_as[0] == "coalesced" else ended_as[0]
            counts[status if status in counts else "other"] += 1
            if ended_as[0] not in ("succeeded", "skipped", "coalesced"):
                problems.append(f"{name} slot {slot}: {ended_as[0]}")
    if counts["missed"] > 0.05 * len(expected) * jobs:
        problems.append(f"{counts['missed']} occurrences missed (found late together with the next)")
    samples, lost = [], 0
    errors = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith("heartbeats-"):
            with open(path) as handle:
                data = json.load(handle)
            samples += data.get("samples", [])
            lost += data.get("lost", 0)
        elif name.startswith("worker-"):
            with open(path, errors="replace") as handle:
                errors += [f"{name}: {line.strip()}" for line in handle if "ERROR" in line or "locked" in line]
    problems += errors
    if lost:
        problems.append(f"{lost} leases lost")
    return {
        "seconds": round(ended - started, 1),
        "jobs": jobs,
        "processes": processes,
        "occurrences_judged": len(expected) * jobs,
        "statuses": counts,
        "heartbeats": {
            "renewals": len(samples),
            "p50_ms": round(percentile(samples, 0.5) * 1000, 2),
            "p99_ms": round(percentile(samples, 0.99) * 1000, 2),
            "max_ms": round(max(samples, default=float("nan")) * 1000, 2),
            "lost_leases": lost,
        },
        "problems": problems,
    }


def describe(report: dict) -> str:
    h = report["heartbeats"]
    lines = [
        f"{report['jobs']} jobs every {INTERVAL_MS} ms, {report['processes']} processes, {report['seconds']} s",
        f"occurrences judged {report['occurrences_judged']}: "
        + ", ".join(f"{k} {v}" for k, v in report["statuses"].items()),
        (
            f"heartbeats {h['renewals']}: p50 {h['p50_ms']} ms, p99 {h['p99_ms']} ms, max {h['max_ms']} ms, "
            f"lost leases {h['lost_leases']}"
        ),
        f"problems: {len(report['problems'])}",
    ]
    lines += [f"  {p}" for p in report["problems"][:20]]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.jobs)
        return 0
    with tempfile.TemporaryDirectory(prefix="anarchon-load-") as directory:
        report = run(directory, args.seconds, args.jobs, args.processes)
    print(describe(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
