"""The same small workloads on APScheduler 3 and 4, each in a virtual environment of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
VENVS = os.path.join(HERE, ".venvs")
PEERS = {
    "apscheduler3": ("aps3", ["apscheduler>=3.11,<4", "sqlalchemy"]),
    "apscheduler4": ("aps4", ["apscheduler==4.0.0a6", "sqlalchemy[asyncio]", "aiosqlite", "sniffio"]),
}


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


def start(python: str, kind: str, db: str, out: str, idle: float = 0.0) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [python, os.path.join(HERE, "peer_worker.py"), kind, db, out, str(idle)],
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


def workload(python: str, kind: str, seconds: float) -> dict[str, Any]:
    """Four processes declaring one job every second, for ``seconds``: runs, duplicates, lateness."""
    with tempfile.TemporaryDirectory() as folder:
        db, out = os.path.join(folder, "jobs.db"), os.path.join(folder, "runs.jsonl")
        procs = []
        try:
            for _ in range(4):
                procs.append(start(python, kind, db, out))
            begin = time.time()
            time.sleep(seconds)
        finally:
            stop(procs)
        runs = [json.loads(line) for line in Path(out).read_text().splitlines()] if os.path.exists(out) else []
        runs = [r for r in runs if begin + 2 <= r["slot"] <= begin + seconds - 1]
        slots = [r["slot"] for r in runs]
        late = [r["late"] * 1000 for r in runs]
    return {
        "runs": len(runs),
        "occurrences": len(set(slots)),
        "duplicates": len(slots) - len(set(slots)),
        "lateness_p50_ms": percentile(late, 50),
        "lateness_p99_ms": percentile(late, 99),
    }


def idle_cpu(pythons: dict[str, tuple[str, str]], seconds: float) -> dict[str, float]:
    """CPU seconds per hour of one idle process of each peer, all measured over the same ``seconds``."""
    with tempfile.TemporaryDirectory() as folder:
        procs: dict[str, subprocess.Popen[str]] = {}
        try:
            for name, (python, kind) in pythons.items():
                procs[name] = start(
                    python, kind, os.path.join(folder, f"{kind}.db"), os.path.join(folder, kind), idle=1
                )
            time.sleep(1.0)
            cpu0 = {name: cpu_seconds(proc.pid) for name, proc in procs.items()}
            time.sleep(seconds)
            return {name: (cpu_seconds(proc.pid) - cpu0[name]) / seconds * 3600 for name, proc in procs.items()}
        finally:
            stop(list(procs.values()))


def run_peers(results: dict[str, Any], quick: bool) -> dict[str, Any]:
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
    pythons: dict[str, tuple[str, str]] = {}
    for name, (kind, requirements) in PEERS.items():
        try:
            python = venv_python(kind, requirements)
            peers[name] = workload(python, kind, seconds)
            pythons[name] = (python, kind)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            peers[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"peer {name}: done", flush=True)
    try:
        for name, cpu in idle_cpu(pythons, idle_seconds).items():
            peers[name]["idle_cpu_s_per_hour"] = cpu
            peers[name]["idle_cpu_resolution_s_per_hour"] = 3600 / os.sysconf("SC_CLK_TCK") / idle_seconds
    except Exception as exc:  # noqa: BLE001
        for name in pythons:
            peers[name] = {"error": f"idle measurement: {type(exc).__name__}: {exc}"}
    print("peers idle: done", flush=True)
    return peers
