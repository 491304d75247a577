"""Real processes on one file: exactly once, kill -9 takeover, SIGTERM hand-over, SIGSTOP fencing."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import run

from anarchon_lite import Scheduler

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


class Isolated:
    """A worker in a pid namespace of its own (``unshare --pid --fork --mount-proc``), as if on
    another host: no ``/proc`` look reaches it. ``pid`` is the worker's (not unshare's), signals go
    to it, and its exit status reads as a ``Popen``'s."""

    # The namespace's first process is a shell that waits for the worker and exits with its status:
    # the worker can be killed without ending the namespace, and unshare reports how it ended.
    _SHELL = '"$@"; status=$?; exit $status'

    def __init__(self, args, pid_file):
        self._unshare = subprocess.Popen(
            [
                "unshare",
                "--pid",
                "--fork",
                "--mount-proc",
                "--kill-child=SIGKILL",
                "sh",
                "-c",
                self._SHELL,
                "sh",
                *args,
            ],
            env={**os.environ, "WORKER_PID_FILE": pid_file},
        )
        shell = self._child(self._unshare.pid)
        self.pid = self._child(shell) if shell else None
        if not self.pid:
            self._unshare.kill()
            raise AssertionError("the isolated worker did not start")
        with open(pid_file + ".tmp", "w") as handle:
            handle.write(str(self.pid))
        os.rename(pid_file + ".tmp", pid_file)

    @staticmethod
    def _child(pid):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as handle:
                    found = handle.read().split()
            except OSError:
                found = []
            if found:
                return int(found[0])
            time.sleep(0.01)
        return None

    def _status(self, code):
        return None if code is None else (code - 128) * -1 if code > 128 else code

    def poll(self):
        return self._status(self._unshare.poll())

    def wait(self, timeout=None):
        return self._status(self._unshare.wait(timeout=timeout))

    @property
    def returncode(self):
        return self.poll()

    def send_signal(self, signum):
        os.kill(self.pid, signum)

    def kill(self):
        self._unshare.kill()  # and its child, by --kill-child


class Processes:
    """Starts worker processes and guarantees that each is ended and reaped. On PostgreSQL each
    worker gets a pid namespace of its own, as on a host of its own."""

    def __init__(self, db, events, isolated=False):
        self.db, self.events, self.procs, self.isolated = db, events, [], isolated

    def start(self, mode, lease=30.0, prefix=(), env=None):
        """Start a worker (``prefix``: a command it runs under, such as ``faketime``; ``env``:
        variables set for it)."""
        args = [*prefix, sys.executable, WORKER, self.db, self.events, mode, str(lease)]
        if self.isolated:
            pid_file = f"{self.events}.pid{len(self.procs)}"
            proc = Isolated(args, pid_file)
        else:
            proc = subprocess.Popen(args, env={**os.environ, **(env or {})})
        self.procs.append(proc)
        return proc

    def read(self):
        if not os.path.exists(self.events):
            return []
        with open(self.events) as handle:
            return [json.loads(line) for line in handle if line.endswith("\n")]

    def wait(self, predicate, timeout=20.0, what="event"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.read() if predicate(e)]
            if found:
                return found[0]
            for proc in self.procs:
                if proc.poll() not in (None, 0, -9, -15):
                    raise AssertionError(f"worker {proc.pid} died with {proc.returncode}")
            time.sleep(0.02)
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGUSR1)  # each worker prints its threads' stacks
        time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}; events: {self.read()[-10:]}")

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                proc.kill()
        for proc in self.procs:
            proc.wait(timeout=30)


@pytest.fixture
def procs(tmp_path, store):
    p = Processes(store, str(tmp_path / "events.jsonl"), isolated=not store.endswith(".db"))
    try:
        yield p
    finally:
        p.close()


def history(db, job=None):
    return run(Scheduler(db).history(job, limit=1000))


def settled(db, job, expected, timeout=20.0):
    """The attempts and statuses of ``job``, once they equal ``expected`` (the handler's "done" event
    comes just before its run's final record is written)."""
    deadline = time.monotonic() + timeout
    while True:
        found = sorted((r.attempt, r.status) for r in history(db, job))
        if found == expected or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def start_all(procs, mode, n, lease=30.0):
    started = [procs.start(mode, lease) for _ in range(n)]
    for proc in started:
        procs.wait(lambda e, pid=proc.pid: e["event"] == "ready" and e["pid"] == pid, what=f"{proc.pid} ready")
    return started


@pytest.mark.parametrize("n", [2, 3])
def test_each_occurrence_runs_once_across_processes(procs, n):
    started = start_all(procs, "every", n)
    first = max(e["t"] for e in procs.read() if e["event"] == "ready")
    # the schedule itself is what is under test: six occurrences after every process was ready
    procs.wait(
        lambda e: len({r["slot"] for r in procs.read() if r["event"] == "run" and r["slot"] / 1000 > first + 0.5}) >= 6,
        what="six occurrences",
    )
    for proc in started:
        proc.send_signal(signal.SIGTERM)
    for proc in started:
        assert proc.wait(timeout=30) == 0
    runs = [e for e in procs.read() if e["event"] == "run"]
    slots = [e["slot"] for e in runs]
    assert len(slots) == len(set(slots)), "an occurrence ran twice"
    late = sorted(s for s in slots if s / 1000 > first + 0.5)
    assert len(late) >= 4 and all(b - a == 500 for a, b in zip(late, late[1:])), late
    assert len({e["pid"] for e in runs}) >= 1
    records = [r for r in history(procs.db, "tick") if r.status != "skipped"]
    assert sorted(r.slot for r in records) == sorted(slots)
    assert all(r.status == "succeeded" and r.attempt == 1 for r in records)


def trigger(db, job):
    return run(Scheduler(db).trigger(job))


def owner_of(procs, attempt=1):
    return procs.wait(lambda e: e["event"] == "start" and e["attempt"] == attempt, what=f"attempt {attempt}")["pid"]


def test_kill_9_is_taken_over_from_the_checkpoint_within_2_s(procs):
    kill_9_is_taken_over(procs)


@pytest.mark.sqlite_only
def test_kill_9_in_another_pid_namespace_is_taken_over_within_2_s(tmp_path, store):
    """The owner runs in a pid namespace of its own (a container sharing the file's volume): no
    ``/proc`` look reaches it, its liveness socket tells."""
    isolated = Processes(store, str(tmp_path / "events.jsonl"), isolated=True)
    try:
        kill_9_is_taken_over(isolated)
    finally:
        isolated.close()


def kill_9_is_taken_over(procs):
    start_all(procs, "export", 2, lease=30.0)
    slot = trigger(procs.db, "export")
    owner = owner_of(procs)
    saved = procs.wait(lambda e: e["event"] == "saved" and e["after"] >= 5, what="progress")
    os.kill(owner, signal.SIGKILL)
    killed_at = time.time()
    next(p for p in procs.procs if p.pid == owner).wait(timeout=10)
    last = max(e["after"] for e in procs.read() if e["event"] == "saved" and e["pid"] == owner)
    second = procs.wait(lambda e: e["event"] == "start" and e["attempt"] == 2, what="takeover")
    assert second["pid"] != owner and second["slot"] == slot
    assert second["after"] == last >= saved["after"]  # continues after the saved checkpoint
    assert second["t"] - killed_at < 2.0, "dead owner not detected promptly (lease is 30 s)"
    procs.wait(lambda e: e["event"] == "done", timeout=30, what="done")
    assert settled(procs.db, "export", [(1, "interrupted"), (2, "succeeded")]) == [(1, "interrupted"), (2, "succeeded")]


def test_sigterm_hands_the_run_over(procs):
    start_all(procs, "export", 2)
    trigger(procs.db, "export")
    owner = owner_of(procs)
    procs.wait(lambda e: e["event"] == "saved" and e["after"] >= 3, what="progress")
    proc = next(p for p in procs.procs if p.pid == owner)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    aborted = procs.wait(lambda e: e["event"] == "aborted" and e["pid"] == owner, what="shutdown seen")
    assert aborted["reason"] == "Shutdown"
    last = max(e["after"] for e in procs.read() if e["event"] == "saved" and e["pid"] == owner)
    second = procs.wait(lambda e: e["event"] == "start" and e["attempt"] == 2, what="hand-over")
    assert second["after"] == last and second["pid"] != owner
    procs.wait(lambda e: e["event"] == "done", timeout=30, what="done")
    assert settled(procs.db, "export", [(1, "interrupted"), (2, "succeeded")]) == [(1, "interrupted"), (2, "succeeded")]


def test_sigstop_past_the_lease_is_taken_over_and_fenced(procs):
    start_all(procs, "export", 2, lease=2.0)
    slot = trigger(procs.db, "export")
    owner = owner_of(procs)
    procs.wait(lambda e: e["event"] == "saved" and e["after"] >= 3, what="progress")
    os.kill(owner, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        second = procs.wait(lambda e: e["event"] == "start" and e["attempt"] == 2, what="takeover", timeout=20)
        # a frozen owner is alive: its run waits for the lease (renewed every 2/3 s, so >= 1.3 s left)
        assert second["t"] - stopped_at > 1.2
        procs.wait(lambda e: e["event"] == "saved" and e["attempt"] == 2, what="new attempt progress")
    finally:
        os.kill(owner, signal.SIGCONT)
    refused = procs.wait(lambda e: e["event"] == "refused" and e["pid"] == owner, what="stale write refused")
    assert refused["attempt"] == 1 and refused["reason"] == "LeaseLost"
    done = procs.wait(lambda e: e["event"] == "done", timeout=30, what="done")
    assert done["attempt"] == 2 and second["pid"] != owner
    # no write of the frozen attempt landed after its successor read the checkpoint
    assert max(e["after"] for e in procs.read() if e["event"] == "saved" and e["pid"] == owner) <= second["after"]
    assert run(Scheduler(procs.db).checkpoints.get("export", slot)) is None  # deleted by attempt 2 only
    assert settled(procs.db, "export", [(1, "interrupted"), (2, "succeeded")]) == [(1, "interrupted"), (2, "succeeded")]


@pytest.mark.sqlite_only
def test_a_process_on_another_lease_board_waits_a_lease_from_its_join_for_a_frozen_owner(procs, tmp_path):
    """The owner renews on its lease board alone, long past its claim's lease in the file, and is
    frozen; a process that cannot see that board (a container with a /dev/shm of its own) joins: it
    cannot tell when the owner last renewed, so it takes the run over a whole lease after its join,
    not at once, and once; the owner, thawed, has its stale writes refused."""
    longer = {"WORKER_EXPORT_STEPS": "80"}  # 8 s: time for the newcomer to start and wait
    owner = procs.start("export", lease=3.0, env=longer)
    procs.wait(lambda e: e["event"] == "ready", what="the owner ready")
    trigger(procs.db, "export")
    procs.wait(lambda e: e["event"] == "saved" and e["after"] >= 35, what="progress past the claim's lease")
    os.kill(owner.pid, signal.SIGSTOP)
    try:
        elsewhere = tmp_path / "another-shm"
        elsewhere.mkdir()
        newcomer = procs.start("export", lease=3.0, env={**longer, "ANARCHON_BOARD_DIR": str(elsewhere)})
        ready = procs.wait(lambda e: e["event"] == "ready" and e["pid"] == newcomer.pid, what="the newcomer ready")
        second = procs.wait(lambda e: e["event"] == "start" and e["attempt"] == 2, what="takeover", timeout=20)
        assert second["pid"] == newcomer.pid and second["t"] - ready["t"] > 1.5
    finally:
        os.kill(owner.pid, signal.SIGCONT)
    refused = procs.wait(lambda e: e["event"] == "refused" and e["pid"] == owner.pid, what="stale write refused")
    assert refused["attempt"] == 1 and refused["reason"] == "LeaseLost"
    procs.wait(lambda e: e["event"] == "done", timeout=30, what="done")
    assert settled(procs.db, "export", [(1, "interrupted"), (2, "succeeded")]) == [(1, "interrupted"), (2, "succeeded")]


@pytest.mark.parametrize("mode", ["block", "spin"])
def test_cpu_bound_handler_keeps_its_lease(procs, mode):
    """``block``: an async handler that never yields the event loop; ``spin``: a thread computing.
    A second process stands ready to take the run over if a lease of 1 s were ever lost."""
    start_all(procs, mode, 2, lease=1.0)
    trigger(procs.db, mode)
    owner_of(procs)
    procs.wait(lambda e: e["event"] == "done", timeout=30, what="done")
    assert [e for e in procs.read() if e["event"] == "start" and e["attempt"] > 1] == []

    assert settled(procs.db, mode, [(1, "succeeded")]) == [(1, "succeeded")]


def test_a_handler_raising_system_exit_takes_no_process_down(procs):
    started = start_all(procs, "escape", 3)
    trigger(procs.db, "escape")
    procs.wait(lambda e: e["event"] == "done", timeout=30, what="the third attempt")
    assert settled(procs.db, "escape", [(1, "failed"), (2, "failed"), (3, "succeeded")]) == [
        (1, "failed"),
        (2, "failed"),
        (3, "succeeded"),
    ]
    errors = {r.attempt: r.error for r in history(procs.db, "escape") if r.status == "failed"}
    assert "HandlerEscaped: SystemExit: 3" in errors[1] and "HandlerEscaped: KeyboardInterrupt" in errors[2]
    assert all(proc.poll() is None for proc in started)  # every worker still running
    for proc in started:
        proc.send_signal(signal.SIGTERM)
    assert [proc.wait(timeout=30) for proc in started] == [0, 0, 0]


def test_jobs_declared_and_removed_at_run_time_are_seen_by_every_process(procs):
    """Two processes that declare jobs while they run (``every`` and ``at`` called in a running
    scheduler, then ``remove``): another process (this test's) sees them in ``status`` and can
    ``trigger`` them at once; a one-shot job runs once however many declare it; a job one process
    removes while the other still declares it goes on running there, and ``forget`` refuses it;
    once neither declares it, it is ``undeclared``, refused by ``trigger`` and forgotten."""
    from anarchon_lite import ConfigError

    a, b = start_all(procs, "runtime", 2)
    inspector = Scheduler(procs.db)
    when = time.time() + 1.5

    def ask(step, proc, told):
        with open(f"{procs.events}.{step}.{proc.pid}", "w") as handle:
            handle.write(repr(when))
        return procs.wait(lambda e: e["event"] == told and e["pid"] == proc.pid, what=f"{proc.pid} {told}")

    def states():
        return {job.name: (job.state, job.next_at is not None) for job in run(inspector.status())}

    def runs(job, pid=None):
        return [e for e in procs.read() if e["event"] == "run" and e["job"] == job and pid in (None, e["pid"])]

    def state_of(job, expected):
        deadline = time.monotonic() + 10
        while states().get(job) != expected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert states().get(job) == expected

    ask("add", a, "added")
    state_of("added", ("active", True))  # recorded at the process's next look
    slot = run(inspector.trigger("added"))
    procs.wait(lambda e: e["event"] == "run" and e["job"] == "added" and e["slot"] == slot, what="the trigger run")
    ask("add", b, "added")
    procs.wait(lambda e: e["event"] == "run" and e["job"] == "once", what="the one-shot job")
    removed = ask("remove", a, "removed")["t"]
    procs.wait(
        lambda e: e["event"] == "run" and e["job"] == "added" and e["pid"] == b.pid and e["t"] > removed + 0.6,
        what="b running what a removed",
    )
    assert not [e for e in runs("added", a.pid) if e["t"] > removed + 0.1]
    assert states()["added"] == ("active", True)
    with pytest.raises(ConfigError, match="declares it"):
        run(inspector.forget("added"))
    ask("remove", b, "removed")
    state_of("added", ("undeclared", True))
    with pytest.raises(ConfigError, match="no running process declares it"):
        run(inspector.trigger("added"))
    state_of("once", ("done", False))  # (its end is written after the run event)
    assert [e["slot"] for e in runs("once")] == [int(when * 1000)]
    slots = [(e["job"], e["slot"]) for e in procs.read() if e["event"] == "run"]
    assert len(slots) == len(set(slots)), "an occurrence ran twice"
    run(inspector.forget("added"))
    assert "added" not in states()
    for proc in (a, b):
        proc.send_signal(signal.SIGTERM)
    for proc in (a, b):
        assert proc.wait(timeout=30) == 0


def wait_for_line(stream, text, timeout=20.0):
    """Read ``stream`` until a line holds ``text`` (``communicate`` then reads the rest)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if text in line:
            return
        assert line, f"the stream ended before {text!r}"
    raise AssertionError(f"no line with {text!r}")


ASYNC_WITH_APP = """
import asyncio, logging, signal, sys, time
sys.path.insert(0, sys.argv[2])
# As started from a terminal: a shell's background job (a test run started with &) ignores SIGINT,
# and Python then leaves it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
from anarchon_lite import Scheduler

logging.basicConfig(level=logging.INFO)
scheduler = Scheduler(sys.argv[1], poll=0.05)


async def waits(ctx):
    print("started", flush=True)
    await ctx.signal.wait()
    print("aborted", type(ctx.signal.reason).__name__, flush=True)
    ctx.signal.throw_if_aborted()


def deaf(ctx):  # (a thread that does not listen: only a second signal cuts its grace short)
    print("started", flush=True)
    time.sleep(30)


scheduler.every("long", "24h", waits if sys.argv[4] == "waits" else deaf, offset=int(sys.argv[3]), grace="25s")


async def main():
    async with scheduler:
        await scheduler.trigger("long")
        await asyncio.Event().wait()
    print("after the block", flush=True)


asyncio.run(main())
"""


@pytest.mark.parametrize(
    ("handler", "signals"), [("waits", ["SIGTERM"]), ("waits", ["SIGINT"]), ("deaf", ["SIGTERM", "SIGTERM"])]
)
def test_sigterm_ends_an_async_with_block_and_hands_its_runs_over(store, tmp_path, handler, signals):
    """Also SIGINT under ``asyncio.run`` (which has a handler of its own for it, on Python 3.11 and
    newer), and a second SIGTERM while a handler that does not listen has its grace: the stop then
    cuts the grace short and still hands over (it used to kill the process: the signals were given
    back before the stop).

    An asyncio application that runs the scheduler with ``async with`` and waits for ever:
    SIGTERM stops the scheduler as it stops ``run()`` (the handler sees ``Shutdown``, the run is
    handed over: ``interrupted``, waiting for the next process), ends the block, and the code
    after it runs; the process exits 0 (it used to be killed by the signal, with no hand-over)."""
    from conftest import QUIET

    app = tmp_path / "app.py"
    app.write_text(ASYNC_WITH_APP)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, str(app), store, root, str(QUIET), handler],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "started\n"
        proc.send_signal(getattr(signal, signals[0]))
        if len(signals) > 1:  # once the first is being handled: the stop waits out the grace
            wait_for_line(proc.stderr, f"received {signals[0]}: stopping")
            proc.send_signal(getattr(signal, signals[1]))
        out, err = proc.communicate(timeout=20)  # (less than the deaf handler's 30 s and its 25 s grace)
        assert proc.returncode == 0, err
        expected = "aborted Shutdown\nafter the block\n" if handler == "waits" else "after the block\n"
        assert out == expected, out + err
        assert "attempt 1 interrupted" in err and "handed over" in err, err
        if len(signals) > 1:
            assert "cutting the grace short" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    (record,) = history(store, "long")
    assert (record.attempt, record.status) == (1, "interrupted")
