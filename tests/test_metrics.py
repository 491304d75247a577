"""The metrics: the Prometheus text and the node_exporter textfile."""

import asyncio
import time

import pytest
from conftest import run, wait_for
from schedulers import (
    make,
)


@pytest.fixture
def db(store):
    """Every test here runs on both stores (``store``), unless marked ``sqlite_only``."""
    return store


def metric(text, name, **labels):
    """The value of one sample in a Prometheus text, or None."""
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_the_metrics_file_counts_runs_by_status_through_pruning_and_tells_times(db, tmp_path):
    """metrics_file= is rewritten (whole: no temporary file stays) after runs end: counters of
    runs by status that pruning the history does not lower (retention 2, 4 successes: 4), the newest
    start, success, failure and duration, the attempts running, and this process's renewal
    lateness; prometheus() returns the same figures."""
    path = tmp_path / "metrics" / "anarchon.prom"
    path.parent.mkdir()

    async def slow(ctx):
        await asyncio.sleep(2.5)  # renewed a few times under its short lease

    def fails(ctx):
        raise RuntimeError("no")

    async def main():
        s = make(db, retention=2, metrics_file=path)
        s.every("ok", "1d", lambda ctx: None, overlap="allow")
        s.every("bad", "1d", fails)
        s.every("slow", "1d", slow, lease="0.6s")

        def figure(name, **labels):
            return metric(path.read_text() if path.exists() else "", name, **labels)

        async with s:
            await wait_for(lambda: figure("anarchon_job_running", job="ok") == 0, message="the first figures")
            for _ in range(4):
                await s.trigger("ok")
            await s.trigger("bad")
            await s.trigger("slow")
            await wait_for(lambda: figure("anarchon_job_running", job="slow") == 1, timeout=20)
            await wait_for(lambda: figure("anarchon_job_runs_total", job="ok", status="succeeded") == 4, timeout=20)
            await wait_for(lambda: figure("anarchon_job_runs_total", job="slow", status="succeeded") == 1, timeout=20)
            await wait_for(lambda: figure("anarchon_job_running", job="slow") == 0, timeout=20)
            assert len(await s.history("ok")) == 2  # pruned to the retention; the counter kept 4
            text = path.read_text()
            assert metric(text, "anarchon_job_runs_total", job="bad", status="failed") == 1
            assert metric(text, "anarchon_job_runs_total", job="bad", status="succeeded") == 0
            assert metric(text, "anarchon_job_last_success_timestamp_seconds", job="bad") is None
            now = time.time()
            assert now - 60 < metric(text, "anarchon_job_last_failure_timestamp_seconds", job="bad") <= now
            assert now - 60 < metric(text, "anarchon_job_last_success_timestamp_seconds", job="ok") <= now
            assert 2.4 < metric(text, "anarchon_job_last_duration_seconds", job="slow") < 30
            started = metric(text, "anarchon_job_last_start_timestamp_seconds", job="slow")
            assert now - 60 < started <= metric(text, "anarchon_job_last_success_timestamp_seconds", job="slow")
            assert 0 <= metric(text, "anarchon_lease_renewal_lateness_p99_seconds", instance=s.instance) < 30
            assert "# TYPE anarchon_job_runs_total counter" in text
            figures = await s.prometheus()
            assert metric(figures, "anarchon_job_runs_total", job="ok", status="succeeded") == 4
        assert sorted(p.name for p in path.parent.iterdir()) == ["anarchon.prom"]
        assert metric(path.read_text(), "anarchon_job_running", job="slow") == 0

    run(main())
