"""The long-running job recipe, end to end: an hourly export that stops when asked, has a timeout,
keeps a checkpoint, exports idempotent batches and tells its attempts apart.

    python examples/export.py demo       # two processes, one stopped mid-export, the other finishes
    python examples/export.py worker DB  # one scheduler process (what the demo starts twice)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from anarchon_lite import Scheduler

CUSTOMERS = 1200
BATCH = 200


def customers_after(data: str, after: int, limit: int) -> list[tuple[int, str]]:
    """The application's own data: customers with an id above ``after``."""
    with sqlite3.connect(data) as conn:
        return conn.execute(
            "SELECT id, name FROM customers WHERE id > ? ORDER BY id LIMIT ?", (after, limit)
        ).fetchall()


def export_batch(data: str, batch: list[tuple[int, str]], slot: int) -> None:
    """Step 4: an idempotent batch (an upsert), safe to repeat after a crash."""
    with sqlite3.connect(data) as conn:
        conn.executemany(
            "INSERT INTO exported (slot, id, name) VALUES (?, ?, ?) ON CONFLICT (slot, id) DO UPDATE SET name = excluded.name",
            [(slot, i, name) for i, name in batch],
        )


def build(db: str, data: str) -> Scheduler:
    scheduler = Scheduler(db, instance=f"instance-{os.getpid()}")

    # Step 2: a timeout. Steps 1, 3 and 5 are in the handler.
    @scheduler.every("export", "1h", timeout="50m")
    async def export(ctx):
        checkpoints = scheduler.checkpoints
        after = await checkpoints.get("export", ctx.slot) or 0  # step 3: continue where we stopped
        if ctx.attempt > 1:  # step 5: tell attempts apart
            ctx.log.warning("export %s: attempt %d, continuing after %d", ctx.scheduled_at, ctx.attempt, after)
        while True:
            ctx.signal.throw_if_aborted()  # step 1: stop when asked, between two batches
            batch = customers_after(data, after, BATCH)
            if not batch:
                break
            await ctx.signal.run(asyncio.to_thread(export_batch, data, batch, ctx.slot))
            await asyncio.sleep(0.5)  # stands for the time a real export takes
            after = batch[-1][0]
            await checkpoints.set("export", ctx.slot, after)
            ctx.log.info("exported customers %d-%d, saved checkpoint %d", batch[0][0], after, after)
        await checkpoints.delete("export", ctx.slot)
        ctx.log.info("export finished: %d customers", after)

    return scheduler


def worker(db: str, data: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[pid {os.getpid()}] %(message)s", stream=sys.stdout)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    asyncio.run(build(db, data).run())


def demo() -> None:
    folder = tempfile.mkdtemp(prefix="anarchon-demo-")
    db, data = os.path.join(folder, "jobs.db"), os.path.join(folder, "app.db")
    with sqlite3.connect(data) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("CREATE TABLE exported (slot INTEGER, id INTEGER, name TEXT, PRIMARY KEY (slot, id))")
        conn.executemany("INSERT INTO customers VALUES (?, ?)", [(i, f"customer {i}") for i in range(1, CUSTOMERS + 1)])
    print(f"demo: two scheduler processes share {db}")
    procs = [subprocess.Popen([sys.executable, __file__, "worker", db, data]) for _ in range(2)]
    try:
        scheduler = Scheduler(db)
        while not asyncio.run(scheduler.status()):
            time.sleep(0.1)
        slot = asyncio.run(scheduler.trigger("export"))
        print(f"demo: triggered the export, slot {slot}")
        owner = None
        while owner is None or asyncio.run(scheduler.checkpoints.get("export", slot)) in (None, BATCH):
            runs = [r for job in asyncio.run(scheduler.status()) for r in job.runs if r.owner]
            owner = int(runs[0].owner.rsplit("-", 1)[1]) if runs else None
            time.sleep(0.1)
        print(f"demo: deploying: SIGTERM to pid {owner}, which holds the export")
        os.kill(owner, signal.SIGTERM)
        next(p for p in procs if p.pid == owner).wait(timeout=30)
        while not any(r.status == "succeeded" for r in asyncio.run(scheduler.history("export"))):
            time.sleep(0.1)
        for record in reversed(asyncio.run(scheduler.history("export"))):
            print(f"demo: history: attempt {record.attempt} {record.status} on {record.instance}")
        with sqlite3.connect(data) as conn:
            rows, distinct = conn.execute("SELECT count(*), count(DISTINCT id) FROM exported").fetchone()
        print(f"demo: {distinct} customers exported, {rows} rows: every customer once")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=30)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2], sys.argv[3])
    else:
        demo()
