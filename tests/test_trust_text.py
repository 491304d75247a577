"""Whatever a handler returns, raises or prints, its attempt ends with a readable record, and one
attempt's bad end never touches another's (SPEC section 12), on both stores."""

import asyncio
import datetime as dt
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
from conftest import QUIET, faulty, run, stop_processes, wait_for

import anarchon_lite as al
from anarchon_lite import Scheduler


class SlicingRaises(str):
    def __getitem__(self, key):
        raise RuntimeError("no slicing")


class StrRaises(Exception):
    def __str__(self):
        raise RuntimeError("no str")

    def __repr__(self):
        raise RuntimeError("no repr")


class EvilText(str):  # what a ``__str__`` may return: a str whose own methods raise
    def __getitem__(self, key):
        raise RuntimeError("no slicing")

    def isascii(self):
        raise RuntimeError("no isascii")


class StrIsEvil(Exception):
    def __str__(self):
        return EvilText("evil text")


class OutputRaises(Exception):
    @property
    def output(self):
        raise RuntimeError("no output")


async def raise_surrogate(ctx):
    raise ValueError("cannot parse caf\udce9.txt")  # os.listdir() of a name that is not UTF-8


async def return_surrogate(ctx):
    return "read caf\udce9.txt"


async def return_slicing_raises(ctx):
    return SlicingRaises("hello")


async def raise_str_raises(ctx):
    raise StrRaises()


async def raise_str_is_evil(ctx):
    raise StrIsEvil()


def exit_str_is_evil(ctx):  # a plain function: a BaseException, wrapped on its way out of the thread
    raise type("EvilExit", (SystemExit,), {"__str__": lambda self: EvilText("evil exit")})()


def raise_output_raises(ctx):  # a plain function, in a worker thread
    raise OutputRaises("bad output")


async def return_nul(ctx):
    return "a\x00b"


async def return_fine(ctx):
    return "fine"


HANDLERS = {
    "surrogate-raised": (raise_surrogate, "failed", "ValueError: cannot parse caf\\udce9.txt"),
    "surrogate-returned": (return_surrogate, "succeeded", None),
    "slicing-raises": (return_slicing_raises, "succeeded", None),
    "str-raises": (raise_str_raises, "failed", "StrRaises: <StrRaises whose str() raised>"),
    "output-raises": (raise_output_raises, "failed", "OutputRaises: bad output"),
    "str-is-evil": (raise_str_is_evil, "failed", "StrIsEvil: evil text"),
    "exit-str-is-evil": (
        exit_str_is_evil,
        "failed",
        "HandlerEscaped: EvilExit: evil exit (raised by the handler; the process carried on)",
    ),
    "nul": (return_nul, "succeeded", None),
    "neighbour": (return_fine, "succeeded", None),
}


async def ended(s, names):
    records = await s.history(limit=1000)
    return {r.job: r for r in records if r.status != "running" and r.job in names}


def test_odd_text_from_handlers_ends_every_attempt_readably(store):
    """Each handler's attempt ends (none stays ``running``, so none wedges the job's later
    occurrences), the error says what the handler raised, starting with the handler's own frame,
    and the job's next occurrence runs."""

    async def main():
        s = Scheduler(store, poll=0.02)
        for name, (handler, _, _) in HANDLERS.items():
            s.every(name, "24h", handler, offset=QUIET)
        async with s:
            for name in HANDLERS:  # one after another in one turn: their ends share a batch
                await s.trigger(name)
            await wait_for(lambda: _all_ended(s, set(HANDLERS)), message="every attempt's end")
            records = await ended(s, set(HANDLERS))
            for name, (_, status, error) in HANDLERS.items():
                assert records[name].status == status, (name, records[name])
                if error is not None:
                    assert records[name].error.endswith(error), (name, records[name].error)
                    assert records[name].error.lstrip().startswith(f'File "{__file__}"'), records[name].error
            assert records["surrogate-returned"].output == "read caf\\udce9.txt"
            assert records["nul"].output == "a\\x00b"
            assert records["slicing-raises"].output == "hello"
            for name in HANDLERS:  # not wedged: the next run of each job runs and ends too
                await s.trigger(name)
            await wait_for(lambda: _all_ended(s, set(HANDLERS), count=2), message="every second attempt's end")

    run(main())


async def _all_ended(s, names, count=1):
    records = await s.history(limit=1000)
    done = [r.job for r in records if r.status != "running"]
    return all(done.count(name) >= count for name in names)


def test_one_ends_fault_never_fails_its_neighbours_in_the_batch(store):
    """An end that the store cannot write for a reason of its own (not the store's: a
    ``StoreError`` would be retried for the whole batch) is written again alone, bare, and the end
    written beside it lands."""
    batches = []

    def finish_many(original, owner, ends):
        batches.append(sorted(e.claim.job for e in ends))
        if any(e.claim.job == "bad" and "could not be stored" not in (e.error or "") for e in ends):
            raise UnicodeEncodeError("utf-8", "x", 0, 1, "as if its text could not be encoded")
        return original(owner, ends)

    started = []
    both = None  # (an asyncio.Event, made on the test's loop: Python 3.9 binds one where it is made)

    async def together(ctx):  # the two attempts end in the same turn of the loop: one batch
        started.append(ctx.job)
        if len(started) == 2:
            both.set()
        await both.wait()
        if ctx.job == "bad":
            raise ValueError("bad")

    async def main():
        nonlocal both
        both = asyncio.Event()
        s = Scheduler(store, poll=0.02, store=faulty(finish_many=finish_many))
        s.every("bad", "24h", together, offset=QUIET)
        s.every("good", "24h", together, offset=QUIET)
        async with s:
            await s.trigger("bad")
            await s.trigger("good")
            await wait_for(lambda: _all_ended(s, {"bad", "good"}), message="both ends")
            records = await ended(s, {"bad", "good"})
        assert batches[0] == ["bad", "good"], batches
        assert records["good"].status == "succeeded"
        assert records["bad"].status == "failed"
        assert "could not be stored" in records["bad"].error and "UnicodeEncodeError" in records["bad"].error

    run(main())


@pytest.mark.parametrize(
    "value, expected",
    [
        ("plain", "plain"),
        ("caf\udce9", "caf\\udce9"),
        ("a\x00b", "a\\x00b"),
        (SlicingRaises("abc"), "abc"),
        (StrRaises(), "<StrRaises whose str() raised>"),
        (StrIsEvil(), "evil text"),
        (EvilText("evil"), "evil"),
        ("é" * 10, "é" * 4),
    ],
)
def test_safe_text_is_total(value, expected):
    text = al._safe_text(value, 4 if expected == "é" * 4 else None)
    assert text == expected and type(text) is str
    text.encode("utf-8")  # never raises


# -- the command line shows what is stored safely ---------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}
ANSI = "\x1b]0;pwned\x07\x1b[2Jdone"


def anarchon(*args, stdout=subprocess.PIPE):
    return subprocess.run(
        [sys.executable, "-m", "anarchon_lite", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        timeout=60,
        check=False,
    )


def ran_once(store, handlers, times=1):
    """Run each handler ``times`` (by trigger) and wait for every end."""

    async def main():
        s = Scheduler(store, poll=0.02)
        for name, handler in handlers.items():
            s.every(name, "24h", handler, offset=QUIET, overlap="allow")
        async with s:
            for _ in range(times):
                for name in handlers:
                    await s.trigger(name)
            await wait_for(lambda: _all_ended(s, set(handlers), count=times), timeout=30, message="the ends")

    run(main())


def test_history_and_show_escape_control_characters(store):
    async def ansi(ctx):
        return ANSI

    ran_once(store, {"ansi": ansi, "surrogate": raise_surrogate})
    for args in (["history"], ["history", "--output"], ["show", "ansi"], ["show", "surrogate"]):
        done = anarchon("--db", store, *args)
        assert done.returncode == 0 and done.stderr == "", (args, done.stderr)
        assert "\x1b" not in done.stdout and "\x07" not in done.stdout, args
    assert "\\x1b]0;pwned\\x07\\x1b[2Jdone" in anarchon("--db", store, "show", "ansi").stdout
    assert "caf\\udce9.txt" in anarchon("--db", store, "show", "surrogate").stdout
    shown = json.loads(anarchon("--db", store, "history", "--json").stdout)
    assert {r["job"]: r["output"] for r in shown}["ansi"] == ANSI  # JSON carries the text itself, escaped by JSON


@pytest.mark.sqlite_only  # PostgreSQL's text never holds bytes that are not UTF-8
def test_stored_bytes_that_are_not_utf8_are_shown_escaped(store):
    ran_once(store, {"fine": return_fine})
    conn = sqlite3.connect(store)
    with conn:
        conn.execute("UPDATE history SET error = CAST(X'41ff42' AS TEXT)")
    conn.close()
    done = anarchon("--db", store, "history")
    assert done.returncode == 0 and "A\\xffB" in done.stdout, done.stderr

    async def read():
        return await Scheduler(store).history()

    assert run(read())[0].error == "A\\xffB"


@pytest.mark.sqlite_only  # a file's name
def test_a_database_path_that_is_not_utf8(tmp_path):
    path = os.path.join(os.fsdecode(bytes(tmp_path)), os.fsdecode(b"caf\xe9.db"))
    ran_once(path, {"fine": return_fine})
    done = subprocess.run(
        [sys.executable.encode(), b"-m", b"anarchon_lite", b"--db", os.fsencode(path), b"history", b"--json"],
        capture_output=True,
        env=ENV,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert [r["status"] for r in json.loads(done.stdout)] == ["succeeded"]


def test_output_piped_to_a_reader_that_stops_early(store):
    """``history --output | head -1``: no ``Broken pipe`` message, the exit status of a command
    ended by SIGPIPE."""

    async def big(ctx):
        return "x" * 4000 + "\n"

    ran_once(store, {"big": big}, times=30)  # 120 KB of output: more than a pipe holds
    proc = subprocess.Popen(
        [sys.executable, "-m", "anarchon_lite", "--db", store, "history", "--output", "--limit", "30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    try:
        assert proc.stdout.readline()
        proc.stdout.close()
        assert proc.wait(timeout=60) == 141
        assert proc.stderr.read() == b""
    finally:
        stop_processes([proc])


def test_numbers_on_the_command_line_are_bounded(tmp_path):
    db = str(tmp_path / "jobs.db")
    for args, option in (
        (["history", "--limit", "99999999999999999999"], "--limit"),
        (["history", "-n", "0"], "--limit"),
        (["next", "-n", "99999999999999999999"], "-n"),
    ):
        done = anarchon("--db", db, *args)
        assert done.returncode == 2 and done.stdout == "", args
        assert len(done.stderr.splitlines()) == 1 and option in done.stderr and "whole number" in done.stderr, args


def test_history_of_an_unknown_job_is_refused_and_n_is_its_limit(store):
    ran_once(store, {"fine": return_fine}, times=2)
    done = anarchon("--db", store, "history", "--job", "nope")
    assert done.returncode == 2 and done.stderr.strip() == "anarchon-lite: job 'nope': no such job in the database"
    records = json.loads(anarchon("--db", store, "history", "--job", "fine", "-n", "1", "--json").stdout)
    assert len(records) == 1


def test_status_shows_a_next_time_that_has_passed_as_late(store):
    async def once():  # one occurrence of a job every second, then no process runs it
        s = Scheduler(store, poll=0.02)
        s.every("often", "1s", return_fine)
        async with s:
            await wait_for(lambda: _all_ended(s, {"often"}), message="one run")

    def overdue():
        job = json.loads(anarchon("--db", store, "status", "--json").stdout)["jobs"][0]
        return job["next_at"] is not None and dt.datetime.fromisoformat(job["next_at"]).timestamp() < time.time() - 1

    run(once())
    deadline = time.monotonic() + 30
    while not overdue():
        assert time.monotonic() < deadline, "the next occurrence never passed"
        time.sleep(0.1)
    line = next(line for line in anarchon("--db", store, "status").stdout.splitlines() if line.startswith("often"))
    assert " late " in line and " left " not in line, line


def test_run_of_a_function_that_needs_arguments_is_one_line(tmp_path):
    (tmp_path / "needs.py").write_text(
        "import anarchon_lite\n\ndef make(path):\n    return anarchon_lite.Scheduler(path)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "anarchon_lite", "run", "needs:make"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "needs:make" in done.stderr and "'path'" in done.stderr


def test_instance_must_be_printable_text(tmp_path):
    for bad in ("a\udce9", "", "a\nb", "x" * 201):
        with pytest.raises(al.ConfigError, match="option 'instance'"):
            Scheduler(str(tmp_path / "jobs.db"), instance=bad)


def test_a_thread_handler_returning_after_the_loop_closed_is_quiet(store):
    """A plain-function handler still running when ``stop(grace)`` gives up returns later into a
    closed event loop: nothing is printed; its record names the grace the stop used."""
    release, started, crashes = threading.Event(), threading.Event(), []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: crashes.append(args)

    def stubborn(ctx):
        started.set()
        release.wait(30)

    async def main():
        s = Scheduler(store, poll=0.02)
        s.every("stubborn", "24h", stubborn, offset=QUIET)
        async with s:
            await s.trigger("stubborn")
            await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
            await s.stop(grace=0.3)
        return await s.history("stubborn")

    try:
        records = run(main())
        threads = [t for t in threading.enumerate() if t.name == "anarchon-stubborn"]
        release.set()
        for thread in threads:
            thread.join(30)
        assert threads and crashes == []
    finally:
        release.set()
        threading.excepthook = old_hook
    assert records[0].status == "interrupted"
    assert "300ms grace" in records[0].error, records[0].error


def test_a_crontab_variable_with_a_nul_is_refused_at_its_line(tmp_path):
    crontab = tmp_path / "jobs.cron"
    crontab.write_bytes(b"FOO=a\x00b\n@every 1s echo $FOO\n")
    done = anarchon("crontab", "--check", str(crontab))
    assert (
        done.returncode == 2
        and done.stderr.strip() == f"anarchon-lite: {crontab}:1: the value of FOO has a NUL character in it"
    )


def test_progress_that_is_not_a_finite_number_is_refused_to_the_handler(store):
    said = []

    async def report(ctx):
        for bad in ((float("nan"), None), (1.0, float("inf"))):
            try:
                ctx.progress(*bad)
            except ValueError as exc:
                said.append(str(exc))
        ctx.progress(1, 2)

    ran_once(store, {"report": report})
    assert len(said) == 2 and all(s.startswith("job 'report': progress must be finite") for s in said), said
