"""A scheduler process for the status page's tests: ``python webapp.py DB``.

Jobs: ``tick`` every second (a steady stream of runs), and three that run only when triggered
(``QUIET``: their own occurrence is hours away): ``work`` reports its progress in 60 steps of
0.25 s (it travels with the heartbeats: a lease of 3 s renews about every second) and saves
each step as its checkpoint, ``fail`` raises an error with markup in it, ``evil`` returns markup that would run a
script if a page let it; and jobs whose names a page must carry whole (``ODD``)."""

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conftest import QUIET  # (this folder is on the path: the script's own)

from anarchon_lite import Scheduler

EVIL = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\">"
scheduler = Scheduler(sys.argv[1], instance="webapp")


@scheduler.every("tick", "1s")
async def tick(ctx):
    return "ok"


@scheduler.every("work", "24h", offset=QUIET, lease="3s")
async def work(ctx):
    for step in range(60):
        ctx.progress(step, 60)
        await ctx.checkpoint.set({"step": step})
        await ctx.signal.sleep(0.25)
    return "done"


@scheduler.every("fail", "24h", offset=QUIET)
def fail(ctx):
    raise ValueError("the disk <b>is</b> full")


@scheduler.every("evil", "24h", offset=QUIET)
def evil(ctx):
    return EVIL


# Names a page must carry whole: a slash, markup, the two that a path takes for steps between folders.
ODD = ('a/b "<i>x</i>"', "..", ".", "é✓日本")
for name in ODD:
    scheduler.every(name, "24h", lambda ctx: None, offset=QUIET)

asyncio.run(scheduler.run())
