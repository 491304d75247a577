"""One scheduler process, JOBS jobs every second spread over it, each with ``timeout="1h"``,
handlers that return at once: prints, as JSON, the CPU of the process and the context switches of
its timer thread and of all its threads, per occurrence over SECONDS.

``python _timeouts.py JOBS SECONDS`` (``run.timeouts_one``). The worktree's anarchon_lite is
imported, unless ``$PYTHONPATH`` names a folder holding another (``ab.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import threading
import time

import run  # noqa: F401 - (this folder's, first: it puts the root after the $PYTHONPATH entries)

from anarchon_lite import Scheduler


def switches(tid: int) -> int:
    """The context switches of one thread of this process so far (0 once it has ended)."""
    try:
        with open(f"/proc/{os.getpid()}/task/{tid}/status") as status:
            return sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)
    except FileNotFoundError:
        return 0


async def main(jobs: int, seconds: float) -> dict[str, float]:
    starts = []
    with tempfile.TemporaryDirectory() as folder:
        s = Scheduler(os.path.join(folder, "timeouts.db"))
        for i in range(jobs):
            s.every(f"j{i}", "1s", lambda ctx: starts.append(1), offset=f"{i * 1000 // jobs}ms", timeout="1h")
        async with s:
            await asyncio.sleep(4.0)  # (declared and looking)
            threads = {t.name: t.native_id for t in threading.enumerate() if t.native_id is not None}
            before = {name: switches(tid) for name, tid in threads.items()}
            cpu, began = time.process_time(), len(starts)
            await asyncio.sleep(seconds)
            cpu, occurrences = time.process_time() - cpu, max(len(starts) - began, 1)
            after = {name: switches(tid) for name, tid in threads.items()}
    moved = {name: after[name] - before[name] for name in after if after[name]}  # (threads still there)
    timers = sum(count for name, count in moved.items() if name.startswith("anarchon-timers"))
    return {
        "occurrences": occurrences,
        "cpu_per_occurrence_ms": cpu / occurrences * 1000,
        "timer_thread_switches_per_occurrence": timers / occurrences,
        "switches_per_occurrence": sum(moved.values()) / occurrences,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(int(sys.argv[1]), float(sys.argv[2])))))
