"""Hello, world: one job every 2 seconds. Start this script in two terminals: each occurrence is
printed by one of them only, and when one stops (Ctrl-C), the other carries on alone."""

import asyncio

from anarchon_lite import RunContext, Scheduler

scheduler = Scheduler("hello.db")  # every copy of this script shares the file


@scheduler.every("hello", "2s")
def hello(ctx: RunContext) -> None:
    print(f"hello from {ctx.instance}: the occurrence of {ctx.scheduled_at:%H:%M:%S}", flush=True)


if __name__ == "__main__":
    asyncio.run(scheduler.run())  # SIGTERM or Ctrl-C: stop, and hand running jobs over
