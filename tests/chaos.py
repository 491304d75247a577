"""Chaos: scheduler processes sharing one file, killed, stopped, frozen and restarted at random.

    python tests/chaos.py [--minutes M | --seconds S] [--seed S] [--processes N] [--boards N] [--json PATH]
                          [--store sqlite|postgresql]

N worker processes (default 3) declare the same three jobs: ``skip`` (every 2 s, overlap skip),
``allow`` (every 1 s, overlap allow, runs longer than its interval) and ``thread`` (every 3 s, a
plain-function handler). Each handler is the recipe of the README: it reads its checkpoint, then
exports batches of rows into a second SQLite file (the "target", an upsert per batch) and saves
the position after each batch. Every step is also logged in the target file, in order.

From a seed, the controller injects a fault every fraction of a second: ``kill -9`` at a random
moment, or aimed at the middle of a store transaction, of a heartbeat, or of a checkpoint write
(the worker, told by SIGUSR2, kills itself there); SIGTERM; SIGSTOP for longer than the lease,
then SIGCONT; and restarts. Then it pauses the jobs, lets every started occurrence finish and
checks, from the scheduler's file and the target's log:

- every occurrence that started finished exactly once (one ``succeeded`` record, nothing left
  running, no failure);
- every attempt after the first began from the latest checkpoint saved before it started;
- no checkpoint write of an attempt landed after a newer attempt of its run had started;
- each batch's rows exist exactly once, all of them, for every finished occurrence;
- ``PRAGMA integrity_check`` is ``ok`` on both files;
- no ``database is locked`` reached a handler or a log.

With ``--store postgresql`` the workers share a schema of a PostgreSQL server (a throwaway one,
tests/pgserver.py, or ``$ANARCHON_TEST_POSTGRES``), each through a TCP proxy of its own
(tests/tcpproxy.py), and five more kinds of fault join in: ``pg_terminate`` (the server ends the
session that holds the worker's lock, the worker living on), ``freeze`` (its connections stop
without FIN or reset for longer than the lease: a partition), ``freeze_terminate`` (both: its path
frozen, the server ends its lock session, so the lock is free while the worker cannot hear that
its session ended), ``reset`` (its connections end with a TCP reset) and ``pg_restart`` (the whole
server restarts, ending every session). The verdict is the same, from the schema (no
``integrity_check``: that is SQLite's).

The summary also says the overlap: the seconds during which two attempts of one run were at work at
once, from the target's log (an attempt works from its first logged step to its last), less the
windows when a worker was stopped by SIGSTOP; and, beside it, the seconds their handlers had not yet
returned at once (each logs its stop in a ``finally``): a stale handler waiting in a store call that
the fence will refuse counts there, not as work.

Any violation prints the seed and the events around it. ``tests/test_chaos.py`` runs 45 s with a
fixed seed in CI, on each store.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

BATCHES, BATCH_ROWS = 8, 25
TOTAL = BATCHES * BATCH_ROWS
LEASE = 1.0
JOBS = {  # name: (interval, overlap, seconds between batches, plain function)
    "skip": ("2s", "skip", 0.3, False),  # runs longer than its interval: some occurrences are skipped
    "allow": ("1s", "allow", 0.15, False),
    "thread": ("3s", "skip", 0.06, True),
}
KINDS = ("kill9", "kill9_transaction", "kill9_heartbeat", "kill9_checkpoint", "sigterm", "sigstop", "restart")
PG_KINDS = ("pg_terminate", "freeze", "freeze_terminate", "reset", "pg_restart")
TARGET_SCHEMA = """
CREATE TABLE IF NOT EXISTS rows (
    job TEXT NOT NULL, slot INTEGER NOT NULL, id INTEGER NOT NULL,
    attempt INTEGER NOT NULL, writes INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (job, slot, id)
);
CREATE TABLE IF NOT EXISTS log (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL, slot INTEGER NOT NULL, attempt INTEGER NOT NULL,
    pid INTEGER NOT NULL, kind TEXT NOT NULL, value INTEGER, t REAL NOT NULL
);
"""


###############################################################################
# The scheduler's state, as the controller reads it: an SQLite file or a PostgreSQL schema
###############################################################################


class State:
    """Statements on the scheduler's tables (``?`` placeholders), wherever they are."""

    def __init__(self, location: str):
        self.location = location
        self.postgres = location.startswith("postgresql://")

    def query(self, sql: str, args=()) -> list:
        if not self.postgres:
            conn = sqlite3.connect(self.location, timeout=60, isolation_level=None)
            try:
                return conn.execute(sql, args).fetchall()
            finally:
                conn.close()
        import pgserver
        import psycopg

        import anarchon_lite as al

        statement = sql.replace("?", "%s")
        if statement.lstrip().upper().startswith("UPDATE"):  # a change the processes must hear of
            statement = f"WITH changed AS ({statement} RETURNING 1) SELECT pg_notify(%s, '') FROM (SELECT 1) one"
            args = (*args, f"anarchon_{al._PGTarget.parse(self.location).schema}")
        for tries in range(20):  # an UPDATE of several rows can deadlock with a worker's transaction
            try:
                return pgserver.query(self.location, statement, args)
            except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                if tries == 19:
                    raise
                time.sleep(0.05)
        raise AssertionError("unreachable")


###############################################################################
# The worker: a scheduler process whose store can be told to die mid-write
###############################################################################


class Target:
    """The export's destination: one connection per thread, a transaction per batch."""

    def __init__(self, path: str):
        self.path = path
        self._local = threading.local()

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            conn.execute("PRAGMA journal_mode = WAL")
            self._local.conn = conn
        return conn

    def log(self, ctx, kind: str, value: int | None = None, t: float | None = None) -> None:
        """Log a step of an attempt, at ``t`` (default now)."""
        self._conn().execute(
            "INSERT INTO log (job, slot, attempt, pid, kind, value, t) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (ctx.job, ctx.slot, ctx.attempt, os.getpid(), kind, value, time.time() if t is None else t),
        )

    def stopped(self, ctx) -> None:
        """Log that the attempt's handler stops working now (any way but a kill)."""
        with contextlib.suppress(Exception):  # (never hides how the handler ended)
            self.log(ctx, "stop", None, time.time())

    def export(self, ctx, after: int) -> None:
        """Upsert the rows after ``after`` (one batch) and log it, in one transaction."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(
                "INSERT INTO rows (job, slot, id, attempt) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (job, slot, id) DO UPDATE SET attempt = excluded.attempt, writes = writes + 1",
                [(ctx.job, ctx.slot, i, ctx.attempt) for i in range(after + 1, after + BATCH_ROWS + 1)],
            )
            self.log(ctx, "batch", after + BATCH_ROWS)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


def arm_store(directory: str, store: type) -> None:
    """Let the controller make this process kill itself inside a write of ``store`` (SIGUSR2 arms it)."""

    armed = {"kind": ""}
    local = threading.local()

    def on_arm(signum, frame):
        with contextlib.suppress(OSError), open(os.path.join(directory, f"arm-{os.getpid()}")) as handle:
            armed["kind"] = handle.read().strip()

    signal.signal(signal.SIGUSR2, on_arm)

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    write, renew_all, checkpoint_write = store._write, store.renew_all, store.checkpoint_write

    def armed_write(self, work, *args, **kwargs):
        def inside(conn):
            result = work(conn)
            kind = armed["kind"]
            if kind == "transaction" or (kind == "checkpoint" and getattr(local, "checkpoint", False)):
                die()  # after the transaction's writes, before its COMMIT
            return result

        return write(self, inside, *args, **kwargs)

    def armed_renew_all(self, *args):
        if armed["kind"] == "heartbeat":
            threading.Timer(random.uniform(0, 0.002), die).start()  # during or just after the statement
        return renew_all(self, *args)

    def armed_checkpoint_write(self, *args):
        local.checkpoint = True
        try:
            return checkpoint_write(self, *args)
        finally:
            local.checkpoint = False

    store._write = armed_write
    store.renew_all = armed_renew_all
    store.checkpoint_write = armed_checkpoint_write


def worker(directory: str, location: str) -> None:
    import faulthandler

    import anarchon_lite as al

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the controller asks a stuck worker where it is

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    arm_store(directory, al._PGStore if location.startswith("postgresql://") else al._SQLiteStore)
    target = Target(os.path.join(directory, "target.db"))
    scheduler = al.Scheduler(location, instance=f"w{os.getpid()}", retention=1_000_000)

    def make_async(pause: float):
        async def export(ctx):
            loop = asyncio.get_running_loop()
            after = await ctx.checkpoint.get(0)
            await loop.run_in_executor(None, target.log, ctx, "start", after)
            try:
                while after < TOTAL:
                    ctx.signal.throw_if_aborted()
                    await loop.run_in_executor(None, target.export, ctx, after)
                    after += BATCH_ROWS
                    await loop.run_in_executor(None, target.log, ctx, "saving", after)
                    await ctx.checkpoint.set(after)
                    await loop.run_in_executor(None, target.log, ctx, "saved", after)
                    await ctx.signal.sleep(pause)
                await loop.run_in_executor(None, target.log, ctx, "done", after)
            finally:
                at = time.time()  # (logged from a thread: the event loop may be shutting down)
                threading.Thread(target=target.log, args=(ctx, "stop", None, at)).start()

        return export

    def make_plain(pause: float):
        def export(ctx):
            after = ctx.checkpoint.get_sync(0)
            target.log(ctx, "start", after)
            try:
                while after < TOTAL:
                    ctx.signal.throw_if_aborted()
                    target.export(ctx, after)
                    after += BATCH_ROWS
                    target.log(ctx, "saving", after)
                    ctx.checkpoint.set_sync(after)
                    target.log(ctx, "saved", after)
                    ctx.signal.sleep_sync(pause)
                target.log(ctx, "done", after)
            finally:
                target.stopped(ctx)

        return export

    for name, (interval, overlap, pause, plain) in JOBS.items():
        handler = make_plain(pause) if plain else make_async(pause)
        scheduler.every(name, interval, handler, overlap=overlap, lease=LEASE, max_attempts=10_000, grace="3s")

    async def serve():
        runner = asyncio.ensure_future(scheduler.run())
        while scheduler._loop.ready is None or not scheduler._loop.ready.is_set():  # SIGTERM is handled from here on
            if runner.done():
                break
            await asyncio.sleep(0.01)
        os.close(os.open(os.path.join(directory, f"ready-{os.getpid()}"), os.O_CREAT | os.O_WRONLY, 0o600))
        await runner

    asyncio.run(serve())


###############################################################################
# The controller
###############################################################################


class Workers:
    """The worker processes; every one started is ended and reaped by ``close``."""

    def __init__(self, directory: str, location: str, server=None, boards: int = 0):
        self.directory, self.location, self.server = directory, location, server
        # With ``boards``, the workers take turns among that many lease boards, as containers with
        # a /dev/shm each would: owners renew in the file while processes of two boards run.
        self.boards = boards
        self.alive: list[subprocess.Popen] = []
        self.all: list[subprocess.Popen] = []
        self.proxies: dict[int, object] = {}  # pid: the TCP proxy between that worker and the server

    def start(self) -> subprocess.Popen:
        location, proxy = self.location, None
        if self.server is not None:
            import urllib.parse

            from tcpproxy import Proxy

            parts = urllib.parse.urlsplit(location)
            proxy = Proxy((parts.hostname, parts.port))
            location = urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}@127.0.0.1:{proxy.port}"))
        env = dict(os.environ)
        if self.boards:
            env["ANARCHON_BOARD_DIR"] = os.path.join(self.directory, f"board-{len(self.all) % self.boards}")
            os.makedirs(env["ANARCHON_BOARD_DIR"], exist_ok=True)
        with open(os.path.join(self.directory, f"worker-{len(self.all)}.log"), "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", self.directory, location],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
            )
        if proxy is not None:
            self.proxies[proc.pid] = proxy
        self.alive.append(proc)
        self.all.append(proc)
        return proc

    def gone(self, proc: subprocess.Popen) -> None:
        self.alive.remove(proc)

    def close(self) -> None:
        for proc in self.all:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
        for proc in self.all:
            proc.wait(timeout=30)
        for proxy in self.proxies.values():
            proxy.close()


def _wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


class Chaos:
    def __init__(self, directory: str, seed: int, processes: int, server=None, boards: int = 0):
        """``server``: a tests/pgserver.Server to run on (its schema ``chaos``); else an SQLite file."""
        self.directory = directory
        self.server = server
        self.db = server.url(schema=f"chaos_{os.getpid()}_{seed}") if server else os.path.join(directory, "jobs.db")
        self.state = State(self.db)
        self.target = os.path.join(directory, "target.db")
        self.rng = random.Random(seed)
        self.seed = seed
        self.processes = processes
        self.workers = Workers(directory, self.db, server, boards)
        self.kinds = KINDS + (PG_KINDS if server else ())
        if server is not None and server.given:
            self.kinds = tuple(k for k in self.kinds if k != "pg_restart")  # not a server of ours to restart
        self.faults = {kind: 0 for kind in self.kinds}
        self.aimed_hits = 0  # aimed kills that died where aimed (the rest were plain kill -9)
        self.timeline: list[tuple[float, str, int]] = []
        self.problems: list[str] = []
        self.restart_at: list[float] = []

    def run(self, seconds: float) -> dict:
        conn = sqlite3.connect(self.target, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.executescript(TARGET_SCHEMA)
        conn.close()
        started = time.time()
        try:
            for _ in range(self.processes):
                self.workers.start()
            end = time.monotonic() + seconds
            kinds: list[str] = []
            while time.monotonic() < end:
                time.sleep(self.rng.uniform(0.2, 0.9))
                self._restart_due()
                if not kinds:
                    kinds = self.rng.sample(self.kinds, len(self.kinds))  # every kind, in a random order
                if self.workers.alive:
                    kind = kinds.pop()
                    self._inject(kind, self._victim(kind))
            self._calm()
        finally:
            self.workers.close()
        report = self.check()
        report.update(seed=self.seed, seconds=seconds, processes=self.processes, started=started)
        return report

    def _victim(self, kind: str) -> subprocess.Popen:
        """A random live worker; for a kill aimed at a heartbeat or a checkpoint, one running a job."""
        candidates = self.workers.alive
        if kind in ("kill9_heartbeat", "kill9_checkpoint", "pg_terminate", "freeze", "freeze_terminate"):
            try:
                owners = {owner for (owner,) in self.state.query("SELECT owner FROM runs WHERE state = 'running'")}
            except Exception:  # noqa: BLE001 - no file or schema yet, or the server restarting
                owners = set()
            candidates = [p for p in candidates if f"w{p.pid}" in owners] or candidates
        return self.rng.choice(sorted(candidates, key=lambda p: p.pid))

    def _ready(self, proc: subprocess.Popen) -> bool:
        return os.path.exists(os.path.join(self.directory, f"ready-{proc.pid}"))

    def _note(self, kind: str, proc: subprocess.Popen) -> None:
        self.faults[kind] += 1
        self.timeline.append((time.time(), kind, proc.pid))

    def _restart_due(self) -> None:
        now = time.monotonic()
        for when in [w for w in self.restart_at if w <= now]:
            self.restart_at.remove(when)
            self.workers.start()

    def _down(self, proc: subprocess.Popen, low: float, high: float) -> None:
        self.workers.gone(proc)
        self.restart_at.append(time.monotonic() + self.rng.uniform(low, high))

    def _inject(self, kind: str, proc: subprocess.Popen) -> None:
        self._note(kind, proc)
        if kind == "kill9":
            proc.kill()
            proc.wait()
            self._down(proc, 0.1, 1.0)
        elif kind.startswith("kill9_"):
            with open(os.path.join(self.directory, f"arm-{proc.pid}"), "w") as handle:
                handle.write(kind[len("kill9_") :])
            proc.send_signal(signal.SIGUSR2)
            if _wait_exit(proc, 3.0):
                self.aimed_hits += proc.returncode == -signal.SIGKILL
            else:
                proc.kill()  # nothing of that kind happened in time: a plain kill -9
                proc.wait()
            self._down(proc, 0.1, 1.0)
        elif kind in ("sigterm", "restart"):
            proc.send_signal(signal.SIGTERM)
            if not _wait_exit(proc, 20.0):
                self._stuck(proc)
            elif proc.returncode != 0 and (self._ready(proc) or proc.returncode != -signal.SIGTERM):
                self.problems.append(f"pid {proc.pid} exited with {proc.returncode} after SIGTERM")
            if kind == "restart":
                self.workers.gone(proc)
                self.workers.start()
            else:
                self._down(proc, 0.2, 1.5)
        elif kind == "sigstop":
            proc.send_signal(signal.SIGSTOP)
            time.sleep(self.rng.uniform(1.5, 3.0) * LEASE)  # frozen past its lease
            proc.send_signal(signal.SIGCONT)
            self.timeline.append((time.time(), "sigcont", proc.pid))  # (not a fault: the end of one)
        elif kind == "pg_terminate":  # the session that holds the worker's lock ends; the worker lives on
            self._terminate_lock_session(proc)
        elif kind in ("freeze", "freeze_terminate"):  # a partition: nothing passes, nothing is closed
            proxy = self.workers.proxies[proc.pid]
            proxy.freeze()
            try:
                if kind == "freeze_terminate":  # the lock is free; the worker cannot hear its session end
                    self._terminate_lock_session(proc)
                time.sleep(self.rng.uniform(1.5, 3.0) * LEASE)  # for longer than the lease
            finally:
                proxy.thaw()
        elif kind == "reset":
            self.workers.proxies[proc.pid].reset()
        elif kind == "pg_restart":
            self.server.restart()

    def _terminate_lock_session(self, proc: subprocess.Popen) -> None:
        """``pg_terminate_backend`` of the session that holds ``proc``'s advisory lock (the
        controller's own connection goes straight to the server, not through the worker's proxy)."""
        with contextlib.suppress(Exception):
            self.state.query(
                "SELECT pg_terminate_backend(l.pid) FROM pg_locks l JOIN instances i ON l.objid = i.lock_key "
                "WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND i.instance = ?",
                (f"w{proc.pid}",),
            )

    def _stuck(self, proc: subprocess.Popen) -> None:
        """A worker that did not stop within 20 s of SIGTERM: a violation, with its threads' stacks."""
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)  # the stacks are written to its log
        proc.kill()
        proc.wait()
        log = os.path.join(self.directory, f"worker-{self.workers.all.index(proc)}.log")
        with open(log, errors="replace") as handle:
            tail = handle.read()[-6000:]
        self.problems.append(f"pid {proc.pid} did not stop within 20 s of SIGTERM; its log ends:\n{tail}")

    def _calm(self) -> None:
        """Restart every process, pause the jobs and wait until every started run has finished."""
        for proc in self.workers.all:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        self.restart_at.clear()
        while len(self.workers.alive) < self.processes:
            self.workers.start()
        deadline = time.monotonic() + 30
        while True:  # the jobs exist in the file once a worker has started
            with contextlib.suppress(Exception):
                if self.state.query("SELECT count(*) FROM jobs")[0][0] == len(JOBS):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not start")
            time.sleep(0.05)
        self.state.query("UPDATE jobs SET paused = 1")
        deadline = time.monotonic() + 90
        while self.state.query("SELECT count(*) FROM runs")[0][0]:
            if time.monotonic() > deadline:
                self.problems.append("runs still unfinished 90 s after the faults stopped")
                break
            time.sleep(0.1)
        for proc in list(self.workers.alive):
            proc.send_signal(signal.SIGTERM)
        for proc in list(self.workers.alive):
            if not _wait_exit(proc, 20.0):
                self._stuck(proc)

    # -- the verdict ------------------------------------------------------------------------------

    def check(self) -> dict:
        violations = list(self.problems)
        history = self.state.query("SELECT job, slot, attempt, status, error FROM history ORDER BY id")
        points = {
            (j, s): (v, a) for j, s, v, a in self.state.query("SELECT job, slot, value, attempt FROM checkpoints")
        }
        if not self.state.postgres:
            verdict = self.state.query("PRAGMA integrity_check")[0][0]
            if verdict != "ok":
                violations.append(f"integrity_check of jobs.db: {verdict}")
        target = sqlite3.connect(self.target)
        try:
            log = target.execute("SELECT seq, job, slot, attempt, pid, kind, value, t FROM log ORDER BY seq").fetchall()
            rows = target.execute(
                "SELECT job, slot, count(*), count(DISTINCT id), min(id), max(id), sum(writes) "
                "FROM rows GROUP BY job, slot"
            ).fetchall()
            verdict = target.execute("PRAGMA integrity_check").fetchone()[0]
            if verdict != "ok":
                violations.append(f"integrity_check of target.db: {verdict}")
        finally:
            target.close()

        by_slot: dict[tuple[str, int], list] = {}
        for job, slot, attempt, status, error in history:
            by_slot.setdefault((job, slot), []).append((attempt, status, error))
        events: dict[tuple[str, int], list] = {}
        for entry in log:
            events.setdefault((entry[1], entry[2]), []).append(entry)
        exported = {(job, slot): rest for job, slot, *rest in rows}

        started = {key for key, records in by_slot.items() if any(a > 0 for a, _, _ in records)}
        succeeded = 0
        for key in sorted(started | set(events)):
            records = by_slot.get(key, [])
            statuses = [status for attempt, status, _ in records if attempt > 0]
            wins = statuses.count("succeeded")
            bad = [(a, s, e) for a, s, e in records if s not in ("succeeded", "interrupted", "skipped", "missed")]
            if wins != 1 or bad:
                violations.append(f"{key}: attempts ended {records} (want exactly one succeeded)")
                continue
            succeeded += 1
            winner = max(a for a, s, _ in records if s == "succeeded")
            if not any(e[3] == winner and e[5] == "done" for e in events.get(key, [])):
                violations.append(f"{key}: attempt {winner} succeeded without finishing its batches")
            count, distinct, low, high, _ = exported.get(key, (0, 0, None, None, 0))
            if (count, distinct, low, high) != (TOTAL, TOTAL, 1, TOTAL):
                violations.append(f"{key}: rows {count} ({distinct} distinct, ids {low}..{high}), want 1..{TOTAL} once")
            violations += self._check_attempts(key, events.get(key, []), points.get(key))

        resumed = sum(1 for e in log if e[5] == "start" and e[3] > 1 and e[6])
        locked = []
        for name in sorted(os.listdir(self.directory)):
            if name.startswith("worker-"):
                with open(os.path.join(self.directory, name), errors="replace") as handle:
                    locked += [f"{name}: {line.strip()}" for line in handle if "database is locked" in line]
        locked += [f"{key}: {e}" for key, records in by_slot.items() for _, _, e in records if e and "locked" in e]
        violations += locked
        overlap, overlapping = overlaps(log, self.timeline)
        alive, _ = overlaps(log, self.timeline, until_stop=True)
        return {
            "faults": dict(self.faults),
            "aimed_kills_that_hit": self.aimed_hits,
            "occurrences": len(started),
            "succeeded": succeeded,
            "skipped": sum(1 for r in history if r[3] == "skipped"),
            "missed": sum(1 for r in history if r[3] == "missed"),
            "attempts": sum(1 for r in history if r[2] > 0),
            "interrupted": sum(1 for r in history if r[3] == "interrupted"),
            "resumed": resumed,
            "repeated_batches": sum(max(r[6] - r[2], 0) for r in rows) // BATCH_ROWS,
            "overlap_seconds": overlap,
            "overlapping": overlapping,
            "alive_at_once_seconds": alive,
            "violations": violations,
            "log": log,
            "timeline": self.timeline,
        }

    @staticmethod
    def _check_attempts(key, entries, point) -> list[str]:
        """Resumed from the latest checkpoint, and no fenced-off write landed."""
        problems = []
        starts = [e for e in entries if e[5] == "start"]
        for start in starts:
            seq, attempt, after = start[0], start[3], start[6]
            earlier = [e for e in entries if e[3] < attempt and e[0] < seq]
            saved = max([e[6] for e in earlier if e[5] == "saved"], default=0)
            saving = {e[6] for e in earlier if e[5] == "saving"}
            if after != saved and after not in saving:
                problems.append(f"{key}: attempt {attempt} (seq {seq}) began from {after}; latest saved was {saved}")
            elif after < saved:
                problems.append(f"{key}: attempt {attempt} (seq {seq}) went back to {after} from {saved}")
        for e in entries:
            if e[5] != "saved":
                continue
            intent = max(
                (x[0] for x in entries if x[5] == "saving" and x[3] == e[3] and x[6] == e[6] and x[0] < e[0]),
                default=e[0],
            )
            newer = [s for s in starts if s[3] > e[3] and s[0] < intent]
            if newer:
                problems.append(
                    f"{key}: attempt {e[3]} saved {e[6]} (seq {e[0]}), begun after attempt {newer[0][3]} started "
                    f"(seq {newer[0][0]}): a fenced-off write landed"
                )
        saved_by = [e[3] for e in entries if e[5] == "saved"]
        if point is not None and saved_by and (point[1] or 0) < max(saved_by):
            problems.append(
                f"{key}: the stored checkpoint {point} was written by an attempt older than {max(saved_by)}"
            )
        return problems


def _less(span: tuple[float, float], windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``span`` outside every window."""
    parts = [span]
    for low, high in windows:
        parts = [piece for a, b in parts for piece in ((a, min(b, low)), (max(a, high), b)) if piece[1] > piece[0]]
    return parts


def overlaps(log: list, timeline: list, until_stop: bool = False) -> tuple[float, list]:
    """The seconds during which two attempts of one run worked at once, in all, and the pairs that
    did ((job, slot), attempt, attempt, seconds). An attempt works from its first logged step to its
    last (``until_stop``: to its handler's ``stop``, so also while it waits, for instance in a store
    call that the fence will refuse), except while its process was stopped (SIGSTOP)."""
    stopped: dict[int, list[tuple[float, float]]] = {}
    since: dict[int, float] = {}
    for t, kind, pid in timeline:
        if kind == "sigstop":
            since[pid] = t
        elif kind == "sigcont" and pid in since:
            stopped.setdefault(pid, []).append((since.pop(pid), t))
    for pid, t in since.items():  # (stopped to the end: the controller's close continues it)
        stopped.setdefault(pid, []).append((t, float("inf")))
    spans: dict[tuple[str, int], dict[int, list]] = {}
    for _seq, job, slot, attempt, pid, kind, _value, t in log:
        if kind == "stop" and not until_stop:
            continue
        span = spans.setdefault((job, slot), {}).setdefault(attempt, [t, t, pid])
        span[0], span[1] = min(span[0], t), max(span[1], t)
    total, pairs = 0.0, []
    for key, attempts in sorted(spans.items()):
        working = {a: _less((low, high), stopped.get(pid, [])) for a, (low, high, pid) in attempts.items()}
        for a in sorted(working):
            for b in sorted(working):
                if b <= a:
                    continue
                both = sum(max(0.0, min(h1, h2) - max(l1, l2)) for l1, h1 in working[a] for l2, h2 in working[b])
                if both > 0:
                    total += both
                    pairs.append((key, a, b, round(both, 3)))
    return total, pairs


def describe(report: dict) -> str:
    """The summary, and for each violation the seed and the events around it."""
    lines = [
        f"seed {report['seed']}, {report['seconds']:.0f} s, {report['processes']} processes on {report['store']}",
        "faults: "
        + ", ".join(f"{k} {v}" for k, v in report["faults"].items())
        + f" (aimed kills that hit: {report['aimed_kills_that_hit']})",
        (
            f"occurrences judged {report['occurrences']}, succeeded {report['succeeded']}, "
            f"attempts {report['attempts']}, interrupted {report['interrupted']}, resumed from a checkpoint "
            f"{report['resumed']}, batches repeated {report['repeated_batches']}, skipped {report['skipped']}, "
            f"missed {report['missed']}"
        ),
        f"overlap seconds {report['overlap_seconds']:.3f} in {len(report['overlapping'])} pairs (two attempts of "
        "one run at work at once, from their logged steps"
        + "".join(
            f"; {job} {slot} attempts {a} and {b} {t:.3f} s" for (job, slot), a, b, t in report["overlapping"][:5]
        )
        + f"); handlers not yet returned at once {report['alive_at_once_seconds']:.3f} s",
        f"violations: {len(report['violations'])}",
    ]
    for violation in report["violations"][:20]:
        lines.append(f"  VIOLATION (seed {report['seed']}): {violation}")
        words = violation.replace("(", " ").replace(")", " ").replace(",", " ").split()
        key = next(((j, int(s)) for j, s in zip(words, words[1:]) if j.strip("'") in JOBS and s.isdigit()), None)
        if key is None:
            continue
        near = [e for e in report["log"] if (e[1], e[2]) == (key[0].strip("'"), key[1])]
        for e in near[-12:]:
            lines.append(f"    seq {e[0]} t {e[7]:.3f} attempt {e[3]} pid {e[4]} {e[5]} {e[6]}")
        if near:
            low, high = near[0][7] - 3, near[-1][7] + 3
            for t, kind, pid in report["timeline"]:
                if low <= t <= high:
                    lines.append(f"    fault t {t:.3f}: {kind} pid {pid}")
    return "\n".join(lines)


def run(
    directory: str, seconds: float, seed: int, processes: int = 3, store: str = "sqlite", server=None, boards: int = 0
) -> dict:
    """One chaos run; on ``store="postgresql"``, on ``server`` (a tests/pgserver.Server) or a
    throwaway server of its own; with ``boards`` (SQLite), the workers spread over that many lease
    boards."""
    if store == "sqlite":
        report = Chaos(directory, seed, processes, boards=boards).run(seconds)
    elif server is not None:
        report = Chaos(directory, seed, processes, server).run(seconds)
    else:
        import pgserver

        server = pgserver.Server.start()
        try:
            report = Chaos(directory, seed, processes, server).run(seconds)
        finally:
            server.stop()
    report["store"] = store
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("location", nargs="?", help=argparse.SUPPRESS)  # (a worker's database)
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float)
    length.add_argument("--seconds", type=float)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--boards", type=int, default=0, help="spread the workers over this many lease boards")
    parser.add_argument("--store", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--json", metavar="PATH", help="write the summary (without the event log) here")
    parser.add_argument("--keep", metavar="DIR", help="run in DIR and keep its files")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.location)
        return 0
    seconds = args.seconds if args.seconds else (args.minutes or 1.0) * 60
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    with contextlib.ExitStack() as stack:
        directory = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="anarchon-chaos-"))
        os.makedirs(directory, exist_ok=True)
        report = run(directory, seconds, seed, args.processes, args.store, boards=args.boards)
    print(describe(report))
    if args.json:
        summary = {k: v for k, v in report.items() if k not in ("log", "timeline")}
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=2)
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
