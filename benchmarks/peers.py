"""The same small workloads on APScheduler 3 and 4, each in a virtual environment of its own: on
SQLite files, or (``--store postgresql``) APScheduler 4 on the same PostgreSQL server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
VENVS = os.path.join(HERE, ".venvs")
PEERS = {
    "apscheduler3": ("aps3", ["apscheduler>=3.11,<4", "sqlalchemy"]),
    "apscheduler4": ("aps4", ["apscheduler==4.0.0a6", "sqlalchemy[asyncio]", "aiosqlite", "sniffio"]),
}
# (anyio as of APScheduler 4.0.0a6's release: with anyio 4.16, the newest on 2026-12-01, its asyncpg
# event broker's notification callback fails with NoEventLoopError and schedules never fire)
PEERS_POSTGRES = {
    "apscheduler4": (
        "aps4pg",
        ["apscheduler==4.0.0a6", "sqlalchemy[asyncio]>=2,<2.1", "asyncpg", "sniffio", "anyio==4.9.0"],
    )
}


Database = Callable[[str, str], str]  # (temporary folder, purpose) -> where a peer keeps its state


def sqlite_files(folder: str, purpose: str) -> str:
    return os.path.join(folder, f"{purpose}.db")


def postgres_databases(server: Any) -> Database:
    """A fresh database of the server for each use (APScheduler 4 keeps its tables in ``public``)."""
    import psycopg

    def create(folder: str, purpose: str) -> str:
        name = f"peer_{purpose}_{os.getpid()}_{int(time.monotonic() * 1000)}"
        with psycopg.connect(server.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return str(server.url(name))

    return create


def venv_python(name: str, requirements: list[str]) -> str:
    folder = os.path.join(VENVS, name)
    python = os.path.join(folder, "bin", "python")
    marker = os.path.join(folder, "installed.txt")
    wanted = "\n".join(requirements)
    if not (os.path.exists(marker) and Path(marker).read_text() == wanted):
        subprocess.run([sys.executable, "-m", "venv", "--clear", folder], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", *requirements], check=True, capture_output=True)
        with open(marker, "w") as handle:
            handle.write(wanted)
    return python


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def start(python: str, kind: str, db: str, out: str, idle: float = 0.0, *more: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [python, os.path.join(HERE, "peer_worker.py"), kind, db, out, str(idle), *more],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{kind} worker did not start (exit {proc.wait()})")
    return proc


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def records(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(out).read_text().splitlines()] if os.path.exists(out) else []


def workload(python: str, kind: str, seconds: float, database: Database) -> dict[str, Any]:
    """Four processes declaring one job every second, for ``seconds``: runs, duplicates, lateness."""
    with tempfile.TemporaryDirectory() as folder:
        db, out = database(folder, "work"), os.path.join(folder, "runs.jsonl")
        procs = []
        try:
            for _ in range(4):
                procs.append(start(python, kind, db, out))
            begin = time.time()
            time.sleep(seconds)
        finally:
            stop(procs)
        runs = [r for r in records(out) if begin + 2 <= r["slot"] <= begin + seconds - 1]
        slots = [r["slot"] for r in runs]
        late = [r["late"] * 1000 for r in runs]
    return {
        "runs": len(runs),
        "occurrences": len(set(slots)),
        "duplicates": len(slots) - len(set(slots)),
        "lateness_p50_ms": percentile(late, 50),
        "lateness_p99_ms": percentile(late, 99),
    }


def spread(python: str, count: int, seconds: float) -> dict[str, Any]:
    """One APScheduler 4 process (SQLite) with ``count`` jobs every minute, spread over the minute
    (as the ``scale`` benchmark's busy workload): its CPU share of a core and how late runs start."""
    with tempfile.TemporaryDirectory() as folder:
        db, out = sqlite_files(folder, "spread"), os.path.join(folder, "runs.jsonl")
        # (adding 10,000 schedules one by one takes APScheduler 4 a while: the first runs wait for it)
        os.environ["PEER_AT"] = str(time.time() + 5 + count / 100)
        proc = start(python, "aps4", db, out, 0.0, "spread", str(count))
        try:
            time.sleep(max(0.0, float(os.environ["PEER_AT"]) - time.time()) + 5)
            cpu, begin = cpu_seconds(proc.pid), time.time()
            time.sleep(seconds)
            cpu, end = cpu_seconds(proc.pid) - cpu, time.time()
        finally:
            stop([proc])
        late = [r["late"] * 1000 for r in records(out) if begin <= r["slot"] < end - 1]
    return {
        "jobs": count,
        "occurrences": len(late),
        "expected": round(count * (end - 1 - begin) / 60),
        "cpu_share": cpu / (end - begin),
        "p50_ms": percentile(late, 50),
        "p99_ms": percentile(late, 99),
        "max_ms": max(late, default=float("nan")),
    }


def sweep(python: str, kind: str, processes: int, jobs: int, seconds: float) -> dict[str, Any]:
    """``processes`` processes of a peer declaring ``jobs`` jobs every second, spread over it (the
    ``sweep`` benchmark's workload, on SQLite): CPU per occurrence that came due (duplicate runs are
    waste, counted in the CPU and not as occurrences), duplicates, lateness."""
    with tempfile.TemporaryDirectory() as folder:
        db, out = sqlite_files(folder, "sweep"), os.path.join(folder, "runs.jsonl")
        procs: list[subprocess.Popen[str]] = []
        try:
            for _ in range(processes):
                procs.append(start(python, kind, db, out, 0.0, "sweep", str(jobs)))
            time.sleep(5.0)  # (every process declared and running)
            cpu0, begin = sum(cpu_seconds(p.pid) for p in procs), time.time()
            time.sleep(seconds)
            cpu, end = sum(cpu_seconds(p.pid) for p in procs) - cpu0, time.time()
        finally:
            stop(procs)
        runs = [r for r in records(out) if begin <= r["slot"] < end]
        seen = [(r["job"], r["slot"]) for r in runs]
        late = [r["late"] * 1000 for r in runs]
    expected = round(jobs * (end - begin))
    return {
        "processes": processes,
        "runs": len(runs),
        "occurrences": len(set(seen)),
        "expected": expected,
        "duplicates": len(seen) - len(set(seen)),
        "cpu_per_occurrence_ms": cpu * 1000 / max(len(set(seen)), 1),
        "lateness_p50_ms": percentile(late, 50),
        "lateness_p99_ms": percentile(late, 99),
    }


def idle_cpu(
    pythons: dict[str, tuple[str, str]], seconds: float, database: Database, activity: Any = None
) -> dict[str, dict[str, float]]:
    """CPU seconds per hour of one idle process of each peer, all measured over the same ``seconds``;
    on PostgreSQL also the transactions an hour in its own database (``activity``: makes the benchmark's
    ``PostgresActivity`` for a purpose: a database of its own, its ``url`` and its counters)."""
    with tempfile.TemporaryDirectory() as folder:
        procs: dict[str, subprocess.Popen[str]] = {}
        stats: dict[str, Any] = {}
        try:
            for name, (python, kind) in pythons.items():
                if activity is not None:
                    stats[name] = activity(f"idle_{kind}")
                db = stats[name].url if activity is not None else database(folder, f"idle_{kind}")
                procs[name] = start(python, kind, db, os.path.join(folder, kind), 1)
            time.sleep(1.0 if activity is None else 11.0)  # (a backend reports its start-up within 10 s)
            before = {
                name: (cpu_seconds(proc.pid), stats[name].read() if stats else None) for name, proc in procs.items()
            }
            begin = time.monotonic()
            time.sleep(seconds)
            result = {}
            for name, proc in procs.items():
                hours = (time.monotonic() - begin) / 3600
                cpu0, counters0 = before[name]
                result[name] = {"idle_cpu_s_per_hour": (cpu_seconds(proc.pid) - cpu0) / hours}
                if stats:
                    result[name]["idle_queries_per_hour"] = (stats[name].read()[0] - counters0[0]) / hours
            return result
        finally:
            stop(list(procs.values()))


def takeover(python: str, kind: str, window: float, database: Database) -> dict[str, Any]:
    """Two processes declare one hourly job that runs for an hour; once one of them runs it, it is
    killed with SIGKILL: how long until the other starts that run again (None: not within ``window``)."""
    with tempfile.TemporaryDirectory() as folder:
        db, out = database(folder, "takeover"), os.path.join(folder, "runs.jsonl")
        at = time.time() + 8.0  # both are running before it is due
        os.environ["PEER_AT"] = str(at)
        procs = []
        try:
            procs = [start(python, kind, db, out, 0, "long") for _ in range(2)]
            deadline = time.time() + 30.0
            while not records(out) and time.time() < deadline:
                time.sleep(0.05)
            first = records(out)
            if not first:
                return {"error": "the job did not start"}
            owner = next(p for p in procs if p.pid == first[0]["pid"])
            owner.kill()
            killed = time.monotonic()
            deadline = killed + window
            while len(records(out)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            again = records(out)[1:]
            return {
                "kill9_s": None if not again else round(time.monotonic() - killed, 3),
                "window_s": window,
                "rerun_same_occurrence": bool(again) and again[0]["slot"] == first[0]["slot"],
            }
        finally:
            stop(procs)


def run_peers(results: dict[str, Any], quick: bool, server: Any = None, activity: Any = None) -> dict[str, Any]:
    """The peers' figures beside ours (``results``); on ``server`` (PostgreSQL) when given."""
    seconds, idle_seconds = (20.0, 20.0) if quick else (30.0, 120.0)
    peers: dict[str, Any] = {}
    ours = results["start_lateness_ms"]["four_processes"]
    peers["anarchon_lite"] = {
        "runs": ours["runs"],
        "duplicates": ours["duplicates"],
        "lateness_p50_ms": ours["p50"],
        "lateness_p99_ms": ours["p99"],
        "idle_cpu_s_per_hour": results["idle"]["cpu_s_per_hour"],
    }
    if server is not None:
        peers["anarchon_lite"]["idle_queries_per_hour"] = results["idle"].get("queries_per_hour")
        peers["anarchon_lite"]["kill9_s"] = results["takeover"]["kill9_s"]["p50"]
    database = postgres_databases(server) if server is not None else sqlite_files
    pythons: dict[str, tuple[str, str]] = {}
    for name, (kind, requirements) in (PEERS if server is None else PEERS_POSTGRES).items():
        try:
            python = venv_python(kind, requirements)
            peers[name] = workload(python, kind, seconds, database)
            if server is not None:
                peers[name]["takeover"] = takeover(python, kind, 40.0 if quick else 120.0, database)
            pythons[name] = (python, kind)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            peers[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"peer {name}: done", flush=True)
    try:
        named = None if server is None else (lambda purpose: activity(server, f"peer_{purpose}"))
        for name, figures in idle_cpu(pythons, idle_seconds, database, named).items():
            peers[name].update(figures)
            peers[name]["idle_cpu_resolution_s_per_hour"] = 3600 / os.sysconf("SC_CLK_TCK") / idle_seconds
    except Exception as exc:  # noqa: BLE001
        for name in pythons:
            peers[name] = {"error": f"idle measurement: {type(exc).__name__}: {exc}"}
    print("peers idle: done", flush=True)
    return peers
