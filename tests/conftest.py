"""Shared helpers: a clock moved by hand, and waiting on conditions with deadlines."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable
from typing import Callable

import pytest

import anarchon_lite

# The offset of a daily job ``every(name, "24h", offset=QUIET)`` whose occurrences come 11-12 hours
# after the test session started: a test on the real clock that triggers runs by hand never meets a
# scheduled one (an hourly job would, when a test runs across the top of an hour).
# Worked out once and handed down to the worker processes, whose clocks may be set otherwise (faketime).
QUIET = int(os.environ.setdefault("ANARCHON_TEST_QUIET", str((int(time.time()) // 3600 + 12) % 24 * 3600)))


# The lease boards of the session's files, in a folder of RAM of the session's own (removed at its
# end) rather than in /dev/shm itself, where each test's file would leave its board until a reboot.
# Worker processes inherit it (and import this file: they keep the folder they were given).
BOARDS = os.environ.get("ANARCHON_TEST_BOARDS") or tempfile.mkdtemp(
    prefix="anarchon-lite-boards-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
)
os.environ["ANARCHON_TEST_BOARDS"] = BOARDS
os.environ.setdefault("ANARCHON_BOARD_DIR", BOARDS)  # (a worker may be given another)


# libfaketime itself (the faketime wrapper names a semaphore by pid, which collides across pid
# namespaces). A test that needs it skips without it, unless ``$ANARCHON_REQUIRE_FAKETIME`` (CI).
FAKETIME = next(iter(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")), None)
needs_faketime = pytest.mark.skipif(
    FAKETIME is None and not os.environ.get("ANARCHON_REQUIRE_FAKETIME"), reason="no libfaketime (apt install faketime)"
)


def wall_clock_ahead(offset: str = "+1h") -> list[str]:
    """The command prefix that runs a process with its wall clock moved by ``offset`` and its
    monotonic clock left alone, as on a host whose clock is wrong (faking the monotonic clock too
    makes libfaketime stretch every timed wait of the process by the offset)."""
    assert FAKETIME, "libfaketime is required (apt install faketime)"
    return ["env", f"LD_PRELOAD={FAKETIME}", f"FAKETIME={offset}", "FAKETIME_DONT_FAKE_MONOTONIC=1"]


def stop_processes(procs: list[subprocess.Popen], signum: int = signal.SIGTERM, timeout: float = 20.0) -> None:
    """Send ``signum`` to each process still running, wait for each (killed past ``timeout``): every
    process a test starts is ended and reaped, whatever became of the test."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signum)
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ManualClock(anarchon_lite.Clock):
    """Wall and monotonic time that move only when the test says so (or ``tick`` per real second)."""

    def __init__(self, start: float = 1_800_000_000.0):
        self._lock = threading.Lock()
        self._wall = start
        self._mono = 1000.0

    def time(self) -> float:
        with self._lock:
            return self._wall

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def advance(self, seconds: float) -> None:
        """Time passes: both clocks move."""
        with self._lock:
            self._wall += seconds
            self._mono += seconds

    def jump(self, seconds: float) -> None:
        """The wall clock is set (NTP, a wrong boot clock): only wall time moves."""
        with self._lock:
            self._wall += seconds


async def wait_for(
    condition: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, message: str = "condition"
) -> None:
    """Poll ``condition`` (sync or async) until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}")
        await asyncio.sleep(0.01)


@pytest.fixture
def db(tmp_path) -> str:
    return str(tmp_path / "jobs.db")


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def run(coro: Awaitable[object], timeout: float | None = 60.0) -> object:
    """Run a coroutine on a fresh event loop, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture
def machine_to_itself():
    """For the tests that load the whole machine (chaos, load): when several test sessions run at
    once (CI runs one per Python, two at a time), these run one at a time across all of them."""
    import fcntl
    import os
    import tempfile

    path = os.path.join(tempfile.gettempdir(), "anarchon-lite-heavy-tests.lock")
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# -- PostgreSQL -------------------------------------------------------------------------------------
#
# A test that takes the ``store`` fixture runs once on an SQLite file and once on a fresh schema of
# a throwaway PostgreSQL server (one per test session, started on first use: tests/pgserver.py);
# ``@pytest.mark.sqlite_only`` keeps a test to SQLite, where what it checks exists only there (the
# injected clock as the lease clock, the file itself). Without a server the PostgreSQL cases skip
# with the reason, unless ``$ANARCHON_REQUIRE_POSTGRES`` is set (CI): then they fail.


def pytest_unconfigure(config):
    if os.environ.get("ANARCHON_TEST_BOARDS") == BOARDS:
        shutil.rmtree(BOARDS, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "sqlite_only: the test checks what only the SQLite store has")


# CI runs the PostgreSQL half of the suite and the browser tests on the oldest and newest Python
# only: ``$ANARCHON_WITHOUT_POSTGRES`` and ``$ANARCHON_WITHOUT_BROWSER`` deselect them (a deselected
# test is not a skip: it is not run here, and runs in full in the other environments).
WITHOUT_POSTGRES = "ANARCHON_WITHOUT_POSTGRES"
WITHOUT_BROWSER = "ANARCHON_WITHOUT_BROWSER"


def pytest_collection_modifyitems(config, items):
    without_postgres, without_browser = os.environ.get(WITHOUT_POSTGRES), os.environ.get(WITHOUT_BROWSER)
    if not without_postgres and not without_browser:
        return
    kept, dropped = [], []
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        postgres = "pg_server" in fixtures or (
            getattr(item, "callspec", None) and item.callspec.params.get("store") == "postgresql"
        )
        needs = (without_postgres and postgres) or (without_browser and "browser" in fixtures)
        (dropped if needs else kept).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_generate_tests(metafunc):
    if "store" in metafunc.fixturenames:
        kinds = ["sqlite"] if metafunc.definition.get_closest_marker("sqlite_only") else ["sqlite", "postgresql"]
        metafunc.parametrize("store", kinds, indirect=True)


@pytest.fixture(scope="session")
def pg_server():
    import pgserver

    reason = pgserver.reason_missing()
    if reason is not None:
        if os.environ.get(pgserver.REQUIRED):
            pytest.fail(f"PostgreSQL is required (${pgserver.REQUIRED}) but cannot be had: {reason}")
        pytest.skip(f"no PostgreSQL server: {reason}")
    server = pgserver.Server.start()
    yield server
    server.stop()


_schemas = iter(range(1, 1_000_000))


@pytest.fixture
def lease_clock(store, clock):
    """For tests of leases running out: the injected clock on SQLite, whose leases are on it; on
    PostgreSQL, whose leases are on the server's clock, the real one (see ``expire``)."""
    return clock if store.endswith(".db") else anarchon_lite.Clock()


@pytest.fixture
def store(request, tmp_path) -> str:
    """Where a test's scheduler keeps its state: an SQLite file, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        return str(tmp_path / "jobs.db")
    server = request.getfixturevalue("pg_server")
    return server.url(schema=f"t{os.getpid()}_{next(_schemas)}")


class Process:
    """One process on the store at ``where`` (a file or a URL), its stores built as its scheduler's
    backend builds them (``anarchon_lite._store_at``, the factory ``Scheduler`` calls): ``open()`` gives a store of its own
    connection. On PostgreSQL the process holds its advisory lock, as a running scheduler does (its
    ``_Changes`` session), so that its stores can claim runs. ``close`` lets go of everything."""

    def __init__(self, where: str, clock: anarchon_lite.Clock | None = None, **options):
        self.backend = anarchon_lite._store_at(where, clock=clock, **options)
        self._stores: list = []
        self._changes = None
        if isinstance(self.backend, anarchon_lite._Postgres):
            self._loop = asyncio.new_event_loop()  # (never run: told of changes it is not asked about)
            self._changes = self.backend.changes(self._loop, lambda: None, "test")
            if not self.backend._identity.held.wait(30):
                self.close()
                raise AssertionError(f"no advisory lock on {where} within 30 s")

    @property
    def postgres(self) -> bool:
        return self._changes is not None

    def open(self):
        store = self.backend.control_store()
        self._stores.append(store)
        return store

    def close(self) -> None:
        for store in self._stores:
            store.close()
        if self._changes is not None:
            self._changes.close()
            self._loop.close()


# -- faults through the store interface ----------------------------------------------------------


class _Wrapped:
    """A store whose methods named in ``around`` run through ``around[name](original, *args)``
    (and whose attributes named there have the value given)."""

    def __init__(self, inner, around):
        self._inner, self._around = inner, around

    def __getattr__(self, name):
        original = getattr(self._inner, name)
        if name not in self._around:
            return original
        if not callable(self._around[name]):  # (a value in place of the store's: ``waitless=False``)
            return self._around[name]
        return lambda *args, **kwargs: self._around[name](original, *args, **kwargs)


class FaultyBackend(anarchon_lite._Backend):
    """A scheduler's backend whose stores run the methods named in ``around`` through the given
    functions (to fail, delay or count them), and whose ``_Changes`` run those named in
    ``changes_around``: faults injected through the interface, on any store."""

    def __init__(self, inner, around, changes_around=None):
        self.inner, self.around, self.where = inner, around, inner.where
        self.changes_around = changes_around or {}
        self.look_every, self.polled = inner.look_every, inner.polled

    def control_store(self):
        return _Wrapped(self.inner.control_store(), self.around)

    def renewal_store(self):
        return _Wrapped(self.inner.renewal_store(), self.around)

    def loop_renewal(self):
        store = self.inner.loop_renewal()
        return None if store is None else _Wrapped(store, self.around)

    def changes(self, loop, on_change, instance, on_gone=None, on_asked=None):
        changes = self.inner.changes(loop, on_change, instance, on_gone, on_asked)
        return _Wrapped(changes, self.changes_around) if self.changes_around else changes


def coalesced(monkeypatch, seconds: float) -> None:
    """Every store's watch reads what other processes tell (claims, ends) at most every
    ``seconds`` (its ``coalesce``): a read it would wait for does not come within a test."""
    for watch in (anarchon_lite._SQLiteChanges, anarchon_lite._PGChanges):
        monkeypatch.setattr(watch, "coalesce", seconds)


def faulty(**around):
    """A ``store=`` for ``Scheduler``: the store it would open, with the named methods of its stores
    run through ``around`` (``inner(original, *args)``)."""
    return lambda backend: FaultyBackend(backend, around)


def counting_looks(**around):
    """A ``store=`` for ``Scheduler`` (as ``faulty(**around)``) and a list that gets an item at each
    of the scheduler's looks (each look asks its ``_Changes`` for the store's version once, first)."""
    looks = []

    def version(original):
        looks.append(1)
        return original()

    return (lambda backend: FaultyBackend(backend, around, {"version": version})), looks
