"""Talking to systemd: a real datagram socket stands in for the service manager ($NOTIFY_SOCKET)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import run, wait_for

from anarchon_lite import Scheduler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Manager:
    """The service manager's end of $NOTIFY_SOCKET: every message received, with when (monotonic)."""

    def __init__(self, address: str):
        self.env = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        while not self._closed:
            try:
                data = self.sock.recv(4096)
            except (socket.timeout, OSError):
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            with self._lock:
                self.messages.append((time.monotonic(), fields))

    def received(self, key: str, value: str | None = None) -> list[tuple[float, dict[str, str]]]:
        with self._lock:
            return [(t, m) for t, m in self.messages if key in m and (value is None or m[key] == value)]

    def wait(self, key: str, value: str | None = None, count: int = 1, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.received(key, value)
            if len(found) >= count:
                return found
            time.sleep(0.02)
        raise AssertionError(f"no {count} x {key}={value} from the process in {timeout} s: {self.messages}")

    def close(self):
        self._closed = True
        self._reader.join()
        self.sock.close()


@pytest.fixture(params=["path", "abstract"])
def manager(request, tmp_path):
    address = str(tmp_path / "notify") if request.param == "path" else f"@anarchon-test-{os.getpid()}-{id(tmp_path)}"
    found = Manager(address)
    try:
        yield found
    finally:
        found.close()


# (SQLite only: what systemd is told does not depend on the store)
def test_crontab_under_systemd_is_ready_says_what_it_does_pings_and_says_it_stops(tmp_path, manager):
    """`crontab` with $NOTIFY_SOCKET and $WATCHDOG_USEC: READY=1 with a STATUS once joined, the
    running command in a later STATUS, WATCHDOG=1 every half of the timeout, and at SIGTERM
    STOPPING=1 with EXTEND_TIMEOUT_USEC for handing its run over; the command it starts does not
    inherit the variables."""
    db, crontab, seen = str(tmp_path / "jobs.db"), tmp_path / "crontab", tmp_path / "seen.txt"
    crontab.write_text(
        f"# name: long\n# grace: 3s\n@reboot printenv NOTIFY_SOCKET WATCHDOG_USEC > {seen}; echo started >> {seen}; exec sleep 60\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "NOTIFY_SOCKET": manager.env, "WATCHDOG_USEC": "300000"}
    with open(tmp_path / "daemon.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "anarchon_lite", "--db", db, "crontab", str(crontab)], stderr=log, env=env
        )
    try:
        (_, ready), *_ = manager.wait("READY", "1")
        assert ready["STATUS"].startswith("1 jobs, "), ready
        manager.wait("STATUS", "1 jobs, 1 running")
        deadline = time.monotonic() + 30
        while "started" not in (seen.read_text() if seen.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen.read_text() == "started\n", "the command saw NOTIFY_SOCKET or WATCHDOG_USEC"
        manager.wait("WATCHDOG", "1", count=4)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        (_, stopping), *_ = manager.received("STOPPING", "1")
        assert int(stopping["EXTEND_TIMEOUT_USEC"]) >= 3_000_000, stopping  # at least the grace
        assert stopping["STATUS"] == "stopping: handing over 1 running", stopping
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# (SQLite only: the watchdog pings come from the event loop, whatever the store)
def test_watchdog_pings_come_from_the_event_loop_not_while_it_is_blocked(db, monkeypatch):
    """WATCHDOG=1 is sent from the event loop: a handler busy in a worker thread does not stop the
    pings (systemd must not restart a process that works), an async handler that blocks the loop
    does (a wedged loop is what the watchdog is for). STOPPING=1 at the end, with no time to
    extend when nothing runs."""
    address = f"@anarchon-test-{os.getpid()}-watchdog"
    manager = Manager(address)
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a ping every 50 ms
    times: dict[str, float] = {}

    def busy_thread(ctx):
        times["thread_start"] = time.monotonic()
        time.sleep(1.0)
        times["thread_end"] = time.monotonic()

    async def blocks_the_loop(ctx):
        times["block_start"] = time.monotonic()
        time.sleep(1.0)  # noqa: ASYNC251 - the point of the test
        times["block_end"] = time.monotonic()

    scheduler = Scheduler(db, notify=True, blocked_warning=30.0)
    scheduler.every("thread", "1d", busy_thread)
    scheduler.every("blocker", "1d", blocks_the_loop)
    assert "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ

    async def main():
        async with scheduler:
            await scheduler.trigger("thread")
            await wait_for(lambda: "thread_end" in times, timeout=30, message="the thread handler")
            await scheduler.trigger("blocker")
            await wait_for(lambda: "block_end" in times, timeout=30, message="the blocking handler")
            await wait_for(lambda: any(t > times["block_end"] for t, _ in manager.received("WATCHDOG")), 10)

    try:
        run(main())
        pings = [t for t, _ in manager.received("WATCHDOG", "1")]
        during_thread = [t for t in pings if times["thread_start"] < t < times["thread_end"]]
        assert len(during_thread) >= 5, (during_thread, times)  # 20 at the plan; under load, fewer
        # one sent just before the block may be read a moment after it began
        during_block = [t for t in pings if times["block_start"] + 0.2 < t < times["block_end"]]
        assert during_block == [], (during_block, times)
        (_, stopping), *_ = manager.received("STOPPING", "1")
        assert "EXTEND_TIMEOUT_USEC" not in stopping and stopping["STATUS"] == "stopping: handing over 0 running"
    finally:
        manager.close()
