# anarchon_lite - a job scheduler for one machine (or a few, on PostgreSQL), in one file.
#
# Copyright (c) 2026 the anarchon_lite authors. MIT licence: use, copy, modify and distribute this
# file freely, provided this header stays with it.
"""One file, one dependency (python-dateutil; psycopg 3 only for PostgreSQL); see the README.

Copy this file into your project and keep this header. Several processes on one host share one
SQLite file in WAL mode (or processes on many hosts one PostgreSQL database: give a
``postgresql://`` URL instead of a path); they declare the same jobs, and every scheduled occurrence
runs exactly once across them, under a lease kept alive by heartbeats. When the owner crashes, is
deployed or freezes, another process takes the run over as the next attempt, and a checkpoint store
lets it continue::

    import asyncio

    from anarchon_lite import Scheduler

    scheduler = Scheduler("jobs.db")

    @scheduler.every("export", "1h", timeout="50m")
    async def export(ctx):
        after = await ctx.checkpoint.get(0)
        for batch in batches_after(after):
            ctx.signal.throw_if_aborted()
            await export_batch(batch)
            await ctx.checkpoint.set(batch[-1].id)

    asyncio.run(scheduler.run())
"""

# The map: sections in dependency order (a name is defined before it is used), each under a banner.
#
#   Errors, Durations and clocks, Cancellation, Schedules      the pure parts: no I/O
#   The store interface                                        what the scheduler asks of a store
#   Files this process trusts, Processes on this host          ownership of files; /proc, groups, liveness
#   The SQL stores                                             the statements both stores share
#   The SQLite file, The lease board, The SQLite store         the default store (one host)
#   The PostgreSQL store, PostgreSQL: locks and changes        the store of many hosts
#   Choosing the store                                         _store_at: from a path or URL to a store
#   Leases and heartbeats                                      the renewing thread, timers, the watchdog
#   Jobs and options, The store from the event loop            declarations; calls queued to the store
#   The run context and checkpoints, Running an attempt        what a handler gets; _Runner
#   Planning occurrences, Metrics, Talking to systemd          what is due; Prometheus text; sd_notify
#   The scheduler loop                                         _Loop: join, look, fire, claim, take over
#   The scheduler                                              Scheduler (the public face; _Declaring its jobs), Control
#   The status page's server, The status page                  HTTP and tokens; StatusPage's pages
#   Shell commands in process groups, Crontab files            what ``crontab`` runs, and reads
#   The command line                                           ``python -m anarchon_lite``

from __future__ import annotations

import abc
import asyncio
import bisect
import collections
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import datetime as _dt
import enum
import functools
import heapq
import importlib
import inspect
import json
import logging
import math
import os
import random
import re
import select
import signal
import socket
import sqlite3
import stat
import sys
import threading
import time
import traceback
import unicodedata
import zlib
import zoneinfo
from collections.abc import Awaitable, Coroutine, Generator, Iterable, Iterator, Mapping, Sequence
from queue import SimpleQueue
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Literal,
    NamedTuple,
    Optional,
    TypedDict,
    TypeVar,
    Union,
    cast,
    overload,
)

if TYPE_CHECKING:  # imported when needed: dateutil for rrule schedules, argparse for the command line
    import argparse

    from dateutil import rrule as _rrule
    from dateutil.relativedelta import relativedelta

# ``**options: Unpack[JobOptions]`` lets a type checker check each option's name and type; typing
# has ``Unpack`` from Python 3.11 (nothing is imported for it before: a checker reading the file for
# Python 3.10 takes the options as they come, and ``typing.get_type_hints`` reads this stand-in).
if TYPE_CHECKING or sys.version_info >= (3, 11):
    from typing import Unpack  # type: ignore[attr-defined, unused-ignore]
else:

    class Unpack:
        def __class_getitem__(cls, item: object) -> object:
            return item


__version__ = "0.1.0"

__all__ = [
    "Aborted",
    "AnarchonError",
    "CancelToken",
    "Cancelled",
    "Checkpoint",
    "CheckpointStore",
    "Clock",
    "CommandFailed",
    "ConfigError",
    "Control",
    "CrontabError",
    "HandlerEscaped",
    "JobNotFound",
    "JobOptions",
    "JobStatus",
    "LeaseLost",
    "ProcessInfo",
    "RunContext",
    "RunEvent",
    "RunInfo",
    "RunRecord",
    "RunTimeout",
    "Scheduler",
    "Shutdown",
    "StatusPage",
    "StoreError",
    "SystemClock",
    "command_handler",
    "format_duration",
    "main",
    "parse_duration",
    "serve_status_page",
]

_log = logging.getLogger("anarchon_lite")
_UTC = _dt.timezone.utc
T = TypeVar("T")
Handler = Callable[["RunContext"], Any]  # a job's handler: given the run's context; async or not
#: What ``on_failure`` is given: the final record of a run that failed for good (or of each failed attempt).
FailureHook = Callable[["RunRecord"], object]
H = TypeVar("H", bound=Handler)  # a handler, as declared: the decorators give it back unchanged
DurationLike = Union[int, float, _dt.timedelta, str]
PathLike = Union[str, "os.PathLike[str]"]
Zone = Union[None, str, _dt.tzinfo]  # an IANA name or a tzinfo; None: the local zone
When = Union[_dt.datetime, str, int, float]  # a one-shot job's time: see ``Scheduler.at``


class JobOptions(TypedDict, total=False):
    """The options every kind of job takes, as keywords (the README's table says what each does):
    a type checker refuses a misspelt one."""

    # (``Optional`` and ``Union``, not ``|``: ``typing.get_type_hints`` reads them on Python 3.9)
    timeout: Optional[DurationLike]  # noqa: UP045
    overlap: Union[Literal["skip", "allow"], int]  # noqa: UP007
    lease: DurationLike
    retries: int
    retry_delay: DurationLike
    max_attempts: int
    grace: DurationLike
    catch_up: Optional[DurationLike]  # noqa: UP045
    jitter: Optional[DurationLike]  # noqa: UP045
    on_failure: Optional[FailureHook]  # noqa: UP045
    on_failure_every_attempt: bool


#: Whether a write tells the others: always, or by its result. ``_NOW`` also says that a run was
#: handed over, to be claimed now, which a store that can say so has read at once (not coalesced);
#: ``_ASKED``, that another process asks every process to act on it (a trigger, a cancel, a pause, a
#: resume), which is read soon (``_ASKED_GAP``). (PostgreSQL: the payload. SQLite: both touch the
#: file's times, ``_FileWatch``, read soon; a hand-over is also told at once when the process that
#: stops closes its liveness socket, after the last of its runs is handed over.)
_Telling = Union[bool, str, Callable[[T], Union[bool, str]]]
_NOW = "now"
_ASKED = "asked"


###############################################################################
# Errors ######################################################################
###############################################################################


def _safe_text(value: object, limit: int | None = None) -> str:
    """``value`` as text that every store, log, terminal and JSON takes, whatever it is: a ``str``
    subclass is read as a plain ``str`` (its own methods may raise), an object whose ``str()``
    raises is named by its type, a lone surrogate (a file name that is not UTF-8) and NUL (which
    PostgreSQL's text refuses) become backslash escapes. Keeps the last ``limit`` characters. Never
    raises."""
    try:
        text = str.__str__(value) if isinstance(value, str) else str(value)
        text = str.__str__(text)  # (``__str__`` may return a ``str`` subclass, whose methods may raise)
    except BaseException:  # noqa: BLE001 - any text at all beats an attempt without an end
        text = f"<{_type_name(value)} whose str() raised>"
    if limit is not None:
        text = text[-limit:]
    if text.isascii():
        return text.replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def _first_line(exc: BaseException, otherwise: str) -> str:
    """The first line of an exception's text (a driver's error can run to several), or ``otherwise``."""
    text = _safe_text(exc).strip()
    return text.splitlines()[0] if text else otherwise


def _type_name(value: object) -> str:
    try:
        return str.__str__(type(value).__name__)
    except BaseException:  # noqa: BLE001 - a metaclass's name that raises
        return "object"


_ERROR_CHARS = 2000  # the end of a failure's text that its record keeps
_OUTPUT_CHARS = 4096  # the end of a handler's result (or a command's output) that its record keeps


class AnarchonError(Exception):
    """Base class of the errors this module raises for bad input or a broken store."""


class ConfigError(AnarchonError, ValueError):
    """A declaration or an argument is wrong. ``job`` and ``option`` name what, when known."""

    def __init__(self, message: str, *, job: str | None = None, option: str | None = None):
        where = ", ".join(
            part for part in (f"job {job!r}" if job else "", f"option {option!r}" if option else "") if part
        )
        super().__init__(f"{where}: {message}" if where else message)
        self.job = job
        self.option = option


class JobNotFound(ConfigError):
    """No job of that name is in the database (or declared, for ``upcoming``): a web app's 404."""


class StoreError(AnarchonError):
    """The database cannot be used. ``path`` names it (a file, or a URL without its password); the
    message says why. ``transient`` when it may pass by itself (a connection to a server lost)."""

    def __init__(self, path: str, message: str, *, transient: bool = False):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.transient = transient


class _WouldWait(BaseException):
    """A store call made on the event loop's thread would wait here (``_Store.run_on_loop``); a
    ``BaseException``, so that no ``except Exception`` in the call takes it for the call's fault."""


class _Refused(StoreError):
    """A file this process may not act on (another user's, or not an anarchon_lite database)."""


class HandlerEscaped(Exception):
    """A handler raised a ``BaseException`` that is not one of the library's aborts (``SystemExit``,
    ``KeyboardInterrupt``...), or ``StopIteration``: the attempt is ``failed`` and the process goes
    on. ``exception`` is what the handler raised."""

    def __init__(self, exception: BaseException):
        super().__init__(
            f"{_type_name(exception)}: {_safe_text(exception)} (raised by the handler; the process carried on)"
        )
        self.exception = exception


class _PlainFailure(Exception):
    """A failure whose message says it all (a command's exit code): its run's record and log line
    carry the message alone, without the library's traceback."""


class Aborted(BaseException):
    """Why a cancellation token was aborted.

    It derives from ``BaseException`` so that a batch loop's ``except Exception:`` that logs and
    carries on does not swallow a shutdown, a lost lease or a cancel (asyncio's ``CancelledError``
    made the same move). ``RunTimeout`` is the exception: it is also a ``TimeoutError``.
    """


class Shutdown(Aborted):
    """The process is stopping (a deploy, SIGTERM, ``Scheduler.stop()``): the run is handed over."""


class RunTimeout(Aborted, TimeoutError):
    """The attempt ran past its ``timeout``. Also a ``TimeoutError`` (hence an ``OSError``)."""


class LeaseLost(Aborted):
    """Another attempt took the run over; nothing this attempt writes lands any more."""


class Cancelled(Aborted):
    """The run was cancelled by hand (``Scheduler.cancel()``)."""


###############################################################################
# Durations and clocks ########################################################
###############################################################################

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_MAX_DURATION = 100 * 365 * 86400.0  # 100 years: every instant a schedule reaches stays a datetime
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)(?![a-z])")


def parse_duration(
    value: DurationLike, *, job: str | None = None, option: str | None = None, allow_zero: bool = False
) -> float:
    """Return a duration in seconds from seconds, a ``timedelta`` or a string such as ``"1h30m"``.

    Units: ``ms``, ``s``, ``m``, ``h``, ``d``, ``w``. Negative and malformed durations, zero unless
    ``allow_zero``, and durations over 100 years (``36500d``) raise ``ConfigError`` naming ``job`` and
    ``option``.
    """
    if isinstance(value, bool):
        raise ConfigError(f"duration must be a number, timedelta or string, not {value!r}", job=job, option=option)
    if isinstance(value, _dt.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        read = _duration_text(value)
        if read is None:
            raise ConfigError(
                f"cannot read duration {value!r}: use a number with a unit ms, s, m, h, d or w, such as '1h30m'",
                job=job,
                option=option,
            )
        seconds = read
    else:
        raise ConfigError(f"duration must be a number, timedelta or string, not {value!r}", job=job, option=option)
    if not (seconds >= 0 if allow_zero else seconds > 0):
        must = "must not be negative" if allow_zero else "must be positive"
        raise ConfigError(f"duration {must}, got {value!r}", job=job, option=option)
    if seconds > _MAX_DURATION:
        raise ConfigError(f"duration {value!r} is too long: at most 100 years (36500d)", job=job, option=option)
    return seconds


@functools.lru_cache(maxsize=1024)  # (10,000 jobs declared with the same few durations)
def _duration_text(text: str) -> float | None:
    """The seconds ``text`` says, or None if it cannot be read."""
    compact = text.strip().lower()
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(compact):
        if match.start() != pos and compact[pos : match.start()].strip():
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if not compact or compact[pos:].strip():
        return None
    return total


def format_duration(seconds: float) -> str:
    """Return ``seconds`` in the compact form that ``parse_duration`` reads, e.g. ``"1h30m"``."""
    ms = round(seconds * 1000)
    parts = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        if ms >= size:
            parts.append(f"{ms // size}{unit}")
            ms %= size
    return "".join(parts) or "0ms"


def _elapsed(seconds: float) -> str:
    """How long a run took, as people read it: ``0.25s``, ``3.52s``, ``42.1s``, ``12m5s``."""
    if seconds < 10:
        return f"{seconds:.2f}s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    return format_duration(round(seconds))


class Clock:
    """Where the scheduler reads time. Subclass it in tests to move time by hand.

    ``time()`` is wall-clock seconds since the Unix epoch; ``monotonic()`` never goes back and, on
    one host, is the same clock in every process (Linux ``CLOCK_MONOTONIC``), so leases compare
    across processes whatever the wall clock does.
    """

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


SystemClock = Clock


def _pause(seconds: float) -> None:
    """Sleep, in a thread of the store. Not ``time.sleep``: from Python 3.11 on it sleeps until an
    instant of the monotonic clock (``clock_nanosleep`` with ``TIMER_ABSTIME``), which libfaketime
    with ``FAKETIME_DONT_FAKE_MONOTONIC`` (a wrong wall clock, the way a box that boots without one is
    tried) refuses with ``EINVAL``; a relative timeout in ``select`` sleeps the same everywhere."""
    select.select((), (), (), max(seconds, 0.0))


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _utc_from_ms(ms: int) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(ms / 1000, _UTC)


def _ms_from_dt(moment: _dt.datetime) -> int:
    delta = moment - _dt.datetime(1970, 1, 1, tzinfo=_UTC)
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


###############################################################################
# Cancellation ################################################################
###############################################################################


class CancelToken:
    """A cancellation token, as JavaScript's ``AbortSignal`` or .NET's ``CancellationToken``.

    It is aborted at most once: the first reason wins and a later ``abort`` does nothing. Every
    method is safe from any thread; callbacks run outside the token's lock, in the thread that
    aborts, and a callback registered after the abort runs at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: BaseException | None = None
        self._callbacks: dict[int, Callable[[BaseException], object]] = {}
        self._next_id = 0
        self._detach: Callable[[], None] | None = None

    @property
    def aborted(self) -> bool:
        """Whether the token has been aborted."""
        return self._reason is not None

    @property
    def reason(self) -> BaseException | None:
        """The exception the token was aborted with, or ``None``."""
        return self._reason

    def abort(self, reason: BaseException | None = None) -> bool:
        """Abort with ``reason`` (default ``Cancelled()``); return whether this call did it."""
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = reason if reason is not None else Cancelled("aborted")
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
            detach, self._detach = self._detach, None
        if detach is not None:
            detach()
        for callback in callbacks:
            _call_quietly(callback, self._reason)
        return True

    def throw_if_aborted(self) -> None:
        """Raise the reason if the token is aborted; else do nothing."""
        reason = self._reason
        if reason is not None:
            raise reason

    def on_abort(self, callback: Callable[[BaseException], object]) -> Callable[[], None]:
        """Call ``callback(reason)`` on abort (at once if already aborted); return a remover."""
        with self._lock:
            if self._reason is None:
                key = self._next_id
                self._next_id += 1
                self._callbacks[key] = callback
                return functools.partial(self._remove, key)
        _call_quietly(callback, self._reason)
        return _nothing

    def _remove(self, key: int) -> None:
        with self._lock:
            self._callbacks.pop(key, None)

    def child(self) -> CancelToken:
        """A token that aborts with this one (same reason); it unregisters once aborted itself."""
        token = CancelToken()
        remove = self.on_abort(token.abort)
        with token._lock:
            if token._reason is None:
                token._detach = remove
                return token
        remove()
        return token

    @classmethod
    def after(cls, delay: DurationLike, reason: BaseException | None = None) -> CancelToken:
        """A token that aborts by itself after ``delay`` (default reason ``RunTimeout``)."""
        seconds = parse_duration(delay, option="delay")
        token = cls()
        timer = threading.Timer(
            seconds, token.abort, [reason or RunTimeout(f"timed out after {format_duration(seconds)}")]
        )
        timer.daemon = True
        token.on_abort(lambda _reason: timer.cancel())
        timer.start()
        return token

    async def wait(self) -> BaseException:
        """Return the reason once the token is aborted."""
        if self._reason is not None:
            return self._reason
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        remove = self.on_abort(lambda _r: loop.call_soon_threadsafe(_resolve, future))
        try:
            await future
        finally:
            remove()
        assert self._reason is not None
        return self._reason

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``; raise the reason at once if the token aborts meanwhile."""
        self.throw_if_aborted()
        waiter = asyncio.ensure_future(self.wait())
        try:
            await asyncio.wait({waiter}, timeout=max(0.0, seconds))
        finally:
            waiter.cancel()
        self.throw_if_aborted()

    def sleep_sync(self, seconds: float) -> None:
        """Blocking form of ``sleep`` for worker threads."""
        event = threading.Event()
        remove = self.on_abort(lambda _r: event.set())
        try:
            event.wait(max(0.0, seconds))
        finally:
            remove()
        self.throw_if_aborted()

    async def run(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable``; if the token aborts first, cancel it and raise the reason instead."""
        self.throw_if_aborted()
        task = asyncio.ensure_future(awaitable)
        waiter = asyncio.ensure_future(self.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            self.throw_if_aborted()
        return task.result()


def _false() -> bool:
    return False


def _ignore(_value: object) -> None:
    pass


def _nothing() -> None:
    return None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _call_quietly(callback: Callable[[BaseException], object], reason: BaseException) -> None:
    try:
        callback(reason)
    except Exception:  # noqa: BLE001 - one failing callback must not stop the others
        _log.exception("cancellation callback %r failed", callback)


###############################################################################
# Schedules ###################################################################
###############################################################################
#
# A schedule is pure: ``next_after(ms)`` gives the first occurrence strictly after an instant, as
# integer Unix epoch milliseconds, or None when the schedule has no more. Calendar schedules (cron,
# rrule) work on naive local times in their zone and then map each local time to instants with one
# of two daylight-saving rules: "elapsed" (a local time in a gap does not exist, a repeated one
# happens twice) or "wall" (a time in a gap fires at the first instant after it, a repeated one
# fires once, the first time).

_MINUTE = _dt.timedelta(minutes=1)
_DST_REACH = _dt.timedelta(hours=3)  # wider than any daylight-saving shift in the tz database


class _Schedule:
    description = ""

    def next_after(self, after_ms: int) -> int | None:
        raise NotImplementedError

    def watermark(self, now_ms: int) -> int:
        """The watermark of a job new to the store, declared at ``now_ms``: its occurrences come after it."""
        return now_ms

    def start_of(self, slot: int) -> int:
        """When the occurrence ``slot`` starts: at its time, unless a delay is added (``_Jittered``)."""
        return slot

    @property
    def plain(self) -> _Schedule:
        """The schedule without the delay of its starts."""
        return self

    def following(self, after_ms: int, count: int) -> list[_dt.datetime]:
        """The next ``count`` occurrences strictly after ``after_ms`` (fewer if the schedule ends), in UTC."""
        found: list[_dt.datetime] = []
        cursor = self.next_after(after_ms)
        while cursor is not None and len(found) < count:
            found.append(_utc_from_ms(cursor))
            cursor = self.next_after(cursor)
        return found


class _Every(_Schedule):
    def __init__(self, interval: float, offset: float):
        self.interval = max(1, round(interval * 1000))
        self.offset = round(offset * 1000) % self.interval
        self.description = f"every {format_duration(interval)}" + (
            f" offset {format_duration(offset)}" if offset else ""
        )

    def next_after(self, after_ms: int) -> int | None:
        steps = (after_ms - self.offset) // self.interval + 1
        return steps * self.interval + self.offset


class _OnStart(_Schedule):
    """Runs once when a group of scheduler processes starts on a file (no other one running), never
    on a clock: ``@reboot`` in a crontab."""

    description = "@reboot"

    def next_after(self, after_ms: int) -> int | None:
        return None


class _At(_Schedule):
    """One occurrence, at ``when`` (ms), and then none: a one-shot job. A job new to the store
    starts just before it when it is already past, so that it is found late and recorded (run if on
    time or within ``catch_up``, else ``missed``), never silently dropped."""

    def __init__(self, when: int):
        self.when = when
        self.description = f"at {_utc_from_ms(when).isoformat(timespec='milliseconds').replace('+00:00', 'Z')}"

    def next_after(self, after_ms: int) -> int | None:
        return self.when if after_ms < self.when else None

    def watermark(self, now_ms: int) -> int:
        return min(now_ms, self.when - 1)


def _at_time(when: object, zone: _dt.tzinfo, job: str) -> int:
    """A one-shot job's time as ms: an aware ``datetime``, a naive one or an ISO 8601 string in
    ``zone`` (so ``at("x", "2026-12-24 18:00")`` is 18:00 where the job's ``tz`` says), or Unix
    epoch seconds."""
    moment = when
    if isinstance(when, str):
        try:
            moment = _dt.datetime.fromisoformat(when.strip().replace("Z", "+00:00"))
        except ValueError:
            raise ConfigError(
                f"must be an ISO 8601 time such as '2026-12-24T18:00', not {when!r}", job=job, option="when"
            ) from None
    if isinstance(moment, _dt.datetime):
        return _ms_from_dt(moment if moment.tzinfo else moment.replace(tzinfo=zone))
    if isinstance(moment, (int, float)) and not isinstance(moment, bool) and math.isfinite(moment):
        return _ms(moment)
    raise ConfigError(f"must be a datetime, an ISO 8601 string or epoch seconds, not {when!r}", job=job, option="when")


class _Jittered(_Schedule):
    """Another schedule whose occurrences each start up to ``jitter`` later (systemd's
    ``RandomizedDelaySec=``), by a delay that every process computes alike from the job's name and
    the slot: the slot stays the occurrence's key, so the once-only claim is unchanged, and only
    the start moves. A delay never reaches the next occurrence (it is scaled to the gap when the
    gap is shorter than ``jitter``): occurrences start in the order of their slots."""

    def __init__(self, inner: _Schedule, jitter: float, job: str):
        self.inner = inner
        self.jitter = max(1, round(jitter * 1000))  #: the longest delay, milliseconds
        self._salt = job.encode()
        self.description = f"{inner.description} jitter {format_duration(jitter)}"

    @property
    def plain(self) -> _Schedule:
        return self.inner

    def next_after(self, after_ms: int) -> int | None:
        return self.inner.next_after(after_ms)

    def watermark(self, now_ms: int) -> int:
        return self.inner.watermark(now_ms)

    def start_of(self, slot: int) -> int:
        following = self.inner.next_after(slot)
        most = self.jitter if following is None else min(self.jitter, following - slot)
        return slot + _jitter_ms(self._salt, slot, most)


def _hashes() -> tuple[Any, Any]:
    """SHA-256 and BLAKE2b as Python builds them in (``hashlib``'s own, without the OpenSSL
    binding that ``hashlib`` loads as well: 0.7 MB of a running scheduler's memory); ``hashlib``'s
    where a build has no such module. The digests are the same."""
    try:
        from _blake2 import blake2b
    except ImportError:
        from hashlib import blake2b
    for name in ("_sha2", "_sha256"):  # (3.12 and later; before)
        with contextlib.suppress(ImportError):
            return importlib.import_module(name).sha256, blake2b
    from hashlib import sha256

    return sha256, blake2b


_sha256, _blake2b = _hashes()


def _digest(text: str) -> str:
    """32 hex digits of the SHA-256 of ``text``: a name made of parts (a file's, a process's)."""
    return str(_sha256(text.encode()).hexdigest()[:32])


def _jitter_ms(salt: bytes, slot: int, most: int) -> int:
    """A delay in [0, ``most``) milliseconds, the same on every process for the same job (``salt``)
    and slot: a hash, not a random number, which each process would draw differently."""
    digest = _blake2b(salt + b"\0" + str(slot).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") * most >> 64


def _local_zone() -> _dt.tzinfo:
    name = os.environ.get("TZ", "").lstrip(":")
    if name:
        try:
            return zoneinfo.ZoneInfo(name)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            pass
    try:
        target = os.path.realpath("/etc/localtime")
        if "zoneinfo/" in target:
            return zoneinfo.ZoneInfo(target.split("zoneinfo/", 1)[1])
        with open("/etc/localtime", "rb") as handle:
            return zoneinfo.ZoneInfo.from_file(handle, key="localtime")
    except (OSError, ValueError, zoneinfo.ZoneInfoNotFoundError):
        return _UTC


def _zone(tz: None | str | _dt.tzinfo, job: str) -> _dt.tzinfo:
    if tz is None:
        return _local_zone()
    if isinstance(tz, _dt.tzinfo):
        return tz
    try:
        return zoneinfo.ZoneInfo(tz)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError) as exc:
        raise ConfigError(f"unknown time zone {tz!r} ({exc})", job=job, option="tz") from None


def _instants(naive: _dt.datetime, zone: _dt.tzinfo) -> list[_dt.datetime]:
    """The UTC instants at which the local time ``naive`` happens: none (gap), one or two."""
    found: list[_dt.datetime] = []
    for fold in (0, 1):
        moment = naive.replace(tzinfo=zone, fold=fold).astimezone(_UTC)
        if moment.astimezone(zone).replace(tzinfo=None) == naive and moment not in found:
            found.append(moment)
    found.sort()
    return found


def _after_gap(naive: _dt.datetime, zone: _dt.tzinfo) -> _dt.datetime:
    """The first instant after the daylight-saving gap that swallows the local time ``naive``."""
    low = naive.replace(tzinfo=zone, fold=1).astimezone(_UTC)
    high = naive.replace(tzinfo=zone, fold=0).astimezone(_UTC)
    if low > high:
        low, high = high, low
    before = low.astimezone(zone).utcoffset()
    while (high - low) > _dt.timedelta(seconds=1):
        middle = low + (high - low) / 2
        middle = middle.replace(microsecond=0)
        if middle.astimezone(zone).utcoffset() == before:
            low = middle
        else:
            high = middle
    return high


class _Calendar(_Schedule):
    """Shared mapping of naive local occurrences to instants, for cron and rrule."""

    zone: _dt.tzinfo
    elapsed: bool

    def _naive_after(self, naive: _dt.datetime) -> _dt.datetime | None:
        raise NotImplementedError

    def next_after(self, after_ms: int) -> int | None:
        after = _utc_from_ms(after_ms)
        found = self._next_elapsed(after) if self.elapsed else self._next_wall(after)
        return None if found is None else _ms_from_dt(found)

    def _local(self, moment: _dt.datetime) -> _dt.datetime:
        return moment.astimezone(self.zone).replace(tzinfo=None)

    def _near_transition(self, moment: _dt.datetime) -> bool:
        offset = moment.astimezone(self.zone).utcoffset()
        return any((moment + d).astimezone(self.zone).utcoffset() != offset for d in (-_DST_REACH, _DST_REACH))

    def _next_wall(self, after: _dt.datetime) -> _dt.datetime | None:
        naive: _dt.datetime | None = self._local(after)
        while naive is not None:
            naive = self._naive_after(naive)
            if naive is None:
                return None
            found = _instants(naive, self.zone)
            moment = found[0] if found else _after_gap(naive, self.zone)
            if moment > after:
                return moment
        return None

    def _next_elapsed(self, after: _dt.datetime) -> _dt.datetime | None:
        start = self._local(after)
        if self._near_transition(after):
            start -= _DST_REACH
        best: _dt.datetime | None = None
        naive: _dt.datetime | None = start
        while True:
            naive = self._naive_after(naive) if naive is not None else None
            if naive is None or (best is not None and naive > self._local(best) + _DST_REACH):
                return best
            for moment in _instants(naive, self.zone):
                if moment > after and (best is None or moment < best):
                    best = moment
            if best is not None and not self._near_transition(best):
                return best


_CRON_NICKNAMES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_MONTH_NAMES = {
    name: i + 1
    for i, name in enumerate(["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"])
}
_DAY_NAMES = {name: i for i, name in enumerate(["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"])}
_CRON_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, _MONTH_NAMES),
    ("day of week", 0, 7, _DAY_NAMES),
)


_DIGITS = re.compile(r"[0-9]+\Z")  # str.isdigit() takes "²", which int() refuses


@functools.lru_cache(maxsize=4096)  # (thousands of jobs declared with the same fields)
def _cron_values(text: str, index: int) -> tuple[int, ...]:
    """The values of cron field ``index`` written ``text``; ValueError says what is wrong."""
    name, low, high, names = _CRON_FIELDS[index]

    def number(token: str) -> int:
        value = names.get(token.upper()) if names else None
        if value is None:
            if not _DIGITS.match(token):
                raise ValueError(f"cron {name} field: {token!r} is not a number or name")
            value = int(token)
        if not low <= value <= high:
            raise ValueError(f"cron {name} field: {value} is outside {low}-{high}")
        return value

    values: set[int] = set()
    for item in text.split(","):
        body, _, step_text = item.partition("/")
        step = 1
        if step_text:
            if not _DIGITS.match(step_text) or int(step_text) == 0:
                raise ValueError(f"cron {name} field: bad step in {item!r}")
            step = int(step_text)
        if body == "*":
            first, last = low, high
        elif "-" in body:
            a, _, b = body.partition("-")
            first, last = number(a), number(b)
            if index == 4 and b.upper() == "SUN":
                last = 7  # as cronie reads it: MON-SUN, FRI-SUN (Sunday as 7 at a range's end)
            if first > last:
                raise ValueError(f"cron {name} field: range {item!r} runs backwards")
        elif body:
            first = number(body)
            last = high if step_text else first
        else:
            raise ValueError(f"cron {name} field: empty item in {text!r}")
        values.update(range(first, last + 1, step))
    if index == 4 and 7 in values:
        values.discard(7)
        values.add(0)
    return tuple(sorted(values))


class _CronFields(NamedTuple):
    minutes: list[int]
    hours: list[int]
    days: set[int]
    months: set[int]
    weekdays: set[int]
    dom_star: bool  # the day-of-month field starts with ``*`` (cron's rule for both day fields)
    dow_star: bool
    elapsed: bool  # the minute or hour field starts with ``*``: it follows elapsed time over DST


@functools.lru_cache(maxsize=4096)  # (a crontab of 10,000 jobs: each text parsed once)
def _cron_fields(text: str) -> _CronFields:
    """The fields of a 5-field cron expression; ValueError says what is wrong."""
    fields = text.split()
    if len(fields) != 5:
        raise ValueError(f"cron expression {text!r} must have 5 fields (minute hour day month weekday)")
    minutes, hours, days, months, weekdays = (list(_cron_values(f, i)) for i, f in enumerate(fields))
    parsed = _CronFields(
        minutes,
        hours,
        set(days),
        set(months),
        set(weekdays),
        fields[2].startswith("*"),
        fields[4].startswith("*"),
        fields[0].startswith("*") or fields[1].startswith("*"),
    )
    if (parsed.dom_star or parsed.dow_star) and min(days) > max(map(_month_days, months)):
        raise ValueError(f"cron expression {text!r} never fires")
    return parsed


class _Cron(_Calendar):
    def __init__(self, expr: str, zone: _dt.tzinfo, job: str):
        text = _CRON_NICKNAMES.get(expr.strip().lower(), expr.strip())
        try:
            fields = _cron_fields(text)
        except ValueError as exc:
            raise ConfigError(str(exc).replace(repr(text), repr(expr)), job=job, option="cron") from None
        self.minutes, self.hours, self.days, self.months, self.weekdays = fields[:5]
        self.dom_star, self.dow_star, self.elapsed = fields.dom_star, fields.dow_star, fields.elapsed
        self.zone = zone
        self.description = f"cron {expr.strip()} {getattr(zone, 'key', None) or zone}"

    def _day_matches(self, day: _dt.date) -> bool:
        dom = day.day in self.days
        dow = (day.weekday() + 1) % 7 in self.weekdays
        if self.dom_star or self.dow_star:
            return dom and dow
        return dom or dow

    def _naive_after(self, naive: _dt.datetime) -> _dt.datetime | None:
        moment = naive.replace(second=0, microsecond=0) + _MINUTE
        limit = moment.year + 30
        while moment.year <= limit:
            if moment.month not in self.months:
                moment = (moment.replace(day=1, hour=0, minute=0) + _dt.timedelta(days=32)).replace(day=1)
            elif not self._day_matches(moment.date()):
                moment = moment.replace(hour=0, minute=0) + _dt.timedelta(days=1)
            else:
                hour = bisect.bisect_left(self.hours, moment.hour)
                if hour == len(self.hours):
                    moment = moment.replace(hour=0, minute=0) + _dt.timedelta(days=1)
                    continue
                if self.hours[hour] != moment.hour:
                    moment = moment.replace(hour=self.hours[hour], minute=0)
                minute = bisect.bisect_left(self.minutes, moment.minute)
                if minute == len(self.minutes):
                    moment = moment.replace(minute=0) + _dt.timedelta(hours=1)
                    continue
                return moment.replace(minute=self.minutes[minute])
        return None


def _month_days(month: int) -> int:
    return 29 if month == 2 else 30 if month in (4, 6, 9, 11) else 31


_RRULE_EPOCH = _dt.datetime(2000, 1, 1)
# The unit of each of dateutil's frequencies, in their order (``rrule.YEARLY`` is 0, ``SECONDLY`` 6).
_FREQ_STEP = ("years", "months", "weeks", "days", "hours", "minutes", "seconds")
_HOURLY = 4


def _dateutil_rrule(job: str) -> Any:
    """dateutil's ``rrule`` module, imported on the first ``rrule`` schedule: the rest of the
    module works without python-dateutil (a vendored copy on a box with nothing but Python)."""
    try:
        from dateutil import rrule
    except ImportError:
        raise ConfigError(
            "rrule schedules need python-dateutil: pip install python-dateutil", job=job, option="rrule"
        ) from None
    return rrule


class _RRule(_Calendar):
    def __init__(self, rule: str | _rrule.rrule, zone: _dt.tzinfo | None, job: str):
        rrule = _dateutil_rrule(job)
        if isinstance(rule, str):
            rule = self._parse(rrule, rule, job)
        if not isinstance(rule, rrule.rrule):
            raise ConfigError(
                f"rrule must be an RFC 5545 string or a dateutil rrule, not {rule!r}", job=job, option="rrule"
            )
        rule = cast("_rrule.rrule", rule)
        start: _dt.datetime = rule._dtstart  # type: ignore[attr-defined]
        self.zone = zone or start.tzinfo or _local_zone()
        replace: dict[str, Any] = {
            "dtstart": start.astimezone(self.zone).replace(tzinfo=None) if start.tzinfo else start
        }
        until = rule._until  # type: ignore[attr-defined]
        if until is not None and until.tzinfo is not None:
            replace["until"] = until.astimezone(self.zone).replace(tzinfo=None)
        self.rule: _rrule.rrule = rule.replace(**replace)
        self.freq: int = rule._freq  # type: ignore[attr-defined]
        self.interval: int = rule._interval  # type: ignore[attr-defined]
        self.elapsed = self.freq >= _HOURLY
        self.description = f"rrule {_rule_text(self.rule)} {getattr(self.zone, 'key', None) or self.zone}"
        self._shifted: tuple[_dt.datetime, _rrule.rrule] | None = None

    @staticmethod
    def _parse(rrule: Any, text: str, job: str) -> _rrule.rrule:
        def refused(why: str) -> ConfigError:
            return ConfigError(f"rrule {text!r}{why}", job=job, option="rrule")

        upper = text.upper()
        if "FREQ=" not in upper:
            raise refused(" has no FREQ")
        if "DTSTART" not in upper and re.search(r"\bCOUNT=", upper):
            raise refused(
                " has a COUNT and no DTSTART: it would count from 2000-01-01, long done; "
                "give a DTSTART line, or an UNTIL"
            )
        try:
            parsed = rrule.rrulestr(text.strip(), dtstart=_RRULE_EPOCH)
        except (ValueError, TypeError) as exc:
            if "DTSTART" not in upper and re.search(r"\bUNTIL=[0-9T]+Z", upper):
                raise refused(
                    ": an UNTIL in UTC (ending in Z) needs a DTSTART with a zone; "
                    "write UNTIL without the Z (in the job's zone) or give a DTSTART"
                ) from None
            raise ConfigError(f"cannot read rrule {text!r}: {exc}", job=job, option="rrule") from None
        if not isinstance(parsed, rrule.rrule):
            raise refused(": only one RRULE (with an optional DTSTART) is supported")
        return cast("_rrule.rrule", parsed)

    def _rule_near(self, naive: _dt.datetime) -> _rrule.rrule:
        """The rule with its start moved forward by whole intervals, to just before ``naive``.

        dateutil iterates from DTSTART; moving the start by whole intervals keeps every later
        occurrence and keeps ``after()`` fast however old the start is.
        """
        start: _dt.datetime = self.rule._dtstart  # type: ignore[attr-defined]
        if self.rule._count is not None or naive <= start:  # type: ignore[attr-defined]
            return self.rule
        unit = _FREQ_STEP[self.freq]
        period = _steps(unit, self.interval)
        target = naive - period - period
        if target <= start:
            return self.rule
        if unit in ("years", "months"):
            from dateutil.relativedelta import relativedelta

            delta = relativedelta(target, start)
            whole = delta.years if unit == "years" else delta.years * 12 + delta.months
        else:
            size = {"weeks": 604800, "days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}[unit]
            whole = int((target - start).total_seconds() // size)
        moved = start + _steps(unit, whole // self.interval * self.interval)
        if unit in ("years", "months") and moved.day != start.day:  # a month without that day
            return self.rule
        if self._shifted is None or self._shifted[0] != moved:
            self._shifted = (moved, self.rule.replace(dtstart=moved))
        return self._shifted[1]

    def _naive_after(self, naive: _dt.datetime) -> _dt.datetime | None:
        found: _dt.datetime | None = self._rule_near(naive).after(naive, inc=False)
        return found


def _steps(unit: str, count: int) -> relativedelta:
    from dateutil.relativedelta import relativedelta

    size: dict[str, Any] = {unit: count}
    return relativedelta(**size)


def _rule_text(rule: _rrule.rrule) -> str:
    return str(rule).split("\n")[-1].replace("RRULE:", "")


# What a stored description adds after the schedule: its jitter, and an overlap that is a number.
_DESCRIBED_OPTIONS = re.compile(r"^(.*?)(?: jitter (\S+))?(?: overlap ([0-9]+))?\Z")


def _described(description: str) -> tuple[str, str | None, int | None]:
    """A stored description (``every 1h jitter 30s overlap 3``) as its schedule's own description,
    its jitter (as written) and its overlap."""
    match = _DESCRIBED_OPTIONS.match(description)
    assert match is not None, "the pattern matches any line"
    base, jitter, overlap = match.groups()
    return base, jitter, None if overlap is None else int(overlap)


def _schedule_from(description: str, job: str) -> _Schedule:
    """The schedule a stored description names (``every 1h``, ``cron 0 3 * * * UTC``, ``rrule
    FREQ=DAILY Europe/Paris``, ``@reboot``, ``at 2026-12-24T16:00:00.000Z``, each maybe with
    ``jitter 30s`` and ``overlap 3``): for the command line, which has no declarations."""
    base, jitter, _ = _described(description)
    if jitter is not None:
        return _Jittered(_schedule_from(base, job), parse_duration(jitter, job=job, option="jitter"), job)
    kind, _, rest = base.partition(" ")
    if kind == "every":
        interval, _, offset = rest.partition(" offset ")
        return _Every(
            parse_duration(interval, option="every"), parse_duration(offset, option="offset") if offset else 0.0
        )
    if kind in ("cron", "rrule"):
        text, _, zone = rest.rpartition(" ")
        return _Cron(text, _zone(zone, job), job) if kind == "cron" else _RRule(text, _zone(zone, job), job)
    if base == _OnStart.description:
        return _OnStart()
    if kind == "at":
        return _At(_at_time(rest, _UTC, job))
    raise ConfigError(f"cannot read the stored schedule {description!r}", job=job)


###############################################################################
# The store interface #########################################################
###############################################################################
#
# The records the scheduler and a store exchange, and the interface every store implements. The
# scheduler is given its ``_Backend`` (``_store_at`` makes it from the path or URL, once); past that
# it never opens a file, reads /proc or names a lease clock.


@dataclasses.dataclass(frozen=True)
class _Owner:
    """Who holds a run: the instance id and what tells whether its process still exists."""

    instance: str
    pid: int
    start: int | None
    namespace: str | None
    boot_id: str | None


class _JobRow(NamedTuple):  # (a tuple: a status of 10,000 jobs makes 10,000 of them)
    name: str
    schedule: str
    paused: int  # 1 when paused (as stored)
    last_slot: int
    next_slot: int | None
    definition: str | None = None  # what the process that last declared it otherwise declared
    declared_by: str | None = None  # that process's instance
    changed: int = 0  # the change number of the row's last write (see _SQL_NEXT_CHANGE)


class _JobStatusRow(NamedTuple):
    """A job as ``job_statuses`` reads it (a tuple: one per job)."""

    name: str
    schedule: str
    paused: int  # 1 when paused (as stored)
    last_slot: int
    next_slot: int | None
    definition: str | None
    declared_by: str | None
    undeclared: int | None  # 1 when no running process declares it; None when that cannot be told
    last_status: str | None  # the status of its newest record
    last_at: int | None  # when that record's attempt started (ms; for a record of no attempt, its slot)


@dataclasses.dataclass(frozen=True)
class _Declared:
    """A job as this process declares it, for ``register``."""

    name: str
    schedule: str  # the schedule's description
    last_slot: int  # the watermark of a job new to the file: now
    next_slot: int | None  # the first occurrence after it (or None: ``first`` gives it)
    definition: str  # the schedule, and the command of a crontab entry
    declared_by: str
    # The first occurrence after a watermark, asked only for a job new to the store (a cron
    # schedule's costs tens of microseconds: a restart of 10,000 jobs asks none).
    first: Callable[[int], int | None] | None = dataclasses.field(default=None, compare=False)
    # When it was declared or given this schedule while the scheduler ran: a schedule the store
    # holds otherwise goes on from then. (None: declared before; a schedule changed between two
    # runs of the program, a deploy, goes on from the watermark the store holds.)
    since: int | None = None


@dataclasses.dataclass(frozen=True)
class _RunRow:
    job: str
    slot: int
    attempt: int
    state: str
    not_before: int
    failures: int
    owner: str | None
    owner_pid: int | None
    owner_start: int | None
    owner_ns: str | None
    boot_id: str | None
    lease_until: float | None
    cancel: bool
    # (progress is no part of a compare-and-set: the lease board may have newer figures than the file)
    progress_done: float | None = dataclasses.field(compare=False)
    progress_total: float | None = dataclasses.field(compare=False)
    started_at: int | None
    lease: float | None = dataclasses.field(default=None, compare=False)  # the lease's length, seconds
    # Seconds the lease had left when the row was read, on the store's lease clock (not a column;
    # not part of a compare-and-set): the scheduler ages it by its own elapsed time since the read.
    lease_left: float | None = dataclasses.field(default=None, compare=False)
    # Why the owner is gone, as the store judged it at the read (a store whose ``_Changes`` cannot
    # judge it on the loop: PostgreSQL), or None.
    gone: str | None = dataclasses.field(default=None, compare=False)

    def holder(self) -> _Owner:
        return _Owner(self.owner or "", self.owner_pid or 0, self.owner_start, self.owner_ns, self.boot_id)


@dataclasses.dataclass(frozen=True)
class _Claim:
    job: str
    slot: int
    attempt: int
    failures: int = 0
    started_at: int | None = dataclasses.field(default=None, compare=False)  # ms, as its record has it


class _NotClaimed(enum.Enum):
    """What ``claim_due_many`` did for a job when it did not claim a run of it."""

    MOVED = "moved"  # another process moved the job's watermark first, or paused the job: nothing was written
    RECORDED = "recorded"  # the occurrence was recorded without running: skipped, or missed


_Claimed = Union[_Claim, _NotClaimed]


class _AfterEnd(enum.Enum):
    """What becomes of a run after an attempt ends."""

    DONE = "done"  # the run is over
    RETRY = "retry"  # another attempt, after the backoff (``not_before``)
    HANDOVER = "handover"  # another attempt at once, by any process (a shutdown)


@dataclasses.dataclass(frozen=True)
class _Due:
    """What to do with a job's due occurrences, for ``claim_due_many``."""

    job: str
    expected_last: int  # the watermark as the scheduler saw it (compare-and-set)
    slot: int  # the occurrence to run, or the newest one recorded
    next_slot: int | None
    missed: Sequence[tuple[int, str | None]]  # (slot, error) of the occurrences recorded missed
    run: bool
    overlap: int | None  # at most this many runs of the job unfinished, this one included (None: no limit)
    lease: float  # seconds; the store stamps its expiry on its own clock
    missed_count: int = 0  # how many occurrences were missed in all (``missed`` keeps at most 100)


@dataclasses.dataclass(frozen=True)
class _End:
    """How an attempt ended, for ``finish_many``."""

    claim: _Claim
    status: str
    error: str | None
    now_ms: int
    then: _AfterEnd = _AfterEnd.DONE
    not_before: int = 0
    output: str | None = None

    def __post_init__(self) -> None:  # one end's text never fails a batch of ends (``_safe_text``)
        for name, limit in (("error", _ERROR_CHARS), ("output", _OUTPUT_CHARS)):
            text = getattr(self, name)
            if text is not None:
                object.__setattr__(self, name, _safe_text(text, limit))


# The statuses a record ends with (``running`` is an attempt's record until its end is written).
_ENDED = ("succeeded", "failed", "timed_out", "interrupted", "cancelled", "skipped", "missed")


class _JobFigures(NamedTuple):
    """What the history says of one job, for metrics: records by ending status (those pruned
    included), its newest start, success and failure (ms), its newest attempt's duration (ms) and
    how many of its attempts run now."""

    job: str
    records: dict[str, int]
    started: int | None
    succeeded: int | None
    failed: int | None  # (failed or timed out)
    duration: int | None
    running: int


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """A scheduler process running on the store, as ``processes()`` reports it."""

    instance: str
    pid: int | None
    host: str | None
    started_at: _dt.datetime
    jobs: int | None  # how many jobs it declares (None: a process of an older version, which does not say)


class _Stretch(NamedTuple):
    """Records of one job and status close together in time, as the status page's timeline draws
    them: how many, from the first one's start to the last one's end."""

    job: str
    status: str
    records: int
    start_ms: int
    end_ms: int
    attempt: int  # the highest among them
    instance: str | None  # one of the processes that ran them


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One history record: an attempt, or an occurrence that was skipped or missed (attempt 0)."""

    job: str
    slot: int
    attempt: int
    status: str
    instance: str | None
    started_at: _dt.datetime | None
    finished_at: _dt.datetime | None
    error: str | None
    output: str | None = None  # what the handler returned, if a string (the last 4 KiB)

    @property
    def scheduled_at(self) -> _dt.datetime:
        return _utc_from_ms(self.slot)


def _dt_or_none(ms: int | None) -> _dt.datetime | None:
    return None if ms is None else _utc_from_ms(ms)


class _Store(abc.ABC):
    """The state every process of a group shares, behind the one interface the scheduler calls.

    Each method is one transaction, atomic against every other process: it happens whole or not at
    all. Every write of an attempt (its checkpoints, its progress, its end) checks in that same
    transaction that the attempt still holds its run (the fence), and does nothing if not. Leases
    are stamped and compared on the store's own clock: the scheduler passes durations. A store
    object belongs to one thread at a time and never crosses a ``fork()``; failures raise
    ``StoreError`` naming where the state lives, and change nothing.
    """

    retention = 1000  # history records kept per job
    backlog: frozenset[str] = frozenset()  #: jobs whose last prune stopped at its bound, records left
    shrink = False  #: a backlog was pruned: the file's free pages may be given back (``tidy``)
    on_loop = False  #: a call runs on the event loop's thread (``run_on_loop``)
    wrote = False  #: that call committed a change (it can no longer be made again from its start)

    @property
    def waitless(self) -> bool:
        """Whether a call may run on the event loop's thread now (``run_on_loop``): where it would
        wait for another process, or for the disk, it can stop instead. No store says so unless it
        knows."""
        return False

    def run_on_loop(self, call: Callable[[], T]) -> T:
        """``call()`` (a call of this store's) on the event loop's thread, which must not wait: where
        the store would wait for another process before the call committed anything, ``_WouldWait``
        is raised instead, and the caller makes the call again from its start on the store's thread."""
        self.on_loop, self.wrote = True, False
        try:
            return call()
        finally:
            self.on_loop = False

    def _would_wait(self) -> None:
        """Called where the store is about to wait for another process (see ``run_on_loop``)."""
        if self.on_loop and not self.wrote:
            raise _WouldWait

    @property
    def untidy(self) -> bool:
        """Whether ``tidy`` has work (read from any thread: a hint)."""
        return bool(self.backlog) or self.shrink

    # -- jobs

    @abc.abstractmethod
    def register(self, jobs: Sequence[_Declared]) -> list[_JobRow]:
        """Add the jobs not yet known, with their watermark (now: nothing earlier counts as missed);
        update the others' schedule text and definition, and their next occurrence if the schedule
        changed. Returns the rows, as they were, of jobs another process had declared differently."""

    @abc.abstractmethod
    def jobs(self, since: int = -1) -> list[_JobRow]:
        """The jobs whose rows changed after the change number ``since`` (every job by default),
        ordered by name. Change numbers grow in the order the writes commit, so a reader that keeps the
        newest number it read and passes it next time misses no change (a row that is deleted is
        not reported)."""

    def job(self, name: str) -> _JobRow | None:
        """The job ``name``, or None."""
        return next((row for row in self.jobs() if row.name == name), None)

    @abc.abstractmethod
    def newest_slot(self) -> int | None:
        """The newest occurrence recorded for any job (a clock earlier than this is unset)."""

    @abc.abstractmethod
    def set_paused(self, name: str, paused: bool, now_ms: int) -> bool:
        """Pause or resume on every process; resuming moves the watermark to now (a pause is not
        downtime). False if there is no such job."""

    # -- runs

    @abc.abstractmethod
    def runs(self) -> list[_RunRow]:
        """The unfinished runs, each with the seconds its lease had left when read (``lease_left``)."""

    @abc.abstractmethod
    def claim_due_many(self, owner: str, now_ms: int, due: Sequence[_Due]) -> list[_Claimed]:
        """For each job, record its due occurrences up to ``slot`` and claim ``slot`` for ``owner``,
        all in one transaction. Per job a compare-and-set on its watermark: ``MOVED`` when another
        process moved it first (nothing written for that job), ``RECORDED`` when the occurrence was
        recorded without running (skipped because an earlier run is unfinished, or missed), else the
        claim of attempt 1."""

    @abc.abstractmethod
    def end_and_claim(
        self, owner: str, now_ms: int, ends: Sequence[_End], due: Sequence[_Due]
    ) -> tuple[list[bool], list[_Claimed]]:
        """``finish_many(owner, ends)`` then ``claim_due_many(owner, now_ms, due)``, in one
        transaction; both answers."""

    def claim_due(self, owner: str, now_ms: int, due: _Due) -> _Claimed:
        """``claim_due_many`` for one job."""
        return self.claim_due_many(owner, now_ms, [due])[0]

    @abc.abstractmethod
    def claim(
        self,
        expected: _RunRow,
        owner: str,
        lease: float,
        now_ms: int,
        max_attempts: int,
        overlap: int | None,
        reason: str = "",
        owner_gone: bool = False,
    ) -> _Claim | RunRecord | None:
        """Claim a pending run, or take over a running one whose owner is gone or whose lease ran
        out (``reason`` says why; ``owner_gone``: the owner is known to have ended, so its lease no
        longer counts), for ``lease`` seconds. A compare-and-set on the whole row as the caller saw
        it: if the owner renewed (in the row, or where else the store keeps leases), or another
        process claimed first, nothing is written and None returned. A takeover records the previous
        attempt ``interrupted``; a cancelled run ends ``cancelled``; past ``max_attempts`` the run is
        ``failed`` for good, and its final record is returned (the caller, alone among the
        processes, tells of the failure); an occurrence that has not started while ``overlap`` other
        runs of the job are unfinished is ``skipped`` (the count and the claim are one transaction)."""

    @abc.abstractmethod
    def owner_gone(self, run: _RunRow) -> str | None:
        """Why the process holding ``run`` no longer exists, or None when it may be alive (then only
        its lease decides). Cheap enough to ask for every run at every look."""

    # -- an attempt's writes (fenced)

    @abc.abstractmethod
    def renew_all(self, owner: str, claims: Sequence[_Claim]) -> list[_Claim]:
        """Extend the leases of ``claims`` by each run's lease from now, at once; return those that
        no longer hold their run."""

    @abc.abstractmethod
    def report_progress(self, claim: _Claim, owner: str, progress: tuple[float | None, float | None]) -> None:
        """Record the attempt's progress (done, total), fenced."""

    @abc.abstractmethod
    def set_process_group(self, claim: _Claim, owner: str, group: str) -> bool:
        """Record, fenced, the process group the attempt started (JSON), so that a later attempt of
        the run can make sure it is gone first. Returns whether it was written."""

    @abc.abstractmethod
    def process_group(self, job: str, slot: int) -> str | None:
        """The process group last recorded by an attempt of (job, slot), or None."""

    @abc.abstractmethod
    def finish_many(self, owner: str, ends: Sequence[_End]) -> list[bool]:
        """End attempts of ``owner``, in one transaction. Each is fenced: False (nothing written)
        if the attempt no longer holds its run; True, written, by this call alone (so a written
        ``DONE`` end of a failed or timed-out attempt is the one that made the run failed for good:
        its caller tells of it). ``DONE`` deletes the run (and prunes the job's
        history to ``retention`` records, never an unfinished run's); ``RETRY`` and ``HANDOVER`` leave
        it pending, claimable from ``not_before``. The attempt's record becomes the job's newest."""

    def finish(self, owner: str, end: _End) -> bool:
        """``finish_many`` for one attempt."""
        return self.finish_many(owner, [end])[0]

    # -- requests from any process

    @abc.abstractmethod
    def trigger(self, job: str, now_ms: int) -> int:
        """Record a run of ``job`` due now; return its slot (now, or the next free millisecond).
        ``ConfigError`` if there is no such job."""

    @abc.abstractmethod
    def cancel(self, job: str, now_ms: int) -> int:
        """Ask every unfinished run of ``job`` to stop; pending ones end ``cancelled`` at once.
        Returns how many runs were asked."""

    # -- running processes

    @abc.abstractmethod
    def join(self, instance: str, now_ms: int, declares: Sequence[str]) -> bool:
        """Record this process (as ``instance``) as running and declaring the jobs ``declares``
        (again: after its declarations changed), and forget those that are gone; True if no other
        one is running: the start of a group of processes (what ``@reboot`` runs on)."""

    @abc.abstractmethod
    def leave(self, instance: str) -> None:
        """Forget this process and its declarations (it stops)."""

    @abc.abstractmethod
    def processes(self) -> list[ProcessInfo]:
        """The processes running on the store, those known to be gone left out."""

    @abc.abstractmethod
    def peers(self) -> dict[str, frozenset[str]]:
        """The processes running on the store (those known to be gone left out), each with the jobs
        it declares (none for a process of an older version, which does not say)."""

    @abc.abstractmethod
    def undeclared(self, job: str | None = None) -> list[str] | None:
        """The jobs (of every job, or only ``job``) that no running process declares; None when
        that cannot be told: no process runs, or one of an older version does (it records no
        declarations)."""

    @abc.abstractmethod
    def job_statuses(self, since: int = -1) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """Every job, by name, as its marks: ``(name, changed, undeclared, last_status,
        last_at)``, whether a running process declares it and its newest record; and the rows
        ``(name, schedule, paused, last_slot, next_slot, definition, declared_by, changed)`` of
        the jobs changed since the change number ``since`` (every job's with -1, read with the
        marks in one statement). Tuples as read (``status`` makes a ``_JobStatusRow`` only of a
        job that differs from what it made before); ``changed`` is None on a file of a schema
        before version 7, whose rows are all given each time."""

    @abc.abstractmethod
    def forget(self, job: str) -> str | None:
        """Delete ``job``, its runs, history, checkpoints and counts, unless a running process
        declares it or it has unfinished runs: then why not (and nothing is deleted). None once
        forgotten; ``JobNotFound`` if there is no such job."""

    # -- checkpoints and history

    @abc.abstractmethod
    def checkpoint_get(self, job: str, slot: int, fence: tuple[int, str] | None = None) -> tuple[bool, str | None]:
        """(whether the attempt ``fence`` = (attempt, owner) still holds the run, the saved JSON),
        read together; with no fence the first is True."""

    @abc.abstractmethod
    def checkpoint_write(
        self, job: str, slot: int, value: str | None, now_ms: int, fence: tuple[int, str] | None
    ) -> bool:
        """Save (or, with ``value`` None, delete) the JSON checkpoint of (job, slot); with a fence,
        only while that attempt holds the run. Returns whether it was written. Visible to every
        process once it returns."""

    @abc.abstractmethod
    def history(self, job: str | None, limit: int) -> list[RunRecord]:
        """The newest ``limit`` records (of ``job``, or of every job), newest first."""

    @abc.abstractmethod
    def timeline(self, jobs: Sequence[str], since_ms: int, until_ms: int, part_ms: int) -> list[_Stretch]:
        """The records of ``jobs`` from ``since_ms`` to ``until_ms``, each job's records of one
        status in each ``part_ms`` merged into one stretch; by job, then time."""

    @abc.abstractmethod
    def figures(self) -> list[_JobFigures]:
        """Every job's figures, by name: the records of each ending status
        (counted since the job was first declared: pruning keeps the count), the newest start,
        success and failure, the newest attempt's duration, the attempts running now."""

    # -- upkeep

    @abc.abstractmethod
    def tidy(self) -> bool:
        """One bounded step of what pruning left (``untidy``): a batch of a job's records past its
        retention, or of the file's free pages given back; its own short transaction, telling no
        one. Whether more is left."""

    @abc.abstractmethod
    def maintain(self) -> None:
        """Upkeep that must not delay a renewal, done by the heartbeat thread after its rounds."""

    @abc.abstractmethod
    def connect(self) -> None:
        """Open the connection now rather than in the first call that needs it (a renewal must not
        wait for a connection to a server to be made)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of the connection; the next call opens it again."""


class _Changes(abc.ABC):
    """What the scheduler's loop asks between transactions, on the event loop's thread. The store
    calls the ``on_change`` it was given when another process may have written (``pushed``); else the
    loop looks every so often."""

    @property
    @abc.abstractmethod
    def pushed(self) -> bool:
        """Whether other processes' writes are told through ``on_change``."""

    @abc.abstractmethod
    def version(self) -> int:
        """A number that changes when another process commits (cheap: no transaction); -2 when the
        state cannot be read."""

    @abc.abstractmethod
    def lost(self) -> str | None:
        """Why the state this process was using is gone, or its claim on its runs may be (the file was
        deleted or replaced; the connection holding this process's lock was lost), as a sentence; or
        None (SQLite compares the files at once when its watch saw one of their names change, else
        every 0.25 s at most). The scheduler then aborts its attempts, calls ``reset``, closes every
        store and opens them again."""

    @abc.abstractmethod
    def owner_gone(self, run: _RunRow) -> str | None:
        """As ``_Store.owner_gone``, on the loop: it never waits for a server."""

    #: Whether ``owner_gone`` looks afresh each time it is asked (SQLite asks the kernel). If not,
    #: it answers as of the last read of the runs, and the loop reads them again to watch an owner.
    fresh_liveness = True

    #: Seconds at least between two reads after changes told by ``on_change``: where every commit of
    #: every process is told to every other (NOTIFY), busy processes would each read a hundred times
    #: a second; they learn of a change within 1 s all the same.
    coalesce = 0.0

    def recheck(self, changed: bool, written: bool, previous: float) -> float:
        """Seconds after which the loop looks again though it saw no change (0: not before its next
        wake-up), given whether ``version`` changed since the last look, whether a write was told
        (or made here) since then, and the previous answer. A file watch (inotify) reports a WAL
        write a moment before its commit is visible: after a write with no visible change, look
        again after 5, 25, 125 and 625 ms."""
        if changed:
            return 0.0
        if written:
            return 0.005
        return previous * 5 if 0 < previous < 0.5 else 0.0

    def hold(self) -> None:
        """Changes told from now on may wait for ``release`` (the loop reads no sooner anyway)."""

    def release(self) -> None:
        """Tell changes again (those held back among them)."""

    def settles_in(self, run: _RunRow) -> float:
        """Seconds until ``owner_gone`` may call ``run``'s owner gone where it does not yet (a free
        lock waiting out the owner's chance to notice it); infinity when nothing is waited for."""
        return math.inf

    def vouch_for(self, running: Callable[[], bool], lost: Callable[[str], None]) -> None:
        """Where what proves this process's claims can end unseen (a server session), keep proving
        it while ``running()`` and call ``lost(why)``, from any thread, as soon as it cannot."""

    def attempt_started(self) -> None:
        """An attempt began (``running()`` may have become true): prove the claims from now on."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Let go of the state; the next call opens it again."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop telling of changes and let go."""

    async def closed(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, for what ``close`` let go of to end (a thread of its own)."""


class _AsyncRenewal(abc.ABC):
    """Renewals made on the event loop without blocking it, for a store whose calls wait for the
    network: the loop's fallback when the heartbeat thread cannot get the GIL in time."""

    #: How long after a round's plan the loop renews if the thread has not. Less than a round trip:
    #: the two often renew side by side (a second UPDATE, harmless), but a starved thread costs
    #: only this much (a renewal 5 ms late at p50, against 7 ms at 3 ms).
    delay = 0.001

    @abc.abstractmethod
    def renew_all(self, owner: str, claims: Sequence[_Claim]) -> list[_Claim] | Awaitable[list[_Claim]]:
        """As ``_Store.renew_all``, begun at once in the calling loop callback (a task would start
        one turn of the loop later: behind a handler computing in chunks, one chunk later): its
        result when the answer came within a short wait, else an awaitable of it."""

    @abc.abstractmethod
    def connect(self) -> None:
        """Open the connection (called off the loop, from the heartbeat thread)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of the connection."""


class _Backend(abc.ABC):
    """Where the state lives: opens the store each thread of the scheduler uses, and the loop's
    ``_Changes``. Everything that depends on where the state lives is behind it."""

    where: str  #: the database as messages name it (a path; a URL without its password)
    #: Seconds between the scheduler's looks when nothing tells it of changes (``poll=``, at most 1 s).
    look_every: float = 0.5
    #: Whether the scheduler was asked to poll (``poll=``): ``on_change`` is then never called for
    #: other processes' writes, and the loop looks every ``look_every``.
    polled: bool = False

    @abc.abstractmethod
    def control_store(self) -> _Store:
        """The scheduler's own store: claims, ends, checkpoints, control; durable when a call returns."""

    @abc.abstractmethod
    def renewal_store(self) -> _Store:
        """The heartbeat thread's: renewals that wait for contention as briefly as they can."""

    @abc.abstractmethod
    def loop_renewal(self) -> _Store | _AsyncRenewal | None:
        """The event loop's fallback renewal: a store whose calls never block, or renewals awaited
        on the loop; None if there can be none."""

    @abc.abstractmethod
    def changes(
        self,
        loop: asyncio.AbstractEventLoop,
        on_change: Callable[[], None],
        instance: str,
        on_gone: Callable[[], None] | None = None,
        on_asked: Callable[[], None] | None = None,
    ) -> _Changes:
        """The loop's view of changes, for the scheduler ``instance`` of this process (open from
        before it joins until it has left); when ``polled``, ``on_change`` is never called for
        other processes' writes. A store that learns of an owner's end apart from its writes, or
        is told that a run was handed over to be claimed now, calls ``on_gone`` then
        (``on_change`` if not given): the loop looks at once, not coalesced. One told of a write
        told ``_ASKED`` calls ``on_asked`` (``on_change`` if not given): the loop reads it soon."""


###############################################################################
# Files this process trusts ###################################################
###############################################################################


# Trust (docs/database.md, "Trust model"): the files this process acts on must be its own. A database, its
# -wal and -shm, the lease board or the liveness directory that another user owns, or that users
# other than the owner may write, could make this process run, skip or record what they choose: it
# is refused, as OpenSSH's StrictModes and cron refuse such files. With ``shared_group`` (an app
# user and a deploy user in one group) a file whose group is one of this process's groups is
# trusted whoever owns it, and that group may write it; a file every user may write never is. A
# directory that holds them belongs to this user or to root (or, shared, to the group) and may be
# written by others only if it is sticky (/tmp): there only a file's owner can remove or replace it.
def _user(uid: int) -> str:
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    import grp

    try:
        return f"gid {gid} ({grp.getgrgid(gid).gr_name})"
    except KeyError:
        return f"gid {gid}"


def _distrust(status: os.stat_result, shared_group: bool, directory: bool = False) -> str | None:
    """The rule that a file (or directory) of ``status`` breaks, as the end of a sentence; None if
    this process may trust it (see above)."""
    me, mode = os.geteuid(), status.st_mode
    if directory != stat.S_ISDIR(mode) or not (directory or stat.S_ISREG(mode)):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else "a special file"
        return "is not a directory" if directory else f"is {kind}, not a regular file"
    group = shared_group and status.st_gid in {os.getegid(), *os.getgroups()}
    if status.st_uid != me and not group and not (directory and status.st_uid == 0):
        return f"is owned by {_user(status.st_uid)}, not by this process's {_user(me)}"
    if directory and mode & stat.S_ISVTX:
        return None  # (only a file's owner may remove or rename it)
    if mode & stat.S_IWOTH:
        return "may be written by every user"
    if mode & stat.S_IWGRP and not group:
        return f"may be written by its group, {_group(status.st_gid)} (shared_group=True, --shared-group, trusts it)"
    return None


def _check_trusted(path: str, what: str, status: os.stat_result, shared_group: bool, directory: bool = False) -> None:
    """Raise ``StoreError`` naming ``path`` (``what`` it is) and the rule, if it is not to be trusted."""
    rule = _distrust(status, shared_group, directory)
    if rule is not None:
        raise _Refused(path, f"{what} {rule}: refused (see docs/database.md, Trust model)")


def _what(suffix: str) -> str:
    """How a message names the database file (``""``) or the file beside it with ``suffix``."""
    return f"the database's {suffix} file" if suffix else "the database file"


def _opened(paths: Iterable[str]) -> dict[str, list[os.stat_result]] | None:
    """The files this process has open under each of ``paths`` (absolute, links resolved), as the
    open files themselves say (``/proc/self/fd``: not what the paths name now); None without /proc."""
    wanted: dict[str, list[os.stat_result]] = {path: [] for path in paths}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            if target in wanted:
                wanted[target].append(os.stat(f"/proc/self/fd/{name}"))
        except OSError:
            continue  # (closed meanwhile)
    return wanted


def _create_file(path: str, shared_group: bool) -> bool:
    """Create ``path`` empty, owner-only (with ``shared_group``, its group's too), never through a
    link planted at its name; False if it existed."""
    mode = 0o660 if shared_group else 0o600
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, mode)  # (past the umask)
    finally:
        os.close(fd)  # (a new file: this process holds no lock on it that closing would drop)
    return True


###############################################################################
# Processes on this host ######################################################
###############################################################################
#
# Whether a process still exists (``/proc``: a zombie is gone, a reused pid is told apart by its
# start time, other pid namespaces and boots are never judged by pid), the process groups of
# commands, and liveness sockets: an owner's death told by the kernel the moment it happens.


def _read_text(path: str) -> str | None:
    """A small file of ``/proc``, whatever its bytes (a process names itself as it likes), or None
    if it cannot be read. (``os.read``: half the cost of ``open``, read for every peer every 2 s.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        parts = []
        while part := os.read(fd, 4096):
            parts.append(part)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(parts).decode(errors="replace").strip()


def _process_start(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a process, from /proc; None if gone."""
    fields = _process_stat(pid)
    return None if fields is None else (fields[0], int(fields[19]))


def _process_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None if gone."""
    text = _read_text(f"/proc/{pid}/stat")
    return None if text is None else text[text.rfind(")") + 2 :].split()


def _group_record(pgid: int, me: _Owner, nonce: str) -> str:
    """What identifies a process group that this process just started: its id, the leader's start
    time (a reused pid is told apart), the boot, the pid namespace, and the nonce of the marker in
    its command's environment (JSON, kept with the run)."""
    started = _process_start(pgid)
    start = started[1] if started else None
    return json.dumps({"pgid": pgid, "start": start, "boot": me.boot_id, "ns": me.namespace, "run": nonce})


def _group_members(pgid: int) -> list[str]:
    """``pid name`` of the live processes of process group ``pgid`` (Linux: from /proc; elsewhere
    only whether there are any)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        return ["processes of another user"]
    if not os.path.isdir("/proc/self"):
        return ["processes"]
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _process_stat(int(name))
            if fields is not None and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                comm = (_read_text(f"/proc/{name}/comm") or "?").strip()
                found.append(f"{name} ({comm})")
    return found


def _this_owner(instance: str) -> _Owner:
    pid = os.getpid()
    started = _process_start(pid)
    namespace = None
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return _Owner(
        instance, pid, started[1] if started else None, namespace, _read_text("/proc/sys/kernel/random/boot_id")
    )


def _owner_gone(owner: _Owner, me: _Owner) -> str | None:
    """Why the process ``owner`` no longer exists, or None when it may be alive.

    Judged by pid only on this host and boot, in this pid namespace: a missing process, a zombie,
    or a pid now used by a process that started at another time.
    """
    if owner.boot_id and me.boot_id and owner.boot_id != me.boot_id:
        return "the owner's host rebooted"
    if not _judged_by_pid(owner, me):
        return None
    state = _process_start(owner.pid)
    if state is None:
        return f"owner process {owner.pid} exited"
    if state[0] in ("Z", "X"):
        return f"owner process {owner.pid} exited (zombie)"
    if owner.start is not None and state[1] != owner.start:
        return f"owner process {owner.pid} exited (pid reused)"
    return None


def _judged_by_pid(owner: _Owner, me: _Owner) -> bool:
    """Whether ``owner``'s pid names a process ``me`` can see: the same pid namespace, on a system
    that tells start times."""
    return owner.namespace is not None and owner.namespace == me.namespace and me.start is not None


class _Alive:
    """Processes judged alive by ``/proc`` once (``_owner_gone``), held by a pidfd since (Linux
    5.3 and later): the kernel makes a pidfd readable when its process ends, a zombie included, and
    a reused pid is another process with another pidfd. Every process reads who runs every
    ``_PEERS_EVERY`` and judges each one listed: with 16 processes, reading ``/proc/PID/stat`` of
    each was half of the 0.8 ms of CPU that reading who runs took; one ``poll`` of the pidfds
    judges them all. A process is held from its second judgement on: a store opened for one call
    (the command line) judges each once, and a pidfd would cost it more than it saves. Where no
    pidfd is to be had (another system, a process of another namespace, ``_MOST`` held already),
    ``/proc`` judges each time."""

    _MOST = 64  # (pidfds a store holds at most: beside each other store of the process, and its own files)

    def __init__(self) -> None:
        self._held: dict[_Owner, int] = {}  # (by the whole owner: an instance joined again is another)
        self._once: set[_Owner] = set()  # judged alive by ``/proc`` once, not held (at most 4 × ``_MOST``)

    def gone(self, owners: Sequence[_Owner], me: _Owner) -> list[str | None]:
        """Why each of ``owners`` no longer exists, or None when it may be alive."""
        # (one poll of them all: when one of these is held, or when all are held, to make room)
        full = len(self._held) >= self._MOST
        ended = self._ended() if full or any(owner in self._held for owner in owners) else set()
        this = (me.pid, me.start, me.namespace, me.boot_id)
        why: list[str | None] = []
        for owner in owners:
            if (owner.pid, owner.start, owner.namespace, owner.boot_id) == this:
                why.append(None)  # (this process)
            elif owner in ended:  # (its pidfd says so: a pid taken again within a tick of the start fools /proc)
                why.append(f"owner process {owner.pid} exited")
            elif owner in self._held:
                why.append(None)
            else:
                gone = _owner_gone(owner, me)
                if gone is None and owner not in self._once:
                    if len(self._once) >= 4 * self._MOST:
                        self._once.clear()
                    self._once.add(owner)
                elif gone is None and len(self._held) < self._MOST:
                    self._once.discard(owner)
                    self._hold(owner, me)
                why.append(gone)
        return why

    def _ended(self) -> set[_Owner]:
        """Those held whose processes ended (let go of)."""
        poller = select.poll()
        for fd in self._held.values():
            poller.register(fd, select.POLLIN)
        ready = dict(poller.poll(0))
        ended = {owner for owner, fd in self._held.items() if fd in ready}
        for owner in ended:
            fd = self._held.pop(owner)
            if not ready[fd] & select.POLLNVAL:  # (closed by someone else: the number may be another's now)
                os.close(fd)
        return ended

    def _hold(self, owner: _Owner, me: _Owner) -> None:
        if owner.start is None or not _judged_by_pid(owner, me):
            return
        try:
            fd = os.pidfd_open(owner.pid)  # type: ignore[attr-defined,unused-ignore]
        except (AttributeError, OSError):
            return
        state = _process_start(owner.pid)  # (the pid may have ended and been taken again meanwhile)
        if state is None or state[0] in ("Z", "X") or state[1] != owner.start:
            os.close(fd)
            return
        self._held[owner] = fd

    def keep(self, owners: Iterable[_Owner]) -> None:
        """Let go of the processes held that are not among ``owners`` (no longer listed)."""
        listed = set(owners)
        self._once &= listed
        for owner in [owner for owner in self._held if owner not in listed]:
            os.close(self._held.pop(owner))

    def close(self) -> None:
        self.keep(())


def _live_name(owner: _Owner) -> str:
    """The name of ``owner``'s liveness socket: one scheduler instance of one process (a reused pid,
    or the same instance name in a later process, names another)."""
    key = "\0".join(str(part) for part in (owner.instance, owner.pid, owner.start, owner.namespace, owner.boot_id))
    return "p-" + _digest(key)


@dataclasses.dataclass
class _Watched:
    """A connection to another process's liveness socket."""

    sock: socket.socket | None  #: None once the owner's socket closed (or before any connection)
    ended: bool = False  #: the kernel closed the owner's socket while connected
    asked: float = 0.0  #: when (``time.monotonic``) a run of this owner was last asked about


class _Liveness:
    """Owners' deaths as the kernel tells them, the moment they happen, on one host.

    While it serves, each scheduler listens on a unix socket of its own in the directory beside the
    database (``jobs.db-live/``); nothing is ever accepted. A process watching one of its runs
    connects once; when the owner's process ends, however it ends (``kill -9`` included), the
    kernel closes the listening socket, the watcher's connection turns readable, the loop is woken
    (``on_change``) and the owner is gone. No ``/proc`` is needed, so it holds across pid namespaces
    (containers sharing the volume). A frozen owner keeps its socket open: its lease decides. An
    owner whose socket cannot be found (a directory it could not write) is judged as before:
    ``/proc`` and the lease. One descriptor per watched owner, closed when it ends or is not
    asked about for ``_FORGET`` seconds; no thread.
    """

    _FORGET = 60.0

    def __init__(
        self, path: str, loop: asyncio.AbstractEventLoop, on_change: Callable[[], None], shared_group: bool = False
    ):
        self._dir = _real_path(path) + "-live"
        self._shared_group = shared_group
        self._loop, self._on_change = loop, on_change
        self._dir_fd: int | None = None  # the directory held open: a socket's path may be 107 bytes at most
        self._listener: socket.socket | None = None
        self._own: tuple[str, int] | None = None  # this process's socket's name and inode
        self._watched: dict[str, _Watched] = {}
        self._forgot = time.monotonic()

    def _where(self, name: str) -> str:
        path = os.path.join(self._dir, name)
        if len(os.fsencode(path)) < 100 or self._dir_fd is None:
            return path
        return f"/proc/self/fd/{self._dir_fd}/{name}"

    def _open_dir(self) -> bool:
        """Open the directory (made owner-only, or its group's too when shared); ``StoreError`` if
        this process may not trust it: whoever may write it could plant a socket that lies about
        who is alive."""
        if self._dir_fd is None:
            mode = 0o770 if self._shared_group else 0o700
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self._dir, mode)  # (never through a link: mkdir does not follow one)
                    os.chmod(self._dir, mode)  # (past the umask)
                fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                return False
            try:
                _check_trusted(self._dir, "the liveness directory", os.fstat(fd), self._shared_group, directory=True)
            except StoreError:
                os.close(fd)
                raise
            self._dir_fd = fd
        return True

    def listen(self, me: _Owner) -> None:
        """Listen as ``me`` (before joining: a run of ours is never recorded before the socket is
        there), and sweep away the sockets of processes that have ended."""
        if not hasattr(socket, "AF_UNIX") or not self._open_dir():
            return
        name = _live_name(me)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            fresh = self._where(f"{name}.new")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(fresh)
            listener.bind(fresh)
            if self._shared_group:
                os.chmod(fresh, 0o770)  # (its group's processes connect to it)
            listener.listen(socket.SOMAXCONN)
            os.replace(fresh, self._where(name))  # a name that exists is always listened on
            self._own = (name, os.stat(self._where(name)).st_ino)
        except OSError as exc:
            listener.close()
            _log.debug("no liveness socket in %s: %s", self._dir, exc)
            return
        self._listener = listener
        self._sweep(name)

    def _sweep(self, own: str) -> None:
        try:
            names = [n for n in os.listdir(self._dir) if n.startswith("p-") and "." not in n and n != own]
        except OSError:
            return
        for name in names:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
            try:
                probe.connect(self._where(name))
            except ConnectionRefusedError:  # nobody listens: its process ended
                with contextlib.suppress(OSError):
                    os.unlink(self._where(name))
            except OSError:
                pass
            finally:
                probe.close()

    def gone(self, owner: _Owner) -> str | None:
        """Why ``owner``'s process has ended, by its socket; None while it may be alive."""
        try:
            if not self._open_dir():
                return None
        except StoreError:
            return None  # (said when listening)
        now = time.monotonic()
        if now - self._forgot > self._FORGET / 4:
            self._forget(now)
        name = _live_name(owner)
        watched = self._watched.setdefault(name, _Watched(None))
        watched.asked = now
        if watched.sock is not None:
            return None
        # (again after an end: a later scheduler of the same instance name in the same process
        # listens on the same name, and its runs are its own)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            sock.connect(self._where(name))
        except ConnectionRefusedError:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self._where(name))
            return f"owner process {owner.pid} exited (nothing listens on its liveness socket)"
        except FileNotFoundError:
            sock.close()
            return f"owner process {owner.pid} exited (its liveness socket closed)" if watched.ended else None
        except OSError:
            sock.close()
            return None
        watched.sock = sock
        self._loop.add_reader(sock.fileno(), self._ended, name)
        return None

    def _ended(self, name: str) -> None:
        watched = self._watched.get(name)
        if watched is None or watched.sock is None:
            return
        self._drop(watched)
        watched.ended = True
        self._on_change()

    def _drop(self, watched: _Watched) -> None:
        if watched.sock is not None:
            self._loop.remove_reader(watched.sock.fileno())
            watched.sock.close()
            watched.sock = None

    def _forget(self, now: float) -> None:
        self._forgot = now
        for name, watched in list(self._watched.items()):
            if now - watched.asked > self._FORGET:
                self._drop(watched)
                del self._watched[name]

    def close(self) -> None:
        """Stop listening (our socket's name is removed) and watching."""
        for watched in self._watched.values():
            self._drop(watched)
        self._watched.clear()
        if self._listener is not None and self._own is not None:
            name, inode = self._own
            with contextlib.suppress(OSError):
                if os.stat(self._where(name)).st_ino == inode:  # (not a later listener's of the same name)
                    os.unlink(self._where(name))
            self._listener.close()
            self._listener = self._own = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None


###############################################################################
# The SQL stores ##############################################################
###############################################################################
#
# The statements, and the logic around them, that SQLite and PostgreSQL share: one text each, with
# ``?`` and ``:name`` placeholders (the PostgreSQL connection translates them). ``lease_clock()`` is a
# function each store defines: the clock its leases are stamped and compared on, in seconds.

SCHEMA_VERSION = 8
# Every write to a job row gives it the next change number (``changed``; writers take turns, so the
# numbers are handed out in commit order): a process re-reads only the rows changed since the newest
# number it has seen, not every job. (``register`` writes only what is new or declared otherwise.)
_SQL_NEXT_CHANGE = "(SELECT COALESCE(MAX(changed), 0) + 1 FROM jobs)"
_SQL_REGISTER = (
    "INSERT INTO jobs (name, schedule, last_slot, next_slot, definition, declared_by, changed) "
    "VALUES (:name, :schedule, :last_slot, :next_slot, :definition, :declared_by, :changed) "
    "ON CONFLICT (name) DO UPDATE SET "
    # (``next_slot`` is always the first occurrence after ``last_slot``, or NULL: unknown)
    "next_slot = CASE WHEN jobs.schedule != excluded.schedule THEN NULL ELSE jobs.next_slot END, "
    # (a schedule changed: its occurrences come after the watermark ``register`` gives: ``_watermark``)
    "last_slot = CASE WHEN jobs.schedule != excluded.schedule THEN excluded.last_slot ELSE jobs.last_slot END, "
    "changed = excluded.changed, "
    "schedule = excluded.schedule, definition = excluded.definition, declared_by = excluded.declared_by"
)
_SQL_JOB_COLUMNS = "name, schedule, paused, last_slot, next_slot, definition, declared_by, changed"
_SQL_JOB = f"SELECT {_SQL_JOB_COLUMNS} FROM jobs WHERE name = ?"
# (in the order of the index on ``changed``: ordered by name, SQLite would read every row to find them)
_SQL_JOBS = f"SELECT {_SQL_JOB_COLUMNS} FROM jobs WHERE changed > ? ORDER BY changed"
_SQL_ALL_JOBS = f"SELECT {_SQL_JOB_COLUMNS} FROM jobs"
_SQL_NEWEST_SLOT = "SELECT max(slot) FROM history"
# Which process declares which job (rows of processes that are gone are deleted by the next to join).
_SQL_DECLARE = "INSERT INTO declarations (job, instance) VALUES (?, ?)"
_SQL_UNDECLARE = "DELETE FROM declarations WHERE instance = ?"
_SQL_UNDECLARE_GONE = "DELETE FROM declarations WHERE instance NOT IN (SELECT instance FROM instances)"
_SQL_UNDECLARED = (  # (``{live}``: the placeholders of the running processes' instances)
    "SELECT name FROM jobs WHERE {only}NOT EXISTS "
    "(SELECT 1 FROM declarations d WHERE d.job = jobs.name AND d.instance IN ({live})) ORDER BY name"
)
_SQL_DECLARERS = "SELECT instance FROM declarations WHERE job = ? ORDER BY instance"
_SQL_DECLARATIONS = "SELECT instance, job FROM declarations"
# Before a job is forgotten, the job with the next largest change number takes a new one: change
# numbers keep growing (the largest plus one, they went back when the job holding it was deleted,
# and a job declared again then took its forgotten number: a reader that had seen that number kept
# the forgotten row). Only a last job forgotten takes them back to 0.
_SQL_FORGET_CHANGE = (
    f"UPDATE jobs SET changed = {_SQL_NEXT_CHANGE} "
    "WHERE name = (SELECT name FROM jobs WHERE name != ? ORDER BY changed DESC LIMIT 1)"
)
_SQL_FORGET = (_SQL_FORGET_CHANGE,) + tuple(
    f"DELETE FROM {table} WHERE {column} = ?"
    for table, column in (
        ("jobs", "name"),
        ("runs", "job"),
        ("history", "job"),
        ("checkpoints", "job"),
        ("totals", "job"),
        ("declarations", "job"),
    )
)
_SQL_JOB_RUNS = "SELECT count(*) FROM runs WHERE job = ?"
# Every job with what ``status`` shows: whether a running process declares it (``{undeclared}``:
# NULL when that cannot be told) and its newest record, which the job's row keeps (``last_status``,
# ``last_at``: written by triggers on ``history``, whoever writes the record). One read: 10,000 jobs
# are scanned once (two look-ups a job in ``history`` would be two thirds of a ``status``'s time).
_SQL_JOB_STATUSES = (
    "SELECT name, schedule, paused, last_slot, next_slot, definition, declared_by, changed, {undeclared}, "
    "last_status, last_at FROM jobs ORDER BY name"
)
# The same in two parts, for a ``status`` that has read the rows before: what can change without a
# change number, for every job (its marks), and the rows changed since (by ``jobs_by_change``).
_SQL_JOB_MARKS = "SELECT name, changed, {undeclared}, last_status, last_at FROM jobs ORDER BY name"
_SQL_JOBS_CHANGED = (
    "SELECT name, schedule, paused, last_slot, next_slot, definition, declared_by, changed FROM jobs WHERE changed > ?"
)
_SQL_NEWEST_ID = "(SELECT max(id) FROM {schema}history x WHERE x.job = {job})"  # a job's newest record's id
_SQL_JOBS_NEWEST_ID = _SQL_NEWEST_ID.format(schema="", job="jobs.name")  # (in a statement on ``jobs``)
_SQL_RECORD_AT = "COALESCE({record}.started_at, {record}.slot)"  # what ``last_at`` keeps of a record
_SQL_JOB_STATUSES_BEFORE_7 = (  # (read-only, on a file of an earlier version whose processes still run)
    "SELECT jobs.name, jobs.schedule, jobs.paused, jobs.last_slot, jobs.next_slot, jobs.definition, "
    f"jobs.declared_by, {{undeclared}}, h.status, {_SQL_RECORD_AT.format(record='h')} FROM jobs "
    f"LEFT JOIN history h ON h.id = {_SQL_JOBS_NEWEST_ID} ORDER BY jobs.name"
)
# A job's newest record, kept in its row by a trigger on ``history`` (``NEW``: the record written):
# a new record is always the newest (ids only grow), a changed one is when it still has the job's
# largest id. (``{schema}``: the schema's name and a dot, on PostgreSQL.)
_SQL_KEEP_NEWEST = (
    f"UPDATE {{schema}}jobs SET last_status = NEW.status, last_at = {_SQL_RECORD_AT.format(record='NEW')} "
    "WHERE name = NEW.job"
)
_SQL_IS_NEWEST = "NEW.id = " + _SQL_NEWEST_ID.replace("{job}", "NEW.job")
# An attempt's record, written by a trigger on ``runs`` when a run is made running (``NEW``: the run,
# inserted running by a claim or taken as its next attempt): in the claim's own statement.
_SQL_RUN_TAKEN = "NEW.state = 'running'"
_SQL_RECORD_TAKEN = (
    "INSERT INTO {schema}history (job, slot, attempt, status, instance, started_at) "
    "VALUES (NEW.job, NEW.slot, NEW.attempt, 'running', NEW.owner, NEW.started_at) "
    "ON CONFLICT (job, slot, attempt) DO UPDATE SET status = excluded.status, finished_at = excluded.finished_at, "
    "error = excluded.error"
)
# A run whose attempt's record has ended while that attempt still holds it running is over: a trigger
# on ``history`` deletes it, so that an end is one statement (``_SQL_END_HELD``). An attempt that
# another follows lets go of its run before its record ends (``_SQL_RELEASE_HELD``: the run is no
# longer running); ``interrupted`` is what a takeover writes of the attempt before it while that one
# still holds the run.
_SQL_RECORD_ENDED = "OLD.status = 'running' AND NEW.status NOT IN ('running', 'interrupted')"
_SQL_LET_GO_ENDED = (
    "DELETE FROM {schema}runs WHERE job = NEW.job AND slot = NEW.slot AND attempt = NEW.attempt AND state = 'running'"
)
_SQL_NEWEST_RECORD = f"FROM history h WHERE h.id = {_SQL_JOBS_NEWEST_ID}"
_SQL_FILL_NEWEST = (  # the same for every job at once (the migration to version 7)
    f"UPDATE jobs SET last_status = (SELECT h.status {_SQL_NEWEST_RECORD}), "
    f"last_at = (SELECT {_SQL_RECORD_AT.format(record='h')} {_SQL_NEWEST_RECORD})"
)
_SQL_NOT_DECLARED = (  # (``{live}``: the placeholders of the running processes' instances)
    "CASE WHEN EXISTS (SELECT 1 FROM declarations d WHERE d.job = jobs.name AND d.instance IN ({live})) "
    "THEN 0 ELSE 1 END"
)
_SQL_ADVANCE = (  # (a paused job's watermark stays: a process that has not read the pause yet claims nothing)
    f"UPDATE jobs SET last_slot = :slot, next_slot = :next_slot, changed = {_SQL_NEXT_CHANGE} "
    "WHERE name = :job AND last_slot = :expected_last AND paused = 0"
)
_SQL_SET_PAUSED = (
    "UPDATE jobs SET paused = :paused, last_slot = CASE WHEN last_slot > :since THEN last_slot ELSE :since END, "
    f"changed = {_SQL_NEXT_CHANGE} WHERE name = :job"
)
_SQL_RUN_COLUMNS = (
    "job, slot, attempt, state, not_before, failures, owner, owner_pid, owner_start, owner_ns, boot_id, "
    "lease_until, cancel, progress_done, progress_total, started_at, lease"
)
_SQL_RUN = f"SELECT {_SQL_RUN_COLUMNS} FROM runs WHERE job = ? AND slot = ?"
_SQL_RUNS = f"SELECT {_SQL_RUN_COLUMNS}, lease_until - lease_clock() FROM runs ORDER BY job, slot"
_SQL_JOB_BUSY = "SELECT count(*) FROM runs WHERE job = :job AND slot != :slot"  # (the job's other unfinished runs)
_SQL_INSERT_RUN = "INSERT INTO runs (job, slot, attempt, state, not_before) VALUES (?, ?, 0, 'pending', ?)"
_SQL_TAKE_RUN = (
    "UPDATE runs SET state = 'running', attempt = attempt + 1, owner = :owner, owner_pid = :pid, "
    "owner_start = :start, owner_ns = :namespace, boot_id = :boot_id, lease_until = lease_clock() + :lease, "
    "lease = :lease, started_at = :now_ms, progress_done = NULL, progress_total = NULL "
    "WHERE job = :job AND slot = :slot"
)
_SQL_ATTEMPT = "SELECT attempt, failures FROM runs WHERE job = ? AND slot = ?"
# A due occurrence's run, made running as its first attempt in one statement (``_SQL_TAKE_RUN``'s
# parameters and ``:overlap``), unless that slot has a run (triggered by hand: it is claimed as
# pending) or the job already has ``:overlap`` other unfinished runs (NULL: no bound): the count and
# the insert in one statement; a claim tells the two apart only when nothing was inserted.
_SQL_INSERT_DUE_RUNNING = (
    "INSERT INTO runs (job, slot, attempt, state, not_before, owner, owner_pid, owner_start, owner_ns, boot_id, "
    "lease_until, lease, started_at) SELECT :job, :slot, 1, 'running', :now_ms, :owner, :pid, :start, :namespace, "
    ":boot_id, lease_clock() + :lease, :lease, :now_ms "
    "WHERE CAST(:overlap AS INTEGER) IS NULL "
    f"OR ({_SQL_JOB_BUSY}) < CAST(:overlap AS INTEGER) "
    "ON CONFLICT (job, slot) DO NOTHING"
)


def _held_by(job: str, slot: int, attempt: int | None, owner: str | None) -> dict[str, Any]:
    """The parameters of ``_SQL_FENCE``: one attempt of a run, while ``owner`` holds it."""
    return {"job": job, "slot": slot, "attempt": attempt, "owner": owner}


def _ended_by(owner: str, end: _End) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parameters of ``_SQL_FENCE`` for ``end``'s attempt held by ``owner``, and those of the
    statements that write its end (``_SQL_END_HELD`` and its kin)."""
    held = _held_by(end.claim.job, end.claim.slot, end.claim.attempt, owner)
    return held, {**held, "status": end.status, "finished_at": end.now_ms, "error": end.error, "output": end.output}


_SQL_FENCE = "job = :job AND slot = :slot AND attempt = :attempt AND owner = :owner AND state = 'running'"
_SQL_RENEW_ALL = (  # {rows}: one (job, slot, attempt) per attempt
    "UPDATE runs SET lease_until = lease_clock() + lease WHERE owner = ? AND state = 'running' "
    "AND (job, slot, attempt) IN (VALUES {rows})"
)
_SQL_PROGRESS = f"UPDATE runs SET progress_done = :done, progress_total = :total WHERE {_SQL_FENCE}"
_SQL_SET_PROCESS_GROUP = f"UPDATE runs SET process_group = :group WHERE {_SQL_FENCE}"
_SQL_PROCESS_GROUP = "SELECT process_group FROM runs WHERE job = ? AND slot = ?"
_SQL_IS_HELD = f"SELECT cancel FROM runs WHERE {_SQL_FENCE}"
# An attempt's end lets go of its run, fenced (nothing when the attempt no longer holds it): the
# run deleted, or left pending for the next attempt (``_held_by`` and these).
_SQL_DELETE_HELD = f"DELETE FROM runs WHERE {_SQL_FENCE}"
_SQL_RELEASE_HELD = (
    "UPDATE runs SET state = 'pending', not_before = :not_before, failures = failures + :failed, owner = NULL, "
    f"lease_until = NULL WHERE {_SQL_FENCE}"
)
_SQL_DELETE_RUN = "DELETE FROM runs WHERE job = ? AND slot = ?"
_SQL_CANCEL = "UPDATE runs SET cancel = 1 WHERE job = ?"
_SQL_CANCEL_PENDING = "SELECT slot, attempt FROM runs WHERE job = ? AND state = 'pending'"
_SQL_RECORD = (
    "INSERT INTO history (job, slot, attempt, status, instance, started_at, finished_at, error) VALUES "
    "(:job, :slot, :attempt, :status, :instance, :started_at, :finished_at, :error) ON CONFLICT (job, slot, attempt) DO UPDATE SET status = excluded.status, "
    "finished_at = excluded.finished_at, error = excluded.error"
)
_SQL_END_ATTEMPT = (
    "UPDATE history SET status = :status, finished_at = :finished_at, error = :error, output = :output "
    "WHERE job = :job AND slot = :slot AND attempt = :attempt"
)
# As _SQL_END_ATTEMPT when the record is already the job's newest (a short run: nothing recorded for
# the job since it started): the record is changed in place, no index is touched.
_SQL_END_NEWEST = f"{_SQL_END_ATTEMPT} AND id = {_SQL_NEWEST_ID.format(schema='', job=':job')}"
# An attempt's end, its run over, in one statement: as _SQL_END_NEWEST while the attempt holds its run
# (``_held_by``'s parameters too); the trigger on the record's end deletes the run (_SQL_LET_GO_ENDED).
_SQL_END_HELD = f"{_SQL_END_NEWEST} AND EXISTS (SELECT 1 FROM runs WHERE {_SQL_FENCE})"
_SQL_SLOT_USED = "SELECT 1 FROM runs WHERE job = :job AND slot = :slot UNION ALL SELECT 1 FROM history WHERE job = :job AND slot = :slot"
_SQL_HISTORY_COLUMNS = "job, slot, attempt, status, instance, started_at, finished_at, error, output"
_SQL_RECORD_OF = f"SELECT {_SQL_HISTORY_COLUMNS} FROM history WHERE job = ? AND slot = ? AND attempt = ?"
_SQL_HISTORY = f"SELECT {_SQL_HISTORY_COLUMNS} FROM history ORDER BY id DESC LIMIT ?"
_SQL_JOB_HISTORY = f"SELECT {_SQL_HISTORY_COLUMNS} FROM history WHERE job = ? ORDER BY id DESC LIMIT ?"  # (by index)
# The records that overlap a stretch of time, in groups of one job, status and part of the stretch
# (a day of a job every second is 86,400 records; the status page draws at most a bar a pixel). A
# record is found by its slot (indexed), up to a day before the stretch: a run longer than that
# shows while it runs, not after.
_SQL_TIMELINE = (
    "SELECT job, status, (COALESCE(started_at, slot) - ?) / ? AS piece, count(*), "
    "min(COALESCE(started_at, slot)), max(COALESCE(finished_at, started_at, slot)), max(attempt), min(instance) "
    "FROM history WHERE job IN ({jobs}) AND slot >= ? AND slot < ? AND COALESCE(finished_at, started_at, slot) >= ? "
    "GROUP BY job, status, piece ORDER BY job, piece"
)
# How many records of each status pruning has deleted, per job (the history keeps the rest).
_SQL_TOTALS_TABLE = """CREATE TABLE IF NOT EXISTS totals (
        job TEXT NOT NULL,
        status TEXT NOT NULL,
        records BIGINT NOT NULL,
        PRIMARY KEY (job, status)
    )"""
_SQL_NTH_NEWEST = "SELECT id FROM history WHERE job = ? ORDER BY id DESC LIMIT 1 OFFSET ?"
_SQL_UNFINISHED = "EXISTS (SELECT 1 FROM runs r WHERE r.job = history.job AND r.slot = history.slot)"
# A job's records up to an id; never an unfinished run's: it still writes its end there.
_SQL_PRUNABLE = f"job = ? AND id <= ? AND NOT {_SQL_UNFINISHED}"
_SQL_NTH_OLDEST_PRUNABLE = (
    f"SELECT id FROM history WHERE job = ? AND NOT {_SQL_UNFINISHED} ORDER BY id LIMIT 1 OFFSET ?"
)
_SQL_COUNT_PRUNED = (  # the records pruning deletes stay counted: the metrics' counters never go down
    f"INSERT INTO totals (job, status, records) SELECT job, status, count(*) FROM history WHERE {_SQL_PRUNABLE} "
    "GROUP BY job, status ON CONFLICT (job, status) DO UPDATE SET records = totals.records + excluded.records"
)
_SQL_PRUNE_HISTORY = f"DELETE FROM history WHERE {_SQL_PRUNABLE}"
_PRUNE_BATCH = 1000  # records pruned at most in one transaction (a few ms of the write lock)
# The metrics: per job and status the records, newest start and end; the newest attempt's duration.
_SQL_FIGURES = "SELECT job, status, count(*), max(started_at), max(finished_at) FROM history GROUP BY job, status"
_SQL_TOTALS = "SELECT job, status, records FROM totals"
_SQL_LAST_DURATIONS = (
    "SELECT job, finished_at - started_at FROM history WHERE id IN (SELECT max(id) FROM history "
    "WHERE attempt > 0 AND status != 'running' AND started_at IS NOT NULL AND finished_at IS NOT NULL GROUP BY job)"
)
_SQL_RUNNING = "SELECT job, count(*) FROM runs WHERE state = 'running' GROUP BY job"
_SQL_JOB_NAMES = "SELECT name FROM jobs"
_SQL_PRUNE_CHECKPOINTS = (
    "DELETE FROM checkpoints WHERE job = ? AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.job = checkpoints.job "
    "AND r.slot = checkpoints.slot) AND NOT EXISTS (SELECT 1 FROM history h WHERE h.job = checkpoints.job "
    "AND h.slot = checkpoints.slot)"
)
# Whether the attempt of ``_held_by`` holds its run (true when no attempt is given); ``{lock}``: how
# the run is read (each store's ``_SQL_CHECKPOINT_SET``).
_SQL_HELD_OR_FREE = f"(CAST(:attempt AS BIGINT) IS NULL OR EXISTS (SELECT 1 FROM runs WHERE {_SQL_FENCE}{{lock}}))"
_SQL_CHECKPOINT_GET = (  # (held, value) in one snapshot
    f"SELECT {_SQL_HELD_OR_FREE.format(lock='')}, (SELECT value FROM checkpoints WHERE job = :job AND slot = :slot)"
)
# A checkpoint is written or deleted in one statement, its own transaction, fenced in its WHERE: no
# write of it is ever left open while its process waits (a PostgreSQL writer cut off in the middle of
# a transaction holds the others up, _PG_OPEN_WRITE), and it never waits for the writers' turn.
_SQL_CHECKPOINT_SET = (
    "INSERT INTO checkpoints (job, slot, value, updated_at, attempt) SELECT :job, :slot, :value, :now_ms, "
    "CAST(:attempt AS BIGINT) "
    f"WHERE {_SQL_HELD_OR_FREE} ON CONFLICT (job, slot) DO UPDATE SET value = excluded.value, "
    "updated_at = excluded.updated_at, attempt = excluded.attempt"
)
_SQL_CHECKPOINT_DELETE = f"DELETE FROM checkpoints WHERE job = :job AND slot = :slot AND {_SQL_HELD_OR_FREE}"


# The tables, written once for both stores: ``_dialect`` renders them, ``{ms}`` being the type of a
# time in milliseconds (or a slot), ``{real}`` of seconds, ``{id}`` the history's growing id,
# ``{new}`` and ``{rowid}`` what SQLite adds. Each store adds its own ``instances`` table (what tells
# that a process is gone differs) and what only it has (PostgreSQL: ``meta``, its lock keys and
# functions; SQLite keeps its version in ``PRAGMA user_version``).
_SQL_JOB_TABLES = (
    # One row per declared job: its pause flag, its watermark (every occurrence up to ``last_slot``
    # has been handled: run, skipped or missed) and its newest record's status and start.
    """CREATE TABLE {new}jobs (
        name TEXT PRIMARY KEY,
        schedule TEXT NOT NULL,
        paused INTEGER NOT NULL DEFAULT 0,
        last_slot {ms} NOT NULL,
        next_slot {ms},
        definition TEXT,
        declared_by TEXT,
        changed {ms} NOT NULL DEFAULT 0,
        last_status TEXT,
        last_at {ms}
    )""",
    "CREATE INDEX {new}jobs_by_change ON jobs (changed)",
    # One row per unfinished occurrence: waiting to be claimed, or running under a lease.
    """CREATE TABLE {new}runs (
        job TEXT NOT NULL,
        slot {ms} NOT NULL,
        attempt INTEGER NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('pending', 'running')),
        not_before {ms} NOT NULL,
        failures INTEGER NOT NULL DEFAULT 0,
        owner TEXT,
        owner_pid INTEGER,
        owner_start {ms},
        owner_ns TEXT,
        boot_id TEXT,
        lease_until {real},
        lease {real},
        cancel INTEGER NOT NULL DEFAULT 0,
        progress_done {real},
        progress_total {real},
        started_at {ms},
        process_group TEXT,
        PRIMARY KEY (job, slot)
    ){rowid}""",
    # One row per attempt, and per skipped or missed occurrence (attempt 0). (A new id is always
    # the largest: records are only ever deleted from the oldest end, or replaced by a newer id.)
    """CREATE TABLE {new}history (
        id {id},
        job TEXT NOT NULL,
        slot {ms} NOT NULL,
        attempt INTEGER NOT NULL,
        status TEXT NOT NULL,
        instance TEXT,
        started_at {ms},
        finished_at {ms},
        error TEXT,
        output TEXT,
        UNIQUE (job, slot, attempt)
    )""",
    "CREATE INDEX {new}history_by_job ON history (job, id)",
    "CREATE INDEX {new}history_by_slot ON history (slot)",
)
# Which process declares which job (rows of processes that are gone are deleted by the next to join).
_SQL_DECLARATIONS_TABLE = """CREATE TABLE IF NOT EXISTS declarations (
        job TEXT NOT NULL,
        instance TEXT NOT NULL,
        PRIMARY KEY (job, instance)
    ){rowid}"""
_SQL_CHECKPOINT_TABLES = (
    # One row per saved checkpoint; ``attempt`` is the attempt that saved it (NULL from outside a run).
    """CREATE TABLE {new}checkpoints (
        job TEXT NOT NULL,
        slot {ms} NOT NULL,
        value TEXT NOT NULL,
        updated_at {ms} NOT NULL,
        attempt INTEGER,
        PRIMARY KEY (job, slot)
    )""",
    _SQL_TOTALS_TABLE,
)
# From each earlier version to the next, in place and in one transaction with the version change
# (what both stores share; each adds its own). Every step only adds, so a process of the previous
# version still running on the database keeps working (a job row it inserts has change number 0:
# the full read a process makes every ``_FULL_READ`` seconds finds it).
_SQL_MIGRATIONS: dict[int, tuple[str, ...]] = {
    4: (
        "ALTER TABLE jobs ADD COLUMN changed BIGINT NOT NULL DEFAULT 0",
        "UPDATE jobs SET changed = 1",
        "CREATE INDEX jobs_by_change ON jobs (changed)",
    ),
    5: (_SQL_TOTALS_TABLE,),
    6: ("ALTER TABLE instances ADD COLUMN declares INTEGER", _SQL_DECLARATIONS_TABLE),
    7: ("ALTER TABLE jobs ADD COLUMN last_status TEXT", "ALTER TABLE jobs ADD COLUMN last_at {ms}", _SQL_FILL_NEWEST),
}


def _dialect(statements: Iterable[str], types: dict[str, str]) -> tuple[str, ...]:
    """``statements`` (of the shared schema) as one store writes them."""
    return tuple(statement.format_map(types) if "{" in statement else statement for statement in statements)


_job_row = _JobRow._make


def _watermark(row: _JobRow, job: _Declared) -> int:
    """The watermark of a job the store holds, declared anew: where it was, unless its schedule
    was changed while the scheduler ran (then from that moment, or where it was, if later)."""
    if job.since is None or row.schedule == job.schedule:
        return int(row.last_slot)
    return max(int(row.last_slot), job.since)


def _first_slot(job: _Declared) -> int | None:
    """The next occurrence of a job new to the store, after its watermark."""
    return job.next_slot if job.first is None else job.first(job.last_slot)


def _reader(conn: Any) -> Callable[[str, Sequence[Any]], list[Any]]:
    """``read(sql, args)``: the rows of a statement run on ``conn`` (inside a transaction)."""

    def read(sql: str, args: Sequence[Any] = ()) -> list[Any]:
        return list(conn.execute(sql, args).fetchall())

    return read


def _record(
    job: str,
    slot: int,
    attempt: int,
    status: str,
    instance: str | None = None,
    *,
    started_at: int | None = None,
    finished_at: int | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """The named parameters of ``_SQL_RECORD``."""
    return {
        "job": job,
        "slot": slot,
        "attempt": attempt,
        "status": status,
        "instance": instance,
        "started_at": started_at,
        "finished_at": finished_at,
        "error": error,
    }


def _history_record(r: Sequence[Any]) -> RunRecord:
    """A record as read (``_SQL_HISTORY_COLUMNS``)."""
    return RunRecord(r[0], r[1], r[2], r[3], r[4], _dt_or_none(r[5]), _dt_or_none(r[6]), r[7], r[8])


def _run_row(row: Sequence[Any]) -> _RunRow:
    """A run as read (``_SQL_RUN_COLUMNS``, then the lease left and why the owner is gone, if read)."""
    values = list(row)
    values[12] = bool(values[12])
    return _RunRow(*values)


def _renewal(owner: str, claims: Sequence[_Claim]) -> tuple[str, list[Any]]:
    """The statement and arguments that renew the leases of ``claims`` at once."""
    rows = ", ".join(["(?, CAST(? AS BIGINT), CAST(? AS INTEGER))"] * len(claims))  # (typed: see _PGStore)
    return _SQL_RENEW_ALL.format(rows=rows), [owner, *(v for c in claims for v in (c.job, c.slot, c.attempt))]


def _won(claims: Sequence[_Claimed]) -> bool:
    """Whether a claim was won or recorded something (what other processes are told of)."""
    return any(claim is not _NotClaimed.MOVED for claim in claims)


def _hands_over(ends: Sequence[_End], written: Sequence[bool]) -> bool | str:
    """Whether an end written leaves its run pending (what other processes are told of): ``_NOW``
    when one is handed over, for another process to claim now. A run deleted concerns no other
    process at once: one watching it reads the runs again within its store's ``coalesce``."""
    left = [end.then for end, wrote in zip(ends, written) if wrote and end.then is not _AfterEnd.DONE]
    return _NOW if _AfterEnd.HANDOVER in left else bool(left)


class _SQLStore(_Store):
    """The store's logic, in SQL that SQLite and PostgreSQL both run (the statements above).

    A subclass supplies the connection: ``_write(work)`` runs ``work(conn)`` as one transaction that
    may take locks it then holds to the end, ``_read`` one statement, ``_autocommit`` one write
    statement in a transaction of its own; ``conn.execute``/``executemany`` take ``?`` and ``:name``
    placeholders. The SQL function ``lease_clock()`` is the store's lease clock, in seconds.
    """

    _SQL_RUNS = _SQL_RUNS
    _SQL_RUN_TO_TAKE = _SQL_RUN  # a run read to be claimed (PostgreSQL locks it)
    schema = SCHEMA_VERSION  # the connected schema's version (older only when opened read-only)
    _SQL_FINISH_ATTEMPT = ""  # as _SQL_END_ATTEMPT, and the record becomes the job's newest (a new id)
    _renewal = staticmethod(_renewal)  # the statement that renews leases (PostgreSQL has its own)
    # A checkpoint's write reads the run that fences it as it is: SQLite's write lock holds every
    # other writer off (PostgreSQL locks the run).
    _SQL_CHECKPOINT_SET = _SQL_CHECKPOINT_SET.format(lock="")
    _SQL_CHECKPOINT_DELETE = _SQL_CHECKPOINT_DELETE.format(lock="")

    def __init__(self) -> None:
        self._ends: dict[str, int] = {}  # records each job's ends wrote since its history was looked at (_prune_due)

    @abc.abstractmethod
    def _owner(self) -> _Owner:
        """This process, as the owner of the runs it takes (what tells whether it still exists)."""

    @abc.abstractmethod
    def _write(self, work: Callable[[Any], T], notify: _Telling[T] = True, again: bool = True) -> T:
        """Run ``work(conn)`` in one transaction; roll back on any error. ``notify``: tell the other
        processes when it commits (a checkpoint needs no one's attention), or whether to, given what
        ``work`` returned (a claim that found every watermark moved wrote nothing). ``again``: the
        transaction may be run a second time when its commit may have been lost with the connection
        (not a trigger: it would record a second run)."""

    @abc.abstractmethod
    def _read(self, sql: str, args: Sequence[Any] | Mapping[str, Any] = ()) -> list[Any]:
        """The rows of one statement."""

    @abc.abstractmethod
    def _autocommit(self, sql: str, args: Sequence[Any] | Mapping[str, Any]) -> int:
        """One write statement, its own transaction; returns the number of rows it changed."""

    @abc.abstractmethod
    def _connect(self) -> Any:
        """The connection, opened if need be."""

    def connect(self) -> None:
        self._connect()

    # -- jobs -------------------------------------------------------------------------------------

    def register(self, jobs: Sequence[_Declared]) -> list[_JobRow]:
        def work(conn: Any) -> list[_JobRow]:
            before = {row.name: row for row in map(_job_row, conn.execute(_SQL_ALL_JOBS))}
            # Only what is new or declared otherwise is written: a restart of 10,000 jobs writes nothing.
            # A job given another schedule while the scheduler runs goes on from then (``_watermark``):
            # the occurrences the new schedule would have had before are not missed, they never were.
            # (one change number for the whole transaction: a reader sees all of its rows or none)
            changed = int(conn.execute(f"SELECT {_SQL_NEXT_CHANGE}").fetchone()[0])
            fresh = []
            for job in jobs:
                row = before.get(job.name)
                if row is None or (row.schedule, row.definition) != (job.schedule, job.definition):
                    fresh.append(  # (by hand: ``asdict`` copies deeply, a third of registering 10,000 jobs)
                        {
                            "name": job.name,
                            "schedule": job.schedule,
                            "last_slot": job.last_slot if row is None else _watermark(row, job),
                            "next_slot": _first_slot(job) if row is None else None,
                            "definition": job.definition,
                            "declared_by": job.declared_by,
                            "changed": changed,
                        }
                    )
            conn.executemany(_SQL_REGISTER, fresh)
            return [
                row
                for job in jobs
                if (row := before.get(job.name)) is not None and row.definition not in (None, job.definition)
            ]

        return self._write(work)

    def jobs(self, since: int = -1) -> list[_JobRow]:
        rows = self._read(_SQL_JOBS, (since,)) if since >= 0 else self._read(_SQL_ALL_JOBS)
        return sorted(map(_job_row, rows))  # (by name: the first field)

    def job(self, name: str) -> _JobRow | None:
        rows = self._read(_SQL_JOB, (name,))
        return _job_row(rows[0]) if rows else None

    def newest_slot(self) -> int | None:
        value = self._read(_SQL_NEWEST_SLOT)[0][0]
        return None if value is None else int(value)

    def set_paused(self, name: str, paused: bool, now_ms: int) -> bool:
        def work(conn: Any) -> bool:
            since = 0 if paused else now_ms
            return bool(
                conn.execute(_SQL_SET_PAUSED, {"paused": int(paused), "since": since, "job": name}).rowcount == 1
            )

        return self._write(work, notify=lambda changed: _ASKED if changed else False)

    def runs(self) -> list[_RunRow]:
        return [_run_row(row) for row in self._read(self._SQL_RUNS)]

    # -- claims -----------------------------------------------------------------------------------

    def claim_due_many(self, owner: str, now_ms: int, due: Sequence[_Due]) -> list[_Claimed]:
        def work(conn: Any) -> list[_Claimed]:
            return self._claim_all_due(conn, owner, now_ms, due)

        # (Only claims won are told: of four processes claiming the same due jobs, three find them
        # moved, and telling that would wake the others for nothing, 3,700 times in 45 s.)
        return self._write(work, notify=_won)

    def end_and_claim(
        self, owner: str, now_ms: int, ends: Sequence[_End], due: Sequence[_Due]
    ) -> tuple[list[bool], list[_Claimed]]:
        """``finish_many`` and ``claim_due_many`` in one transaction, the ends first (a run that
        ended leaves its job free for a claim after it)."""
        looks = self._looks(ends)

        def work(conn: Any) -> tuple[list[bool], list[_Claimed]]:
            written = self._finish_all(conn, owner, ends, looks)
            return written, self._claim_all_due(conn, owner, now_ms, due)

        written, claims = self._write(work, lambda both: _hands_over(ends, both[0]) or _won(both[1]))
        self._noted(ends, looks, written)
        return written, claims

    def _claim_all_due(self, conn: Any, owner: str, now_ms: int, due: Sequence[_Due]) -> list[_Claimed]:
        """``_claim_due`` of each of ``due``, in the transaction on ``conn``."""
        return [self._claim_due(conn, owner, now_ms, item) for item in due]

    def _claim_due(self, conn: Any, owner: str, now_ms: int, due: _Due) -> _Claimed:
        advance = {"slot": due.slot, "next_slot": due.next_slot, "job": due.job, "expected_last": due.expected_last}
        if conn.execute(_SQL_ADVANCE, advance).rowcount != 1:
            return _NotClaimed.MOVED
        return self._claim_advanced(conn, owner, now_ms, due)

    def _claim_advanced(self, conn: Any, owner: str, now_ms: int, due: _Due) -> _Claimed:
        """The rest of ``_claim_due`` once the job's watermark moved: the occurrences missed, and
        the run claimed (or the occurrence skipped)."""
        job, slot = due.job, due.slot
        records = [_record(job, s, 0, "missed", finished_at=now_ms, error=e) for s, e in due.missed]
        conn.executemany(_SQL_RECORD, records)
        if due.missed:
            self._prune(conn, job)
        if not due.run:
            return _NotClaimed.RECORDED
        holder = {**self._holder(job, slot, owner, due.lease, now_ms), "overlap": due.overlap}
        if conn.execute(_SQL_INSERT_DUE_RUNNING, holder).rowcount == 0:
            if self._full(conn, job, slot, due.overlap):
                self._skip(conn, job, slot, owner, now_ms)
            return _NotClaimed.RECORDED  # (else a run of that very slot was triggered: it is claimed as pending)
        return _Claim(job, slot, 1, 0, now_ms)  # (its record: _SQL_RECORD_TAKEN)

    def _holder(self, job: str, slot: int, owner: str, lease: float, now_ms: int) -> dict[str, Any]:
        """The parameters that make ``owner`` (an instance of this process) the holder of a run for
        ``lease`` seconds, stamped on the lease clock, with what tells whether this process still
        exists."""
        me = self._owner()
        return {
            "owner": owner,
            "pid": me.pid,
            "start": me.start,
            "namespace": me.namespace,
            "boot_id": me.boot_id,
            "lease": lease,
            "now_ms": now_ms,
            "job": job,
            "slot": slot,
        }

    def _take(self, conn: Any, job: str, slot: int, owner: str, lease: float, now_ms: int) -> _Claim:
        """Make ``owner`` the holder of a pending run (its next attempt), as ``_holder`` says; the
        attempt's record is written by the trigger on the run (``_SQL_RECORD_TAKEN``)."""
        conn.execute(_SQL_TAKE_RUN, self._holder(job, slot, owner, lease, now_ms))
        attempt, failures = conn.execute(_SQL_ATTEMPT, (job, slot)).fetchone()
        return _Claim(job, slot, attempt, failures, now_ms)

    @staticmethod
    def _full(conn: Any, job: str, slot: int, overlap: int | None) -> bool:
        """Whether ``overlap`` runs of ``job`` other than ``slot``'s are unfinished (pending, running,
        waiting for a retry or a takeover), read in the claim's own transaction: the store's write
        lock (SQLite's, PostgreSQL's write turn) keeps the count true until the claim commits."""
        return (
            overlap is not None
            and int(conn.execute(_SQL_JOB_BUSY, {"job": job, "slot": slot}).fetchone()[0]) >= overlap
        )

    def claim(
        self,
        expected: _RunRow,
        owner: str,
        lease: float,
        now_ms: int,
        max_attempts: int,
        overlap: int | None,
        reason: str = "",
        owner_gone: bool = False,
    ) -> _Claim | RunRecord | None:
        def work(conn: Any) -> _Claim | RunRecord | None:
            rows = conn.execute(self._SQL_RUN_TO_TAKE, (expected.job, expected.slot)).fetchall()
            if not rows or _run_row(rows[0]) != expected:
                return None
            if expected.state == "running" and not owner_gone and self._leased_elsewhere(expected):
                return None
            job, slot, attempt = expected.job, expected.slot, expected.attempt
            if expected.state == "running":
                ended = {"status": "interrupted", "finished_at": now_ms, "error": reason, "output": None}
                conn.execute(_SQL_END_ATTEMPT, {**ended, "job": job, "slot": slot, "attempt": attempt})
            if expected.cancel:
                self._end(conn, expected, "cancelled", "cancelled while waiting", now_ms)
                return None
            if attempt >= max_attempts:
                return self._end(conn, expected, "failed", f"gave up after {attempt} attempts (max_attempts)", now_ms)
            if attempt == 0 and self._full(conn, job, slot, overlap):
                conn.execute(_SQL_DELETE_RUN, (job, slot))
                self._skip(conn, job, slot, owner, now_ms)
                return None
            return self._take(conn, job, slot, owner, lease, now_ms)

        return self._write(work)

    def _leased_elsewhere(self, run: _RunRow) -> bool:
        """Whether ``run``'s lease still holds by what the row does not show (SQLite's lease board)."""
        return False

    def _skip(self, conn: Any, job: str, slot: int, owner: str, now_ms: int) -> None:
        skipped = _record(job, slot, 0, "skipped", owner, finished_at=now_ms, error="an earlier run is unfinished")
        conn.execute(_SQL_RECORD, skipped)
        self._prune(conn, job)

    def _end(self, conn: Any, row: _RunRow, status: str, error: str, now_ms: int) -> RunRecord:
        """End ``row``'s run with ``status``; its last attempt's record, as written (read before the
        job's history is pruned, which may drop that record when it is an old one)."""
        conn.execute(_SQL_DELETE_RUN, (row.job, row.slot))
        conn.execute(_SQL_RECORD, _record(row.job, row.slot, row.attempt, status, finished_at=now_ms, error=error))
        written = _history_record(conn.execute(_SQL_RECORD_OF, (row.job, row.slot, row.attempt)).fetchone())
        self._prune(conn, row.job)
        return written

    # -- an attempt's writes (fenced) -------------------------------------------------------------

    def renew_all(self, owner: str, claims: Sequence[_Claim]) -> list[_Claim]:
        if self._autocommit(*self._renewal(owner, claims)) == len(claims):
            return []
        return [c for c in claims if not self._read(_SQL_IS_HELD, _held_by(c.job, c.slot, c.attempt, owner))]

    def report_progress(self, claim: _Claim, owner: str, progress: tuple[float | None, float | None]) -> None:
        done, total = progress
        self._autocommit(
            _SQL_PROGRESS, {"done": done, "total": total, **_held_by(claim.job, claim.slot, claim.attempt, owner)}
        )

    def set_process_group(self, claim: _Claim, owner: str, group: str) -> bool:
        return (
            self._autocommit(
                _SQL_SET_PROCESS_GROUP, {"group": group, **_held_by(claim.job, claim.slot, claim.attempt, owner)}
            )
            == 1
        )

    def process_group(self, job: str, slot: int) -> str | None:
        rows = self._read(_SQL_PROCESS_GROUP, (job, slot))
        return rows[0][0] if rows else None

    def finish_many(self, owner: str, ends: Sequence[_End]) -> list[bool]:
        looks = self._looks(ends)
        if len(ends) == 1 and ends[0].then is _AfterEnd.DONE and not looks[0] and self._end_alone(owner, ends[0]):
            self._ended(ends[0].claim.job, False)
            return [True]
        written = self._write(
            lambda conn: self._finish_all(conn, owner, ends, looks), lambda written: _hands_over(ends, written)
        )
        self._noted(ends, looks, written)
        return written

    def _looks(self, ends: Sequence[_End]) -> list[bool]:
        """For each end, whether it looks whether its job's history is due a prune (``_prune_due``)."""
        return [end.then is _AfterEnd.DONE and self._prune_due(end.claim.job) for end in ends]

    def _finish_all(self, conn: Any, owner: str, ends: Sequence[_End], looks: Sequence[bool]) -> list[bool]:
        return [self._finish(conn, owner, end, look) for end, look in zip(ends, looks)]

    def _noted(self, ends: Sequence[_End], looks: Sequence[bool], written: Sequence[bool]) -> None:
        """Count the ends written, once committed (a transaction run again counts once)."""
        for end, look, wrote in zip(ends, looks, written):
            if wrote:
                self._ended(end.claim.job, look)

    def _finish(self, conn: Any, owner: str, end: _End, look: bool) -> bool:
        """Write ``end`` if its attempt still holds its run; ``look``: a ``DONE`` end that looks
        whether the job's history is due a prune (``_prune_due``)."""
        held, ended = _ended_by(owner, end)
        if end.then is _AfterEnd.DONE:
            if conn.execute(_SQL_END_HELD, ended).rowcount == 0:  # not held, or others were recorded since
                if conn.execute(_SQL_DELETE_HELD, held).rowcount == 0:
                    return False  # (the attempt no longer holds its run: nothing was written)
                conn.execute(self._SQL_FINISH_ATTEMPT, ended)  # (made the newest)
        else:
            failed = int(end.then is _AfterEnd.RETRY)
            if conn.execute(_SQL_RELEASE_HELD, {**held, "not_before": end.not_before, "failed": failed}).rowcount == 0:
                return False
            if conn.execute(_SQL_END_NEWEST, ended).rowcount == 0:
                conn.execute(self._SQL_FINISH_ATTEMPT, ended)
        if look:
            self._prune(conn, end.claim.job)
        return True

    def _end_alone(self, owner: str, end: _End) -> bool:
        """Write ``end`` (its run over) as one statement that is its own transaction, when its
        record is the job's newest and the attempt holds its run: whether it did (if not, the end is
        written in a transaction, which tells the two apart). Two statements and a ``BEGIN`` fewer
        than the transaction."""
        return self._autocommit(_SQL_END_HELD, _ended_by(owner, end)[1]) == 1

    def _prune_due(self, job: str) -> bool:
        """Whether a run of ``job`` ended now looks whether its history is due a prune: at this
        store's first end of it, then once its ends have written a hundredth of the retention
        since the last look (at every run's end below 200). The look steps through a tenth more
        records than the retention, 25-50 us at the default: at every end it was a statement of the
        eleven an occurrence made. Between looks each process adds at most a hundredth of the
        retention and the attempts of one run (an end of an attempt that another follows writes
        its record but does not look)."""
        written = self._ends.get(job)
        return written is None or written + 1 >= self.retention // 100

    def _ended(self, job: str, looked: bool) -> None:
        """Count an end of ``job`` written and committed (``_prune_due``)."""
        if looked:
            self._ends[job] = 0
        elif job in self._ends:
            self._ends[job] += 1

    def _prune(self, conn: Any, job: str) -> None:
        """Prune the job's history to ``retention`` records once it holds a tenth more: each write
        of a prune changes a few pages, once every hundred records rather than at every one. At most
        ``_PRUNE_BATCH`` records at once, the oldest: a backlog (retention lowered, years of records
        left by an older version) is noted in ``backlog``, and ``tidy`` prunes the rest batch by
        batch, never holding the write lock for longer than one batch takes."""
        if conn.execute(_SQL_NTH_NEWEST, (job, self.retention + self.retention // 10)).fetchone() is None:
            if job in self.backlog:
                self.backlog -= {job}
            return
        (keep,) = conn.execute(_SQL_NTH_NEWEST, (job, self.retention)).fetchone()
        batch = conn.execute(_SQL_NTH_OLDEST_PRUNABLE, (job, _PRUNE_BATCH - 1)).fetchone()
        upto = keep if batch is None else min(keep, batch[0])
        conn.execute(_SQL_COUNT_PRUNED, (job, upto))
        pruned = conn.execute(_SQL_PRUNE_HISTORY, (job, upto)).rowcount
        conn.execute(_SQL_PRUNE_CHECKPOINTS, (job,))
        if upto == keep or not pruned:
            self.backlog -= {job}
        else:
            self.backlog |= {job}
            self.shrink = True

    def tidy(self) -> bool:
        backlog = next(iter(self.backlog), None)
        if backlog is not None:
            self._write(lambda conn: self._prune(conn, backlog), notify=False)
            return True
        if self.shrink:
            self.shrink = self._shrink()
        return self.shrink

    def _shrink(self) -> bool:
        """Give a bounded part of the file's free pages back to the system; whether more are left."""
        return False

    # -- requests from any process ----------------------------------------------------------------

    def trigger(self, job: str, now_ms: int) -> int:
        def work(conn: Any) -> int:
            if conn.execute(_SQL_JOB, (job,)).fetchone() is None:
                raise JobNotFound("no such job in the database", job=job)
            slot = now_ms
            while conn.execute(_SQL_SLOT_USED, {"job": job, "slot": slot}).fetchone():
                slot += 1
            conn.execute(_SQL_INSERT_RUN, (job, slot, now_ms))
            return slot

        return self._write(work, notify=_ASKED, again=False)

    def cancel(self, job: str, now_ms: int) -> int:
        def work(conn: Any) -> int:
            pending = conn.execute(_SQL_CANCEL_PENDING, (job,)).fetchall()
            for slot, attempt in pending:
                conn.execute(_SQL_DELETE_RUN, (job, slot))
                cancelled = _record(job, slot, attempt, "cancelled", finished_at=now_ms, error="cancelled")
                conn.execute(_SQL_RECORD, cancelled)
            return int(conn.execute(_SQL_CANCEL, (job,)).rowcount) + len(pending)

        return self._write(work, notify=lambda count: _ASKED if count else False)

    def forget(self, job: str) -> str | None:
        def work(conn: Any) -> str | None:
            read = _reader(conn)
            if not read(_SQL_JOB, (job,)):
                raise JobNotFound("no such job in the database", job=job)
            live = {p.instance: p for p in self._live_processes(read)}
            declarers = [row[0] for row in read(_SQL_DECLARERS, (job,)) if row[0] in live]
            if declarers:
                return f"the running process {', '.join(declarers)} declares it: remove it there first"
            if any(p.jobs is None for p in live.values()):
                older = ", ".join(p.instance for p in live.values() if p.jobs is None)
                return f"the running process {older} is of an older version, which does not say what it declares"
            unfinished = int(read(_SQL_JOB_RUNS, (job,))[0][0])
            if unfinished:
                return f"it has {unfinished} unfinished run{'s' if unfinished > 1 else ''}: cancel them first"
            for statement in _SQL_FORGET:
                conn.execute(statement, (job,))
            return None

        return self._write(work)

    # -- running processes ------------------------------------------------------------------------

    @abc.abstractmethod
    def _live_processes(self, read: Callable[[str, Sequence[Any]], list[Any]]) -> list[ProcessInfo]:
        """The processes running on the store (those known to be gone left out), read with ``read``."""

    def processes(self) -> list[ProcessInfo]:
        return self._live_processes(self._read)

    def peers(self) -> dict[str, frozenset[str]]:
        declared: dict[str, set[str]] = {p.instance: set() for p in self._live_processes(self._read)}
        for instance, job in self._read(_SQL_DECLARATIONS, ()):
            if instance in declared:
                declared[instance].add(job)
        return {instance: frozenset(jobs) for instance, jobs in declared.items()}

    def undeclared(self, job: str | None = None) -> list[str] | None:
        live = self._live_processes(self._read)
        if not live or any(p.jobs is None for p in live):
            return None
        sql = _SQL_UNDECLARED.format(only="name = ? AND " if job else "", live=", ".join("?" * len(live)))
        return [row[0] for row in self._read(sql, [*([job] if job else []), *(p.instance for p in live)])]

    def _declare(self, conn: Any, instance: str, declares: Sequence[str]) -> None:
        """Record the jobs ``instance`` declares, instead of those it declared, and forget the
        declarations of processes that are gone (after their ``instances`` rows)."""
        conn.execute(_SQL_UNDECLARE, (instance,))
        conn.execute(_SQL_UNDECLARE_GONE)
        conn.executemany(_SQL_DECLARE, [(name, instance) for name in declares])

    def job_statuses(self, since: int = -1) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        live = self._live_processes(self._read)
        judged = live and not any(p.jobs is None for p in live)
        undeclared = _SQL_NOT_DECLARED.format(live=", ".join("?" * len(live))) if judged else "NULL"
        args = [p.instance for p in live] if judged else []
        if self.schema < 7:  # (read-only, a file of an earlier version whose processes still run)
            rows = self._read(_SQL_JOB_STATUSES_BEFORE_7.format(undeclared=undeclared), args)
            return [(row[0], None, *row[7:]) for row in rows], [(*row[:7], None) for row in rows]
        if since < 0:
            rows = self._read(_SQL_JOB_STATUSES.format(undeclared=undeclared), args)
            return [(row[0], *row[7:]) for row in rows], [row[:8] for row in rows]
        return self._read(_SQL_JOB_MARKS.format(undeclared=undeclared), args), self._read(_SQL_JOBS_CHANGED, (since,))

    # -- checkpoints and history ------------------------------------------------------------------

    def checkpoint_get(self, job: str, slot: int, fence: tuple[int, str] | None = None) -> tuple[bool, str | None]:
        attempt, owner = (None, None) if fence is None else fence
        held, value = self._read(_SQL_CHECKPOINT_GET, _held_by(job, slot, attempt, owner))[0]
        return bool(held), value

    def checkpoint_write(
        self, job: str, slot: int, value: str | None, now_ms: int, fence: tuple[int, str] | None
    ) -> bool:
        held = _held_by(job, slot, *(fence or (None, None)))
        if value is not None:
            return self._one_write(self._SQL_CHECKPOINT_SET, {**held, "value": value, "now_ms": now_ms}) == 1
        if self._one_write(self._SQL_CHECKPOINT_DELETE, held):
            return True
        return fence is None or bool(self._read(_SQL_IS_HELD, held))  # (held, with nothing to delete?)

    def _one_write(self, sql: str, args: Mapping[str, Any]) -> int:
        """``_autocommit`` of a write that may be made again (PostgreSQL waits out a lost connection)."""
        return self._autocommit(sql, args)

    def history(self, job: str | None, limit: int) -> list[RunRecord]:
        rows = self._read(_SQL_HISTORY, (limit,)) if job is None else self._read(_SQL_JOB_HISTORY, (job, limit))
        return [_history_record(row) for row in rows]

    def timeline(self, jobs: Sequence[str], since_ms: int, until_ms: int, part_ms: int) -> list[_Stretch]:
        if not jobs:
            return []
        sql = _SQL_TIMELINE.format(jobs=", ".join("?" * len(jobs)))
        args = (since_ms, max(1, part_ms), *jobs, since_ms - 86_400_000, until_ms, since_ms)
        return [_Stretch(*row[:2], *row[3:]) for row in self._read(sql, args)]

    def figures(self) -> list[_JobFigures]:
        names = sorted(row[0] for row in self._read(_SQL_JOB_NAMES))
        records: dict[str, dict[str, int]] = {name: dict.fromkeys(_ENDED, 0) for name in names}
        newest: dict[tuple[str, str], tuple[int | None, int | None]] = {}
        for job, status, count, started, finished in self._read(_SQL_FIGURES):
            newest[job, status] = (started, finished)
            if status in _ENDED and job in records:
                records[job][status] += count
        for job, status, count in self._read(_SQL_TOTALS):
            if status in _ENDED and job in records:
                records[job][status] += count
        durations = dict(self._read(_SQL_LAST_DURATIONS))
        running = dict(self._read(_SQL_RUNNING))

        def last(job: str, statuses: Iterable[str], index: int) -> int | None:
            found = [newest[job, status][index] for status in statuses if (job, status) in newest]
            return max((t for t in found if t is not None), default=None)

        return [
            _JobFigures(
                name,
                records[name],
                last(name, ("running", *_ENDED), 0),
                last(name, ("succeeded",), 1),
                last(name, ("failed", "timed_out"), 1),
                durations.get(name),
                running.get(name, 0),
            )
            for name in names
        ]


###############################################################################
# The SQLite file #############################################################
###############################################################################

# The WAL is written back into the file once it holds this many bytes of pages (1 MiB), and cut
# back to this size after: it outgrows that only while a reader keeps an old snapshot. (A quarter of
# it makes renewals wait 2-3 times longer at p50, behind the extra checkpoints.)
_WAL_LIMIT = 1024 * 1024
# A new file's pages: a commit writes each page it changed whole into the WAL, and an occurrence
# changes about ten (a job row, a run row, a history record, their indexes): 1 KiB each instead of
# SQLite's 4 KiB default is a quarter of the bytes written to storage (a Raspberry Pi's SD card).
_PAGE_SIZE = 1024
_SHRINK_PAGES = 1024  # free pages given back at most in one transaction (a WAL's worth: _WAL_LIMIT)
#: Seconds between looks for the write lock of a process's own (``lock_poll``; up to eight times
#: it while the lock stays held): SQLite's busy handler sleeps up to 100 ms, and does not wake when
#: the lock frees.
_LOCK_POLL = 0.0005
_OPEN_RETRY = 2.0  # seconds an opening that met a transient I/O error is tried again (_SQLiteFile._connect)
_SQLITE_KEEP_NEWEST, _SQLITE_IS_NEWEST = (sql.format(schema="") for sql in (_SQL_KEEP_NEWEST, _SQL_IS_NEWEST))
_SQLITE_NEWEST_TRIGGERS = (
    f"CREATE TRIGGER IF NOT EXISTS history_added AFTER INSERT ON history BEGIN {_SQLITE_KEEP_NEWEST}; END",
    (
        "CREATE TRIGGER IF NOT EXISTS history_changed AFTER UPDATE OF status ON history "
        f"WHEN {_SQLITE_IS_NEWEST} BEGIN {_SQLITE_KEEP_NEWEST}; END"
    ),
)
_SQLITE_RUN_TRIGGERS = (  # (version 8)
    (
        f"CREATE TRIGGER IF NOT EXISTS run_added AFTER INSERT ON runs WHEN {_SQL_RUN_TAKEN} "
        f"BEGIN {_SQL_RECORD_TAKEN.format(schema='')}; END"
    ),
    (
        f"CREATE TRIGGER IF NOT EXISTS run_taken AFTER UPDATE OF attempt ON runs WHEN {_SQL_RUN_TAKEN} "
        f"BEGIN {_SQL_RECORD_TAKEN.format(schema='')}; END"
    ),
    (
        f"CREATE TRIGGER IF NOT EXISTS history_ended AFTER UPDATE OF status ON history WHEN {_SQL_RECORD_ENDED} "
        f"BEGIN {_SQL_LET_GO_ENDED.format(schema='')}; END"
    ),
)
_SQLITE_TYPES = {
    "ms": "INTEGER",
    "real": "REAL",
    "id": "INTEGER PRIMARY KEY",
    "new": "IF NOT EXISTS ",
    "rowid": " WITHOUT ROWID",
}
# One row per running scheduler process, so that a process can tell whether it starts alone, and
# what tells whether it still exists on this host; ``declares``: how many jobs it declares (NULL
# from a process of a version before 6).
_SQLITE_INSTANCES_TABLE = """CREATE TABLE IF NOT EXISTS instances (
        instance TEXT PRIMARY KEY,
        pid INTEGER NOT NULL,
        start INTEGER,
        namespace TEXT,
        boot_id TEXT,
        started_at INTEGER NOT NULL,
        host TEXT,
        declares INTEGER
    )"""
_SCHEMA = (
    *_dialect(_SQL_JOB_TABLES, _SQLITE_TYPES),
    _SQLITE_INSTANCES_TABLE,
    *_dialect((_SQL_DECLARATIONS_TABLE, *_SQL_CHECKPOINT_TABLES), _SQLITE_TYPES),
    *_SQLITE_NEWEST_TRIGGERS,
    *_SQLITE_RUN_TRIGGERS,
)
# The tables that every version of the schema has: a file with a schema version and without them is
# another application's (``_SQLiteFile._refuse_foreign``).
_OWN_TABLES = {"jobs", "runs", "history", "instances", "checkpoints"}
_MIGRATIONS: dict[int, tuple[str, ...]] = {  # (versions 2 and 3 were never written on PostgreSQL)
    2: ("ALTER TABLE checkpoints ADD COLUMN attempt INTEGER",),
    3: (
        "ALTER TABLE jobs ADD COLUMN definition TEXT",
        "ALTER TABLE jobs ADD COLUMN declared_by TEXT",
        "ALTER TABLE runs ADD COLUMN process_group TEXT",
    ),
    4: _SQL_MIGRATIONS[4],
    5: _SQL_MIGRATIONS[5],
    6: ("ALTER TABLE instances ADD COLUMN host TEXT", *_dialect(_SQL_MIGRATIONS[6], _SQLITE_TYPES)),
    7: (*_dialect(_SQL_MIGRATIONS[7], _SQLITE_TYPES), *_SQLITE_NEWEST_TRIGGERS),
    8: _SQLITE_RUN_TRIGGERS,
}

_SQL_FINISH_ATTEMPT = (  # as _SQL_END_ATTEMPT, and the record becomes the job's newest (a new id): pruning
    # keeps the newest records, and a long run must not lose its record to those written while it ran
    "INSERT OR REPLACE INTO history (job, slot, attempt, status, instance, started_at, finished_at, error, output) "
    "SELECT job, slot, attempt, :status, instance, started_at, :finished_at, :error, :output FROM history "
    "WHERE job = :job AND slot = :slot AND attempt = :attempt"
)
_SQL_INSTANCES = "SELECT instance, pid, start, namespace, boot_id, host, started_at, declares FROM instances"
_SQL_INSTANCES_BEFORE_6 = "SELECT instance, pid, start, namespace, boot_id, NULL, started_at, NULL FROM instances"
_SQL_JOIN = (
    "INSERT OR REPLACE INTO instances (instance, pid, start, namespace, boot_id, started_at, host, declares) "
    "VALUES (:instance, :pid, :start, :namespace, :boot_id, :started_at, :host, :declares)"
)
_SQL_LEAVE = "DELETE FROM instances WHERE instance = ?"


def _switch_to_wal(conn: sqlite3.Connection, path: str, timeout: float) -> None:
    """Put the file in WAL mode. While another process is switching a new file, the switch fails at
    once (no busy handler for it), so it is retried for up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            mode = str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower()
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc):
                raise
            mode = "busy"
        if mode == "wal":
            return
        if time.monotonic() > deadline:
            raise StoreError(path, f"cannot switch to WAL mode (got {mode})")
        _pause(0.01)


def _real_path(path: str) -> str:
    """The file that ``path`` names, symbolic links followed (SQLite keeps the -wal and -shm files
    beside it). As the kernel's ``protected_symlinks`` rule has it, a link in a directory that every
    user may write is followed only if this user or the directory's owner made it: whoever else
    made it could point it at any file this process may write."""
    if not os.path.islink(path):
        return path
    directory = os.path.dirname(os.path.abspath(path))
    owner, place = os.lstat(path).st_uid, os.stat(directory)
    if place.st_mode & stat.S_IWOTH and owner not in (os.geteuid(), place.st_uid):
        raise StoreError(
            path,
            f"a symbolic link owned by {_user(owner)} in {directory}, which every user may write: refused "
            "(give the path of the file itself)",
        )
    return os.path.realpath(path)


def _lenient_text(data: bytes) -> str:
    return data.decode("utf-8", "backslashreplace")


def _is_busy(exc: sqlite3.Error) -> bool:
    text = str(exc)
    return "locked" in text or "busy" in text


def _explain(exc: sqlite3.Error) -> str:
    text = str(exc)
    if "not a database" in text:
        return "not an SQLite database (file is not a database)"
    if "disk is full" in text or "database or disk is full" in text:
        return "disk full: the database cannot grow (database or disk is full)"
    if "readonly" in text or "read-only" in text:
        return f"the database is read-only ({text})"
    if _is_busy(exc):
        return f"the database stayed locked by another process past the busy timeout ({text})"
    return text


###############################################################################
# The lease board #############################################################
###############################################################################


# The lease board: what lives only while the processes live (leases renewed, progress), kept in a
# small SQLite file on a RAM filesystem (``/dev/shm``; ``$ANARCHON_BOARD_DIR`` names another
# directory, an empty value none), one per database file and boot. A lease renewal written there
# costs the database file nothing: a power cut ends every owner anyway, and the boot id voids their
# runs. The durable file keeps what must survive: claims (with their first lease), ends, checkpoints.
#
# Who may renew there, and who must still renew in the file: a process renews on the board only
# while every process recorded in the file (``instances``) is a member of the same board, itself
# included; a process enrols before its join commits. A process that cannot see this board (a
# container with its own /dev/shm, no board at all, an older version) is not a member, so while it
# runs every owner renews in the file. It may have joined after an owner's last look: it then holds
# every run of an owner not on its own board as leased until its join + that run's lease, because
# a renewal on the board lasts the lease from the instant before the owner read the file.
#
# Takeover against a renewal: an owner's renewal on the board counts only if it committed before
# the lease it held ran out (its last counted renewal on the board, or the file's lease, on the
# shared monotonic clock); a taker reads the clock, then the lease, and takes over only when the
# lease ended before that reading. A renewal committed after the taker read the board finished
# after that lease ran out, so it does not count: the owner renews in the file instead, where the
# claim's compare-and-set decides between them. Readers never wait (WAL), so a process frozen in the
# middle of a write never stops a takeover; writers that find the board locked renew in the file.
_BOARD_DIR = "/dev/shm"
_NEVER = float("-inf")
_BOARD_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS members (
        instance TEXT NOT NULL,
        pid INTEGER NOT NULL,
        start INTEGER,
        namespace TEXT,
        PRIMARY KEY (instance, pid)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS leases (
        job TEXT NOT NULL,
        slot INTEGER NOT NULL,
        attempt INTEGER NOT NULL,
        owner TEXT NOT NULL,
        until REAL NOT NULL,
        progress_done REAL,
        progress_total REAL,
        PRIMARY KEY (job, slot, attempt)
    ) WITHOUT ROWID""",
)
_SQL_ENROL = (
    "INSERT OR REPLACE INTO members (instance, pid, start, namespace) VALUES (:instance, :pid, :start, :namespace)"
)
_SQL_MEMBERS = "SELECT instance, pid, start, namespace FROM members"
_SQL_LEAVE_BOARD = "DELETE FROM members WHERE instance = ? AND pid = ?"
_SQL_BOARD_KEY = "job = :job AND slot = :slot AND attempt = :attempt AND owner = :owner"  # one attempt's lease
_SQL_BOARD_LEASE = f"SELECT until FROM leases WHERE {_SQL_BOARD_KEY}"
_SQL_BOARD_RENEW = (  # {rows}: one (?, ?, ?, ?, ?) per lease: one statement, one call into SQLite
    "INSERT INTO leases (job, slot, attempt, owner, until) VALUES {rows} ON CONFLICT (job, slot, attempt) "
    "DO UPDATE SET until = max(leases.until, excluded.until) WHERE leases.owner = excluded.owner"
)
_SQL_BOARD_PROGRESS = f"UPDATE leases SET progress_done = :done, progress_total = :total WHERE {_SQL_BOARD_KEY}"
_SQL_BOARD_LEASES = "SELECT job, slot, attempt, owner, until, progress_done, progress_total FROM leases"
# (an ended attempt's lease is left to expire: a round of renewals deletes what expired a minute ago)
_SQL_BOARD_PURGE = "DELETE FROM leases WHERE until < ?"
# What the file says of the processes, and of one owner's runs, for a renewal on the board.
_SQL_INSTANCE_IDS = "SELECT instance, pid, start, namespace FROM instances"
_SQL_HELD_BY = "SELECT job, slot, attempt, lease_until, lease FROM runs WHERE owner = ? AND state = 'running'"

_Member = tuple[str, int, Union[int, None], Union[str, None]]  # (instance, pid, start, pid namespace)


class _BoardLease(NamedTuple):
    owner: str
    until: float
    progress: tuple[float | None, float | None]


class _Board:
    """The lease board of one database file (see above). Every call is one short transaction; any
    failure is reported as "not on the board" (None or False), and the caller uses the file. A board
    this process may not trust (see trust: whoever made its name could lie about leases) is refused
    once, at ERROR, and the file used. The last member to close it removes it."""

    def __init__(self, path: str, shared_group: bool = False):
        self.path = path
        self._shared_group = shared_group
        self._refused = False  #: the board is not to be trusted: never used
        self._identity: tuple[int, int] | None = None  #: (device, inode) of the board opened
        self._conn: sqlite3.Connection | None = None
        self._members: tuple[int, set[_Member]] | None = None  # (the data_version they were read at, them)
        self._purged = _NEVER  # when (lease clock) expired leases were last deleted

    @classmethod
    def of(
        cls, directory: str | None, identity: tuple[int, int], boot_id: str | None, shared_group: bool = False
    ) -> _Board | None:
        """The board of the database file ``identity`` (device, inode) in ``directory``, if any."""
        if not directory:
            return None
        key = _digest(f"{identity[0]}:{identity[1]}:{boot_id}")
        return cls(os.path.join(os.path.realpath(directory), f"anarchon_lite-{key}.board"), shared_group)

    def _connect(self, create: bool) -> sqlite3.Connection | None:
        if self._conn is not None or self._refused:
            return self._conn
        try:
            self._check_place(create)
            if not os.path.exists(self.path):
                return None
            conn = sqlite3.connect(self.path, timeout=0.05, isolation_level=None, check_same_thread=False)
        except StoreError as exc:
            self._refuse(exc)
            return None
        except (OSError, sqlite3.Error) as exc:
            _log.debug("no lease board at %s: %s", self.path, exc)
            return None
        try:
            _switch_to_wal(conn, self.path, 1.0)
            conn.execute("PRAGMA synchronous = OFF")  # (RAM: nothing to sync; its WAL stays small)
            conn.execute("PRAGMA wal_autocheckpoint = 64")
            conn.execute("PRAGMA journal_size_limit = 262144")
            for statement in _BOARD_SCHEMA:
                conn.execute(statement)
        except (StoreError, sqlite3.Error) as exc:
            _log.debug("the lease board at %s cannot be used: %s", self.path, exc)
            conn.close()
            return None
        try:
            self._identity = self._check_opened()
        except StoreError as exc:
            conn.close()
            self._refuse(exc)
            return None
        self._conn = conn
        return conn

    def _check_place(self, create: bool) -> None:
        """Refuse (``StoreError``) a board this process may not trust, before SQLite opens it; make
        it if ``create`` and it is missing (never through a link planted at its name)."""
        directory = os.path.dirname(self.path)
        _check_trusted(directory, "the lease board's directory", os.stat(directory), self._shared_group, True)
        if create:
            _create_file(self.path, self._shared_group)
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                _check_trusted(
                    self.path + suffix, _board_what(suffix), os.lstat(self.path + suffix), self._shared_group
                )

    def _check_opened(self) -> tuple[int, int] | None:
        """Refuse the files SQLite opened if this process may not trust them; the board's identity."""
        found = _opened(self.path + suffix for suffix in ("", "-wal", "-shm")) or {}
        for name, statuses in found.items():
            for status in statuses:
                _check_trusted(name, _board_what(name[len(self.path) :]), status, self._shared_group)
        mine = found.get(self.path)
        return (mine[0].st_dev, mine[0].st_ino) if mine else None

    def _refuse(self, exc: StoreError) -> None:
        _log.error("%s; leases are renewed in the database file instead", exc)
        self._refused = True

    def _write(self, work: Callable[[sqlite3.Connection], T], transaction: bool = True) -> T | None:
        """``work``'s result, or None if the board could not be written. Without ``transaction``
        each of its statements commits alone (two calls into SQLite fewer)."""
        conn = self._connect(create=True)
        if conn is None:
            return None
        try:
            if not transaction:
                return work(conn)
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = work(conn)
                conn.execute("COMMIT")
                return result
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            _log.debug("lease board write failed: %s", exc)
            return None

    def _read(self, sql: str, args: Sequence[Any] | dict[str, Any] = ()) -> list[Any]:
        conn = self._connect(create=False)
        if conn is None:
            return []
        try:
            return conn.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            _log.debug("lease board read failed: %s", exc)
            return []

    def enrol(self, me: _Member) -> bool:
        """Make this process a member (before its join commits)."""
        self._members = None  # (this connection's own write does not change its data_version)
        member = dict(zip(("instance", "pid", "start", "namespace"), me))
        return self._write(lambda conn: conn.execute(_SQL_ENROL, member)) is not None

    def members(self) -> set[_Member]:
        """The members, read again only when another connection has written the board since (a
        renewal behind a computing thread waits a switch interval for every call into SQLite)."""
        version = self._read("PRAGMA data_version")
        if not version:
            return set()
        if self._members is None or self._members[0] != version[0][0]:
            self._members = (version[0][0], {tuple(row) for row in self._read(_SQL_MEMBERS)})
        return self._members[1]

    def until(self, run: _RunRow) -> float | None:
        """Until when (lease clock) the board says ``run``'s owner holds it, if it says."""
        rows = self._read(
            _SQL_BOARD_LEASE, {"job": run.job, "slot": run.slot, "attempt": run.attempt, "owner": run.owner}
        )
        return float(rows[0][0]) if rows else None

    def leases(self) -> dict[tuple[str, int, int], _BoardLease]:
        return {(j, s, a): _BoardLease(o, u, (d, t)) for j, s, a, o, u, d, t in self._read(_SQL_BOARD_LEASES)}

    def renew(self, owner: str, leases: Sequence[tuple[tuple[str, int, int], float]], now: float) -> bool:
        """Extend each ``((job, slot, attempt), until)`` of ``owner``'s, in one statement; False if
        that failed. (Now and then, first, the leases that expired a minute before ``now`` go.)"""
        rows = ", ".join(["(?, ?, ?, ?, ?)"] * len(leases))

        def work(conn: sqlite3.Connection) -> bool:
            if now - self._purged > 10.0:
                conn.execute(_SQL_BOARD_PURGE, (now - 60.0,))
                self._purged = now
            conn.execute(_SQL_BOARD_RENEW.format(rows=rows), [v for key, until in leases for v in (*key, owner, until)])
            return True

        return self._write(work, transaction=False) is not None

    def report(self, claim: _Claim, owner: str, progress: tuple[float | None, float | None]) -> bool:
        """Keep an attempt's progress with its lease; False if the board has no lease of it."""
        done, total = progress
        key = {"job": claim.job, "slot": claim.slot, "attempt": claim.attempt, "owner": owner}
        return bool(
            self._write(lambda conn: conn.execute(_SQL_BOARD_PROGRESS, {"done": done, "total": total, **key}).rowcount)
        )

    def leave(self, me: _Member) -> None:
        """This process (``me``) is no longer a member."""
        self._write(lambda conn: conn.execute(_SQL_LEAVE_BOARD, me[:2]))

    def close(self) -> None:
        """Close the board; remove it when no member is left (as this process's ``/proc`` tells;
        members in another pid namespace count as alive) and this was the last connection to it
        anywhere (SQLite then removes its -wal and -shm). A process that opened it meanwhile, and
        now renews on a board of its own, is not a member of the next one's: each renews in the file
        while the other runs (see the lease board)."""
        if self._conn is None:
            return
        try:
            left = [row for row in self._conn.execute(_SQL_MEMBERS) if _member_alive(tuple(row))]
        except sqlite3.Error:
            left = [None]
        self._conn.close()
        self._conn = None
        if left or self._identity is None or any(os.path.exists(self.path + s) for s in ("-wal", "-shm")):
            return
        with contextlib.suppress(OSError):
            status = os.lstat(self.path)
            if (status.st_dev, status.st_ino) == self._identity:
                os.unlink(self.path)


def _board_what(suffix: str) -> str:
    return f"the lease board's {suffix} file" if suffix else "the lease board"


def _member_alive(member: _Member) -> bool:
    """Whether a member of a board may still run (one in another pid namespace may)."""
    me = _this_owner("")
    if member[3] != me.namespace or member[3] is None:
        return True
    state = _process_start(member[1])
    return state is not None and state[0] not in ("Z", "X") and member[2] in (None, state[1])


###############################################################################
# The SQLite store ############################################################
###############################################################################


class _SQLiteFile(_SQLStore):
    """The SQLite file under a store: opening it (trusted, in WAL mode, its schema made or
    migrated), noticing it was replaced, and running transactions on this object's connection.
    ``_SQLiteStore`` adds the processes and the lease board.
    """

    _SQL_FINISH_ATTEMPT = _SQL_FINISH_ATTEMPT

    def __init__(
        self,
        path: str,
        *,
        busy_timeout: float = 30.0,
        synchronous: str = "FULL",
        lock_poll: float | None = None,
        read_only: bool = False,
        autocheckpoint: bool = True,
        waitless: bool = False,
        clock: Clock | None = None,
        board_dir: str | None = None,
        granted: dict[tuple[str, int, int], float] | None = None,
        shared_group: bool = False,
    ):
        self.path = path
        super().__init__()
        self._shared_group = shared_group  #: trust files of this process's groups (see trust)
        # Leases are stamped and compared on this clock's ``monotonic()``: on Linux one clock for
        # every process of a boot, whatever the wall clock does.
        self._clock = clock or Clock()
        self._me = _this_owner("")  # this process, as an owner of runs (a store never crosses a fork)
        self._alive = _Alive()  # the other processes judged alive, held by pidfd
        self._read_only = read_only
        # Without ``autocheckpoint``, a commit never writes the WAL back into the file itself (the
        # heartbeat connections: a renewal must not wait for that); ``checkpoint()`` does it.
        self._autocheckpoint = autocheckpoint
        # With ``waitless`` (the scheduler's connection, syncing the disk only at checkpoints), calls
        # may run on the event loop's thread (``run_on_loop``): they never wait for the write lock
        # there (``_would_wait``), and the checkpoint after a commit is made by the store's thread
        # (``_committed``), since it syncs the disk.
        self._waitless = waitless and lock_poll is not None and not read_only
        self._wal = ""  # the -wal beside the file opened
        self._wal_due = False  #: the WAL holds ``_WAL_LIMIT``: the next commit is to write it back
        self._busy_timeout = busy_timeout
        self._synchronous = synchronous
        # With ``lock_poll``, a single-statement write looks for the lock this often (seconds) instead
        # of in SQLite's busy handler, whose sleeps grow to 100 ms and do not end when the lock frees:
        # under heavy contention, other writers keep taking the lock while it sleeps.
        self._lock_poll = lock_poll
        self._conn: sqlite3.Connection | None = None
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file opened
        #: (device, inode) of the -wal and -shm files opened with it, by suffix
        self._beside: dict[str, tuple[int, int]] = {}
        self._lost_beside = False  #: the path no longer names them (``rescue`` before closing)
        self._board_dir = board_dir  # where the lease board lives (None: renew in the file only)
        self._board: _Board | None = None
        self._on_board = False  #: the last renewal was made on the board (progress goes there too)
        # What a renewal on the board last read of the file: (data_version, owner, whether every
        # process of the file is a member of the board, the runs held: their lease's end and length)
        self._snapshot: tuple[int, str, bool, dict[tuple[str, int, int], tuple[float, float]]] | None = None
        # Until when this process's last counted renewals on the board hold, by attempt (shared by
        # its heartbeat thread's store and its event loop's: either may renew a round)
        self._granted: dict[tuple[str, int, int], float] = {} if granted is None else granted
        # When this process joined (lease clock): an owner not on its board may have renewed
        # elsewhere until then, and its runs count as leased until then + their lease.
        self._joined_at = self._clock.monotonic()

    def _owner(self) -> _Owner:
        return self._me

    # -- connection -------------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        if self.path in (":memory:", ""):  # (declaring jobs on such a scheduler, as tests do, opens nothing)
            raise _Refused(
                self.path,
                "not supported: the processes of a scheduler share one file; give the path of one "
                "(in a test, a file in a temporary directory)",
            )
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise StoreError(self.path, f"directory {directory} does not exist")
        if self._read_only:
            self._conn = self._connect_read_only()
            return self._conn
        real = _real_path(self.path)
        self._check_place(real)
        # Several processes opening a new file at once race to switch it to WAL, and the loser can
        # get a transient "disk I/O error": such an opening is tried again, with a new connection,
        # for up to _OPEN_RETRY s.
        deadline = time.monotonic() + _OPEN_RETRY
        while True:
            try:
                conn = sqlite3.connect(real, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False)
            except sqlite3.Error as exc:
                raise StoreError(self.path, f"cannot open the database: {self._explain(exc)}") from None
            try:
                conn.create_function("lease_clock", 0, self._clock.monotonic)
                self._check_opened(real, ("",))  # (before anything is read from it)
                self._prepare(conn)
                if self._lock_poll:
                    conn.execute("PRAGMA busy_timeout = 0")  # writes look for the lock themselves
                status = os.stat(self.path)
                self._beside = self._check_opened(real, ("", "-wal", "-shm"))
            except StoreError as exc:
                conn.close()
                if "disk I/O error" not in str(exc) or time.monotonic() > deadline:
                    raise
                _pause(0.02)
                continue
            except BaseException:
                conn.close()
                raise
            self._conn, self._identity, self._wal = conn, (status.st_dev, status.st_ino), real + "-wal"
            return conn

    def _check_place(self, real: str) -> None:
        """Refuse (``StoreError``) what this process may not trust before SQLite opens anything: the
        file's directory, the file, its -wal and -shm (as they are now; ``_check_opened`` looks at
        what was opened). A missing file is created, never through a link planted at its name.
        Never open and close an existing file here: closing any descriptor of a file drops every
        POSIX lock this process holds on it, SQLite's too, and another process would then think the
        WAL unused and delete it."""
        directory = os.path.dirname(os.path.abspath(real))
        _check_trusted(directory, "the database's directory", os.stat(directory), self._shared_group, directory=True)
        try:
            _create_file(real, self._shared_group)
        except OSError as exc:
            if os.path.isdir(real):
                raise StoreError(self.path, "is a directory, not a database file") from None
            raise StoreError(self.path, f"cannot create the database file: {exc.strerror}") from None
        for suffix in ("", "-wal", "-shm"):
            try:
                status = os.lstat(real + suffix)
            except FileNotFoundError:
                continue
            if suffix == "" and stat.S_ISDIR(status.st_mode):
                raise StoreError(self.path, "is a directory, not a database file")
            _check_trusted(real + suffix, _what(suffix), status, self._shared_group)

    def _check_opened(self, real: str, suffixes: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Refuse the files SQLite opened (the database, and its -wal and -shm files: ``suffixes``)
        if this process may not trust them (a file swapped in after ``_check_place`` looked); their
        (device, inode) by suffix, as the open files say. Without ``/proc``, as the paths say."""
        full = os.path.realpath(real)
        names = {full + suffix: suffix for suffix in suffixes}
        found = _opened(names)
        identities = {}
        for name, suffix in names.items():
            what = _what(suffix)
            statuses = found[name] if found is not None else [os.stat(name)] if os.path.exists(name) else []
            for status in statuses:
                _check_trusted(name, what, status, self._shared_group)
                identities[suffix] = (status.st_dev, status.st_ino)
        return identities

    def _connect_read_only(self) -> sqlite3.Connection:
        """Open the file only to read it: nothing is created, switched or migrated. In a directory
        this process cannot write, with no other process using the file (no ``-wal`` to read), the
        file is opened as immutable: there is nothing newer than the file itself to see."""
        if not os.path.exists(self.path):
            raise StoreError(self.path, "no such database file")
        if os.path.isdir(self.path):
            raise StoreError(self.path, "is a directory, not a database file")
        import urllib.parse

        uri = "file:" + urllib.parse.quote(os.fsencode(os.path.abspath(self.path))) + "?mode=ro"
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.access(directory, os.W_OK) and not os.path.exists(self.path + "-wal"):
            uri += "&immutable=1"
        try:
            conn = sqlite3.connect(
                uri, uri=True, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
            )
            conn.create_function("lease_clock", 0, self._clock.monotonic)
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if self._lock_poll:
                conn.execute("PRAGMA busy_timeout = 0")  # (``_read`` waits itself: not twice the timeout)
        except sqlite3.Error as exc:
            raise StoreError(self.path, f"cannot read the database: {self._explain(exc)}") from None
        if version > SCHEMA_VERSION:
            conn.close()
            self._refuse_newer(version)
        if version == 0:
            conn.close()
            raise StoreError(self.path, "not an anarchon_lite database (it has no schema)")
        self.schema = version
        return conn

    def _explain(self, exc: sqlite3.Error) -> str:
        """``_explain``, and for a file that cannot be opened, whether permissions are why."""
        text = _explain(exc)
        if "unable to open" not in text:
            return text
        directory = os.path.dirname(os.path.abspath(self.path))
        if os.path.exists(self.path) and not os.access(self.path, os.R_OK | (0 if self._read_only else os.W_OK)):
            return f"permission denied: this process (uid {os.geteuid()}) cannot {'read' if self._read_only else 'write'} it ({text})"
        if not self._read_only and not os.access(directory, os.W_OK):
            return (
                f"permission denied: this process (uid {os.geteuid()}) cannot write its directory {directory}, "
                f"where the -wal and -shm files live ({text})"
            )
        return text

    def file_changed(self) -> str | None:
        """Which of the files this store opened the path no longer names, as a sentence: the
        database file, or its -wal or -shm file (SQLite keeps them open by descriptor: a process
        opening the path now would make new ones, and each would believe it alone writes the file)."""
        if self._conn is None or self._identity is None:
            return None
        change = self._changed(self.path, self._identity)
        if change is not None:
            return f"the database file {self.path} was {change} while in use"
        real = _real_path(self.path)
        for suffix, identity in self._beside.items():
            change = self._changed(real + suffix, identity) if suffix else None
            if change is not None:
                self._lost_beside = True
                return f"the {suffix} file of the database {self.path} was {change} while in use"
        return None

    @staticmethod
    def _changed(path: str, identity: tuple[int, int]) -> str | None:
        try:
            status = os.stat(path)
        except FileNotFoundError:
            return "deleted"
        except OSError:
            return None
        return None if (status.st_dev, status.st_ino) == identity else "replaced"

    def rescue(self) -> None:
        """After its -wal or -shm was deleted or replaced (``file_changed``): write what the WAL
        this connection still has open holds into the file itself, so that the processes that open
        the path afresh find every commit; unless one already has (new -wal and -shm files are at
        the path: writing into the file under it could corrupt what it reads). Then close."""
        conn, real = self._conn, _real_path(self.path)
        lost, self._lost_beside = self._lost_beside, False
        if lost and conn is not None and not (os.path.exists(real + "-wal") or os.path.exists(real + "-shm")):
            deadline = time.monotonic() + 2.0
            try:
                while conn.execute("PRAGMA wal_checkpoint(FULL)").fetchone()[0] and time.monotonic() < deadline:
                    _pause(0.01)  # (busy: a process of the same group is writing)
            except sqlite3.Error as exc:
                _log.error("%s: the WAL of the file's deleted -wal could not be written back: %s", self.path, exc)
        self.close()

    def _refuse_newer(self, version: int) -> None:
        raise StoreError(
            self.path, f"written by a newer anarchon_lite (schema version {version}; this one knows {SCHEMA_VERSION})"
        )

    def _prepare(self, conn: sqlite3.Connection) -> None:
        try:
            version = self._refuse_foreign(conn)
            if version > SCHEMA_VERSION:
                self._refuse_newer(version)
            if version == 0:  # (a file with anything in it keeps its page size and page map)
                conn.execute(f"PRAGMA page_size = {_PAGE_SIZE}")
                conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # free pages can be given back (``_shrink``)
            _switch_to_wal(conn, self.path, self._busy_timeout)
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            pages = _WAL_LIMIT // int(conn.execute("PRAGMA page_size").fetchone()[0])
            by_itself = self._autocheckpoint and not self._waitless
            conn.execute(f"PRAGMA wal_autocheckpoint = {pages if by_itself else 0}")
            conn.execute(f"PRAGMA journal_size_limit = {_WAL_LIMIT}")
            if version < SCHEMA_VERSION:
                self._create_schema(conn)
        except sqlite3.DatabaseError as exc:
            raise StoreError(self.path, self._explain(exc)) from None

    def _refuse_foreign(self, conn: sqlite3.Connection) -> int:
        """Refuse, before anything is written to it, a file that is neither new (no schema at all:
        an empty file, or one whose creation stopped before its schema was written) nor ours (a
        schema version and the tables of every version); its schema version. (Read in one
        transaction: another process may be creating the schema meanwhile.)"""
        conn.execute("BEGIN")
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            schema = conn.execute("SELECT type, name FROM sqlite_master").fetchall()
        finally:
            if conn.in_transaction:  # (a read that failed may have ended it: its error is the one to tell)
                conn.execute("COMMIT")
        tables = {name for kind, name in schema if kind == "table"}
        if (version == 0 and not schema) or (version > 0 and _OWN_TABLES <= tables):
            return version
        named = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        raise _Refused(
            self.path,
            f"not an anarchon_lite database (it has {'tables ' + named if tables else 'no tables'} and schema "
            f"version {version}): refused, nothing written to it (give the path of a new file)",
        )

    def _create_schema(self, conn: sqlite3.Connection) -> None:
        """Create the schema in a new file, or migrate an older one in place (one transaction)."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                for statement in _SCHEMA:
                    conn.execute(statement)
            elif version < SCHEMA_VERSION:
                _log.info("%s: migrating the schema from version %s to %s", self.path, version, SCHEMA_VERSION)
                for step in range(version + 1, SCHEMA_VERSION + 1):
                    for statement in _MIGRATIONS[step]:
                        conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._snapshot = None  # (a new connection counts its data_version afresh)
        if self._board is not None:
            self._board.close()

    def _write(self, work: Callable[[sqlite3.Connection], T], notify: _Telling[T] = True, again: bool = True) -> T:
        """Run ``work`` inside ``BEGIN IMMEDIATE`` ... ``COMMIT``; roll back on any error. (Every
        commit that changed a page wakes the other processes: it writes the -wal file that they
        watch; one that changed nothing writes nothing, whatever ``notify`` says.)"""
        conn = self._connect()
        self._begin_write(conn)
        wrote = self.wrote
        try:
            result = work(conn)
            self.wrote = True  # (from its commit on, a call is never made again: a signal may come after)
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                    self.wrote = wrote
                except sqlite3.Error:
                    pass
            if isinstance(exc, sqlite3.Error):
                raise StoreError(self.path, self._explain(exc)) from None
            raise
        self._committed()
        if notify in (_ASKED, _NOW) or (callable(notify) and notify(result) in (_ASKED, _NOW)):
            self._ask()
        return result

    def _ask(self) -> None:
        """Have the other processes read what was just committed soon, not coalesced: the database
        file's times touched, which their ``_FileWatch`` tells at once (no commit changes them; any
        process that may write the file may set them to now). Where they cannot be set (a file
        system that refuses it, an immutable file), the others read the change within ``coalesce``."""
        try:
            os.utime(_real_path(self.path), follow_symlinks=False)
        except (OSError, StoreError):
            pass

    def _begin_write(self, conn: sqlite3.Connection) -> None:
        """``BEGIN IMMEDIATE``: the write lock, waited for up to ``busy_timeout``. With ``lock_poll``
        this process looks for it itself, every ``lock_poll`` at first and at most every eight: four
        processes claiming 10,000 runs due at once in batches of 100 waited in SQLite's busy handler
        for up to 1.1 s a batch (its sleeps grow to 100 ms, and the lock changes hands meanwhile)."""
        pause, deadline = self._lock_poll or 0.0, math.inf
        longest = pause * 8
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.Error as exc:
                if not pause or not _is_busy(exc) or time.monotonic() > deadline:
                    raise StoreError(self.path, self._explain(exc)) from None
            self._would_wait()
            deadline = min(deadline, time.monotonic() + self._busy_timeout)
            _pause(pause)
            pause = min(pause * 2, longest)

    def _read(self, sql: str, args: Sequence[Any] | Mapping[str, Any] = ()) -> list[Any]:
        conn = self._connect()
        deadline = math.inf  # (set at the first busy answer: nothing more on the way of every read)
        while True:
            try:
                return conn.execute(sql, args).fetchall()
            except sqlite3.OperationalError as exc:
                if self._lock_poll and _is_busy(exc) and time.monotonic() < deadline:
                    self._would_wait()
                    deadline = min(deadline, time.monotonic() + self._busy_timeout)
                    _pause(self._lock_poll)  # (a reader waits only while another process recovers the WAL)
                    continue
                if not str(exc).startswith("Could not decode"):
                    raise StoreError(self.path, _explain(exc)) from None
                break
            except sqlite3.Error as exc:
                raise StoreError(self.path, _explain(exc)) from None
        # Text that is not UTF-8, written by another program: read again, its bad bytes escaped (a
        # text factory of Python's on every read would cost a status of 10,000 jobs a third more).
        conn.text_factory = _lenient_text
        try:
            return conn.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(self.path, _explain(exc)) from None
        finally:
            conn.text_factory = str

    def _shrink(self) -> bool:
        """Give ``_SHRINK_PAGES`` of the file's free pages back to the system (an incremental
        vacuum: the pages at the file's end move into free ones, and the file is cut short when the
        WAL is written back), while a quarter of its pages or more are free; whether more are left.
        A file made by an older anarchon_lite (``PRAGMA auto_vacuum`` 0) has no page map for it and
        keeps its size: ``PRAGMA auto_vacuum = INCREMENTAL`` then ``VACUUM``, with no scheduler
        running, shrinks it once and makes it one that shrinks (docs/database.md, "The file")."""

        def work(conn: sqlite3.Connection) -> bool:
            free = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
            pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
            if not free or free * 4 < pages or conn.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
                return False
            for _ in range(min(free, _SHRINK_PAGES)):  # (a step gives one page back; Python steps it once)
                conn.execute("PRAGMA incremental_vacuum(1)")
            return True

        if self._write(work, notify=False):
            return True
        self._write_back()  # (the file is cut short as the WAL is written back)
        return False

    def maintain(self) -> None:
        """Write the WAL back into the file once it holds twice ``_WAL_LIMIT``, never waiting for
        readers or writers (a passive checkpoint). While the scheduler's own connection writes, its
        commits keep the WAL under ``_WAL_LIMIT`` and this does nothing; when only renewals write (a
        long run and nothing else), this is what bounds the WAL."""
        try:
            size = os.stat(_real_path(self.path) + "-wal").st_size
        except OSError:
            return
        if size > 2 * _WAL_LIMIT:
            self._write_back()

    def _write_back(self) -> None:
        """Write the WAL back into the file without waiting for anyone (a passive checkpoint); once
        the whole of it is, begin it anew at once with a write on this thread (the schema version
        written as it is): with ``synchronous = NORMAL`` the first commit into a WAL begun anew
        syncs its header, and that commit must not be one made on an event loop's thread."""
        busy, log, done = self._read("PRAGMA wal_checkpoint(PASSIVE)")[0]
        if busy or log <= 0 or done != log:
            return
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error:
            return  # (another process writes now, or is about to: its commit begins the WAL anew)
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            conn.execute(f"PRAGMA user_version = {version}")
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            if not isinstance(exc, sqlite3.Error):
                raise

    def data_version(self) -> int:
        """A number that changes whenever another connection commits to the file."""
        return int(self._read("PRAGMA data_version")[0][0])

    def _autocommit(self, sql: str, args: Sequence[Any] | Mapping[str, Any]) -> int:
        """One write statement, its own transaction; returns the number of rows it changed."""
        conn = self._connect()
        deadline = time.monotonic() + self._busy_timeout
        wrote = self.wrote
        while True:
            try:
                self.wrote = True  # (as in ``_write``: the statement commits as it ends)
                changed = int(conn.execute(sql, args).rowcount)
            except sqlite3.OperationalError as exc:
                self.wrote = wrote
                if not self._lock_poll or not _is_busy(exc) or time.monotonic() > deadline:
                    raise StoreError(self.path, _explain(exc)) from None
            except sqlite3.Error as exc:
                self.wrote = wrote
                raise StoreError(self.path, _explain(exc)) from None
            else:
                if changed:
                    self._committed()
                else:
                    self.wrote = wrote
                return changed
            self._would_wait()
            _pause(self._lock_poll)

    @property
    def waitless(self) -> bool:
        return self._waitless and self._conn is not None and not self._wal_due

    def _committed(self) -> None:
        """After a commit (of a ``waitless`` store): note that a call on the event loop's thread
        wrote, and write the WAL back into the file once it holds ``_WAL_LIMIT``, as SQLite does
        after a commit by itself, but never on the loop's thread, since a checkpoint syncs the disk:
        the next call goes to the store's thread (``waitless`` is false), whose commit makes it
        (``_write_back``)."""
        if not self._waitless:
            return
        self.wrote = True
        try:
            self._wal_due = os.stat(self._wal).st_size > _WAL_LIMIT
            if self._wal_due and not self.on_loop:
                with contextlib.suppress(StoreError):  # (as SQLite's own: a commit never fails for it)
                    self._write_back()
                self._wal_due = os.stat(self._wal).st_size > _WAL_LIMIT
        except OSError:
            return


# A batch of claims at once (SQLite 3.33 and newer: ``UPDATE ... FROM``), each statement led by its
# verb (Python's sqlite3 counts the rows changed only then): each job's watermark moved where it is as
# expected, with a change number of its own (the first ``?``, above every number before, plus its
# place in the batch); then which of them moved, when not all; whether any of them has a run; their runs.
_SET_CLAIMS = sqlite3.sqlite_version_info >= (3, 33)
_SQL_MAX_CHANGE = "SELECT COALESCE(MAX(changed), 0) FROM jobs"
_SQL_BATCH = "(SELECT column1 AS i, column2 AS job, column3 AS slot, column4 AS next_slot, column5 AS expected_last FROM (VALUES {rows}))"
_SQL_ADVANCE_ALL = (
    "UPDATE jobs SET last_slot = v.slot, next_slot = v.next_slot, changed = ? + v.i "
    "FROM {batch} AS v WHERE jobs.name = v.job AND jobs.last_slot = v.expected_last AND jobs.paused = 0"
)
_SQL_ADVANCED = "SELECT group_concat(v.i) FROM {batch} AS v JOIN jobs ON jobs.name = v.job AND jobs.changed = ? + v.i"
_SQL_ANY_RUN = "SELECT EXISTS (SELECT 1 FROM runs WHERE job IN ({rows}))"
_SQL_INSERT_ALL_RUNNING = (
    "INSERT INTO runs (job, slot, attempt, state, not_before, owner, owner_pid, owner_start, owner_ns, boot_id, "
    "lease_until, lease, started_at) SELECT v.column1, v.column2, 1, 'running', ?, ?, ?, ?, ?, ?, "
    "lease_clock() + v.column3, v.column3, ? FROM (VALUES {rows}) AS v WHERE true"
)


class _SQLiteStore(_SQLiteFile):
    """The store in one SQLite file in WAL mode, shared by the processes of one host.

    Each method is one transaction on this object's own connection: read-then-write transactions
    start with ``BEGIN IMMEDIATE`` so they wait (bounded by ``busy_timeout``) for the write lock
    instead of failing on an upgrade. Leases are on the clock's ``monotonic()``, renewed on the
    lease board while it can be; owners are judged by pid, start time, pid namespace and boot id
    (``_owner_gone``).
    """

    # -- claims -----------------------------------------------------------------------------------

    def _claim_all_due(self, conn: Any, owner: str, now_ms: int, due: Sequence[_Due]) -> list[_Claimed]:
        """As the generic one, when every job's occurrence is to run and none was missed (a burst),
        in four statements for the batch instead of three a job: the watermarks moved in one
        ``UPDATE``, the runs inserted in one ``INSERT`` if none of these jobs has a run (else a
        job at a time, as the generic one: a run may be in the way). A burst's loop waits for each
        batch: claiming 100 jobs took its thread 2.7 ms a job at a time, 1.4 ms at once."""
        if (
            len(due) < 2
            or not _SET_CLAIMS
            or any(item.missed or not item.run for item in due)
            or len({item.job for item in due}) < len(due)
        ):
            return super()._claim_all_due(conn, owner, now_ms, due)
        base = int(conn.execute(_SQL_MAX_CHANGE).fetchone()[0])
        batch = _SQL_BATCH.format(rows=", ".join(["(?, ?, ?, ?, ?)"] * len(due)))
        params = [base, *(x for i, d in enumerate(due, 1) for x in (i, d.job, d.slot, d.next_slot, d.expected_last))]
        if conn.execute(_SQL_ADVANCE_ALL.format(batch=batch), params).rowcount == len(due):
            moved = [False] * len(due)
        else:  # (the jobs another process moved first keep their change number)
            found = conn.execute(_SQL_ADVANCED.format(batch=batch), [*params[1:], base]).fetchone()[0] or ""
            advanced = {int(i) for i in found.split(",") if i}
            moved = [i not in advanced for i in range(1, len(due) + 1)]
        mine = [d for d, m in zip(due, moved) if not m]
        if not mine:
            return [_NotClaimed.MOVED] * len(due)
        if conn.execute(_SQL_ANY_RUN.format(rows=", ".join(["?"] * len(mine))), [d.job for d in mine]).fetchone()[0]:
            claimed = iter([self._claim_advanced(conn, owner, now_ms, d) for d in mine])
        else:
            me = self._owner()
            holder = [now_ms, owner, me.pid, me.start, me.namespace, me.boot_id, now_ms]
            rows = ", ".join(["(?, ?, ?)"] * len(mine))
            conn.execute(
                _SQL_INSERT_ALL_RUNNING.format(rows=rows), holder + [x for d in mine for x in (d.job, d.slot, d.lease)]
            )
            claimed = iter([_Claim(d.job, d.slot, 1, 0, now_ms) for d in mine])
        return [_NotClaimed.MOVED if m else next(claimed) for m in moved]

    # -- running processes ------------------------------------------------------------------------

    def join(self, instance: str, now_ms: int, declares: Sequence[str]) -> bool:
        me = dataclasses.replace(self._me, instance=instance)
        board = self._the_board()
        if board is not None:
            board.enrol(self._member(instance))  # (before the join commits: see the lease board)

        def work(conn: sqlite3.Connection) -> bool:
            others = [_Owner(*row[:5]) for row in conn.execute(_SQL_INSTANCES) if row[0] != me.instance]
            alive = 0
            for other in others:
                if _owner_gone(other, me) is not None:
                    conn.execute(_SQL_LEAVE, (other.instance,))
                else:
                    alive += 1
            row = {
                **dataclasses.asdict(me),
                "started_at": now_ms,
                "host": socket.gethostname(),
                "declares": len(declares),
            }
            conn.execute(_SQL_JOIN, row)
            self._declare(conn, instance, declares)
            return alive == 0

        alone = self._write(work)
        self._joined_at = self._clock.monotonic()
        return alone

    def _live_processes(self, read: Callable[[str, Sequence[Any]], list[Any]]) -> list[ProcessInfo]:
        me = self._owner()
        self._connect()  # (``schema`` is known once connected)
        rows = sorted(read(_SQL_INSTANCES if self.schema >= 6 else _SQL_INSTANCES_BEFORE_6, ()))
        others = [_Owner(*row[:5]) for row in rows if row[0] != me.instance]
        gone = iter(self._alive.gone(others, me))
        self._alive.keep(others)
        return [
            ProcessInfo(row[0], row[1], row[5], _utc_from_ms(row[6]), row[7])
            for row in rows
            if row[0] == me.instance or next(gone) is None
        ]

    def owner_gone(self, run: _RunRow) -> str | None:
        """Why the process holding ``run`` no longer exists, or None when it may be alive (then
        only its lease decides). Reads no database: it asks the operating system."""
        return None if run.owner_pid is None else self._alive.gone([run.holder()], self._me)[0]

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._alive.close()

    def leave(self, instance: str) -> None:
        self._write(
            lambda conn: (conn.execute(_SQL_LEAVE, (instance,)), conn.execute(_SQL_UNDECLARE, (instance,))),
            notify=_ASKED,  # (the others read who runs at once: ``_Loop._asked``)
        )
        board = self._the_board()
        if board is not None:
            board.leave(self._member(instance))
            board.close()  # (removed if this was its last member; a later read opens it again)

    # -- the lease board ----------------------------------------------------------------------------

    def _the_board(self) -> _Board | None:
        if self._board is None and self._board_dir:
            try:
                status = os.stat(self.path)
            except OSError:
                return None
            self._board = _Board.of(
                self._board_dir, (status.st_dev, status.st_ino), self._me.boot_id, self._shared_group
            )
        return self._board

    def _member(self, instance: str) -> _Member:
        return (instance, self._me.pid, self._me.start, self._me.namespace)

    def renew_all(self, owner: str, claims: Sequence[_Claim]) -> list[_Claim]:
        lost = self._renew_on_board(owner, claims)
        self._on_board = lost is not None
        if lost is not None:
            return lost
        self._snapshot = None  # (this connection's own commit leaves data_version alone: read the new ends next time)
        return super().renew_all(owner, claims)

    def _renew_on_board(self, owner: str, claims: Sequence[_Claim]) -> list[_Claim] | None:
        """Renew on the board if every process of the file is a member of it; the claims no longer
        held (as the file says), or None: renew in the file. A renewal counts only if it committed
        before the lease it extends ran out (see the lease board)."""
        board = self._the_board()
        if board is None:
            return None
        stamp = self._clock.monotonic()  # (before the file is read: see the lease board)
        try:
            members, held = self._file_snapshot(owner, claims, board)
        except sqlite3.Error as exc:
            _log.debug("renewal on the lease board: the file could not be read: %s", exc)
            return None
        if not members:
            return None
        keys = [(c.job, c.slot, c.attempt) for c in claims]
        leases = [(k, stamp + held[k][1]) for k in keys if k in held]
        if not board.renew(owner, leases, stamp):
            return None
        committed = self._clock.monotonic()
        if any(committed >= max(self._granted.get(k, _NEVER), held[k][0]) for k, _ in leases):
            return None
        for key in list(self._granted):  # (a copy made at once: the other renewing thread may write it)
            if key not in held:
                self._granted.pop(key, None)
        self._granted.update(leases)
        return [c for c, k in zip(claims, keys) if k not in held]

    def _file_snapshot(
        self, owner: str, claims: Sequence[_Claim], board: _Board
    ) -> tuple[bool, dict[tuple[str, int, int], tuple[float, float]]]:
        """Whether every process of the file, ``owner``'s included, is a member of ``board``, and
        the runs ``owner`` holds (their lease's end and length), from one snapshot of the file;
        read again unless no other connection has committed since and it holds every claim (a
        claim this connection made itself is read; its own renewals in the file make the next
        round read again). A process that was a member stays one: only processes that have the
        board open write its members."""
        conn = self._connect()
        version = int(conn.execute("PRAGMA data_version").fetchone()[0])
        cached = self._snapshot
        if (
            cached is not None
            and cached[:2] == (version, owner)
            and all((c.job, c.slot, c.attempt) in cached[3] for c in claims)
        ):
            return cached[2], cached[3]
        conn.execute("BEGIN")
        try:
            processes: set[_Member] = {tuple(row) for row in conn.execute(_SQL_INSTANCE_IDS)}
            held = {(j, s, a): (until, lease) for j, s, a, until, lease in conn.execute(_SQL_HELD_BY, (owner,))}
        finally:
            conn.execute("COMMIT")
        members = self._member(owner) in processes and processes <= board.members()
        self._snapshot = (version, owner, members, held)
        return members, held

    def report_progress(self, claim: _Claim, owner: str, progress: tuple[float | None, float | None]) -> None:
        board = self._the_board()
        if not (board is not None and board.report(claim, owner, progress) and self._on_board):
            super().report_progress(claim, owner, progress)

    def runs(self) -> list[_RunRow]:
        """The runs as the file has them, each running one's lease and progress as the board (or
        an owner's possible renewals elsewhere before this process joined) extends them."""
        rows = super().runs()
        if not any(run.state == "running" for run in rows):
            return rows
        board = self._the_board()
        members = board.members() if board is not None else set()
        leases = board.leases() if board is not None and members else {}
        now = self._clock.monotonic()
        processes = self._processes()
        return [
            self._with_board(run, members, processes, leases, now) if run.state == "running" else run for run in rows
        ]

    def _with_board(
        self,
        run: _RunRow,
        members: set[_Member],
        processes: set[_Member],
        leases: dict[tuple[str, int, int], _BoardLease],
        now: float,
    ) -> _RunRow:
        lease = leases.get((run.job, run.slot, run.attempt))
        if lease is not None and lease.owner != run.owner:
            lease = None
        until = self._leased_until(run, members, processes, None if lease is None else lease.until)
        left = run.lease_left if until is None else max(run.lease_left or 0.0, until - now)
        progress = lease.progress if lease is not None and lease.progress != (None, None) else None
        if left == run.lease_left and progress is None:
            return run
        if progress is None:
            return dataclasses.replace(run, lease_left=left)
        return dataclasses.replace(run, lease_left=left, progress_done=progress[0], progress_total=progress[1])

    def _processes(self) -> set[_Member]:
        """The processes recorded in the file (as members of a board are)."""
        return {tuple(row) for row in self._read(_SQL_INSTANCE_IDS)}

    def _leased_until(
        self, run: _RunRow, members: set[_Member], processes: set[_Member], on_board: float | None
    ) -> float | None:
        """Until when (lease clock) ``run``'s lease may hold beyond what the file says: its lease on
        the board if its owner is a member of ours; if it is a process of the file that is not,
        this process's join + the run's lease (an owner that never joined renews in the file)."""
        owner = (run.owner, run.owner_pid, run.owner_start, run.owner_ns)
        if owner in members:
            return on_board
        return self._joined_at + (run.lease or 0.0) if owner in processes else None

    def _leased_elsewhere(self, run: _RunRow) -> bool:
        now = self._clock.monotonic()  # (before the board is read: see the lease board)
        board = self._the_board()
        members = board.members() if board is not None else set()
        on_board = board.until(run) if board is not None and members else None
        until = self._leased_until(run, members, self._processes(), on_board)
        return until is not None and until >= now


class _FileWatch:
    """Wakes the event loop when any process writes the database (Linux inotify, via ctypes).

    Every commit appends to the ``-wal`` file, so an idle process sleeps until something changes
    instead of polling. The ``-wal`` is watched itself, and its directory only for the database's
    own names being created, renamed or deleted (a ``-wal`` made anew is watched in its turn): the
    other files of the directory, however busy, wake nothing. ``start`` returns None where inotify
    is not available; the scheduler then polls the file every ``poll`` seconds.

    A write that asks something of every process (``_ASKED``: a trigger, a cancel, a pause, a
    resume) touches the database file's times (``_SQLStore._ask``); a watch of its own, never
    held, calls ``on_asked`` for it.
    """

    # Writes, and the file being replaced or deleted (the scheduler then reopens the path).
    _IN_MODIFY, _IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x2, 0x40, 0x80, 0x100, 0x200
    _NAMES = _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
    _IN_ATTRIB = 0x4  # (the file's times touched: a write that asks something)

    def __init__(
        self,
        fds: tuple[int, int],
        libc: Any,
        loop: asyncio.AbstractEventLoop,
        path: str,
        on_change: Callable[[], None],
        on_asked: Callable[[], None],
    ):
        (self._fd, self._asked_fd), self._libc, self._loop = fds, libc, loop
        self._on_change, self._on_asked = on_change, on_asked
        self._prefix = os.fsencode(os.path.basename(path))
        self._file, self._wal = os.fsencode(path), os.fsencode(path + "-wal")
        self._wal_name = self._prefix + b"-wal"
        self._wal_wd = -1  # the -wal's watch (-1: none yet: the file does not exist)
        self._renamed = False  # the database's names were made, renamed or deleted since the last ``look``

    @classmethod
    def start(
        cls,
        path: str,
        loop: asyncio.AbstractEventLoop,
        on_change: Callable[[], None],
        on_asked: Callable[[], None] | None = None,
    ) -> _FileWatch | None:
        if not sys.platform.startswith("linux"):
            return None
        path = _real_path(path)  # the -wal file that commits touch lives beside the file itself
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            return None
        if fd < 0:
            return None
        if libc.inotify_add_watch(fd, os.fsencode(os.path.dirname(os.path.abspath(path))), cls._NAMES) < 0:
            os.close(fd)
            return None
        # (none left for the watch of what is asked, ``max_user_instances``: the -wal's is kept)
        asked_fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        watch = cls((fd, asked_fd), libc, loop, os.path.abspath(path), on_change, on_asked or on_change)
        watch._watch_wal()
        watch._watch_file()
        loop.add_reader(fd, watch._read)
        if asked_fd >= 0:
            loop.add_reader(asked_fd, watch._read_asked)
        return watch

    @property
    def asks(self) -> bool:
        """Whether what another process asks is told apart (``on_asked``)."""
        return self._asked_fd >= 0

    def _watch_wal(self) -> None:
        """Watch the -wal as it is now (the same watch again if it is the same file)."""
        self._wal_wd = self._libc.inotify_add_watch(self._fd, self._wal, self._IN_MODIFY)

    def _watch_file(self) -> None:
        """Watch the database file's times as it is now (the file made anew: the new one; none yet:
        when its name is made)."""
        if self._asked_fd >= 0:
            self._libc.inotify_add_watch(self._asked_fd, self._file, self._IN_ATTRIB)

    def _read_asked(self) -> None:
        told = False
        while True:
            try:
                told = bool(os.read(self._asked_fd, 65536)) or told
            except (BlockingIOError, InterruptedError):
                break
        if told:
            self._on_asked()

    def _read(self) -> None:
        if self._take():
            self._on_change()

    def look(self) -> bool:
        """Read what the watch holds now, held or not, without waiting for the loop to; whether
        one of the database's names was made, renamed or deleted since the last look (then the
        files are compared). A change found is told after this look, as the reader would have."""
        if self._take():
            self._loop.call_soon(self._on_change)
        renamed, self._renamed = self._renamed, False
        return renamed

    def _take(self) -> bool:
        """Read the events waiting; whether the database changed (noted for ``look`` when one of its
        names did; the -wal watched anew when its name did)."""
        changed = renamed = named = False
        while True:
            try:
                data = os.read(self._fd, 65536)
            except (BlockingIOError, InterruptedError):
                break
            offset = 0
            while offset + 16 <= len(data):
                wd = int.from_bytes(data[offset : offset + 4], sys.byteorder, signed=True)
                length = int.from_bytes(data[offset + 12 : offset + 16], sys.byteorder)
                name = data[offset + 16 : offset + 16 + length].rstrip(b"\0")
                if wd == self._wal_wd and not name:
                    changed = True
                elif name.startswith(self._prefix):
                    changed = self._renamed = named = True
                    renamed = renamed or name == self._wal_name
                offset += 16 + length
        if renamed:  # (a -wal made anew, or gone: watch what the name holds now)
            self._watch_wal()
        if named:  # (the file too, were it made anew)
            self._watch_file()
        return changed

    def hold(self) -> None:
        """Stop waking the loop; what happens meanwhile is told at ``release``."""
        self._loop.remove_reader(self._fd)

    def release(self) -> None:
        self._loop.add_reader(self._fd, self._read)

    def close(self) -> None:
        for fd in (self._fd, self._asked_fd):
            if fd >= 0:
                self._loop.remove_reader(fd)
                os.close(fd)


class _SQLiteChanges(_Changes):
    """Changes to an SQLite file: ``on_change`` from inotify on the real file's directory (every
    commit appends to the ``-wal``); ``version()`` is one ``PRAGMA data_version`` (microseconds);
    ``lost()`` compares the file at the path with the one opened. No inotify (or ``poll``): not
    ``pushed``. Owners are judged by two witnesses: their liveness sockets (``_Liveness``) and
    ``/proc``; either one saying that the process ended is enough."""

    #: Every commit of every process appends to the -wal and wakes every watcher: a busy store's
    #: changes are read at most this often by each process (its own writes and an owner's end at
    #: once, what is asked of it soon: ``_ASKED``); a process claims what comes due on its own
    #: timers, not on these reads. Under ``_SECOND_LOOK``: these reads are what tell a second look
    #: that the first process claimed. (0.5 s without the watch of what is asked.)
    coalesce = 0.8
    #: The files at the path are compared with those opened at most this often (a busy process
    #: looks several times an occurrence: three stat calls each), and at once when the watch
    #: holds news of one of the database's names made, renamed or deleted (each look reads it).
    _LOST_EVERY = 0.25

    def __init__(
        self,
        path: str,
        clock: Clock,
        loop: asyncio.AbstractEventLoop,
        on_change: Callable[[], None],
        poll: bool,
        instance: str,
        shared_group: bool = False,
        on_gone: Callable[[], None] | None = None,
        on_asked: Callable[[], None] | None = None,
    ):
        self._store: _SQLiteStore = _SQLiteStore(path, busy_timeout=0.05, clock=clock, shared_group=shared_group)
        try:  # (first: nothing is made beside a file that is refused)
            self._store.data_version()
        except _Refused:
            raise
        except StoreError:
            pass  # (the scheduler's own connection says why, and tries again)
        self._files: _FileWatch | None = None
        live: _Liveness | None = None
        try:
            self._files = None if poll else _FileWatch.start(path, loop, on_change, on_asked)
            live = _Liveness(path, loop, on_gone or on_change, shared_group)  # (an owner's end: at once)
            live.listen(_this_owner(instance))
        except BaseException:  # (refused: nothing left open, nor reading on the loop)
            for part in (live, self._files, self._store):
                if part is not None:
                    part.close()
            raise
        self._live = live
        if self._files is not None and not self._files.asks:
            self.coalesce = 0.5  # (what is asked is read with the rest: within 1 s all the same)
        self._compared = -math.inf  # (when ``lost`` last compared the files, on time.monotonic)

    @property
    def pushed(self) -> bool:
        return self._files is not None

    def hold(self) -> None:
        if self._files is not None:
            self._files.hold()

    def release(self) -> None:
        if self._files is not None:
            self._files.release()

    def version(self) -> int:
        try:
            return self._store.data_version()
        except StoreError:
            return -2

    def lost(self) -> str | None:
        now = time.monotonic()
        # (one read, nothing waiting most times: the names' news even while the watch is held)
        renamed = self._files is not None and self._files.look()
        if not renamed and now < self._compared + self._LOST_EVERY:
            return None
        self._compared = now
        return self._store.file_changed()

    def owner_gone(self, run: _RunRow) -> str | None:
        if run.owner_pid is None:
            return None
        return self._live.gone(run.holder()) or self._store.owner_gone(run)

    def reset(self) -> None:
        self._store.rescue()

    def close(self) -> None:
        if self._files is not None:
            self._files.close()
        self._live.close()
        self._store.close()


class _SQLite(_Backend):
    """The SQLite file at ``path``: one connection per thread of the scheduler."""

    def __init__(
        self,
        path: str,
        clock: Clock,
        busy_timeout: float,
        read_only: bool,
        retention: int,
        durability: str,
        shared_group: bool = False,
    ):
        self.path, self.where, self._clock, self._busy_timeout = path, path, clock, busy_timeout
        self.shared_group = shared_group  #: trust files of this process's groups (see trust; ``run --shared-group``)
        self._read_only, self._retention = read_only, retention
        self._synchronous = "FULL" if durability == "full" else "NORMAL"
        self._board_dir = os.environ.get("ANARCHON_BOARD_DIR", _BOARD_DIR)
        self._granted: dict[tuple[str, int, int], float] = {}  # (see _SQLiteStore: its renewing stores share it)

    def control_store(self) -> _Store:  # looks for the write lock itself (``_begin_write``)
        store = _SQLiteStore(
            self.path,
            busy_timeout=self._busy_timeout,
            synchronous=self._synchronous,
            lock_poll=_LOCK_POLL,
            read_only=self._read_only,
            waitless=self._synchronous == "NORMAL",  # (``FULL`` syncs the disk at every commit)
            clock=self._clock,
            board_dir=self._board_dir,
            shared_group=self.shared_group,
        )
        store.retention = self._retention
        return store

    def renewal_store(self) -> _Store:  # looks for the write lock every _LOCK_POLL; never checkpoints in a commit
        return _SQLiteStore(
            self.path,
            busy_timeout=self._busy_timeout,
            synchronous="NORMAL",
            lock_poll=_LOCK_POLL,
            autocheckpoint=False,
            clock=self._clock,
            board_dir=self._board_dir,
            granted=self._granted,
            shared_group=self.shared_group,
        )

    def loop_renewal(self) -> _Store:  # never waits for the lock
        return _SQLiteStore(
            self.path,
            busy_timeout=0.0,
            synchronous="NORMAL",
            autocheckpoint=False,
            clock=self._clock,
            board_dir=self._board_dir,
            granted=self._granted,
            shared_group=self.shared_group,
        )

    def changes(
        self,
        loop: asyncio.AbstractEventLoop,
        on_change: Callable[[], None],
        instance: str,
        on_gone: Callable[[], None] | None = None,
        on_asked: Callable[[], None] | None = None,
    ) -> _Changes:
        return _SQLiteChanges(
            self.path, self._clock, loop, on_change, self.polled, instance, self.shared_group, on_gone, on_asked
        )


###############################################################################
# The PostgreSQL store ########################################################
###############################################################################
#
# The same tables in a schema of their own (``anarchon`` unless the URL says ``?schema=NAME``).
# Write transactions take turns (_PG_TURN), so the shared logic sees the one-writer-at-a-time world
# it was written for, as SQLite's write lock gives it. Leases are on the server's clock.
# Each process holds a session-level advisory lock, on the connection that listens for changes,
# for as long as it runs: a run whose owner's lock is free is taken over at once.

# The first key of every advisory lock of a schema (the second is the process's ``lock_key``).
_PG_LOCK_SPACE = "(hashtext({schema_literal}) & 2147483647)"
# The advisory locks of this schema's processes that are held now (``{schema_literal}``, as
# ``_PGTarget.format`` fills it), and why an owner is gone given ``i`` (its ``instances`` row) and
# ``{held}``, whether the lock it held is held now; or NULL while it may be alive. After a server
# restart its owners get _PG_COMEBACK seconds to reconnect and lock again; until then their leases decide.
_PG_HELD = (
    "SELECT l.objid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 "
    f"AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) AND l.classid = {_PG_LOCK_SPACE}"
)
_PG_GONE = """CASE
        WHEN i.instance IS NULL THEN 'the owner has left'
        WHEN i.server_start <> pg_postmaster_start_time() THEN
            CASE WHEN clock_timestamp() - pg_postmaster_start_time() < interval '{{comeback}} seconds' THEN NULL
            ELSE 'the owner did not come back after the server restarted' END
        WHEN {held} THEN NULL
        ELSE 'the owner''s session ended (its advisory lock is free)' END"""
_PG_NEWEST_TRIGGER = (  # as _SQLITE_NEWEST_TRIGGERS (names qualified: whatever the writer's search_path)
    f"""CREATE FUNCTION keep_newest() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' OR {_SQL_IS_NEWEST.format(schema="{schema}.")} THEN
            {_SQL_KEEP_NEWEST.format(schema="{schema}.")};
        END IF;
        RETURN NULL;
    END $$""",
    "CREATE TRIGGER history_newest AFTER INSERT OR UPDATE OF status ON history FOR EACH ROW EXECUTE FUNCTION keep_newest()",
)


def _pg_trigger(name: str, event: str, condition: str, function: str, body: str) -> tuple[str, str]:
    """A trigger ``name`` run ``event`` (``AFTER ... ON table``) for each row where ``condition``
    holds, and the PL/pgSQL function ``function`` it runs: the one statement ``body`` (its names
    qualified: whatever the writer's search_path)."""
    return (
        f"""CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        {body.format(schema="{schema}.")};
        RETURN NULL;
    END $$""",
        f"CREATE TRIGGER {name} {event} FOR EACH ROW WHEN ({condition}) EXECUTE FUNCTION {function}()",
    )


_PG_RUN_TRIGGERS = (  # as _SQLITE_RUN_TRIGGERS (version 8)
    *_pg_trigger(
        "run_taken", "AFTER INSERT OR UPDATE OF attempt ON runs", _SQL_RUN_TAKEN, "record_taken", _SQL_RECORD_TAKEN
    ),
    *_pg_trigger(
        "history_ended", "AFTER UPDATE OF status ON history", _SQL_RECORD_ENDED, "let_go_ended", _SQL_LET_GO_ENDED
    ),
)
_PG_TYPES = {"ms": "BIGINT", "real": "DOUBLE PRECISION", "id": "BIGSERIAL PRIMARY KEY", "new": "", "rowid": ""}
# One row per running process: the advisory lock it holds, and the server's start time when it
# took it (a restart frees every lock: until its owner is back, a free lock proves nothing).
_PG_INSTANCES_TABLE = """CREATE TABLE instances (
        instance TEXT PRIMARY KEY,
        lock_key INTEGER NOT NULL,
        server_start TIMESTAMPTZ NOT NULL,
        host TEXT,
        pid INTEGER,
        started_at BIGINT NOT NULL,
        declares INTEGER
    )"""
_PG_SCHEMA = (
    "CREATE TABLE meta (version INTEGER NOT NULL)",
    *_dialect(_SQL_JOB_TABLES, _PG_TYPES),
    _PG_INSTANCES_TABLE,
    *_dialect((_SQL_DECLARATIONS_TABLE,), _PG_TYPES),
    "CREATE SEQUENCE lock_keys AS INTEGER MINVALUE 1 CYCLE",
    *_dialect(_SQL_CHECKPOINT_TABLES, _PG_TYPES),
    *_PG_NEWEST_TRIGGER,
    *_PG_RUN_TRIGGERS,
    (
        "CREATE FUNCTION lease_clock() RETURNS DOUBLE PRECISION LANGUAGE sql VOLATILE AS "
        "'SELECT extract(epoch FROM clock_timestamp())::DOUBLE PRECISION'"
    ),
    # Why the process ``who``, as it was when it held lock ``lock``, is gone (or its session is), or
    # NULL while it may be alive. After a server restart its owners get _PG_COMEBACK seconds to
    # reconnect and lock again; until then their leases decide.
    f"""CREATE FUNCTION owner_gone(who TEXT, lock INTEGER) RETURNS TEXT LANGUAGE sql STABLE AS $$
    SELECT {_PG_GONE.format(held=f"EXISTS ({_PG_HELD} AND l.objid = lock)")}
    FROM (SELECT 1) AS one LEFT JOIN {{schema}}.instances i ON i.instance = who
    $$""",
)
_PG_MIGRATIONS: dict[int, tuple[str, ...]] = {  # (PostgreSQL's schema began at version 4, with ``host``)
    4: _SQL_MIGRATIONS[4],
    5: _SQL_MIGRATIONS[5],
    6: _dialect(_SQL_MIGRATIONS[6], _PG_TYPES),
    7: (*_dialect(_SQL_MIGRATIONS[7], _PG_TYPES), *_PG_NEWEST_TRIGGER),
    8: _PG_RUN_TRIGGERS,
}
# A write transaction's first statement: the schema's write turn (held to its end, as SQLite's write
# lock), taken in READ COMMITTED, so each statement after it sees every write committed before it. The
# change numbers are then handed out in commit order, and the claims of four processes on the same due
# jobs wait their turn instead of failing (as SERIALIZABLE transactions, a third of them fail and run
# again). The one-statement writes beside them (renewals, progress, a command's
# process group) are fenced in their own WHERE; a claim reads the run it takes over FOR UPDATE, so
# a renewal is either seen by it or refused. (Key 0 is also the lock that creating the schema takes.)
_PG_TURN = "SELECT pg_advisory_xact_lock({space}, 0)"
_PG_RUN_TO_TAKE = _SQL_RUN + " FOR UPDATE"
# A write transaction left open by a process frozen in its middle (a paused VM) would keep every
# other writer waiting: the server ends its session after this long (milliseconds).
_PG_OPEN_WRITE = 5000
_PG_COMEBACK = 60  # seconds
_PG_RECONNECT = 5.0  # seconds a call waits for a lost connection to be made again (a fast restart takes 1-2)
_PG_VERSION = "SELECT version FROM meta"
_PG_SCHEMA_EXISTS = "SELECT to_regclass(?) IS NOT NULL"
_PG_FINISH_ATTEMPT = (
    "UPDATE history SET status = :status, finished_at = :finished_at, error = :error, output = :output, "
    "id = nextval(pg_get_serial_sequence('history', 'id')) WHERE job = :job AND slot = :slot AND attempt = :attempt"
)
# The runs, each with why its owner is gone (owner_pid: the key of the lock its owner held when it took
# it). The server's locks are read once for all of them, not once a run (with 1,000 runs, four processes
# watching would use 0.76 of the server's core). (``_PGTarget.format``.)
_PG_RUNS = (
    f"WITH held AS MATERIALIZED ({_PG_HELD}) "
    f"SELECT {', '.join('r.' + column.strip() for column in _SQL_RUN_COLUMNS.split(','))}, "
    f"r.lease_until - lease_clock(), {_PG_GONE.format(held='r.owner_pid IN (SELECT objid FROM held)')} "
    "FROM runs r LEFT JOIN instances i ON i.instance = r.owner ORDER BY r.job, r.slot"
)
_PG_JOIN = (
    "INSERT INTO instances (instance, lock_key, server_start, host, pid, started_at, declares) "
    "VALUES (:instance, :lock_key, pg_postmaster_start_time(), :host, :pid, :started_at, :declares) "
    "ON CONFLICT (instance) DO UPDATE SET "
    "lock_key = excluded.lock_key, server_start = excluded.server_start, host = excluded.host, "
    "pid = excluded.pid, started_at = excluded.started_at, declares = excluded.declares"
)
_PG_PROCESSES = (
    "SELECT instance, pid, host, started_at, {declares} FROM instances "
    "WHERE owner_gone(instance, lock_key) IS NULL ORDER BY instance"
)
_PG_FORGET_GONE = "DELETE FROM instances WHERE instance != ? AND owner_gone(instance, lock_key) IS NOT NULL"
_PG_OTHERS = "SELECT count(*) FROM instances WHERE instance != ?"
_PG_LEAVE = "DELETE FROM instances WHERE instance = ?"
_PG_NEXT_KEY = "SELECT nextval('lock_keys')"
_PG_IDLE_TIMEOUT = "SELECT setting::int FROM pg_settings WHERE name = 'idle_session_timeout'"  # (ms; 0: none)
_PG_LOCK = "SELECT pg_try_advisory_lock({space}, ?)"
_PG_READ_ONLY = "25006"  # a read-only server: a standby not yet promoted after a failover, or set so
# Serialization failure, deadlock: run the transaction again; a read-only server: again, later.
_PG_RETRY = ("40001", "40P01", _PG_READ_ONLY)


_PG_NAME = r"(?<![:\w]):([a-z_]+)"  # a named parameter (``::`` is a cast)


@functools.cache
def _pg_sql(sql: str) -> str:
    """A statement of this file in psycopg's placeholders: ``?`` and ``:name`` to ``%s`` and
    ``%(name)s`` (no statement here has a ``?``, a ``%`` or a ``:`` in a literal)."""
    return re.sub(_PG_NAME, r"%(\1)s", sql.replace("?", "%s"))


# A renewal is one text whatever the number of attempts (arrays, not a row of VALUES each), so it is
# prepared once on each connection: the heartbeat thread's on first use, the loop's as it connects.
_PG_SQL_RENEW_ALL = (
    "UPDATE runs SET lease_until = lease_clock() + lease WHERE owner = ? AND state = 'running' "
    "AND (job, slot, attempt) IN (SELECT * FROM unnest(CAST(? AS TEXT[]), CAST(? AS BIGINT[]), CAST(? AS INTEGER[])))"
)


def _pg_array(values: Iterable[object]) -> str:
    """A PostgreSQL array literal of ``values``, each element quoted."""
    quoted = ('"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"' for value in values)
    return "{" + ",".join(quoted) + "}"


def _pg_renewal(owner: str, claims: Sequence[_Claim]) -> tuple[str, list[Any]]:
    """As ``_renewal``, in one text for any number of claims."""
    columns = ((c.job for c in claims), (c.slot for c in claims), (c.attempt for c in claims))
    return _PG_SQL_RENEW_ALL, [owner, *(_pg_array(column) for column in columns)]


@functools.cache
def _pg_numbered(sql: str) -> bytes:
    """A statement of this file with libpq's numbered placeholders (``$1``...), as bytes: each
    ``?`` in turn, or each ``:name`` by its place in ``_pg_names``."""
    names = _pg_names(sql)
    if names:
        return re.sub(_PG_NAME, lambda match: f"${names.index(match.group(1)) + 1}", sql).encode()
    numbers = iter(range(1, sql.count("?") + 1))
    return re.sub(r"\?", lambda _match: f"${next(numbers)}", sql).encode()


@functools.cache
def _pg_names(sql: str) -> tuple[str, ...]:
    """The named parameters of a statement, in the order of their first use."""
    return tuple(dict.fromkeys(re.findall(_PG_NAME, sql)))


class _PGConnection:
    """A psycopg connection that takes this file's placeholders (the shared logic's ``conn``)."""

    def __init__(self, raw: Any):
        self.raw = raw

    def execute(self, sql: str, args: Any = ()) -> Any:
        return self.raw.execute(_pg_sql(sql), args)

    def executemany(self, sql: str, rows: Any) -> Any:
        cursor = self.raw.cursor()
        cursor.executemany(_pg_sql(sql), rows)
        return cursor


def _import_psycopg() -> Any:
    try:
        return importlib.import_module("psycopg")
    except ImportError:
        raise ConfigError(
            "a PostgreSQL URL needs psycopg 3: pip install 'anarchon_lite[postgres]' (or: pip install 'psycopg[binary]')"
        ) from None


def _is_postgres(path: str) -> bool:
    return path.startswith(("postgresql://", "postgres://"))


_PG_CHANNEL = "anarchon_"  # the NOTIFY channel's name, before the schema's
_PG_SECRETS = ("password", "sslpassword")  # the parameters of a URL that messages never show


@dataclasses.dataclass
class _PGTarget:
    """Where the state lives: the connection string, the schema, and the URL as messages show it."""

    conninfo: str
    schema: str
    shown: str  # the URL without its password

    @classmethod
    def parse(cls, url: str) -> _PGTarget:
        import urllib.parse

        parts = urllib.parse.urlsplit(url)
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        schema = next((v for k, v in query if k == "schema"), "anarchon")
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", schema):
            raise ConfigError(f"schema must be a lower-case SQL name, got {schema!r}", option="schema")
        if len(_PG_CHANNEL + schema) > 63:  # the longest name made of it: PostgreSQL's limit is 63 bytes
            raise ConfigError(
                f"schema must be at most {63 - len(_PG_CHANNEL)} characters, got {schema!r}", option="schema"
            )
        rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "schema"])
        conninfo = urllib.parse.urlunsplit(parts._replace(query=rest))
        netloc = parts.netloc.rsplit("@", 1)
        if len(netloc) == 2 and ":" in netloc[0]:
            netloc[0] = netloc[0].split(":", 1)[0] + ":***"
        shown_query = "&".join(  # (the query as given, but for the value of every secret)
            f"{part.split('=', 1)[0]}=***" if urllib.parse.unquote(part.split("=", 1)[0]) in _PG_SECRETS else part
            for part in parts.query.split("&")
        )
        shown = urllib.parse.urlunsplit(parts._replace(netloc="@".join(netloc), query=shown_query))
        return cls(conninfo, schema, shown)

    def connect(self, psycopg: Any) -> Any:
        """A new autocommit connection with this schema first on its search path."""
        raw = psycopg.connect(autocommit=True, **self.options(psycopg))
        raw.execute(f'SET search_path TO "{self.schema}"')
        return raw

    def options(self, psycopg: Any) -> dict[str, Any]:
        """The connection's parameters: the URL's, and defaults. Keepalives end a connection to a
        server that stopped answering in about 11 s instead of the system's hours."""
        options: dict[str, Any] = psycopg.conninfo.conninfo_to_dict(self.conninfo)
        defaults = {
            "connect_timeout": 5,
            "keepalives": 1,
            "keepalives_idle": 5,
            "keepalives_interval": 2,
            "keepalives_count": 3,
            "tcp_user_timeout": 10000,
            "application_name": "anarchon_lite",
        }
        for key, value in defaults.items():
            options.setdefault(key, value)
        return options

    def format(self, sql: str) -> str:
        """A schema statement with this schema's name and lock space filled in."""
        literal = "'" + self.schema + "'"
        space = _PG_LOCK_SPACE.format(schema_literal=literal)
        return sql.format(schema=f'"{self.schema}"', comeback=_PG_COMEBACK, space=space, schema_literal=literal)


class _PGIdentity:
    """This process's advisory lock: its key (a new one for each session: the runs taken under an
    ended session must look ownerless) and whether the listening connection holds it now. Shared by
    the backend's stores and its ``_Changes``."""

    def __init__(self) -> None:
        self.key: int | None = None
        self.held = threading.Event()
        self.failing = ""  #: why the listening connection cannot be made, while it cannot


class _PGPrepared:
    """Statements run through libpq as prepared statements of their connection: a renewal then
    costs the server no parsing or planning (a third of its round trip on a nearby server)."""

    _KEEP = 64  # statements prepared per connection at most (a few run this way: renewals, progress, groups)

    def __init__(self, psycopg: Any):
        self._psycopg = psycopg
        self._on: Any = None  #: the libpq connection the names below were prepared on
        self._names: dict[str, bytes] = {}  #: the statements prepared on it, and their names
        self._made = 0  #: names made on it so far (a name is never used twice on one connection)

    def run(self, pgconn: Any, sql: str, params: list[bytes | None]) -> Any:
        """Run ``sql`` (one call, the GIL let go while it waits; the first time on a connection, a
        preparation before it); its libpq result, or the failed preparation's.

        The session's prepared statements may be gone under us: psycopg's own cache of the
        connection sends ``DEALLOCATE ALL`` after any rolled-back transaction (a serialization
        retry). A statement found missing is prepared again, under a new name, and run once more."""
        if self._on is not pgconn:
            self._on, self._names, self._made = pgconn, {}, 0
        result = self._run(pgconn, sql, params)
        if result.status == self._psycopg.pq.ExecStatus.FATAL_ERROR and _sqlstate(result) == _PG_NO_STATEMENT:
            self._names = {}
            result = self._run(pgconn, sql, params)
        return result

    def _run(self, pgconn: Any, sql: str, params: list[bytes | None]) -> Any:
        name = self._names.get(sql)
        if name is None and len(self._names) < self._KEEP:
            fresh = b"anarchon_%d" % self._made
            self._made += 1
            prepared = pgconn.prepare(fresh, _pg_numbered(sql))
            if prepared.status != self._psycopg.pq.ExecStatus.COMMAND_OK:
                return prepared
            name = self._names[sql] = fresh
        return pgconn.exec_params(_pg_numbered(sql), params) if name is None else pgconn.exec_prepared(name, params)


_PG_NO_STATEMENT = "26000"  # invalid_sql_statement_name: "prepared statement ... does not exist"


def _sqlstate(result: Any) -> str | None:
    """The SQLSTATE of a libpq result (``PG_DIAG_SQLSTATE``), or None."""
    code = result.error_field(ord("C"))
    return None if code is None else bytes(code).decode("ascii", "replace")


class _PGStore(_SQLStore):
    """The store in a PostgreSQL schema, shared by processes on any number of hosts.

    One connection per store object (autocommit). Multi-statement writes take turns (``_PG_TURN``)
    in READ COMMITTED transactions; each one notifies the others (LISTEN/NOTIFY).
    Leases are stamped and compared on the server's clock (``lease_clock()``); an owner is gone
    when its advisory lock is free and the server has not restarted since it took it.
    """

    _SQL_FINISH_ATTEMPT = _PG_FINISH_ATTEMPT
    _SQL_RUNS = _PG_RUNS
    _SQL_RUN_TO_TAKE = _PG_RUN_TO_TAKE
    _renewal = staticmethod(_pg_renewal)
    # A checkpoint's write locks the run that fences it: a takeover or an end in flight is waited for
    # and its commit seen (READ COMMITTED reads a locked row's newest version again before the write;
    # under a stricter default of the role's, the statement fails to serialize and is made again),
    # and one that comes after waits for the write (a claim reads the run it takes FOR UPDATE).
    _SQL_CHECKPOINT_SET = _SQL_CHECKPOINT_SET.format(lock=" FOR SHARE")
    _SQL_CHECKPOINT_DELETE = _SQL_CHECKPOINT_DELETE.format(lock=" FOR SHARE")

    def __init__(
        self,
        target: _PGTarget,
        identity: _PGIdentity,
        *,
        read_only: bool = False,
        busy_timeout: float = 30.0,
        probe: bool = False,
    ):
        self.path = target.shown
        super().__init__()
        self._target = target
        self._identity = identity
        self._read_only = read_only
        self._busy_timeout = busy_timeout
        self._psycopg = _import_psycopg()
        self._conn: Any = None
        self._statements = _PGPrepared(self._psycopg)
        self._probe = probe  #: whether its first connection checks for a pooler that shares sessions
        self._SQL_RUNS = target.format(_PG_RUNS)
        self._turn = target.format(_PG_TURN)

    def _owner(self) -> _Owner:
        """The runs this process takes carry the key of the advisory lock it holds now (in
        ``owner_pid``): a run taken under a session that has ended is judged by that session's lock."""
        key = self._identity.key
        if key is None or not self._identity.held.is_set():
            raise StoreError(self.path, "not connected: this process holds no lock to claim runs under", transient=True)
        return _Owner("", key, None, None, None)

    # -- connection -------------------------------------------------------------------------------

    def _error(self, exc: Exception) -> StoreError:
        text = _first_line(exc, type(exc).__name__)
        transient = isinstance(exc, self._psycopg.OperationalError) or getattr(exc, "sqlstate", None) == _PG_READ_ONLY
        return StoreError(self.path, text, transient=transient)

    def _connect(self) -> Any:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        self._conn = None
        try:
            raw = self._target.connect(self._psycopg)
            try:
                if self._probe:
                    _pg_check_sessions(raw, self._target, self._psycopg)
                    self._probe = False
                self.schema = _pg_prepare(raw, self._target, self._read_only)
                # (whatever the role's or the database's defaults: see _PG_TURN, _PG_OPEN_WRITE)
                raw.isolation_level = self._psycopg.IsolationLevel.READ_COMMITTED
                raw.execute(f"SET lock_timeout = {int(self._busy_timeout * 1000)}")
                raw.execute(f"SET idle_in_transaction_session_timeout = {_PG_OPEN_WRITE}")
            except BaseException:
                raw.close()
                raise
        except self._psycopg.Error as exc:
            raise self._error(exc) from None
        self._conn = raw
        return raw

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except self._psycopg.Error:
                pass
            self._conn = None

    def _failed(self, exc: Exception) -> StoreError:
        """The error to raise for ``exc``; a connection that broke is dropped (the next call opens one)."""
        if self._conn is not None and (self._conn.closed or self._conn.broken):
            self.close()
        return self._error(exc)

    def _write(self, work: Callable[[Any], T], notify: _Telling[T] = True, again: bool = True) -> T:
        """Run ``work(conn)`` in one transaction, in this process's turn among the writers (the
        wait bounded by ``busy_timeout``); again while it deadlocks with a one-statement write (up to
        ``busy_timeout``) or, if ``again``, when its connection is lost (``_reconnecting``); notify
        the other processes when it commits."""

        channel = _pg_channel(self._target)

        def told(telling: bool | str) -> tuple[str, str]:  # (the notification's payload says: now, or asked)
            return channel, telling if telling in (_NOW, _ASKED) else ""

        def transaction(raw: Any) -> T:
            deadline = time.monotonic() + self._busy_timeout
            pause = 0.001
            while True:
                try:
                    with raw.transaction():
                        if notify and not callable(notify):  # (told in the same round trip as the turn is taken)
                            raw.execute(self._turn + ", pg_notify(%s, %s)", told(notify))
                        else:
                            raw.execute(self._turn)
                        result = work(_PGConnection(raw))
                        if callable(notify) and (telling := notify(result)):
                            raw.execute("SELECT pg_notify(%s, %s)", told(telling))
                    return result
                except self._psycopg.Error as exc:
                    if getattr(exc, "sqlstate", None) not in _PG_RETRY or time.monotonic() > deadline:
                        raise
                    _pause(pause * random.random())
                    pause = min(pause * 2, 0.5 if exc.sqlstate == _PG_READ_ONLY else 0.1)

        if again:
            return self._reconnecting(transaction)
        raw = self._connect()
        try:
            return transaction(raw)
        except self._psycopg.Error as exc:
            raise self._failed(exc) from None

    def _read(self, sql: str, args: Sequence[Any] | Mapping[str, Any] = ()) -> list[Any]:
        return self._reconnecting(lambda raw: list(raw.execute(_pg_sql(sql), args).fetchall()))

    def _end_alone(self, owner: str, end: _End) -> bool:
        """Never: outside the writers' turn, a takeover's transaction could change the run between
        what the statement's fence read (READ COMMITTED: a subquery sees the statement's snapshot)
        and the record it writes."""
        return False

    def _reconnecting(self, call: Callable[[Any], T]) -> T:
        """``call(connection)``; when the connection is lost (a server restart, a terminated
        session, a reset), on a new one, for up to ``_PG_RECONNECT`` seconds. Every transaction here
        may run twice: a claim or an end whose commit was lost with the connection finds, the second
        time, that it was done (the watermark moved, the fence no longer holds) and does nothing."""
        deadline = time.monotonic() + _PG_RECONNECT
        pause = 0.05
        while True:
            try:
                return call(self._connect())
            except StoreError as exc:  # (no connection to be had; or a statement failed on a live one)
                if not exc.transient or self._conn is not None or time.monotonic() > deadline:
                    raise
            except self._psycopg.Error as exc:
                error = self._failed(exc)
                if (
                    self._conn is not None or time.monotonic() > deadline
                ):  # the connection is fine: the statement failed
                    raise error from None
            _pause(pause)
            pause = min(pause * 2, 1.0)

    def _autocommit(self, sql: str, args: Sequence[Any] | Mapping[str, Any]) -> int:
        """One libpq call, which lets go of the GIL while it waits for the server: the heartbeat's
        renewal must not need the GIL back at each step of a round trip, as psycopg's own ``execute``
        does (behind an event loop that yields often, each step waits a switch interval or more)."""
        pq = self._psycopg.pq
        deadline = time.monotonic() + self._busy_timeout
        values = [args[name] for name in _pg_names(sql)] if isinstance(args, Mapping) else args
        params = [None if a is None else str(a).encode() for a in values]
        fresh = self._conn is None  # (a connection idle for long may have been ended by the server)
        while True:
            raw = self._connect()
            result = self._statements.run(raw.pgconn, sql, params)
            if result.status == pq.ExecStatus.COMMAND_OK:
                return int(result.command_tuples or 0)
            if raw.pgconn.status != pq.ConnStatus.OK:
                self.close()
                if not fresh:  # ``idle_session_timeout``: once more, on a new connection
                    fresh = True
                    continue
                raise StoreError(self.path, "the connection was lost", transient=True)
            exc = self._psycopg.errors.error_from_result(result)
            if exc.sqlstate not in _PG_RETRY or time.monotonic() > deadline:
                raise self._error(exc) from None
            if exc.sqlstate == _PG_READ_ONLY:
                _pause(0.1)  # (until a standby is promoted: never a spin)

    def _one_write(self, sql: str, args: Mapping[str, Any]) -> int:
        # (made again only on a new connection: a statement the server refused fails at once)
        return self._reconnecting(lambda _: self._autocommit(sql, args))

    def maintain(self) -> None:
        """Nothing: the server does its own upkeep."""

    # -- running processes ------------------------------------------------------------------------

    def join(self, instance: str, now_ms: int, declares: Sequence[str]) -> bool:
        if not self._identity.held.wait(5.0) or self._identity.key is None:
            why = f" ({self._identity.failing})" if self._identity.failing else ""
            raise StoreError(
                self.path,
                f"not connected: waiting for the connection that holds this process's lock{why}",
                transient=True,
            )
        key = self._identity.key

        def work(conn: Any) -> bool:
            joined = {
                "instance": instance,
                "lock_key": key,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started_at": now_ms,
                "declares": len(declares),
            }
            conn.execute(_PG_JOIN, joined)
            conn.execute(_PG_FORGET_GONE, (instance,))
            self._declare(conn, instance, declares)
            return int(conn.execute(_PG_OTHERS, (instance,)).fetchone()[0]) == 0

        return self._write(work)

    def _live_processes(self, read: Callable[[str, Sequence[Any]], list[Any]]) -> list[ProcessInfo]:
        self._reconnecting(lambda raw: None)  # (``schema`` is known once connected)
        sql = _PG_PROCESSES.format(declares="declares" if self.schema >= 6 else "NULL")
        return [ProcessInfo(i, pid, host, _utc_from_ms(since), n) for i, pid, host, since, n in read(sql, ())]

    def owner_gone(self, run: _RunRow) -> str | None:
        """As the server judged it when ``run`` was read (``owner_gone()`` in SQL)."""
        return run.gone

    def leave(self, instance: str) -> None:
        self._write(
            lambda conn: (conn.execute(_PG_LEAVE, (instance,)), conn.execute(_SQL_UNDECLARE, (instance,))),
            notify=_ASKED,  # (the others read who runs at once: ``_Loop._asked``)
        )


def _pg_channel(target: _PGTarget) -> str:
    return _PG_CHANNEL + target.schema


_PG_SHARED_SESSIONS = (
    "is reached through a pooler that shares server sessions between clients (PgBouncer's transaction or "
    "statement pooling): this process's lock, LISTEN and prepared statements need a session of their own. "
    "Connect to the server directly, or through PgBouncer with pool_mode = session"
)


def _pg_check_sessions(raw: Any, target: _PGTarget, psycopg: Any) -> None:
    """Refuse a connection whose session is not its own. A session's backend never changes and
    never serves another client. This connection and a second one each hold a transaction (two
    backends), this one ends first and the second after; then this one asks again: behind
    transaction pooling it is served by another backend (PgBouncer hands out the most recently
    released: the second's), and a statement pooler refuses the transactions. Another client
    taking that backend meanwhile can only make this one land elsewhere still. The pooler may
    not have taken the second's backend back when this one asks (seen once in CI: this one was
    served by its own again), so both ask again, and the whole is tried three times: a session
    of its own answers alike every time."""
    other = target.connect(psycopg)

    def pid(conn: Any) -> int:  # (never prepared: a pooler's server sessions would already have it)
        return int(conn.execute("SELECT pg_backend_pid()", prepare=False).fetchone()[0])

    try:
        shared = False
        for _ in range(3):
            raw.execute("BEGIN")
            mine = pid(raw)
            other.execute("BEGIN")
            theirs = pid(other)
            raw.execute("COMMIT")
            other.execute("COMMIT")
            again = pid(raw), pid(other)
            shared = shared or theirs == mine or again != (mine, theirs)
    except psycopg.Error as exc:
        if "pooling mode" not in str(exc):  # "transaction blocks not allowed in statement pooling mode"
            raise
        shared = True
        with contextlib.suppress(psycopg.Error):
            raw.execute("ROLLBACK")
    finally:
        other.close()
    if shared:
        raise StoreError(target.shown, _PG_SHARED_SESSIONS)


def _pg_prepare(raw: Any, target: _PGTarget, read_only: bool) -> int:
    """Create the schema on first use (one process at a time: a transaction-level advisory lock),
    or check that it is of a version this module knows."""
    tables = f"{target.schema}.meta"
    exists = raw.execute(_pg_sql(_PG_SCHEMA_EXISTS), (tables,)).fetchone()[0]
    version = int(raw.execute(_PG_VERSION).fetchone()[0]) if exists else 0
    if version == 0 and read_only:
        raise StoreError(target.shown, f"no anarchon_lite schema {target.schema!r} in this database")
    if version < SCHEMA_VERSION and not read_only:
        try:
            version = _pg_create(raw, target)
        except _import_psycopg().errors.InsufficientPrivilege as exc:
            what = "create" if version == 0 else f"migrate (from version {version} to {SCHEMA_VERSION})"
            raise StoreError(
                target.shown,
                f"this role may not {what} schema {target.schema!r} ({str(exc).strip().splitlines()[0]}): grant it "
                "CREATE on the database, or have an administrator run once what `anarchon-lite --db URL schema` prints",
            ) from None
    if version > SCHEMA_VERSION:
        raise StoreError(
            target.shown,
            f"schema {target.schema!r} was written by a newer anarchon_lite (version {version}; this one knows {SCHEMA_VERSION})",
        )
    return version


def _pg_create(raw: Any, target: _PGTarget) -> int:
    """Create or migrate the schema (one process at a time: a transaction-level advisory lock);
    the version it then has."""
    with raw.transaction():
        raw.execute(target.format(_PG_TURN))
        raw.execute(f'CREATE SCHEMA IF NOT EXISTS "{target.schema}"')
        if not raw.execute(_pg_sql(_PG_SCHEMA_EXISTS), (f"{target.schema}.meta",)).fetchone()[0]:
            for statement in _PG_SCHEMA:
                raw.execute(target.format(statement))
            raw.execute("INSERT INTO meta (version) VALUES (%s)", (SCHEMA_VERSION,))
        version = int(raw.execute(_PG_VERSION).fetchone()[0])
        if version < SCHEMA_VERSION:
            _log.info("%s: migrating the schema from version %s to %s", target.shown, version, SCHEMA_VERSION)
            for step in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _PG_MIGRATIONS[step]:
                    raw.execute(target.format(statement))
            raw.execute("UPDATE meta SET version = %s", (SCHEMA_VERSION,))
            version = SCHEMA_VERSION
    return version


def _pg_schema_script(target: _PGTarget, role: str) -> str:
    """What an administrator runs once (``psql -f``) to create the schema for a role that may not
    create it, or to migrate the schema of an earlier version (each release that changes it): the
    schema, its tables and functions, and the rights the role needs to use them. A schema of this
    version or a newer one is left as it is."""
    schema, role_name = f'"{target.schema}"', '"' + role.replace('"', '""') + '"'

    def executed(statements: Iterable[str], indent: str) -> list[str]:
        return [
            f"{indent}EXECUTE $statement${target.format(statement).strip()}$statement$;" for statement in statements
        ]

    migrations = [
        line
        for step in sorted(_PG_MIGRATIONS)
        for line in (f"        IF was < {step} THEN", *executed(_PG_MIGRATIONS[step], " " * 12), "        END IF;")
    ]
    lines = [
        "BEGIN;",
        f"CREATE SCHEMA IF NOT EXISTS {schema};",
        f"SET LOCAL search_path TO {schema};",
        "DO $script$",
        "DECLARE was INTEGER;",
        "BEGIN",
        f"    IF to_regclass('{schema}.meta') IS NULL THEN",
        *executed(_PG_SCHEMA, " " * 8),
        f"        INSERT INTO meta (version) VALUES ({SCHEMA_VERSION});",
        "    ELSE",
        "        SELECT version INTO was FROM meta;",
        *migrations,
        f"        UPDATE meta SET version = {SCHEMA_VERSION} WHERE version < {SCHEMA_VERSION};",
        "    END IF;",
        "END $script$;",
        f"GRANT USAGE ON SCHEMA {schema} TO {role_name};",
        f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role_name};",
        f"GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {schema} TO {role_name};",
        f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} TO {role_name};",
        "COMMIT;",
    ]
    return "\n".join(lines) + "\n"


###############################################################################
# PostgreSQL: locks and changes ###############################################
###############################################################################


# An owner's lock session can end where the owner cannot see it (a frozen network path, then the
# server ends the session: pg_terminate_backend, a pooler recycling server connections, a
# server-side keepalive). So while it runs attempts the owner proves its session with a round trip
# on it every _PG_VOUCH / 4 and aborts them (LeaseLost) when none was answered for _PG_VOUCH;
# another process takes a run over on a free lock only once it has seen the lock free for
# _PG_VOUCH + _PG_VOUCH_MARGIN (or the lease ran out). The owner has stopped by then (a crontab
# command is killed at once, not given the TERM grace), kill -9 is still taken over within about a
# second, and two attempts of a run never work at the same time.
_PG_VOUCH = 0.4  # seconds: B, the longest an owner runs attempts without an answer from its lock session
_PG_VOUCH_MARGIN = 0.2  # seconds: for the owner's thread to be late in noticing
_PG_IDLE_PING = 30.0  # seconds between round trips on an idle lock session (within ``idle_session_timeout``)


class _PGChanges(_Changes):
    """Changes in a PostgreSQL schema, and this process's advisory lock, on one connection.

    A thread of its own connects (again, with backoff, after ``reset``), takes this process's lock,
    LISTENs, and waits on the socket: each notification bumps ``version()`` and calls ``on_change``
    on the loop. It sends a round trip every ``_PG_VOUCH / 4`` while this process runs attempts (and
    one in a while when idle: ``idle_session_timeout`` ends a silent session). A lost connection, or
    no answer for ``_PG_VOUCH`` while attempts run, is ``lost()`` and aborts the attempts at once,
    from the thread (an event loop blocked by a handler cannot delay it): the lock may be free, and
    another process may take the runs over once it has seen it so for ``_PG_VOUCH`` and a margin.
    """

    pushed = True
    fresh_liveness = False  # ``owner_gone`` answers as of the last read of the runs
    coalesce = 0.5  # (what comes due is claimed on timers, changes told are read together; SQLite: 0.8)

    def __init__(
        self,
        target: _PGTarget,
        identity: _PGIdentity,
        loop: asyncio.AbstractEventLoop,
        on_change: Callable[[], None],
        on_now: Callable[[], None],
        on_asked: Callable[[], None] | None = None,
    ):
        self._target, self._identity, self._loop, self._on_change = target, identity, loop, on_change
        self._on_now = on_now  #: called for a notification that a run was handed over, held or not
        self._on_asked = on_asked or on_change  #: for one of a write told ``_ASKED``, held or not
        self._psycopg = _import_psycopg()
        self._count = 0  #: bumped at each notification and each new session (read on the loop)
        self._held = False  #: the loop reads changes later (``hold``): notifications are counted, not told
        self._connected = False  #: whether the thread holds a session now
        self._lost: str | None = None  #: why the last session was lost, until ``reset``
        self._running: Callable[[], bool] = _false  #: whether attempts of this process run (``vouch_for``)
        self._on_lost: Callable[[str], None] = _ignore  #: aborts them, from the thread
        self._closed = threading.Event()
        self._resume = threading.Event()  #: set by ``reset``: connect again after a loss
        self._idle = _PG_IDLE_PING  #: seconds between round trips while no attempt runs
        #: when the first attempt began that the thread has not yet seen running (monotonic)
        self._since: float | None = None
        self._wake, self._waker = socket.socketpair()  #: wakes the thread: an attempt began, or ``close``
        self._waker.setblocking(False)
        #: when each run's owner was first seen with its lock free, by (job, slot, attempt)
        self._free_since: dict[tuple[str, int, int], float] = {}
        self._ended = loop.create_future()  #: done once the thread has closed its session
        self._thread = threading.Thread(target=self._serve, name="anarchon-listen", daemon=True)
        self._thread.start()

    def vouch_for(self, running: Callable[[], bool], lost: Callable[[str], None]) -> None:
        self._running, self._on_lost = running, lost

    def attempt_started(self) -> None:
        if self._since is None:  # (vouched for from the first start, however late the thread wakes)
            self._since = time.monotonic()
        with contextlib.suppress(OSError):  # (full: the thread is woken already; closed: it has ended)
            self._waker.send(b"!")

    # -- on its thread

    def _serve(self) -> None:
        try:
            self._sessions()
        finally:
            self._wake.close()
            self._waker.close()
            with contextlib.suppress(RuntimeError):  # (the loop is closed)
                self._loop.call_soon_threadsafe(_resolve, self._ended)

    def _sessions(self) -> None:
        pause, failing, logged = 0.5, "", 0.0
        while not self._closed.is_set():
            try:
                raw, key = self._connect()
            except StoreError as exc:  # (the schema, or the pooler: the main connection says the same)
                self._identity.failing = str(exc).removeprefix(f"{self._target.shown}: ")
                self._closed.wait(pause)
                pause = min(pause * 2, 5.0)
                continue
            except self._psycopg.Error as exc:
                text = _first_line(exc, type(exc).__name__)
                self._identity.failing = text
                if text != failing or time.monotonic() - logged >= 60.0:
                    _log.error(
                        "%s: cannot connect (trying again every %s): %s",
                        self._target.shown,
                        format_duration(pause),
                        text,
                    )
                    failing, logged = text, time.monotonic()
                self._closed.wait(pause)
                pause = min(pause * 2, 5.0)
                continue
            if self._closed.is_set():  # (closed while connecting: the identity is the next run's now)
                with contextlib.suppress(self._psycopg.Error):
                    raw.close()
                return
            if failing:
                _log.warning("%s: connected again", self._target.shown)
            failing, pause, self._identity.failing = "", 0.5, ""
            self._connected = True
            self._identity.key = key
            self._identity.held.set()
            self._count += 1
            self._tell()
            why = self._watch(raw)
            if self._identity.key == key:  # the lock went with the session: the next one takes a new key
                self._identity.held.clear()
                self._identity.key = None
            self._connected = False
            with contextlib.suppress(self._psycopg.Error):
                raw.close()
            if why is None:
                return
            self._resume.clear()  # (before ``lost()`` says so: the loop's ``reset`` then sets it again)
            self._lost = f"the connection to {self._target.shown} that holds this process's lock was lost ({why})"
            self._on_lost(self._lost)
            self._tell()
            while not self._resume.wait(1.0) and not self._closed.is_set():
                pass

    def _connect(self) -> tuple[Any, int]:
        """A new session holding a new key's lock, listening; and the key."""
        raw = self._target.connect(self._psycopg)
        try:
            _pg_prepare(raw, self._target, read_only=False)
            while True:  # (a key another process holds, the keys having gone round: the next one)
                key = int(raw.execute(_PG_NEXT_KEY).fetchone()[0])
                if raw.execute(self._target.format(_pg_sql(_PG_LOCK)), (key,)).fetchone()[0]:
                    break
            raw.execute(f'LISTEN "{_pg_channel(self._target)}"')
            timeout = raw.execute(_PG_IDLE_TIMEOUT).fetchone()
            self._idle = _PG_IDLE_PING if not timeout or not timeout[0] else min(_PG_IDLE_PING, timeout[0] / 3000)
            raw.pgconn.nonblocking = 1
        except BaseException:
            raw.close()
            raise
        return raw, key

    def _watch(self, raw: Any) -> str | None:
        """Wait on the session until it is lost (why) or closed (None): notifications, and the
        round trips that prove it. The session is lost when it is seen to end, or when no answer
        was read for ``_PG_VOUCH`` while attempts run: the input is read first, and a thread that
        was itself held up (the GIL held by a long C call, a pause of the process) asks once more
        before it gives up: a session that still answers has held its lock throughout (a new
        session takes a new key)."""
        pgconn, pq = raw.pgconn, self._psycopg.pq
        answered, asked = time.monotonic(), None  # the last answer read; the round trip awaiting one
        vouching, until = False, 0.0
        while not self._closed.is_set():
            now = time.monotonic()
            late, running = now - until if until else 0.0, self._running()
            if running and not vouching:  # (the claims it vouches for began then)
                answered = max(answered, now if self._since is None else self._since)
            vouching, self._since = running, None
            every = _PG_VOUCH / 4 if vouching else self._idle
            try:
                if vouching and now - answered > _PG_VOUCH:
                    asked = self._take_input(pgconn, asked)
                    answered = now if asked is None else answered
                    if now - answered > _PG_VOUCH and late < _PG_VOUCH / 4:
                        return f"its session did not answer for {format_duration(now - answered)}"
                    answered = max(answered, now - _PG_VOUCH / 2)  # (held up itself: one more chance)
                if asked is None and now >= answered + every:
                    pgconn.send_query(b"SELECT 1")
                    asked = now
                pgconn.flush()
                if asked is None:
                    until = answered + every
                else:  # (the answer is due: within the vouch, or for an idle session in good time)
                    until = answered + _PG_VOUCH if vouching else asked + every + _PG_VOUCH
                ready, _, _ = select.select([pgconn.socket, self._wake], [], [], max(0.0, until - now))
                if self._wake in ready:
                    self._wake.recv(4096)
                if pgconn.socket in ready:
                    if (asked := self._take_input(pgconn, asked)) is None:
                        answered = time.monotonic()
                    if pgconn.status != pq.ConnStatus.OK:
                        return pgconn.get_error_message().decode(errors="replace").strip() or "closed by the server"
            except (self._psycopg.Error, OSError) as exc:
                return _first_line(exc, "closed by the server")
            if not vouching and asked is not None and time.monotonic() - asked > every + _PG_VOUCH:
                return "an idle round trip was not answered"  # (no attempt runs: nothing to abort)
        return None

    def _take_input(self, pgconn: Any, asked: float | None) -> float | None:
        """Read what the server sent: notifications (told to the loop), and the answer to the
        round trip asked at ``asked``; None once it is answered (or none was asked)."""
        pgconn.consume_input()
        told, payloads = self._count, set()
        while (notification := pgconn.notifies()) is not None:
            self._count += 1
            payloads.add(notification.extra)
        if _NOW.encode() in payloads:  # (a hand-over: read at once, not coalesced)
            self._tell(self._on_now)
        elif _ASKED.encode() in payloads:  # (read soon, not coalesced)
            self._tell(self._on_asked)
        elif self._count != told and not self._held:  # (held: the loop reads them when it lets go)
            self._tell()
        while asked is not None and not pgconn.is_busy():
            if pgconn.get_result() is None:
                asked = None
        return asked

    def _tell(self, call: Callable[[], None] | None = None) -> None:
        """Call ``call`` (``on_change``) on the loop."""
        with contextlib.suppress(RuntimeError):  # (the loop is closed)
            self._loop.call_soon_threadsafe(call or self._on_change)

    # -- on the event loop

    def hold(self) -> None:
        self._held = True

    def release(self) -> None:
        self._held = False

    def version(self) -> int:
        return self._count if self._connected else -2

    def lost(self) -> str | None:
        return self._lost

    def owner_gone(self, run: _RunRow) -> str | None:
        key = (run.job, run.slot, run.attempt)
        if run.gone is None:
            self._free_since.pop(key, None)
            return None
        now = time.monotonic()
        if len(self._free_since) > 10_000:  # (runs taken over or ended long ago)
            self._free_since = {k: t for k, t in self._free_since.items() if now - t < 60.0}
        return run.gone if now - self._free_since.setdefault(key, now) >= _PG_VOUCH + _PG_VOUCH_MARGIN else None

    def settles_in(self, run: _RunRow) -> float:
        since = self._free_since.get((run.job, run.slot, run.attempt))
        if run.gone is None or since is None:
            return math.inf
        return max(0.0, since + _PG_VOUCH + _PG_VOUCH_MARGIN - time.monotonic())

    def reset(self) -> None:
        self._lost = None
        self._resume.set()

    def close(self) -> None:
        self._closed.set()
        self._resume.set()
        self.attempt_started()  # (wakes the thread, which closes its session)

    async def closed(self, timeout: float) -> None:
        await asyncio.wait({self._ended}, timeout=timeout)  # (else still connecting: it closes that session and ends)
        if self._ended.done():  # (it has only its return left, but may wait for a core to make it)
            self._thread.join(timeout)


class _PGLoopRenewal(_AsyncRenewal):
    """Renewals made on the event loop when the heartbeat thread is late: an event loop that yields
    often (computing in chunks) takes the GIL straight back at each turn and can keep the thread
    from it for seconds. One libpq call on a connection of its own, whose answer the loop waits for
    on the socket for at most ``_BLOCK`` (about a round trip to a nearby server; the loop blocks
    that long at worst, as SQLite's fallback blocks for its write), and then without blocking.
    The connection is made off the loop (``connect``, from the heartbeat thread)."""

    _BLOCK = 0.02

    def __init__(self, target: _PGTarget, loop: asyncio.AbstractEventLoop):
        self._target, self._loop = target, loop
        self._psycopg = _import_psycopg()
        self._raw: Any = None
        self._lock = threading.Lock()

    _RENEW = b"anarchon_renew"

    def connect(self) -> None:
        """Open the connection and prepare the renewal on it (off the loop: both wait for the server)."""
        with self._lock:
            if self._raw is None or self._raw.closed:
                raw = self._target.connect(self._psycopg)
                prepared = raw.pgconn.prepare(self._RENEW, _pg_numbered(_PG_SQL_RENEW_ALL))
                if prepared.status != self._psycopg.pq.ExecStatus.COMMAND_OK:
                    raw.close()
                    raise self._psycopg.errors.error_from_result(prepared)
                self._raw = raw

    def renew_all(self, owner: str, claims: Sequence[_Claim]) -> list[_Claim] | Awaitable[list[_Claim]]:
        raw = self._raw
        if raw is None or raw.closed:
            threading.Thread(target=self._connect_quietly, name="anarchon-connect", daemon=True).start()
            raise StoreError(self._target.shown, "the loop's renewal connection is not open yet", transient=True)
        _sql, args = _pg_renewal(owner, claims)
        with self._failures():
            raw.pgconn.send_query_prepared(self._RENEW, [str(a).encode() for a in args])
            if self._answered(raw.pgconn, time.monotonic() + self._BLOCK):
                return self._judge(raw.pgconn, len(claims))
        return self._later(raw.pgconn, len(claims))

    async def _later(self, pgconn: Any, count: int) -> list[_Claim]:
        """The rest of a renewal whose answer did not come within ``_BLOCK``: waited for on the loop."""
        with self._failures():
            while not self._answered(pgconn, 0.0):
                readable = self._loop.create_future()
                self._loop.add_reader(pgconn.socket, _resolve, readable)
                try:
                    await readable
                finally:
                    self._loop.remove_reader(pgconn.socket)
            return self._judge(pgconn, count)

    @staticmethod
    def _answered(pgconn: Any, deadline: float) -> bool:
        """Whether the answer is in, waiting on the socket for it until ``deadline``."""
        while True:
            pgconn.consume_input()
            if not pgconn.is_busy():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([pgconn.socket], [], [], left)

    def _judge(self, pgconn: Any, count: int) -> list[_Claim]:
        result = pgconn.get_result()
        while pgconn.get_result() is not None:
            pass
        if result.status != self._psycopg.pq.ExecStatus.COMMAND_OK or result.command_tuples != count:
            # (which runs were lost, the thread's renewal finds out)
            raise StoreError(self._target.shown, "the loop's renewal did not renew every lease", transient=True)
        return []

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        """A failure of the connection closes it and is a transient ``StoreError``."""
        try:
            yield
        except (self._psycopg.Error, OSError) as exc:
            self.close()
            raise StoreError(self._target.shown, str(exc).strip() or type(exc).__name__, transient=True) from None

    def _connect_quietly(self) -> None:
        try:
            self.connect()
        except Exception as exc:  # noqa: BLE001 - the thread's renewals say what is wrong
            _log.debug("the loop's renewal connection could not be opened: %s", exc)

    def close(self) -> None:
        with self._lock:
            raw, self._raw = self._raw, None
        if raw is not None:
            try:
                raw.close()
            except self._psycopg.Error:
                pass


class _Postgres(_Backend):
    """A PostgreSQL schema: one connection per thread of the scheduler, and one that holds this
    process's advisory lock and listens for changes."""

    def __init__(self, url: str, read_only: bool, busy_timeout: float, retention: int):
        _import_psycopg()
        self._target = _PGTarget.parse(url)
        self.where = self._target.shown
        self._identity = _PGIdentity()
        self._read_only, self._busy_timeout, self._retention = read_only, busy_timeout, retention

    def control_store(self) -> _Store:
        store = _PGStore(
            self._target,
            self._identity,
            read_only=self._read_only,
            busy_timeout=self._busy_timeout,
            probe=not self._read_only,
        )
        store.retention = self._retention
        return store

    def renewal_store(self) -> _Store:
        return _PGStore(self._target, self._identity, busy_timeout=self._busy_timeout)

    def loop_renewal(self) -> _AsyncRenewal:
        return _PGLoopRenewal(self._target, asyncio.get_running_loop())

    def changes(
        self,
        loop: asyncio.AbstractEventLoop,
        on_change: Callable[[], None],
        instance: str,
        on_gone: Callable[[], None] | None = None,
        on_asked: Callable[[], None] | None = None,
    ) -> _Changes:
        return _PGChanges(self._target, self._identity, loop, on_change, on_gone or on_change, on_asked or on_change)


###############################################################################
# Choosing the store ##########################################################
###############################################################################


def _store_at(
    path: str,
    *,
    clock: Clock | None = None,
    poll: float | None = None,
    busy_timeout: float = 30.0,
    retention: int = 1000,
    read_only: bool = False,
    durability: str = "normal",
    shared_group: bool = False,
) -> _Backend:
    """The store at ``path``: the schema of a ``postgresql://`` URL (psycopg is imported only
    then), else the SQLite file. The one place a backend is chosen; nothing is opened until its
    first use. The settings are the store's, as ``Scheduler`` documents them (``clock``: the one
    SQLite's leases are stamped on; ``durability`` and ``shared_group`` are SQLite's alone)."""
    if isinstance(retention, bool) or not isinstance(retention, int) or retention < 1:
        raise ConfigError(
            f"must be an integer >= 1 (history records kept per job), got {retention!r}", option="retention"
        )
    if durability not in ("full", "normal"):
        raise ConfigError(f"must be 'full' or 'normal', not {durability!r}", option="durability")
    backend: _Backend = (
        _Postgres(path, read_only, busy_timeout, retention)
        if _is_postgres(path)
        else _SQLite(path, clock or Clock(), busy_timeout, read_only, retention, durability, shared_group)
    )
    backend.look_every = 0.5 if poll is None else min(poll, 1.0)
    backend.polled = poll is not None
    return backend


###############################################################################
# Leases and heartbeats #######################################################
###############################################################################


class _Timers(threading.Thread):
    """One daemon thread that calls functions at monotonic deadlines (timeouts, watchdog).

    It keeps firing while the event loop is blocked, which is the point of it. ``call_at``
    returns a function that cancels the call.
    """

    def __init__(self, clock: Clock, name: str):
        super().__init__(name=name, daemon=True)
        self._clock = clock
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._cancelled: set[int] = set()
        self._seq = 0
        self._stopped = False

    def call_at(self, deadline: float, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` on this thread at ``deadline`` (monotonic). The thread is woken only
        when the deadline is the first: it wakes by the first anyway and looks at the rest then (a
        run with a ``timeout`` woke it each time, behind the watchdog's tick planned sooner: about
        four context switches of the thread an occurrence with 20 jobs a second, and a fifth of the CPU)."""
        with self._cond:
            self._seq += 1
            seq = self._seq
            heapq.heappush(self._heap, (deadline, seq, callback))
            if self._heap[0][1] == seq:
                self._cond.notify()
        return functools.partial(self._cancel, seq)

    def _cancel(self, seq: int) -> None:
        with self._cond:
            self._cancelled.add(seq)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    if self._heap and self._heap[0][1] in self._cancelled:
                        self._cancelled.discard(heapq.heappop(self._heap)[1])
                        continue
                    wait = self._heap[0][0] - self._clock.monotonic() if self._heap else None
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait if wait is None else min(wait, 1.0))
                if self._stopped:
                    return
                _deadline, _seq, callback = heapq.heappop(self._heap)
            try:
                callback()
            except Exception:  # noqa: BLE001 - the timer thread must outlive a failing callback
                _log.exception("timer callback failed")


@dataclasses.dataclass
class _Lateness:
    """Heartbeat lateness samples (seconds), kept for the benchmark, and those of the last minute
    (with when, on the monotonic clock) for the metrics."""

    samples: list[float] = dataclasses.field(default_factory=list)
    lost: int = 0
    recent: collections.deque[tuple[float, float]] = dataclasses.field(default_factory=collections.deque)

    def add(self, value: float, now: float) -> None:
        if len(self.samples) < 100_000:
            self.samples.append(value)
        self.recent.append((now, value))
        while self.recent[0][0] < now - 60.0:
            self.recent.popleft()

    def p99(self, now: float) -> float | None:
        """The 99th percentile of the last minute's samples, or None if there were none."""
        values = sorted(value for at, value in list(self.recent) if at >= now - 60.0)
        return values[min(len(values) - 1, int(len(values) * 0.99))] if values else None


class _SwitchInterval:
    """Lowers the interpreter's GIL switch interval around heartbeat rounds, and puts it back after.

    A heartbeat from a thread waits for the GIL at each hand-off (waking up, after the statement,
    after its reset) whenever another thread computes: a switch interval each, 5 ms by default.
    At 0.5 ms a renewal is a few ms late instead of 10-30 ms. Threads that compute together lose
    6-18% of their work at 0.5 ms (the benchmark's ``switch_interval_cost``), so the
    heartbeat thread lowers it only from shortly before a round until the round is done: a few
    percent of the time while runs are renewing, never in a process with nothing running.
    Counted, so that several schedulers in one process share it; the last to let go restores it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved: float | None = None

    def lower(self, interval: float | None) -> None:
        if interval is None:
            return
        with self._lock:
            self._users += 1
            current = sys.getswitchinterval()
            if current > interval:
                if self._saved is None:
                    self._saved = current
                sys.setswitchinterval(interval)

    def restore(self, interval: float | None) -> None:
        if interval is None:
            return
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._saved is not None:
                sys.setswitchinterval(self._saved)
                self._saved = None


_switch_interval = _SwitchInterval()


class _Heartbeats(threading.Thread):
    """Renews the leases of this process's running attempts, all in one statement per round.

    A thread of its own, with its own SQLite connection (plain ``sqlite3``), keeps renewals
    arriving while a handler computes in a thread or blocks the event loop. A timer on the event
    loop renews too, a moment later, if the round is still not done: an event loop that yields often
    (computing in chunks) takes the GIL straight back at every turn and can starve a waiting thread
    for seconds. Renewing twice is harmless. A renewal that finds a run taken aborts that attempt's
    token with ``LeaseLost``; one that fails (lock held too long, disk error, a lost connection) is
    retried soon. An attempt whose lease runs out, by this process's own clock, before a renewal
    succeeds is aborted with ``LeaseLost`` then, without waiting to hear it from the store.
    From ``_EARLY`` before a round until it is done, the thread lowers the interpreter's switch
    interval to ``switch_interval`` (``_SwitchInterval``).
    """

    _LOOP_DELAY = 0.0005  # the event loop renews only if the thread has not, this long after the plan
    _EARLY = 0.025  # lower the switch interval this long before a round: a GIL hand-off at 5 ms, and then some

    def __init__(
        self,
        backend: _Backend,
        clock: Clock,
        name: str,
        loop: asyncio.AbstractEventLoop,
        switch_interval: float | None,
    ):
        super().__init__(name=name, daemon=True)
        self._store = backend.renewal_store()
        self._loop_store = backend.loop_renewal()  # never blocks the loop (None: the loop only checks expiry)
        self._loop = loop
        self._loop_timer: asyncio.TimerHandle | None = None
        self._loop_renewal: asyncio.Task[None] | None = None  # the loop's renewal in flight (asynchronous)
        self._clock = clock
        self._cond = threading.Condition()
        self._attempts: dict[int, _Attempt] = {}
        self._due: float | None = None
        self._stopped = False
        self._reopen = False
        self._closed = threading.Event()  # set once the thread has closed its connection for a reopen
        self._low_interval = switch_interval
        self._lowered = False
        self._failing: str | None = None  #: the last renewal error of the thread, until one succeeds
        self.lateness = _Lateness()

    def add(self, attempt: _Attempt) -> None:
        """Start renewing ``attempt`` (call on the event loop's thread)."""
        with self._cond:
            now = self._clock.monotonic()
            attempt.valid_until = time.monotonic() + attempt.lease
            self._attempts[id(attempt)] = attempt
            first = now + attempt.renew_every
            # Only a round sooner than the one planned wakes the thread and moves the loop's timer:
            # the planned round renews the attempt in time (and the timer checks its expiry first).
            sooner = self._due is None or first < self._due
            if sooner:
                self._due = first
                self._cond.notify()
        if sooner:
            if self._loop_timer is not None:
                self._loop_timer.cancel()
            self._on_loop()

    def stop(self) -> None:
        """Stop renewing (call on the event loop's thread)."""
        with self._cond:
            self._stopped = True
            self._lower_near_round(None)  # put it back now, not when the thread next wakes
            self._cond.notify()
        if self._loop_timer is not None:
            self._loop_timer.cancel()
            self._loop_timer = None
        if self._loop_renewal is not None:
            self._loop_renewal.cancel()
        self._close_loop_store()

    def reopen(self) -> None:
        """Close the connections to the file; the next renewal opens the path again (call on the
        event loop's thread)."""
        with self._cond:
            self._closed.clear()
            self._reopen = True
            self._cond.notify()
        self._close_loop_store()

    def _close_loop_store(self) -> None:
        # (Under the lock: a thread that first ran after the stop, as under load it can, opened this
        # connection after ``stop`` closed it, and closes it again as it ends; never both at once.)
        with self._cond:
            if self._loop_store is not None:
                self._loop_store.close()

    def wait_closed(self, timeout: float) -> bool:
        """After ``reopen``: wait until the thread has closed its connection (call off the loop)."""
        return self._closed.wait(timeout)

    def _round(self) -> tuple[float | None, float, list[_Attempt]]:
        """(seconds until the next round or None, its planned time, the attempts to renew now if
        it is due), read together under the lock."""
        with self._cond:
            for key in [k for k, a in self._attempts.items() if a.done]:
                del self._attempts[key]
            if self._stopped or self._due is None:
                self._due = None
                return None, 0.0, []
            wait = self._due - self._clock.monotonic()
            if not self._attempts:
                # (The round stays planned until its time: an attempt added before then, as short ones
                # come one after another, needs no wake-up of this thread. One that had ended before
                # the thread looked set no round, and the next woke the thread again.)
                if wait > 0:
                    return wait, self._due, []
                self._due = None
                return None, 0.0, []
            return wait, self._due, list(self._attempts.values()) if wait <= 0 else []

    def _renew_due(self, store: _Store) -> float | None:
        """Renew every attempt if the round is due; return the seconds until the next round."""
        wait, planned, batch = self._round()
        if not batch:
            return wait
        owner = batch[0].owner
        sent = time.monotonic()
        try:
            lost = store.renew_all(owner, [a.claim for a in batch])
            for attempt in batch:
                if attempt.progress != attempt.reported:
                    store.report_progress(attempt.claim, owner, attempt.progress)
                    attempt.reported = attempt.progress
        except Exception as exc:  # noqa: BLE001 - renewals must outlive any failure
            if store is self._loop_store:  # the fallback does not wait for the lock; the thread does
                _log.debug("lease renewal from the event loop failed: %s", exc)
                return 0.001
            if str(exc) != self._failing:  # once per kind of failure, not once per retry
                _log.warning("lease renewal failed, retrying every 0.2 s: %s", exc)
            self._failing = str(exc)
            self._expire()
            return 0.2
        if self._failing is not None and store is self._store:
            _log.warning("lease renewals work again")
            self._failing = None
        return self._renewed(batch, planned, sent, lost)

    def _renewed(self, batch: list[_Attempt], planned: float, sent: float, lost: list[_Claim]) -> float | None:
        """Book a round of renewals sent at ``sent`` (``time.monotonic``) that succeeded; return
        the seconds until the next round."""
        now = self._clock.monotonic()
        period = min(a.renew_every for a in batch)
        with self._cond:
            if self._due == planned:  # the first to finish this round
                for _ in batch:
                    self.lateness.add(now - planned, now)
                self._due = max(planned + period, now + period / 4)
            for attempt in batch:
                attempt.valid_until = max(attempt.valid_until, sent + attempt.lease)
            for claim in lost:
                attempt = next(a for a in batch if a.claim is claim)
                if not attempt.done:  # (a finished attempt's run is simply gone)
                    self.lateness.lost += 1
                    attempt.token.abort(LeaseLost(f"{claim.job}: the run was taken over by another attempt"))
                    attempt.done = True
            return None if self._due is None else self._due - now

    def _on_loop(self) -> None:
        expiry = self._expire()
        if isinstance(self._loop_store, _Store):
            wait = self._renew_due(self._loop_store)  # (a round is always due well before an expiry)
        elif self._loop_store is not None:
            wait, planned, batch = self._round()
            if batch and (self._loop_renewal is None or self._loop_renewal.done()):
                self._renew_on_loop(self._loop_store, batch, planned)
            if batch:
                wait = 0.005  # (until the round is done, by the thread or the loop)
        else:
            wait = None if expiry is None else expiry - time.monotonic()
        delay = self._LOOP_DELAY if not isinstance(self._loop_store, _AsyncRenewal) else self._loop_store.delay
        self._loop_timer = None if wait is None else self._loop.call_later(max(wait, 0.0) + delay, self._on_loop)

    def _renew_on_loop(self, renewal: _AsyncRenewal, batch: list[_Attempt], planned: float) -> None:
        sent = time.monotonic()
        try:
            answer = renewal.renew_all(batch[0].owner, [a.claim for a in batch])
        except Exception as exc:  # noqa: BLE001 - the thread renews too; this only helps it
            _log.debug("lease renewal from the event loop failed: %s", exc)
            return
        if isinstance(answer, list):
            self._renewed(batch, planned, sent, answer)
        else:
            self._loop_renewal = self._loop.create_task(self._renewed_later(answer, batch, planned, sent))

    async def _renewed_later(
        self, answer: Awaitable[list[_Claim]], batch: list[_Attempt], planned: float, sent: float
    ) -> None:
        try:
            lost = await answer
        except Exception as exc:  # noqa: BLE001 - the thread renews too; this only helps it
            _log.debug("lease renewal from the event loop failed: %s", exc)
            return
        self._renewed(batch, planned, sent, lost)

    def _expire(self) -> float | None:
        """Abort the attempts whose lease ran out by this process's clock; return when the next
        one would (``time.monotonic``), or None. Real elapsed time, not the injected clock's: the
        clock a store's leases run on is its own (the server's, or a test's by hand)."""
        now = time.monotonic()
        with self._cond:
            live = [a for a in self._attempts.values() if not a.done]
            for attempt in live:
                if attempt.valid_until <= now:
                    self.lateness.lost += 1
                    attempt.token.abort(
                        LeaseLost(
                            f"{attempt.claim.job}: the lease ran out ({format_duration(attempt.lease)}) before a "
                            "renewal succeeded"
                        )
                    )
                    attempt.done = True
            return min((a.valid_until for a in live if not a.done), default=None)

    def _lower_near_round(self, wait: float | None) -> float | None:
        """Lower the switch interval if the next round is ``_EARLY`` away or less, put it back if
        not; return how long to sleep before looking again (call holding ``_cond``)."""
        near = wait is not None and wait <= self._EARLY
        if near != self._lowered:
            if near:
                _switch_interval.lower(self._low_interval)
            else:
                _switch_interval.restore(self._low_interval)
            self._lowered = near
        return wait if wait is None or near else wait - self._EARLY

    def _maintain(self) -> None:
        """The store's upkeep (a checkpoint of the WAL), outside any renewal's commit. Only well
        before a round: behind a computing thread, each system call here waits for the GIL."""
        try:
            self._store.maintain()
        except Exception as exc:  # noqa: BLE001 - the scheduler's own connection checkpoints too
            _log.debug("upkeep of the store failed: %s", exc)

    def run(self) -> None:
        try:
            for store in (self._store, self._loop_store):  # before the first round, which must not wait
                try:
                    if store is not None:
                        store.connect()
                except Exception as exc:  # noqa: BLE001 - the first renewal tries again, and says why
                    _log.debug("a heartbeat connection could not be opened yet: %s", exc)
            while True:
                with self._cond:
                    if self._reopen:
                        self._store.close()
                        self._reopen = False
                        self._closed.set()
                wait = self._renew_due(self._store)
                if wait is not None and wait > 2 * self._EARLY:  # just after a round, well before the next
                    self._maintain()
                with self._cond:
                    if self._stopped:
                        return
                    if not self._reopen:
                        self._cond.wait(self._lower_near_round(wait))
        finally:
            with self._cond:
                self._lower_near_round(None)
                stopped = self._stopped
            self._store.close()
            if stopped:
                self._close_loop_store()


class _Watchdog:
    """Warns when the event loop stays blocked past ``threshold`` seconds while handlers run.

    A timer thread posts a ping to the loop; a ping unanswered past the threshold means the loop is
    blocked, unless the timer thread itself woke that late (the whole process was frozen or
    suspended), in which case nothing is reported. The loop sends the first ping itself as a
    handler starts (it is running then), answered after the handler's first step, and the timer
    is planned a whole threshold later, to see it answered: it is left to run out when the last
    handler ends (it then plans no other), so short runs starting within a threshold of each other
    share one timer. (Planned a quarter of the threshold later, it woke its thread twice for each
    short run of a process that runs one now and then: at 16 processes, most of the other
    threads' 2.5 wake-ups an occurrence.) While handlers run, it looks every quarter of the
    threshold.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timers: _Timers,
        clock: Clock,
        threshold: float,
        describe: Callable[[int], str],
    ):
        self._loop, self._timers, self._clock = loop, timers, clock
        self._threshold = threshold
        self._describe = describe
        self._loop_thread = threading.get_ident()
        self._active = 0
        self._sent: float | None = None
        self._warned = False
        self._planned = 0.0
        self._pending = False  # a tick is planned (it may find nothing running: then it plans no other)
        self._lock = threading.Lock()
        self.warnings = 0

    def acquire(self) -> None:
        """A handler starts (on the loop's thread); ``ping`` once its first step is on its way."""
        with self._lock:
            self._active += 1
            if not self._pending:
                self._schedule(self._threshold)

    def ping(self) -> None:
        """The loop's own ping (on its thread), answered after what it has to do now: a handler
        whose first step blocks the loop leaves it unanswered."""
        with self._lock:
            if self._sent is None and self._active:
                self._sent = self._clock.monotonic()
                self._loop.call_soon(self._pong)

    def release(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._sent = None

    def _schedule(self, after: float) -> None:
        self._planned = self._clock.monotonic() + after
        self._pending = True
        self._timers.call_at(self._planned, self._tick)

    def _pong(self) -> None:
        self._sent = None
        self._warned = False

    def _tick(self) -> None:
        now = self._clock.monotonic()
        with self._lock:
            self._pending = False
            if self._active == 0:
                return
            frozen = now - self._planned > self._threshold / 2
            if self._sent is None or frozen:
                self._sent = now
                try:
                    self._loop.call_soon_threadsafe(self._pong)
                except RuntimeError:
                    return
            elif now - self._sent > self._threshold and not self._warned:
                self._warned = True
                self.warnings += 1
                _log.warning(
                    "the event loop has been blocked for %.1f s: %s",
                    now - self._sent,
                    self._describe(self._loop_thread),
                )
            self._schedule(self._threshold / 4)


###############################################################################
# Jobs and options ############################################################
###############################################################################

_OVERLAP = {"skip": 1, "allow": None}  # the words ``overlap`` takes, as the number of runs they allow
_MIN_LEASE = 0.25  # seconds: renewed every third, a renewal may come 160 ms late (10x the worst measured)
_KNOWN_OPTIONS = tuple(JobOptions.__annotations__)  # (their names, as the type checker knows them)


@dataclasses.dataclass(frozen=True)
class _Options:
    timeout: float | None
    overlap: int | None  #: at most this many runs of the job unfinished at once (1: "skip"; None: "allow")
    lease: float
    retries: int
    retry_delay: float
    max_attempts: int
    grace: float
    catch_up: float | None
    jitter: float | None = None  #: each occurrence starts up to this much later (seconds)
    on_failure: FailureHook | None = None  #: called once a run has failed for good
    on_failure_every_attempt: bool = False  #: called after every attempt that failed or timed out instead


def _options(job: str, given: dict[str, Any]) -> _Options:
    """The options of job ``job`` from what its declaration gave; a ``ConfigError`` naming the job
    and the option for any that is wrong. (Read once per set of values: 10,000 jobs declared with
    the same few options read them once.)"""
    try:  # (keyed by type too: True and 1 are equal, and only one of them is a count)
        return _options_read(tuple(sorted((key, type(value).__name__, value) for key, value in given.items())))
    except (ConfigError, TypeError):  # (again with the job's name in the error; TypeError: unhashable)
        return _read_options(job, given)


@functools.lru_cache(maxsize=256)
def _options_read(given: tuple[tuple[str, str, Any], ...]) -> _Options:
    return _read_options("", {key: value for key, _, value in given})


def _read_options(job: str, given: dict[str, Any]) -> _Options:
    for key in given:
        if key not in _KNOWN_OPTIONS:
            raise ConfigError(f"unknown option (known: {', '.join(sorted(_KNOWN_OPTIONS))})", job=job, option=key)

    def duration(key: str, default: DurationLike | None) -> float | None:
        value = given.get(key, default)
        return None if value is None else parse_duration(value, job=job, option=key)

    def count(key: str, default: int, low: int) -> int:
        value = given.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"must be an integer >= {low}, got {value!r}", job=job, option=key)
        return value

    lease = duration("lease", "30s") or 30.0
    if lease < _MIN_LEASE:
        raise ConfigError(
            f"must be at least {format_duration(_MIN_LEASE)} (renewed every third of it, a shorter lease "
            f"runs out between renewals and the run bounces between processes), got {given['lease']!r}",
            job=job,
            option="lease",
        )
    jitter = parse_duration(given.get("jitter", 0), job=job, option="jitter", allow_zero=True)
    return _Options(
        timeout=duration("timeout", None),
        overlap=_overlap(job, given.get("overlap", "skip")),
        lease=lease,
        retries=count("retries", 0, 0),
        retry_delay=duration("retry_delay", "1s") or 1.0,
        max_attempts=count("max_attempts", 10, 1),
        grace=duration("grace", "10s") or 10.0,
        catch_up=duration("catch_up", None),
        jitter=jitter if round(jitter * 1000) else None,  # (zero, or under a millisecond: none)
        **_failure_options(job, given),
    )


def _overlap(job: str, value: object) -> int | None:
    """How many runs of the job may be unfinished at once, from ``overlap``: ``"skip"`` (1),
    ``"allow"`` (no limit) or a number >= 1 (not a bool: ``True`` is an int)."""
    if isinstance(value, str) and value in _OVERLAP:
        return _OVERLAP[value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ConfigError(f"must be 'skip', 'allow' or a number of runs >= 1, got {value!r}", job=job, option="overlap")


def _failure_options(job: str, given: dict[str, Any]) -> dict[str, Any]:
    """``on_failure`` (a callable, sync or async, given a ``RunRecord``) and whether it is called
    after every failed attempt (a bool, and only with ``on_failure``)."""
    hook, every = given.get("on_failure"), given.get("on_failure_every_attempt", False)
    if hook is not None and not callable(hook):
        raise ConfigError(
            f"must be callable (given the failed run's RunRecord), not {hook!r}", job=job, option="on_failure"
        )
    if not isinstance(every, bool):
        raise ConfigError(f"must be True or False, got {every!r}", job=job, option="on_failure_every_attempt")
    if every and hook is None:
        raise ConfigError("is set without an on_failure to call", job=job, option="on_failure_every_attempt")
    return {"on_failure": hook, "on_failure_every_attempt": every}


@dataclasses.dataclass
class _Job:
    name: str
    schedule: _Schedule
    handler: Handler
    options: _Options
    is_async: bool
    definition: str = ""  # what another process declaring the job must agree on: the schedule (and command)
    since: int | None = None  #: declared (or rescheduled) while the scheduler ran, at this time (ms)
    #: The watermark last asked about and the first occurrence after it: each look asks again, and
    #: a cron schedule's next occurrence costs tens of microseconds.
    _next: tuple[int, int | None] | None = dataclasses.field(default=None, repr=False, compare=False)
    _logger: logging.Logger | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.schedule = _with_jitter(self.name, self.schedule, self.options.jitter)
        self.definition = self.definition or self.description

    @property
    def description(self) -> str:
        """The schedule as the store keeps it and ``status`` shows it: with its jitter, and its
        overlap when that is a number of runs other than one."""
        overlap = self.options.overlap
        return self.schedule.description + (f" overlap {overlap}" if overlap not in (None, 1) else "")

    @property
    def logger(self) -> logging.Logger:
        """The logger of its handlers' ``ctx.log`` (looked up once: ``getLogger`` takes a lock)."""
        if self._logger is None:
            self._logger = logging.getLogger(f"anarchon_lite.job.{self.name}")
        return self._logger

    def next_due(self, last_slot: int, stored: int | None = None) -> int | None:
        """The first occurrence after ``last_slot``, computed once per watermark; or ``stored``,
        the one the file holds for this declaration, when it is later than the watermark (the
        process that moved the watermark computed it: a cron job's costs tens of microseconds)."""
        cached = self._next
        if cached is None or cached[0] != last_slot:
            following = stored if stored is not None and stored > last_slot else self.schedule.next_after(last_slot)
            cached = self._next = (last_slot, following)
        return cached[1]


def _every(name: str, interval: DurationLike, offset: DurationLike) -> _Every:
    seconds = parse_duration(interval, job=name, option="interval")
    return _Every(seconds, parse_duration(offset, job=name, option="offset", allow_zero=True))


def _cron(name: str, expr: str, tz: Zone) -> _Cron:
    if not isinstance(expr, str):
        raise ConfigError(f"cron expression must be a string, not {expr!r}", job=name, option="cron")
    return _Cron(expr, _zone(tz, name), name)


def _with_jitter(job: str, schedule: _Schedule, jitter: float | None) -> _Schedule:
    """``schedule`` with its starts delayed by up to ``jitter`` seconds; ``ConfigError`` for a
    jitter that cannot apply: on ``@reboot`` (no occurrence on a clock), or not shorter than an
    interval (every delay would be cut to the interval: surely a mistake)."""
    if jitter is None or isinstance(schedule, _Jittered):
        return schedule
    if isinstance(schedule, _OnStart):
        raise ConfigError(
            "@reboot jobs run when a group of processes starts: there is no time to delay", job=job, option="jitter"
        )
    if isinstance(schedule, _Every) and round(jitter * 1000) >= schedule.interval:
        raise ConfigError(
            f"must be shorter than the interval ({format_duration(schedule.interval / 1000)}), got {format_duration(jitter)}",
            job=job,
            option="jitter",
        )
    return _Jittered(schedule, jitter, job)


def _is_async(function: Callable[..., Any]) -> bool:
    """Whether calling ``function`` returns a coroutine (async functions, partials of them, and
    objects whose ``__call__`` is async)."""
    if inspect.iscoroutinefunction(function):
        return True
    call = None if inspect.isroutine(function) else type(function).__call__
    return call is not None and inspect.iscoroutinefunction(call)


def _where_blocked(jobs: dict[str, _Job], thread_id: int) -> str:
    """Where the event loop's thread ``thread_id`` is blocked: the job whose handler it is in (of
    ``jobs``), and the innermost line outside asyncio."""
    frame = sys._current_frames().get(thread_id)
    handlers = {job.handler.__code__: job.name for job in jobs.values() if hasattr(job.handler, "__code__")}
    innermost = None
    job_name = None
    while frame is not None:
        if innermost is None and not frame.f_code.co_filename.startswith(os.path.dirname(asyncio.__file__)):
            innermost = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        if frame.f_code in handlers:
            job_name = handlers[frame.f_code]
            break
        frame = frame.f_back
    return f"job {job_name or '(unknown)'} at {innermost or '(unknown)'}"


_DISPUTES_TOLD = 3  # jobs declared differently elsewhere that a look names one by one (then one line for the rest)


class _Declarations:
    """The jobs this process declares: what ``every``, ``cron``, ``rrule`` and ``at`` add (before
    the scheduler runs or while it does), what ``remove`` and ``reschedule`` change, what a reload
    puts in their place, the rows the store records for them, and the warnings when another process
    declares one of them otherwise. The store link records them before its next call whenever
    ``version`` has moved since it last did.

    While the scheduler serves (``live``), ``jobs`` is never changed in place but replaced by a
    changed copy: the loop and the store's thread may be going through it, on other threads than
    the one that declares, and each sees one whole set of jobs. ``changed`` then tells the loop."""

    def __init__(self, instance: str, clock: Clock):
        self.instance = instance  #: the process that declares them
        self._clock = clock
        self.jobs: dict[str, _Job] = {}  #: the jobs declared in this process, by name
        self.version = 0  #: one more after each change of ``jobs``: the store records them again
        self.live = False  #: the scheduler serves: change ``jobs`` by replacing it, and call ``changed``
        self.changed: Callable[[], None] | None = None  #: tells the serving loop (from any thread)
        self._lock = threading.Lock()  #: held while a change is checked and made (from any thread)
        self._disputes: set[tuple[str, str | None]] = set()  #: (job, other definition) already warned of

    def declare(self, name: str, schedule: _Schedule, handler: Handler | None, given: dict[str, Any]) -> Any:
        """Declare job ``name`` (``handler``'s, or the decorated function's: a decorator without one)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"job name must be a non-empty string, not {name!r}")
        if not name.isprintable():
            raise ConfigError(f"job name {name!r} has a line break or another control character")
        if name in self.jobs:
            raise ConfigError("a job with this name is already declared", job=name)
        options = _options(name, given)

        def register(function: Handler) -> Handler:
            if not callable(function):
                raise ConfigError(f"handler must be callable, not {function!r}", job=name)
            job = _Job(name, schedule, function, options, _is_async(function))
            with self._lock:
                if name in self.jobs:
                    raise ConfigError("a job with this name is already declared", job=name)
                self._put(name, job)
            self._tell()
            return function

        return register if handler is None else register(handler)

    def job(self, name: str) -> _Job:
        """The job ``name``; ``JobNotFound`` if this process does not declare it."""
        job = self.jobs.get(name)
        if job is None:
            raise JobNotFound("no such job is declared", job=name)
        return job

    def remove(self, name: str) -> None:
        """Stop declaring job ``name`` (``JobNotFound`` if this process does not)."""
        with self._lock:
            self.job(name)
            self._put(name, None)
        self._tell()

    def reschedule(self, name: str, schedule: _Schedule) -> None:
        """Give job ``name`` another schedule, with its handler and options."""
        with self._lock:
            job = self.job(name)
            self._put(name, _Job(name, schedule, job.handler, job.options, job.is_async))
        self._tell()

    def _put(self, name: str, job: _Job | None) -> None:
        """Declare ``job`` as ``name`` (None: remove it), under ``_lock``; the caller then tells."""
        if job is not None and self.live:
            job.since = _ms(self._clock.time())
        jobs = dict(self.jobs) if self.live else self.jobs
        if job is None:
            del jobs[name]
        else:
            jobs[name] = job
        self.jobs = jobs
        self.version += 1

    def replace(self, jobs: dict[str, _Job]) -> None:
        """Declare ``jobs`` instead of the current ones (a crontab read again)."""
        with self._lock:
            self.jobs = jobs
            self.version += 1
        self._tell()

    def _tell(self) -> None:
        """Have the serving loop record the declarations again (outside ``_lock``)."""
        changed = self.changed
        if changed is not None:
            changed()

    def agree_on(self, name: str, text: str) -> None:
        """Make ``text`` part of what every process must declare alike for job ``name``."""
        job = self.job(name)
        job.definition = f"{job.description}: {text}"
        self.version += 1

    def rows(self, now: int) -> list[_Declared]:
        """The declarations as the store records them (a job new to the store starts at ``now``,
        and its next occurrence after now; a one-shot job already due, just before it). Called on
        the store's thread."""
        return [
            _Declared(
                job.name,
                job.description,
                job.schedule.watermark(now),
                None,
                job.definition,
                self.instance,
                job.schedule.next_after,
                job.since,
            )
            for job in self.jobs.values()
        ]

    def disagree(self, rows: Iterable[_JobRow], outcome: str) -> None:
        """Warn, once per definition, that another process declares jobs of ours differently: a
        line for each of the first few, one for the rest (a deploy that changed a set of 10,000
        jobs logs four lines, not 10,000)."""
        disputed = []
        for row in rows:
            job = self.jobs.get(row.name)
            if job is None or row.definition in (None, job.definition) or (row.name, row.definition) in self._disputes:
                continue
            if row.declared_by == self.instance:  # (this process declared it otherwise before: rescheduled)
                continue
            self._disputes.add((row.name, row.definition))
            disputed.append((row, job))
        for row, job in disputed[:_DISPUTES_TOLD]:
            _log.warning(
                "job %r is declared differently by two processes: %s declares %r, this one (%s) %r; the file %s",
                row.name,
                row.declared_by or "another process",
                row.definition,
                self.instance,
                job.definition,
                outcome,
            )
        rest = [row.name for row, _ in disputed[_DISPUTES_TOLD:]]
        if rest:
            _log.warning(
                "%d more jobs are declared differently by another process than by this one (%s): %s%s; the file %s",
                len(rest),
                self.instance,
                ", ".join(map(repr, rest[:_DISPUTES_TOLD])),
                ", ..." if len(rest) > _DISPUTES_TOLD else "",
                outcome,
            )


###############################################################################
# The store from the event loop ###############################################
###############################################################################


_STORE_THREADS: set[_StoreThread] = set()  #: the store threads alive, each told to end at the interpreter's exit
_STORE_THREADS_TOLD = False  #: whether ``_end_store_threads`` is registered


def _end_store_threads() -> None:
    """At the interpreter's exit, before it waits for its threads: each store thread ends after
    the calls queued to it (a stop's last writes land; an idle thread does not hold the exit up)."""
    for thread in list(_STORE_THREADS):
        thread.close()


#: Called on the event loop with a store call's result, or the exception it raised (``submit``).
_Answer = Callable[[Any, Optional[BaseException]], None]


def _fill(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    """A store call's ``_Answer`` into ``future``."""
    if exc is not None:
        _set_exception(future, exc)
    else:
        _set_result(future, result)


class _StoreThread:
    """The thread on which the scheduler's store connection lives; calls are queued to it, and
    each answer is handed back to its loop as one callback (``submit``), or as the result of one
    future (``call``). (An executor's future, wrapped for the loop and shielded, took the loop four
    turns and five callbacks to resume the caller; a claim, an end and a read are each one of these
    hops.) A call submitted ``soon`` runs on the caller's thread instead when the thread has nothing
    queued and the store needs no wait for it (``_Store.run_on_loop``): no hop at all."""

    def __init__(self, store: _Store):
        self.store = store
        self._calls: SimpleQueue[tuple[Callable[[_Store], Any], asyncio.AbstractEventLoop, _Answer] | None] = (
            SimpleQueue()
        )
        # By loop, the calls queued whose answer has not yet reached it (under ``_counting``): a loop
        # stopped and closed before an answer reached it holds only its own count up.
        self._queued: dict[asyncio.AbstractEventLoop, int] = {}
        self._counting = threading.Lock()
        self._busy = threading.Lock()  # held while a call runs, on this thread or the caller's
        self._thread = threading.Thread(target=self._serve, name="anarchon-store")
        global _STORE_THREADS_TOLD
        if not _STORE_THREADS_TOLD:  # (before the interpreter waits for its threads; once a process)
            with contextlib.suppress(RuntimeError):  # (already exiting: the thread is made and ended now)
                threading._register_atexit(_end_store_threads)  # type: ignore[attr-defined]
            _STORE_THREADS_TOLD = True
        _STORE_THREADS.add(self)
        self._thread.start()

    def submit(
        self, work: Callable[[_Store], Any], loop: asyncio.AbstractEventLoop, answer: _Answer, soon: bool = False
    ) -> None:
        """``work(store)`` on the thread, then ``answer(result, None)`` or ``answer(None, exception)``
        on ``loop``; with ``soon``, on this thread (the loop's) when it can be (see the class)."""
        if not soon or not self._now(work, loop, answer):
            self._queue(work, loop, answer)

    def _queue(self, work: Callable[[_Store], Any], loop: asyncio.AbstractEventLoop, answer: _Answer) -> None:
        with self._counting:
            self._queued[loop] = self._queued.get(loop, 0) + 1
        self._calls.put((work, loop, answer))

    def _now(self, work: Callable[[_Store], Any], loop: asyncio.AbstractEventLoop, answer: _Answer) -> bool:
        """Run ``work`` on this thread if nothing is queued before it (the answers keep their order)
        and the store can run it without waiting; whether it did."""
        store = self.store
        if loop in self._queued or not self._busy.acquire(blocking=False):
            return False
        try:
            if not store.waitless:  # (asked with the thread held: a call of another loop's can change it)
                return False
            loop.call_soon(answer, store.run_on_loop(lambda: work(store)), None)
        except _WouldWait:
            return False
        except (KeyboardInterrupt, SystemExit) as exc:  # a signal's, on this thread: the process's to judge
            # (Python runs a signal's handler between two steps of its own, the few between the
            # call's end and its answer's planning included: an answer lost there is the limit.)
            if store.wrote:  # (it wrote, in part or whole: its answer is the exception)
                loop.call_soon(answer, None, exc)
            else:  # (rolled back: made whole on the store's thread)
                self._queue(work, loop, answer)
            raise
        except BaseException as exc:  # noqa: BLE001 - the caller's to judge
            loop.call_soon(answer, None, exc)
        finally:
            self._busy.release()
        return True

    async def call(self, work: Callable[[_Store], T]) -> T:
        """``work(store)`` on the thread; it completes even if the awaiting task is cancelled."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self.submit(work, loop, functools.partial(_fill, future))
        return await future

    def _serve(self) -> None:
        try:
            while (call := self._calls.get()) is not None:
                self._answer(*call)
                del call  # (nothing of a call is kept while the thread waits for the next)
        finally:
            with self._busy, contextlib.suppress(Exception):  # (not under a call the loop is making)
                self.store.close()
            _STORE_THREADS.discard(self)

    def _answer(self, work: Callable[[_Store], Any], loop: asyncio.AbstractEventLoop, answer: _Answer) -> None:
        result, failure = None, None
        with self._busy:  # (let go before the answer leaves: the loop may make the next call itself)
            try:
                result = work(self.store)
            except BaseException as exc:  # noqa: BLE001 - the caller's to judge
                failure = exc
        if not _hand_back(loop, self._answered, loop, answer, result, failure):
            self._counted(loop)  # (its loop is closed: the answer never gets there to count)

    def _answered(
        self, loop: asyncio.AbstractEventLoop, answer: _Answer, result: Any, exc: BaseException | None
    ) -> None:
        """An answer reaching its loop: counted first, so that a call the answer makes may be made
        on the loop's thread (and the answers reach the loop in the order of their calls)."""
        self._counted(loop)
        answer(result, exc)

    def _counted(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._counting:
            left = self._queued[loop] - 1
            if left:
                self._queued[loop] = left
            else:
                del self._queued[loop]

    def close(self) -> None:
        """End the thread, and close its connection, after the calls queued before this."""
        self._calls.put(None)

    def join(self) -> None:
        """Wait for the thread to end (after ``close``)."""
        self._thread.join()


class _StoreLink:
    """How the scheduler, its checkpoints and its handlers' contexts reach the store: calls queued
    to one thread that owns the main connection, opened at the first call. While the scheduler runs
    (``held``) the thread stays between calls; otherwise each call closes it again, so a process
    that calls ``status()`` now and then keeps no thread or connection in between. The first call on
    a connection, and the first after the declarations changed, records them in the store in the
    same transaction's hop (registering and joining are one call)."""

    def __init__(self, backend: _Backend, declarations: _Declarations, clock: Clock):
        self.backend = backend  #: where the state lives: opens every connection to it
        self.declarations = declarations  #: what this process declares, recorded before other calls
        self._clock = clock
        self.held = False  #: the scheduler runs: the thread and its connection stay between calls
        self._recorded: int | None = None  #: the declarations' version recorded on this connection
        self._thread: _StoreThread | None = None
        self._closing: _StoreThread | None = None  # the last one closed, ending

    @property
    def open(self) -> bool:
        return self._thread is not None

    @property
    def untidy(self) -> bool:
        """Whether the store has upkeep to do (``_Store.tidy``)."""
        return self._thread is not None and self._thread.store.untidy

    async def call(self, work: Callable[[_Store], T], soon: bool = False) -> T:
        """Run ``work(store)`` on the store's thread; the transaction completes even if the
        awaiting task is cancelled. ``soon``: on the loop's own thread when the store needs no wait
        for it (``_StoreThread``): the loop's claims, ends and reads, short and never waiting."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self.submit(work, functools.partial(_fill, future), soon)
        return await future

    def submit(self, work: Callable[[_Store], Any], answer: _Answer, soon: bool = False) -> None:
        """As ``call``, with no task to resume: ``answer(result, exception)`` is called on the loop
        once the thread has run ``work``."""
        if self._thread is None:
            self._thread = _StoreThread(self.backend.control_store())
        declared = self.declarations
        version = declared.version
        rows: list[list[_JobRow]] = []
        run = work
        if self._recorded == version or not declared.jobs:
            self._recorded = version
        else:
            now = _ms(self._clock.time())

            def run(store: _Store) -> Any:  # (the declarations recorded first, in the same hop)
                rows.append(store.register(declared.rows(now)))
                return work(store)

        def answered(result: Any, exc: BaseException | None) -> None:
            if rows:
                self._recorded = version
                declared.disagree(rows[0], "now holds this one's")
            if not self.held:
                self.close()
            answer(result, exc)

        self._thread.submit(run, asyncio.get_running_loop(), answered, soon and run is work)

    async def disconnect(self) -> None:
        """Close the connection and keep the thread: the next call connects again, and records."""
        if self._thread is not None:
            await self._thread.call(lambda s: s.close())
        self._recorded = None

    def close(self, wait: bool = False) -> None:
        """Close the connection and end the thread (after the calls queued before this one); with
        ``wait``, return once both are done (those of an earlier close too)."""
        if self._thread is not None:
            self._thread.close()
            self._closing, self._thread = self._thread, None
        if wait and self._closing is not None:
            self._closing.join()
            self._closing = None
        self._recorded = None


###############################################################################
# The run context and checkpoints #############################################
###############################################################################


class _AttemptToken(CancelToken):
    """An attempt's ``ctx.signal``: its abort, from whichever thread, is handed to the runner by
    ``told`` (a callback registered with ``on_abort`` took a lock, an entry and a remover an
    attempt)."""

    def __init__(self) -> None:
        super().__init__()
        self.told: Callable[[], object] | None = None  #: called after the abort, until the attempt ends

    def abort(self, reason: BaseException | None = None) -> bool:
        if not super().abort(reason):
            return False
        told = self.told
        if told is not None:
            with contextlib.suppress(RuntimeError):  # (its loop closed: the attempt was given up)
                told()
        return True


@dataclasses.dataclass
class _Attempt:
    """A running attempt in this process: what the heartbeat thread and the scheduler share."""

    job: _Job
    claim: _Claim
    owner: str
    token: _AttemptToken
    lease: float
    renew_every: float
    progress: tuple[float | None, float | None] = (None, None)
    reported: tuple[float | None, float | None] = (None, None)
    done: bool = False
    started: float = 0.0  #: when its handler was started (the scheduler's monotonic clock)
    #: Until when (``time.monotonic``) the lease surely holds, by this process's own clock: a
    #: lease's length from when the last renewal that succeeded was sent.
    valid_until: float = 0.0


#: The attempt whose handler (task or thread) is running here, for ``scheduler.checkpoints``' fencing.
_current_attempt: contextvars.ContextVar[_Attempt | None] = contextvars.ContextVar("anarchon_attempt", default=None)


class _JobLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        return f"[{extra['job']} slot={extra['slot']} attempt={extra['attempt']}] {msg}", kwargs


class CheckpointStore:
    """The checkpoints of every (job, slot), as in the recipe: ``get``, ``set``, ``delete``.

    Values are anything JSON can hold; one that it cannot is refused with ``TypeError`` before
    anything is written. Called from inside a run for that run's own job and slot, writes are
    fenced: they land only while the attempt holds the run, else they raise ``LeaseLost``.
    Writes are visible to every process once they return.
    """

    def __init__(self, link: _StoreLink, clock: Clock):
        self._link, self._clock = link, clock

    async def get(self, job: str, slot: int, default: Any = None) -> Any:
        """The value saved for (job, slot), or ``default``."""
        return await self._read(job, slot, default, _current_attempt.get())

    async def set(self, job: str, slot: int, value: Any) -> None:
        """Save ``value`` for (job, slot)."""
        await self._write(job, slot, _to_json(value), _current_attempt.get())

    async def delete(self, job: str, slot: int) -> None:
        """Forget the value of (job, slot)."""
        await self._write(job, slot, None, _current_attempt.get())

    async def _read(self, job: str, slot: int, default: Any, attempt: _Attempt | None) -> Any:
        fence = _fence(job, slot, attempt)
        held, text = await self._link.call(lambda s: s.checkpoint_get(job, slot, fence))
        if not held:
            _lost(job, attempt)
        return default if text is None else json.loads(text)

    async def _write(self, job: str, slot: int, text: str | None, attempt: _Attempt | None) -> None:
        fence = _fence(job, slot, attempt)
        now = _ms(self._clock.time())
        if not await self._link.call(lambda s: s.checkpoint_write(job, slot, text, now, fence)):
            _lost(job, attempt)


def _fence(job: str, slot: int, attempt: _Attempt | None) -> tuple[int, str] | None:
    """(attempt number, owner) when ``attempt`` is a run of (job, slot): its checkpoint is fenced."""
    if attempt is not None and (attempt.claim.job, attempt.claim.slot) == (job, slot):
        return attempt.claim.attempt, attempt.owner
    return None


def _lost(job: str, attempt: _Attempt | None) -> None:
    """A fenced checkpoint read or write found the run taken over: abort the attempt and raise."""
    reason = LeaseLost(f"{job}: checkpoint refused, the run was taken over by another attempt")
    if attempt is not None:
        attempt.token.abort(reason)
    raise reason


def _to_json(value: Any) -> str:
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"checkpoint value must be JSON-serialisable: {exc}") from None


async def _await(coroutine: Awaitable[T]) -> T:
    return await coroutine


class Checkpoint:
    """``ctx.checkpoint``: the checkpoint of one run, shared by all its attempts (fenced writes).

    The ``*_sync`` forms are for plain-function handlers running in a worker thread.
    """

    def __init__(self, store: CheckpointStore, attempt: _Attempt, loop: asyncio.AbstractEventLoop):
        self._store, self._attempt, self._loop = store, attempt, loop
        self._job, self._slot = attempt.claim.job, attempt.claim.slot

    async def get(self, default: Any = None) -> Any:
        """The saved value, or ``default``; raises ``LeaseLost`` if the run was taken over."""
        return await self._store._read(self._job, self._slot, default, self._attempt)

    async def set(self, value: Any) -> None:
        """Save ``value``; raises ``LeaseLost`` (and aborts the run's token) if the run was taken over."""
        await self._store._write(self._job, self._slot, _to_json(value), self._attempt)

    async def delete(self) -> None:
        """Forget the saved value (fenced like ``set``)."""
        await self._store._write(self._job, self._slot, None, self._attempt)

    def get_sync(self, default: Any = None) -> Any:
        """``get`` for a plain-function handler's thread; ``RuntimeError`` on the event loop."""
        return self._blocking("get", lambda: self.get(default))

    def set_sync(self, value: Any) -> None:
        """``set`` for a plain-function handler's thread; ``RuntimeError`` on the event loop."""
        _to_json(value)
        self._blocking("set", lambda: self.set(value))

    def delete_sync(self) -> None:
        """``delete`` for a plain-function handler's thread; ``RuntimeError`` on the event loop."""
        self._blocking("delete", self.delete)

    def _blocking(self, name: str, make: Callable[[], Awaitable[T]]) -> T:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:  # it would wait for the loop it blocks: for ever
            raise RuntimeError(
                f"ctx.checkpoint.{name}_sync() called on the event loop (from an async handler): "
                f"use 'await ctx.checkpoint.{name}(...)' there; the _sync forms are for plain-function handlers"
            )
        return asyncio.run_coroutine_threadsafe(_await(make()), self._loop).result()


@dataclasses.dataclass
class RunContext:
    """What a handler receives: the run's identity, its cancellation token and its checkpoint."""

    job: str
    slot: int
    scheduled_at: _dt.datetime
    attempt: int
    signal: CancelToken
    checkpoint: Checkpoint
    instance: str
    _attempt: _Attempt = dataclasses.field(repr=False)
    _store: Callable[[Callable[[_Store], Any]], Awaitable[Any]] = dataclasses.field(repr=False)
    _log: logging.LoggerAdapter | None = dataclasses.field(default=None, repr=False)  # type: ignore[type-arg]

    @property
    def log(self) -> logging.LoggerAdapter:  # type: ignore[type-arg]
        """The logger ``anarchon_lite.job.<job>``, its lines saying the slot and attempt; made when
        first used (10,000 jobs due at once made 10,000 loggers, kept for the life of the process,
        for handlers that may never log)."""
        if self._log is None:
            self._log = _JobLog(self._attempt.job.logger, {"job": self.job, "slot": self.slot, "attempt": self.attempt})
        return self._log

    def progress(self, done: float, total: float | None = None) -> None:
        """Report progress; it travels with the next heartbeat, never as a write of its own.
        Raises ``ValueError`` for a number that is not finite (NaN has no place on a progress bar)."""
        progress = (float(done), None if total is None else float(total))
        if not all(math.isfinite(value) for value in progress if value is not None):
            raise ValueError(f"job {self.job!r}: progress must be finite numbers, not {progress}")
        self._attempt.progress = progress


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """A running (or waiting) attempt, as ``status()`` reports it."""

    job: str
    slot: int
    attempt: int
    state: str
    owner: str | None
    started_at: _dt.datetime | None
    age: float | None
    progress: tuple[float, float | None] | None


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """One job, as ``status()`` reports it."""

    name: str
    schedule: str
    paused: bool
    next_at: _dt.datetime | None
    runs: tuple[RunInfo, ...]
    definition: str | None = None  # as the process that last changed its declaration declared it
    declared_by: str | None = None  # that process's instance id
    undeclared: bool = False  # no running process declares it (removed from a crontab, renamed in code)
    last_status: str | None = None  # the status of its newest record (``running`` while that one runs)
    last_at: _dt.datetime | None = None  # when that record's attempt started (or its occurrence was due)
    next_start: _dt.datetime | None = None  # when the next occurrence starts: ``next_at`` and its jitter

    @property
    def state(self) -> str:
        """``undeclared``, ``paused``, ``done`` (a one-shot job that has had its occurrence and
        has no unfinished run) or ``active``."""
        if self.undeclared:
            return "undeclared"
        if self.paused:
            return "paused"
        done = self.schedule.startswith("at ") and self.next_at is None and not self.runs
        return "done" if done else "active"

    def _fill(self, row: _JobStatusRow, following: int | None, runs: tuple[RunInfo, ...], start: int | None) -> None:
        # (Filled in directly: a frozen dataclass's __init__ sets each field through
        # object.__setattr__, 2 us an object, a third of a status of 10,000 jobs.)
        self.__dict__.update(
            name=row.name,
            schedule=row.schedule,
            paused=bool(row.paused),
            next_at=None if following is None else _utc_from_ms(following),
            runs=runs,
            definition=row.definition,
            declared_by=row.declared_by,
            undeclared=bool(row.undeclared),
            last_status=row.last_status,
            last_at=None if row.last_at is None else _utc_from_ms(row.last_at),
            next_start=None if start is None else _utc_from_ms(start),
        )


def _stored_schedule(row: _JobStatusRow) -> _Schedule:
    """What a job's stored description tells of its starts, for ``status`` in a process that does
    not declare it: its jitter, when it has one (else any schedule will do: the start is the slot)."""
    if " jitter " in row.schedule:
        with contextlib.suppress(ConfigError):
            return _schedule_from(row.schedule, row.name)
    return _NO_DELAY


_NO_DELAY = _OnStart()  # (a schedule whose ``start_of`` is the slot, for ``_stored_schedule``)


def _run_info(row: _RunRow, now: float) -> RunInfo:
    started = _dt_or_none(row.started_at)
    progress = None if row.progress_done is None else (row.progress_done, row.progress_total)
    age = None if row.started_at is None or row.state != "running" else max(0.0, now - row.started_at / 1000)
    return RunInfo(row.job, row.slot, row.attempt, row.state, row.owner, started, age, progress)


###############################################################################
# Running an attempt ##########################################################
###############################################################################

_LAST_WORDS = 1.0  # seconds a hurried handler has left before it is cancelled, then closed
_HURRIED = 2 * _LAST_WORDS + 5.0  # seconds hurried attempts have to end and write their ends
_END_TRIES = 60  # writes of an attempt's end, a pause between each (doubling up to 5 s), before it is left


def _safe_to_raise(exc: BaseException) -> BaseException:
    """What a handler's exception becomes on its way to the scheduler: one that cannot stop the
    event loop (asyncio lets ``SystemExit`` and ``KeyboardInterrupt`` out of a task) or be refused
    by a future (``StopIteration``)."""
    if isinstance(exc, (Exception, Aborted, asyncio.CancelledError)) and not isinstance(exc, StopIteration):
        return exc
    return HandlerEscaped(exc)


class _AbandonableCoroutine:
    """An ``async`` handler's coroutine, stepped for its task by this object instead of by ``await``.

    Exceptions are passed through ``_safe_to_raise``. ``abandon()`` handles a coroutine that swallows
    ``CancelledError``: at the next step (the task's next cancel), the coroutine is closed
    (``GeneratorExit`` at the ``await`` where it waits, so its ``finally`` blocks run) and is never
    resumed again, whatever it does; the task ends cancelled.
    """

    def __init__(self, coroutine: Coroutine[Any, Any, Any]):
        self._coroutine = coroutine
        self._abandoned = False

    def abandon(self) -> None:
        self._abandoned = True

    def __await__(self) -> Generator[Any, None, Any]:
        coroutine = self._coroutine
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = coroutine.send(value) if error is None else coroutine.throw(error)
            except StopIteration as stop:
                return stop.value
            except BaseException as exc:
                contained = _safe_to_raise(exc)
                if contained is exc:
                    raise
                raise contained from exc
            value, error = None, None
            try:
                value = yield step
            except GeneratorExit:
                coroutine.close()
                raise
            except BaseException as exc:  # thrown in by the task: a cancellation
                if self._abandoned:
                    self._close()
                    raise
                error = exc

    def _close(self) -> None:
        try:
            self._coroutine.close()
        except BaseException as exc:  # noqa: BLE001 - it ignored GeneratorExit too: it is dropped
            _log.warning("an abandoned handler did not stop when closed: %s: %s", type(exc).__name__, exc)


@dataclasses.dataclass
class _Outcome:
    status: str | None  # None: the attempt lost its run, nothing to write
    error: str | None = None
    retryable: bool = False
    output: str | None = None
    said: str | None = None  # what the handler raised, ``Type: message``: the log line's start

    def __post_init__(self) -> None:  # whatever the handler handed back, text every store and log takes
        self.error = None if self.error is None else _safe_text(self.error, _ERROR_CHARS)
        self.output = None if self.output is None else _safe_text(self.output, _OUTPUT_CHARS)


def _start_thread(
    handler: Handler,
    ctx: RunContext,
    context: contextvars.Context,
    future: asyncio.Future[Any],
    loop: asyncio.AbstractEventLoop,
) -> None:
    def body() -> None:
        try:
            result = context.run(handler, ctx)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, which judges it
            _hand_back(loop, _set_exception, future, _safe_to_raise(exc))
        else:
            _hand_back(loop, _set_result, future, result)

    threading.Thread(target=body, name=f"anarchon-{ctx.job}", daemon=True).start()


def _hand_back(loop: asyncio.AbstractEventLoop, setter: Callable[..., None], *args: Any) -> bool:
    """A thread's answer (a handler's result, a store call's), to its event loop; whether it was
    handed. A loop already closed (the handler returned after ``stop()`` gave up on it: its attempt
    was ended and fenced then) is told nothing."""
    try:
        loop.call_soon_threadsafe(setter, *args)
    except RuntimeError:
        return False
    return True


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


_ABORT_STATUS = {Shutdown: "interrupted", Cancelled: "cancelled", RunTimeout: "timed_out"}
_FAILED = ("failed", "timed_out")  # the ends of an attempt that ``on_failure`` is told of


def _outcome(work: asyncio.Future[Any], token: CancelToken, grace: float) -> _Outcome:
    """Judge how an attempt ended, from its handler's result and its token's reason."""
    reason = token.reason
    if work.done() and not work.cancelled():
        work.exception()  # retrieved, whatever the verdict (else asyncio logs it as lost)
    if isinstance(reason, LeaseLost):
        return _Outcome(None)
    if isinstance(reason, RunTimeout):
        return _Outcome("timed_out", str(reason), retryable=True)
    if reason is None and work.cancelled():
        return _Outcome("failed", "asyncio.CancelledError: the handler ended cancelled, with no abort", retryable=True)
    if not work.done() or work.cancelled():
        status = next((s for cls, s in _ABORT_STATUS.items() if isinstance(reason, cls)), "failed")
        return _Outcome(status, f"did not return within the {format_duration(grace)} grace period after: {reason}")
    exc = work.exception()
    if exc is None:
        return _Outcome("succeeded", output=_tail(work.result()))
    if isinstance(exc, LeaseLost):
        return _Outcome(None)
    if isinstance(exc, Aborted):
        status = next(s for cls, s in _ABORT_STATUS.items() if isinstance(exc, cls))
        return _Outcome(status, _said(exc), retryable=status == "timed_out")
    output = _tail(_attribute(exc, "output"))
    if isinstance(exc, _PlainFailure):
        return _Outcome("failed", _safe_text(exc), retryable=True, output=output)
    return _Outcome("failed", _error_text(exc), retryable=True, output=output, said=_said(exc))


async def _call_async(hook: FailureHook, record: RunRecord) -> None:
    """An async ``on_failure`` called in its task (so what even the call raises is the task's)."""
    await cast("Awaitable[object]", hook(record))


def _said(exc: BaseException) -> str:
    """``Type: message`` of an exception, whatever its methods do."""
    return f"{_type_name(exc)}: {_safe_text(exc)}"


def _summary(error: str, said: str | None) -> str:
    """A failure's text for a log line: what was raised first, then where (the record keeps the
    traceback's order, where first)."""
    if said is None or not error.endswith(said) or error == said:
        return error
    return f"{said}\n  {error[: -len(said)].strip()}"


def _error_text(exc: BaseException) -> str:
    """A failure as its record keeps it: the handler's last two frames (this module's own frames
    left out: where the handler raised, not where the library awaited it), then ``Type: message``."""
    shown = exc.exception if isinstance(exc, HandlerEscaped) else exc
    try:
        frames = [f for f in traceback.extract_tb(shown.__traceback__) if f.filename not in _THIS_FILE][-2:]
        where = "".join(traceback.format_list(frames))
    except BaseException:  # noqa: BLE001 - a traceback that cannot be read: the message alone
        where = ""
    return f"{where}{_said(exc)}".strip()[-_ERROR_CHARS:]


# The names this file's frames carry: the path it was imported from, and the one its code was
# compiled at (they differ for a copy whose cached bytecode was written elsewhere).
_THIS_FILE = frozenset({__file__, _error_text.__code__.co_filename})


def _attribute(value: object, name: str) -> object:
    """``getattr(value, name, None)``, for objects whose attributes may raise."""
    try:
        return getattr(value, name, None)
    except BaseException:  # noqa: BLE001 - a property that raises: as if it were not there
        return None


def _tail(value: object) -> str | None:
    return _safe_text(value, _OUTPUT_CHARS) if isinstance(value, str) else None


# Every attempt's start and end is logged, with ``extra`` fields (job, slot, attempt, status,
# duration) for handlers that keep structure: INFO for a start and a success, ERROR for a failure or
# a timeout (with the error's last lines and the output's), WARNING for any other end. The same
# moments are ``RunEvent``s for the listeners of ``Scheduler.on_event``.
_END_LEVELS = {"succeeded": logging.INFO, "failed": logging.ERROR, "timed_out": logging.ERROR}
_LOGGED_OUTPUT_LINES = 10
EventKind = Literal[
    "started",
    "succeeded",
    "failed",
    "timed_out",
    "interrupted",
    "handed_over",
    "cancelled",
    "lost",
    "skipped",
    "missed",
    "taken_over",
]


@dataclasses.dataclass(frozen=True)
class RunEvent:
    """What just happened to a run in this process, as ``Scheduler.on_event`` listeners get it.

    ``kind``: ``started``; an end (``succeeded``, ``failed``, ``timed_out``, ``cancelled``,
    ``interrupted``, ``handed_over`` when an interrupted run goes to the next process, ``lost`` when
    another attempt took it); ``skipped`` or ``missed`` (attempt 0; ``count`` says how many were
    missed); ``taken_over`` (this process takes a run over as ``attempt``; ``error`` says why).
    ``duration`` (seconds) and ``error`` come with an end."""

    kind: EventKind
    job: str
    slot: int
    attempt: int
    instance: str
    duration: float | None = None
    error: str | None = None
    count: int | None = None


class _Events:
    """Logs what happens to runs and tells the listeners (on the event loop's thread)."""

    def __init__(self, instance: str):
        self.instance = instance
        self.listeners: list[Callable[[RunEvent], object]] = []  #: in the order they were added

    def tell(self, level: int, kind: EventKind, job: str, slot: int, attempt: int, what: str, **fields: Any) -> None:
        if _log.isEnabledFor(level):
            when = _utc_from_ms(slot).isoformat(timespec="seconds").replace("+00:00", "Z")
            name = f"{job} {when}" + (f" attempt {attempt}" if attempt else "")
            extra = {"job": job, "slot": slot, "attempt": attempt, **{k: v for k, v in fields.items() if k != "error"}}
            _log.log(level, "%s %s", name, what, extra=extra)
        if self.listeners:
            event = RunEvent(
                kind,
                job,
                slot,
                attempt,
                self.instance,
                fields.get("duration"),
                fields.get("error"),
                fields.get("count"),
            )
            for listener in list(self.listeners):
                try:
                    listener(event)
                except Exception:  # noqa: BLE001 - a listener must never break a run
                    _log.exception("an on_event listener failed on %s of %s", kind, job)

    def end(self, attempt: _Attempt, outcome: _Outcome, duration: float, then: _AfterEnd) -> None:
        claim, status = attempt.claim, outcome.status or "lost"
        level = _END_LEVELS.get(status, logging.WARNING)
        if not self.listeners and not _log.isEnabledFor(level):
            return  # (no one to tell: a burst of 10,000 short runs spent 5% of its loop's time saying it)
        what = f"{status} after {_elapsed(duration)}" if status != "lost" else "lost its run to another attempt"
        kind: EventKind = "handed_over" if then is _AfterEnd.HANDOVER else cast(EventKind, status)
        if then is _AfterEnd.RETRY:
            what += ", to be retried"
        elif then is _AfterEnd.HANDOVER:
            what += ", handed over"
        if outcome.error and status != "succeeded":
            what += f": {_summary(outcome.error, outcome.said)}"
        if outcome.output and status in ("failed", "timed_out"):
            tail = outcome.output.rstrip("\n").splitlines()[-_LOGGED_OUTPUT_LINES:]
            what += "".join(f"\n  | {line}" for line in tail)
        fields = {"status": status, "duration": round(duration, 3), "error": outcome.error}
        self.tell(level, kind, claim.job, claim.slot, claim.attempt, what, **fields)


class _Call:
    """One attempt's call of its handler, driven by callbacks on the loop, not by a task of its own
    (a task per attempt waiting on its handler's was a third of the loop's work in a burst): where
    its grace stands after an abort, and its end until written."""

    __slots__ = ("attempt", "cancel_timeout", "driven", "end", "grace", "phase", "timer", "tries", "work")

    def __init__(self, attempt: _Attempt, work: asyncio.Future[Any], driven: _AbandonableCoroutine | None):
        self.attempt = attempt
        self.grace = attempt.job.options.grace  #: after an abort (after ``Shutdown``: the stop's grace, if shorter)
        #: the handler's task, or the future its thread sets (None once ended: its end is all that is kept)
        self.work: asyncio.Future[Any] | None = work
        self.driven = driven  #: an ``async`` handler's coroutine, as its task steps it (None once ended)
        self.phase = 0  #: 0 running; 1, 2, 3 in a grace (``_Runner._plan``); -1 ended; -2 given up
        self.timer: asyncio.TimerHandle | None = None  #: a grace's end, or the next try of the end's write
        self.cancel_timeout: Callable[[], None] = _nothing
        self.end: _End | None = None  #: once ended, what its record says
        self.tries = 0  #: failed writes of its end


class _Runner:
    """The attempts running in this process: each handler in its task or thread, its timeout, its
    grace after an abort, and the write of its end (a retry, a hand-over or done); at a stop,
    waiting for them all. Lives on the event loop."""

    def __init__(
        self,
        link: _StoreLink,
        clock: Clock,
        instance: str,
        checkpoints: CheckpointStore,
        poke: Callable[[], None],
        events: _Events,
    ):
        self._link, self._clock, self._instance = link, clock, instance
        self._events = events
        self._checkpoints = checkpoints
        self._poke = poke  #: called after an end that leaves the run to be claimed: the scheduler looks again
        self.ends_written: Callable[[], None] = _nothing  #: called after each write of ends
        self.started: Callable[[], None] = _nothing  #: called after an attempt began
        self.untidy: Callable[[], None] = _nothing  #: called when a write of ends left the store upkeep
        self.running: dict[tuple[str, int], _Attempt] = {}  #: this process's attempts, by (job, slot)
        #: (job, slot, attempt) of this process's attempts that have ended, while the runs read may still show them
        self.ended: set[tuple[str, int, int]] = set()
        self.calls: set[_Call] = set()  #: the attempts started here and not yet settled (their ends written)
        self._settled_all: asyncio.Future[None] | None = None  #: resolved once ``calls`` is empty (a drain waits)
        self.hooks: set[asyncio.Future[Any]] = set()  #: ``on_failure`` calls still running
        self.grace = 10.0  #: the grace of the stop in progress
        self.hurry: asyncio.Event | None = None  #: set when the stop's grace is over (or cut short)
        self._stopped: Callable[[str], Aborted] | None = None  #: the stop's reason, once it began (``stop``)
        self._ends: list[tuple[_End, _Call]] = []  #: attempts' ends waiting to be written
        #: seconds the end of a run of this job (its run over) may wait for the next claim's transaction
        self.end_wait: Callable[[str], float] = lambda job: 0.0
        self._flush: asyncio.Handle | None = None  #: the write of the ends waiting, planned
        self._flush_at = math.inf  #: when (the loop's time)
        self._heartbeats: _Heartbeats | None = None
        self._timers: _Timers | None = None
        self._watchdog: _Watchdog | None = None

    def begin(self, heartbeats: _Heartbeats, timers: _Timers, watchdog: _Watchdog) -> None:
        """Attach the threads that keep attempts alive, as the scheduler starts serving."""
        self._heartbeats, self._timers, self._watchdog = heartbeats, timers, watchdog
        self.hurry = asyncio.Event()
        self._stopped = None

    def stop(self, reason: Callable[[str], Aborted]) -> None:
        """Abort the running attempts with ``reason(job name)``, and every attempt started from
        now on (won by a claim that was in flight as the process began to stop)."""
        self._stopped = reason
        self.abort(reason)

    def abort(self, reason: Callable[[str], Aborted], job: str | None = None) -> None:
        """Abort the running attempts (of ``job``, or all) with ``reason(job name)``."""
        for attempt in list(self.running.values()):
            if job is None or attempt.claim.job == job:
                attempt.token.abort(reason(attempt.claim.job))

    def lose(self, why: str) -> None:
        """This process's claim on its runs may be gone (``why``: the database was replaced, the
        session holding its lock ended): abort every running attempt with ``LeaseLost``."""
        self.abort(lambda job: LeaseLost(f"{job}: {why}"))

    def judge(self, run: _RunRow) -> bool:
        """The one place that decides from the store's view that an attempt of this process was
        superseded (a newer attempt holds the run: ``LeaseLost``) or cancelled, and aborts it.
        True when ``run`` is one of this process's running attempts (the loop leaves it alone)."""
        mine = self.running.get((run.job, run.slot))
        if mine is None:
            return False
        # The snapshot may predate this process's own claim; only a newer attempt means a takeover.
        if run.attempt > mine.claim.attempt:
            mine.token.abort(LeaseLost(f"{run.job}: the run was taken over by another attempt"))
        elif run.cancel and run.attempt == mine.claim.attempt:
            mine.token.abort(Cancelled(f"{run.job}: cancelled"))
        return True

    def start(self, job: _Job, claim: _Claim) -> None:
        """Run the attempt that ``claim`` won: its handler in a task or thread of its own, the rest
        (its grace after an abort, its end) in callbacks on the loop (``_Call``)."""
        assert self._heartbeats is not None and self._timers is not None and self._watchdog is not None
        token = _AttemptToken()
        if self._stopped is not None:  # (a claim answered after the stop began: its run is handed over)
            token.abort(self._stopped(claim.job))
        attempt = _Attempt(job, claim, self._instance, token, job.options.lease, max(job.options.lease / 3, 0.05))
        self.running[(claim.job, claim.slot)] = attempt
        self._heartbeats.add(attempt)
        self._watchdog.acquire()
        attempt.started = self._clock.monotonic()
        self._events.tell(logging.INFO, "started", claim.job, claim.slot, claim.attempt, "started", status="running")
        work, driven = self._call_handler(attempt)
        self._watchdog.ping()  # (after the handler's first step: a step that blocks the loop is told)
        call = _Call(attempt, work, driven)
        if job.options.timeout is not None:
            call.cancel_timeout = self._time_out(attempt, job.options.timeout)
        self.calls.add(call)
        work.add_done_callback(functools.partial(self._returned, call))
        loop = asyncio.get_running_loop()  # (from any thread: the token hands the abort to the loop)
        token.told = functools.partial(loop.call_soon_threadsafe, self._aborted, call)
        if token.aborted:  # (by the heartbeat thread since ``add``: before it could tell)
            loop.call_soon(self._aborted, call)
        self.started()

    async def drain(self) -> None:
        """After a stop: wait up to the stop grace for the attempts, which hand their runs over;
        then hurry the rest (cancelled, abandoned) and let them write their ends; then give up on
        those whose ends cannot be written (the next owner takes their runs over). Takes
        ``longest_drain()`` at most."""
        assert self.hurry is not None
        self.write_ends()  # (none waits for a claim any more)
        await self._all_settled(self.grace + 0.1, self.hurry)
        self.hurry_now()
        await self._all_settled(_HURRIED)
        for call in list(self.calls):  # a store that does not answer: the next owner takes the runs over
            self._give_up(call)
        if self.hooks:  # the failures just told (a mail being sent)
            await asyncio.wait(set(self.hooks), timeout=_HURRIED)

    async def _all_settled(self, timeout: float, hurry: asyncio.Event | None = None) -> None:
        """Wait up to ``timeout`` seconds for every attempt to be settled (or for ``hurry``)."""
        if not self.calls:
            return
        self._settled_all = settled = asyncio.get_running_loop().create_future()
        waiters: set[asyncio.Future[Any]] = {settled}
        if hurry is not None:
            waiters.add(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._settled_all = None
            for waiter in waiters:
                waiter.cancel()

    def hurry_now(self) -> None:
        """Cut the stop's grace short: every attempt still within a grace has ``_LAST_WORDS`` left
        of it at most."""
        assert self.hurry is not None
        self.hurry.set()
        now = asyncio.get_running_loop().time()
        for call in self.calls:
            if call.phase in (1, 2) and call.timer is not None and call.timer.when() > now + _LAST_WORDS:
                self._plan(call, call.phase, _LAST_WORDS)

    def join_threads(self, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds each) for the heartbeat and timer threads of the last
        run to end: its end told them to stop."""
        for thread in (self._heartbeats, self._timers):
            if thread is not None and thread.is_alive():
                thread.join(timeout)

    def longest_drain(self) -> float:
        """The seconds ``drain()`` takes at most."""
        return self.grace + 0.1 + _HURRIED + _HURRIED  # (the last: the ``on_failure`` calls still running)

    def _time_out(self, attempt: _Attempt, limit: float) -> Callable[[], None]:
        """Abort ``attempt`` with ``RunTimeout`` once ``limit`` seconds have passed; returns what
        cancels that. (Not in ``start``: what its lambda would hold stays alive with every attempt.)"""
        assert self._timers is not None
        reason = f"{attempt.job.name}: timed out after {format_duration(limit)}"
        return self._timers.call_at(self._clock.monotonic() + limit, lambda: attempt.token.abort(RunTimeout(reason)))

    def _context(self, attempt: _Attempt) -> RunContext:
        claim = attempt.claim
        loop = asyncio.get_running_loop()
        return RunContext(
            job=claim.job,
            slot=claim.slot,
            scheduled_at=_utc_from_ms(claim.slot),
            attempt=claim.attempt,
            signal=attempt.token,
            checkpoint=Checkpoint(self._checkpoints, attempt, loop),
            instance=self._instance,
            _attempt=attempt,
            _store=self._link.call,
        )

    def _call_handler(self, attempt: _Attempt) -> tuple[asyncio.Future[Any], _AbandonableCoroutine | None]:
        """Start the handler, in its task (``async``) or thread: the future of its end, and the
        coroutine its task steps (``async``)."""
        ctx = self._context(attempt)
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        context.run(_current_attempt.set, attempt)
        work: asyncio.Future[Any]
        if not attempt.job.is_async:
            work = loop.create_future()
            try:  # (a thread that cannot be started, on a small device in a burst: this attempt fails, alone)
                _start_thread(attempt.job.handler, ctx, context, work, loop)
            except BaseException as exc:  # noqa: BLE001 - judged by ``_outcome``, made safe as what it raises
                work.set_exception(_safe_to_raise(exc))
            return work, None
        try:  # (calling it is part of the attempt: an ``async def`` that takes no ``ctx`` fails it)
            coroutine = context.run(attempt.job.handler, ctx)
        except BaseException as exc:  # noqa: BLE001 - judged by ``_outcome``, made safe as what it raises
            work = loop.create_future()
            work.set_exception(_safe_to_raise(exc))
            return work, None
        driven = _AbandonableCoroutine(coroutine if inspect.iscoroutine(coroutine) else _await(coroutine))
        return context.run(loop.create_task, _await(driven)), driven

    def _aborted(self, call: _Call, *_reason: object) -> None:
        """The attempt's token aborted: the handler has its grace to return by itself."""
        if call.phase or call.work is None or call.work.done():
            return
        if isinstance(call.attempt.token.reason, Shutdown):
            call.grace = min(call.grace, self.grace)
        self._plan(call, 1, call.grace)

    def _plan(self, call: _Call, phase: int, seconds: float) -> None:
        """Give ``call`` ``seconds`` (once the stop is hurried, ``_LAST_WORDS`` at most) of grace
        ``phase``: 1 to return by itself, 2 once cancelled, 3 once abandoned."""
        if self.hurry is not None and self.hurry.is_set() and phase < 3:
            seconds = min(seconds, _LAST_WORDS)
        if call.timer is not None:
            call.timer.cancel()
        call.phase = phase
        call.timer = asyncio.get_running_loop().call_later(seconds, self._graced, call)

    def _graced(self, call: _Call) -> None:
        """A grace ran out with the handler still running: cancel it (``async``), then close it at
        its next ``await`` whatever it does (it swallowed the cancel); a thread is abandoned."""
        call.timer = None
        if call.phase < 0 or call.work is None or call.work.done():
            return
        if call.driven is not None and call.phase == 1:
            call.work.cancel()  # then CancelledError, and another grace
            self._plan(call, 2, call.grace)
        elif call.driven is not None and call.phase == 2:
            call.driven.abandon()
            call.work.cancel()
            self._plan(call, 3, _LAST_WORDS)
        else:
            self._end(call)

    def _returned(self, call: _Call, _work: asyncio.Future[Any]) -> None:
        if call.phase >= 0:
            self._end(call)

    def _end(self, call: _Call) -> None:
        """The attempt is over (its handler returned, or was abandoned): judge it, write its end."""
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        work, call.work, call.driven, call.phase = call.work, None, None, -1  # (kept no longer than needed)
        assert work is not None
        self._let_go(call)
        self._settle(call, _outcome(work, call.attempt.token, call.grace))

    def _let_go(self, call: _Call) -> None:
        """The attempt no longer runs here (its token, timeout, heartbeats and watchdog let go of it)."""
        attempt, claim = call.attempt, call.attempt.claim
        assert self._watchdog is not None
        attempt.token.told = None
        call.cancel_timeout()
        call.cancel_timeout = _nothing
        attempt.done = True
        self._watchdog.release()
        self.running.pop((claim.job, claim.slot), None)
        self.ended.add((claim.job, claim.slot, claim.attempt))

    def _settle(self, call: _Call, outcome: _Outcome) -> None:
        """Write the attempt's end: done, a retry after backoff, or a hand-over (fenced); log it."""
        attempt = call.attempt
        duration = self._clock.monotonic() - attempt.started
        if outcome.status is None:
            self._events.end(attempt, outcome, duration, _AfterEnd.DONE)
            self._settled(call)
            return
        claim, options = attempt.claim, attempt.job.options
        then, not_before = _AfterEnd.DONE, 0
        now_ms = _ms(self._clock.time())
        if outcome.status == "interrupted":
            then, not_before = _AfterEnd.HANDOVER, now_ms
        elif outcome.retryable and claim.failures < options.retries:
            backoff = min(options.retry_delay * 2 ** min(claim.failures, 64), _MAX_DURATION)
            then, not_before = _AfterEnd.RETRY, now_ms + _ms(backoff)
        call.end = _End(claim, outcome.status, outcome.error, now_ms, then, not_before, outcome.output)
        self._events.end(attempt, outcome, duration, then)
        self._finish(call)

    def _end_written(self, call: _Call, written: bool | None, exc: BaseException | None) -> None:
        """The store's answer to the write of ``call``'s end: on a failure, try again after a
        pause (60 times at most); then tell ``on_failure``, and the loop of a run left to claim."""
        end = call.end
        assert end is not None
        if call.phase == -2:  # (given up by the drain)
            return
        if isinstance(exc, Exception):  # a StoreError passes; anything else is this end's own
            claim = end.claim
            if not isinstance(exc, StoreError):  # the end as bare as can be: its status alone
                _log.error(
                    "%s slot %s: the end of attempt %s cannot be written",
                    claim.job,
                    claim.slot,
                    claim.attempt,
                    exc_info=(type(exc), exc, exc.__traceback__),
                )
                call.end = dataclasses.replace(end, error=f"(its text could not be stored: {_said(exc)})", output=None)
            _log.error(
                "%s slot %s: cannot record the end of attempt %s, retrying: %s",
                claim.job,
                claim.slot,
                claim.attempt,
                exc,
            )
            call.tries += 1
            if call.tries < _END_TRIES:
                pause = min(0.1 * 2 ** (call.tries - 1), 5.0)
                call.timer = asyncio.get_running_loop().call_later(pause, self._finish, call)
                return
        if written and end.status in _FAILED:
            self._ended_failed(call.attempt.job, end)
        if end.then is not _AfterEnd.DONE:
            self._poke()
        self._settled(call)

    def _settled(self, call: _Call) -> None:
        self.calls.discard(call)
        if not self.calls and self._settled_all is not None:
            _resolve(self._settled_all)

    def _give_up(self, call: _Call) -> None:
        """Leave ``call`` as it is (its end unwritten: the store does not answer, or its handler
        never let go), so that the stop can end."""
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        if call.phase != -1:
            self._let_go(call)
        call.phase = -2
        self.calls.discard(call)

    def _ended_failed(self, job: _Job, end: _End) -> None:
        """This process wrote the end of a failed or timed-out attempt (fenced: no other process
        wrote it): tell ``on_failure`` when it made the run failed for good, or of every attempt
        when asked to."""
        if end.then is _AfterEnd.DONE or job.options.on_failure_every_attempt:
            claim = end.claim
            started, finished = _dt_or_none(claim.started_at), _utc_from_ms(end.now_ms)
            record = RunRecord(
                claim.job,
                claim.slot,
                claim.attempt,
                end.status,
                self._instance,
                started,
                finished,
                end.error,
                end.output,
            )
            self.tell_failure(job, record)

    def tell_failure(self, job: _Job, record: RunRecord) -> None:
        """Call ``job``'s ``on_failure`` with ``record`` (an async one as a task, a plain one in a
        thread, so that neither holds up the scheduler); what it raises is logged, never raised."""
        hook = job.options.on_failure
        if hook is None:
            return
        loop = asyncio.get_running_loop()
        call = (
            loop.create_task(_call_async(hook, record)) if _is_async(hook) else loop.run_in_executor(None, hook, record)
        )
        self.hooks.add(call)
        call.add_done_callback(functools.partial(self._hook_done, job.name, record))

    def _hook_done(self, job: str, record: RunRecord, call: asyncio.Future[Any]) -> None:
        self.hooks.discard(call)
        exc = None if call.cancelled() else call.exception()
        if exc is not None:
            _log.error(
                "%s slot %s: on_failure raised: %s",
                job,
                record.slot,
                _said(exc),
                exc_info=(type(exc), exc, exc.__traceback__),
            )

    def _finish(self, call: _Call) -> None:
        """Write an attempt's end (``call.end``; ``_end_written`` gets the answer). The ends of
        attempts that finish together are written in one transaction: at fifty jobs every 100 ms,
        one commit per end would keep the disk busy. An end with its run over may wait a little for
        this process's next claim (``end_wait``), which writes it in its own transaction
        (``take_ends``), if half its lease is left after the wait (it is no longer renewed: past
        its lease, another process would run it again)."""
        end, attempt = call.end, call.attempt
        assert end is not None
        call.timer = None
        loop = asyncio.get_running_loop()
        self._ends.append((end, call))
        wait = self.end_wait(end.claim.job) if end.then is _AfterEnd.DONE else 0.0
        if wait and attempt.valid_until - time.monotonic() - wait < attempt.lease / 2:
            wait = 0.0
        at = loop.time() + wait
        if at < self._flush_at:  # (sooner than the write planned, if any)
            if self._flush is not None:
                self._flush.cancel()
            self._flush_at = at
            # (at once: after the attempts ending in this turn of the loop)
            self._flush = loop.call_at(at, self.write_ends) if wait else loop.call_soon(self.write_ends)

    def take_ends(self) -> list[tuple[_End, _Call]]:
        """The ends waiting, no longer planned to be written: the caller writes them and tells
        ``written`` of the store's answer."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush, self._flush_at = None, math.inf
        batch, self._ends = self._ends, []
        return batch

    def write_ends(self) -> None:
        """Send the ends waiting (if any) to the store in one call; no task: the store's answer is
        handed to ``written`` (a task with a turn to gather the ends took the loop three turns more)."""
        batch = self.take_ends()
        if batch:
            self.write_batch(batch)

    def write_batch(self, batch: list[tuple[_End, _Call]]) -> None:
        ends = [end for end, _ in batch]
        try:
            self._link.submit(
                lambda s: s.finish_many(self._instance, ends),
                functools.partial(self.written, batch),
                len(ends) <= _ON_THE_LOOP,
            )
        except Exception as exc:  # noqa: BLE001 - (the store could not be opened) every waiting attempt gets it
            self.written(batch, None, exc)

    def written(self, batch: list[tuple[_End, _Call]], results: list[bool] | None, exc: BaseException | None) -> None:
        """The store's answer to a batch of ends, to the attempts waiting for it."""
        if exc is not None:  # every waiting attempt gets it (a StoreError: each retries)
            if isinstance(exc, Exception) and not isinstance(exc, StoreError) and len(batch) > 1:
                for one in batch:  # not the store: one end's own fault, never its neighbours'
                    self.write_batch([one])
                return
            for _, call in batch:
                self._end_written(call, None, exc)
            return
        assert results is not None
        for (_, call), written in zip(batch, results):
            self._end_written(call, written, None)
        self.ends_written()
        if self._link.untidy:
            self.untidy()


###############################################################################
# Planning occurrences ########################################################
###############################################################################

_ON_TIME = 5.0  # seconds: an occurrence found later than this after its time was missed (downtime)
_MISSED_RECORDS = 100


@dataclasses.dataclass(frozen=True)
class _Plan:
    slot: int
    next_slot: int | None
    run: bool
    missed: list[tuple[int, str | None]]
    missed_count: int


def _next_due(job: _Job, row: _JobRow) -> int | None:
    """The next occurrence of ``job`` after its watermark in ``row`` (the stored next slot, when
    the row was declared as this process declares it), or None."""
    return job.next_due(row.last_slot, row.next_slot if row.definition == job.definition else None)


def _comes_due_by(job: _Job, row: _JobRow, at_ms: int) -> bool:
    """Whether the next occurrence of ``job`` after its watermark in ``row`` starts by ``at_ms``."""
    after = _next_due(job, row)
    return after is not None and job.schedule.start_of(after) <= at_ms


class _Agenda:
    """The job rows as this process last read them, and the declared, unpaused jobs among them in
    the order they come due: a look finds what is due in time that grows with what is due, and a
    read that brings a few changed rows moves only those, not with what is declared.

    A job's place, once it moves, is left behind stale rather than deleted (deleting from the front
    of 10,000 entries moves the rest: a burst of 10,000 claimed in batches of 100 spent 90 ms on it),
    cut off the front in one move where the agenda is read (a look that skipped them instead went
    through every place left behind since the last sweep: 10,000 jobs every minute took 70% more
    CPU), skipped where the agenda is read further on, and swept out in one pass once they are half
    of it."""

    def __init__(self, jobs: dict[str, _Job], rows: Iterable[_JobRow], look: Callable[[str, int], int]):
        self.jobs = jobs  #: the declarations it was made for (the scheduler's)
        self._look = look  #: when this process looks at an occurrence of a job, given its start (ms)
        self.count = len(jobs)
        self.rows: dict[str, _JobRow] = {row.name: row for row in rows}  #: every row, by job name
        self.seen = max((row.changed for row in self.rows.values()), default=0)  #: the newest change number read
        entries = sorted(entry for row in self.rows.values() if (entry := self._entry(row)) is not None)
        self._keys = [key for key, _ in entries]  # (due, name), ascending; no key twice
        self._entries = [entry for _, entry in entries]
        self._due: dict[str, int] = {key[1]: key[0] for key in self._keys}  #: each live place's due, by job
        self._stale = 0  #: places left behind (a key is live when ``_due`` has it)

    def _entry(self, row: _JobRow) -> tuple[tuple[int, str], tuple[_Job, _JobRow]] | None:
        job = self.jobs.get(row.name)
        if job is None or row.paused:
            return None
        due = _next_due(job, row)
        return None if due is None else ((self._look(row.name, job.schedule.start_of(due)), row.name), (job, row))

    def current(self, jobs: dict[str, _Job]) -> bool:
        """Whether it was made for these declarations."""
        return jobs is self.jobs and len(jobs) == self.count

    def _live(self, key: tuple[int, str]) -> bool:
        return self._due.get(key[1]) == key[0]

    def update(self, rows: Iterable[_JobRow]) -> None:
        """Take in rows read again (changed, or read whole)."""
        keys, entries = self._keys, self._entries
        for row in rows:
            self.rows[row.name] = row
            self.seen = max(self.seen, row.changed)
            was = self._due.pop(row.name, None)
            entry = self._entry(row)
            if was is not None and (entry is None or entry[0][0] != was):
                self._stale += 1
            if entry is None:
                continue
            key = entry[0]
            at = bisect.bisect_left(keys, key)
            if at < len(keys) and keys[at] == key:  # its own place, or one it had left: live again
                entries[at] = entry[1]
                if was != key[0]:
                    self._stale -= 1
            else:
                keys.insert(at, key)
                entries.insert(at, entry[1])
            self._due[row.name] = key[0]
        if self._stale > max(64, len(keys) // 2):
            live = [at for at, key in enumerate(keys) if self._live(key)]
            self._keys, self._entries = [keys[at] for at in live], [entries[at] for at in live]
            self._stale = 0

    def _next(self, at: int) -> int:
        """The first live place from ``at`` on (``len``: none)."""
        keys = self._keys
        while at < len(keys) and not self._live(keys[at]):
            at += 1
        return at

    def _trim(self) -> None:
        """Cut the places left behind at the front off, in one move of the rest."""
        stale = self._next(0)
        if stale:
            del self._keys[:stale], self._entries[:stale]
            self._stale -= stale

    def first(self) -> tuple[int, str] | None:
        """The start of the next occurrence this process looks at, and its job's name (None:
        nothing is due)."""
        self._trim()
        if not self._keys:
            return None
        job, row = self._entries[0]
        due = _next_due(job, row)
        return (self._keys[0][0] if due is None else job.schedule.start_of(due)), job.name

    def next_look(self) -> int | None:
        """When this process next looks at an occurrence (ms; None: nothing is due)."""
        self._trim()
        return self._keys[0][0] if self._keys else None

    def ready(self, now_ms: int, wait: float) -> tuple[list[tuple[_Job, _JobRow]], float]:
        """The jobs with an occurrence due by ``now_ms`` (its start: its time and its jitter; each
        with its row), and the seconds until the next occurrence of the others is due, at most ``wait``."""
        self._trim()
        keys = self._keys
        count = bisect.bisect_left(keys, (now_ms + 1,))
        after = self._next(count)
        if after < len(keys):
            wait = min(wait, (keys[after][0] - now_ms) / 1000)
        if not self._stale:
            return self._entries[:count], wait
        return [entry for key, entry in zip(keys[:count], self._entries) if self._live(key)], wait


def _plan_due(job: _Job, last_slot: int, now_ms: int) -> _Plan:
    """Decide what to do with the occurrences of ``job`` after ``last_slot`` that are due by now.

    Of the occurrences found due in one look only the newest may run; the older ones are recorded
    as missed (at most ``_MISSED_RECORDS`` records, the last saying how many more). The newest runs
    when it is on time (found no later than ``_ON_TIME`` after its start, so that a quick restart
    loses nothing), or, after downtime (no process was running, or the clock jumped forward), when
    it is younger than ``catch_up``. An occurrence is due, on time or late by its start: its time
    plus its jitter.
    """
    schedule = job.schedule
    start = schedule.start_of
    older: list[int] = []
    count = 0
    newest: int | None = None
    jumped = False
    cursor = job.next_due(last_slot)
    while cursor is not None and start(cursor) <= now_ms:
        if newest is not None:
            count += 1
            if len(older) < _MISSED_RECORDS + 1:
                older.append(newest)
        newest = cursor
        every = schedule.plain
        if len(older) > _MISSED_RECORDS and isinstance(every, _Every):
            skip = (now_ms - cursor) // every.interval
            if skip and start(cursor + skip * every.interval) > now_ms:  # (the last one's start is still to come)
                skip -= 1
            cursor += skip * every.interval
            count += skip
            newest = cursor
        elif count > 20_000 and not jumped:  # a calendar schedule across years of outage
            jumped = True
            cursor = schedule.next_after(max(cursor, now_ms - 86_400_000 * 8))
            continue
        cursor = schedule.next_after(cursor)
    assert newest is not None, "called with nothing due"
    catch_up, late = job.options.catch_up, now_ms - start(newest)
    run = late <= _ms(_ON_TIME) or (catch_up is not None and late <= catch_up * 1000)
    if not run:
        count += 1
        older.append(newest)
    return _Plan(newest, schedule.next_after(newest), run, _missed_records(older, count), count)


def _due(job: _Job, last_slot: int, now_ms: int) -> _Due:
    """What the store is to record for ``job``'s occurrences after ``last_slot`` due by now."""
    plan = _plan_due(job, last_slot, now_ms)
    return _Due(
        job.name,
        last_slot,
        plan.slot,
        plan.next_slot,
        plan.missed,
        plan.run,
        job.options.overlap,
        job.options.lease,
        plan.missed_count,
    )


def _missed_records(slots: list[int], count: int) -> list[tuple[int, str | None]]:
    """Records for ``count`` missed occurrences, of which ``slots`` are the first ones."""
    kept = slots[:_MISSED_RECORDS]
    records: list[tuple[int, str | None]] = [(s, None) for s in kept]
    if count > len(kept) and records:
        records[-1] = (kept[-1], f"missed; {count - len(kept)} more occurrences were missed and not recorded")
    return records


###############################################################################
# Metrics #####################################################################
###############################################################################
#
# The Prometheus text format, written to a file for node_exporter's textfile collector (no server of
# our own): what the history says of every job, and how late this process's lease renewals are.

_METRIC_HELP = {
    "anarchon_job_runs_total": (
        "counter",
        "Records of the job by status: its attempts' ends, and the occurrences skipped or missed.",
    ),
    "anarchon_job_last_start_timestamp_seconds": ("gauge", "When the job's newest attempt started."),
    "anarchon_job_last_success_timestamp_seconds": ("gauge", "When the job's newest successful attempt ended."),
    "anarchon_job_last_failure_timestamp_seconds": (
        "gauge",
        "When the job's newest failed or timed-out attempt ended.",
    ),
    "anarchon_job_last_duration_seconds": ("gauge", "How long the job's newest ended attempt ran."),
    "anarchon_job_running": ("gauge", "The job's attempts running now, on any process."),
    "anarchon_lease_renewal_lateness_p99_seconds": (
        "gauge",
        "How late this process renewed its leases against their plan over the last minute (99th percentile).",
    ),
}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _prometheus(figures: Sequence[_JobFigures], lateness: dict[str, float] | None = None) -> str:
    """The figures (and each instance's renewal lateness) in the Prometheus text format."""
    samples: dict[str, list[tuple[str, float]]] = {name: [] for name in _METRIC_HELP}
    for f in figures:
        job = f'job="{_label(f.job)}"'
        for status, count in f.records.items():
            samples["anarchon_job_runs_total"].append((f'{job},status="{status}"', count))
        for name, ms in (
            ("anarchon_job_last_start_timestamp_seconds", f.started),
            ("anarchon_job_last_success_timestamp_seconds", f.succeeded),
            ("anarchon_job_last_failure_timestamp_seconds", f.failed),
            ("anarchon_job_last_duration_seconds", f.duration),
        ):
            if ms is not None:
                samples[name].append((job, ms / 1000))
        samples["anarchon_job_running"].append((job, f.running))
    for instance, value in (lateness or {}).items():
        samples["anarchon_lease_renewal_lateness_p99_seconds"].append((f'instance="{_label(instance)}"', value))
    lines = []
    for name, found in samples.items():
        if found:
            kind, text = _METRIC_HELP[name]
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{labels}}} {value}" for labels, value in found]
    return "".join(line + "\n" for line in lines)


def _replace_file(path: str, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, then renamed over it (a
    reader such as node_exporter never sees half a file; the name does not end in ``.prom``).

    The temporary file is made new by the kernel (``O_EXCL``, with a name no one can guess): a link
    planted at any name in a shared directory is never followed, and the rename replaces a link at
    ``path`` itself rather than writing through it. Its mode is what ``open(path, "w")`` gives (0666
    less the umask)."""
    temporary = f"{path}.{os.urandom(8).hex()}.tmp"  # (64 random bits: a name taken fails the write, logged)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with open(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


class _MetricsFile:
    """The node_exporter textfile (``metrics_file``): rewritten whole at start, within a second of
    each start and end of a run (one write a second at most), and at the stop."""

    def __init__(self, link: _StoreLink, lateness: Callable[[], dict[str, float]], stopping: Callable[[], bool]):
        self.path: str | None = None  #: the file, once kept
        self._link = link
        self._lateness = lateness  #: this process's renewal lateness, for the figures
        self._stopping = stopping  #: whether the scheduler stops: no rewrite is begun then
        self._task: asyncio.Task[None] | None = None  #: the rewrite in progress (or waiting)
        self._again = False  #: something happened since it began: rewrite once more after it
        self._failing: str | None = None  #: the error of the last write, while writes fail

    def keep(self, path: str, events: _Events, runner: _Runner) -> None:
        """Keep the file at ``path``: rewritten after each start (and each skipped or missed
        occurrence recorded) that ``events`` tells, and each write of ends by ``runner``."""
        if self.path is None:
            events.listeners.append(lambda event: None if event.duration is not None else self.soon())
            runner.ends_written = self.soon
        self.path = path

    def restart(self) -> None:
        """A run begins: its first figures are written once it has joined (``first``)."""
        self._task = None

    def first(self) -> None:
        """The first write of a run, once."""
        if self.path is not None and self._task is None:
            self.soon()

    def soon(self) -> None:
        """Rewrite the file: now, or (while one is written) a second after that one."""
        if self._task is not None and not self._task.done():
            self._again = True
        elif self.path is not None and not self._stopping():
            self._task = asyncio.get_running_loop().create_task(self._write(self.path))

    async def last(self) -> None:
        """The last figures, with nothing running here (at the stop)."""
        if self.path is not None:
            if self._task is not None:
                self._task.cancel()
            await self._write(self.path, again=False)

    async def _write(self, path: str, again: bool = True) -> None:
        while True:
            self._again = False
            try:
                await self._link.call(lambda s: _replace_file(path, _prometheus(s.figures(), self._lateness())))
                self._failing = None
            except (StoreError, OSError) as exc:  # told once, until it works again
                if str(exc) != self._failing:
                    _log.warning("cannot write the metrics file %s: %s", path, exc)
                    self._failing = str(exc)
            if not again:
                return
            await asyncio.sleep(1.0)  # one write a second at most, however many runs end
            if not self._again:
                return


###############################################################################
# Talking to systemd ##########################################################
###############################################################################


_NOTIFY_RETRY = 1.0  # seconds before a message the service manager's full queue refused is sent again


class _Notify:
    """systemd's notify protocol (sd_notify(3)) with no dependency: each message one datagram to
    ``$NOTIFY_SOCKET``, a path or, when it starts with ``@``, an abstract socket. Reading the
    variables removes them from the environment, so that no command this process starts talks to
    systemd in its name. Sending never raises and never waits: a manager that went away is a debug
    line, and when one does not read (its queue is full) the message waits for the next one or a
    retry, newer values replacing older ones."""

    def __init__(self, environ: dict[str, str] | os._Environ[str]):
        address = environ.pop("NOTIFY_SOCKET", "")
        usec, pid = environ.pop("WATCHDOG_USEC", ""), environ.pop("WATCHDOG_PID", "")
        #: where messages go (an abstract socket's name starts with NUL); empty: not under systemd
        self.address = "\0" + address[1:] if address.startswith("@") else address
        if not self.address.startswith(("/", "\0")):  # unset, or a kind of socket not supported here
            self.address = ""
        #: seconds between ``WATCHDOG=1`` pings (half the manager's timeout), or None: no watchdog
        self.watchdog = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and pid in ("", str(os.getpid())) else None
        self._socket: socket.socket | None = None
        self._status: str | None = None  # the STATUS= last sent
        self._next: asyncio.TimerHandle | None = None  # the next WATCHDOG=1
        #: the fields not sent yet (the manager's queue was full), sent with the next message: newest value wins
        self._unsent: dict[str, str] = {}
        self._retry: asyncio.TimerHandle | None = None  # the next try to send ``_unsent``

    def send(self, *fields: str) -> None:
        """Send ``fields`` (``"READY=1"``, ``"STATUS=…"``) as one message, with any not sent yet."""
        if not self.address:
            return
        for field in fields:
            key, _, value = field.partition("=")
            self._unsent.pop(key, None)  # (the newest value goes last, as it was given)
            self._unsent[key] = value
        self._flush()

    def _flush(self) -> None:
        if self._retry is not None:  # (this is the retry, or a message came before it)
            self._retry.cancel()
            self._retry = None
        if not self._unsent:
            return
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._socket.setblocking(False)
            self._socket.sendto("\n".join(f"{k}={v}" for k, v in self._unsent.items()).encode(), self.address)
        except BlockingIOError:  # the manager does not read: try again with the next message, or in a second
            with contextlib.suppress(RuntimeError):  # (no loop running: with the next message only)
                self._retry = asyncio.get_running_loop().call_later(_NOTIFY_RETRY, self._flush)
            return
        except OSError as exc:
            _log.debug("cannot notify the service manager at %r: %s", self.address, exc)
        self._unsent.clear()

    def status(self, text: str, *fields: str) -> None:
        """Send ``STATUS=text`` when it differs from the last one sent, and ``READY=1`` with the
        first (or ``fields`` instead)."""
        if text != self._status or fields:
            first = self._status is None
            self._status = text
            self.send(*(fields or (("READY=1",) if first else ())), f"STATUS={text}")

    def start_pings(self, loop: asyncio.AbstractEventLoop) -> None:
        """Send ``WATCHDOG=1`` now and every ``watchdog`` seconds from ``loop``'s own thread (when
        the manager asked for it): a wedged loop stops the pings, and systemd restarts the process;
        a handler busy in a thread does not."""
        if self.watchdog is not None and self.address:
            self.send("WATCHDOG=1")
            self._next = loop.call_later(self.watchdog, self.start_pings, loop)

    def close(self) -> None:
        """Stop the pings and close the socket."""
        for timer in (self._next, self._retry):
            if timer is not None:
                timer.cancel()
        self._next = self._retry = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None


###############################################################################
# The scheduler loop ##########################################################
###############################################################################
#
# The engine under ``Scheduler``: while it serves, each look reads what changed in the store, fires
# the occurrences that came due, claims pending runs and takes over those whose owner is gone, and
# then sleeps until the next thing due or a change told by the store.

#: Seconds at most a stopping scheduler waits for its watch's thread to end (one making a
#: PostgreSQL session ends once connected or given up: ``connect_timeout`` is 5 s by default).
_WATCH_CLOSED = 6.0
_CLOCK_CHECK = 5.0  # seconds between looks at the wall clock when file changes wake the scheduler
_CLOCK_SLACK_MS = 1000  # a clock this much behind the newest recorded occurrence counts as unset
_FULL_READ = 600.0  # seconds between reads of every job row (between them, only the changed ones)
# After a look that found several occurrences due at once, the next look waits this long (seconds),
# whatever wakes it: when they come due faster than one look each, each look fires several together
# instead of one at a time. A look that found one fires it and waits for nothing: occurrences 20 ms
# apart each start on time.
_LOOK_GAP = 0.02
# An attempt whose run is over (succeeded, or failed for good) waits this long at most to have its end
# written in the transaction of this process's next claim, when one is due that soon and before the
# job's own next occurrence: one commit and one hop to the store's thread an occurrence, not two.
_END_WAIT = 0.1
# While one look claims more than a batch (a sweep: thousands due at once), the ends of the runs it
# started wait until it is over, this long at most (seconds), unless their job comes due sooner or
# another process claims it first: the store's thread then claims batch after batch while the loop
# starts what was won, instead of writing ends in the claims' way.
_SWEEP_END_WAIT = 1.0
_TIDY_GAP = 0.05  # seconds between two steps of the store's upkeep, when nothing is due sooner
_TIDY_RETRY = 5.0  # seconds after a failed step of the store's upkeep before the next
# What another process asks of every process (a trigger, a cancel, a pause, a resume) is read at once,
# but this long (seconds) after the last read began at the soonest: a hundred triggers in a burst,
# read one by one, made every process read twice a trigger.
_ASKED_GAP = 0.2
# Of the processes declaring a job, one is its first (``_first_of``): it claims the job's occurrences
# as they come due; the others look this long after (seconds), and claim only what is still unclaimed
# then (the first is frozen, stopping or gone), so that one claim is tried where every process tried.
# Longer than the coalescing of reads (0.8 s on SQLite, 0.5 s on PostgreSQL): the first's claim is read
# before, and moves it on.
_SECOND_LOOK = 1.0
_PEERS_EVERY = 2.0  # seconds at least between two reads of which processes run and what they declare
_CLAIM_BATCH = 100  # jobs claimed in one transaction (it holds the write lock: ~0.3 ms a job on SQLite)
# A call of the loop with at most this many claims and ends (a read: ten times as many rows the last
# time) is made on the loop's thread when the store needs no wait for it (``_StoreThread``); a larger
# one (a sweep's batch) goes to the store's thread, whose statements let go of Python's lock while the
# loop runs the attempts already won.
_ON_THE_LOOP = 10


def _skipped(job: _Job) -> str:
    """Why an occurrence of ``job`` was skipped, for its log line."""
    overlap = job.options.overlap
    if overlap == 1:
        return "skipped: the job's previous run is unfinished (overlap skip)"
    return f"skipped: {overlap} runs of the job are unfinished (overlap {overlap})"


def _tell_missed(events: _Events, job: _Job, item: _Due) -> None:
    """Tell that occurrences of ``job`` up to ``item`` were found late and not run."""
    count = item.missed_count
    what = f"missed ({count} occurrence{'s' if count > 1 else ''} up to this one, found late and not run)"
    events.tell(logging.WARNING, "missed", job.name, item.missed[-1][0], 0, what, status="missed", count=count)


def _tell_taken_over(events: _Events, run: _RunRow, claim: _Claim, reason: str) -> None:
    """Tell that ``run``, whose owner is gone (``reason``), was taken over as ``claim``."""
    what = f"taken over from {run.owner} as attempt {claim.attempt}: {reason}"
    events.tell(
        logging.WARNING, "taken_over", run.job, claim.slot, claim.attempt, what, status="taken_over", error=reason
    )


def _first_of(job: str, declarers: Iterable[str]) -> str | None:
    """The process that claims ``job``'s occurrences first, of those that declare it: the same
    answer in every process that knows them, spread over them, and changed only for the jobs of a
    process that joins or leaves (the highest hash of process and job, ``_spread``)."""
    return max(declarers, key=lambda instance: _spread(f"{instance}\0{job}"), default=None)


def _spread(text: str) -> int:
    """A 32-bit hash of ``text`` whose order is as good as random between texts: crc32, then
    mixed by multiplications (MurmurHash3's finalizer). Compared bare, crc32 orders two texts of
    the same length that differ alone in a few places (two processes' ids) the same way for most of
    what follows them (it is linear): of four processes with consecutive pids, one was first for
    half of 10,000 jobs and two for an eighth each, in two name sets of five."""
    h = zlib.crc32(text.encode())
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _from_own_place(ready: list[T], instance: str) -> list[T]:
    """``ready`` begun at a place of ``instance``'s own, so that processes finding thousands due at
    once share them instead of all claiming the same first ones."""
    turn = zlib.crc32(instance.encode()) % len(ready)
    return ready[turn:] + ready[:turn]


#: Who runs on a store, to tell a change: each process's instance, when it joined, how many jobs it declares.
_Who = tuple[tuple[str, _dt.datetime, Optional[int]], ...]


def _met(store: _Store, known: _Who) -> tuple[_Who, dict[str, frozenset[str]]] | None:
    """The processes running on ``store`` and what each declares, read only when who they are
    differs from ``known`` (a process joined, left, or joined again with other declarations);
    returns who they are and that, or None."""
    key = tuple((p.instance, p.started_at, p.jobs) for p in store.processes())
    return None if key == known else (key, store.peers())


def _give_back_freed_memory() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``): what compiling
    this file from source left free (under ``$PYTHONDONTWRITEBYTECODE`` or from a read-only copy, 18
    MB of a 43 MB process) stays resident otherwise. The whole process's heap: an application's
    free memory goes back too (which does it no harm). Elsewhere (musl, macOS) nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def _greeting(where: str, instance: str, count: int, first: tuple[int, str] | None, now: float) -> str:
    """The start-up line: where this process joined, as whom, how many jobs it declares, and the
    first occurrence due (``first``: its time in ms and its job), with how long until it."""
    text = f"joined {where} as {instance}: {count} job{'' if count == 1 else 's'} declared"
    if first is not None:
        due, name = first
        at = _utc_from_ms(due).astimezone(_local_zone()).strftime("%Y-%m-%d %H:%M:%S %Z")
        text += f", next {name!r} at {at} (in {format_duration(max(0, math.ceil(due / 1000 - now)))})"
    return text


def _service_status(jobs: int, running: int, failing: str | None) -> str:
    """What a serving process is doing, in a line (systemd's ``STATUS=``)."""
    text = f"{jobs} jobs, {running} running"
    return text if failing is None else f"{text}; failing: {failing}"


def _stopping_status(running: int, drain: float) -> tuple[str, ...]:
    """What systemd is told as a process stops: the status line, ``STOPPING=1`` and, with runs to
    hand over, the ``drain`` seconds that may take."""
    fields = ["STOPPING=1"]
    if running:
        fields.append(f"EXTEND_TIMEOUT_USEC={int(drain * 1e6)}")
    return (f"stopping: handing over {running} running", *fields)


#: The warning of a clock that reads earlier than the newest occurrence recorded (the clock, the
#: database, that occurrence).
_CLOCK_UNSET = (
    "the clock reads %s, earlier than the newest occurrence recorded in %s (%s): running nothing until it is corrected"
)


class _Loop:
    """What a running scheduler does: ``serve()`` joins the store's processes, looks at the store
    again and again (``_tick``), sleeps between looks until something is due or a change is told,
    and backs off while looks fail; at a stop it drains this process's attempts and leaves. Lives
    on the event loop; its state is its own (``Scheduler`` reaches it through ``poke``, ``stop``,
    ``rejoin`` and ``ready``)."""

    def __init__(
        self,
        instance: str,
        clock: Clock,
        link: _StoreLink,
        checkpoints: CheckpointStore,
        events: _Events,
        blocked_warning: float,
        switch_interval: float | None,
    ):
        self.instance = instance  #: this process's id in the store
        self._clock = clock  #: wall and monotonic time
        self._link = link  #: the store, and every connection to it
        self._declared = link.declarations  #: the jobs this process declares
        self._events = events  #: what is told of runs (log lines and listeners)
        #: this process's running attempts (it alone decides that one of them was superseded)
        self.runner = _Runner(link, clock, instance, checkpoints, self.poke, events)
        self.runner.end_wait = self._end_wait
        self._where = link.backend.where  #: the database, as messages name it
        self._poll = link.backend.look_every  #: seconds between looks when nothing tells of changes
        self._blocked_warning = blocked_warning  #: seconds of a blocked event loop before a warning
        self._switch_interval = switch_interval  #: the GIL switch interval around renewals (None: left alone)
        self.notify: _Notify | None = None  #: the service manager, when it is told (systemd)
        self.metrics: _MetricsFile | None = None  #: the node_exporter textfile, when one is kept
        self.stopping = False  #: a stop was asked: claim nothing more, drain, leave
        self._sweeping = False  #: claiming more due occurrences than one transaction takes (``_fire``)
        self.ready: asyncio.Event | None = None  #: set after each look (``__aenter__`` waits for the first)
        self.heartbeats: _Heartbeats | None = None  #: the thread that renews leases, from the last serve
        self._watch: _Changes | None = None  #: the store's changes, while serving
        self._wake: asyncio.Future[None] | None = None  #: resolved to end the current sleep
        self._poked = False  #: woken since the look began: look again at once
        self._tidied = -math.inf  #: the next step of the store's upkeep comes _TIDY_GAP after this (monotonic, real)
        self._tidy_failing = False  #: the last step of the store's upkeep failed (said once)
        self._written = False  #: the watch saw a write this process may not see committed yet
        self._backing_off = False  #: a look failed: sleep the back-off out whatever the store does
        self._dirty = True  #: read the job rows and runs at the next look (after this process's writes, to stop)
        self._rejoin = False  #: join again at the next look (the declarations changed, or the store reopened)
        self._clock_warned = False  #: the unset clock was told, until it is corrected
        self._told: asyncio.TimerHandle | None = None  #: a wake-up for changes told within the read gap
        self._idle = self._poll  #: seconds between looks with nothing due and nothing told
        self._fresh()

    def _fresh(self) -> None:
        """What the looks know, as a serve begins (and some of it after a reopen)."""
        self._version = -1  #: the watch's version at the last read (-1: read at the next look)
        self._agenda: _Agenda | None = None  #: the job rows as last read (None: read them whole)
        self._whole_at = 0.0  #: when they were last read whole (monotonic)
        self._busy_until = 0.0  #: no look before this (monotonic): see _LOOK_GAP
        self._moved: dict[str, int] = {}  #: watermarks found moved by the last ``_fire``, by job
        self._runs: list[_RunRow] | None = None  #: the unfinished runs as last read
        # The last read found few rows (``_ON_THE_LOOP`` tens): the next may be made on the loop's own
        # thread (a read of thousands would hold every handler and timer on the loop meanwhile).
        self._small_reads = False
        self._newest = 0  #: the newest occurrence recorded in the store (ms)
        self._wait = 0.0  #: seconds until the next look, as the last look found
        self._delay = 0.0  #: seconds of back-off, while looks fail
        self._recheck = 0.0  #: after a write seen by the watch: look again this soon
        self._read_at = 0.0  #: when ``_runs`` was read (monotonic): their ``lease_left`` is as of then
        self._watching = False  #: another process's run is watched with ``owner_gone`` as of that read
        self._reread = 0.0  #: then read again this long after that read (seconds)
        self._read_real = 0.0  #: when the last read began (real monotonic): what is told since waits ``coalesce``
        self._asking: asyncio.TimerHandle | None = None  #: the look another process asked for (``_asked``)
        #: whether the last read found a run waiting to be claimed now (what is told next is read at once)
        self._claimable = False
        self._failing: str | None = None  #: the error of the last look, while looks fail
        self._logged = 0.0  #: when it was last logged (monotonic)
        self._peers: dict[str, frozenset[str]] = {}  #: the running processes and what they declare, as last read
        self._peers_key: _Who = ()  #: who they were, to tell a change
        self._peers_at = -math.inf  #: when they were last read (monotonic)
        #: how often a process's leaving or end was told (``_peers_anew``): a read of who runs begun
        #: before one may not have seen it, and leaves them to be read again
        self._peers_told = 0
        #: a read since left them unread (read less than ``_PEERS_EVERY`` before): read them once that passed
        self._peers_unread = False
        self._first: dict[str, bool] = {}  #: whether this process is each job's first, among these peers
        #: runs triggered of jobs another process claims first, and when this process first saw each
        #: (monotonic): it claims one ``_SECOND_LOOK`` after (``_consider``)
        self._triggers_seen: dict[tuple[str, int], float] = {}

    # -- waking ------------------------------------------------------------------------------------

    def poke(self) -> None:
        """Look at the store again at once, and read it whole (after our own writes, or to stop)."""
        self._dirty = True
        self._wake_up()

    def _asked(self) -> None:
        """Another process asks every process to act on its write (a trigger, a cancel, a pause, a
        resume, or its leaving, which the store tells apart from claims and ends): look, and read the
        store whole and who runs on it, at once, but ``_ASKED_GAP`` after the last read began at the
        soonest, so that a burst of them (a script that triggers a hundred jobs) is read in a few
        reads, not one each. (A process that left was first of some jobs, whose occurrences each
        waited for a second look until the next read of who runs, up to ``_PEERS_EVERY`` later.)"""
        self._peers_anew()
        if self._backing_off or self._watch is None:  # (as ``_store_written``: the back-off is waited for)
            self._written = True
            return
        if self._asking is None:
            later = max(self._read_real + _ASKED_GAP - time.monotonic(), 0.0)
            self._asking = asyncio.get_running_loop().call_later(later, self._asked_now)

    def _asked_now(self) -> None:
        self._asking = None
        self.poke()

    def rejoin(self) -> None:
        """Record what this process declares with it again (the declarations changed), and look."""
        self._rejoin = True
        self.poke()

    def _declarations_changed(self, loop: asyncio.AbstractEventLoop) -> None:
        """A job was declared, removed or rescheduled while serving, on any thread: join again."""
        with contextlib.suppress(RuntimeError):  # (the loop has just closed: the next serve joins anew)
            loop.call_soon_threadsafe(self.rejoin)

    def _wake_up(self) -> None:
        self._written = True
        self._look_again()

    def _gone(self) -> None:
        """A process ended (its liveness socket closed) or handed a run over (it stops): look, and
        read the store and who runs on it, at once (``_asked``)."""
        self._peers_anew()
        self.poke()

    def _peers_anew(self) -> None:
        """Read who runs at the next read, whenever they were last read."""
        self._peers_at = -math.inf
        self._peers_told += 1

    def _look_again(self) -> None:
        """End the sleep and look again after it (a write left the store upkeep: ``_Store.tidy``,
        which a look does)."""
        self._poked = True
        if self._wake is not None:
            _resolve(self._wake)

    def _store_written(self) -> None:
        """Another process (or this one) wrote the store. While backing off after a failure, this
        waits for the back-off: the failing writes themselves touch the file. Changes told within
        the store's ``coalesce`` of the last read wake the loop once, when it has passed."""
        if self._backing_off:
            self._written = True
            return
        watch = self._watch
        later = 0.0 if watch is None else self._coalescing(watch)
        if later <= 0:
            self._wake_up()
        elif self._told is None and watch is not None:
            watch.hold()
            self._told = asyncio.get_running_loop().call_later(later, self._told_now)

    def _coalescing(self, watch: _Changes) -> float:
        """Seconds until the store's ``coalesce`` has passed since the last read began (<= 0: it
        has); none while the last read found a run waiting to be claimed now (``_found``)."""
        return -1.0 if self._claimable else self._read_real + watch.coalesce - time.monotonic()

    def _found(self, runs: list[_RunRow]) -> None:
        """Keep the runs just read. One of a job this process declares, waiting to be claimed now
        (triggered, handed over, due a retry), is about to be claimed, by this process or another
        that declares it: what is told next is read at once, not with what comes in the next
        ``coalesce``. A process that read a run triggered and saw another claim it learnt of the
        claim only at the next read, up to half a second later, and of the owner's death or
        hand-over no sooner: one takeover in ten or fifteen took 0.2-0.5 s instead of 5 ms. (A run
        no process here would claim, a job's that is declared elsewhere or no more, may wait for
        long: it leaves the coalescing alone.)"""
        self._runs, self._read_at = runs, self._clock.monotonic()
        now_ms, jobs = _ms(self._clock.time()), self._declared.jobs
        self._claimable = not self.stopping and any(
            run.state == "pending" and run.not_before <= now_ms and run.job in jobs for run in runs
        )
        if self._triggers_seen:  # (forget those claimed since, by any process)
            pending = {(run.job, run.slot) for run in runs if run.state == "pending"}
            self._triggers_seen = {key: at for key, at in self._triggers_seen.items() if key in pending}

    def _told_now(self) -> None:
        self._told = None
        if self._watch is not None:
            self._watch.release()
        self._wake_up()

    async def _sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on the loop's monotonic clock, or until ``poke()``."""
        loop = asyncio.get_running_loop()
        if seconds > 0 and not self._poked:
            self._wake = loop.create_future()
            handle = loop.call_later(seconds, _resolve, self._wake)
            try:
                await self._wake
            finally:
                handle.cancel()
                self._wake = None

    # -- serving -----------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Join, look until stopped, drain this process's attempts, leave."""
        loop = asyncio.get_running_loop()
        runner = self.runner
        self._fresh()
        # Watch for changes before joining: the watch may be what joining needs (PostgreSQL: the
        # connection that holds this process's lock), and no change after the join goes unseen.
        self._watch = watch = self._link.backend.changes(
            loop, self._store_written, self.instance, self._gone, self._asked
        )
        watch.vouch_for(lambda: bool(runner.running), runner.lose)
        runner.started, runner.untidy = watch.attempt_started, self._look_again
        self._idle = _CLOCK_CHECK if watch.pushed else self._poll
        timers = _Timers(self._clock, f"anarchon-timers-{self.instance}")
        self.heartbeats = heartbeats = _Heartbeats(
            self._link.backend, self._clock, f"anarchon-heartbeat-{self.instance}", loop, self._switch_interval
        )
        jobs = self._declared
        jobs.live, jobs.changed = True, functools.partial(self._declarations_changed, loop)
        watchdog = _Watchdog(loop, timers, self._clock, self._blocked_warning, lambda t: _where_blocked(jobs.jobs, t))
        runner.begin(heartbeats, timers, watchdog)
        timers.start()
        heartbeats.start()
        self._link.held = True
        if self.metrics is not None:
            self.metrics.restart()
        if self.notify is not None:
            self.notify.start_pings(loop)
        joined = False  # (a process that never joined has nothing to leave)
        try:
            await self._join_first()
            joined = True
            self._poked = False
            while not self.stopping:
                await self._look_and_sleep()
            self._stopping_told()
            await runner.drain()
            if self.metrics is not None:
                await self.metrics.last()
        finally:
            jobs.live, jobs.changed = False, None
            if self.notify is not None:
                self.notify.close()
            watch.close()
            self._watch = None
            for handle in (self._told, self._asking):
                if handle is not None:
                    handle.cancel()
            self._told = self._asking = None
            timers.stop()
            heartbeats.stop()
            if self._link.open and joined:
                try:
                    await self._link.call(lambda s: s.leave(self.instance))
                except StoreError as exc:
                    _log.warning("%s", exc)
            self._link.held = False
            self._link.close()
            await watch.closed(_WATCH_CLOSED)

    async def _look_and_sleep(self) -> None:
        """One look (backing off if it fails), then the sleep until the next."""
        self._poked = False  # a wake from now on means: look again after this tick
        try:
            await self._tick()
        except Exception as exc:  # noqa: BLE001 - a running scheduler logs, backs off and carries on
            self._back_off(exc)
        else:
            if self._failing is not None:
                _log.warning("%s can be used again", self._where)
                self._failing = None
            self._delay = 0.0
            self._backing_off = False
        if self.ready is not None:
            if not self.ready.is_set() and self._failing is None:
                self._greet()
            self.ready.set()
        if self.notify is not None:
            self.notify.status(self._doing())
        if self.metrics is not None:  # the first, once joined
            self.metrics.first()
        await self._sleep(self._wait if not self._delay else self._delay)
        busy = self._busy_until - self._clock.monotonic()
        if busy > 0 and not self.stopping:  # what comes due meanwhile is fired together
            await asyncio.sleep(busy)

    def _greet(self) -> None:
        """Say, once the first look is done, that this process has joined, and what comes next
        (a process that would otherwise stay silent until its first run looks hung)."""
        _give_back_freed_memory()
        first = None if self._agenda is None else self._agenda.first()
        _log.info("%s", _greeting(self._where, self.instance, len(self._declared.jobs), first, self._clock.time()))

    def _doing(self) -> str:
        """What this process is doing, in a line (systemd's ``STATUS=``)."""
        return _service_status(len(self._declared.jobs), len(self.runner.running), self._failing)

    def _stopping_told(self) -> None:
        """Tell systemd that this process stops, and how long handing its runs over may take."""
        if self.notify is not None:
            running = len(self.runner.running)
            self.notify.status(*_stopping_status(running, self.runner.longest_drain() if running else 0.0))

    async def _join(self) -> bool:
        """Record this process among the store's running instances, with what it declares (in the
        same call, when the declarations changed); True if it is the only one."""
        now_ms = _ms(self._clock.time())
        declares = list(self._declared.jobs)
        alone = await self._link.call(lambda s: s.join(self.instance, now_ms, declares))
        self._rejoin = False
        return alone

    async def _join_first(self) -> None:
        """Join the group; the first process of a group runs the jobs declared to run on start. A
        server that cannot be reached yet is waited for (logged, with back-off); any other failure
        to open the database is raised."""
        now_ms = _ms(self._clock.time())
        while not self.stopping:
            try:
                alone = await self._join()
                break
            except StoreError as exc:
                if not exc.transient:
                    raise
                self._back_off(exc)
                await self._sleep(self._delay)
        else:
            return
        on_start = [job.name for job in self._declared.jobs.values() if isinstance(job.schedule, _OnStart)]
        if alone and on_start:
            await self._link.call(lambda s: [s.trigger(name, now_ms) for name in on_start])

    def _back_off(self, exc: Exception) -> None:
        self._delay = min(max(self._delay * 2, self._poll), 5.0)
        self._backing_off = True
        self._log_failure(exc)

    def _log_failure(self, exc: Exception) -> None:
        """Log a failed look: at once when it fails differently, else once a minute at most."""
        now = self._clock.monotonic()
        if str(exc) != self._failing or now - self._logged >= 60.0:
            _log.error(
                "%s (looking again in %s)", exc, format_duration(self._delay), exc_info=not isinstance(exc, StoreError)
            )
            self._failing, self._logged = str(exc), now

    def lateness(self) -> dict[str, float]:
        """This process's lease renewals' lateness over the last minute (99th percentile), if any."""
        heartbeats = self.heartbeats
        p99 = None if heartbeats is None else heartbeats.lateness.p99(self._clock.monotonic())
        return {} if p99 is None else {self.instance: p99}

    # -- one look at the store ---------------------------------------------------------------------

    async def _tick(self) -> None:
        watch = self._watch
        assert watch is not None, "serving"
        now = self._clock.time()
        now_ms = _ms(now)
        version = watch.version()  # microseconds on this thread; the store thread only on a change
        change = watch.lost()
        if change is not None:
            await self._reopen(watch, change)
        if self._rejoin:
            await self._join()
        written, self._written = self._written, False
        self._recheck = watch.recheck(version != self._version, written, self._recheck)
        stale = self._watching and self._clock.monotonic() >= self._read_at + self._reread - 0.01
        deferred = 0.0  # a change told by another process, read this much later with the changes after it
        if version != self._version and not self._dirty and self._runs is not None:
            deferred = max(0.0, self._coalescing(watch))
        peers = self._peers_unread and self._peers_in() <= 0
        if deferred == 0.0 and (version != self._version or self._runs is None or self._dirty):
            await self._read_as_of(version)
        elif stale or peers:  # nothing was written since (that would have been told): the runs alone,
            # one statement, and who runs if a read left it unread (a process that joined just after it)
            await self._read_runs(stale, peers)
        if self._clock_unset(now_ms):
            self._wait = self._idle
            return
        jobs = self._declared.jobs
        agenda = self._agenda
        assert agenda is not None, "made by the first read"
        if not agenda.current(jobs):
            self._agenda = agenda = _Agenda(jobs, agenda.rows.values(), self._look)
        recheck = self._recheck
        if recheck and not self._dirty and self._runs is not None:
            # (a change seen sooner than ``coalesce`` after the last read would wait for it: look then)
            recheck = max(recheck, self._coalescing(watch))
        limit = min(self._idle, recheck or self._idle)
        ready, wait = agenda.ready(now_ms, limit)
        if ready and deferred and not all(self._is_first(job.name) for job, _ in ready):
            # A second look acts on what the jobs' first processes left unclaimed: as the store has it.
            await self._read_as_of(version)
            deferred = 0.0
            agenda = self._agenda
            assert agenda is not None, "read"
            ready, wait = agenda.ready(now_ms, limit)
        if ready:
            if len(ready) > 1:
                self._busy_until = self._clock.monotonic() + _LOOK_GAP
            self._moved = await self._fire(ready, now_ms)
            self._version = -1
            self._dirty = self._dirty or bool(self._moved)  # (read those rows before claiming them again)
            # The next look when the agenda says (the rows claimed are moved in it), at once if a claim
            # found its row moved (read first) or what came due during the claims
            wait = 0.0 if self._moved else agenda.ready(_ms(self._clock.time()), limit)[1]
        self._watching, self._reread = False, self._poll
        soonest = math.inf  # (seconds until a run needs a look)
        for run in self._runs or []:
            again = await self._consider(run, now_ms, watch)
            if again is not None:
                wait, soonest = min(wait, again), min(soonest, again)
                if again == 0.0:
                    self._version = -1
        self._wait = min(wait, deferred) if deferred else wait
        if self._peers_unread and not deferred:  # (one that joined just after their last read: read then)
            self._wait = min(self._wait, max(self._peers_in(), 0.0))
        if self._link.untidy and not ready:
            look = agenda.next_look()  # (an occurrence another process looks at first: a second later)
            await self._tidy(min(soonest, math.inf if look is None else look / 1000 - now))

    async def _tidy(self, due_in: float) -> None:
        """One step of the store's upkeep (``_Store.tidy``), never within ``_TIDY_GAP`` of what is
        due (``due_in`` seconds: an occurrence, a run to look at), and after the last step at least
        ``_TIDY_GAP`` and as long as it took, so that other writes (this process's, the others')
        come between the steps; then look again. A failed step is tried again ``_TIDY_RETRY`` later
        (said once while they fail): the looks go on."""
        since = time.monotonic() - self._tidied
        if since < _TIDY_GAP or due_in < _TIDY_GAP:
            self._wait = min(self._wait, max(_TIDY_GAP - since, 0.0) or _TIDY_GAP)
            return
        began = time.monotonic()
        try:
            await self._link.call(lambda s: s.tidy())
        except StoreError as exc:
            if not self._tidy_failing:
                _log.warning("upkeep of the store failed (tried again every %s s): %s", _TIDY_RETRY, exc)
            self._tidy_failing = True
            self._tidied = time.monotonic() + _TIDY_RETRY
            self._wait = min(self._wait, _TIDY_RETRY + _TIDY_GAP)
            return
        self._tidy_failing = False
        self._tidied = time.monotonic() + (time.monotonic() - began)  # (as long again before the next)
        self._wait = min(self._wait, _TIDY_GAP)

    def _clock_unset(self, now_ms: int) -> bool:
        """Whether the clock reads earlier than the newest occurrence recorded (told once)."""
        if now_ms >= self._newest - _CLOCK_SLACK_MS:
            self._clock_warned = False
            return False
        if not self._clock_warned:
            now, newest = _utc_from_ms(now_ms).isoformat(), _utc_from_ms(self._newest).isoformat()
            _log.warning(_CLOCK_UNSET, now, self._where, newest)
            self._clock_warned = True
        return True

    async def _read_as_of(self, version: int) -> None:
        """``_read``, and remember that it saw the store's changes up to ``version``."""
        self._dirty = False
        await self._read()
        self._version = version

    async def _read(self) -> None:
        """Read the runs, and the job rows changed since the last read (all of them at first, and
        every ``_FULL_READ`` seconds: a process of an older version writes no change numbers)."""
        agenda = self._agenda
        whole = agenda is None or self._clock.monotonic() >= self._whole_at + _FULL_READ
        since = -1 if agenda is None or whole else agenda.seen
        peers = self._peers_in() <= 0
        known, told = self._peers_key, self._peers_told
        self._read_real = time.monotonic()
        jobs, runs, newest, met = await self._link.call(
            lambda s: (s.jobs(since), s.runs(), s.newest_slot(), _met(s, known) if peers else None),
            soon=since >= 0 and self._small_reads,
        )
        self._small_reads = len(jobs) + len(runs) <= _ON_THE_LOOP * 10
        self._found(runs)
        changed = self._met(peers, met, told)
        self.runner.ended &= {(run.job, run.slot, run.attempt) for run in runs}
        self._newest = newest or 0
        self._declared.disagree(jobs, "holds that one's")
        if agenda is None or whole:
            self._agenda, self._whole_at = _Agenda(self._declared.jobs, jobs, self._look), self._read_at
            return
        if changed:  # (when each job is looked at, too)
            self._agenda = agenda = _Agenda(self._declared.jobs, agenda.rows.values(), self._look)
        agenda.update(jobs)
        # A claim refused because the watermark moved (not because the job was paused: its row is
        # read, and left out), while the row read still has the old one: a writer of an older
        # version moved it. Read those rows by name, or the look would try again.
        behind = [
            name for name, last in self._moved.items() if (seen := agenda.rows.get(name)) and seen.last_slot == last
        ]
        self._moved = {}
        if behind:
            again = await self._link.call(lambda s: [s.job(name) for name in behind])
            agenda.update(row for row in again if row is not None)

    async def _read_runs(self, runs: bool, peers: bool) -> None:
        """Read the runs alone (``runs``) and who runs on the store (``peers``), in one call."""
        known, told = self._peers_key, self._peers_told
        if runs:
            self._read_real = time.monotonic()
        found, met = await self._link.call(
            lambda s: (s.runs() if runs else None, _met(s, known) if peers else None), soon=self._small_reads
        )
        if found is not None:
            self._small_reads = len(found) <= _ON_THE_LOOP * 10
            self._found(found)
        if peers and self._met(True, met, told) and self._agenda is not None:  # (when each job is looked at, too)
            self._agenda = _Agenda(self._declared.jobs, self._agenda.rows.values(), self._look)

    def _met(self, read: bool, met: tuple[_Who, dict[str, frozenset[str]]] | None, told: int) -> bool:
        """Keep who runs on the store, if ``read`` (``met``: who they are and what each declares,
        None when unchanged; ``told``: ``_peers_told`` as the read began); whether they changed
        (the caller makes the agenda again)."""
        self._peers_unread = not read
        if read and told == self._peers_told:  # (else a leaving told meanwhile: read them again)
            self._peers_at = self._clock.monotonic()
        if met is None:
            return False
        self._peers_key, self._peers, self._first = *met, {}
        return True

    def _peers_in(self) -> float:
        """Seconds until who runs on the store may be read again (<= 0: now): ``_PEERS_EVERY``
        after the last read of them."""
        return self._peers_at + _PEERS_EVERY - self._clock.monotonic()

    def _is_first(self, job: str) -> bool:
        """Whether this process is ``job``'s first (``_first_of``), or knows of no other."""
        first = self._first.get(job)
        if first is None:
            declarers = [instance for instance, jobs in self._peers.items() if job in jobs]
            chosen = _first_of(job, declarers if self.instance in declarers else [*declarers, self.instance])
            first = self._first[job] = chosen == self.instance
        return first

    def _look(self, job: str, start: int) -> int:
        """When (ms) this process looks at an occurrence of ``job`` that starts at ``start``: then,
        when it is the job's first process; else ``_SECOND_LOOK`` after it (a read before)."""
        return start if self._is_first(job) else start + _ms(_SECOND_LOOK)

    async def _reopen(self, watch: _Changes, change: str) -> None:
        """The state this process used is gone from view, or its claim on its runs may be (``change``
        says which): the database file was deleted or replaced, or the connection holding this
        process's lock was lost. Abort the attempts, close every connection, and carry on with what
        the path names now (a file created anew if none; the server once it is back)."""
        _log.error("%s: aborting this process's running attempts and opening the database again", change)
        self.runner.lose(change)
        watch.reset()
        await self._link.disconnect()
        if self.heartbeats is not None:
            # No connection of this process may stay on the old file when the path is opened again:
            # its -wal and -shm files keep their names, and a new connection would read them.
            self.heartbeats.reopen()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.heartbeats.wait_closed, 5.0)
        self._rejoin = True
        self._dirty = True
        self._version = -1
        self._newest = 0
        self._agenda = None

    async def _fire(self, ready: list[tuple[_Job, _JobRow]], now_ms: int) -> dict[str, int]:
        """Handle the due occurrences of these jobs after their watermarks (run, skip, catch up or
        miss), ``_CLAIM_BATCH`` jobs a transaction; the attempts each won start while the next is
        claimed, and each process begins at a place of its own in the list, so that processes
        finding thousands due at once share them. Returns the watermarks that had moved, by job."""
        if len(ready) <= _CLAIM_BATCH:
            return await self._claim_batch(ready, now_ms)
        ready = _from_own_place(ready, self.instance)
        # (Batch after batch, the ends are written beside the claims, not in their way: a claim
        # that waited for a hundred ends before it took 15% longer to start 10,000.)
        self._sweeping = True
        self.runner.write_ends()  # (an end waiting goes first, in the store thread's order: its job may be in the sweep)
        # The store's thread claims the next batch while the loop starts the attempts of the last
        # (two batches in flight: the thread's 1.4 ms a batch of 100 no longer adds to the loop's).
        batches = [ready[start : start + _CLAIM_BATCH] for start in range(0, len(ready), _CLAIM_BATCH)]
        moved: dict[str, int] = {}
        claiming: collections.deque[asyncio.Future[dict[str, int]]] = collections.deque()
        try:
            for batch in batches:
                if len(claiming) == 2:
                    moved.update(await claiming.popleft())  # (its attempts started as it was answered)
                    if self.stopping:
                        break
                    now_ms = _ms(self._clock.time())
                claiming.append(self._claim_ahead(batch, now_ms))
            while claiming:
                moved.update(await claiming.popleft())
        finally:
            if claiming:  # (left by a fault of an earlier batch: what they win starts before the look is over)
                await self._wait_for_left(claiming)
            self.runner.write_ends()  # (the ends that waited for the sweep to be over)
            self._sweeping = False
        return moved

    @staticmethod
    async def _wait_for_left(claiming: Iterable[asyncio.Future[dict[str, int]]]) -> None:
        """Wait for the answers of the batches a sweep's fault left in flight (their attempts are
        started, so that a stop's drain, or the abort of a store opened again, finds them); log
        their own faults that are not the store's (the store's is the sweep's, logged with it)."""
        left = list(claiming)
        await asyncio.wait(left)
        for done in left:
            fault = None if done.cancelled() else done.exception()
            if fault is not None and not isinstance(fault, StoreError):
                _log.error("claiming a batch of a sweep failed", exc_info=fault)

    def _claim_ahead(self, batch: list[tuple[_Job, _JobRow]], now_ms: int) -> asyncio.Future[dict[str, int]]:
        """A sweep's batch claimed on the store's thread; what it won starts as the answer comes
        (the sweep waits for every batch it asked for, ``_wait_for_left``); the future has what had
        moved."""
        due = [_due(job, row.last_slot, now_ms) for job, row in batch]
        done: asyncio.Future[dict[str, int]] = asyncio.get_running_loop().create_future()

        def answered(claims: list[_Claimed] | None, exc: BaseException | None) -> None:
            moved = None
            if exc is None:
                assert claims is not None
                try:
                    moved = self._won(batch, due, claims)
                except Exception as fault:  # noqa: BLE001 - (a bug: the sweep's look fails with it)
                    exc = fault
            _fill(done, moved, exc)

        self._link.submit(lambda s: s.claim_due_many(self.instance, now_ms, due), answered)
        return done

    async def _claim_batch(self, batch: list[tuple[_Job, _JobRow]], now_ms: int) -> dict[str, int]:
        """One transaction of ``_fire``: write the ends waiting for it, claim, start what was won,
        return what had moved."""
        due = [_due(job, row.last_slot, now_ms) for job, row in batch]
        ending = self.runner.take_ends()
        if ending:
            claims = await self._end_and_claim(ending, due, now_ms)
        else:
            claims = await self._link.call(
                lambda s: s.claim_due_many(self.instance, now_ms, due), soon=len(due) <= _ON_THE_LOOP
            )
        return self._won(batch, due, claims)

    def _won(self, batch: list[tuple[_Job, _JobRow]], due: list[_Due], claims: list[_Claimed]) -> dict[str, int]:
        """Start the attempts that the claims of ``due`` won, tell what was missed or skipped; return
        the watermarks found moved, by job."""
        moved = {}
        written = []  # (the rows as this process moved them: the next look need not read them first)
        for (job, row), item, claim in zip(batch, due, claims):
            if claim is _NotClaimed.MOVED:
                moved[job.name] = row.last_slot
                continue
            written.append(row._replace(last_slot=item.slot, next_slot=item.next_slot))
            if item.missed:
                _tell_missed(self._events, job, item)
            if isinstance(claim, _Claim):
                self.runner.start(job, claim)
            elif item.run:
                self._events.tell(logging.WARNING, "skipped", job.name, item.slot, 0, _skipped(job), status="skipped")
        if self._agenda is not None:
            self._agenda.update(written)
        return moved

    async def _end_and_claim(self, ending: list[tuple[_End, _Call]], due: list[_Due], now_ms: int) -> list[_Claimed]:
        """The claims of ``due``, in the transaction that writes the ends ``ending`` first; the
        attempts waiting for those are told of the answer even if this task is cancelled. A fault
        not the store's (a bug, an end's text) fails the transaction, not the ends nor the claims:
        each is written again alone, the ends first, where the fault shows as its own."""
        claimed: asyncio.Future[list[_Claimed]] = asyncio.get_running_loop().create_future()

        def answered(both: tuple[list[bool], list[_Claimed]] | None, exc: BaseException | None) -> None:
            if isinstance(exc, Exception) and not isinstance(exc, StoreError):
                self.runner.write_batch(ending)
            else:
                self.runner.written(ending, None if both is None else both[0], exc)
            _fill(claimed, None if both is None else both[1], exc)

        ends = [end for end, _ in ending]
        try:
            soon = len(ends) + len(due) <= _ON_THE_LOOP
            self._link.submit(lambda s: s.end_and_claim(self.instance, now_ms, ends, due), answered, soon)
        except Exception as exc:
            self.runner.written(ending, None, exc)
            raise
        try:
            return await claimed
        except StoreError:
            raise
        except Exception:  # noqa: BLE001 - (not the store's: above)
            return await self._link.call(lambda s: s.claim_due_many(self.instance, now_ms, due))

    def _end_wait(self, job: str) -> float:
        """Seconds the end of a run of ``job`` (its run over) may wait to be written in the
        transaction of this process's next claim: when that comes within ``_END_WAIT`` (the next
        look is at an occurrence this process claims first) and before the job's own next
        occurrence starts, which this process claims first too (whichever process claims it must
        find this run over). During a sweep, until it is over (``_SWEEP_END_WAIT`` at most), for a
        job this process claims first that does not come due before. 0: written at once."""
        agenda, declared = self._agenda, self._declared.jobs.get(job)
        row = None if agenda is None else agenda.rows.get(job)
        if self.stopping or agenda is None or declared is None or row is None or not self._is_first(job):
            # (The next occurrence, or a run triggered, of a job another process claims first may be
            # claimed there before this end is written, and find it unfinished: skipped.)
            return 0.0
        if self._sweeping:  # (written once the sweep is over)
            until = _ms(self._clock.time() + _SWEEP_END_WAIT + _LOOK_GAP)
            return 0.0 if _comes_due_by(declared, row, until) else _SWEEP_END_WAIT
        first = agenda.first()
        if first is None or not self._is_first(first[1]):
            return 0.0  # (a look at another process's occurrence reads first, and may claim nothing)
        look = first[0]
        wait = max(look - _ms(self._clock.time()), 0) / 1000
        if wait > _END_WAIT or _comes_due_by(declared, row, look + _ms(_LOOK_GAP)):
            return 0.0
        return wait + _LOOK_GAP  # (then the end is written alone, if that claim was not made)

    async def _consider(self, run: _RunRow, now_ms: int, watch: _Changes) -> float | None:
        """Claim a pending run, take over one whose owner is gone, or let the runner judge one of
        ours. ``run`` was read at ``_read_at`` (its ``lease_left`` is as of then).

        Returns how many seconds from now the run needs another look (0 after a claim), or None.
        """
        if self.runner.judge(run):
            return None
        job = self._declared.jobs.get(run.job)
        if (
            job is None
            or self.stopping
            or (run.state == "running" and (run.job, run.slot, run.attempt) in self.runner.ended)
        ):
            return None  # (an attempt of ours that ended: its end is written, or about to be)
        reason, gone = "", None
        if run.state == "pending":
            if run.not_before > now_ms:
                return (run.not_before - now_ms) / 1000
            if run.attempt == 0 and not self._is_first(run.job):
                # A run triggered is claimed by its job's first process, whose end of the job's last
                # run may wait for its next claim (``_end_wait``): a process that claimed it first
                # found that run unfinished and recorded the trigger skipped. The others claim it a
                # second look after they saw it (the first is frozen, stopping or gone), on their own
                # clock (the slot is the clock of the process that triggered it).
                seen = self._triggers_seen.setdefault((run.job, run.slot), self._clock.monotonic())
                left = seen + _SECOND_LOOK - self._clock.monotonic()
                if left > 0:
                    return left
        else:
            gone = watch.owner_gone(run)
            left = (run.lease_left or 0.0) - (self._clock.monotonic() - self._read_at)
            if gone is None and left >= 0:
                # Watch the owner, and its lease: a store that judges owners only when it reads the
                # runs has them read again at the next look (sooner when a free lock settles).
                again = min(self._poll, left + 0.001, watch.settles_in(run))
                if not watch.fresh_liveness:
                    self._watching = True
                    self._reread = min(self._reread, self._clock.monotonic() - self._read_at + again)
                return again
            reason = gone or "lease expired"
        options = job.options
        self.runner.write_ends()  # (a run of ours that ended is over before this claim: a trigger is not skipped)
        claim = await self._link.call(
            lambda s: s.claim(
                run,
                self.instance,
                options.lease,
                now_ms,
                options.max_attempts,
                options.overlap,
                reason,
                owner_gone=gone is not None,
            ),
            soon=True,
        )
        if isinstance(claim, RunRecord):  # it reached max_attempts: this process ended it failed for good
            self.runner.tell_failure(job, claim)
            return 0.0
        if claim is not None:
            if run.state == "running":
                _tell_taken_over(self._events, run, claim, reason)
            self.runner.start(job, claim)
        return 0.0


###############################################################################
# The scheduler ###############################################################
###############################################################################


def _resumed_from(row: _JobRow, now_ms: int) -> int:
    """Where a job resumed at ``now_ms`` goes on from: now (what came due while it was paused is
    neither run nor recorded), but a one-shot job whose time passed during the pause just before
    that time, so that it is found late (run within ``catch_up``, else recorded ``missed``)."""
    try:
        return _schedule_from(row.schedule, row.name).watermark(now_ms)
    except ConfigError:  # (a schedule the command line cannot read: as any other)
        return now_ms


def _unclaimed(handler: Any) -> bool:
    """Whether a signal's handler is Python's default (or ``asyncio.run``'s for SIGINT), which
    the application did not choose."""
    if handler in (signal.SIG_DFL, signal.default_int_handler):
        return True
    function = getattr(handler, "func", handler)  # (asyncio.Runner's is a partial of its method)
    return getattr(function, "__qualname__", "") == "Runner._on_sigint"


class _Declaring:
    """The jobs a ``Scheduler`` declares: the declaring half of its public face (``every``,
    ``cron``, ``rrule``, ``at``, ``on_start``, ``remove``, ``reschedule`` and what tells of them),
    over the process's ``_Declarations``.

    Jobs may be declared, removed and rescheduled before the scheduler runs or while it does, from
    any thread: it takes effect at the next look (at once), and the store records what this process
    declares, for ``status``, ``trigger`` and ``forget`` in every process."""

    _declared: _Declarations  #: the jobs this process declares (the ``Scheduler`` makes it)
    _clock: Clock  #: wall and monotonic time, for ``upcoming``

    @overload
    def every(
        self,
        name: str,
        interval: DurationLike,
        handler: None = None,
        *,
        offset: DurationLike = 0,
        **options: Unpack[JobOptions],
    ) -> Callable[[H], H]: ...

    @overload
    def every(
        self, name: str, interval: DurationLike, handler: H, *, offset: DurationLike = 0, **options: Unpack[JobOptions]
    ) -> H: ...

    def every(
        self,
        name: str,
        interval: DurationLike,
        handler: Handler | None = None,
        *,
        offset: DurationLike = 0,
        **options: Unpack[JobOptions],
    ) -> Any:
        """Run ``handler`` every ``interval``, on slots aligned to the Unix epoch (plus ``offset``)."""
        return self._declared.declare(name, _every(name, interval, offset), handler, dict(options))

    @overload
    def cron(
        self, name: str, expr: str, handler: None = None, *, tz: Zone = None, **options: Unpack[JobOptions]
    ) -> Callable[[H], H]: ...

    @overload
    def cron(self, name: str, expr: str, handler: H, *, tz: Zone = None, **options: Unpack[JobOptions]) -> H: ...

    def cron(
        self, name: str, expr: str, handler: Handler | None = None, *, tz: Zone = None, **options: Unpack[JobOptions]
    ) -> Any:
        """Run ``handler`` on a 5-field cron schedule in zone ``tz`` (default: the local zone)."""
        return self._declared.declare(name, _cron(name, expr, tz), handler, dict(options))

    @overload
    def rrule(
        self,
        name: str,
        rule: str | _rrule.rrule,
        handler: None = None,
        *,
        tz: Zone = None,
        **options: Unpack[JobOptions],
    ) -> Callable[[H], H]: ...

    @overload
    def rrule(
        self, name: str, rule: str | _rrule.rrule, handler: H, *, tz: Zone = None, **options: Unpack[JobOptions]
    ) -> H: ...

    def rrule(
        self,
        name: str,
        rule: str | _rrule.rrule,
        handler: Handler | None = None,
        *,
        tz: Zone = None,
        **options: Unpack[JobOptions],
    ) -> Any:
        """Run ``handler`` on an RFC 5545 recurrence rule (string or ``dateutil.rrule.rrule``)."""
        return self._declared.declare(
            name, _RRule(rule, None if tz is None else _zone(tz, name), name), handler, dict(options)
        )

    @overload
    def at(
        self, name: str, when: When, handler: None = None, *, tz: Zone = None, **options: Unpack[JobOptions]
    ) -> Callable[[H], H]: ...

    @overload
    def at(self, name: str, when: When, handler: H, *, tz: Zone = None, **options: Unpack[JobOptions]) -> H: ...

    def at(
        self, name: str, when: When, handler: Handler | None = None, *, tz: Zone = None, **options: Unpack[JobOptions]
    ) -> Any:
        """Run ``handler`` once, at ``when``, on one of the processes that declare it: a one-shot
        job. ``when`` is an aware ``datetime``, a naive one or an ISO 8601 string (in zone ``tz``,
        default the local zone), or Unix epoch seconds. The store keeps that it ran: a process
        started again that declares it again does not run it again. A ``when`` already past runs
        if it is no more than 5 s late, or within ``catch_up``; otherwise it is recorded ``missed``.
        Give every process the same ``when``: one computed at start (``now + 5 minutes``) is
        another schedule in each process and at each start, and runs once for each."""
        return self._declared.declare(name, _At(_at_time(when, _zone(tz, name), name)), handler, dict(options))

    @overload
    def on_start(self, name: str, handler: None = None, **options: Unpack[JobOptions]) -> Callable[[H], H]: ...

    @overload
    def on_start(self, name: str, handler: H, **options: Unpack[JobOptions]) -> H: ...

    def on_start(self, name: str, handler: Handler | None = None, **options: Unpack[JobOptions]) -> Any:
        """Run ``handler`` once when a group of processes starts on the store (no other one
        running): a crontab's ``@reboot``. Never on a clock; ``trigger`` runs it any time."""
        return self._declared.declare(name, _OnStart(), handler, dict(options))

    def remove(self, name: str) -> None:
        """Stop declaring job ``name`` in this process (``JobNotFound`` if it does not): from the
        next look it claims no occurrence of it; its attempts running here carry on to their end.
        The store keeps the job and its history: other processes that declare it go on running
        it, and once none does, ``status`` shows it ``undeclared`` and ``forget`` deletes it."""
        self._declared.remove(name)

    def reschedule(
        self,
        name: str,
        *,
        every: DurationLike | None = None,
        offset: DurationLike = 0,
        cron: str | None = None,
        rrule: str | _rrule.rrule | None = None,
        at: When | None = None,
        tz: Zone = None,
    ) -> None:
        """Give job ``name`` another schedule (exactly one of ``every``, ``cron``, ``rrule`` and
        ``at``), with its handler and options, from the next look. Its occurrences go on from now:
        those the new schedule had before are neither run nor recorded missed. Every process that
        declares the job should declare the new schedule (until they all do, each warns that the
        other declares it differently, and the store holds the one declared last)."""
        given = [
            kind
            for kind, value in (("every", every), ("cron", cron), ("rrule", rrule), ("at", at))
            if value is not None
        ]
        if len(given) != 1:
            raise ConfigError(
                f"give exactly one of every, cron, rrule and at, not {given or 'none'}", job=name, option="schedule"
            )
        if every is not None:
            schedule: _Schedule = _every(name, every, offset)
        elif cron is not None:
            schedule = _cron(name, cron, tz)
        elif rrule is not None:
            schedule = _RRule(rrule, None if tz is None else _zone(tz, name), name)
        else:
            schedule = _At(_at_time(at, _zone(tz, name), name))
        self._declared.reschedule(name, schedule)

    def agree_on(self, name: str, text: str) -> None:
        """Make ``text`` (a crontab entry's command) part of what every process declaring job
        ``name`` must declare alike, besides its schedule: a process that declares it otherwise is
        warned of, as for a different schedule. ``JobNotFound`` if this process does not declare it."""
        self._declared.agree_on(name, text)

    def declared(self) -> list[str]:
        """The names of the jobs this process declares, in the order they were declared."""
        return list(self._declared.jobs)

    def describe(self, name: str) -> str:
        """Job ``name``'s schedule as the store keeps it and ``status`` shows it (``every 1h``,
        ``cron 0 3 * * * Europe/Athens``, ``@reboot``); ``JobNotFound`` if not declared here."""
        return self._declared.job(name).description

    def zone(self, name: str) -> _dt.tzinfo:
        """The zone job ``name``'s occurrences are reckoned in: its cron or rrule zone; the local
        zone for an interval or ``@reboot``. ``JobNotFound`` if not declared here."""
        schedule = self._declared.job(name).schedule.plain
        return schedule.zone if isinstance(schedule, _Calendar) else _local_zone()

    def replace_jobs(self, source: Scheduler) -> None:
        """Declare the jobs that ``source`` declares (a ``Scheduler`` made only to declare them,
        never run) instead of this one's, from its next look: what a reload on SIGHUP does with a
        crontab read again. Safe while this scheduler runs, on its event loop's thread; attempts
        already running carry on."""
        self._declared.replace(source._declared.jobs)

    def upcoming(self, name: str, count: int = 5, after: _dt.datetime | None = None) -> list[_dt.datetime]:
        """The next ``count`` occurrences of job ``name`` strictly after ``after`` (default now; a
        naive datetime counts as UTC), as aware UTC datetimes. Pure schedule math: no database."""
        job = self._declared.job(name)
        if after is None:
            cursor = _ms(self._clock.time())
        else:  # a naive datetime is taken as UTC, like every datetime this module returns
            cursor = _ms_from_dt(after if after.tzinfo else after.replace(tzinfo=_UTC))
        return job.schedule.following(cursor, count)


class Scheduler(_Declaring):
    """Runs declared jobs from one SQLite file shared with other processes on this host, or from
    one PostgreSQL database shared with processes on any host.

    ``path`` is the database file (created on first use, mode 0600), or a ``postgresql://`` URL
    (tables in the schema ``anarchon``, or the URL's ``?schema=NAME``; needs psycopg 3, the
    ``postgres`` extra); ``instance`` a readable id
    for this process (default: host, pid and a random suffix). Other keyword arguments are for
    tests and tuning: ``clock`` (a ``Clock``), ``poll`` (look at the file this often, at most every
    1 s, instead of being woken by changes to it), ``busy_timeout`` (seconds a write waits for the lock), ``retention`` (history records kept
    per job), ``blocked_warning`` (seconds of a blocked event loop before a warning),
    ``switch_interval`` (the interpreter's GIL switch interval around lease renewals, if lower than
    it was; None leaves it alone), ``read_only`` (only look at the file, for ``status()`` and
    ``history()``: a missing file is a ``StoreError``, nothing is created, and the file may be in a
    directory this process cannot write; such a scheduler cannot run or change anything),
    ``notify`` (talk to systemd when ``$NOTIFY_SOCKET`` is set, for a service of ``Type=notify``:
    ``READY=1`` once joined, ``STATUS=``, ``STOPPING=1``, and ``WATCHDOG=1`` from the event loop when
    ``WatchdogSec=`` is set; for a process that systemd runs as the service itself, not for one of
    its workers. The command line's ``run`` and ``crontab`` do it), ``metrics_file`` (a path, for
    node_exporter's textfile collector: rewritten whole, at start and within a second of each
    attempt's start and end, with what ``prometheus()`` returns), ``durability`` (of the SQLite
    file's commits: ``"normal"``, the default, syncs the WAL to disk at its checkpoints, so a power
    cut can lose the last commits, and an occurrence whose claim was lost may run again after power
    returns, never twice while it is on; ``"full"`` syncs every commit, for about twice the bytes
    written. On PostgreSQL the server's ``synchronous_commit`` decides), ``shared_group`` (the SQLite
    file, its -wal and -shm, the lease board and the liveness directory may belong to another user
    of one of this process's groups, and that group may write them: an app user and a deploy user
    sharing a group; new ones are made writable by the group. Without it, those of another user, or
    that users other than the owner may write, are refused with a ``StoreError``: the
    "Trust model" in docs/database.md). ``":memory:"`` is refused (``StoreError``) when first used: processes share a file.

    The store settings (``clock``, ``poll``, ``busy_timeout``, ``retention``, ``read_only``,
    ``durability``, ``shared_group``) go to the store that ``path`` names, which one factory
    chooses (``_store_at``). ``store`` hands a store in instead: one built by ``_store_at``, or a
    function given the store this scheduler would open and returning the one it uses (tests wrap
    it to inject faults or count calls through the store interface).
    """

    def __init__(
        self,
        path: PathLike,
        *,
        instance: str | None = None,
        clock: Clock | None = None,
        poll: float | None = None,
        busy_timeout: float = 30.0,
        retention: int = 1000,
        blocked_warning: float = 1.0,
        switch_interval: float | None = 0.0005,
        read_only: bool = False,
        notify: bool = False,
        metrics_file: PathLike | None = None,
        durability: Literal["full", "normal"] = "normal",
        shared_group: bool = False,
        store: _Backend | Callable[[_Backend], _Backend] | None = None,
    ):
        self.path = os.fspath(path)
        if instance is not None and not (
            isinstance(instance, str) and instance.isprintable() and 0 < len(instance) <= 200
        ):
            raise ConfigError(f"must be printable text of 1 to 200 characters, not {instance!r}", option="instance")
        self.instance = instance or f"{_safe_text(socket.gethostname())}-{os.getpid()}-{random.randrange(16**4):04x}"
        self._clock = clock or Clock()
        self._read_only = read_only
        if isinstance(store, _Backend):
            backend = store
        else:
            backend = _store_at(
                self.path,
                clock=self._clock,
                poll=poll,
                busy_timeout=busy_timeout,
                retention=retention,
                read_only=read_only,
                durability=durability,
                shared_group=shared_group,
            )
            if store is not None:
                backend = store(backend)
        self._declared = _Declarations(self.instance, self._clock)  #: the jobs this process declares
        self._link = _StoreLink(backend, self._declared, self._clock)  #: the store, and every connection to it
        self.checkpoints = CheckpointStore(self._link, self._clock)
        self._events = _Events(self.instance)  #: what is told of runs: log lines, ``on_event`` listeners
        #: the engine: serves while ``run()`` runs (its ``runner``: this process's running attempts)
        self._loop = _Loop(
            self.instance, self._clock, self._link, self.checkpoints, self._events, blocked_warning, switch_interval
        )
        self._signal_tasks: set[asyncio.Task[None]] = set()  #: the stops that signals began
        self._body_signals: list[tuple[int, Any]] = []  #: the signals ``async with`` took (given back at its end)
        self._body_cancelled = False  #: a signal cancelled the ``async with`` block's task
        self._main: asyncio.Task[None] | None = None  #: the task that serves, while it does
        self._thread: threading.Thread | None = None  #: the thread of ``start_in_thread``
        self._thread_loop: asyncio.AbstractEventLoop | None = None  #: and its event loop
        #: what the last ``status()`` made of each job without unfinished runs, to be given again
        #: while its marks, its row, its declaration and its next start stay as they were
        self._shown: dict[str, tuple[tuple[Any, ...], tuple[Any, ...], _Job | None, JobStatus, int | None]] = {}
        #: each job's row as ``status()`` last read it, the newest change number it read (a status
        #: reads again only the rows changed since: ``job_statuses``), and when it last read every
        #: row (every ``_FULL_READ`` seconds, as the loop: a row changed by hand has no new number)
        self._rows: dict[str, tuple[Any, ...]] = {}
        self._rows_read = -1
        self._rows_whole_at = -math.inf
        if notify:
            self.notify_systemd()
        if metrics_file is not None:
            self.keep_metrics(metrics_file)

    # -- control from any process ----------------------------------------------------------------

    async def trigger(self, name: str) -> int:
        """Record a run of ``name`` due now and return its slot (ms); a process declaring the job
        runs it (while none runs, the first to start that declares it). Works whether or not this
        scheduler is running. ``JobNotFound`` for a job the store does not hold; ``ConfigError``
        for one that no running process declares (nothing would run it)."""
        now = _ms(self._clock.time())

        def trigger(store: _Store) -> int:
            if name in (store.undeclared(name) or ()):
                raise ConfigError(
                    "no running process declares it (removed from a crontab, or renamed?): nothing would run it; "
                    "`forget` removes it and its records",
                    job=name,
                )
            return store.trigger(name, now)

        slot = await self._link.call(trigger)
        self._loop.poke()
        return slot

    async def forget(self, name: str) -> None:
        """Delete ``name`` and everything recorded of it (runs, history, checkpoints, counts):
        for a job that no running process declares any more. ``ConfigError`` (and nothing deleted)
        while one declares it or it has unfinished runs; ``JobNotFound`` if there is no such job."""
        why = await self._link.call(lambda s: s.forget(name))
        if why is not None:
            raise ConfigError(f"not forgotten: {why}", job=name)

    async def processes(self) -> list[ProcessInfo]:
        """The scheduler processes running on the store (this one too, while it runs)."""
        return await self._link.call(lambda s: s.processes())

    async def pause(self, name: str) -> None:
        """Stop scheduling ``name`` on every process (runs in progress carry on)."""
        await self._set_paused(name, True)

    async def resume(self, name: str) -> None:
        """Restart the schedule of ``name``; occurrences during the pause are not run or recorded."""
        await self._set_paused(name, False)

    async def _set_paused(self, name: str, paused: bool) -> None:
        now = _ms(self._clock.time())

        def set_paused(store: _Store) -> bool:
            row = None if paused else store.job(name)
            since = now if row is None else _resumed_from(row, now)
            return store.set_paused(name, paused, since)

        if not await self._link.call(set_paused):
            raise JobNotFound("no such job in the database", job=name)
        self._loop.poke()

    async def cancel(self, name: str) -> int:
        """Abort every unfinished run of ``name`` with ``Cancelled``, on whichever process holds it."""
        now = _ms(self._clock.time())
        count = await self._link.call(lambda s: s.cancel(name, now))
        self._loop.runner.abort(lambda job: Cancelled(f"{job}: cancelled"), name)
        return count

    async def history(self, job: str | None = None, limit: int = 100) -> list[RunRecord]:
        """The newest ``limit`` records (of ``job``, or of every job), newest first."""
        return await self._link.call(lambda s: s.history(job, limit))

    async def prometheus(self) -> str:
        """Every job's figures in the Prometheus text format (what ``metrics_file`` holds): runs
        by status (counters: pruning the history keeps them), the newest start, success, failure
        and duration, the attempts running now; while this scheduler runs, also its lease
        renewals' lateness over the last minute (99th percentile)."""
        return await self._link.call(lambda s: _prometheus(s.figures(), self._loop.lateness()))

    def keep_metrics(self, path: PathLike) -> None:
        """Keep the node_exporter textfile at ``path`` while this scheduler runs, as
        ``metrics_file=`` does: rewritten whole at start, within a second of each start and end of
        an attempt, and at the stop, with what ``prometheus()`` returns. A failed write is logged
        once (until one works again) and never stops the scheduler."""
        loop = self._loop
        if loop.metrics is None:
            loop.metrics = _MetricsFile(self._link, loop.lateness, lambda: loop.stopping)
        loop.metrics.keep(os.fspath(path), self._events, loop.runner)

    def notify_systemd(self) -> None:
        """Talk to systemd while this scheduler runs, as ``notify=True`` does, when
        ``$NOTIFY_SOCKET`` is set (a service of ``Type=notify``): ``READY=1`` once joined,
        ``STATUS=`` after each look, ``STOPPING=1`` with the time the hand-over may take, and
        ``WATCHDOG=1`` from the event loop when ``WatchdogSec=`` is set. For the process that
        systemd runs as the service itself. Once is enough; again does nothing."""
        if self._loop.notify is None:
            self._loop.notify = _Notify(os.environ)

    def share_group(self) -> None:
        """Trust the SQLite file, its -wal and -shm, the lease board and the liveness directory
        when they belong to one of this process's groups, as ``shared_group=True`` does (the
        "Trust model" in docs/database.md), from the next connection on. Nothing on PostgreSQL."""
        backend = self._link.backend
        if isinstance(backend, _SQLite):
            backend.shared_group = True

    async def status(self) -> list[JobStatus]:
        """Every job in the file: schedule, next occurrence, state, newest record and unfinished runs."""
        since = self._rows_read
        if self._clock.monotonic() >= self._rows_whole_at + _FULL_READ:
            since, self._rows_whole_at = -1, self._clock.monotonic()
        (marks, fresh), runs = await self._link.call(lambda s: (s.job_statuses(since), s.runs()))
        now_wall = self._clock.time()
        now_ms = _ms(now_wall)
        runs_of: dict[str, list[_RunRow]] = {}
        for run in runs:
            runs_of.setdefault(run.job, []).append(run)
        result = []
        shown, self._shown = self._shown, {}
        rows, self._rows = self._rows, {}
        rows.update((row[0], row) for row in fresh)
        self._rows_read = max((row[7] for row in fresh if row[7] is not None), default=since)
        declared_jobs = self._declared.jobs
        for mark in marks:
            name = mark[0]
            row = rows.get(name)
            if row is None or row[7] != mark[1]:
                # (a row changed between the two reads, or under a change number already passed)
                self._rows, self._shown, self._rows_whole_at = {}, {}, -math.inf
                return await self.status()
            self._rows[name] = row
            declared = declared_jobs.get(name)
            mine = runs_of.get(name)
            before = None if mine else shown.get(name)
            if (
                before is not None
                and before[0] == mark
                and before[1] is row
                and before[2] is declared
                and (before[4] is None or before[4] > now_ms)
            ):
                # As the last time (its next start is still to come): the same objects, nothing
                # made that the garbage collector would count (of 10,000 jobs, 30,000 containers).
                self._shown[name] = before
                result.append(before[3])
                continue
            status, start = self._status_of(
                _JobStatusRow._make((*row[:7], *mark[2:])), declared, mine, now_ms, now_wall
            )
            if not mine:
                self._shown[name] = (mark, row, declared, status, start)
            result.append(status)
        return result

    @staticmethod
    def _status_of(
        row: _JobStatusRow, declared: _Job | None, runs: list[_RunRow] | None, now_ms: int, now_wall: float
    ) -> tuple[JobStatus, int | None]:
        """One job's ``JobStatus``: its next occurrence (the one after now once due); and its start."""
        schedule = _stored_schedule(row) if declared is None else declared.schedule
        following = row.next_slot if declared is None else declared.next_due(row.last_slot)
        if declared is not None and following is not None and schedule.start_of(following) <= now_ms:
            following = schedule.next_after(now_ms)  # due: the one after now
        start = None if following is None else schedule.start_of(following)
        status = object.__new__(JobStatus)
        status._fill(row, following, () if runs is None else tuple(_run_info(r, now_wall) for r in runs), start)
        return status, start

    # -- running ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the scheduler until ``stop()`` (or SIGTERM/SIGINT, when on the main thread)."""
        if self._read_only:
            raise ConfigError("a read-only scheduler only looks at the file: it cannot run", option="read_only")
        self._loop.stopping = False  # a stop from now on, even while starting, is kept
        installed = self._take_signals(only_unclaimed=False)
        self._main = asyncio.current_task()
        self._loop.ready = asyncio.Event()
        try:
            await self._loop.serve()
        finally:
            self._give_signals_back(installed)

    def _take_signals(self, only_unclaimed: bool, then: Callable[[], object] | None = None) -> list[tuple[int, Any]]:
        """Stop on SIGTERM and SIGINT (a second one cuts the grace short), then call ``then``;
        only on the main thread, and with ``only_unclaimed`` only for a signal whose handling the
        application left as Python's (or ``asyncio.run``'s: Ctrl-C cancels the main task) default.
        Returns the signals taken, each with the handler to give it back to."""
        taken: list[tuple[int, Any]] = []
        if threading.current_thread() is not threading.main_thread():
            return taken
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            before = signal.getsignal(signum)
            if only_unclaimed and not _unclaimed(before):
                continue
            try:
                loop.add_signal_handler(signum, self._on_signal, signum, then)
                taken.append((signum, before))
            except (NotImplementedError, RuntimeError):
                pass
        return taken

    def _give_signals_back(self, taken: list[tuple[int, Any]]) -> None:
        loop = asyncio.get_running_loop()
        for signum, before in taken:
            loop.remove_signal_handler(signum)
            if before is not None:
                signal.signal(signum, before)
        taken.clear()

    def _on_signal(self, signum: int, then: Callable[[], object] | None = None) -> None:
        hurry = self._loop.runner.hurry
        if self._loop.stopping and hurry is not None:
            if not hurry.is_set():
                _log.warning("received %s again: cutting the grace short", signal.Signals(signum).name)
                self._loop.runner.hurry_now()
            return
        _log.info("received %s: stopping (again to cut the grace short)", signal.Signals(signum).name)
        task = asyncio.get_running_loop().create_task(self.stop())
        self._signal_tasks.add(task)
        task.add_done_callback(self._signal_tasks.discard)
        if then is not None:
            then()

    async def __aenter__(self) -> Scheduler:  # noqa: PYI034 - typing has Self only from Python 3.11
        """Start the scheduler in the background; returns once it has looked at the file once.

        On the main thread, SIGTERM and SIGINT (unless the application handles them itself) stop
        it as they stop ``run()``, handing its runs over, and end the block: the task in it is
        cancelled, and the ``CancelledError`` ends at the block's end, where the code after it
        carries on (a second signal cuts the grace short)."""
        self._loop.stopping = False
        self._loop.ready = ready = asyncio.Event()
        body = asyncio.current_task()
        self._body_cancelled = False
        self._body_signals = self._take_signals(True, functools.partial(self._cancel_body, body))
        self._main = asyncio.get_running_loop().create_task(self._loop.serve())
        waiter = asyncio.ensure_future(ready.wait())
        try:
            await asyncio.wait({self._main, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # (cancelled while starting, by a signal or the application: stop, then say so)
            await self._stop_and_give_signals_back()
            raise
        finally:
            waiter.cancel()
        if self._main.done():
            self._give_signals_back(self._body_signals)
            self._main.result()
        return self

    def _cancel_body(self, body: asyncio.Task[Any] | None) -> None:
        if body is not None and not body.done():
            self._body_cancelled = True
            body.cancel()

    async def _stop_and_give_signals_back(self) -> None:
        """Stop (a cancel meanwhile waits for the hand-over before it goes on), and only then give
        the signals back: a second one while stopping cuts the grace short, as under ``run()``."""
        stopping = asyncio.ensure_future(self.stop())
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            await stopping
            raise
        finally:
            self._give_signals_back(self._body_signals)

    async def __aexit__(self, kind: type[BaseException] | None, *exc_info: object) -> bool:
        await self._stop_and_give_signals_back()
        if self._body_cancelled and kind is asyncio.CancelledError:
            self._body_cancelled = False
            task = asyncio.current_task()
            uncancel = getattr(task, "uncancel", None)  # (Python 3.11: what cancelled it is dealt with)
            if uncancel is not None:
                uncancel()
            return True  # the signal's cancel ends here: the code after the block runs
        return False

    async def stop(self, grace: DurationLike = 10.0) -> None:
        """Stop claiming work, abort running handlers with ``Shutdown``, wait up to ``grace`` for
        them, and hand their runs over to the next process (another live one takes them at once)."""
        self._loop.runner.grace = parse_duration(grace, option="grace")
        self._loop.stopping = True
        self._loop.runner.stop(lambda _job: Shutdown(f"{self.instance} is stopping"))
        self._loop.poke()
        main = self._main
        if main is not None and main is not asyncio.current_task():
            await asyncio.wait({main})

    def on_event(self, listener: Callable[[RunEvent], object]) -> Callable[[], None]:
        """Call ``listener(event)`` for each ``RunEvent`` of this process (for metrics, alerts); it
        runs on the event loop's thread and must be quick. One that raises is logged and kept.
        Returns a function that removes it."""
        self._events.listeners.append(listener)
        return lambda: self._events.listeners.remove(listener) if listener in self._events.listeners else None

    def start_in_thread(self) -> None:
        """Run the scheduler in a thread of its own, on an event loop of its own, for code that is
        not async (Flask, Django, a script); returns once it has looked at the file once (or raises
        why it could not). Handlers run on that loop, plain functions in worker threads as always.
        Signals stay the application's: stop it with ``stop_thread`` (from a SIGTERM handler, an
        ``atexit`` function, a test's teardown)."""
        if self._thread is not None and self._thread.is_alive():
            raise ConfigError("this scheduler already runs in a thread")
        started: concurrent.futures.Future[None] = concurrent.futures.Future()

        async def serve() -> None:
            try:
                await self.__aenter__()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller of start_in_thread
                started.set_exception(exc)
                return
            self._thread_loop = asyncio.get_running_loop()
            started.set_result(None)
            assert self._main is not None
            await asyncio.wait({self._main})

        self._thread = threading.Thread(target=asyncio.run, args=(serve(),), name=f"anarchon-{self.instance}")
        self._thread.daemon = True
        self._thread.start()
        started.result()

    def stop_thread(self, grace: DurationLike = 10.0, timeout: float | None = None) -> None:
        """Stop the scheduler that ``start_in_thread`` started, as ``stop(grace)`` does, and wait
        (up to ``timeout`` seconds, if given) for its thread to end."""
        thread, loop = self._thread, self._thread_loop
        if thread is None:
            return
        if loop is not None and thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self.stop(grace), loop).result(timeout)
            except RuntimeError:  # its loop ended meanwhile
                pass
        thread.join(timeout)
        self._thread = self._thread_loop = None

    def close(self) -> None:
        """Let go of what this object holds: a scheduler started by ``start_in_thread`` is stopped
        (as ``stop_thread()``), and the store's thread and connection are closed. A scheduler
        running on an event loop of the caller's must be stopped (``stop()``) first. A later call
        opens what it needs again."""
        if self._thread is not None:
            self.stop_thread()
        elif self._main is not None and not self._main.done():
            raise ConfigError("this scheduler is running: stop() it before close()")
        self._loop.runner.join_threads(10.0)
        self._link.close(wait=True)


class Control:
    """The jobs of a database, for code that is not async (a Flask view, a Django command, a
    script): the same calls as ``Scheduler``'s, each run to its end on an event loop of its own.
    Do not call it from async code (use the ``Scheduler``); the command line is built on it."""

    def __init__(self, path: PathLike, *, read_only: bool = False, shared_group: bool = False):
        self.scheduler = Scheduler(path, read_only=read_only, shared_group=shared_group)  #: what the calls go through

    def status(self) -> list[JobStatus]:
        return asyncio.run(self.scheduler.status())

    def history(self, job: str | None = None, limit: int = 100) -> list[RunRecord]:
        return asyncio.run(self.scheduler.history(job, limit))

    def trigger(self, name: str) -> int:
        """Record a run of ``name`` due now; its slot. ``JobNotFound`` if the database has no such job."""
        return asyncio.run(self.scheduler.trigger(name))

    def pause(self, name: str) -> None:
        asyncio.run(self.scheduler.pause(name))

    def resume(self, name: str) -> None:
        asyncio.run(self.scheduler.resume(name))

    def cancel(self, name: str) -> int:
        """Cancel the unfinished runs of ``name``; how many."""
        return asyncio.run(self.scheduler.cancel(name))

    def forget(self, name: str) -> None:
        """Delete a job that no running process declares, and its records (``Scheduler.forget``)."""
        asyncio.run(self.scheduler.forget(name))

    def processes(self) -> list[ProcessInfo]:
        return asyncio.run(self.scheduler.processes())

    def prometheus(self) -> str:
        """Every job's figures in the Prometheus text format (``Scheduler.prometheus``)."""
        return asyncio.run(self.scheduler.prometheus())

    def close(self) -> None:
        """Close the database (``Scheduler.close``); ``with Control(path) as control:`` does it."""
        self.scheduler.close()

    def __enter__(self) -> Control:  # noqa: PYI034 - typing has Self only from Python 3.11
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


###############################################################################
# The status page's server ####################################################
###############################################################################
#
# HTTP/1.1 on the event loop, one request a connection (standard library only): the token and the
# session made of it, loopback names, the live stream of changes (server-sent events) that one look
# serves to every listening page. What the pages show is the next section's.

_WEB_LIVE = 0.5  # seconds between two looks for a change, while a page listens
_WEB_COOKIE = "anarchon_session"  # (its value is made from the token: the token itself never leaves)
_WEB_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{16,}")  # (what a cookie, a header and a URL carry as it is)
_WEB_NUMBER = re.compile(r"[0-9]{1,9}")
_WEB_STATUS = {404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden"}
# No script runs but the page's own (its nonce), nothing is loaded from elsewhere, no other site frames it.
_WEB_POLICY = (
    "default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


def _html(value: object) -> str:
    """Stored text as HTML text or an attribute's value: whatever its characters, it is only text."""
    import html

    return html.escape(_safe_text(value), quote=True)


def _listen_address(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6) as a host and a port."""
    host, colon, port = listen.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not colon or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"expected HOST:PORT (such as 127.0.0.1:8080), got {listen!r}", option="listen")
    return host, int(port)


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _local(path: str) -> str:
    """A path of this page, fit for a Location header: one leading slash (``//host`` would leave
    the page), nothing but ASCII (no line ends: no header of the client's making)."""
    import urllib.parse

    return "/" + urllib.parse.quote(path.lstrip("/"), safe="/%?=&+:@!$'()*,;-._~")


def _web_number(text: str, most: int, option: str) -> int:
    """A whole number of a query, from 1 to ``most`` (ASCII digits only)."""
    if not _WEB_NUMBER.fullmatch(text) or not 1 <= int(text) <= most:
        raise ConfigError(f"{option} must be a whole number from 1 to {most}, got {text[:20]!r}", option=option)
    return int(text)


class _WebRequest(NamedTuple):
    method: str
    path: str  # as sent (percent-encoded), without the query
    parts: tuple[str, ...]  # the path's segments, each decoded (a job's name may hold a "/")
    query: dict[str, str]
    headers: dict[str, str]  # names in lower case
    body: bytes
    peer: str


class _WebReply(NamedTuple):
    status: int
    body: bytes
    kind: str = "text/html; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()
    nonce: str = ""  # the page's own script's (no other script runs)


_Served = TypeVar("_Served", bound="_PageServer")  # (``async with StatusPage(...)`` gives a StatusPage)


class _PageServer:
    """The HTTP side of a status page: listening, reading requests, answering them (``_answer``, a
    subclass's), the token, and the live stream (what ``_live`` tells, looked at every
    ``_WEB_LIVE`` seconds while a page listens)."""

    def __init__(self, listen: str, token: str | None):
        self.host, self.port = _listen_address(listen)
        if token is not None and not _WEB_TOKEN.fullmatch(token):
            raise ConfigError(
                "a token must be at least 16 characters of letters, digits and ._~+/=- (openssl rand -hex 16)",
                option="token",
            )
        if token is None and not _loopback(self.host):
            raise ConfigError(
                f"{self.host} is not a loopback address: a page that others can reach needs a token "
                "(--token, or $ANARCHON_WEB_TOKEN)",
                option="listen",
            )
        self._token = token
        self._server: asyncio.AbstractServer | None = None
        self._listeners: set[asyncio.Queue[bytes]] = set()  #: the pages listening for changes
        self._watch: asyncio.Task[None] | None = None  #: what looks for changes while a page listens
        self._last_told = b""  #: what the listening pages were told last
        self._answering: set[asyncio.Task[Any]] = set()  #: the connections being answered

    async def _answer(self, request: _WebRequest) -> _WebReply:
        raise NotImplementedError

    async def _live(self) -> bytes:
        """What the listening pages are told (when it changes)."""
        raise NotImplementedError

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve_one, self.host, self.port, limit=16384)
        self.port = self._server.sockets[0].getsockname()[1]  # (port 0: the one the system chose)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        if self._server is not None:
            self._server.close()
        for queue in self._listeners:  # (each listening page's answer ends)
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(b"")
        if self._answering:  # (ended here, not cancelled when the loop closes: that would be logged)
            _, late = await asyncio.wait(self._answering, timeout=5.0)
            for task in late:
                task.cancel()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def serve(self) -> None:
        """Listen until cancelled."""
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    async def __aenter__(self: _Served) -> _Served:  # noqa: PYI019 - typing has Self only from Python 3.11
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- HTTP -------------------------------------------------------------------------------------

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        task = asyncio.current_task()
        if task is not None:
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)
        answered = False
        try:
            try:
                request = await self._read(reader, str(peer[0]) if peer else "?")
            except (asyncio.LimitOverrunError, ValueError):
                request = None
            if request is None:
                self._write(writer, self._problem(400, "not an HTTP request this page understands"))
                return
            if request.parts == ("events",) and request.method == "GET" and self._allowed(request) is None:
                answered = True
                await self._events(reader, writer)
                return
            try:
                reply = await self._answer(request)
            except JobNotFound as exc:
                reply = self._problem(404, str(exc))
            except AnarchonError as exc:
                reply = self._problem(503 if isinstance(exc, StoreError) else 400, str(exc))
            answered = True
            self._write(writer, reply, head_only=request.method == "HEAD")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        except Exception:  # noqa: BLE001 - a bug of this page must not end the process it lives in
            _log.exception("status page: answering a request failed")
            if not answered:
                self._write(writer, self._problem(500, "this page failed: its log says why"))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read(self, reader: asyncio.StreamReader, peer: str) -> _WebRequest | None:
        import urllib.parse

        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return None
        headers = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if colon:
                headers[name.strip().lower()] = value.strip()
        length = headers.get("content-length", "0")
        body = b""
        if length.isdigit() and 0 < int(length) <= 16384:
            body = await asyncio.wait_for(reader.readexactly(int(length)), 10)
        target = urllib.parse.urlsplit(parts[1])
        query = dict(urllib.parse.parse_qsl(target.query, errors="replace"))
        path = target.path if target.path.startswith("/") else "/"
        segments = tuple(urllib.parse.unquote(part, errors="replace") for part in path.strip("/").split("/"))
        return _WebRequest(parts[0], path, segments, query, headers, body, peer)

    def _write(self, writer: asyncio.StreamWriter, reply: _WebReply, head_only: bool = False) -> None:
        lines = [
            f"HTTP/1.1 {reply.status} {_WEB_STATUS.get(reply.status, 'OK')}",
            f"Content-Type: {reply.kind}",
            f"Content-Length: {len(reply.body)}",
            "Connection: close",
            "Cache-Control: no-store",
            "X-Content-Type-Options: nosniff",
            "X-Frame-Options: DENY",
            "Referrer-Policy: no-referrer",
            f"Content-Security-Policy: {_WEB_POLICY.format(nonce=reply.nonce or 'none')}",
            *(f"{name}: {value}" for name, value in reply.headers),
        ]
        head = "\r\n".join(lines) + "\r\n\r\n"  # (every value made here is ASCII: see _local)
        writer.write(head.encode("ascii", "replace") + (b"" if head_only else reply.body))

    def _allowed(self, request: _WebRequest) -> _WebReply | None:
        """None if the request may be answered; else the refusal. With a token, it must carry the
        token (``?token=``, ``Authorization: Bearer``) or the session made of it (the cookie).
        Without one, the page answers only to a loopback name: a page of another site that a name
        of its own points at 127.0.0.1 (DNS rebinding) is refused."""
        import hmac

        if self._token is None:
            host = request.headers.get("host", "localhost").rpartition(":")[0] or request.headers.get("host", "")
            if host.strip("[]") and not _loopback(host.strip("[]")):
                return self._problem(403, "this page answers only to a loopback address (a token lets other names in)")
            return None
        given = [request.query.get("token", ""), request.headers.get("authorization", "").removeprefix("Bearer ")]
        if any(hmac.compare_digest(value.encode(), self._token.encode()) for value in given if value):
            return None
        for part in request.headers.get("cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == _WEB_COOKIE and hmac.compare_digest(value.encode(), self._secret(b"session").encode()):
                return None
        return self._problem(401, "this page needs its token: open it as /?token=TOKEN once")

    def _secret(self, purpose: bytes) -> str:
        """A value made of the token for one purpose (the session cookie, the forms)."""
        import hashlib
        import hmac

        assert self._token is not None
        return hmac.new(self._token.encode(), b"anarchon_lite status page " + purpose, hashlib.sha256).hexdigest()

    def _csrf(self) -> str:
        return self._secret(b"form")

    def _problem(self, status: int, text: str, headers: tuple[tuple[str, str], ...] = ()) -> _WebReply:
        page = f"<!doctype html><meta charset=utf-8><title>{status}</title><p>{_html(text)}</p>"
        return _WebReply(status, page.encode(), headers=headers)

    async def _events(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Server-sent events: what runs now and the newest records, whenever they change. One look
        every ``_WEB_LIVE`` seconds serves every listening page. A page that left is noticed at once
        (its end of the connection closes), and one gone without a word by a comment every 15 s."""
        head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n\r\nretry: 2000\n\n"
        writer.write(head.encode())
        queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=8)
        self._listeners.add(queue)
        if self._watch is None or self._watch.done():
            self._watch = asyncio.ensure_future(self._look())
        elif self._last_told:
            queue.put_nowait(self._last_told)
        gone = asyncio.ensure_future(reader.read(1))  # (a page sends nothing more: this ends when it leaves)
        told: asyncio.Future[bytes] | None = None
        try:
            while not gone.done():
                told = told or asyncio.ensure_future(queue.get())
                await asyncio.wait((told, gone), timeout=15.0, return_when=asyncio.FIRST_COMPLETED)
                if not told.done():
                    writer.write(b": still here\n\n")
                elif told.result():
                    writer.write(b"data: " + told.result() + b"\n\n")
                    told = None
                else:
                    return  # (the page is closing)
                await writer.drain()
        finally:
            self._listeners.discard(queue)
            for future in (told, gone):
                if future is not None:
                    future.cancel()

    async def _look(self) -> None:
        while self._listeners:
            try:
                told = await self._live()
            except StoreError as exc:
                _log.warning("status page: %s", exc)
                told = b""
            if told and told != self._last_told:
                self._last_told = told
                for queue in list(self._listeners):
                    with contextlib.suppress(asyncio.QueueFull):
                        queue.put_nowait(told)
            await asyncio.sleep(_WEB_LIVE)


###############################################################################
# The status page #############################################################
###############################################################################
#
# Every job, every run on a timeline, what runs now, live, in a browser: an HTTP server on the
# event loop (standard library only), pages without external assets that read without JavaScript,
# the same data as JSON, and control only when asked for, with a token.

_WEB_JOBS_A_PAGE = 100
_WEB_SPANS = {"1h": 3_600_000, "1d": 86_400_000, "1w": 604_800_000}  # the timeline's stretches (ms)
_WEB_WIDTH = 840  # the timeline's drawing, in pixels (after the names' column)
_WEB_ACTIONS = ("trigger", "pause", "resume", "cancel")
_WEB_COLOURS = {
    "succeeded": "#2e9e4f",
    "failed": "#d63b3b",
    "timed_out": "#e8891c",
    "interrupted": "#8e5bd0",
    "cancelled": "#7d7d7d",
    "skipped": "#c4c4c4",
    "missed": "#e3c325",
    "running": "#2f7fd6",
    "pending": "#9cc4ee",
}
_WEB_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:.5em 1em;display:flex;gap:1.5em;align-items:baseline;flex-wrap:wrap}
header a{color:#cfd8dc;text-decoration:none}header a.on{color:#fff;font-weight:600}
header .store{margin-left:auto;font-size:12px;color:#90a4ae;word-break:break-all}
main{padding:1em;overflow-x:auto}table{border-collapse:collapse;background:#fff;min-width:60%}
th,td{padding:.25em .6em;border-bottom:1px solid #e0e0e0;text-align:left;vertical-align:top}
th{background:#eceff1;font-weight:600}.mark{display:inline-block;width:9px;height:9px;margin-right:2px;border-radius:2px}
.s{padding:0 .4em;border-radius:3px;color:#fff;font-size:12px;white-space:nowrap}
pre{white-space:pre-wrap;word-break:break-all;max-width:90ch;margin:.2em 0;font-size:12px;background:#f3f3f3;padding:.4em}
progress{width:12em}.muted{color:#777}.pages a{margin-right:.8em}form{display:inline}
button{margin-right:.3em}#live{font-size:12px;color:#90a4ae}
"""
_WEB_SCRIPT = """
(function(){
function when(t){var d=new Date(t.getAttribute('datetime'));if(!isNaN(d)){t.title=t.textContent;t.textContent=d.toLocaleString();}}
function times(root){root.querySelectorAll('time[datetime]').forEach(when);}
function axis(root){root.querySelectorAll('svg text[data-t]').forEach(function(e){var d=new Date(+e.getAttribute('data-t'));
 var hm=d.toLocaleTimeString([],{hour:'2-digit',minute:'2-digit'});e.textContent=e.getAttribute('data-day')?d.toLocaleDateString()+' '+hm:hm;});}
times(document);axis(document);
if(!window.EventSource)return;
var colours=JSON.parse(document.body.getAttribute('data-colours'));
function cell(tr,text,cls){var td=document.createElement('td');if(cls)td.className=cls;td.textContent=text;tr.appendChild(td);return td;}
function status(td,s){td.textContent='';var b=document.createElement('span');b.className='s';b.textContent=s;b.style.background=colours[s]||'#555';td.appendChild(b);}
function stamp(td,iso){if(!iso){td.textContent='-';return;}var t=document.createElement('time');t.setAttribute('datetime',iso);
 t.textContent=new Date(iso).toISOString().replace('T',' ').slice(0,19)+' UTC';td.textContent='';td.appendChild(t);when(t);}
function progress(td,p){if(!p)return;var g=document.createElement('progress');if(p[1]){g.max=p[1];g.value=Math.min(p[0],p[1]);}td.appendChild(g);
 td.appendChild(document.createTextNode(' '+(p[1]?Math.round(100*Math.min(1,p[0]/p[1]))+'% ('+p[0]+'/'+p[1]+')':p[0]+' done')));}
function running(rows){var body=document.getElementById('running');if(!body)return;var job=body.getAttribute('data-job');body.textContent='';
 rows.forEach(function(r){if(job&&r.job!==job)return;var tr=document.createElement('tr');tr.setAttribute('data-run',r.job+'/'+r.slot);
 cell(tr,r.job);cell(tr,String(r.attempt));status(cell(tr,''),r.state);cell(tr,r.owner||'-');stamp(cell(tr,''),r.started_at);progress(cell(tr,'','p'),r.progress);body.appendChild(tr);});}
function recent(records){var body=document.getElementById('recent');var seen={};
 records.forEach(function(r){var row=document.querySelector('tr[data-job="'+CSS.escape(r.job)+'"]');
  if(row&&!seen[r.job]){seen[r.job]=1;var last=row.querySelector('td.last');if(last){status(last,r.status);}var at=row.querySelector('td.at');if(at)stamp(at,r.started_at||r.scheduled_at);}});
 if(!body)return;var job=body.getAttribute('data-job');var known={};body.querySelectorAll('tr[data-key]').forEach(function(tr){known[tr.getAttribute('data-key')]=tr;});
 records.slice().reverse().forEach(function(r){if(job&&r.job!==job)return;var key=r.job+'/'+r.slot+'/'+r.attempt;var tr=document.createElement('tr');tr.setAttribute('data-key',key);
  cell(tr,r.job);stamp(cell(tr,''),r.scheduled_at);cell(tr,String(r.attempt));status(cell(tr,''),r.status);cell(tr,r.instance||'-');stamp(cell(tr,''),r.started_at);
  cell(tr,r.duration==null?'-':r.duration.toFixed(2)+'s');var e=cell(tr,'');if(r.error){var p=document.createElement('pre');p.textContent=r.error;e.appendChild(p);}
  if(r.output){var d=document.createElement('details'),s=document.createElement('summary'),o=document.createElement('pre');
   s.textContent='output';o.textContent=r.output;d.appendChild(s);d.appendChild(o);e.appendChild(d);}
  tr.setAttribute('data-status',r.status);
  if(known[key]){if(known[key].getAttribute('data-status')!==r.status)body.replaceChild(tr,known[key]);}else{body.insertBefore(tr,body.firstChild);}});}
var source=new EventSource('/events');
var live=document.getElementById('live');
source.onopen=function(){if(live)live.textContent='live';};
source.onerror=function(){if(live)live.textContent='reconnecting';};
var drawn=Date.now();
source.onmessage=function(m){var d=JSON.parse(m.data);running(d.running);recent(d.recent);
 var svg=document.getElementById('timeline');if(!svg||svg.busy||Date.now()-drawn<5000)return;svg.busy=1;drawn=Date.now();
 fetch(location.pathname+location.search+(location.search?'&':'?')+'svg=1').then(function(r){return r.ok?r.text():null;})
 .then(function(t){if(t){svg.innerHTML=t;axis(svg);}svg.busy=0;},function(){svg.busy=0;});};
})();
"""


def _shown_store(path: str) -> str:
    """Where the state lives, as a page may show it: a URL without its password."""
    if _is_postgres(path):
        try:
            return _PGTarget.parse(path).shown
        except ConfigError:
            return "postgresql://…"
    return path


class StatusPage(_PageServer):
    """The status page of a store, served over HTTP: every job, a timeline of runs, what runs now
    with its progress, a job's history and output, the processes; live in a browser (server-sent
    events), readable without JavaScript, and the same data as JSON under ``/api/``.

    ``scheduler`` is any ``Scheduler`` of the store: a running one (the page lives in that process)
    or one made only to look (``Scheduler(path, read_only=True)``). The page binds to loopback by
    default; any other address needs ``token``, which every request must then carry (``?token=``
    once, then a session cookie made of it; or ``Authorization: Bearer``). ``control=True`` (also
    with a token) adds buttons for trigger, pause, resume and cancel, each logged with who asked.

    ``await page.start()`` listens (``page.url`` says where); ``await page.close()`` stops;
    ``async with StatusPage(scheduler) as page:`` does both.
    """

    def __init__(
        self, scheduler: Scheduler, listen: str = "127.0.0.1:8080", *, token: str | None = None, control: bool = False
    ):
        super().__init__(listen, token)
        if control and token is None:
            raise ConfigError("control (trigger, pause, resume, cancel) needs a token", option="control")
        self.scheduler = scheduler  #: what the page reads (and, with control, changes)
        self._control = control
        self._status: tuple[float, list[JobStatus]] | None = None  #: the newest status, and when it was read
        self._drawn: dict[str, tuple[float, str]] = {}  #: timelines drawn lately, by their query

    async def _answer(self, request: _WebRequest) -> _WebReply:
        refused = self._allowed(request)
        if refused is not None:
            return refused
        if "token" in request.query and request.method in ("GET", "HEAD"):  # a session cookie, out of the address
            import urllib.parse

            rest = urllib.parse.urlencode({k: v for k, v in request.query.items() if k != "token"})
            cookie = f"{_WEB_COOKIE}={self._secret(b'session')}; HttpOnly; SameSite=Strict; Path=/"
            location = _local(request.path + (f"?{rest}" if rest else ""))
            return _WebReply(303, b"", headers=(("Location", location), ("Set-Cookie", cookie)))
        parts = request.parts
        if request.method == "POST":
            if parts == ("control",):
                return await self._act(request)
            return self._problem(405 if self._route(parts) else 404, "no such page")
        if request.method not in ("GET", "HEAD"):
            return self._problem(405, "only GET (and POST for control)", headers=(("Allow", "GET, HEAD"),))
        page = self._route(parts)
        if page is None:
            return self._problem(404, "no such page")
        return await page(request, *parts[1:])

    def _route(self, parts: tuple[str, ...]) -> Callable[..., Awaitable[_WebReply]] | None:
        pages: dict[tuple[str, int], Callable[..., Awaitable[_WebReply]]] = {
            ("", 1): self._jobs_page,
            ("timeline", 1): self._timeline_page,
            ("running", 1): self._running_page,
            ("processes", 1): self._processes_page,
            ("job", 2): self._job_page,
            ("job", 1): self._job_page,  # (?name=: the names "." and "..", which no path can carry)
            ("api", 2): self._api,
        }
        return pages.get((parts[0], len(parts)))

    # -- the data ---------------------------------------------------------------------------------

    async def _jobs(self) -> list[JobStatus]:
        """Every job's status, read at most once a second whatever the number of pages asking."""
        now = time.monotonic()
        if self._status is None or now - self._status[0] > 1.0:
            self._status = (now, await self.scheduler.status())
        return self._status[1]

    async def _running(self) -> list[RunInfo]:
        rows = await self.scheduler._link.call(lambda store: store.runs())
        now = time.time()
        return [_run_info(row, now) for row in rows]

    async def _live(self) -> bytes:
        running, recent = await asyncio.gather(self._running(), self.scheduler.history(None, 20))
        # (without each run's age: what a page is told changes only when a run or a record does)
        shown = {
            "running": [{**_running_json(r), "age": None} for r in running],
            "recent": [_web_record_json(r) for r in recent],
        }
        return json.dumps(shown, separators=(",", ":")).encode()

    async def _act(self, request: _WebRequest) -> _WebReply:
        """A button's form (``job``, ``action``, ``csrf``): trigger, pause, resume or cancel a job."""
        import hmac
        import urllib.parse

        if not self._control:
            return self._problem(403, "this page is read-only: start it with --control and a token to control jobs")
        form = dict(urllib.parse.parse_qsl(request.body.decode("utf-8", "replace")))
        if not hmac.compare_digest(form.get("csrf", "").encode(), self._csrf().encode()):
            return self._problem(403, "the form's token is missing or wrong: reload the page")
        job, action = form.get("job", ""), form.get("action", "")
        if action not in _WEB_ACTIONS:
            return self._problem(400, f"action must be one of {', '.join(_WEB_ACTIONS)}")
        await getattr(self.scheduler, action)(job)
        _log.warning("status page: %s %r, asked from %s", action, job, request.peer)
        self._status = None
        return _WebReply(303, b"", headers=(("Location", _job_href(job)),))

    async def _api(self, request: _WebRequest, what: str) -> _WebReply:
        data: object
        if what == "status":
            jobs, processes = await asyncio.gather(self._jobs(), self.scheduler.processes())
            data = {"jobs": [_status_json(j) for j in jobs], "processes": [_process_json(p) for p in processes]}
        elif what == "history":
            data = [
                _record_json(r) for r in await self.scheduler.history(request.query.get("job"), self._limit(request))
            ]
        elif what == "running":
            data = [_running_json(r) for r in await self._running()]
        elif what == "timeline":
            since, until, span = self._span(request)
            names, _, _ = await self._timeline_jobs(request)
            data = [s._asdict() for s in await self._stretches(names, since, until, span)]
        else:
            return self._problem(404, "no such page")
        return _WebReply(200, json.dumps(data, separators=(",", ":")).encode(), "application/json")

    def _limit(self, request: _WebRequest) -> int:
        return _web_number(request.query.get("limit", "100"), 100_000, "limit")

    def _span(self, request: _WebRequest) -> tuple[int, int, str]:
        span = request.query.get("span", "1h")
        if span not in _WEB_SPANS:
            raise ConfigError(f"span must be one of {', '.join(_WEB_SPANS)}, got {span!r}", option="span")
        until = _ms(time.time())
        return until - _WEB_SPANS[span], until, span

    async def _stretches(self, jobs: list[str], since: int, until: int, span: str) -> list[_Stretch]:
        part = _WEB_SPANS[span] // (_WEB_WIDTH // 2)
        return await self.scheduler._link.call(lambda store: store.timeline(jobs, since, until, part))

    async def _timeline(self, names: list[str], since: int, until: int, span: str) -> str:
        """The timeline of ``names``, drawn again only once a bar may have grown by a pixel or so
        (every 4 s over an hour, every 60 s over a day): each listening page asks for it at each
        change, and a day of a job every second takes 100-130 ms to draw."""
        key = f"{span} {names}"
        now = time.monotonic()
        drawn = self._drawn.get(key)
        if drawn is None or now - drawn[0] > min(60.0, _WEB_SPANS[span] / _WEB_WIDTH / 1000):
            stretches, running = await asyncio.gather(self._stretches(names, since, until, span), self._running())
            drawn = self._drawn[key] = (now, _timeline_svg(names, stretches, running, since, until))
            for old in [k for k, (at, _) in self._drawn.items() if now - at > 120]:
                del self._drawn[old]
        return drawn[1]

    async def _timeline_jobs(self, request: _WebRequest) -> tuple[list[str], int, int]:
        """The jobs a timeline shows (``?job=NAME``: that one; else a page of 50), its page and pages."""
        names = [job.name for job in await self._jobs()]
        if "job" in request.query:
            if request.query["job"] not in names:
                raise JobNotFound("no such job in the store", job=request.query["job"])
            return [request.query["job"]], 0, 1
        number, pages = self._page_number(request, len(names), 50)
        return names[number * 50 : (number + 1) * 50], number, pages

    # -- pages ------------------------------------------------------------------------------------

    def _page(self, title: str, here: str, body: str) -> _WebReply:
        links = "".join(
            f'<a href="{href}"{" class=on" if name == here else ""}>{name}</a>'
            for name, href in (
                ("jobs", "/"),
                ("timeline", "/timeline"),
                ("running", "/running"),
                ("processes", "/processes"),
            )
        )
        store = _html(_shown_store(self.scheduler.path))
        nonce = os.urandom(12).hex()
        colours = _html(json.dumps(_WEB_COLOURS))
        page = (
            f"<!doctype html><html lang=en><meta charset=utf-8><meta name=viewport content='width=device-width'>"
            f"<title>{_html(title)} · anarchon_lite</title><style>{_WEB_STYLE}</style>"
            f"<body data-colours='{colours}'><header><b>anarchon_lite</b>{links}"
            f"<span id=live></span><span class=store>{store}</span></header><main>{body}</main>"
            f"<script nonce={nonce}>{_WEB_SCRIPT}</script></body></html>"
        )
        return _WebReply(200, page.encode(), nonce=nonce)

    async def _jobs_page(self, request: _WebRequest) -> _WebReply:

        jobs = await self._jobs()
        number, pages = self._page_number(request, len(jobs), _WEB_JOBS_A_PAGE)
        shown = jobs[number * _WEB_JOBS_A_PAGE : (number + 1) * _WEB_JOBS_A_PAGE]
        names = [job.name for job in shown]
        marks = await self.scheduler._link.call(lambda store: {name: store.history(name, 10) for name in names})
        rows = []
        for job in shown:
            href = _job_href(job.name)
            # (when the next occurrence starts, its jitter included, as ``status`` shows it)
            following = None if job.paused or job.undeclared else job.next_start or job.next_at
            last = "".join(
                f'<span class=mark style="background:{_WEB_COLOURS.get(r.status, "#555")}" title="{_html(r.status)}"></span>'
                for r in reversed(marks.get(job.name, []))
            )
            runs = "<br>".join(
                f"attempt {r.attempt} {_html(r.state)} on {_html(r.owner or '-')} {_web_progress(r.progress)}"
                for r in job.runs
            )
            rows.append(
                f'<tr data-job="{_html(job.name)}"><td><a href="{_html(href)}">{_html(job.name)}</a></td>'
                f"<td>{_html(job.state)}</td><td>{_html(job.schedule)}</td><td>{_web_time(following)}</td>"
                f"<td class=last>{_web_status(job.last_status)}</td><td class=at>{_web_time(job.last_at)}</td>"
                f"<td>{last}</td><td>{runs}</td><td>{_html(job.declared_by or '-')}</td></tr>"
            )
        table = (
            "<table><thead><tr><th>job</th><th>state</th><th>schedule</th><th>next</th><th>result</th>"
            "<th>last</th><th>last runs</th><th>running</th><th>declared by</th></tr></thead><tbody>"
            + "".join(rows)
            + "</tbody></table>"
        )
        body = (
            f"<h2>{len(jobs)} job{'' if len(jobs) == 1 else 's'}</h2>{table}{self._pager('/', number, pages, request)}"
        )
        return self._page("jobs", "jobs", body)

    def _page_number(self, request: _WebRequest, count: int, size: int) -> tuple[int, int]:
        pages = max(1, -(-count // size))
        return _web_number(request.query.get("page", "1"), pages, "page") - 1, pages

    def _pager(self, path: str, number: int, pages: int, request: _WebRequest) -> str:
        import urllib.parse

        if pages == 1:
            return ""
        links = []
        for label, target in (
            ("« first", 0),
            ("‹ previous", number - 1),
            ("next ›", number + 1),
            ("last »", pages - 1),
        ):
            if 0 <= target < pages and target != number:
                query = urllib.parse.urlencode({**request.query, "page": target + 1})
                links.append(f'<a href="{_html(path)}?{_html(query)}">{label}</a>')
        return f"<p class=pages>page {number + 1} of {pages} {''.join(links)}</p>"

    async def _timeline_page(self, request: _WebRequest) -> _WebReply:
        import urllib.parse

        since, until, span = self._span(request)
        names, number, pages = await self._timeline_jobs(request)
        svg = await self._timeline(names, since, until, span)
        if request.query.get("svg"):
            return _WebReply(200, svg.encode(), "image/svg+xml")
        choices = " ".join(
            f'<a href="/timeline?{_html(urllib.parse.urlencode({**request.query, "span": name}))}"'
            f"{' class=on' if name == span else ''}>{name}</a>"
            for name in _WEB_SPANS
        )
        legend = " ".join(
            f'<span class=mark style="background:{colour}"></span>{name}' for name, colour in _WEB_COLOURS.items()
        )
        body = (
            f"<h2>runs of the last {span}</h2><p>{choices}</p><p class=muted>{legend}</p>"
            f"<div id=timeline>{svg}</div>{self._pager('/timeline', number, pages, request)}"
        )
        return self._page("timeline", "timeline", body)

    async def _running_page(self, request: _WebRequest) -> _WebReply:
        running = await self._running()
        body = f"<h2>running and waiting now</h2>{_running_table(running)}"
        return self._page("running", "running", body)

    async def _processes_page(self, request: _WebRequest) -> _WebReply:
        processes = await self.scheduler.processes()
        rows = "".join(
            f"<tr><td>{_html(p.instance)}</td><td>{p.pid or '-'}</td><td>{_html(p.host or '-')}</td>"
            f"<td>{_web_time(p.started_at)}</td><td>{'-' if p.jobs is None else p.jobs}</td></tr>"
            for p in processes
        )
        table = (
            "<table><thead><tr><th>process</th><th>pid</th><th>host</th><th>since</th><th>jobs</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>"
        )
        body = f"<h2>{len(processes)} process{'' if len(processes) == 1 else 'es'} on the store</h2>{table}"
        return self._page("processes", "processes", body)

    async def _job_page(self, request: _WebRequest, name: str | None = None) -> _WebReply:
        import urllib.parse

        name = request.query.get("name", "") if name is None else name
        jobs = await self._jobs()
        job = next((j for j in jobs if j.name == name), None)
        if job is None:
            self._status = None  # (a job declared since the status was read)
            job = next((j for j in await self._jobs() if j.name == name), None)
        if job is None:
            return self._problem(404, f"no job {name!r} in the store")
        records, running = await asyncio.gather(self.scheduler.history(name, 1000), self._running())
        number, pages = self._page_number(request, len(records), 100)
        upcoming = _web_upcoming(job)
        spans = " ".join(
            f'<a href="/timeline?{_html(urllib.parse.urlencode({"job": name, "span": span}))}">{span}</a>'
            for span in _WEB_SPANS
        )
        facts = (
            f"<table><tr><th>schedule</th><td>{_html(job.schedule)}</td></tr>"
            f"<tr><th>state</th><td>{_html(job.state)}</td></tr>"
            f"<tr><th>next</th><td>{'<br>'.join(_web_time(t) for t in upcoming) or '-'}</td></tr>"
            f"<tr><th>declared by</th><td>{_html(job.declared_by or '-')}</td></tr>"
            f"<tr><th>declared as</th><td>{_html(job.definition or '-')}</td></tr>"
            f"<tr><th>timeline</th><td>{spans}</td></tr></table>"
        )
        buttons = ""
        if self._control:
            fields = f'<input type=hidden name=csrf value="{self._csrf()}"><input type=hidden name=job value="{_html(name)}">'
            buttons = (
                "<p>"
                + "".join(
                    f'<form method=post action="/control">{fields}<button name=action value={action}>{action}</button></form>'
                    for action in _WEB_ACTIONS
                )
                + "</p>"
            )
        mine = [r for r in running if r.job == name]
        saved = [(r.slot, await self.scheduler.checkpoints.get(name, r.slot)) for r in mine]
        checkpoints = "".join(
            f"<tr><th>{_web_time(_utc_from_ms(slot))}</th><td><pre>{_html(json.dumps(value))}</pre></td></tr>"
            for slot, value in saved
            if value is not None
        )
        shown = records[number * 100 : (number + 1) * 100]
        body = (
            f"<h2>{_html(name)}</h2>{buttons}{facts}<h3>running and waiting</h3>{_running_table(mine, name)}"
            + (f"<h3>checkpoints of the unfinished runs</h3><table>{checkpoints}</table>" if checkpoints else "")
            + f"<h3>history ({'the newest ' if len(records) == 1000 else ''}{len(records)} record"
            f"{'' if len(records) == 1 else 's'})</h3>{_records_table(shown, name if number == 0 else None)}"
            f"{self._pager(request.path, number, pages, request)}"
        )
        return self._page(name, "", body)


def _job_href(name: str) -> str:
    """A job's page: its name as one segment of the path (``/`` in it too), or, for the names
    ``.`` and ``..`` that a browser would take for steps between folders, as ``?name=``."""
    import urllib.parse

    if name in (".", ".."):
        return "/job?" + urllib.parse.urlencode({"name": name})
    return "/job/" + urllib.parse.quote(name, safe="")


def _web_time(moment: _dt.datetime | None) -> str:
    """A time for a page: UTC in the HTML, the viewer's zone once the script runs (UTC on hover)."""
    if moment is None:
        return "-"
    utc = moment.astimezone(_UTC)
    return f'<time datetime="{utc.isoformat()}">{utc.strftime("%Y-%m-%d %H:%M:%S UTC")}</time>'


def _web_status(status: str | None) -> str:
    if status is None:
        return "-"
    return f'<span class=s style="background:{_WEB_COLOURS.get(status, "#555")}">{_html(status)}</span>'


def _web_progress(progress: tuple[float, float | None] | None) -> str:
    if progress is None:
        return ""
    done, total = progress
    if not total:
        return f"{done:g} done"
    share = max(0.0, min(1.0, done / total))
    return f"<progress max={total:g} value={min(done, total):g}></progress> {share:.0%} ({done:g}/{total:g})"


def _web_upcoming(job: JobStatus, count: int = 5) -> list[_dt.datetime]:
    """The next occurrences of a job, from its stored schedule (none if it cannot be read)."""
    if job.paused or job.undeclared:
        return []
    try:
        return _schedule_from(job.schedule, job.name).following(_ms(time.time()), count)
    except ConfigError:
        return [job.next_at] if job.next_at else []


def _took(record: RunRecord) -> float | None:
    """How long a record's attempt took, in seconds (None while it runs, or for one that never ran)."""
    if record.started_at is None or record.finished_at is None:
        return None
    return (record.finished_at - record.started_at).total_seconds()


def _running_json(run: RunInfo) -> dict[str, Any]:
    return {**dataclasses.asdict(run), "started_at": run.started_at.isoformat() if run.started_at else None}


def _web_record_json(record: RunRecord) -> dict[str, Any]:
    """A record as the live pages take it: as ``history --json``, with its duration, the output's tail."""
    fields = _record_json(record)
    fields["output"] = None if record.output is None else record.output[-1000:]
    return {**fields, "duration": _took(record)}


def _running_table(running: list[RunInfo], job: str = "") -> str:
    rows = "".join(
        f'<tr data-run="{_html(r.job)}/{r.slot}"><td>{_html(r.job)}</td><td>{r.attempt}</td><td>{_web_status(r.state)}</td>'
        f"<td>{_html(r.owner or '-')}</td><td>{_web_time(r.started_at)}</td><td class=p>{_web_progress(r.progress)}</td></tr>"
        for r in running
    )
    return (
        "<table><thead><tr><th>job</th><th>attempt</th><th>state</th><th>process</th><th>started</th>"
        f'<th>progress</th></tr></thead><tbody id=running data-job="{_html(job)}">{rows}</tbody></table>'
    )


def _records_table(records: list[RunRecord], job: str | None = "") -> str:
    """The records as a table; live (new ones added as they come) for ``job``, or every job with "",
    or not at all with None (a page of older records)."""
    rows = []
    for r in records:
        took = _took(r)
        duration = "-" if took is None else f"{took:.2f}s"
        error = f"<pre>{_html(r.error)}</pre>" if r.error else ""
        output = f"<details><summary>output</summary><pre>{_html(r.output[-1000:])}</pre></details>" if r.output else ""
        rows.append(
            f'<tr data-key="{_html(r.job)}/{r.slot}/{r.attempt}" data-status="{_html(r.status)}"><td>{_html(r.job)}</td>'
            f"<td>{_web_time(r.scheduled_at)}</td>"
            f"<td>{r.attempt}</td><td>{_web_status(r.status)}</td><td>{_html(r.instance or '-')}</td>"
            f"<td>{_web_time(r.started_at)}</td><td>{duration}</td><td>{error}{output}</td></tr>"
        )
    live = "" if job is None else f' id=recent data-job="{_html(job)}"'
    return (
        "<table><thead><tr><th>job</th><th>scheduled</th><th>attempt</th><th>status</th><th>process</th>"
        f"<th>started</th><th>took</th><th>error, output</th></tr></thead><tbody{live}>{''.join(rows)}</tbody></table>"
    )


def _timeline_svg(names: list[str], stretches: list[_Stretch], running: list[RunInfo], since: int, until: int) -> str:
    """One row a job, a bar a stretch of records (the running attempts to now), coloured by status;
    the process and times on hover."""
    label, row, width = 180, 20, _WEB_WIDTH
    scale = width / (until - since)
    y_of = {name: 24 + n * row for n, name in enumerate(names)}
    parts = []
    for n in range(7):  # the axis: seven times across the stretch
        at = since + (until - since) * n // 6
        x = label + (at - since) * scale
        anchor = "start" if n == 0 else "end" if n == 6 else "middle"
        text = _utc_from_ms(at).strftime("%H:%M")
        parts.append(
            f'<line x1="{x:.1f}" y1="16" x2="{x:.1f}" y2="{24 + len(names) * row}" stroke="#ddd"/>'
            f'<text x="{x:.1f}" y="12" font-size="11" text-anchor="{anchor}" data-t="{at}"'
            f"{' data-day=1' if until - since > 86_400_000 else ''}>{text}</text>"
        )
    for name, y in y_of.items():
        parts.append(f'<text x="0" y="{y + 13}" font-size="12">{_html(name[:28])}<title>{_html(name)}</title></text>')
    bars = [
        (s.job, s.status, s.start_ms, max(s.end_ms, s.start_ms), s.records, s.attempt, s.instance) for s in stretches
    ]
    now = _ms(time.time())
    for r in running:
        if r.started_at is not None and r.state == "running":
            bars.append((r.job, "running", _ms_from_dt(r.started_at), now, 1, r.attempt, r.owner))
    for job, status, start, end, records, attempt, instance in bars:
        top = y_of.get(job)
        if top is None or end < since:
            continue
        x = label + (max(start, since) - since) * scale
        w = max(2.0, (min(end, until) - max(start, since)) * scale)
        what = f"{job}: {records} {status}" if records > 1 else f"{job}: {status}, attempt {attempt}"
        when = (
            f"{_utc_from_ms(start).isoformat(timespec='seconds')} to {_utc_from_ms(end).isoformat(timespec='seconds')}"
        )
        parts.append(
            f'<rect x="{x:.1f}" y="{top + 2}" width="{w:.1f}" height="{row - 6}" fill="{_WEB_COLOURS.get(status, "#555")}">'
            f"<title>{_html(what)} on {_html(instance or '-')}, {when} UTC</title></rect>"
        )
    height = 30 + len(names) * row
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{label + width + 10}" height="{height}" '
        f'font-family="system-ui,sans-serif">{"".join(parts)}</svg>'
    )


async def serve_status_page(
    path: PathLike, listen: str = "127.0.0.1:8080", *, token: str | None = None, control: bool = False
) -> None:
    """Serve the status page of the store at ``path`` (a file or a URL) until cancelled, from a
    process of its own: read-only connections unless ``control``."""
    scheduler = Scheduler(path, read_only=not control)
    page = StatusPage(scheduler, listen, token=token, control=control)
    try:
        await page.start()
        _log.warning(
            "status page of %s on %s%s", _shown_store(scheduler.path), page.url, " (with control)" if control else ""
        )
        await asyncio.Event().wait()
    finally:
        await page.close()
        scheduler.close()


###############################################################################
# Shell commands in process groups ############################################
###############################################################################


_OUTPUT_TAIL = 4096


class CommandFailed(_PlainFailure):
    """A crontab command exited with a non-zero code, or a signal ended it (a negative ``code``, as
    ``subprocess`` has it); ``output`` is the tail of what it printed."""

    def __init__(self, code: int, output: str):
        super().__init__(_exit_text(code))
        self.code, self.output = code, output


def _exit_text(code: int) -> str:
    """``exit code 3``, or ``killed by SIGTERM`` for -15."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def command_handler(
    command: str, env: dict[str, str] | None = None, on_failure: str | None = None, *, inherit_env: bool = True
) -> Callable[[RunContext], Awaitable[str]]:
    """A handler that runs ``$SHELL -c command`` in a process group of its own, one copy at a time:
    what ``crontab`` declares for each entry, for a front end of one's own.

    ``env`` is added to this process's environment, or with ``inherit_env=False`` to a minimal one
    as cron gives (``_command_environment``); ``SHELL`` in it names the shell (default ``/bin/sh``),
    and the command's ``SHELL`` is always that shell. The run's ``ANARCHON_*`` variables are added. Before it starts, the process group of an earlier attempt of the same run (a
    takeover after a crash) is ended if it still lives on this host. The command waits at a gate
    until its group is recorded with the run, and a reaper outside the group ends the group if this
    process dies. The run ends when the shell exits; what it leaves in its group is ended and the
    output says so. An abort (timeout, cancel, shutdown) sends SIGTERM to the group, then SIGKILL
    after 5 s. A non-zero exit raises ``CommandFailed``; the handler returns the end of the
    output (kept with the record). ``on_failure``: a command run after every attempt that failed
    or timed out (the crontab runs its ``# on_failure:`` command as the job's ``on_failure``
    instead: once, when the run has failed for good).
    """
    extra = {} if env is None else dict(env)
    shell = extra.get("SHELL", "/bin/sh")

    me = _this_owner("")  # this process: its boot and pid namespace say where a recorded group can be seen
    hooks: set[asyncio.Task[None]] = set()  # on_failure commands still running

    def after_failure(ctx: RunContext, status: str, code: int | None, output: str) -> None:
        if on_failure is not None:
            error = _exit_text(code) if status == "failed" and code is not None else status
            record = RunRecord(ctx.job, ctx.slot, ctx.attempt, status, ctx.instance, None, None, error, output)
            task = asyncio.ensure_future(
                _run_on_failure(on_failure, _command_environment(extra, inherit_env), record, code)
            )
            hooks.add(task)
            task.add_done_callback(hooks.discard)

    async def run_command(ctx: RunContext) -> str:
        nonce = os.urandom(16).hex()  # this attempt's, kept in its process-group record
        variables = {
            **_command_environment(extra, inherit_env),
            "ANARCHON_JOB": ctx.job,
            "ANARCHON_SLOT": str(ctx.slot),
            "ANARCHON_ATTEMPT": str(ctx.attempt),
            "ANARCHON_SCHEDULED_AT": ctx.scheduled_at.isoformat(),
            "ANARCHON_RUN": _run_marker(ctx.job, ctx.slot, nonce),
        }
        await _end_previous_group(ctx, me)
        proc, exited = await _spawn(
            ("/bin/sh", "-c", _GATE, shell, command),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=variables,
            start_new_session=True,
        )
        reaper: asyncio.subprocess.Process | None = None
        tail = bytearray()
        reader = asyncio.ensure_future(_read_tail(proc, tail))
        try:
            claim, owner = ctx._attempt.claim, ctx._attempt.owner
            record = _group_record(proc.pid, me, nonce)
            if not await ctx._store(lambda s: s.set_process_group(claim, owner, record)):
                raise LeaseLost(f"{ctx.job}: the run was taken over before its command started")
            reaper = await _start_reaper(proc.pid, variables["ANARCHON_RUN"])
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")  # through the gate
            proc.stdin.close()
            code, left = await _wait_command(ctx, proc, exited, reader, variables["ANARCHON_RUN"])
        finally:
            if not exited.done():
                _kill_group(proc.pid, signal.SIGKILL)
                await exited
            reader.cancel()
            if reaper is not None:
                await _stop_reaper(reaper)
        output = bytes(tail).decode(errors="replace")
        if left:
            output = (output + f"\nanarchon-lite: the command left {left} in its process group; ended them\n")[
                -_OUTPUT_TAIL:
            ]
        if isinstance(ctx.signal.reason, RunTimeout):
            after_failure(ctx, "timed_out", code, output)
        ctx.signal.throw_if_aborted()
        if code != 0:
            after_failure(ctx, "failed", code, output)
            raise CommandFailed(code, output)
        return output

    return run_command


# The command's first process: it waits for one line on stdin ("go", once its process group is
# recorded with the run), then becomes ``$SHELL -c COMMAND`` with stdin from /dev/null. If the
# scheduler dies first, the line never comes and the command never starts.
_GATE = 'read -r go && [ "$go" = go ] || exit 125; exec "$0" -c "$1" </dev/null'
# Outside the command's group: when the scheduler lets go of its stdin without saying "done" first,
# which is what its death does (kill -9, the OOM killer included), it ends what the command started:
# each process of this user with the run's marker (``$1``) in its environment, and the group (``$0``)
# when one of them is in it; SIGTERM, then SIGKILL 5 s later (as ``_end_run``, in sh).
_REAPER = (
    'read -r word; [ "$word" = done ] && exit 0; '
    "for s in TERM KILL; do "
    "g= any=; "
    'for f in $(grep -lsaF "ANARCHON_RUN=$1" /proc/[0-9]*/environ); do '
    '[ -O "$f" ] || continue; p="${f#/proc/}"; p="${p%/environ}"; '
    'st=$(cat "/proc/$p/stat" 2>/dev/null) || continue; set -- "$1" ${st##*") "}; '
    '[ "$4" = "$0" ] && g=1; kill -s "$s" "$p" 2>/dev/null && any=1; '
    "done; "
    '[ -n "$g" ] && kill -s "$s" -- "-$0" 2>/dev/null; '
    '[ -z "$any" ] && exit 0; [ "$s" = TERM ] && sleep 5; '
    "done; exit 0"
)
_GROUP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL for an aborted command's process group


_ON_FAILURE_TIMEOUT = 60.0  # seconds an on_failure command may take before its group is ended
_CRON_PATH = "/usr/bin:/bin"  # the PATH cron gives commands (Vixie cron, cronie)


def _command_environment(extra: dict[str, str], inherit: bool) -> dict[str, str]:
    """What a crontab command (and its ``on_failure`` command) starts with, before its run's
    ``ANARCHON_*`` variables: this process's environment, or (``inherit`` false) what cron gives,
    ``PATH=/usr/bin:/bin`` and this user's ``HOME``, ``LOGNAME`` and ``USER``; then the crontab's
    own variables (``extra``). ``SHELL`` names the shell that runs it, whatever this process's
    ``SHELL`` says."""
    if inherit:
        base = dict(os.environ)
    else:
        import pwd

        try:
            user = pwd.getpwuid(os.geteuid())
            name, home = user.pw_name, user.pw_dir
        except KeyError:  # (a uid with no entry, in a container)
            name, home = str(os.geteuid()), "/"
        base = {"PATH": _CRON_PATH, "HOME": home, "LOGNAME": name, "USER": name}
    return {**base, **extra, "SHELL": extra.get("SHELL", "/bin/sh")}


def _failure_command(command: str, env: dict[str, str]) -> Callable[[RunRecord], Awaitable[None]]:
    """A crontab entry's ``# on_failure: COMMAND``, as the job's ``on_failure`` (``env``: its whole
    environment, from ``_command_environment``)."""

    async def run(record: RunRecord) -> None:
        await _run_on_failure(command, env, record, _exit_code(record.error))

    return run


def _exit_code(error: str | None) -> int | None:
    """The exit code an ``_exit_text`` says (``exit code 3``: 3; ``killed by SIGTERM``: -15), or None."""
    said = re.fullmatch(r"exit code (-?[0-9]+)|killed by (?:SIG([A-Z0-9]+)|signal ([0-9]+))", error or "")
    if said is None:
        return None
    code, name, number = said.groups()
    if code is not None:
        return int(code)
    return -int(number) if number is not None else -int(getattr(signal, f"SIG{name}", 0))


async def _run_on_failure(command: str, env: dict[str, str], record: RunRecord, code: int | None) -> None:
    """Run a crontab entry's ``on_failure`` command: in ``env`` (its whole environment) with the
    failed run's variables, its output's tail on its stdin, ended after ``_ON_FAILURE_TIMEOUT``;
    what goes wrong is logged."""
    where = {"job": record.job, "slot": record.slot, "attempt": record.attempt}
    log = _JobLog(logging.getLogger(f"anarchon_lite.job.{record.job}"), where)
    variables = {
        **env,
        "ANARCHON_JOB": record.job,
        "ANARCHON_SLOT": str(record.slot),
        "ANARCHON_ATTEMPT": str(record.attempt),
        "ANARCHON_SCHEDULED_AT": record.scheduled_at.isoformat(),
        "ANARCHON_STATUS": record.status,
        "ANARCHON_EXIT_CODE": "" if code is None else str(code),
        "ANARCHON_ERROR": record.error or record.status,
    }
    output = record.output or ""
    try:
        proc = await asyncio.create_subprocess_exec(
            env.get("SHELL", "/bin/sh"),
            "-c",
            command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=variables,
            start_new_session=True,
        )
    except OSError as exc:
        log.warning("on_failure: cannot start %r: %s", command, exc)
        return
    try:
        said, _ = await asyncio.wait_for(proc.communicate(output.encode(errors="replace")), _ON_FAILURE_TIMEOUT)
    except asyncio.TimeoutError:
        _kill_group(proc.pid, signal.SIGKILL)
        await proc.wait()
        log.warning("on_failure: %r did not end within %s: ended", command, format_duration(_ON_FAILURE_TIMEOUT))
        return
    if proc.returncode != 0:
        tail = said.decode(errors="replace").strip()[-500:]
        log.warning("on_failure: %r: %s%s", command, _exit_text(proc.returncode or 0), f": {tail}" if tail else "")


async def _end_previous_group(ctx: RunContext, me: _Owner) -> None:
    """Make sure the command of an earlier attempt of this run is gone before starting another: on
    this host, every process of this user that carries the run's marker, and the recorded process
    group when it is proven the run's (same boot, the leader's start time, a member with the
    marker). A record that proves nothing is never signalled; the warning says why."""
    slot, job = ctx.slot, ctx.job
    record = await ctx._store(lambda s: s.process_group(job, slot))
    if record is None:
        return
    group = _parse_group_record(record)
    if group is None:
        ctx.log.warning("the earlier attempt's process-group record is not one this scheduler writes: not signalled")
        return
    if group.get("boot") and me.boot_id and group["boot"] != me.boot_id:
        return  # (another host's or another boot's: gone from here)
    nonce = group.get("run")
    if not isinstance(nonce, str):
        ctx.log.warning("the earlier attempt's process group carries no marker (an older version's): not signalled")
        return
    marker = _run_marker(job, slot, nonce)
    pgid: int | None = group["pgid"]
    if group.get("ns") != me.namespace:
        ctx.log.warning("an earlier attempt's command ran in another pid namespace: its group cannot be checked here")
        pgid = None
    elif not _leader_is(group):
        pgid = None  # (its leader's pid is another process's now)
    left, ours = await asyncio.to_thread(_run_left, pgid, marker)
    if group["pgid"] == pgid and not ours and _group_members(group["pgid"]):
        ctx.log.warning(
            "process group %d, named by the earlier attempt's record, has no process with the run's marker: "
            "not proven this run's, not signalled",
            group["pgid"],
        )
    if not left:
        return
    if ours:
        ctx.log.warning("an earlier attempt's command is still running (process group %d): ending it first", pgid)
    else:
        ctx.log.warning("an earlier attempt's command left processes %s running: ending them first", left)
    if not await _end_run(pgid, marker):
        raise _PlainFailure(f"the command of an earlier attempt (processes {left}) could not be ended")


def _parse_group_record(record: str) -> dict[str, Any] | None:
    """A process-group record (``_group_record``) as a dict with an int ``pgid`` (above 1: 0 and -1
    would name this process's own group, or every process), or None if it is not one."""
    with contextlib.suppress(ValueError, TypeError):
        group = json.loads(record)
        if isinstance(group, dict) and type(group.get("pgid")) is int and group["pgid"] > 1:
            return group
    return None


def _leader_is(group: dict[str, Any]) -> bool:
    """Whether the recorded group's leader is gone (its group may live on: a group id is not reused
    while it has members) or is the process recorded (the same start time)."""
    leader = _process_stat(group["pgid"])
    return leader is None or leader[0] in ("Z", "X") or int(leader[19]) == group.get("start")


def _run_marker(job: str, slot: int, nonce: str) -> str:
    """The value of ``ANARCHON_RUN`` in the environment of an attempt's command: bound to the run
    (job and slot) and to the attempt's random nonce kept in its process-group record, so that a
    record copied from another run or written by hand names no process this scheduler started."""
    return _digest(f"{job}\0{slot}\0{nonce}")


def _marked(marker: str) -> dict[int, int]:
    """The live processes of this user (root: root's) whose environment carries ``ANARCHON_RUN=marker``:
    pid to process group, from /proc (elsewhere none: only the group is known there)."""
    wanted, uid, found = f"ANARCHON_RUN={marker}".encode(), os.geteuid(), {}
    for name in os.listdir("/proc") if os.path.isdir("/proc/self") else ():
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/environ", "rb") as handle:
                if wanted not in handle.read().split(b"\0"):
                    continue
        except OSError:
            continue
        fields = _process_stat(int(name))
        if fields is not None and fields[0] not in ("Z", "X"):
            found[int(name)] = int(fields[2])
    return found


def _run_left(pgid: int | None, marker: str, outside: bool = True) -> tuple[list[int], bool]:
    """What a run's command left on this host: the processes that carry its marker (``outside``:
    also those that left group ``pgid``), and whether the group is proven the run's now (one of them
    is in it: a group id is not reused while the group has members)."""
    marked = _marked(marker)
    ours = pgid is not None and pgid in marked.values()
    return sorted(p for p, g in marked.items() if outside or g == pgid), ours


_MID_EXEC_LOOKS = 5  # looks again, 20 ms apart, when no process of a live group carries the marker


async def _look_again_mid_exec(pgid: int, marker: str, outside: bool) -> tuple[list[int], bool]:
    """``_run_left`` again, up to ``_MID_EXEC_LOOKS`` times while group ``pgid`` has members: a
    process in the middle of ``exec`` (a background ``sh`` becoming its command) shows no
    environment, and a first look that missed it ended nothing."""
    for _ in range(_MID_EXEC_LOOKS):
        if not await asyncio.to_thread(_group_members, pgid):
            break
        await asyncio.sleep(0.02)
        left, ours = await asyncio.to_thread(_run_left, pgid, marker, outside)
        if left:
            return left, ours
    return [], False


async def _end_run(pgid: int | None, marker: str, outside: bool = True, at_once: bool = False) -> bool:
    """End what a run's command started here (``_run_left``): SIGTERM to the group when proven the
    run's and to each process with the marker, SIGKILL to what is left after ``_GROUP_GRACE``
    (``at_once``: SIGKILL only); whether all of it is gone."""
    left: list[int] = []
    for signum in (signal.SIGKILL,) if at_once else (signal.SIGTERM, signal.SIGKILL):
        left, ours = await asyncio.to_thread(_run_left, pgid, marker, outside)
        if not left and pgid is not None and signum is signal.SIGTERM:
            left, ours = await _look_again_mid_exec(pgid, marker, outside)
        if not left:
            return True
        if pgid is not None and ours:
            _kill_group(pgid, signum)
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
        deadline = time.monotonic() + _GROUP_GRACE
        while left and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            left, _ = await asyncio.to_thread(_run_left, pgid, marker, outside)
    return not left


async def _start_reaper(pgid: int, marker: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        "/bin/sh",
        "-c",
        _REAPER,
        str(pgid),
        marker,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )


async def _stop_reaper(reaper: asyncio.subprocess.Process) -> None:
    assert reaper.stdin is not None
    try:
        reaper.stdin.write(b"done\n")
        reaper.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        await asyncio.wait_for(reaper.wait(), 5.0)
    except asyncio.TimeoutError:
        reaper.kill()
        await reaper.wait()


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """The stream protocol of ``create_subprocess_exec``, and a future set when the process exits:
    ``Process.wait()`` (before Python 3.12) waits for its output pipes to close too, which a
    background child of the command can keep open for ever."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop):
        super().__init__(limit, loop)
        self.exited: asyncio.Future[int] = loop.create_future()

    def process_exited(self) -> None:
        code = self._transport.get_returncode()  # type: ignore[attr-defined]
        if not self.exited.done() and code is not None:
            self.exited.set_result(code)
        super().process_exited()  # (which may let go of the transport)


async def _spawn(args: Sequence[str], **options: Any) -> tuple[asyncio.subprocess.Process, asyncio.Future[int]]:
    """``create_subprocess_exec``, with a future of the exit code that does not wait for the pipes."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.subprocess_exec(lambda: _ExitProtocol(2**16, loop), *args, **options)
    return asyncio.subprocess.Process(transport, protocol, loop), protocol.exited


async def _wait_command(
    ctx: RunContext,
    proc: asyncio.subprocess.Process,
    exited: asyncio.Future[int],
    reader: asyncio.Future[None],
    marker: str,
) -> tuple[int, str]:
    """Wait for the shell to exit; on abort (timeout, cancel, shutdown, lost lease) end it, its
    group and every process with the run's marker, inside the group or not. Returns (exit code,
    what was left in the group when the shell exited: a description, empty if nothing)."""
    aborted: asyncio.Future[Any] = asyncio.ensure_future(ctx.signal.wait())
    left = ""
    try:
        await asyncio.wait({exited, aborted}, return_when=asyncio.FIRST_COMPLETED)
        if not exited.done() and isinstance(ctx.signal.reason, LeaseLost):
            # Another process may be running the run already (on PostgreSQL, 0.6 s after this
            # process's lock session ended): no grace to finish, which a TERM trap would take.
            ctx.log.warning("the run is lost: killing the command's process group and every process with its marker")
            await _end_run(proc.pid, marker, at_once=True)
        elif not exited.done():
            ctx.log.info("sending SIGTERM to the command's process group and to every process with its marker")
            await _end_run(proc.pid, marker)
        else:
            left = ", ".join(_group_members(proc.pid))
            if left:
                ctx.log.warning("the command exited and left %s in its process group: ending them", left)
                await _end_run(proc.pid, marker, outside=False)
        if not exited.done():  # (the shell is not reaped yet: its group is this run's for sure)
            _kill_group(proc.pid, signal.SIGKILL)
        code = await exited
        await asyncio.wait({reader}, timeout=1.0)  # the rest of the output, from processes now gone
    finally:
        aborted.cancel()
    return code, left


async def _read_tail(proc: asyncio.subprocess.Process, tail: bytearray) -> None:
    assert proc.stdout is not None
    while True:
        chunk = await proc.stdout.read(65536)
        if not chunk:
            return
        tail.extend(chunk)
        del tail[:-_OUTPUT_TAIL]


def _kill_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


###############################################################################
# Crontab files ###############################################################
###############################################################################


_CRONTAB_OPTIONS = (
    "name",
    "timeout",
    "overlap",
    "retries",
    "retry_delay",
    "catch_up",
    "lease",
    "grace",
    "max_attempts",
    "jitter",
    "on_failure",  # (the rest of its comment line: a command)
    "on_failure_every_attempt",  # (the same, run after every failed attempt)
)
_OPTION_COMMENT = re.compile(r"#\s*(" + "|".join(_CRONTAB_OPTIONS) + r")\s*:", re.IGNORECASE)
_OPTION_PAIR = re.compile(r"(\w+)\s*:\s*([^\s,]+)")
_ENV_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*)$")
_ON_FAILURE = re.compile(r"#\s*(on_failure(?:_every_attempt)?)\s*:\s*(\S.*)$", re.IGNORECASE)
_COUNTS = ("retries", "max_attempts", "overlap")  # the options whose digits are a number


class CrontabError(ConfigError):
    """A line of a crontab file is wrong; ``path`` and ``line`` say where."""

    def __init__(self, path: str, line: int, message: str):
        ValueError.__init__(self, f"{path}:{line}: {message}")
        self.job, self.option, self.path, self.line = None, None, path, line


@dataclasses.dataclass
class _CrontabEntry:
    line: int
    name: str
    kind: str  # "cron", "every" or "reboot"
    spec: str
    command: str
    env: dict[str, str]
    options: dict[str, Any]
    on_failure: str | None = None  # a command run after the run failed for good (or every failed attempt)
    every_attempt: bool = False  # whether ``on_failure`` runs after every failed or timed-out attempt


def _parse_crontab(text: str, path: str) -> list[_CrontabEntry]:
    """Read a crontab: entries, ``NAME=value`` lines, and ``# key: value`` option comments."""
    env: dict[str, str] = {}
    pending: dict[str, Any] = {}
    entries: list[_CrontabEntry] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            if _OPTION_COMMENT.match(line):
                pending.update(_option_comment(line, path, number))
            continue
        assignment = _ENV_LINE.match(line)
        if assignment and not line.startswith("@") and " " not in assignment.group(1):
            value = assignment.group(2).strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            if "\0" in value:  # (no environment can carry it: every command would fail to start)
                raise CrontabError(path, number, f"the value of {assignment.group(1)} has a NUL character in it")
            env[assignment.group(1)] = value
            if assignment.group(1) == "MAILTO" and value:
                _log.warning(
                    "%s:%d: MAILTO is ignored: anarchon-lite sends no mail; put '# on_failure: COMMAND' above an "
                    "entry to run a command (such as mail) after it fails",
                    path,
                    number,
                )
            continue
        entries.append(_crontab_entry(line, number, path, dict(env), pending))
        pending = {}
    names = [e.name for e in entries]
    for entry in entries:
        if names.count(entry.name) > 1:
            raise CrontabError(path, entry.line, f"job name {entry.name!r} is used twice")
    return entries


def _option_comment(line: str, path: str, number: int) -> dict[str, Any]:
    hook = _ON_FAILURE.match(line)
    if hook:
        return {hook.group(1).lower(): hook.group(2).strip()}
    options: dict[str, Any] = {}
    left = _OPTION_PAIR.sub(" ", line.lstrip("#")).replace(",", " ").split()
    if left:
        raise CrontabError(
            path,
            number,
            f"cannot read {left[0]!r} in this option comment: options are key: value pairs separated by spaces or "
            "commas, and a value has no spaces (a job name such as 'nightly-backup', not 'nightly backup')",
        )
    for key, value in _OPTION_PAIR.findall(line):
        key = key.lower()
        if key not in _CRONTAB_OPTIONS:
            raise CrontabError(path, number, f"unknown option {key!r} (known: {', '.join(_CRONTAB_OPTIONS)})")
        options[key] = int(value) if key in _COUNTS and _DIGITS.match(value) else value
    return options


def _crontab_entry(line: str, number: int, path: str, env: dict[str, str], options: dict[str, Any]) -> _CrontabEntry:
    parts = line.split(None, 1)
    if parts[0].lower() == "@every":
        fields = line.split(None, 2)
        if len(fields) < 3:
            raise CrontabError(path, number, "@every needs a duration and a command")
        kind, spec, command = "every", fields[1], fields[2]
    elif parts[0].lower() == "@reboot":
        if len(parts) < 2:
            raise CrontabError(path, number, "@reboot needs a command")
        kind, spec, command = "reboot", "@reboot", parts[1]
    elif parts[0].startswith("@"):
        if len(parts) < 2:
            raise CrontabError(path, number, f"{parts[0]} needs a command")
        kind, spec, command = "cron", parts[0], parts[1]
    else:
        fields = line.split(None, 5)
        if len(fields) < 6:
            raise CrontabError(path, number, "expected 5 schedule fields and a command")
        kind, spec, command = "cron", " ".join(fields[:5]), fields[5]
    problem = _command_problem(command, env) or _user_column(command, env) or _percent_problem(command)
    if problem:
        raise CrontabError(path, number, problem)
    import hashlib  # (a crontab's names only: not loaded by a scheduler of the library)

    digest = hashlib.sha1(f"{spec}\n{command}".encode()).hexdigest()[:8]
    command = command.replace("\\%", "%")
    name = str(options.pop("name", None) or f"{kind}-{digest}")
    once, every = options.pop("on_failure", None), options.pop("on_failure_every_attempt", None)
    if once is not None and every is not None:
        raise CrontabError(path, number, "on_failure and on_failure_every_attempt are both given: keep one")
    return _CrontabEntry(number, name, kind, spec, command, env, options, once or every, every is not None)


_ARG_LIMIT = 131072  # bytes in one argument of execve on Linux (MAX_ARG_STRLEN), the terminating NUL included


def _command_problem(command: str, env: dict[str, str]) -> str | None:
    """What makes a crontab command impossible to run, found before anything starts, or None."""
    if "\0" in command:
        return "the command has a NUL character in it"
    size = len(command.encode(errors="surrogateescape"))
    if size >= _ARG_LIMIT:
        return f"the command is {size} bytes, more than the {_ARG_LIMIT - 1} the system takes in one argument: put it in a script"
    shell = env.get("SHELL", "/bin/sh")
    if _find_program(shell, env.get("PATH", os.environ.get("PATH", os.defpath))) is None:
        return f"SHELL={shell}: no such executable file"
    return None


def _percent_problem(command: str) -> str | None:
    """Why a command with a ``%`` that no backslash escapes is refused: cron ends the command at
    the first such ``%`` and sends what follows as its input (each further ``%`` a new line), a
    line written for this file would mean it as written; rather than guess, such a line is refused.
    ``\\%`` is a ``%``, as in cron."""
    if re.search(r"(?<!\\)%", command) is None:
        return None
    return (
        "the command has a % that no backslash escapes: cron would end the command there and send the rest "
        "as its input; write \\% for a % (date +\\%F), and give input with printf '...' | COMMAND"
    )


def _user_column(command: str, env: dict[str, str]) -> str | None:
    """Why a command whose first word names a user of this system, and no program, is refused: it
    is a system crontab's user column (``0 3 * * * root backup``), which would run a program called
    ``root``."""
    first = command.split(None, 1)[0]
    if _find_program(first, env.get("PATH", os.environ.get("PATH", os.defpath))) is not None:
        return None
    try:
        import pwd

        pwd.getpwnam(first)
    except (ImportError, KeyError):
        return None
    return (
        f"{first!r} is a user of this system, not a program: the user column of a system crontab (/etc/crontab, "
        "/etc/cron.d) is not supported; run one anarchon-lite crontab process per user instead (systemd: User= "
        "in each one's unit)"
    )


def _find_program(name: str, path: str) -> str | None:
    """Where ``name`` is found as an executable file (``execvp``'s search), or None."""
    candidates = [name] if "/" in name else [os.path.join(d or ".", name) for d in path.split(os.pathsep)]
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _declare_crontab(scheduler: Scheduler, entries: list[_CrontabEntry], path: str, inherit_env: bool = True) -> None:
    for entry in entries:
        handler = command_handler(entry.command, entry.env, inherit_env=inherit_env)
        options = dict(entry.options)
        if entry.on_failure is not None:
            options["on_failure"] = _failure_command(entry.on_failure, _command_environment(entry.env, inherit_env))
            options["on_failure_every_attempt"] = entry.every_attempt
        try:
            if entry.kind == "every":
                scheduler.every(entry.name, entry.spec, handler, **options)
            elif entry.kind == "reboot":
                scheduler.on_start(entry.name, handler, **options)
            else:
                tz = entry.env.get("CRON_TZ") or entry.env.get("TZ") or None
                scheduler.cron(entry.name, entry.spec, handler, tz=tz, **options)
        except ConfigError as exc:
            raise CrontabError(path, entry.line, str(exc)) from None
        scheduler.agree_on(entry.name, entry.command)


###############################################################################
# The command line ############################################################
###############################################################################


def _progress_bar(progress: tuple[float, float | None] | None) -> str:
    if progress is None:
        return ""
    done, total = progress
    if not total:
        return f"{done:g} done"
    share = max(0.0, min(1.0, done / total))
    return f"[{'#' * round(share * 20):<20}] {share:4.0%} ({done:g}/{total:g})"


def _record_json(record: RunRecord) -> dict[str, Any]:
    fields = dataclasses.asdict(record)
    for key in ("started_at", "finished_at"):
        fields[key] = fields[key].isoformat() if fields[key] else None
    fields["scheduled_at"] = record.scheduled_at.isoformat()
    return fields


def _zone_of(schedule: str, local: _dt.tzinfo) -> _dt.tzinfo:
    """The zone a job's times are shown in: its cron or rrule zone (the last word of the stored
    description), else ``local``."""
    if schedule.startswith(("cron ", "rrule ")):
        with contextlib.suppress(zoneinfo.ZoneInfoNotFoundError, ValueError):
            return zoneinfo.ZoneInfo(_described(schedule)[0].rsplit(" ", 1)[-1])
    return local


def _when(moment: _dt.datetime | None, zone: _dt.tzinfo) -> str:
    """A time as ``systemctl list-timers`` shows it: ``Thu 2026-12-03 03:00:00 CET``."""
    return "-" if moment is None else moment.astimezone(zone).strftime("%a %Y-%m-%d %H:%M:%S %Z")


def _left(moment: _dt.datetime | None, now: float) -> str:
    """How long until ``moment``: ``5min left``, or, for a time already passed, ``5min late``."""
    if moment is None:
        return "-"
    left = moment.timestamp() - now
    return f"{_span(left)} left" if left >= 0 else f"{_span(-left)} late"


def _span(seconds: float) -> str:
    """A stretch of time at a glance: ``45s``, ``12min 5s``, ``3h 12min``, ``2d 4h``."""
    seconds = abs(seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    for unit, size, rest, rest_size in (("d", 86400, "h", 3600), ("h", 3600, "min", 60), ("min", 60, "s", 1)):
        if whole >= size:
            more = whole % size // rest_size
            return f"{whole // size}{unit}" + (f" {more}{rest}" if more else "")
    return f"{whole}s"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _terminal(text: str) -> str:
    """Stored text as a terminal may show it: control characters (an escape sequence in a
    command's output that would clear the screen or retitle the window) as ``\\xNN``."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


def _table(rows: list[list[str]], below: dict[int, list[str]] | None = None, columns: int | None = None) -> None:
    """Print rows in columns as wide as their widest cell, in terminal columns (the last one as it
    is), and after row ``n`` the lines ``below[n]``. Within ``columns``: the first and the last
    column are cut (ending in "…") so that every line fits, the last one first, to 12."""
    widths = [max(_width(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    if columns is not None:
        spare = columns - sum(widths) - 2 * len(widths) - 12
        if spare < 0:  # (even the last column cut to 12 does not fit: the first gives way, to 8)
            rows = [[_cut(row[0], max(8, widths[0] + spare)), *row[1:]] for row in rows]
            widths[0] = max(_width(row[0]) for row in rows)
        room = max(1, columns - sum(widths) - 2 * len(widths))
        rows = [[*row[:-1], _cut(row[-1], room)] for row in rows]
        below = {n: [_cut(line, columns) for line in lines] for n, lines in (below or {}).items()}
    lines = []
    for number, row in enumerate(rows):
        cells = [cell + " " * (width - _width(cell)) for cell, width in zip(row, widths)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
        lines.extend((below or {}).get(number, ()))
    print("\n".join(lines))  # (one write: 10,000 prints are a tenth of a status of 10,000 jobs)


_COLUMNS = 100  # the width ``status`` fits without ``--wide``
_NAME_CUT = 24  # a job's name or a host, at most, in that width (the rest ends in "…")


def _print_status(
    jobs: list[JobStatus], processes: list[ProcessInfo], as_json: bool, utc: bool, wide: bool = False
) -> None:
    """Every job as ``systemctl list-timers`` shows timers (NEXT, LEFT, LAST, RESULT), its
    running attempts below it, then the processes running on the store: in 100 columns, every time
    in one zone (the local one, or UTC), named in the header; ``wide``: whole names, each time with
    its date, weekday and zone (a job's own zone), and PASSED beside LAST."""
    if as_json:
        shown = {"jobs": [_status_json(job) for job in jobs], "processes": [_process_json(p) for p in processes]}
        print(json.dumps(shown, indent=2))
        return
    now, local = time.time(), _local_zone()  # (once: finding the local zone reads /etc/localtime's link)
    table_zone = _UTC if utc else local
    zone_name = _zone_name(table_zone)
    if wide:
        rows = [["JOB", "STATE", "NEXT", "LEFT", "LAST", "PASSED", "RESULT", "SCHEDULE"]]
    else:
        rows = [["JOB", "STATE", f"NEXT ({zone_name})", "LEFT", "LAST", "RESULT", "SCHEDULE"]]
    below: dict[int, list[str]] = {}
    for job in jobs:
        following = None if job.paused or job.undeclared else job.next_start or job.next_at  # (with its jitter)
        passed = "-" if job.last_at is None else f"{_span(now - job.last_at.timestamp())} ago"
        if wide:
            zone = _UTC if utc else _zone_of(job.schedule, local)
            times = [_when(following, zone), _left(following, now), _when(job.last_at, zone), passed]
            rows.append([job.name, job.state, *times, job.last_status or "-", job.schedule])
        else:
            times = [_short_when(following, table_zone), _left(following, now), passed]
            rows.append([_cut(job.name, _NAME_CUT), job.state, *times, job.last_status or "-", job.schedule])
        below[len(rows) - 1] = [
            f"  attempt {info.attempt} {info.state} on {info.owner or '-'}"
            + ("" if info.age is None else f" for {_span(info.age)}")
            + (f" {_progress_bar(info.progress)}" if info.progress else "")
            for info in job.runs
        ]
    _table(rows, below, None if wide else _COLUMNS)
    undeclared = sum(job.undeclared for job in jobs)
    print(f"\n{len(jobs)} job{'' if len(jobs) == 1 else 's'}" + (f", {undeclared} undeclared" if undeclared else ""))
    if not processes:
        print("no scheduler process runs on the store")
        return
    print()
    since = "SINCE" if wide else f"SINCE ({zone_name})"
    table = [["PROCESS", "PID", "HOST", since, "JOBS"]]
    for process in processes:
        jobs_text = "-" if process.jobs is None else str(process.jobs)
        started = _when(process.started_at, table_zone) if wide else _short_when(process.started_at, table_zone)
        instance, host = process.instance, process.host or "-"
        if not wide:
            instance, host = _cut(instance, 2 * _NAME_CUT), _cut(host, _NAME_CUT)
        table.append([instance, str(process.pid or "-"), host, started, jobs_text])
    _table(table)


def _zone_name(zone: _dt.tzinfo) -> str:
    """A zone as a table's header names it: its IANA name, else its abbreviation now."""
    key = getattr(zone, "key", None)
    if isinstance(key, str) and ("/" in key or key == "UTC") and len(key) <= _ZONE_NAME:
        return key.removeprefix("Etc/")
    return _dt.datetime.now(zone).strftime("%Z")


_ZONE_NAME = 20  # a longer IANA name (America/Argentina/ComodRivadavia) is shown by its abbreviation


def _short_when(moment: _dt.datetime | None, zone: _dt.tzinfo) -> str:
    """A time in a table whose header names the zone: ``12-03 03:00:00``."""
    return "-" if moment is None else moment.astimezone(zone).strftime("%m-%d %H:%M:%S")


def _width(text: str) -> int:
    """How many terminal columns ``text`` takes: two for a wide character (日), none for a
    combining one."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` terminal columns, ending in "…" when it was cut."""
    if text.isascii():  # (one column a character: most names and every schedule)
        return text if len(text) <= width else text[: width - 1] + "…"
    if _width(text) <= width:
        return text
    used = 0
    for end, character in enumerate(text):
        used += _width(character)
        if used > width - 1:
            return text[:end] + "…"
    return text


def _status_json(job: JobStatus) -> dict[str, Any]:
    return {
        "name": job.name,
        "schedule": job.schedule,
        "state": job.state,
        "paused": job.paused,
        "undeclared": job.undeclared,
        "definition": job.definition,
        "declared_by": job.declared_by,
        "next_at": job.next_at.isoformat() if job.next_at else None,
        "next_start": job.next_start.isoformat() if job.next_start else None,
        "last": None if job.last_at is None else {"status": job.last_status, "at": job.last_at.isoformat()},
        "runs": [
            {
                **dataclasses.asdict(r),
                "started_at": r.started_at.isoformat() if r.started_at else None,
                "progress": None if r.progress is None else {"done": r.progress[0], "total": r.progress[1]},
            }
            for r in job.runs
        ],
    }


def _process_json(process: ProcessInfo) -> dict[str, Any]:
    return {**dataclasses.asdict(process), "started_at": process.started_at.isoformat()}


def _print_history(records: list[RunRecord], as_json: bool) -> None:
    if as_json:
        print(json.dumps([_record_json(r) for r in records], indent=2))
        return
    print(
        f"{'JOB':<24} {'SCHEDULED (UTC)':<24} {'ATT':>3} {'STATUS':<11} {'DURATION':>9} {'INSTANCE':<28} ERROR / OUTPUT"
    )
    for r in records:
        error = _terminal(r.error.splitlines()[-1][:60]) if r.error else ""
        last = _terminal((r.output or "").rstrip("\n").rsplit("\n", 1)[-1][:60])
        shown = error if not last else f"{error}  | {last}" if error else f"| {last}"
        at = r.scheduled_at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        seconds = _took(r)
        took = "-" if seconds is None else _elapsed(seconds)
        instance = _terminal(r.instance or "-")
        print(f"{r.job:<24} {at:<24} {r.attempt:>3} {r.status:<11} {took:>9} {instance:<28} {shown}")


def _print_records(records: list[RunRecord], as_json: bool) -> None:
    """Each record whole: its fields, its error and the output stored with it (``show``,
    ``history --output``)."""
    if as_json:
        print(json.dumps([_record_json(r) for r in records], indent=2))
        return
    for number, r in enumerate(records):
        seconds = _took(r)
        took = "-" if seconds is None else _elapsed(seconds)
        print(
            ("\n" if number else "") + f"{r.job}  slot {r.slot} ({r.scheduled_at.isoformat(timespec='milliseconds')})"
        )
        print(f"  attempt {r.attempt}: {r.status} on {_terminal(r.instance or '-')}, took {took}")
        print(f"  started {_when(r.started_at, _UTC)}, ended {_when(r.finished_at, _UTC)}")
        for title, text in (("error", r.error), ("output", r.output)):
            if text:
                print(f"  {title}:")
                print("\n".join(f"    {_terminal(line)}" for line in text.rstrip("\n").split("\n")))


def _slot(text: str) -> int:
    """A slot as the command line takes it: milliseconds since the epoch, or an ISO 8601 time
    (without an offset: UTC)."""
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        moment = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"slot {text!r} is neither milliseconds nor an ISO 8601 time") from None
    return _ms_from_dt(moment if moment.tzinfo else moment.replace(tzinfo=_UTC))


def _show(control: Control, job: str, slot: str | None, as_json: bool) -> None:
    records = control.history(job, limit=2**31 - 1)
    if slot is None:
        chosen = records[:1]
    else:
        wanted = _slot(slot)
        chosen = sorted((r for r in records if r.slot == wanted), key=lambda r: r.attempt)
    if not chosen:  # (then say whether the job itself exists)
        if not any(j.name == job for j in control.status()):
            raise JobNotFound("no such job in the database", job=job)
        raise ConfigError("no such record" if slot is not None else "no record yet", job=job)
    _print_records(chosen, as_json)


def _starting(
    schedule: _Schedule, now_ms: int, count: int, first: _dt.datetime | None
) -> list[tuple[_dt.datetime, _dt.datetime]]:
    """The next ``count`` occurrences of ``schedule`` that start after ``now_ms``, from ``first``
    (the job's next occurrence as its row has it, if known: one passed before the job was declared
    never runs, though its jitter would start it later): (time, start)."""
    found: list[tuple[_dt.datetime, _dt.datetime]] = []
    since = now_ms - (schedule.jitter if isinstance(schedule, _Jittered) else 0)
    cursor = schedule.next_after(since if first is None else max(since, _ms_from_dt(first) - 1))
    while cursor is not None and len(found) < count:
        start = schedule.start_of(cursor)
        if start > now_ms:  # (an occurrence passed may start later; the one before it has started)
            found.append((_utc_from_ms(cursor), _utc_from_ms(start)))
        cursor = schedule.next_after(cursor)
    return found


def _print_next(jobs: list[JobStatus], count: int, utc: bool, as_json: bool) -> None:
    """The next ``count`` occurrences of each job (as ``systemd-analyze calendar`` lists them): the
    time of each, and how much later it starts (its jitter); ``in`` counts to its start."""
    now, local = time.time(), _local_zone()
    shown = []
    for job in jobs:
        try:
            schedule = _schedule_from(job.schedule, job.name)
        except ConfigError as exc:  # (that job's alone: say why, and list the others)
            print(f"anarchon-lite: {exc}", file=sys.stderr)
            continue
        shown.append((job, _starting(schedule, _ms(now), count, job.next_at)))
    if as_json:
        listed = [
            {
                "name": j.name,
                "state": j.state,
                "next": [t.isoformat() for t, _ in ts],
                "start": [s.isoformat() for _, s in ts],
            }
            for j, ts in shown
        ]
        print(json.dumps(listed))
        return
    for number, (job, times) in enumerate(shown):
        zone = _UTC if utc else _zone_of(job.schedule, local)
        state = "" if job.state == "active" else f" ({job.state}: it does not run)"
        print(("\n" if number else "") + f"{job.name}: {job.schedule}{state}")
        if job.schedule.startswith("rrule "):
            print("  (from the stored rule, which keeps no DTSTART: Scheduler.upcoming() in the process is exact)")
        if not times:
            print("  never" if job.schedule != _OnStart.description else "  when a group of processes starts")
        for n, (moment, start) in enumerate(times, 1):
            here, there = _when(moment, zone), _when(moment, _UTC)
            utc_too = "" if here == there else f"  ({there})"
            delay = (start - moment).total_seconds()
            jitter = f"  (+{_span(delay)} jitter)" if delay else ""
            print(f"  {n:>3}  {here}{utc_too}{jitter}  in {_span(start.timestamp() - now)}")


def _check_crontab(path: str) -> None:
    """Parse and declare the file's entries (raising at the first bad one, FILE:LINE), and print
    each with its name, schedule and next three runs; nothing is opened or started."""
    entries = _parse_crontab(_read_crontab(path), path)
    scheduler = Scheduler(os.devnull)  # (declared only: never opened)
    _declare_crontab(scheduler, entries, path)
    for entry in entries:
        description = scheduler.describe(entry.name)
        if entry.kind == "reboot":
            upcoming = "when the group of processes starts"
        else:
            zone = scheduler.zone(entry.name)
            times = scheduler.upcoming(entry.name, count=3)
            upcoming = ", ".join(t.astimezone(zone).isoformat(timespec="seconds") for t in times)
        print(f"{path}:{entry.line}: {entry.name}: {description}: next {upcoming or 'never'}")
    print(f"{path}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, no errors")


def _run_crontab(scheduler: Scheduler, path: str, inherit_env: bool) -> None:
    def reload() -> None:
        try:
            fresh = Scheduler(scheduler.path)
            _declare_crontab(fresh, _parse_crontab(_read_crontab(path), path), path, inherit_env)
        except (ConfigError, OSError) as exc:
            _log.error("SIGHUP: keeping the current table: %s", exc)
            return
        scheduler.replace_jobs(fresh)
        _log.info("SIGHUP: re-read %s (%d jobs)", path, len(fresh.declared()))

    _run_until_stopped(scheduler, reload)


def _run_target(scheduler: Scheduler, target: str) -> None:
    def reload() -> None:
        _log.info("SIGHUP: nothing to reload for run %s (restart the process to load new code)", target)

    _run_until_stopped(scheduler, reload)


def _run_until_stopped(scheduler: Scheduler, on_sighup: Callable[[], None]) -> None:
    """Run ``scheduler`` on a new event loop; SIGHUP calls ``on_sighup`` (it never kills the process)."""

    async def serve() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_sighup)
        await scheduler.run()

    asyncio.run(serve())


_SQLITE_HEADER = b"SQLite format 3\0"  # the first bytes of every SQLite database file


def _read_crontab(path: str) -> str:
    """The text of a crontab file; ``CrontabError`` with the line of the first byte that is not UTF-8,
    ``ConfigError`` for a database file (the arguments swapped)."""
    with open(path, "rb") as handle:
        data = handle.read()
    if data.startswith(_SQLITE_HEADER):
        raise ConfigError(
            f"{path} looks like a database, not a crontab; did you mean --db {path} crontab CRONTAB_FILE?"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise CrontabError(
            path, line, f"the file is not UTF-8 (byte 0x{data[exc.start]:02x}); save it as UTF-8"
        ) from None


def _load_scheduler(target: str) -> Scheduler:
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"expected MODULE:ATTRIBUTE, got {target!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name.partition(".")[0] and exc.name != module_name:
            raise ConfigError(f"cannot import {module_name}: {exc}") from None
        raise ConfigError(
            f"no module named {module_name!r} (run from the directory that holds it, or set PYTHONPATH)"
        ) from None
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name}: {exc}") from None
    if not hasattr(module, attribute):
        raise ConfigError(f"module {module_name!r} has no attribute {attribute!r}")
    found = getattr(module, attribute)
    if not isinstance(found, Scheduler) and callable(found):
        try:
            inspect.signature(found).bind()
        except TypeError as exc:
            raise ConfigError(f"{target} must be a Scheduler or a function called without arguments ({exc})") from None
        except ValueError:  # a builtin without a signature: it is called, and says so itself
            pass
        found = found()
    if not isinstance(found, Scheduler):
        raise ConfigError(f"{target} is not a Scheduler")
    return found


def _log_level(text: str) -> str:
    import argparse

    if not isinstance(logging.getLevelName(text.upper()), int):
        raise argparse.ArgumentTypeError(f"unknown level {text!r} (debug, info, warning, error, critical)")
    return text.upper()


# The fields of a run's log records (``_Events.tell``), as a JSON line carries them.
_LOG_FIELDS = ("job", "slot", "attempt", "status", "duration", "count")
# sd-daemon(3) priorities: under systemd, a line that starts with one is filed at that level.
_JOURNAL_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


class _JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the run's fields, the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _dt.datetime.fromtimestamp(record.created, _UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update((key, getattr(record, key)) for key in _LOG_FIELDS if hasattr(record, key))
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class _JournalFormatter(logging.Formatter):
    """Lines for the journal: each prefixed with its priority (``<3>``), no timestamp (journald
    adds its own)."""

    def format(self, record: logging.LogRecord) -> str:
        priority = _JOURNAL_PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        text = f"{record.name}: {super().format(record)}"
        return "\n".join(f"<{priority}>{line}" for line in text.splitlines())


def _stderr_is_the_journal() -> bool:
    """Whether stderr is the journal's stream (systemd sets ``$JOURNAL_STREAM`` to its device and inode)."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    try:
        status = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return expected == f"{status.st_dev}:{status.st_ino}"


def _configure_logging(level: str, form: str) -> None:
    handler = logging.StreamHandler()
    if form == "json":
        handler.setFormatter(_JsonFormatter())
    elif _stderr_is_the_journal():
        handler.setFormatter(_JournalFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


def _global_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """The options every subcommand takes, before or after its name (after it, a subcommand's
    parser sets only what is given: ``defaults`` False)."""

    import argparse

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--db",
        default=default(os.environ.get("ANARCHON_DB")),
        help="the database file, or a postgresql:// URL (default: $ANARCHON_DB)",
    )
    parser.add_argument(
        "--shared-group",
        action="store_true",
        default=default(False),
        help="trust a database file (and its -wal, -shm, lease board, liveness directory) of another user "
        "of one of this process's groups that the group may write (docs/database.md: Trust model)",
    )
    parser.add_argument(
        "--log-level",
        default=default("INFO"),
        type=_log_level,
        help="logging level for run and crontab (default: INFO)",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=default("text"),
        help="log lines as text, or as one JSON object a line (run and crontab; default: text)",
    )


def _count(most: int) -> Callable[[str], int]:
    """An argument's type: a whole number from 1 to ``most`` (argparse says which, in one line)."""

    def count(text: str) -> int:
        import argparse

        if not text.strip().isdigit() or not 1 <= int(text) <= most:
            raise argparse.ArgumentTypeError(f"give a whole number from 1 to {most:,}, not {text!r}")
        return int(text)

    return count


def _parser() -> argparse.ArgumentParser:
    import argparse  # here, not at the top: it is a tenth of the module's import time

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str) -> Any:  # one line, as every other error of the command line
            self.exit(2, f"{self.prog}: {message} (see --help)\n")

    parser = _Parser(prog="anarchon-lite", description="Work on an anarchon_lite database file.")
    parser.add_argument("--version", action="version", version=f"anarchon-lite {__version__}")
    _global_options(parser, defaults=True)
    common = _Parser(add_help=False)
    _global_options(common, defaults=False)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=text, description=text, parents=[common])

    status = command("status", "every job (next and last run, result, running attempts) and the running processes")
    status.add_argument("--utc", action="store_true", help="show times in UTC (default: the local zone)")
    status.add_argument(
        "--wide", action="store_true", help="whole names, and each time with its date and zone (a job's own zone)"
    )
    shown = status.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    shown.add_argument(
        "--prometheus", action="store_true", help="print every job's figures in the Prometheus text format"
    )
    history = command("history", "run records, newest first")
    history.add_argument("--job", help="only this job's records")
    history.add_argument(
        "--limit", "-n", type=_count(1_000_000), default=50, help="how many records (default: 50, at most 1,000,000)"
    )
    history.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    history.add_argument("--output", action="store_true", help="print each record whole, with its output and error")
    show = command("show", "one run's records whole: status, times, error and the output stored with it")
    show.add_argument("name", help="the job's name")
    show.add_argument("slot", nargs="?", help="its slot: milliseconds or an ISO 8601 time (default: the newest record)")
    show.add_argument("--json", action="store_true", help="print a JSON list instead")
    upcoming = command("next", "the next occurrences of every job, or of one")
    upcoming.add_argument("name", nargs="?", help="only this job")
    upcoming.add_argument(
        "-n", type=_count(1000), default=1, metavar="N", help="how many occurrences of each (default: 1, at most 1,000)"
    )
    upcoming.add_argument("--utc", action="store_true", help="show times in UTC (default: each job's zone, else local)")
    upcoming.add_argument("--json", action="store_true", help="print a JSON list instead")
    for name, text in (
        ("trigger", "record a run of a job due now"),
        ("pause", "pause a job's schedule, on every process"),
        ("resume", "resume a job's schedule, on every process"),
        ("cancel", "cancel a job's unfinished runs, on whichever process holds them"),
        ("forget", "delete a job that no running process declares, and everything recorded of it"),
    ):
        control = command(name, text)
        control.add_argument("name", help="the job's name")
        control.add_argument("--json", action="store_true", help="say what was done as a JSON object")
    web = command("web", "serve a status page: every job, a timeline of runs, what runs now, live in a browser")
    web.add_argument(
        "--listen",
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        help="where (default: 127.0.0.1:8080; port 0: any free one)",
    )
    web.add_argument(
        "--token",
        default=os.environ.get("ANARCHON_WEB_TOKEN") or None,
        help="a secret every request must carry (default: $ANARCHON_WEB_TOKEN); needed off loopback and for --control",
    )
    web.add_argument(
        "--control", action="store_true", help="buttons for trigger, pause, resume and cancel (needs a token)"
    )
    schema = command("schema", "print the SQL that creates (or migrates) a PostgreSQL schema for a role that may not")
    schema.add_argument("--role", help="the role that will use it (default: the URL's user)")
    run = command("run", "run the Scheduler that MODULE:ATTRIBUTE names")
    run.add_argument("target", help="MODULE:ATTRIBUTE, a Scheduler or a function that returns one")
    crontab = command("crontab", "run a crontab file of shell commands")
    crontab.add_argument("file", help="the crontab file")
    for runner in (run, crontab):
        runner.add_argument(
            "--metrics-file",
            metavar="PATH",
            help="keep PATH a Prometheus text file of every job's figures, for node_exporter's textfile collector",
        )
    crontab.add_argument(
        "--check", action="store_true", help="only read the file: list each entry and its next 3 runs, start nothing"
    )
    crontab.add_argument(
        "--env",
        choices=("inherit", "minimal"),
        default="inherit",
        help="the commands' environment: this process's (the default), or minimal as cron gives "
        "(PATH=/usr/bin:/bin, HOME, LOGNAME, USER, SHELL), each with the file's own variables",
    )
    crontab.add_argument(
        "--durability",
        choices=("normal", "full"),
        default="normal",
        help="normal: a power cut can lose the last commits (the default); full: sync every commit to disk",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m anarchon_lite --help``."""
    for stream in (sys.stdout, sys.stderr):  # whatever the locale: text it cannot encode is escaped
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    args = _parser().parse_args(argv)
    try:
        return _command(args)
    except BrokenPipeError:  # ``... | head``: the reader has what it wanted
        with contextlib.suppress(OSError):  # (and Python's own flush at exit must not complain)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a command ended by SIGPIPE
    except (AnarchonError, OSError) as exc:
        print(f"anarchon-lite: {exc}", file=sys.stderr)
        return 2


def _command(args: argparse.Namespace) -> int:
    if args.command in ("run", "crontab"):
        _configure_logging(args.log_level, args.log_format)
    if args.command == "run":
        scheduler = _load_scheduler(args.target)
        given = args.db if args.db != os.environ.get("ANARCHON_DB") else None  # (on the command line)
        if given is not None and _same_store(given) != _same_store(scheduler.path):
            raise ConfigError(
                f"--db {given}: `run` uses the database its Scheduler names ({scheduler.path}); "
                "drop --db, or name that database in the module (Scheduler(os.environ['ANARCHON_DB']) reads $ANARCHON_DB)"
            )
        if args.shared_group:
            scheduler.share_group()
        scheduler.notify_systemd()  # the command line is the service: it talks to systemd
        if args.metrics_file:
            scheduler.keep_metrics(args.metrics_file)
        _run_target(scheduler, args.target)
        return 0
    if args.command == "crontab" and args.check:
        _check_crontab(args.file)
        return 0
    if not args.db:
        raise ConfigError("no database file: give --db PATH or set ANARCHON_DB")
    if args.command == "crontab":
        scheduler = Scheduler(
            args.db,
            notify=True,
            metrics_file=args.metrics_file,
            durability=args.durability,
            shared_group=args.shared_group,
        )
        inherit = args.env == "inherit"
        _declare_crontab(scheduler, _parse_crontab(_read_crontab(args.file), args.file), args.file, inherit)
        _run_crontab(scheduler, args.file, inherit)
        return 0
    if args.command == "schema":
        print(_schema_script(args.db, args.role), end="")
        return 0
    if not _is_postgres(args.db) and not os.path.exists(args.db):
        raise StoreError(args.db, "no such database file")
    if args.command == "web":
        _configure_logging(args.log_level, args.log_format)
        _serve_web(args.db, args.listen, args.token, args.control)
        return 0
    read_only = args.command in ("status", "history", "show", "next")
    control = Control(args.db, read_only=read_only, shared_group=args.shared_group)
    if args.command == "status" and args.prometheus:
        print(control.prometheus(), end="")
    elif args.command == "status":
        _print_status(control.status(), control.processes(), args.json, args.utc, args.wide)
    elif args.command == "history":
        records = control.history(args.job, args.limit)
        if not records and args.job is not None and all(job.name != args.job for job in control.status()):
            raise JobNotFound("no such job in the database", job=args.job)
        (_print_records if args.output else _print_history)(records, args.json)
    elif args.command == "show":
        _show(control, args.name, args.slot, args.json)
    elif args.command == "next":
        jobs = [j for j in control.status() if args.name in (None, j.name)]
        if args.name is not None and not jobs:
            raise JobNotFound("no such job in the database", job=args.name)
        _print_next(jobs, args.n, args.utc, args.json)
    elif args.command == "trigger":
        slot = control.trigger(args.name)
        _confirm(args.command, args.name, slot, args.json, idle=not control.processes())
    else:
        result = getattr(control, args.command)(args.name)  # trigger: its slot; cancel: how many; else None
        _confirm(args.command, args.name, result, args.json)
    return 0


def _serve_web(path: str, listen: str, token: str | None, control: bool) -> None:
    """``web``: the status page until SIGTERM or SIGINT; one line says where it is."""

    async def serve() -> None:
        scheduler = Scheduler(path, read_only=not control)
        try:
            page = StatusPage(scheduler, listen, token=token, control=control)
            await scheduler.status()  # (a store that cannot be read is said now, not on the first page)
            await page.start()
            print(
                f"status page of {_shown_store(path)} on {page.url}" + (" (with control)" if control else ""),
                flush=True,
            )
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop.set)
            await stop.wait()
            await page.close()
        finally:
            scheduler.close()

    asyncio.run(serve())


def _schema_script(url: str, role: str | None) -> str:
    """``schema``: the script an administrator runs once (``psql -f``), for the URL's schema."""
    import urllib.parse

    if not _is_postgres(url):
        raise ConfigError(
            "schema is for a postgresql:// URL: an SQLite file is made by the first process that opens it"
        )
    role = role or urllib.parse.unquote(urllib.parse.urlsplit(url).username or "")
    if not role:
        raise ConfigError("the URL names no user: give --role ROLE, the role that will use the schema")
    return _pg_schema_script(_PGTarget.parse(url), role)


def _same_store(path: str) -> str:
    """What tells two names of a database apart: a URL as it is, a file by its absolute path."""
    return path if _is_postgres(path) else os.path.abspath(path)


def _confirm(command: str, name: str, result: int | None, as_json: bool, idle: bool = False) -> None:
    """One line that says what a control command did (``idle``: no process runs on the store)."""
    later = "no scheduler process runs now: the first to start that declares it runs it"
    if as_json:
        key = {"trigger": "slot", "cancel": "cancelled"}.get(command)
        print(
            json.dumps(
                {"command": command, "job": name, **({key: result} if key else {}), **({"note": later} if idle else {})}
            )
        )
    elif command == "trigger":
        assert result is not None
        at = _utc_from_ms(result).isoformat(timespec="milliseconds")
        print(f"{name}: triggered, slot {result} ({at})" + (f"; {later}" if idle else ""))
    elif command == "forget":
        print(f"{name}: forgotten, with its runs, history and checkpoints")
    elif command == "cancel":
        print(f"{name}: {result} unfinished run{'' if result == 1 else 's'} cancelled")
    else:
        print(f"{name}: {command}d on every process")


if __name__ == "__main__":
    # Run the command line from the module proper, not from ``__main__``: a user's module imported by
    # ``run`` must meet the same ``Scheduler`` class as the command line does.
    sys.exit(importlib.import_module("anarchon_lite").main())
