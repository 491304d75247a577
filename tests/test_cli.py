"""The command line, with real processes: crontab, status, history, trigger, pause, resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def cli(db, *args, check=True):
    done = subprocess.run(
        [sys.executable, "-m", "anarchon_lite", "--db", db, *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
        check=False,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"{args} failed: {done.stderr}")
    return done


class Daemons:
    def __init__(self, tmp_path):
        self.tmp, self.procs = tmp_path, []

    def start(self, *args):
        with open(self.tmp / f"daemon-{len(self.procs)}.log", "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "anarchon_lite", *args], stdout=log, stderr=log, env=ENV)
        self.procs.append(proc)
        return proc

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def daemons(tmp_path):
    d = Daemons(tmp_path)
    try:
        yield d
    finally:
        d.close()


def wait_until(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def history(db, job=None):
    args = ["history", "--json", "--limit", "1000"] + (["--job", job] if job else [])
    return json.loads(cli(db, *args).stdout)


def test_two_crontab_processes_run_each_occurrence_once(tmp_path, daemons):
    db, out = str(tmp_path / "jobs.db"), tmp_path / "out.txt"
    crontab = tmp_path / "crontab"
    crontab.write_text(f"# name: tick\n@every 1s echo $ANARCHON_SLOT $ANARCHON_ATTEMPT >> {out}\n")
    for _ in range(2):
        daemons.start("--db", db, "crontab", str(crontab))
    wait_until(lambda: out.exists() and len(out.read_text().splitlines()) >= 4, what="four runs")
    cli(db, "pause", "tick")  # then no run is in flight when the daemons are stopped
    wait_until(lambda: not json.loads(cli(db, "status", "--json").stdout)[0]["runs"], what="no run in flight")
    daemons.close()
    slots = [int(line.split()[0]) for line in out.read_text().splitlines()]
    assert len(slots) == len(set(slots)) and all(s % 1000 == 0 for s in slots)
    records = [r for r in history(db, "tick") if r["status"] == "succeeded"]
    assert sorted(r["slot"] for r in records) == sorted(slots)


def test_timeout_kills_the_command_and_its_children(tmp_path, daemons):
    db, pidfile = str(tmp_path / "jobs.db"), tmp_path / "child.pid"
    crontab = tmp_path / "crontab"
    crontab.write_text(
        f"SHELL=/bin/sh\n# name: hang\n# timeout: 1s\n@every 24h sleep 300 & echo $! > {pidfile}; wait\n"
    )
    daemons.start("--db", db, "crontab", str(crontab))
    wait_until(lambda: os.path.exists(db) and "hang" in cli(db, "status").stdout, what="registered")
    cli(db, "trigger", "hang")
    wait_until(lambda: any(r["status"] == "timed_out" for r in history(db, "hang")), what="timed_out")
    child = int(pidfile.read_text())

    def gone():
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{child}/stat") as handle:  # a zombie awaiting its reaper counts as gone
            return handle.read().split(")")[-1].split()[0] == "Z"

    wait_until(gone, what="the child to be killed")


def test_failing_command_exit_code_and_output_in_history(tmp_path, daemons):
    db = str(tmp_path / "jobs.db")
    crontab = tmp_path / "crontab"
    crontab.write_text("# name: broken\n@every 24h for i in 1 2 3; do echo line $i; done; echo oops >&2; exit 3\n")
    daemons.start("--db", db, "crontab", str(crontab))
    wait_until(lambda: os.path.exists(db) and "broken" in cli(db, "status").stdout, what="registered")
    cli(db, "trigger", "broken")
    record = wait_until(lambda: [r for r in history(db, "broken") if r["status"] == "failed"], what="failed")[0]
    assert "exit code 3" in record["error"]
    assert record["output"].splitlines() == ["line 1", "line 2", "line 3", "oops"]
    assert "broken" in cli(db, "history").stdout


def test_bad_crontab_line_is_reported_with_its_line_number(tmp_path):
    crontab = tmp_path / "crontab"
    crontab.write_text("PATH=/usr/bin:/bin\n# nightly\n61 * * * * echo bad minute\n")
    done = cli(str(tmp_path / "jobs.db"), "crontab", str(crontab), check=False)
    assert done.returncode != 0
    assert f"{crontab}:3:" in done.stderr and "minute" in done.stderr
    crontab.write_text("# a comment\n# name: x, colour: red\n@hourly true\n")
    done = cli(str(tmp_path / "jobs.db"), "crontab", str(crontab), check=False)
    assert done.returncode != 0 and f"{crontab}:2:" in done.stderr


def test_status_shows_progress_and_control_from_another_process(tmp_path, daemons):
    db = str(tmp_path / "jobs.db")
    (tmp_path / "myjobs.py").write_text(
        "import asyncio\n"
        "from anarchon_lite import Scheduler\n"
        f"scheduler = Scheduler({db!r})\n"
        "@scheduler.every('work', '24h', lease='1s')\n"
        "async def work(ctx):\n"
        "    ctx.progress(3, 10)\n"
        "    await ctx.signal.sleep(30)\n"
        "@scheduler.every('ticker', '1s')\n"
        "async def ticker(ctx):\n"
        "    pass\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "anarchon_lite", "run", "myjobs:scheduler"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    daemons.procs.append(proc)
    wait_until(lambda: os.path.exists(db) and "work" in cli(db, "status").stdout, what="registered")
    cli(db, "trigger", "work")
    ticker = {j["name"]: j for j in json.loads(cli(db, "status", "--json").stdout)}["ticker"]
    assert ticker["next_at"] is not None  # known to a process that does not declare the job
    status = wait_until(lambda: "30%" in (out := cli(db, "status").stdout) and out, what="progress bar")
    assert "attempt 1 running" in status
    runs = {j["name"]: j for j in json.loads(cli(db, "status", "--json").stdout)}["work"]["runs"]
    assert runs[0]["progress"] == [3.0, 10.0]
    cli(db, "pause", "ticker")
    assert {j["name"]: j for j in json.loads(cli(db, "status", "--json").stdout)}["ticker"]["paused"]
    time.sleep(1.5)  # a paused job does not run: look at the history after more than one interval
    count = len(history(db, "ticker"))
    time.sleep(1.5)
    assert len(history(db, "ticker")) == count
    cli(db, "resume", "ticker")
    wait_until(lambda: len(history(db, "ticker")) > count, what="ticker to run again")
    cli(db, "cancel", "work")
    wait_until(lambda: any(r["status"] == "cancelled" for r in history(db, "work")), what="cancelled")
    assert cli(db, "pause", "nope", check=False).returncode != 0


def test_reboot_runs_once_per_start_of_the_group(tmp_path, daemons):
    db, out = str(tmp_path / "jobs.db"), tmp_path / "boot.txt"
    crontab = tmp_path / "crontab"
    crontab.write_text(f"@reboot echo $ANARCHON_SLOT >> {out}\n")
    first = [daemons.start("--db", db, "crontab", str(crontab)) for _ in range(2)]
    wait_until(lambda: out.exists() and out.read_text().strip(), what="the @reboot entry")
    wait_until(lambda: len(json.loads(cli(db, "status", "--json").stdout)) == 1, what="status")
    time.sleep(1.0)  # the second process is running too: it must not run the entry again
    assert len(out.read_text().splitlines()) == 1
    daemons.close()
    assert all(p.returncode == 0 for p in first)
    daemons.procs = []
    daemons.start("--db", db, "crontab", str(crontab))  # a new start of the group
    wait_until(lambda: len(out.read_text().splitlines()) == 2, what="the second @reboot")


def test_sighup_rereads_the_file_and_keeps_the_old_table_on_a_bad_edit(tmp_path, daemons):
    db = str(tmp_path / "jobs.db")
    crontab = tmp_path / "crontab"
    crontab.write_text("# name: first\n@hourly true\n")
    proc = daemons.start("--db", db, "crontab", str(crontab))
    wait_until(lambda: os.path.exists(db) and "first" in cli(db, "status").stdout, what="first job")
    crontab.write_text("# name: first\n@hourly true\n# name: second\n@every 1s echo second\n")
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: any(r["status"] == "succeeded" for r in history(db, "second")), what="the new job to run")
    crontab.write_text("# name: third\n99 * * * * true\n")
    proc.send_signal(signal.SIGHUP)
    count = len(history(db, "second"))
    wait_until(lambda: len(history(db, "second")) > count, what="the old table to keep running")
    assert proc.poll() is None
    log = (tmp_path / "daemon-0.log").read_text()
    assert "keeping the current table" in log and "crontab:2:" in log
