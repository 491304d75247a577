"""Shared helpers: a clock moved by hand, and waiting on conditions with deadlines."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable
from typing import Callable

import pytest

import anarchon_lite

# The offset of a daily job ``every(name, "24h", offset=QUIET)`` whose occurrences come 11-12 hours
# after the test session started: a test on the real clock that triggers runs by hand never meets a
# scheduled one (an hourly job would, when a test runs across the top of an hour).
QUIET = (int(time.time()) // 3600 + 12) % 24 * 3600


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
