"""One scheduler process for the ``disk`` benchmark. Prints one JSON line.

``python _disk.py short DB DURABILITY FROM UNTIL``: a job ``every 1s`` whose handler returns at
once; the bytes this process sent to storage between the Unix seconds FROM and UNTIL (its
``/proc/self/io`` ``write_bytes``, less ``cancelled_write_bytes``: pages dirtied and then truncated
away never reach the disk).

``python _disk.py long DB DURABILITY FROM UNTIL``: one attempt that runs from before FROM to after
UNTIL under a 3 s lease; the same bytes, and the lease renewals in between.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from anarchon_lite import Scheduler

MODE, DB, DURABILITY, FROM, UNTIL = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])


def written() -> int:
    """Bytes this process (every thread) has sent to storage so far."""
    with open("/proc/self/io") as handle:
        fields = dict(line.split(": ") for line in handle.read().splitlines())
    return int(fields["write_bytes"]) - int(fields["cancelled_write_bytes"])


async def at(moment: float) -> None:
    await asyncio.sleep(max(0.0, moment - time.time()))


async def main() -> None:
    scheduler = Scheduler(DB, durability=DURABILITY)
    if MODE == "short":
        scheduler.every("tick", "1s", lambda ctx: None)
    else:

        async def long(ctx: Any) -> None:
            await ctx.signal.sleep(UNTIL - time.time() + 30)

        scheduler.every("long", "24h", long, lease="3s")
    async with scheduler:
        if MODE == "long":
            await scheduler.trigger("long")
        await at(FROM)
        heartbeats = scheduler._loop.heartbeats
        before, renewed = written(), len(heartbeats.lateness.samples) if heartbeats else 0
        await at(UNTIL)
        after, renewals = written(), (len(heartbeats.lateness.samples) if heartbeats else 0) - renewed
        running = len(scheduler._loop.runner.running)
    print(json.dumps({"bytes": after - before, "renewals": renewals, "running_at_end": running}), flush=True)


asyncio.run(main())
