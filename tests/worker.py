"""A scheduler process for the multi-process tests: ``python worker.py DB EVENTS MODE [LEASE]``.

Every event is one JSON line appended to EVENTS, so the test can follow what each process did.
Modes: ``every`` (a 500 ms job), ``export`` (the checkpointed recipe, triggered by the test),
``block`` (an async handler that blocks the event loop for three and a half leases), ``spin``
(the same in a plain-function handler's thread), ``escape`` (raises SystemExit, then
KeyboardInterrupt, then succeeds), ``clock`` (a 1 s job, with the system's wall clock
plus the offset in seconds read from the file EVENTS.offset), ``runtime`` (declares jobs while it
runs when the test asks: see ``declare_when_asked``).
"""

import asyncio
import faulthandler
import json
import os
import select
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conftest import QUIET  # (this folder is on the path: the script's own)

from anarchon_lite import Aborted, Clock, LeaseLost, Scheduler

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the tests ask a stuck worker where it is
DB, EVENTS, MODE = sys.argv[1:4]
LEASE = float(sys.argv[4]) if len(sys.argv) > 4 else 30.0
STEPS = int(os.environ.get("WORKER_EXPORT_STEPS", "60"))  # how many checkpoints an export saves


def host_pid():
    """This process's pid as the test sees it: in a pid namespace of its own (a simulated host),
    the test writes it to $WORKER_PID_FILE, since the worker itself only sees its inner pid."""
    path = os.environ.get("WORKER_PID_FILE")
    if not path:
        return os.getpid()
    deadline = time.monotonic() + 20
    while not os.path.exists(path) and time.monotonic() < deadline:
        select.select((), (), (), 0.01)  # (not time.sleep: libfaketime breaks it, see anarchon_lite._pause)
    with open(path) as handle:
        return int(handle.read())


PID = host_pid()
ME = f"{MODE}-{PID}"


def emit(kind, **fields):
    line = json.dumps({"event": kind, "pid": PID, "t": time.time(), **fields}) + "\n"
    fd = os.open(EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


async def tick(ctx):
    emit("run", job=ctx.job, slot=ctx.slot, attempt=ctx.attempt)


async def export(ctx):
    after = await ctx.checkpoint.get(0)
    emit("start", slot=ctx.slot, attempt=ctx.attempt, after=after)
    try:
        while after < STEPS:
            await asyncio.sleep(0.1)
            after += 1
            await ctx.checkpoint.set(after)  # written before looking at the signal, on purpose
            emit("saved", slot=ctx.slot, attempt=ctx.attempt, after=after)
            ctx.signal.throw_if_aborted()
    except LeaseLost as exc:
        emit("refused", attempt=ctx.attempt, reason=type(ctx.signal.reason).__name__, error=str(exc))
        raise
    except Aborted as exc:
        emit("aborted", attempt=ctx.attempt, reason=type(exc).__name__)
        raise
    await ctx.checkpoint.delete()
    emit("done", slot=ctx.slot, attempt=ctx.attempt, after=after)


async def block(ctx):
    emit("start", slot=ctx.slot, attempt=ctx.attempt)
    end = time.monotonic() + 3.5 * LEASE
    n = 0
    while time.monotonic() < end:  # never yields to the event loop
        n += sum(range(1000))
    emit("done", slot=ctx.slot, attempt=ctx.attempt)


def spin(ctx):
    """A plain-function handler computing in its worker thread for three and a half leases."""
    emit("start", slot=ctx.slot, attempt=ctx.attempt)
    end = time.monotonic() + 3.5 * LEASE
    n = 0
    while time.monotonic() < end:
        n += sum(range(1000))
    emit("done", slot=ctx.slot, attempt=ctx.attempt)


async def escape(ctx):
    """Raises what would end a process: SystemExit on attempt 1, KeyboardInterrupt on attempt 2."""
    emit("start", slot=ctx.slot, attempt=ctx.attempt)
    if ctx.attempt == 1:
        raise SystemExit(3)
    if ctx.attempt == 2:
        raise KeyboardInterrupt
    emit("done", slot=ctx.slot, attempt=ctx.attempt)


async def declare_when_asked(scheduler, runner):
    """While the scheduler runs: when the file EVENTS.add.PID appears, declare a job every 500 ms
    (``added``) and a one-shot job (``once``) at the epoch seconds the file holds; when
    EVENTS.remove.PID appears, remove ``added``. Each is told with an event."""
    steps = [
        ("add", "added", lambda when: (scheduler.every("added", "500ms", tick), scheduler.at("once", when, tick))),
        ("remove", "removed", lambda _when: scheduler.remove("added")),
    ]
    for step, told, act in steps:
        path = f"{EVENTS}.{step}.{PID}"
        while not os.path.exists(path) and not runner.done():
            await asyncio.sleep(0.02)
        if runner.done():
            return
        with open(path) as handle:  # noqa: ASYNC230 - a few bytes, once
            act(float(handle.read() or 0))
        emit(told, instance=ME)


class OffsetClock(Clock):
    """The system's clocks, with the wall clock moved by the offset in a file (a wrong boot clock)."""

    def time(self):
        with open(EVENTS + ".offset") as handle:
            return time.time() + float(handle.read())


async def main():
    scheduler = Scheduler(DB, instance=ME, clock=OffsetClock() if MODE == "clock" else None)
    if MODE == "every":
        scheduler.every("tick", "500ms", tick)
    elif MODE == "export":
        scheduler.every("export", "24h", export, offset=QUIET, lease=LEASE)
    elif MODE == "block":
        scheduler.every("block", "24h", block, offset=QUIET, lease=LEASE)
    elif MODE == "clock":
        scheduler.every("tick", "1s", tick)
    elif MODE == "spin":
        scheduler.every("spin", "24h", spin, offset=QUIET, lease=LEASE)
    elif MODE == "escape":
        scheduler.every("escape", "24h", escape, offset=QUIET, retries=2, retry_delay="100ms")
    if MODE == "runtime":
        scheduler.every("base", "24h", tick, offset=QUIET)
    runner = asyncio.ensure_future(scheduler.run())
    await asyncio.sleep(0)
    while scheduler._loop.ready is None or not scheduler._loop.ready.is_set():
        if runner.done():
            runner.result()  # the scheduler failed to start: show why
        await asyncio.sleep(0.01)
    emit("ready", instance=ME)
    if MODE == "runtime":
        await declare_when_asked(scheduler, runner)
    await runner
    emit("exit", instance=ME)


asyncio.run(main())
