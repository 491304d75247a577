"""The command line, with real processes: crontab, status, history, trigger, pause, resume. Every
test that opens a store runs on both stores (``store``); those that only read a crontab or the
command line's arguments open none."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import QUIET, stop_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def anarchon(*args, cwd=None):
    """One run of the command line, to its end (its output as text)."""
    return subprocess.run(
        [sys.executable, "-m", "anarchon_lite", *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=cwd,
        timeout=60,
        check=False,
    )


def cli(db, *args, check=True):
    done = anarchon("--db", db, *args)
    if check and done.returncode != 0:
        raise AssertionError(f"{args} failed: {done.stderr}")
    return done


class Daemons:
    def __init__(self, tmp_path):
        self.tmp, self.procs = tmp_path, []

    def start(self, *args):
        return self.start_with([], *args)

    def start_with(self, prefix, *args):
        """The command line under ``prefix`` (``["unshare", ...]``: in a pid namespace of its own)."""
        with open(self.tmp / f"daemon-{len(self.procs)}.log", "w") as log:
            command = [*prefix, sys.executable, "-m", "anarchon_lite", *args]
            proc = subprocess.Popen(command, stdout=log, stderr=log, env=ENV)
        self.procs.append(proc)
        return proc

    def close(self):
        stop_processes(self.procs)


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


def listed(db, name):
    """Whether ``status`` lists ``name`` (an error until a daemon has made the store)."""
    done = cli(db, "status", check=False)
    return done.returncode == 0 and name in done.stdout


def status_jobs(db):
    return json.loads(cli(db, "status", "--json").stdout)["jobs"]


def history(db, job=None):
    args = ["history", "--json", "--limit", "1000"] + (["--job", job] if job else [])
    return json.loads(cli(db, *args).stdout)


def test_two_crontab_processes_run_each_occurrence_once(store, tmp_path, daemons):
    """Six entries every second on two processes: each occurrence runs once and none fails (on
    PostgreSQL, the serialization retries of their claims once made most of them fail)."""
    db, out = store, tmp_path / "out.txt"
    crontab = tmp_path / "crontab"
    crontab.write_text(
        "".join(f"# name: tick{n}\n@every 1s echo $ANARCHON_JOB $ANARCHON_SLOT >> {out}\n" for n in range(6))
    )
    for _ in range(2):
        daemons.start("--db", db, "crontab", str(crontab))
    wait_until(lambda: out.exists() and len(out.read_text().splitlines()) >= 36, what="36 runs")
    for n in range(6):
        cli(db, "pause", f"tick{n}")  # then no run is in flight when the daemons are stopped
    wait_until(lambda: not any(job["runs"] for job in status_jobs(db)), what="no run in flight")
    daemons.close()
    runs = [tuple(line.split()) for line in out.read_text().splitlines()]
    assert len(runs) == len(set(runs)) and all(int(slot) % 1000 == 0 for _, slot in runs)
    records = history(db)
    assert [r for r in records if r["status"] not in ("succeeded", "skipped", "missed")] == []
    succeeded = [(r["job"], str(r["slot"])) for r in records if r["status"] == "succeeded"]
    assert sorted(succeeded) == sorted(runs)


def test_timeout_kills_the_command_and_its_children(store, tmp_path, daemons):
    db, pidfile = store, tmp_path / "child.pid"
    crontab = tmp_path / "crontab"
    crontab.write_text(
        f"SHELL=/bin/sh\n# name: hang\n# timeout: 1s\n@every 24h sleep 300 & echo $! > {pidfile}; wait\n"
    )
    daemons.start("--db", db, "crontab", str(crontab))
    wait_until(lambda: listed(db, "hang"), what="registered")
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


def test_failing_command_exit_code_and_output_in_history(store, tmp_path, daemons):
    db = store
    crontab = tmp_path / "crontab"
    crontab.write_text(
        "# name: broken\n@every 24h for i in 1 2 3; do echo line $i; done; echo oops >&2; exit 3\n"
        "# name: killed\n@every 24h kill -TERM $$\n"
    )
    daemons.start("--db", db, "crontab", str(crontab))
    wait_until(lambda: listed(db, "killed"), what="registered")
    cli(db, "trigger", "broken")
    cli(db, "trigger", "killed")
    record = wait_until(lambda: [r for r in history(db, "broken") if r["status"] == "failed"], what="failed")[0]
    assert record["error"] == "exit code 3"  # the command's, not a traceback of the library
    killed = wait_until(lambda: [r for r in history(db, "killed") if r["status"] == "failed"], what="killed")[0]
    assert killed["error"] == "killed by SIGTERM"
    assert record["output"].splitlines() == ["line 1", "line 2", "line 3", "oops"]
    table = cli(db, "history", "--job", "broken").stdout.splitlines()
    assert "DURATION" in table[0] and "OUTPUT" in table[0]
    failed = next(line for line in table if " failed " in line)
    assert failed.rstrip().endswith("exit code 3  | oops") and re.search(r" \d+\.\d\ds ", failed), failed


def test_bad_crontab_line_is_reported_with_its_line_number(tmp_path):
    crontab = tmp_path / "crontab"
    crontab.write_text("PATH=/usr/bin:/bin\n# nightly\n61 * * * * echo bad minute\n")
    done = cli(str(tmp_path / "jobs.db"), "crontab", str(crontab), check=False)
    assert done.returncode != 0
    assert f"{crontab}:3:" in done.stderr and "minute" in done.stderr
    crontab.write_text("# a comment\n# name: x, colour: red\n@hourly true\n")
    done = cli(str(tmp_path / "jobs.db"), "crontab", str(crontab), check=False)
    assert done.returncode != 0 and f"{crontab}:2:" in done.stderr


def test_status_shows_progress_and_control_from_another_process(store, tmp_path, daemons):
    db = store
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
        "@scheduler.every('beat', '1s')\n"
        "async def beat(ctx):\n"
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
    wait_until(lambda: listed(db, "work"), what="registered")
    cli(db, "trigger", "work")
    ticker = {j["name"]: j for j in status_jobs(db)}["ticker"]
    assert ticker["next_at"] is not None  # known to a process that does not declare the job
    status = wait_until(lambda: "30%" in (out := cli(db, "status").stdout) and out, what="progress bar")
    assert "attempt 1 running" in status
    runs = {j["name"]: j for j in status_jobs(db)}["work"]["runs"]
    assert runs[0]["progress"] == {"done": 3.0, "total": 10.0}
    cli(db, "pause", "ticker")
    assert {j["name"]: j for j in status_jobs(db)}["ticker"]["paused"]
    # a paused job does not run: while another job of the same process runs three more times
    # (three looks that would have run it), it records nothing
    count = len(history(db, "ticker"))
    beats = len(history(db, "beat"))
    wait_until(lambda: len(history(db, "beat")) >= beats + 3, what="three more beats")
    assert len(history(db, "ticker")) == count
    cli(db, "resume", "ticker")
    wait_until(lambda: len(history(db, "ticker")) > count, what="ticker to run again")
    cli(db, "cancel", "work")
    wait_until(lambda: any(r["status"] == "cancelled" for r in history(db, "work")), what="cancelled")
    assert cli(db, "pause", "nope", check=False).returncode != 0


def test_reboot_runs_once_per_start_of_the_group(store, tmp_path, daemons):
    db, out = store, tmp_path / "boot.txt"
    crontab = tmp_path / "crontab"
    beats = tmp_path / "beats.txt"
    crontab.write_text(f"@reboot echo $ANARCHON_SLOT >> {out}\n@every 1s echo beat >> {beats}\n")
    first = [daemons.start("--db", db, "crontab", str(crontab)) for _ in range(2)]
    wait_until(lambda: out.exists() and out.read_text().strip(), what="the @reboot entry")
    wait_until(lambda: len(json.loads(cli(db, "status", "--json").stdout)["processes"]) == 2, what="both joined")
    # the second process is running too, and looks (three more beats): it does not run the entry again
    seen = len(beats.read_text().splitlines()) if beats.exists() else 0
    wait_until(lambda: beats.exists() and len(beats.read_text().splitlines()) >= seen + 3, what="three more beats")
    assert len(out.read_text().splitlines()) == 1
    daemons.close()
    assert all(p.returncode == 0 for p in first)
    daemons.procs = []
    daemons.start("--db", db, "crontab", str(crontab))  # a new start of the group
    wait_until(lambda: len(out.read_text().splitlines()) == 2, what="the second @reboot")
    assert len(status_jobs(db)) == 2


def test_sighup_rereads_the_file_and_keeps_the_old_table_on_a_bad_edit(store, tmp_path, daemons):
    db = store
    crontab = tmp_path / "crontab"
    crontab.write_text("# name: first\n@hourly true\n")
    proc = daemons.start("--db", db, "crontab", str(crontab))
    wait_until(lambda: listed(db, "first"), what="first job")
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


# -- signals, files and mistakes ----------------------------------------------------------------


def write_jobs(tmp_path, db, body):
    (tmp_path / "myjobs.py").write_text(
        f"import asyncio, time\nfrom anarchon_lite import Scheduler\nscheduler = Scheduler({db!r})\n{body}"
    )


def start_run(tmp_path, daemons):
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "anarchon_lite", "run", "myjobs:scheduler"],
            cwd=tmp_path,
            env=ENV,
            stdout=log,
            stderr=log,
        )
    daemons.procs.append(proc)
    return proc


def test_sighup_to_run_is_harmless_and_a_second_interrupt_cuts_the_grace_short(store, tmp_path, daemons):
    db = store
    write_jobs(
        tmp_path,
        db,
        "@scheduler.every('deaf', '24h', grace='60s')\ndef deaf(ctx):\n    time.sleep(120)  # ignores its signal\n",
    )
    proc = start_run(tmp_path, daemons)
    wait_until(lambda: listed(db, "deaf"), what="registered")
    proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "nothing to reload" in (tmp_path / "run.log").read_text(), what="the SIGHUP logged")
    cli(db, "trigger", "deaf")
    wait_until(lambda: "attempt 1 running" in cli(db, "status").stdout, what="the run")
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    wait_until(lambda: "again to cut" in (tmp_path / "run.log").read_text(), what="the first SIGINT")
    time.sleep(0.5)  # well inside the 60 s grace
    assert proc.poll() is None
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 0 and time.monotonic() - started < 10
    assert [r["status"] for r in history(db, "deaf")] == ["interrupted"]


@pytest.mark.sqlite_only  # (a missing file: a URL names a server, whose schema the first writer makes)
def test_read_only_commands_refuse_a_missing_file_and_create_nothing(tmp_path):
    missing = str(tmp_path / "typo.db")
    for command in (["status"], ["history"], ["trigger", "x"], ["pause", "x"]):
        done = cli(missing, *command, check=False)
        assert done.returncode == 2 and "no such database file" in done.stderr and "Traceback" not in done.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.sqlite_only  # (a directory of the file system)
def test_status_and_history_work_in_a_read_only_directory(tmp_path):
    from test_faults import read_only_directory

    with read_only_directory(tmp_path) as (directory, make_writable):
        make_writable()
        db = str(directory / "jobs.db")
        subprocess.run(
            [
                sys.executable,
                "-c",
                (
                    f"import anarchon_lite as a, asyncio; s = a.Scheduler({db!r}); "
                    "s.every('once', '24h', lambda ctx: None); asyncio.run(s.trigger('once'))"
                ),
            ],
            env=ENV,
            check=True,
        )
        make_read_only = subprocess.run(
            ["mount", "-o", "remount,bind,ro", str(directory)], check=False, capture_output=True
        )
        if os.geteuid() != 0:
            os.chmod(directory, 0o500)
        else:
            assert make_read_only.returncode == 0
        status = status_jobs(db)
        assert [j["name"] for j in status] == ["once"] and status[0]["runs"][0]["state"] == "pending"
        assert cli(db, "history").returncode == 0
        assert sorted(os.listdir(directory)) == ["jobs.db"]


def bad_crontab(tmp_path, content, *expected):
    crontab = tmp_path / "crontab"
    crontab.write_bytes(content if isinstance(content, bytes) else content.encode())
    done = cli(str(tmp_path / "jobs.db"), "crontab", str(crontab), check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    for text in expected:
        assert text in done.stderr, done.stderr
    assert not os.path.exists(tmp_path / "jobs.db")


def test_crontab_mistakes_are_one_line_with_file_and_line(tmp_path):
    path = str(tmp_path / "crontab")
    bad_crontab(tmp_path, b"# caf\xc3\xa9\n@hourly true\n# \xe9t\xe9\n", f"{path}:3:", "not UTF-8")
    bad_crontab(tmp_path, "\n\n*/\u00b2 * * * * true\n", f"{path}:3:", "minute")
    bad_crontab(tmp_path, "1 \u00b2 * * * true\n", f"{path}:1:", "hour")
    bad_crontab(tmp_path, "@hourly echo a\0b\n", f"{path}:1:", "NUL")
    bad_crontab(tmp_path, "@hourly echo " + "x" * 200_000 + "\n", f"{path}:1:", "put it in a script")
    bad_crontab(tmp_path, "SHELL=/bin/no-such-shell\n\n@hourly true\n", f"{path}:3:", "SHELL=/bin/no-such-shell")
    bad_crontab(tmp_path, "@every 999999999999w true\n", f"{path}:1:", "100 years")
    bad_crontab(tmp_path, "# name: j, lease: 1ms\n@hourly true\n", f"{path}:2:", "lease")
    bad_crontab(tmp_path, "# name: my job\n@hourly true\n", f"{path}:1:", "cannot read 'job'")  # not named 'my'
    bad_crontab(tmp_path, "\n0 3 * * * root /usr/bin/true\n", f"{path}:2:", "user column")  # not a program 'root'
    bad_crontab(tmp_path, "@daily /usr/bin/logger -t backup%dear ops,%it failed%\n", f"{path}:1:", "write \\% for a %")
    bad_crontab(tmp_path, "@daily date +\\%F; echo 100%\n", f"{path}:1:", "no backslash escapes")


def test_crontab_check_lists_each_entry_and_its_next_runs_and_starts_nothing(tmp_path):
    crontab = tmp_path / "crontab"
    crontab.write_text("CRON_TZ=Europe/Athens\n# name: backup\n0 3 * * MON-SUN /usr/bin/true\n@every 90m true\n")
    done = anarchon("crontab", "--check", str(crontab), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{crontab}:3: backup: cron 0 3 * * MON-SUN Europe/Athens: next ")
    assert lines[0].count("T03:00:00+02:00") == 3, lines[0]  # in the job's zone, every day
    assert lines[1].startswith(f"{crontab}:4: every-") and lines[-1].endswith("2 entries, no errors")
    assert os.listdir(tmp_path) == ["crontab"]  # no database made, nothing started
    crontab.write_text("# name: x\n61 * * * * true\n")
    done = anarchon("crontab", "--check", str(crontab))
    assert done.returncode == 2 and f"{crontab}:2:" in done.stderr and "Traceback" not in done.stderr


def test_command_line_mistakes_are_one_line(tmp_path):
    db = str(tmp_path / "jobs.db")
    for args, expected in (
        (["run", "no_such_module:scheduler"], "no module named 'no_such_module'"),
        (["run", "myjobs:nothing"], "has no attribute 'nothing'"),
        (["run", "broken:scheduler"], "cannot import broken: No module named 'not_installed'"),
        (["--log-level", "LOUD", "status"], "unknown level 'LOUD'"),
    ):
        write_jobs(tmp_path, db, "")
        (tmp_path / "broken.py").write_text("import not_installed\n")
        done = anarchon("--db", db, *args, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("anarchon-lite") and done.stderr.count("\n") == 1, done.stderr
        assert expected in done.stderr, done.stderr
    write_jobs(tmp_path, db, "")
    other = anarchon("--db", str(tmp_path / "other.db"), "run", "myjobs:scheduler", cwd=tmp_path)
    assert other.returncode == 2 and "`run` uses the database its Scheduler names" in other.stderr, other.stderr
    assert other.stderr.count("\n") == 1 and not (tmp_path / "other.db").exists()


def test_options_before_or_after_the_command_and_each_control_command_says_what_it_did(store, tmp_path):
    db = store
    crontab = tmp_path / "crontab"
    crontab.write_text("# name: tick\n@every 24h true\n")

    async def declare():
        from anarchon_lite import Scheduler

        s = Scheduler(db)
        s.every("tick", "24h", lambda ctx: None, offset=QUIET)
        async with s:
            pass

    import asyncio

    asyncio.run(declare())

    def command(*args):
        done = anarchon(*args)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert command("--version").startswith("anarchon-lite ")
    assert "tick" in command("status", "--db", db) and "tick" in command("--db", db, "status")
    triggered = command("trigger", "tick", "--db", db)
    assert triggered.startswith("tick: triggered, slot ") and triggered.count("\n") == 0, triggered
    said = json.loads(command("trigger", "--db", db, "tick", "--json"))
    assert said["command"] == "trigger" and said["job"] == "tick" and isinstance(said["slot"], int)
    assert command("pause", "tick", "--db", db) == "tick: paused on every process"
    assert json.loads(command("--db", db, "resume", "tick", "--json")) == {"command": "resume", "job": "tick"}
    assert command("cancel", "tick", "--db", db) == "tick: 2 unfinished runs cancelled"
    for name in ("status", "history", "show", "next", "trigger", "forget", "run", "crontab"):
        text = command(name, "--help")
        assert "--db" in text and "--log-format" in text
        # (the options listed, not the usage lines above them, which wrap where they must; "optional
        # arguments:" on Python 3.9)
        listed = re.split(r"^(?:options|optional arguments):$", text, maxsplit=1, flags=re.MULTILINE)[1]
        options = [line for line in listed.splitlines() if line.strip().startswith("-")]
        assert all(len(line.split(None, 2)) >= 2 for line in options), f"an option of {name} without help: {options}"


def marks(path):
    """(kind, attempt, time) of each line a marking command wrote."""
    if not path.exists():
        return []
    return [(k, int(a), float(t)) for k, a, t in (line.split() for line in path.read_text().splitlines())]


def owner_pid(db, job):
    runs = {j["name"]: j for j in status_jobs(db)}[job]["runs"]
    return int(runs[0]["owner"].split("-")[-2]) if runs and runs[0]["state"] == "running" else None


def children(pid):
    """(pid, command line) of the processes whose parent is ``pid``."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                cmdline = handle.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append((int(name), cmdline))
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_marked_command(db, tmp_path, daemons, seconds, copies):
    """``copies`` daemons of a crontab whose one job marks its start, sleeps ``seconds`` and marks its
    end; the job triggered and started: (marks file, owner's pid, owner's children, the shell's pid)."""
    out = tmp_path / "marks.txt"
    crontab = tmp_path / "crontab"
    mark = f"echo {{}} $ANARCHON_ATTEMPT $(date +\\%s.\\%N) >> {out}"
    crontab.write_text(f"# name: once\n@every 24h {mark.format('start')}; sleep {seconds}; {mark.format('end')}\n")
    for _ in range(copies):
        daemons.start("--db", db, "crontab", str(crontab))

    def joined():
        done = cli(db, "status", "--json", check=False)  # (an error until the first daemon made the store)
        said = json.loads(done.stdout) if done.returncode == 0 else {"jobs": [], "processes": []}
        return [j["name"] for j in said["jobs"]] == ["once"] and len(said["processes"]) == copies

    wait_until(joined, what="every copy to join")
    cli(db, "trigger", "once")
    wait_until(lambda: marks(out), what="attempt 1 to start")
    owner = owner_pid(db, "once")
    spawned = children(owner)
    shell = [pid for pid, cmdline in spawned if f"sleep {seconds}" in cmdline]
    assert shell, spawned
    return out, owner, spawned, shell[0]


@pytest.mark.parametrize("reaper", ["reaper", "no reaper"])
def test_after_kill_9_two_copies_of_a_command_never_overlap(store, tmp_path, daemons, reaper):
    out, owner, spawned, shell = start_marked_command(store, tmp_path, daemons, 6, copies=2)
    if reaper == "no reaper":  # the second line of defence alone: the takeover ends the old group
        for pid, cmdline in spawned:
            if "read -r word" in cmdline:
                os.kill(pid, signal.SIGKILL)
    os.kill(owner, signal.SIGKILL)
    wait_until(lambda: any(k == "end" and a == 2 for k, a, _ in marks(out)), timeout=30, what="attempt 2 to end")
    got = marks(out)
    starts = {a: t for k, a, t in got if k == "start"}
    ends = {a: t for k, a, t in got if k == "end"}
    assert sorted(starts) == [1, 2] and 1 not in ends or ends[1] < starts[2], got
    assert not alive(shell)
    if reaper == "no reaper":  # (with the reaper, it and the takeover race to end the group: either may)
        others = [p for p in daemons.procs if p.pid != owner]
        log = (tmp_path / f"daemon-{daemons.procs.index(others[0])}.log").read_text()
        assert "still running (process group" in log, log


def test_after_kill_9_of_the_only_scheduler_its_command_is_ended_by_the_reaper(store, tmp_path, daemons):
    """No other process to take over: the reaper alone ends the command's group."""
    out, owner, _, shell = start_marked_command(store, tmp_path, daemons, 60, copies=1)
    try:
        os.kill(owner, signal.SIGKILL)
        wait_until(lambda: not alive(shell), what="the reaper to end the command")
        assert [k for k, _, _ in marks(out)] == ["start"]
    finally:
        with contextlib.suppress(OSError):
            os.killpg(shell, signal.SIGKILL)


def test_a_command_leaving_a_background_child_ends_when_its_shell_exits(store, tmp_path, daemons):
    db, pidfile = store, tmp_path / "child.pid"
    crontab = tmp_path / "crontab"
    crontab.write_text(f"# name: bg\n@every 24h sleep 1000 & echo $! > {pidfile}; echo started\n")
    daemons.start("--db", db, "crontab", str(crontab))
    wait_until(lambda: listed(db, "bg"), what="registered")
    cli(db, "trigger", "bg")
    record = wait_until(lambda: [r for r in history(db, "bg") if r["status"] == "succeeded"], what="succeeded")[0]
    child = int(pidfile.read_text())
    # (named as /proc saw it: "sleep", or "sh" for the moment before the background shell execs it)
    assert record["output"].startswith("started") and f"left {child} (" in record["output"]
    wait_until(lambda: not alive(child), what="the child to be ended")
    cli(db, "trigger", "bg")  # not skipped: the first run is over
    wait_until(lambda: len([r for r in history(db, "bg") if r["status"] == "succeeded"]) == 2, what="second run")


def test_each_run_is_logged_as_json_lines_with_its_fields(store, tmp_path, daemons):
    """--log-format json: one object a line; a run's start and end carry job, slot, attempt,
    status and duration, and a failed command's end says its exit code and its output's last lines."""
    db = store
    crontab = tmp_path / "crontab"
    crontab.write_text("# name: ok\n@every 24h true\n# name: bad\n@every 24h echo first; echo oops; exit 3\n")
    daemons.start("--db", db, "--log-format", "json", "crontab", str(crontab))
    log = tmp_path / "daemon-0.log"
    wait_until(lambda: listed(db, "bad"), what="registered")
    cli(db, "trigger", "ok")
    cli(db, "trigger", "bad")

    def ends():
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        found = [e for e in lines if e.get("status") in ("succeeded", "failed")]
        return found if len(found) >= 2 else None

    found = {e["job"]: e for e in wait_until(ends, what="two ends")}
    assert found["ok"]["level"] == "INFO" and found["ok"]["attempt"] == 1 and found["ok"]["duration"] >= 0
    bad = found["bad"]
    assert bad["level"] == "ERROR" and "exit code 3" in bad["message"] and "| oops" in bad["message"], bad
    starts = [json.loads(line) for line in log.read_text().splitlines() if '"running"' in line]
    assert {s["job"] for s in starts} == {"ok", "bad"} and all(s["level"] == "INFO" for s in starts)


def test_under_the_journal_lines_carry_their_priority_and_no_timestamp(store, tmp_path, daemons):
    """With stderr the journal's stream ($JOURNAL_STREAM is its device and inode), each line starts
    with its sd-daemon priority: <6> for a success, <3> for a failure."""
    db = store
    crontab = tmp_path / "crontab"
    crontab.write_text("# name: bad\n@every 24h exit 4\n")
    log = tmp_path / "journal.log"
    with open(log, "w") as stream:
        status = os.fstat(stream.fileno())
        env = {**ENV, "JOURNAL_STREAM": f"{status.st_dev}:{status.st_ino}"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "anarchon_lite", "--db", db, "crontab", str(crontab)], stderr=stream, env=env
        )
    daemons.procs.append(proc)
    wait_until(lambda: listed(db, "bad"), what="registered")
    cli(db, "trigger", "bad")
    wait_until(lambda: "exit code 4" in log.read_text(), what="the failure logged")
    lines = log.read_text().splitlines()
    assert all(line[:3] in ("<3>", "<4>", "<6>", "<7>") for line in lines), lines
    assert any(line.startswith("<6>anarchon_lite: bad ") and "started" in line for line in lines), lines
    assert any(line.startswith("<3>anarchon_lite: bad ") and "exit code 4" in line for line in lines), lines
    assert not any(line[3:7].isdigit() for line in lines), "no timestamp"


def test_on_failure_runs_a_command_with_the_failed_attempt_and_its_output(store, tmp_path, daemons):
    """'# on_failure: COMMAND' above an entry runs COMMAND after an attempt fails (the job, slot,
    status and exit code in its environment, the output's tail on stdin), not after a success; a set
    MAILTO is said to be ignored."""
    db, told, body = store, tmp_path / "told.txt", tmp_path / "body.txt"
    crontab = tmp_path / "crontab"
    crontab.write_text(
        "MAILTO=ops@example.com\n"
        "# name: bad\n"
        f'# on_failure: cat > {body}; echo "$ANARCHON_JOB $ANARCHON_STATUS $ANARCHON_EXIT_CODE $ANARCHON_SLOT" >> {told}\n'
        "@every 24h echo the disk is full; exit 5\n"
        "# name: good\n"
        f"# on_failure: echo good >> {told}\n"
        "@every 24h true\n"
    )
    daemons.start("--db", db, "crontab", str(crontab))
    wait_until(lambda: listed(db, "good"), what="registered")
    cli(db, "trigger", "good")
    cli(db, "trigger", "bad")
    wait_until(lambda: told.exists() and told.read_text().strip(), what="on_failure ran")
    wait_until(lambda: [r for r in history(db, "good") if r["status"] == "succeeded"], what="good ran")
    record = next(r for r in history(db, "bad") if r["status"] == "failed")
    assert told.read_text().split() == ["bad", "failed", "5", str(record["slot"])], told.read_text()
    assert body.read_text() == "the disk is full\n"
    assert "MAILTO is ignored" in (tmp_path / "daemon-0.log").read_text()


def test_on_failure_runs_once_when_the_run_has_failed_for_good_or_after_every_attempt_when_asked(
    store, tmp_path, daemons
):
    """With ``retries: 2`` a failing entry makes three attempts: its ``# on_failure:`` command runs
    once, for the third (cron's MAILTO and systemd's OnFailure= tell once);
    ``# on_failure_every_attempt:`` runs after each of the three."""
    db, once, every = store, tmp_path / "once.txt", tmp_path / "every.txt"
    crontab = tmp_path / "crontab"
    told = 'echo "$ANARCHON_JOB $ANARCHON_ATTEMPT $ANARCHON_STATUS $ANARCHON_EXIT_CODE $(cat)"'
    crontab.write_text(
        "# name: backup, retries: 2, retry_delay: 100ms\n"
        f"# on_failure: {told} >> {once}\n"
        "@every 24h echo disk full; exit 5\n"
        "# name: chatty, retries: 2, retry_delay: 100ms\n"
        f"# on_failure_every_attempt: {told} >> {every}\n"
        "@every 24h echo no; exit 6\n"
    )
    daemons.start("--db", db, "crontab", str(crontab))
    wait_until(lambda: listed(db, "chatty"), what="registered")
    cli(db, "trigger", "chatty")
    wait_until(lambda: every.exists() and len(every.read_text().splitlines()) == 3, what="three notices")
    cli(db, "trigger", "backup")
    wait_until(lambda: once.exists() and once.read_text().strip(), what="the notice")
    # (A notice of attempt 1 or 2 would have come before the third's: their ends were written first.)
    assert once.read_text().splitlines() == ["backup 3 failed 5 disk full"]
    assert [r["attempt"] for r in history(db, "backup") if r["status"] == "failed"] == [3, 2, 1]
    assert every.read_text().splitlines() == [f"chatty {n} failed 6 no" for n in (1, 2, 3)]


def test_crontab_reads_jitter_and_a_number_of_overlapping_runs_and_refuses_both_notice_forms(tmp_path):
    crontab = tmp_path / "crontab"
    crontab.write_text("CRON_TZ=UTC\n# name: nightly, jitter: 30m, overlap: 3\n0 3 * * * true\n")
    done = anarchon("crontab", "--check", str(crontab))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{crontab}:3: nightly: cron 0 3 * * * UTC jitter 30m overlap 3: next ")
    path = str(crontab)
    bad_crontab(tmp_path, "# overlap: yes\n@hourly true\n", f"{path}:2:", "option 'overlap'")
    bad_crontab(tmp_path, "# jitter: 2h\n@every 1h true\n", f"{path}:2:", "shorter than the interval")
    both = "# on_failure: true\n# on_failure_every_attempt: true\n@hourly true\n"
    bad_crontab(tmp_path, both, f"{path}:3:", "keep one")


def test_status_and_next_show_when_a_jittered_occurrence_starts(store):
    """``status`` shows the next start (the occurrence's time and its jitter) in NEXT and LEFT and
    the jitter and overlap in SCHEDULE; ``next`` lists each occurrence's time and its delay."""
    import asyncio
    import datetime

    import anarchon_lite
    from anarchon_lite import Scheduler

    db = store

    async def declare():
        s = Scheduler(db)
        s.cron("nightly", "0 3 * * *", lambda ctx: None, tz="UTC", jitter="30m", overlap=3)
        await s.status()

    asyncio.run(declare())
    (job,) = status_jobs(db)
    assert job["schedule"] == "cron 0 3 * * * UTC jitter 30m overlap 3"
    at = datetime.datetime.fromisoformat(job["next_at"])
    schedule = anarchon_lite._Jittered(
        anarchon_lite._Cron("0 3 * * *", datetime.timezone.utc, "nightly"), 1800, "nightly"
    )
    slot = int(at.timestamp() * 1000)
    start = datetime.datetime.fromtimestamp(schedule.start_of(slot) / 1000, datetime.timezone.utc)
    assert at.strftime("%H:%M:%S") == "03:00:00" and datetime.datetime.fromisoformat(job["next_start"]) == start
    row = next(line for line in cli(db, "status", "--utc").stdout.splitlines() if line.startswith("nightly"))
    assert start.strftime("%m-%d %H:%M:%S") in row and "jitter 30m" in row  # (cut to 100 columns after it)
    row = next(line for line in cli(db, "status", "--utc", "--wide").stdout.splitlines() if line.startswith("nightly"))
    assert start.strftime("%Y-%m-%d %H:%M:%S UTC") in row and "jitter 30m overlap 3" in row
    listed_next = cli(db, "next", "-n", "2", "--utc").stdout.splitlines()
    assert listed_next[0] == "nightly: cron 0 3 * * * UTC jitter 30m overlap 3"
    assert all(" 03:00:00 UTC  (+" in line and " jitter)  in " in line for line in listed_next[1:]), listed_next
    delay = (start - at).total_seconds()
    assert f"(+{anarchon_lite._span(delay)} jitter)" in listed_next[1]


def test_next_does_not_list_an_occurrence_from_before_the_job_was_declared(store):
    """An occurrence whose time passed before its job was declared never runs (the job starts from
    its declaration), even if its jitter would start it later: ``next`` lists from the job's next
    occurrence, as ``status`` shows it (it listed the one passed, between 03:00 and 03:08 UTC, for
    the nightly job of the test above)."""
    import asyncio

    import anarchon_lite
    from anarchon_lite import Scheduler

    slot = int(time.time() - 60) * 1000  # (an hourly occurrence a minute ago)
    offset = slot // 1000 % 3600

    def delay(name):
        return anarchon_lite._Jittered(anarchon_lite._Every(3600, offset), 1800, name).start_of(slot) - slot

    name = next(f"hourly-{i}" for i in range(1000) if delay(f"hourly-{i}") > 600_000)  # (starting in 9 min or more)

    async def declare():
        s = Scheduler(store)
        s.every(name, "1h", lambda ctx: None, offset=f"{offset}s", jitter="30m")
        await s.status()

    asyncio.run(declare())
    (job,) = status_jobs(store)
    assert job["next_at"] == anarchon_lite._utc_from_ms(slot + 3_600_000).isoformat()
    (listed,) = json.loads(cli(store, "next", "-n", "2", "--json").stdout)
    assert listed["next"] == [anarchon_lite._utc_from_ms(slot + n * 3_600_000).isoformat() for n in (1, 2)]


def test_crontab_keeps_a_metrics_file_and_status_prints_the_same_figures(store, tmp_path, daemons):
    """`crontab --metrics-file PATH` keeps PATH a Prometheus text file for node_exporter (runs by
    status, newest times, running attempts, its renewal lateness); `status --prometheus` prints the
    same job figures once."""
    db, crontab, metrics = store, tmp_path / "crontab", tmp_path / "anarchon.prom"
    crontab.write_text("# name: ok\n@every 24h true\n# name: bad\n@every 24h exit 3\n")
    daemons.start("--db", db, "crontab", str(crontab), "--metrics-file", str(metrics))
    wait_until(lambda: metrics.exists() and 'anarchon_job_running{job="ok"} 0' in metrics.read_text(), what="figures")
    cli(db, "trigger", "ok")
    cli(db, "trigger", "bad")
    ended = (
        'anarchon_job_runs_total{job="ok",status="succeeded"} 1',
        'anarchon_job_runs_total{job="bad",status="failed"} 1',
    )
    wait_until(lambda: all(line in metrics.read_text() for line in ended), what="both ends counted")
    printed = cli(db, "status", "--prometheus").stdout
    assert all(line in printed.splitlines() for line in ended), printed
    assert 'anarchon_job_last_failure_timestamp_seconds{job="bad"} ' in printed
    assert "# TYPE anarchon_job_runs_total counter" in printed
    job_lines = [line for line in metrics.read_text().splitlines() if "lease_renewal" not in line]
    assert [line for line in printed.splitlines() if "lease_renewal" not in line] == job_lines


def test_status_reads_like_list_timers_and_undeclared_jobs_are_refused_then_forgotten(store, tmp_path, daemons):
    """``status`` shows NEXT, LEFT, LAST and RESULT per job in one zone (``--wide``: PASSED too,
    and each time with its zone) and the running processes;
    ``show`` and ``history --output`` print a run's whole output; ``next -n`` lists occurrences.
    An entry removed from the crontab (SIGHUP) becomes ``undeclared``: ``trigger`` refuses it,
    ``forget`` removes it (and refuses a job a running process declares)."""
    db, crontab = store, tmp_path / "crontab"
    entries = "# name: greet\n0 3 * * * echo hello; echo world\n"
    crontab.write_text(entries + "# name: other\n30 4 * * * true\n")
    proc = daemons.start("--db", db, "crontab", str(crontab))

    def registered():  # (the file may exist a moment before its schema and its jobs)
        done = cli(db, "status", "--json", check=False)
        return done.returncode == 0 and [j["name"] for j in json.loads(done.stdout)["jobs"]] == ["greet", "other"]

    wait_until(registered, what="registered")
    cli(db, "trigger", "greet")
    wait_until(lambda: [r for r in history(db, "greet") if r["status"] == "succeeded"], what="greet to run")
    table = cli(db, "status", "--utc").stdout
    header, greet_row = (
        table.splitlines()[0].split(),
        next(line for line in table.splitlines() if line.startswith("greet")),
    )
    assert header[:7] == ["JOB", "STATE", "NEXT", "(UTC)", "LEFT", "LAST", "RESULT"]  # one zone, named once
    assert re.search(r"  \d\d-\d\d 03:00:00  ", greet_row), greet_row  # (the header names the zone)
    assert "left" in greet_row and "ago" in greet_row and "succeeded" in greet_row
    assert "PROCESS" in table and f" {proc.pid} " in table and "SINCE (UTC)" in table
    wide = cli(db, "status", "--utc", "--wide").stdout
    assert wide.splitlines()[0].split()[:7] == ["JOB", "STATE", "NEXT", "LEFT", "LAST", "PASSED", "RESULT"]
    assert "03:00:00 UTC" in next(line for line in wide.splitlines() if line.startswith("greet"))
    shown = cli(db, "show", "greet").stdout
    assert "succeeded" in shown and "    hello\n    world" in shown
    assert "    world" in cli(db, "history", "--output", "--job", "greet").stdout
    upcoming = cli(db, "next", "greet", "-n", "3", "--utc").stdout.splitlines()
    assert upcoming[0].startswith("greet: cron 0 3 * * *") and len(upcoming) == 4
    assert all("03:00:00 UTC" in line for line in upcoming[1:])

    crontab.write_text(entries)
    proc.send_signal(signal.SIGHUP)
    jobs = wait_until(
        lambda: (jobs := {j["name"]: j for j in status_jobs(db)})["other"]["state"] == "undeclared" and jobs,
        what="other to be undeclared",
    )
    assert jobs["greet"]["state"] == "active"
    refused = cli(db, "trigger", "other", check=False)
    assert refused.returncode == 2 and "no running process declares it" in refused.stderr
    assert "Traceback" not in refused.stderr
    kept = cli(db, "forget", "greet", check=False)
    assert kept.returncode == 2 and "declares it" in kept.stderr
    assert cli(db, "forget", "other").stdout.strip() == "other: forgotten, with its runs, history and checkpoints"
    assert [j["name"] for j in status_jobs(db)] == ["greet"]
    daemons.close()
    assert "no scheduler process runs on the store" in cli(db, "status").stdout


def test_next_lists_every_job_it_can_and_names_one_whose_stored_schedule_it_cannot_read(store, tmp_path):
    """A job declared with a fixed-offset zone is stored as ``cron 0 3 * * * UTC+02:00``: ``next``
    cannot rebuild it, says so for that job, and still lists the others."""
    db = store

    async def declare():
        import datetime

        from anarchon_lite import Scheduler

        s = Scheduler(db)
        s.every("tick", "24h", lambda ctx: None, offset=QUIET)
        s.cron("offset", "0 3 * * *", lambda ctx: None, tz=datetime.timezone(datetime.timedelta(hours=2)))
        await s.status()

    import asyncio

    asyncio.run(declare())
    done = cli(db, "next", check=False)
    assert done.returncode == 0 and done.stdout.startswith("tick: every 1d"), done.stderr
    assert "job 'offset'" in done.stderr and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize("env", ["inherit", "minimal"])
def test_a_commands_environment_is_this_processs_or_minimal_as_crons(store, tmp_path, daemons, env):
    """The commands get this process's environment (the default) or, with ``--env minimal``, what
    cron gives: PATH=/usr/bin:/bin, HOME, LOGNAME, USER; then the file's own variables, the run's
    ANARCHON_* ones, and SHELL naming the shell that runs them (this process's SHELL said bash
    while /bin/sh ran them). ``\\%`` is a ``%``, as in cron."""
    import pwd

    out = tmp_path / "env.txt"
    crontab = tmp_path / "crontab"
    crontab.write_text(f"GREETING=hello\n# name: env\n@every 24h echo 'percent=\\%' > {out}; env >> {out}\n")
    user = pwd.getpwuid(os.geteuid())
    extra_env = {"SHELL": "/bin/bash", "APP_SECRET": "s3cret", "PATH": f"/opt/venv/bin:{os.environ['PATH']}"}
    setting = [f"{name}={value}" for name, value in extra_env.items()]
    daemons.start_with(["env", *setting], "--db", store, "crontab", "--env", env, str(crontab))
    wait_until(lambda: listed(store, "env"), what="registered")
    cli(store, "trigger", "env")
    wait_until(lambda: out.exists() and "ANARCHON_RUN=" in out.read_text(), what="the command's environment")
    seen = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    assert seen["percent"] == "%"  # (single quotes: the shell left it alone, the \\ was the crontab's)
    assert seen["SHELL"] == "/bin/sh" and seen["GREETING"] == "hello" and seen["ANARCHON_JOB"] == "env"
    if env == "minimal":
        assert seen["PATH"] == "/usr/bin:/bin" and seen["HOME"] == user.pw_dir
        assert seen["LOGNAME"] == seen["USER"] == user.pw_name
        assert "APP_SECRET" not in seen and "VIRTUAL_ENV" not in seen
    else:
        assert seen["APP_SECRET"] == "s3cret" and seen["PATH"].startswith("/opt/venv/bin:")


def test_status_fits_100_columns_in_one_zone_and_wide_shows_everything(store, tmp_path):
    """Long names and schedules are cut to fit 100 columns (``…``), every time of the table is in
    one zone (here Asia/Kolkata, whatever each job's own zone: zones without daylight saving, so
    the hours hold all year), named in the header; ``--wide`` shows them whole, each time in its
    job's zone."""
    import asyncio
    import unicodedata

    from anarchon_lite import Scheduler

    long_name = "nightly-export-of-every-customer-invoice-to-the-warehouse"

    async def declare():
        s = Scheduler(store)
        s.cron(long_name, "0 3 * * *", lambda ctx: None, tz="Asia/Tokyo")
        s.rrule("report", "FREQ=MONTHLY;BYDAY=-1FR;BYHOUR=17;BYMINUTE=0;BYSECOND=0", lambda ctx: None, tz="UTC")
        s.every("夜間のエクスポート" * 3, "1h", lambda ctx: None)  # (27 characters, each two columns wide)
        async with s:
            pass

    asyncio.run(declare())
    env = {**ENV, "TZ": "Asia/Kolkata"}
    table = subprocess.run(
        [sys.executable, "-m", "anarchon_lite", "--db", store, "status"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = table.splitlines()

    def columns(line):
        return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)

    assert max(map(columns, lines)) <= 100, table
    assert len({columns(line.split("  active")[0]) for line in lines if "  active" in line}) == 1, table  # aligned
    assert lines[0].split()[:4] == ["JOB", "STATE", "NEXT", "(Asia/Kolkata)"]
    assert any(line.startswith(long_name[:23] + "…") for line in lines), table
    assert "JST" not in table and "UTC" not in table and "IST" not in table
    tokyo = next(line for line in lines if line.startswith(long_name[:23]))
    assert " 23:30:00 " in tokyo  # 03:00 in Tokyo is 23:30 the day before in Kolkata
    wide = subprocess.run(
        [sys.executable, "-m", "anarchon_lite", "--db", store, "status", "--wide"],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    assert long_name in wide and " 03:00:00 JST" in wide and "FREQ=MONTHLY;BYDAY=-1FR;BYHOUR=17" in wide
