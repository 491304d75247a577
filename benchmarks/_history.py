"""Records made up for the benchmarks: the history of a box that has run many jobs for a while."""

from collections.abc import Iterator
from typing import Any

INSERT = (
    "INSERT INTO history (job, slot, attempt, status, instance, started_at, finished_at, error) "
    "VALUES (?, ?, 1, ?, 'bench', ?, ?, ?)"
)


def hourly(jobs: int, per_job: int, now: int) -> Iterator[tuple[Any, ...]]:
    """``per_job`` records of each job ``job-0`` ... ``job-{jobs - 1}``, an hour apart up to
    ``now`` (milliseconds), one in ten failed: rows for ``INSERT``."""
    for k in range(per_job):
        failed = k % 10 == 0
        for i in range(jobs):
            slot = now - (per_job - k) * 3_600_000 - i
            yield (f"job-{i}", slot, "failed" if failed else "succeeded", slot, slot + 100, "boom" if failed else None)
