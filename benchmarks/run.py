"""anarchon_lite benchmarks: ``python benchmarks/run.py [--quick] [--json PATH] [--plot PATH] [--store S]``.

Measures heartbeat lateness under seven kinds of load, takeover after ``kill -9`` and hand-over
after SIGTERM, how late runs start, the cost of an idle scheduler, the bytes written to storage per
occurrence and per renewal (SQLite), import time and idle memory, and the same small workloads on
APScheduler 3 and 4 side by side. ``--only takeover|scale|disk|lean|pgcost|web|sweep|neighbour|backlog`` measures one section
(``pgcost``, with ``--store postgresql`` only: the server's and the schedulers' CPU with 1,000 runs
running, a busy load of 1,000 jobs on four processes, and an idle process watching another's run;
``web``: the status page over 10,000 jobs and 1,000,000 records, and 50 pages listening live;
``backlog``: a history of 1,000,000 records past the retention pruned while 20 jobs run every second). Prints a table; ``--json`` writes the figures, ``--plot`` a PNG.
With ``--store postgresql`` every scheduler shares a throwaway PostgreSQL server (tests/pgserver.py,
or ``$ANARCHON_TEST_POSTGRES``) instead of an SQLite file, and the takeover of an owner whose
connections freeze (a partition, through tests/tcpproxy.py) is measured too.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import py_compile
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# after the $PYTHONPATH entries, as in _worker.py: a folder named there (another tree) comes first
sys.path.insert(1 + len([path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]), ROOT)


from _spin import two_threads

from anarchon_lite import Scheduler

WORKER = os.path.join(HERE, "_worker.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))  # pgserver, tcpproxy
STORE: dict[str, Any] = {"server": None, "schemas": 0}  # --store postgresql: the server


def location(folder: str) -> str:
    """Where a scenario's schedulers keep their state: a file in ``folder``, or a fresh schema."""
    server = STORE["server"]
    if server is None:
        return os.path.join(folder, "jobs.db")
    STORE["schemas"] += 1
    return str(server.url(schema=f"bench_{os.getpid()}_{STORE['schemas']}"))


def query(db: str, sql: str) -> list[Any]:
    """The rows of one statement on the scheduler's tables, wherever they are."""
    if not db.startswith("postgresql://"):
        with sqlite3.connect(db) as conn:
            return conn.execute(sql).fetchall()
    import pgserver

    return pgserver.query(db, sql)


MODES = ["idle", "chunks", "thread", "process", "blocking", "busy_cores", "contended"]
# the heartbeat thread lowers the GIL switch interval to 0.5 ms around its rounds; these never do
MODES_5MS = ["thread_5ms", "blocking_5ms", "busy_cores_5ms"]
# the limit no heartbeat thread can pass: one C call holds the GIL for 2.5 leases (two processes,
# so that the other one takes the run over)
LIMIT = "gil_held"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class Fleet:
    """Worker processes of one scenario, all ended and reaped on exit."""

    def __init__(self, scenario: str, folder: str, *args: str):
        self.scenario, self.args = scenario, args
        self.db, self.out = location(folder), os.path.join(folder, "events.jsonl")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stderr: int | None = None  # where the workers' log goes (None: this process's stderr)

    def start(self, count: int = 1, db: str | None = None) -> list[subprocess.Popen[bytes]]:
        """Start ``count`` workers on the fleet's database (or ``db``: the same one by another way)."""
        new = [
            subprocess.Popen(
                [sys.executable, WORKER, self.scenario, db or self.db, self.out, *self.args], stderr=self.stderr
            )
            for _ in range(count)
        ]
        self.procs += new
        for proc in new:
            self.wait(lambda e, pid=proc.pid: e["event"] == "ready" and e["pid"] == pid)
        return new

    def start_isolated(self) -> int:
        """Start one worker in a pid namespace of its own (``unshare --pid --fork --mount-proc``: a
        container of its own sharing the folder); returns its pid as this namespace sees it."""
        unshare = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGKILL", sys.executable, WORKER]
            + [self.scenario, self.db, self.out, *self.args]
        )
        self.procs.append(unshare)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{unshare.pid}/task/{unshare.pid}/children") as handle:
                children = handle.read().split()
            if children:
                break
            time.sleep(0.01)
        else:
            raise TimeoutError("the isolated worker did not start")
        self.wait(lambda e: e["event"] == "ready" and e["pid"] == 1)  # (pid 1 of its namespace)
        return int(children[0])

    def events(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.out):
            return []
        with open(self.out) as handle:
            return [json.loads(line) for line in handle if line.endswith("\n")]

    def wait(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events():
                if predicate(event):
                    return event
            time.sleep(0.005)
        raise TimeoutError(f"{self.scenario}: no matching event in {timeout} s")

    def trigger(self, job: str, times: int = 1) -> None:
        scheduler = Scheduler(self.db)
        for _ in range(times):
            asyncio.run(scheduler.trigger(job))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Fleet:  # noqa: PYI034 - no typing_extensions with the bench extra
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def takeovers(db: str) -> int:
    """Attempts after the first: each one is a run taken over from a live owner in these runs."""
    return int(query(db, "SELECT count(*) FROM history WHERE attempt > 1")[0][0])


def heartbeat(mode: str, seconds: float) -> dict[str, Any]:
    hogs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as folder, Fleet(mode, folder, str(seconds)) as fleet:
        fleet.start({"contended": 4, LIMIT: 2}.get(mode, 1))
        if mode.startswith("busy_cores"):
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
        try:
            runs = 4 if mode == "contended" else 1
            fleet.trigger("companion", 4 * runs)
            time.sleep(0.5)  # companions run before a handler that may block the loop starts
            fleet.trigger("hb", runs)
            time.sleep(seconds + 1.0)
            fleet.stop()
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        samples: list[float] = []
        found_taken = 0
        extra: dict[str, Any] = {}
        for event in fleet.events():
            if event["event"] == "heartbeats":
                samples += event["samples"]
                found_taken += event["lost"]
            elif event["event"] == "gil_held":
                extra["gil_held_s"] = event["seconds"]
        taken = takeovers(fleet.db)
    ms = [s * 1000 for s in samples]
    return {
        "renewals": len(ms),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms) if ms else float("nan"),
        # a run taken over from its live owner, whether or not a renewal of the owner saw it after
        "lost_leases": max(taken, found_taken),
        "takeovers": taken,
        "renewals_that_found_the_run_taken": found_taken,
        **extra,
        "samples_ms": ms,
    }


def heartbeats(plan: dict[str, int], seconds: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Every mode of ``plan`` measured that many times, in turns (one repetition of each mode, then
    the next), so that a disturbance of the machine lasting a minute spoils one repetition of a few
    modes rather than every repetition of one. Each mode reports the medians of its repetitions'
    p50 and p99, the worst renewal of all, and the sums of renewals and lost leases; the samples of
    every repetition are pooled for the plot."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in plan}
    for turn in range(max(plan.values())):
        for mode, count in plan.items():
            if turn < count:
                runs[mode].append(heartbeat(mode, seconds[mode]))
                print(f"heartbeat {mode} {turn + 1}/{count}: done", flush=True)
    return {mode: summarize(reps) for mode, reps in runs.items()}


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "renewals": sum(r["renewals"] for r in reps),
        "p50_ms": statistics.median(r["p50_ms"] for r in reps),
        "p99_ms": statistics.median(r["p99_ms"] for r in reps),
        "max_ms": max(r["max_ms"] for r in reps),
        "lost_leases": sum(r["lost_leases"] for r in reps),
        **({"gil_held_s": max(r["gil_held_s"] for r in reps)} if "gil_held_s" in reps[0] else {}),
        "repetitions": [{k: v for k, v in r.items() if k != "samples_ms"} for r in reps],
        "samples_ms": [s for r in reps for s in r["samples_ms"]],
    }


PHASES = random.Random(20261203)  # when in its run the owner of a takeover trial is killed


def takeover(trials: int, graceful: bool, isolated: bool = False) -> dict[str, Any]:
    """Seconds from the owner's SIGKILL (or SIGTERM) to attempt 2's start in the other process;
    ``isolated``: the owner runs in a pid namespace of its own, where no /proc look reaches it."""
    times = []
    for _ in range(trials):
        with tempfile.TemporaryDirectory() as folder, Fleet("export", folder) as fleet:
            if isolated:  # the owner alone runs the export; the other process starts after it
                owner = fleet.start_isolated()
                fleet.trigger("export")
                fleet.wait(lambda e: e["event"] == "start" and e["attempt"] == 1)
                fleet.start(1)
            else:
                fleet.start(2)
                fleet.trigger("export")
                owner = fleet.wait(lambda e: e["event"] == "start" and e["attempt"] == 1)["pid"]
            # A crash comes at any moment, not in step with the other process's look (on PostgreSQL
            # it reads the runs every 0.5 s while it watches one, the first of them when the claim
            # is notified): killed after a random fraction of a second.
            time.sleep(PHASES.uniform(0.0, 1.0))
            killed = time.time()
            os.kill(owner, signal.SIGTERM if graceful else signal.SIGKILL)
            second = fleet.wait(lambda e: e["event"] == "start" and e["attempt"] == 2)
            times.append(second["t"] - killed)
            fleet.stop()
    return {"p50": statistics.median(times), "max": max(times), "n": len(times), "samples_s": times}


def frozen_takeover(trials: int) -> dict[str, Any]:
    """PostgreSQL: the owner's connections freeze (no FIN, no reset: a partition); its lock stays
    held, so its lease (5 s) decides. Seconds from the freeze to attempt 2's start."""
    import urllib.parse

    from tcpproxy import Proxy

    times = []
    for _ in range(trials):
        with tempfile.TemporaryDirectory() as folder, Fleet("export_5s", folder) as fleet:
            parts = urllib.parse.urlsplit(fleet.db)
            proxy = Proxy((parts.hostname, parts.port))
            try:
                via = urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}@127.0.0.1:{proxy.port}"))
                fleet.start(1, db=via)
                fleet.trigger("export")
                fleet.wait(lambda e: e["event"] == "start" and e["attempt"] == 1)
                fleet.start(1)
                time.sleep(1.0)
                proxy.freeze()
                frozen = time.time()
                second = fleet.wait(lambda e: e["event"] == "start" and e["attempt"] == 2)
                times.append(second["t"] - frozen)
                proxy.thaw()
                fleet.stop()
            finally:
                proxy.close()
    return {"p50": statistics.median(times), "max": max(times), "n": len(times), "lease_s": 5.0, "samples_s": times}


def start_lateness(processes: int, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder, Fleet("every", folder) as fleet:
        fleet.start(processes)
        begin = time.time()
        time.sleep(seconds)
        fleet.stop()
        late = [e["late"] * 1000 for e in fleet.events() if e["event"] == "start" and e["t"] > begin + 1]
        slots = [e["slot"] for e in fleet.events() if e["event"] == "start"]
    return {
        "p50": percentile(late, 50),
        "p99": percentile(late, 99),
        "runs": len(late),
        "duplicates": len(slots) - len(set(slots)),
        "seconds": seconds,
    }


def proc_stats(pid: int) -> tuple[float, int, float]:
    """CPU seconds, voluntary context switches and resident MB of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    switches, rss = 0, 0.0
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("voluntary_ctxt_switches"):
                switches = int(line.split()[1])
            elif line.startswith("VmRSS"):
                rss = int(line.split()[1]) / 1024
    return cpu, switches, rss


class IdleProbe:
    """One scheduler with ten hourly jobs and nothing due, measured while the other benchmarks run."""

    def __init__(self) -> None:
        self.folder = tempfile.TemporaryDirectory()
        self.fleet = Fleet("idle_cost", self.folder.name)
        server = STORE["server"]
        if server is not None:  # a database of its own, so that its statistics count only this process
            self.stats = PostgresActivity(server)
            self.fleet.db = str(server.url(self.stats.database, schema="idle"))
        self.fleet.start(1)
        # (a PostgreSQL backend left idle reports its counters within 10 s: those of the start-up)
        time.sleep(1.0 if server is None else 11.0)
        self.pid = self.fleet.procs[0].pid
        self.begin = time.monotonic()
        self.cpu0, self.switches0, _ = proc_stats(self.pid)
        if server is None:
            self.conn = sqlite3.connect(self.fleet.db)
            self.version = self.conn.execute("PRAGMA data_version").fetchone()[0]
        else:
            self.activity = self.stats.read()

    def result(self, minimum: float) -> dict[str, Any]:
        remaining = minimum - (time.monotonic() - self.begin)
        if remaining > 0:
            time.sleep(remaining)
        elapsed = time.monotonic() - self.begin
        cpu, switches, rss = proc_stats(self.pid)
        extra: dict[str, Any] = {}
        if STORE["server"] is None:
            writes = int(self.conn.execute("PRAGMA data_version").fetchone()[0] != self.version)
            self.conn.close()
        else:
            transactions, rows = (now - then for now, then in zip(self.stats.read(), self.activity))
            writes = rows
            extra = {"queries_per_hour": transactions / (elapsed / 3600)}
        self.fleet.stop()
        self.fleet.__exit__()
        self.folder.cleanup()
        hours = elapsed / 3600
        return {
            "cpu_resolution_s_per_hour": 1 / os.sysconf("SC_CLK_TCK") / hours,
            "wakeups_per_min": (switches - self.switches0) / elapsed * 60,
            "cpu_s_per_hour": (cpu - self.cpu0) / hours,
            "rss_mb": rss,
            "db_writes_per_hour": writes / hours,
            "seconds": elapsed,
            **extra,
        }


class PostgresActivity:
    """The transactions and the rows written in one database of the server, from its statistics
    (read from another database, so that reading them counts nothing)."""

    def __init__(self, server: Any, name: str = "idle"):
        import psycopg

        self.database = f"{name}_{os.getpid()}"
        self._url = server.url()
        with psycopg.connect(self._url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {self.database}")
        self.url = str(server.url(self.database))  # the database it counts in

    def read(self) -> tuple[int, int]:
        import psycopg

        with psycopg.connect(self._url, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_force_next_flush()")
            time.sleep(1.5)  # other backends flush their counters at least once a second when active
            row = conn.execute(
                "SELECT xact_commit + xact_rollback, tup_inserted + tup_updated + tup_deleted "
                "FROM pg_stat_database WHERE datname = %s",
                (self.database,),
            ).fetchone()
        return int(row[0]), int(row[1])


def switch_cost(seconds: float) -> dict[str, Any]:
    """The price of the switch interval: the work two computing threads get done in ``seconds``.

    In this process, at 5 ms and at 0.5 ms throughout, alternating three times; and in a scheduler
    process, as a plain-function handler and a thread of its own while the run's lease renews, with
    the interval lowered around each round (as the scheduler does) and left at 5 ms
    (``switch_interval=None``), alternating three times. Ratios of the medians."""

    def in_process(interval: float) -> int:
        sys.setswitchinterval(interval)
        return two_threads(seconds)

    def in_scheduler(scenario: str) -> int:
        with tempfile.TemporaryDirectory() as folder, Fleet(scenario, folder, str(seconds)) as fleet:
            fleet.start(1)
            fleet.trigger("hb")
            work = fleet.wait(lambda e: e["event"] == "work", timeout=seconds + 60)
            fleet.stop()
        return int(work["iterations"])

    default = sys.getswitchinterval()
    try:
        at5, at05 = [], []
        for _ in range(3):
            at5.append(in_process(0.005))
            at05.append(in_process(0.0005))
    finally:
        sys.setswitchinterval(default)
    left, lowered = [], []
    for _ in range(3):
        left.append(in_scheduler("two_threads_5ms"))
        lowered.append(in_scheduler("two_threads"))
    return {
        "iterations_5ms": statistics.median(at5),
        "iterations_0_5ms": statistics.median(at05),
        "ratio_0_5ms_to_5ms": statistics.median(at05) / statistics.median(at5),
        "scheduler_iterations_left_5ms": statistics.median(left),
        "scheduler_iterations_lowered_around_rounds": statistics.median(lowered),
        "ratio_scheduler_lowered_to_left": statistics.median(lowered) / statistics.median(left),
    }


def machine() -> dict[str, Any]:
    server = STORE["server"]
    return {
        "store": "sqlite"
        if server is None
        else "postgresql " + str(query(server.url(schema="public"), "SHOW server_version")[0][0]),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter run (under 4 minutes)")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--plot", help="draw a PNG to this file")
    parser.add_argument("--no-peers", action="store_true", help="skip APScheduler")
    parser.add_argument("--store", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument(
        "--only",
        choices=("takeover", "scale", "disk", "lean", "pgcost", "web", "sweep", "neighbour", "backlog"),
        help="measure only this section",
    )
    args = parser.parse_args()
    if args.store == "postgresql":
        import pgserver

        STORE["server"] = pgserver.Server.start()
    try:
        return measure(args)
    finally:
        if STORE["server"] is not None:
            STORE["server"].stop()


def takeovers_section(quick: bool) -> dict[str, Any]:
    trials = 5 if quick else 10
    section = {
        "kill9_s": takeover(trials, False),
        "kill9_other_pidns_s": takeover(trials, False, isolated=True),
        "handover_s": takeover(trials, True),
    }
    if STORE["server"] is not None:
        section["frozen_connection_s"] = frozen_takeover(3 if quick else 5)
    print("takeover: done", flush=True)
    return section


def web(quick: bool) -> dict[str, Any]:
    """The status page (``_web.py``): each page's answer over 10,000 jobs and 1,000,000 records, a
    day's timeline of a job every second; the page's process's CPU and memory with 50 pages
    listening live to a scheduler running a job every second. On SQLite."""
    with tempfile.TemporaryDirectory() as folder:
        out = subprocess.run(
            [sys.executable, os.path.join(HERE, "_web.py"), folder, "10" if quick else "60"],
            check=True,
            capture_output=True,
            text=True,
            timeout=900,
        ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def report_web(section: dict[str, Any]) -> None:
    print(f"\nstatus page, {section['jobs']:,} jobs and {section['records']:,} records")
    for name, figures in section["pages"].items():
        print(f"  {name:<48} p50 {figures['p50_ms']:7.1f} ms   p99 {figures['p99_ms']:7.1f} ms")
    for name, figures in section["live"].items():
        print(
            f"  {name} listening for {section['seconds']:g} s: {figures['cpu_share_of_a_core']:.1%} of a core, "
            f"{figures['rss_mb']:.1f} MB resident, {figures['bytes_told_per_page_per_s']:.0f} bytes a page a second "
            f"({figures['pages_told']} pages told)"
        )


def _scale_run(*args: str, timeout: float = 600.0) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "_scale.py"), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def scale(quick: bool, peers: bool = True) -> dict[str, Any]:
    """Many jobs, on SQLite: idle (10, 1,000 and 10,000 jobs, ``every`` and cron, none due: start,
    CPU per look and per hour, ``status()``); busy (as many jobs ``every 1m`` spread over the
    minute: CPU share, CPU per occurrence, start lateness); steady (as many jobs, spread so that ten
    fall due each second whatever their number: CPU per occurrence beside the number of jobs alone);
    10,000 due in the same second (one and
    four processes); 10,000 jobs with 1,000,000 history records (the calls and the command line).
    With ``peers``, the busy workload on APScheduler 4 (SQLite) too, one process, the same spans."""
    idle_s, busy_s = (20.0, 30.0) if quick else (60.0, 120.0)
    section: dict[str, Any] = {
        "idle": [],
        "busy": [],
        "steady": [],
        "burst": [],
        "history": {},
        "busy_apscheduler4": [],
    }
    aps4 = None
    if peers:
        from peers import PEERS, venv_python

        aps4 = venv_python(*PEERS["apscheduler4"])
    for count in (10, 1_000, 10_000):
        for kind in ("every", "cron"):
            with tempfile.TemporaryDirectory() as folder:
                section["idle"].append(
                    _scale_run("idle", os.path.join(folder, "jobs.db"), str(count), kind, str(idle_s))
                )
        with tempfile.TemporaryDirectory() as folder:
            section["busy"].append(_scale_run("spread", os.path.join(folder, "jobs.db"), str(count), str(busy_s)))
        with tempfile.TemporaryDirectory() as folder:
            every = str(count / 10)  # ten occurrences a second, one at a time
            section["steady"].append(
                _scale_run("spread", os.path.join(folder, "jobs.db"), str(count), str(busy_s), every)
            )
        if aps4 is not None:
            from peers import spread

            section["busy_apscheduler4"].append(spread(aps4, count, busy_s))
        print(f"scale {count}: done", flush=True)
    for processes in (1, 4):
        with tempfile.TemporaryDirectory() as folder:
            section["burst"].append(burst(os.path.join(folder, "jobs.db"), 10_000, processes))
    print("scale burst: done", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        db = os.path.join(folder, "jobs.db")
        section["history"] = _scale_run("history", db, "10000", "100")
        # As installed, as ``lean`` measures the import: the bytecode compiled (pip does it; under
        # $PYTHONDONTWRITEBYTECODE each command would compile the module first, about 0.1 s).
        py_compile.compile(os.path.join(ROOT, "anarchon_lite.py"), doraise=True)
        for key, command in [
            ("status", ["status"]),
            ("history", ["history"]),
            ("job_history", ["history", "--job", "job-7"]),
        ]:
            samples = []
            for _ in range(3):
                start = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "anarchon_lite", "--db", db, *command],
                    cwd=ROOT,
                    check=True,
                    capture_output=True,
                )
                samples.append(time.perf_counter() - start)
            section["history"][f"cli_{key}_s"] = statistics.median(samples)
    print("scale history: done", flush=True)
    return section


def burst(db: str, count: int, processes: int) -> dict[str, Any]:
    """``count`` jobs due at the same second, declared by ``processes`` processes: how late each
    started, how many each process ran, and whether any ran twice or not at all."""
    at = int(time.time()) + 10 + 2 * processes  # time for the processes to start and declare
    outs = json_lines([os.path.join(HERE, "_scale.py"), "burst", db, str(count), str(at), str(at + 15)], processes, 120)
    starts = [late for out in outs for _, late in out["starts"]]
    jobs = [job for out in outs for job, _ in out["starts"]]
    return {
        "jobs": count,
        "processes": processes,
        "started": len(starts),
        "distinct": len(set(jobs)),
        "per_process": [len(out["starts"]) for out in outs],
        "p50_s": percentile(starts, 50),
        "p99_s": percentile(starts, 99),
        "max_s": max(starts, default=float("nan")),
        # (every process, from just before the burst to the end: the loop's thread is its bound)
        "cpu_us_per_occurrence": sum(out["cpu_s"] for out in outs) / max(len(starts), 1) * 1e6,
        "loop_cpu_us_per_occurrence": sum(out["loop_cpu_s"] for out in outs) / max(len(starts), 1) * 1e6,
    }


def disk(quick: bool) -> dict[str, Any]:
    """Bytes sent to storage (every process's ``write_bytes``: WAL, checkpoints, everything), on a
    file on disk (not /tmp, which may be RAM): per occurrence of a job ``every 1s`` with a handler
    that returns at once, with one and four processes, and per lease renewal of a running attempt;
    with each durability."""
    span = 30.0 if quick else 120.0
    section: dict[str, Any] = {"short": [], "heartbeat": []}
    for durability in ("full", "normal"):
        for processes in (1, 4):
            with tempfile.TemporaryDirectory(prefix=".disk-", dir=ROOT) as folder:
                db = os.path.join(folder, "jobs.db")
                prefill(db, "tick", 1000)
                start = time.time() + 5 + 2 * processes  # time to start, join and settle
                outs = _disk_runs("short", db, durability, start, start + span, processes)
                runs = query(
                    db,
                    f"SELECT count(*) FROM history WHERE status = 'succeeded' AND slot >= {int(start * 1000)} "
                    f"AND slot < {int((start + span) * 1000)}",
                )[0][0]
            per = sum(out["bytes"] for out in outs) / max(runs, 1)
            section["short"].append(
                {
                    "durability": durability,
                    "processes": processes,
                    "occurrences": runs,
                    "bytes_per_occurrence": per,
                    "per_day_every_second_mb": per * 86400 / 1e6,
                    "per_day_every_minute_mb": per * 1440 / 1e6,
                }
            )
        with tempfile.TemporaryDirectory(prefix=".disk-", dir=ROOT) as folder:
            start = time.time() + 5
            (out,) = _disk_runs("long", os.path.join(folder, "jobs.db"), durability, start, start + span, 1)
        section["heartbeat"].append(
            {
                "durability": durability,
                "renewals": out["renewals"],
                "bytes": out["bytes"],
                "bytes_per_renewal": out["bytes"] / max(out["renewals"], 1),
            }
        )
        print(f"disk {durability}: done", flush=True)
    return section


_IDLE_TEN = """
import asyncio, sys
sys.path.insert(0, sys.argv[2])
from anarchon_lite import Scheduler
async def main():
    scheduler = Scheduler(sys.argv[1])
    for i in range(10):
        scheduler.every(f"job-{i}", "24h", lambda ctx: None, offset=f"{i}h")
    async with scheduler:
        print("ready", flush=True)
        await asyncio.sleep(3600)
asyncio.run(main())
"""


def lean(quick: bool) -> dict[str, Any]:
    """The module's import time (``-X importtime``, its cumulative line, bytecode already compiled;
    median of many fresh interpreters) and the resident memory of an idle process with 10 jobs."""
    runs = 11 if quick else 31
    command = [sys.executable, "-X", "importtime", "-c", "import anarchon_lite"]
    # As installed: the bytecode compiled (pip does it; $PYTHONDONTWRITEBYTECODE would make every
    # import compile the source, 60 ms more, and leave the compiler's memory in the process's RSS)
    py_compile.compile(os.path.join(ROOT, "anarchon_lite.py"), doraise=True)
    samples = []
    for _ in range(runs):
        err = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stderr
        line = next(line for line in err.splitlines() if line.rstrip().endswith("| anarchon_lite"))
        samples.append(int(line.split("|")[1]) / 1000)
    rss = [idle_rss(ROOT) for _ in range(3 if quick else 5)]
    with tempfile.TemporaryDirectory() as source:  # a vendored copy run from source, never compiled to a file
        shutil.copy(os.path.join(ROOT, "anarchon_lite.py"), source)
        rss_source = [idle_rss(source, {"PYTHONDONTWRITEBYTECODE": "1"}) for _ in range(3 if quick else 5)]
    print("lean: done", flush=True)
    return {
        "import_ms_p50": statistics.median(samples),
        "import_ms_max": max(samples),
        "imports": runs,
        "idle_rss_mb_p50": statistics.median(rss),
        "idle_rss_mb_max": max(rss),
        "idle_rss_from_source_mb_p50": statistics.median(rss_source),
        "idle_rss_from_source_mb_max": max(rss_source),
    }


def idle_rss(folder: str, env: dict[str, str] | None = None) -> float:
    """The resident memory (MB) of an idle process with 10 jobs importing ``anarchon_lite`` from
    ``folder``, 2 s after its scheduler started."""
    with tempfile.TemporaryDirectory() as db:
        proc = subprocess.Popen(
            [sys.executable, "-c", _IDLE_TEN, os.path.join(db, "jobs.db"), folder],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            time.sleep(2.0)  # (its threads started, its first looks made)
            with open(f"/proc/{proc.pid}/status") as handle:
                return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:")) / 1024
        finally:
            proc.kill()
            proc.wait()


def report_lean(section: dict[str, Any]) -> None:
    print(
        f"\nimport anarchon_lite: {section['import_ms_p50']:.1f} ms median (max {section['import_ms_max']:.1f}, "
        f"{section['imports']} interpreters); idle process with 10 jobs: {section['idle_rss_mb_p50']:.1f} MB resident "
        f"(max {section['idle_rss_mb_max']:.1f}); run from source without cached bytecode: "
        f"{section.get('idle_rss_from_source_mb_p50', float('nan')):.1f} MB"
    )


def backlog(records: int, seconds: float) -> dict[str, Any]:
    """A history of ``records`` of one job (the default retention is 1,000: it was raised, or an
    older version left them), then one process with 20 jobs every second, that job among them:
    how late their occurrences start while the backlog is pruned, how many were missed, when the
    job's records were down to the retention and the file down to twice its live data, and the
    file's size before and after."""
    with tempfile.TemporaryDirectory(prefix=".backlog-", dir=ROOT) as folder:  # (on disk, not in RAM)
        db = os.path.join(folder, "jobs.db")
        prefill(db, "job-0", records)
        before = os.path.getsize(db)
        began = time.time()
        proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_scale.py"), "backlog", db, "20", str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        pruned_s = shrunk_s = None
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            printed: list[str] = []  # (read meanwhile: its last line is larger than a pipe holds)
            reader = threading.Thread(target=lambda: printed.append(proc.stdout.read()))  # type: ignore[union-attr]
            reader.start()
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
                while proc.poll() is None and (pruned_s is None or shrunk_s is None):
                    time.sleep(0.5)
                    left = conn.execute("SELECT count(*) FROM history WHERE job = 'job-0'").fetchone()[0]
                    if pruned_s is None and left <= 1_100:
                        pruned_s = time.time() - began
                    pages, free, size = (
                        conn.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "freelist_count", "page_size")
                    )
                    if pruned_s is not None and shrunk_s is None and os.path.getsize(db) <= 2 * (pages - free) * size:
                        shrunk_s = time.time() - began
            reader.join(timeout=seconds + 60)
            out = json.loads(printed[0].strip().splitlines()[-1])
        finally:
            proc.kill()
            proc.wait()
        with sqlite3.connect(db) as conn:
            missed = conn.execute(
                "SELECT count(*) FROM history WHERE status = 'missed' AND slot >= ?", (int(began * 1000),)
            ).fetchone()[0]
            pages, free, size = (
                conn.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "freelist_count", "page_size")
            )
        after = os.path.getsize(db)
    starts = out["starts"]
    print("backlog: done", flush=True)
    return {
        "records": records,
        "occurrences": len(starts),
        "missed": missed,
        "late_p50_ms": percentile(starts, 50) * 1000,
        "late_p99_ms": percentile(starts, 99) * 1000,
        "late_max_ms": max(starts, default=float("nan")) * 1000,
        "pruned_s": pruned_s,
        "shrunk_s": shrunk_s,
        "file_before_mb": before / 1e6,
        "file_after_mb": after / 1e6,
        "live_after_mb": (pages - free) * size / 1e6,
    }


def report_backlog(section: dict[str, Any]) -> None:
    print(
        f"\nbacklog of {section['records']:,} records: {section['occurrences']} occurrences started "
        f"p50/p99/max {section['late_p50_ms']:.1f}/{section['late_p99_ms']:.1f}/{section['late_max_ms']:.1f} ms late, "
        f"{section['missed']} missed; down to the retention after {section['pruned_s']} s, the file to twice "
        f"its live data after {section['shrunk_s']} s; file {section['file_before_mb']:.1f} -> "
        f"{section['file_after_mb']:.1f} MB ({section['live_after_mb']:.2f} MB live)"
    )


def prefill(db: str, job: str, records: int) -> None:
    """A file whose history holds ``records`` of ``job`` already (the default retention: a box that
    has run for a while prunes as it goes)."""
    asyncio.run(Scheduler(db).status())  # (creates the file)
    now = int(time.time() * 1000)
    with sqlite3.connect(db) as conn:
        conn.executemany(
            "INSERT INTO history (job, slot, attempt, status, instance, started_at, finished_at) "
            "VALUES (?, ?, 1, 'succeeded', 'before', ?, ?)",
            [(job, slot, slot, slot + 1) for slot in range(now - records * 1000, now - 1000, 1000)],
        )


def _disk_runs(mode: str, db: str, durability: str, start: float, until: float, processes: int) -> list[Any]:
    args = [os.path.join(HERE, "_disk.py"), mode, db, durability, str(start), str(until)]
    return json_lines(args, processes, until - time.time() + 120)


def json_lines(args: list[str], processes: int, timeout: float) -> list[Any]:
    """Run ``processes`` copies of the Python program ``args`` at once; the JSON line each prints
    last. Every one is ended and reaped."""
    procs = [subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    try:
        return [json.loads(p.communicate(timeout=timeout)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def report_disk(section: dict[str, Any]) -> None:
    print("\nbytes to storage per occurrence (a job every 1 s, a handler that returns at once)")
    print("durability  processes  occurrences  KB/occurrence  MB/day every 1 s  MB/day every 1 min")
    for r in section["short"]:
        print(
            f"{r['durability']:<11} {r['processes']:>9}  {r['occurrences']:>11}  {r['bytes_per_occurrence'] / 1024:>13.1f}"
            f"  {r['per_day_every_second_mb']:>16.1f}  {r['per_day_every_minute_mb']:>18.2f}"
        )
    for r in section["heartbeat"]:
        print(
            f"lease renewals ({r['durability']}): {r['renewals']} renewals, {r['bytes']} bytes, "
            f"{r['bytes_per_renewal']:.0f} bytes per renewal"
        )


def report_scale(section: dict[str, Any]) -> None:
    print("\nidle (none due)")
    print("jobs    kind   start s  CPU/look ms  idle CPU s/h  status ms  history ms")
    for r in section["idle"]:
        print(
            f"{r['jobs']:<7} {r['kind']:<6} {r['start_s']:>7.3f}  {r['cpu_per_look_ms'] or 0:>11.2f}"
            f"  {r['idle_cpu_s_per_hour']:>12.2f}  {r['status_ms']:>9.1f}  {r['history_ms']:>10.1f}"
        )
    for key, title in (
        ("busy", "busy (every 1m, spread over the minute)"),
        ("steady", "steady (ten occurrences a second, one at a time, whatever the number of jobs)"),
    ):
        print(f"\n{title}")
        print("jobs    occurrences  CPU share  CPU/occurrence ms  lateness p50 ms  p99 ms  max ms")
        for r in section.get(key, []):
            print(
                f"{r['jobs']:<7} {r['occurrences']:>11}  {r['cpu_share']:>8.1%}  {r['cpu_per_occurrence_ms'] or 0:>17.2f}"
                f"  {r['p50_ms'] or 0:>15.1f}  {r['p99_ms'] or 0:>6.1f}  {r['max_ms'] or 0:>6.1f}"
            )
    if section.get("busy_apscheduler4"):
        print("\nthe same busy workload on APScheduler 4.0.0a6 (SQLAlchemy data store on SQLite), one process")
        print("jobs    occurrences  expected  CPU share  lateness p50 ms  p99 ms  max ms")
        for r in section["busy_apscheduler4"]:
            print(
                f"{r['jobs']:<7} {r['occurrences']:>11}  {r['expected']:>8}  {r['cpu_share']:>8.1%}"
                f"  {r['p50_ms']:>15.1f}  {r['p99_ms']:>6.1f}  {r['max_ms']:>6.1f}"
            )
    print("\ndue in the same second")
    for r in section["burst"]:
        print(
            f"{r['jobs']} jobs, {r['processes']} processes: started {r['started']} ({r['distinct']} distinct), "
            f"per process {r['per_process']}, lateness p50 {r['p50_s']:.3f} s, p99 {r['p99_s']:.3f} s, max {r['max_s']:.3f} s, "
            f"CPU {r['cpu_us_per_occurrence']:.0f} µs an occurrence ({r['loop_cpu_us_per_occurrence']:.0f} on the loop's thread)"
        )
    h = section["history"]
    print(
        f"\n{h['jobs']} jobs, {h['history_rows']} history records: status() {h['status_ms']:.1f} ms, "
        f"history(limit=20) {h['history_ms']:.1f} ms, history(job, 20) {h['job_history_ms']:.1f} ms; command line: "
        f"status {h['cli_status_s']:.2f} s, history {h['cli_history_s']:.2f} s, history --job {h['cli_job_history_s']:.2f} s"
    )


def report_takeover(t: dict[str, Any]) -> None:
    print()
    for key, what in [
        ("kill9_s", "takeover after kill -9 (lease 30 s):"),
        ("kill9_other_pidns_s", "the same, owner in another pid namespace:"),
        ("handover_s", "hand-over after SIGTERM:"),
    ]:
        if key in t:
            print(f"{what:<42} p50 {t[key]['p50']:.3f} s, max {t[key]['max']:.3f} s, n {t[key]['n']}")
    if "frozen_connection_s" in t:
        f = t["frozen_connection_s"]
        print(
            f"takeover after a partition (lease {f['lease_s']:.0f} s): p50 {f['p50']:.3f} s, max {f['max']:.3f} s, n {f['n']}"
        )


def measure(args: argparse.Namespace) -> int:
    quick = args.quick
    results: dict[str, Any] = {"machine": machine()}
    if args.only is not None:
        if args.only == "takeover":
            results["takeover"] = takeovers_section(quick)
            report_takeover(results["takeover"])
        elif args.only == "disk":
            results["disk"] = disk(quick)
            report_disk(results["disk"])
        elif args.only == "lean":
            results["lean"] = lean(quick)
            report_lean(results["lean"])
        elif args.only == "pgcost":
            results["pgcost"] = pgcost(quick)
            report_pgcost(results["pgcost"])
        elif args.only == "web":
            results["web"] = web(quick)
            report_web(results["web"])
        elif args.only == "sweep":
            results["sweep"] = sweep(quick, peers=not args.no_peers)
            report_sweep(results["sweep"])
            if args.plot:
                from plot import draw_sweep

                draw_sweep(results, args.plot)
        elif args.only == "neighbour":
            results["neighbour"] = neighbour(30.0 if quick else 120.0)
            print(
                "idle (10 hourly jobs) beside a file written 80 times a second:"
                f" {results['neighbour']['wakeups_per_s']:.2f} wake-ups a second,"
                f" {results['neighbour']['cpu_s_per_hour']:.2f} CPU-s an hour (goals ≤ 1, ≤ 1)"
            )
        elif args.only == "backlog":
            results["backlog"] = backlog(200_000 if quick else 1_000_000, 60.0 if quick else 180.0)
            report_backlog(results["backlog"])
        else:
            results["scale"] = scale(quick, peers=not args.no_peers)
            report_scale(results["scale"])
            if args.plot:
                from plot import draw_scale

                draw_scale(results, args.plot)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=1)
        return 0
    idle = IdleProbe()
    # a full run measures each mode three times for 30 s (90 renewal rounds: a p99 that is not just
    # the worst round); the *_5ms twins and the GIL limit are illustrations: once each
    plan = {mode: 1 if quick else 3 for mode in MODES} | {mode: 1 for mode in [*MODES_5MS, LIMIT]}
    seconds = {mode: 5.0 if quick else 30.0 for mode in MODES}
    seconds |= {mode: 5.0 if quick else 20.0 for mode in MODES_5MS} | {LIMIT: 8.0}
    results["heartbeat"] = heartbeats(plan, seconds)
    results["takeover"] = takeovers_section(quick)
    span = 20.0 if quick else 30.0  # the four-process run is the peers' workload: the same span as theirs
    results["start_lateness_ms"] = {"single": start_lateness(1, span / 2), "four_processes": start_lateness(4, span)}
    print("start lateness: done", flush=True)
    results["idle"] = idle.result(60.0 if quick else 600.0)
    results["switch_interval_cost"] = switch_cost(2.0 if quick else 5.0)
    results["disk"] = disk(quick)
    results["lean"] = lean(quick)
    if not args.no_peers:
        from peers import run_peers

        results["peers"] = run_peers(results, quick, STORE["server"], PostgresActivity)
    report(results)
    report_disk(results["disk"])
    report_lean(results["lean"])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    if args.plot:
        from plot import draw

        draw(results, args.plot)
    return 0


# -- PostgreSQL: cost with many jobs and running runs (--only pgcost) ------------------------------


class ServerCost:
    """What the throwaway server spends on one database, between ``mark()`` and ``since()``: CPU
    (the postmaster's own and its reaped children's, from /proc/PID/stat, plus every live child's:
    backends, autovacuum, checkpointer, WAL writer; a backend that ends in between is counted by its
    parent once reaped), statements (pg_stat_statements, reset at the mark; by role when asked),
    transactions (pg_stat_database, for the database) and serialization failures (SQLSTATE 40001
    and 40P01, counted in the server's log: pg_stat_statements records no failed statement)."""

    def __init__(self, server: Any, database: str):
        import psycopg

        if server.folder is None:
            raise SystemExit("--only pgcost needs a server of its own (tests/pgserver.py), not $ANARCHON_TEST_POSTGRES")
        self.server, self.database = server, database
        self.admin = psycopg.connect(server.url(), autocommit=True)
        self.admin.execute(f"CREATE DATABASE {database}")
        self.admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        if not self.admin.execute("SELECT 1 FROM pg_roles WHERE rolname = 'bench_watcher'").fetchone():
            self.admin.execute("CREATE ROLE bench_watcher LOGIN SUPERUSER")
        with open(os.path.join(server.folder, "data", "postmaster.pid")) as handle:
            self.postmaster = int(handle.readline())
        self.log = os.path.join(server.folder, "log")

    def url(self, role: str = "postgres") -> str:
        return str(self.server.url(self.database, schema="bench")).replace("//postgres@", f"//{role}@", 1)

    def cpu(self) -> float:
        """CPU seconds of the server's processes so far."""
        tick = os.sysconf("SC_CLK_TCK")
        with open(f"/proc/{self.postmaster}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        total = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        with open(f"/proc/{self.postmaster}/task/{self.postmaster}/children") as handle:
            children = handle.read().split()
        for child in children:
            try:
                with open(f"/proc/{child}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:  # (ended since: its parent counts it once reaped)
                continue
            total += int(fields[11]) + int(fields[12])
        return total / tick

    def _database(self) -> tuple[int, int]:
        self.admin.execute("SELECT pg_stat_force_next_flush()")
        row = self.admin.execute(
            "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s", (self.database,)
        ).fetchone()
        return int(row[0]), int(row[1])

    def mark(self) -> None:
        self.admin.execute("SELECT pg_stat_statements_reset()")
        with open(self.log, "rb") as handle:
            self.log_at = handle.seek(0, os.SEEK_END)
        self.xacts = self._database()
        self.cpu0, self.t0 = self.cpu(), time.monotonic()

    def since(self) -> dict[str, Any]:
        cpu, elapsed = self.cpu() - self.cpu0, time.monotonic() - self.t0
        serialization = deadlocks = 0
        with open(self.log, "rb") as handle:
            handle.seek(self.log_at)
            for line in handle:
                if b"ERROR:" in line:
                    serialization += b"could not serialize access" in line
                    deadlocks += b"deadlock detected" in line
        rows = self.admin.execute(
            "SELECT r.rolname, s.query, s.calls, s.total_exec_time FROM pg_stat_statements s "
            "JOIN pg_roles r ON r.oid = s.userid WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = %s)",
            (self.database,),
        ).fetchall()
        time.sleep(1.0)  # (busy backends flush their counters at least once a second)
        commits, rollbacks = (now - then for now, then in zip(self._database(), self.xacts))
        statements = [
            {"role": role, "query": " ".join(text.split())[:160], "calls": int(calls), "total_ms": float(ms)}
            for role, text, calls, ms in rows
        ]
        statements.sort(key=lambda s: -s["total_ms"])
        # A write transaction begins with SET TRANSACTION ... SERIALIZABLE (before 2026-12-03) or by
        # taking the schema's write turn (pg_advisory_xact_lock): one call per attempt, retries too.
        writes = sum(
            s["calls"]
            for s in statements
            if "ISOLATION LEVEL SERIALIZABLE" in s["query"].upper() or "PG_ADVISORY_XACT_LOCK" in s["query"].upper()
        )
        return {
            "seconds": elapsed,
            "server_cpu_s": cpu,
            "statements": sum(s["calls"] for s in statements),
            "write_transactions": writes,
            "serialization_failures": serialization,
            "deadlocks": deadlocks,
            "xact_commit": commits,
            "xact_rollback": rollbacks,
            "top_statements": statements[:8],
            "_all_statements": statements,
        }

    def close(self) -> None:
        self.admin.close()


def _cpu(procs: list[subprocess.Popen[bytes]]) -> float:
    return sum(proc_stats(proc.pid)[0] for proc in procs)


def _modules(fleet: Fleet) -> list[str]:
    return sorted({e["module"] for e in fleet.events() if e["event"] == "ready"})


def _settle_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.25)


def pgcost_running(processes: int, jobs: int, seconds: float) -> dict[str, Any]:
    """``jobs`` runs running over ``processes`` processes (all due at one second, each held by its
    handler until the end): CPU a second of the server and of the schedulers."""
    server = ServerCost(STORE["server"], f"pgcost_running_{os.getpid()}")
    try:
        with tempfile.TemporaryDirectory() as folder:
            at = int(time.time()) + 8 + 3 * processes  # time for the processes to start and declare
            with Fleet("pgcost_hold", folder, "3600", str(jobs), str(at)) as fleet:
                fleet.db = server.url()
                fleet.start(processes)
                count = "SELECT count(*) FROM runs WHERE state = 'running'"
                _settle_until(lambda: query(fleet.db, count)[0][0] >= jobs, at - time.time() + 120, "runs not started")
                shares = sorted(n for _, n in query(fleet.db, "SELECT owner, count(*) FROM runs GROUP BY owner"))
                time.sleep(5.0)  # (the claims' transactions ended, the watches settled)
                server.mark()
                cpu0 = _cpu(fleet.procs)
                time.sleep(seconds)
                schedulers = _cpu(fleet.procs) - cpu0
                stats = server.since()
                running = query(fleet.db, count)[0][0]
                modules = _modules(fleet)
                fleet.stop()
    finally:
        server.close()
    elapsed = stats["seconds"]
    return {
        "processes": processes,
        "jobs": jobs,
        "running_at_end": running,
        "runs_per_process": shares,
        "server_cpu_per_s": stats["server_cpu_s"] / elapsed,
        "schedulers_cpu_per_s": schedulers / elapsed,
        "statements_per_s": stats["statements"] / elapsed,
        "modules": modules,
        **{k: v for k, v in stats.items() if not k.startswith("_")},
    }


def pgcost_busy(processes: int, jobs: int, every: float, seconds: float) -> dict[str, Any]:
    """``jobs`` jobs ``every`` seconds, spread evenly over it (jobs / every occurrences due each
    second), handlers that return at once, on ``processes`` processes: CPU per occurrence,
    serialization failures, start lateness and duplicates."""
    server = ServerCost(STORE["server"], f"pgcost_busy_{os.getpid()}")
    try:
        with (
            tempfile.TemporaryDirectory() as folder,
            Fleet("pgcost_busy", folder, "3600", str(jobs), str(every)) as fleet,
        ):
            fleet.db = server.url()
            fleet.start(processes)
            time.sleep(max(10.0, 2 * every))  # (every process declared and looking; the first late ones run)
            server.mark()
            cpu0, begin = _cpu(fleet.procs), time.time()
            time.sleep(seconds)
            schedulers, end = _cpu(fleet.procs) - cpu0, time.time()
            stats = server.since()
            modules = _modules(fleet)
            fleet.stop()
            starts = [s for e in fleet.events() if e["event"] == "starts" for s in e["starts"]]
            per_process = sorted(len(e["starts"]) for e in fleet.events() if e["event"] == "starts")
    finally:
        server.close()
    inside = [s for s in starts if begin <= s[2] < end]
    late = [s[3] * 1000 for s in inside]
    occurrences = max(len(inside), 1)
    seen = [(job, slot) for job, slot, _, _ in starts]
    elapsed = stats["seconds"]
    return {
        "processes": processes,
        "jobs": jobs,
        "every_s": every,
        "occurrences": len(inside),
        "expected": round(jobs / every * (end - begin)),
        "starts_per_process": per_process,
        "duplicates": len(seen) - len(set(seen)),
        "lateness_p50_ms": percentile(late, 50),
        "lateness_p99_ms": percentile(late, 99),
        "lateness_max_ms": max(late, default=float("nan")),
        "cpu_per_occurrence_ms": (schedulers + stats["server_cpu_s"]) / occurrences * 1000,
        "schedulers_cpu_per_occurrence_ms": schedulers / occurrences * 1000,
        "server_cpu_per_occurrence_ms": stats["server_cpu_s"] / occurrences * 1000,
        "schedulers_cpu_per_s": schedulers / elapsed,
        "server_cpu_per_s": stats["server_cpu_s"] / elapsed,
        "retry_share": (stats["serialization_failures"] + stats["deadlocks"]) / max(stats["write_transactions"], 1),
        "rollback_share": stats["xact_rollback"] / max(stats["xact_commit"] + stats["xact_rollback"], 1),
        "statements_per_occurrence": stats["statements"] / occurrences,
        "modules": modules,
        **{k: v for k, v in stats.items() if not k.startswith("_")},
    }


def pgcost_idle_watch(seconds: float) -> dict[str, Any]:
    """Two processes declaring one long job: one runs it, the other (connected as a role of its
    own, so that pg_stat_statements counts its statements apart) is idle and watches the run."""
    server = ServerCost(STORE["server"], f"pgcost_watch_{os.getpid()}")
    try:
        with tempfile.TemporaryDirectory() as folder:
            at = int(time.time()) + 10
            with Fleet("pgcost_hold", folder, "3600", "1", str(at)) as fleet:
                fleet.db = server.url()
                fleet.start(1)
                running = "SELECT count(*) FROM runs WHERE state = 'running'"
                _settle_until(
                    lambda: query(fleet.db, running)[0][0] == 1, at - time.time() + 60, "the run did not start"
                )
                (watcher,) = fleet.start(1, db=server.url("bench_watcher"))
                time.sleep(3.0)  # (joined, first looks made)
                server.mark()
                cpu0 = proc_stats(watcher.pid)[0]
                time.sleep(seconds)
                cpu = proc_stats(watcher.pid)[0] - cpu0
                stats = server.since()
                modules = _modules(fleet)
                fleet.stop()
    finally:
        server.close()
    elapsed = stats["seconds"]
    mine = [s for s in stats["_all_statements"] if s["role"] == "bench_watcher"]
    calls = sum(s["calls"] for s in mine)
    return {
        "seconds": elapsed,
        "watcher_statements": calls,
        "watcher_statements_per_s": calls / elapsed,
        "watcher_statements_per_hour": calls / elapsed * 3600,
        "watcher_cpu_s_per_hour": cpu / elapsed * 3600,
        "watcher_by_statement": sorted(mine, key=lambda s: -s["calls"]),
        "owner_statements_per_s": (stats["statements"] - calls) / elapsed,
        "server_cpu_per_s": stats["server_cpu_s"] / elapsed,
        "modules": modules,
    }


def pgcost(quick: bool) -> dict[str, Any]:
    """PostgreSQL, issue #24 item 5: what many jobs and many running runs cost (see ``pgcost_*``)."""
    if STORE["server"] is None:
        raise SystemExit("--only pgcost measures PostgreSQL: give --store postgresql")
    span = 15.0 if quick else 30.0
    section = {"running": pgcost_running(4, 1_000, span)}
    print("pgcost running: done", flush=True)
    section["busy"] = pgcost_busy(4, 1_000, 10.0, span if quick else 45.0)
    print("pgcost busy: done", flush=True)
    section["idle_watch"] = pgcost_idle_watch(span if quick else 20.0)
    print("pgcost idle watch: done", flush=True)
    return section


def report_pgcost(section: dict[str, Any]) -> None:
    r, b, w = section["running"], section["busy"], section["idle_watch"]
    print(f"\nPostgreSQL cost (workers imported {', '.join(sorted(set(r['modules'] + b['modules'] + w['modules'])))})")
    rows = [
        (
            f"{r['jobs']} runs running, {r['processes']} processes: server CPU (cores)",
            f"{r['server_cpu_per_s']:.3f}",
            "",
        ),
        ("  schedulers' CPU (cores, all four)", f"{r['schedulers_cpu_per_s']:.3f}", ""),
        ("  statements a second (all processes)", f"{r['statements_per_s']:.1f}", ""),
        (
            f"busy, {b['jobs']} jobs every {b['every_s']:g} s, {b['processes']} processes: occurrences",
            f"{b['occurrences']} of {b['expected']}",
            "",
        ),
        ("  CPU per occurrence, schedulers + server (ms)", f"{b['cpu_per_occurrence_ms']:.2f}", "≤ 5"),
        (
            "  of it schedulers / server (ms)",
            f"{b['schedulers_cpu_per_occurrence_ms']:.2f} / {b['server_cpu_per_occurrence_ms']:.2f}",
            "",
        ),
        (
            "  write transactions run again (serialization failure, deadlock) / all",
            f"{b['serialization_failures']} + {b['deadlocks']} / {b['write_transactions']} = {b['retry_share']:.1%}",
            "≤ 2%",
        ),
        (
            "  xact_rollback / (xact_commit + xact_rollback)",
            f"{b['xact_rollback']} / {b['xact_commit'] + b['xact_rollback']} = {b['rollback_share']:.1%}",
            "",
        ),
        (
            "  start lateness p50 / p99 / max (ms)",
            f"{b['lateness_p50_ms']:.1f} / {b['lateness_p99_ms']:.1f} / {b['lateness_max_ms']:.1f}",
            "p99 ≤ 20",
        ),
        ("  duplicates", str(b["duplicates"]), "0"),
        ("  statements per occurrence", f"{b['statements_per_occurrence']:.1f}", ""),
        ("idle watcher of another's run: statements a second", f"{w['watcher_statements_per_s']:.2f}", "≤ 2"),
        ("  its CPU (s/hour)", f"{w['watcher_cpu_s_per_hour']:.1f}", ""),
    ]
    width = max(len(row[0]) for row in rows)
    for what, value, goal in rows:
        print(f"{what:<{width}}  {value:>24}  {goal}")
    for name, part in (("running", r), ("busy", b)):
        print(f"\ntop statements by total time, {name} ({part['seconds']:.0f} s)")
        for s in part["top_statements"][:5]:
            print(f"{s['total_ms']:>10.0f} ms {s['calls']:>8} calls  {s['query'][:90]}")
    print("\nthe idle watcher's statements")
    for s in w["watcher_by_statement"]:
        print(f"{s['calls']:>8} calls {s['total_ms']:>8.1f} ms  {s['query'][:100]}")


# -- CPU per occurrence against the number of processes (--only sweep) ----------------------------


def _threads_switches(pid: int) -> int:
    """Voluntary context switches (wake-ups after a wait) of every thread of a process."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):  # (a thread that ended meanwhile)
            total += _task_switches(pid, task)
    return total


def _task_switches(pid: int, task: str) -> int:
    """Voluntary context switches of one thread (``task``) of ``pid``."""
    with open(f"/proc/{pid}/task/{task}/status") as handle:
        return sum(int(line.split()[1]) for line in handle if line.startswith("voluntary_ctxt_switches"))


def commit_floor(commits: int = 2_000) -> float:
    """CPU seconds of one bare WAL commit (``synchronous=NORMAL``, one small UPDATE) on this disk."""
    with tempfile.TemporaryDirectory() as folder:
        conn = sqlite3.connect(os.path.join(folder, "floor.db"), isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v INTEGER)")
        conn.execute("INSERT INTO t VALUES (1, 0)")
        begin = time.process_time()
        for i in range(commits):
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("UPDATE t SET v = ? WHERE k = 1", (i,))
            conn.execute("COMMIT")
        cpu = time.process_time() - begin
        conn.close()
    return cpu / commits


def reading_who_runs(peers: int = 16, calls: int = 300) -> dict[str, float]:
    """CPU (this thread's, median, ms) of reading which processes run (``processes()``) with
    ``peers`` other live processes joined: by a store opened for the one call and closed after it,
    as the command line does, and by a store that reads again and again, as a running scheduler
    does every couple of seconds (the store's internals: no public call reads only that)."""
    import anarchon_lite as al

    with tempfile.TemporaryDirectory() as folder:
        db = os.path.join(folder, "who.db")
        sleepers: list[subprocess.Popen[bytes]] = []
        try:
            for i in range(peers):
                sleepers.append(subprocess.Popen(["sleep", "3600"]))
                state = al._process_start(sleepers[-1].pid)
                assert state is not None, "a sleeper ended at once"
                store = al._SQLiteStore(db)
                store._me = dataclasses.replace(store._me, pid=sleepers[-1].pid, start=state[1])
                store.join(f"peer{i:03d}", 1000, [])
                store.close()

            def one_call() -> None:
                store = al._SQLiteStore(db)
                store.processes()
                store.close()

            kept = al._SQLiteStore(db)
            try:
                figures = {
                    name: statistics.median(_thread_cpu(call) for _ in range(calls)) * 1000
                    for name, call in (("one_call_ms", one_call), ("kept_ms", kept.processes))
                }
            finally:
                kept.close()
        finally:
            for sleeper in sleepers:
                sleeper.kill()
                sleeper.wait()
    return figures


def timeouts_one(jobs: int = 20, seconds: float = 20.0) -> dict[str, Any]:
    """One process, ``jobs`` jobs every second each with a ``timeout``, handlers that return at
    once (``_timeouts.py``): CPU and context switches (its timer thread's, all threads') per
    occurrence."""
    command = [sys.executable, os.path.join(HERE, "_timeouts.py"), str(jobs), str(seconds)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=seconds + 120)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@contextlib.contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    """This process's environment with ``values`` set (None: left unset) for the body of the
    block, as it was after: for the workers started in it."""
    before = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is not None:
                os.environ[name] = value
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _thread_cpu(call: Callable[[], Any]) -> float:
    begin = time.thread_time()
    call()
    return time.thread_time() - begin


@contextlib.contextmanager
def _sweeping(processes: int, jobs: int, settle: float = 5.0, **environment: str | None) -> Iterator[tuple[Fleet, str]]:
    """``jobs`` jobs every second, spread over it, handlers that return at once, on ``processes``
    workers started with ``environment`` set (their log left out: past its ceiling every occurrence
    missed is a line), once each has declared and looked for ``settle`` seconds (and a millisecond a
    job); the fleet and its folder, every worker ended and reaped after."""
    with tempfile.TemporaryDirectory() as folder, Fleet("pgcost_busy", folder, "3600", str(jobs), "1") as fleet:
        fleet.stderr = subprocess.DEVNULL
        with _environment(**environment):
            fleet.start(processes)
        time.sleep(settle + jobs / 1000)
        yield fleet, folder


def sweep_one(processes: int, jobs: int, seconds: float, statements: bool = False) -> dict[str, Any]:
    """``jobs`` jobs every second, spread over it, handlers that return at once, on ``processes``
    processes sharing one store: CPU, wake-ups and starts per occurrence, occurrences recorded
    missed (and, with ``statements``, the SQL statements the processes run, counted by a trace
    callback, and the system calls of the first process, counted by ``strace -c``: both cost CPU, so
    that run's CPU is not comparable)."""
    with _sweeping(processes, jobs, BENCH_STATEMENTS="1" if statements else None) as (fleet, folder):
        counted = _statements(fleet) if statements else 0
        tracer = _strace(fleet.procs[0].pid, folder) if statements else None
        cpu0, wakes0, begin = _cpu(fleet.procs), sum(_threads_switches(p.pid) for p in fleet.procs), time.time()
        time.sleep(seconds)
        cpu, end = _cpu(fleet.procs) - cpu0, time.time()
        wakes = sum(_threads_switches(p.pid) for p in fleet.procs) - wakes0
        syscalls = tracer() if tracer else None
        counted = _statements(fleet) - counted if statements else 0
        fleet.stop()
        window = f"slot >= {int(begin * 1000)} AND slot < {int(end * 1000)}"
        missed = query(fleet.db, f"SELECT count(*) FROM history WHERE status = 'missed' AND {window}")[0][0]
        starts = [s for e in fleet.events() if e["event"] == "starts" for s in e["starts"]]
        per_process = sorted(len(e["starts"]) for e in fleet.events() if e["event"] == "starts")
    inside = [s for s in starts if begin <= s[2] < end]
    late = [s[3] * 1000 for s in inside]
    seen = [(job, slot) for job, slot, _, _ in starts]
    occurrences = max(len(inside), 1)
    # Whether every occurrence ran: those due in whole seconds from the start (each job has one a
    # second), up to 2 s before the end (time to start, late by up to a second)
    whole = int(end - begin - 2)
    due = {(job, slot) for job, slot in seen if begin * 1000 <= slot < (begin + whole) * 1000}
    return {
        "processes": processes,
        "occurrences": len(inside),
        "expected": round(jobs * (end - begin)),
        "due": jobs * whole,
        "ran": len(due),
        "duplicates": len(seen) - len(set(seen)),
        "starts_per_process": per_process,
        "cpu_per_occurrence_ms": cpu / occurrences * 1000,
        "wakeups_per_occurrence": wakes / occurrences,
        "statements_per_occurrence": counted / occurrences if statements else None,
        "syscalls_per_occurrence": None if syscalls is None else {k: v / occurrences for k, v in syscalls.items()},
        "missed": missed,
        "lateness_p50_ms": percentile(late, 50),
        "lateness_p99_ms": percentile(late, 99),
    }


def fleet_shares(processes: int, jobs: int, seconds: float) -> dict[str, Any]:
    """The sweep's workload (``sweep_one``) on ``processes`` processes: where the fleet's CPU goes.
    Each process's CPU and wake-ups a second, by thread (the scheduler's precise run time of each
    thread, ``/proc/PID/task/TID/schedstat``), and the occurrences it started; the processes that
    started none show what a process costs only by being in the fleet (it reads the others'
    changes and who runs), and ``baseline_ms`` is that cost times the processes, per occurrence."""
    with _sweeping(processes, jobs) as (fleet, _):
        names = {e["pid"]: e["names"] for e in fleet.events() if e["event"] == "threads"}

        def sample() -> dict[int, dict[str, tuple[float, int]]]:
            return {p.pid: _threads_by_name(p.pid, names.get(p.pid, {})) for p in fleet.procs}

        before, begin = sample(), time.time()
        time.sleep(seconds)
        after, end = sample(), time.time()
        fleet.stop()
        starts = collections.Counter(
            e["pid"] for e in fleet.events() if e["event"] == "starts" for s in e["starts"] if begin <= s[2] < end
        )
    span, each = end - begin, []
    for pid, threads in after.items():
        was = before[pid]
        cpu = {name: (ns - was.get(name, (0, 0))[0]) / 1e6 / span for name, (ns, _) in sorted(threads.items())}
        wakes = {name: (n - was.get(name, (0, 0))[1]) / span for name, (_, n) in sorted(threads.items())}
        each.append(
            {
                "starts_a_second": starts[pid] / span,
                "cpu_ms_a_second": sum(cpu.values()),
                "cpu_ms_a_second_by_thread": cpu,
                "wakeups_a_second_by_thread": wakes,
            }
        )
    each.sort(key=lambda p: (p["starts_a_second"], p["cpu_ms_a_second"]))
    idle = [p["cpu_ms_a_second"] for p in each if not p["starts_a_second"]]
    occurrences = max(sum(starts.values()), 1) / span
    return {
        "processes": processes,
        "occurrences_a_second": occurrences,
        "cpu_per_occurrence_ms": sum(p["cpu_ms_a_second"] for p in each) / occurrences,
        "idle_processes": len(idle),
        "idle_cpu_ms_a_second": statistics.median(idle) if idle else None,
        "baseline_ms": statistics.median(idle) * processes / occurrences if idle else None,
        "each": each,
    }


def _threads_by_name(pid: int, names: dict[str, str]) -> dict[str, tuple[float, int]]:
    """The run time (ns) and voluntary context switches of the threads of ``pid``, by name
    (``names``: by native id, as the worker told them; ``other`` for one it did not)."""
    counts: dict[str, tuple[float, int]] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as handle:
                ran = float(handle.read().split()[0])
            switches = _task_switches(pid, task)
        except FileNotFoundError:
            continue  # (a thread that ended meanwhile)
        name = names.get(task, "other")
        had = counts.get(name, (0.0, 0))
        counts[name] = (had[0] + ran, had[1] + switches)
    return counts


def stop_in_a_sweep(processes: int, jobs: int, window: float = 5.0) -> dict[str, Any]:
    """The sweep's workload (``sweep_one``: ``jobs`` jobs every second, spread over it) on
    ``processes`` processes, and the one that ran most of the last 3 s stopped (SIGTERM) once all
    are looking: of the occurrences due in the ``window`` seconds after the stop, how many started,
    how late (p50, p99, max), and how many were recorded ``missed``."""
    with _sweeping(processes, jobs, settle=10.0) as (fleet, _):  # (and knowing the others)
        since = int((time.time() - 3.0) * 1000)
        ran = query(fleet.db, f"SELECT instance, count(*) FROM history WHERE slot >= {since} GROUP BY instance")
        busiest, busiest_ran = max(ran, key=lambda row: row[1])  # (an instance is named host-pid-suffix)
        stopped = time.time()
        next(p for p in fleet.procs if p.pid == int(busiest.split("-")[-2])).send_signal(signal.SIGTERM)
        time.sleep(window + 3.0)  # (the last occurrences of the window started, or recorded)
        fleet.stop()
        begin, end = int(stopped * 1000), int((stopped + window) * 1000)
        missed = query(
            fleet.db, f"SELECT count(*) FROM history WHERE status = 'missed' AND slot >= {begin} AND slot < {end}"
        )
        starts = [s for e in fleet.events() if e["event"] == "starts" for s in e["starts"] if begin <= s[1] < end]
    late = [s[3] * 1000 for s in starts]
    return {
        "processes": processes,
        "stopped_ran": busiest_ran / 3.0,  # (occurrences a second, before the stop)
        "due": round(jobs * window),
        "started": len(starts),
        "missed": missed[0][0],
        "late_p50_ms": percentile(late, 50),
        "late_p99_ms": percentile(late, 99),
        "late_max_ms": max(late, default=float("nan")),
    }


def triggers_in_a_sweep(processes: int, jobs: int, triggers: int) -> dict[str, Any]:
    """The sweep's workload (``sweep_one``: ``jobs`` jobs every second) on ``processes`` processes,
    and ``triggers`` runs triggered from this process, each of a job 30 ms after one of its
    occurrences (while the end of that run may still wait for its process's next claim), one at a
    time: how the runs triggered were recorded (all ``succeeded`` is right: their jobs are idle)."""
    with _sweeping(processes, jobs) as (fleet, _):
        scheduler, made = Scheduler(fleet.db), []
        for n in range(triggers):
            job = n % jobs
            now = time.time()
            at = int(now) + job / jobs + 0.03  # (the job's offset into the second, and 30 ms)
            time.sleep((at if at > now else at + 1) - now)
            made.append((f"tick-{job}", asyncio.run(scheduler.trigger(f"tick-{job}"))))

        def recorded() -> list[str]:
            rows = {(j, s): st for j, s, st in query(fleet.db, "SELECT job, slot, status FROM history")}
            return [rows.get(key, "running") for key in made]

        _settle_until(lambda: "running" not in recorded(), 30.0, "the runs triggered, ended")
        statuses = recorded()
        fleet.stop()
    return {"processes": processes, "triggers": triggers, **{st: statuses.count(st) for st in sorted(set(statuses))}}


def store_costs(processes: int, jobs: int, seconds: float, top: int = 30) -> list[dict[str, Any]]:
    """The sweep's workload (``sweep_one``) on ``processes`` processes, each counting its calls of
    the store's and the loop's methods and their CPU (``benchmarks/_costs``) over ``seconds``:
    the ``top`` methods by CPU, summed over the processes, per occurrence of the jobs
    (``jobs`` a second). The counting costs CPU: the figures are for comparing the calls."""
    counting = os.pathsep.join(filter(None, [os.path.join(HERE, "_costs"), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as folder:
        environment = {"PYTHONPATH": counting, "BENCH_COSTS": os.path.join(folder, "costs")}
        with _sweeping(processes, jobs, **environment) as (fleet, _):
            for proc in fleet.procs:
                proc.send_signal(signal.SIGUSR2)  # (counted afresh from now)
            time.sleep(seconds)
            fleet.stop()
        totals: dict[str, list[float]] = {}
        for proc in fleet.procs:
            with open(os.path.join(folder, f"costs.{proc.pid}")) as handle:
                for name, (calls, cpu) in json.load(handle).items():
                    total = totals.setdefault(name, [0, 0.0])
                    total[0], total[1] = total[0] + calls, total[1] + cpu
    occurrences = jobs * seconds
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return [
        {"call": name, "calls": calls / occurrences, "us_a_call": cpu / calls * 1e6, "ms": cpu / occurrences * 1000}
        for name, (calls, cpu) in ranked
    ]


def _strace(pid: int, folder: str) -> Callable[[], dict[str, int] | None]:
    """Count the system calls of every thread of ``pid`` from now (``strace -f -c``) until the
    function returned is called: it returns the count of each call and their ``total`` (None
    without strace)."""
    if shutil.which("strace") is None:
        return lambda: None
    out = os.path.join(folder, "strace.txt")
    tracer = subprocess.Popen(["strace", "-f", "-c", "-o", out, "-p", str(pid)], stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # (attached to every thread)

    def counted() -> dict[str, int] | None:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=30)
        calls = {}
        with open(out) as handle:
            for line in handle:
                fields = line.split()
                if len(fields) >= 5 and fields[3].isdigit():
                    calls[fields[-1]] = int(fields[3])
        return calls

    return counted


def _statements(fleet: Fleet) -> int:
    """The SQL statements run so far by the fleet's workers (started with $BENCH_STATEMENTS)."""

    def told(pid: int) -> list[int]:
        return [e["count"] for e in fleet.events() if e["event"] == "statements" and e["pid"] == pid]

    total = 0
    for proc in fleet.procs:
        before = len(told(proc.pid))
        proc.send_signal(signal.SIGUSR1)
        _settle_until(lambda pid=proc.pid, n=before: len(told(pid)) > n, 10.0, "the statements counted")
        total += told(proc.pid)[-1]
    return total


def neighbour(seconds: float) -> dict[str, Any]:
    """An idle scheduler (ten hourly jobs, nothing due) in a directory where another program
    appends to a file of its own 80 times a second (an app's log or data file beside the
    database): the scheduler's wake-ups (every thread) and CPU."""
    with tempfile.TemporaryDirectory() as folder, Fleet("idle_cost", folder) as fleet:
        (proc,) = fleet.start(1)
        time.sleep(3.0)  # (joined, the first looks made)
        log = os.path.join(folder, "app.log")
        cpu0, wakes0, begin = proc_stats(proc.pid)[0], _threads_switches(proc.pid), time.monotonic()
        with open(log, "a") as handle:
            beat = begin
            while time.monotonic() < begin + seconds:
                handle.write("a line of the app's own log\n")
                handle.flush()
                beat += 1 / 80
                time.sleep(max(0.0, beat - time.monotonic()))
        elapsed = time.monotonic() - begin
        cpu, wakes = proc_stats(proc.pid)[0] - cpu0, _threads_switches(proc.pid) - wakes0
        fleet.stop()
    return {"seconds": elapsed, "wakeups_per_s": wakes / elapsed, "cpu_s_per_hour": cpu / elapsed * 3600}


def sweep(quick: bool, peers: bool = True) -> dict[str, Any]:
    """Issue #26: CPU per occurrence of 20 jobs a second as 1, 2, 4, 8 and 16 processes share the
    store, beside the CPU of two bare WAL commits measured in the same run."""
    counts = (1, 4, 16) if quick else (1, 2, 4, 8, 16)
    seconds = 15.0 if quick else 30.0
    floor = commit_floor()
    section: dict[str, Any] = {"two_commits_ms": 2 * floor * 1000, "jobs": 20, "seconds": seconds, "runs": []}
    for count in counts:
        section["runs"].append(sweep_one(count, 20, seconds))
        print(f"sweep {count}: done", flush=True)
    section["apart_20ms"] = sweep_one(1, 50, seconds)  # (50 jobs a second: one every 20 ms)
    section["statements"] = sweep_one(1, 20, seconds, statements=True)
    section["ceiling"] = ceiling(
        (2_000, 3_000, 4_000, 6_000) if quick else (1_000, 2_000, 3_000, 4_000, 6_000, 8_000), seconds
    )
    section["peers"] = sweep_peers(counts, seconds) if peers else {}
    return section


def ceiling(rates: tuple[int, ...], seconds: float) -> list[dict[str, Any]]:
    """Four processes, ``rate`` short occurrences a second (as many jobs every second, spread over
    it), each rate in turn until one is not sustained: an occurrence missed or not run (of those
    due in the whole seconds measured), or the start lateness p99 past 1 s."""
    rows = []
    for rate in rates:
        row = sweep_one(4, rate, seconds)
        row["sustained"] = row["missed"] == 0 and row["ran"] == row["due"] and row["lateness_p99_ms"] <= 1000
        rows.append(row)
        print(f"ceiling {rate}/s: {'sustained' if row['sustained'] else 'not sustained'}", flush=True)
        if not row["sustained"]:
            break
    return rows


def sweep_peers(counts: tuple[int, ...], seconds: float) -> dict[str, Any]:
    """The sweep's workload on APScheduler 3 and 4 (SQLite), the same numbers of processes."""
    from peers import PEERS, venv_python
    from peers import sweep as peer_sweep

    section: dict[str, Any] = {}
    for name, (kind, requirements) in PEERS.items():
        try:
            python = venv_python(kind, requirements)
            section[name] = [peer_sweep(python, kind, count, 20, seconds) for count in counts]
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            section[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"sweep {name}: done", flush=True)
    return section


def report_sweep(section: dict[str, Any]) -> None:
    runs = section["runs"]
    one = runs[0]["cpu_per_occurrence_ms"]
    print(f"\nCPU per occurrence, {section['jobs']} jobs every second ({section['seconds']:.0f} s each)")
    print(f"two bare WAL commits: {section['two_commits_ms'] * 1000:.0f} µs of CPU")
    print("processes  occurrences  duplicates  CPU ms/occ  ×1 process  ÷two commits  wake-ups/occ  late p50/p99 ms")
    for r in runs:
        ratio = r["cpu_per_occurrence_ms"] / one
        print(
            f"{r['processes']:>9}  {r['occurrences']:>5} of {r['expected']:<4}  {r['duplicates']:>10}"
            f"  {r['cpu_per_occurrence_ms']:>10.2f}  {ratio:>10.2f}"
            f"  {r['cpu_per_occurrence_ms'] / section['two_commits_ms']:>12.0f}  {r['wakeups_per_occurrence']:>12.1f}"
            f"  {r['lateness_p50_ms']:>6.1f} / {r['lateness_p99_ms']:.1f}"
        )
    r = section["statements"]
    print(
        f"1 process, SQL statements counted: {r['statements_per_occurrence']:.1f} statements per occurrence"
        f" ({r['cpu_per_occurrence_ms']:.2f} ms CPU each with the counting)"
    )
    calls = r.get("syscalls_per_occurrence")
    if calls:
        top = sorted((k for k in calls if k != "total"), key=lambda k: -calls[k])[:6]
        print(
            f"1 process, system calls per occurrence: {calls['total']:.0f} ("
            + ", ".join(f"{k} {calls[k]:.1f}" for k in top)
            + ")"
        )
    r = section["apart_20ms"]
    print(
        f"occurrences 20 ms apart, 1 process: {r['occurrences']} of {r['expected']}, start lateness p50"
        f" {r['lateness_p50_ms']:.1f} / p99 {r['lateness_p99_ms']:.1f} ms, {r['cpu_per_occurrence_ms']:.2f} ms CPU each"
    )
    print("\nCeiling, 4 processes (sustained: none missed, all run, start p99 <= 1 s)")
    print("   rate/s  ran of due     missed  CPU ms/occ  late p50/p99 ms  per process")
    for r in section.get("ceiling", []):
        print(
            f"{r['expected'] / section['seconds']:>9.0f}  {r['ran']:>6} of {r['due']:<6}  {r['missed']:>6}"
            f"  {r['cpu_per_occurrence_ms']:>10.2f}  {r['lateness_p50_ms']:>7.1f} / {r['lateness_p99_ms']:<7.1f}"
            f"  {r['starts_per_process']}{'' if r['sustained'] else '  (not sustained)'}"
        )
    for name, rows in section.get("peers", {}).items():
        if isinstance(rows, dict):
            print(f"{name}: {rows['error']}")
            continue
        print(f"\n{name}, the same workload")
        print("processes  occurrences  runs  duplicates  CPU ms/occ  late p50/p99 ms")
        for r in rows:
            print(
                f"{r['processes']:>9}  {r['occurrences']:>5} of {r['expected']:<4}  {r['runs']:>5}  {r['duplicates']:>10}"
                f"  {r['cpu_per_occurrence_ms']:>10.2f}  {r['lateness_p50_ms']:>6.1f} / {r['lateness_p99_ms']:.1f}"
            )


def report(results: dict[str, Any]) -> None:
    m = results["machine"]
    print(f"\nanarchon_lite benchmarks on {m['store']}, {m['date']}, Python {m['python']}, {m['cores']} cores")
    print("\nheartbeat lateness (lease 1 s); p50 and p99 are medians over the repetitions")
    print(f"{'mode':<16}{'renewals':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'lost':>6}  p99 of each repetition")
    for mode, r in results["heartbeat"].items():
        each = ", ".join(f"{rep['p99_ms']:.2f}" for rep in r["repetitions"])
        print(
            f"{mode:<16}{r['renewals']:>9}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{r['max_ms']:>9.1f}{r['lost_leases']:>6}  {each}"
        )
    report_takeover(results["takeover"])
    s = results["start_lateness_ms"]
    for key, r in s.items():
        print(
            f"start lateness, {key:<15} p50 {r['p50']:.2f} ms, p99 {r['p99']:.2f} ms ({r['runs']} runs, {r['duplicates']} duplicates)"
        )
    i = results["idle"]
    cpu = f"{i['cpu_s_per_hour']:.2f}" if i["cpu_s_per_hour"] else f"< {i['cpu_resolution_s_per_hour']:.2f}"
    print(
        f"idle (10 hourly jobs, {i['seconds']:.0f} s): {i['wakeups_per_min']:.1f} wake-ups/min, "
        f"{cpu} CPU s/hour, {i['rss_mb']:.1f} MB RSS, {i['db_writes_per_hour']:.0f} db writes/hour"
        + (f", {i['queries_per_hour']:.0f} queries/hour" if "queries_per_hour" in i else "")
    )
    c = results["switch_interval_cost"]
    print(
        f"two computing threads, work done at 0.5 ms / 5 ms switch interval: {c['ratio_0_5ms_to_5ms']:.3f}; "
        f"in a handler, lowered around renewals / left at 5 ms: {c['ratio_scheduler_lowered_to_left']:.3f}"
    )
    for name, r in results.get("peers", {}).items():
        if "error" in r:
            print(f"peer {name}: not measured: {r['error']}")
        else:
            line = (
                f"peer {name:<14} runs {r['runs']:>4}, duplicates {r['duplicates']:>4}, lateness p50 "
                f"{r['lateness_p50_ms']:.1f} ms p99 {r['lateness_p99_ms']:.1f} ms, idle {r['idle_cpu_s_per_hour']:.2f} CPU s/h"
            )
            if "idle_queries_per_hour" in r:
                line += f", {r['idle_queries_per_hour']:.0f} idle queries/h"
            if "takeover" in r or "kill9_s" in r:
                taken, window = (
                    r.get("takeover", {}).get("kill9_s", r.get("kill9_s")),
                    r.get("takeover", {}).get("window_s"),
                )
                line += f", kill -9 takeover {f'not within {window:.0f} s' if taken is None else f'{taken:.3f} s'}"
            print(line)


if __name__ == "__main__":
    sys.exit(main())
