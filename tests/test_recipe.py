"""Appendix A, the long-running job recipe: every step, and the README's demo command itself."""

import asyncio
import importlib.util
import os
import re
import sqlite3
import subprocess
import sys

from conftest import QUIET, run, wait_for

from anarchon_lite import Scheduler, Shutdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "export.py")


def load_example():
    spec = importlib.util.spec_from_file_location("export_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_hands_the_export_over_and_exports_each_customer_once():
    """Steps 1, 3 and 5, across two real processes, as the README's demo command runs them."""
    done = subprocess.run([sys.executable, EXAMPLE, "demo"], capture_output=True, text=True, timeout=120, check=True)
    out = done.stdout
    stopped = re.search(r"SIGTERM to pid (\d+)", out)
    assert stopped, out
    saved_by_first = [int(n) for n in re.findall(rf"\[pid {stopped.group(1)}\] .*saved checkpoint (\d+)", out)]
    resumed = re.search(r"attempt=2\] export .*: attempt 2, continuing after (\d+)", out)
    assert resumed and int(resumed.group(1)) == max(saved_by_first) > 0, out
    assert "attempt 1 interrupted" in out and "attempt 2 succeeded" in out
    assert "1200 customers exported, 1200 rows" in out


# (SQLite only: the recipe as the README writes it, on a file)
def test_a_batch_repeated_after_a_crash_is_safe_and_the_timeout_stops_the_job(tmp_path):
    """Step 4: a batch exported but not checkpointed is exported again, as an upsert. Step 2: the
    timeout aborts the signal and the job really stops."""
    example = load_example()
    data = str(tmp_path / "app.db")
    with sqlite3.connect(data) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("CREATE TABLE exported (slot INTEGER, id INTEGER, name TEXT, PRIMARY KEY (slot, id))")
        conn.executemany("INSERT INTO customers VALUES (?, ?)", [(i, f"c{i}") for i in range(1, 1001)])
    exported_batches = []

    async def main():
        s = Scheduler(str(tmp_path / "jobs.db"), poll=0.02)

        @s.every("export", "24h", offset=QUIET)
        async def export(ctx):
            after = await s.checkpoints.get("export", ctx.slot) or 0
            while True:
                ctx.signal.throw_if_aborted()
                batch = example.customers_after(data, after, 200)
                if not batch:
                    break
                example.export_batch(data, batch, ctx.slot)
                exported_batches.append((ctx.attempt, batch[0][0]))
                if ctx.attempt == 1 and batch[0][0] == 401:
                    raise Shutdown("crash after the batch, before its checkpoint")
                after = batch[-1][0]
                await s.checkpoints.set("export", ctx.slot, after)
            await s.checkpoints.delete("export", ctx.slot)

        @s.every("slow-export", "24h", offset=QUIET, timeout="200ms")
        async def slow_export(ctx):
            while True:
                ctx.signal.throw_if_aborted()
                await asyncio.sleep(0.01)

        async with s:
            slot = await s.trigger("export")
            await s.trigger("slow-export")

            async def finished(job, status):
                return any(r.status == status for r in await s.history(job))

            await wait_for(lambda: finished("export", "succeeded"))
            await wait_for(lambda: finished("slow-export", "timed_out"))
        assert await s.checkpoints.get("export", slot) is None
        return slot

    slot = run(main())
    assert exported_batches.count((1, 401)) == 1 and exported_batches.count((2, 401)) == 1
    with sqlite3.connect(data) as conn:
        rows, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT id) FROM exported WHERE slot = ?", (slot,)
        ).fetchone()
    assert rows == distinct == 1000
