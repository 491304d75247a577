"""What only the PostgreSQL store has: sessions that end under a live process, a server that
restarts, the schema, and psycopg as an optional import. (Its behaviour as a store is checked by the
suites that take the ``store`` fixture.)"""

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.parse

import pytest
from conftest import QUIET, Process, faulty, needs_faketime, run, wait_for, wall_clock_ahead

import anarchon_lite as al
from anarchon_lite import LeaseLost, Scheduler, StoreError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_names = iter(range(1, 1_000_000))


@pytest.fixture
def url(pg_server):
    return pg_server.url(schema=f"p{os.getpid()}_{next(_names)}")


def sql(url, statement, args=()):
    import pgserver

    return pgserver.query(url, statement, args)


def terminate_session_of(url, instance):
    """End the server session that holds ``instance``'s advisory lock (pg_terminate_backend)."""
    return sql(
        url,
        "SELECT pg_terminate_backend(l.pid) FROM pg_locks l JOIN instances i ON l.objid = i.lock_key "
        "WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND i.instance = %s",
        (instance,),
    )


async def statuses(s, job):
    return [(r.attempt, r.status) for r in reversed(await s.history(job, limit=100))]


def test_a_terminated_session_aborts_the_owner_at_once_and_another_process_takes_over(url, caplog):
    events = []

    async def main():
        a, b = Scheduler(url, instance="a", poll=0.05), Scheduler(url, instance="b", poll=0.05)
        for s in (a, b):

            @s.every("work", "24h", offset=QUIET, lease="30s")
            async def work(ctx):
                events.append((ctx.instance, ctx.attempt, "start"))
                try:
                    await ctx.signal.sleep(60 if ctx.instance == "a" else 0.01)
                except LeaseLost:
                    events.append((ctx.instance, ctx.attempt, "lease lost"))
                    raise

        async with a:
            await a.trigger("work")
            await wait_for(lambda: ("a", 1, "start") in events, message="attempt 1 on a")
            async with b:
                await wait_for(lambda: b._loop.ready is not None and b._loop.ready.is_set(), message="b ready")
                loop = asyncio.get_running_loop()
                ended = loop.time()
                assert await loop.run_in_executor(None, terminate_session_of, url, "a") == [(True,)]
                await wait_for(lambda: ("a", 1, "lease lost") in events, message="a to learn", timeout=5)
                learned = loop.time() - ended
                await wait_for(lambda: ("b", 2, "start") in events, message="b to take over", timeout=10)
                taken = loop.time() - ended
                await wait_for(lambda: _has(b, "work", (2, "succeeded")), message="attempt 2 recorded")
                # a reconnects, locks again and goes on working: the next run goes to whichever claims it
                await wait_for(lambda: a._loop.ready.is_set() and _identity(a).held.is_set(), message="a back")
                slot = await a.trigger("work")
                await wait_for(lambda: any(e[2] == "start" and e[1] == 1 for e in events[3:]), message="next run")
                assert slot
        assert learned < 2.0, f"the owner learned of its lost session after {learned:.2f} s"
        assert taken < 5.0, f"taken over after {taken:.2f} s with a 30 s lease"
        assert (await statuses(b, "work"))[:2] == [(1, "interrupted"), (2, "succeeded")]

    with caplog.at_level(logging.WARNING, logger="anarchon_lite"):
        run(main())
    assert any("holds this process's lock was lost" in r.getMessage() for r in caplog.records)


def _identity(scheduler):
    return scheduler._link.backend._identity


def _has(s, job, record):
    async def check():
        return record in await statuses(s, job)

    return check()


def test_a_server_restart_is_survived(url, pg_server, caplog):
    if pg_server.given:
        pytest.skip("the server was given ($ANARCHON_TEST_POSTGRES): this test restarts its own")
    seen = []

    async def main():
        s = Scheduler(url, instance="a", poll=0.05)

        @s.every("tick", "200ms")
        async def tick(ctx):
            seen.append(ctx.slot)

        async with s:
            await wait_for(lambda: len(seen) >= 2, message="runs before the restart")
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, pg_server.restart)
            before = len(seen)
            await wait_for(lambda: len(seen) >= before + 3, timeout=30, message="runs after the restart")
            assert not s._main.done()
        assert len(seen) == len(set(seen))

    with caplog.at_level(logging.WARNING, logger="anarchon_lite"):
        run(main(), timeout=90)
    messages = [r.getMessage() for r in caplog.records]
    assert any("was lost" in m for m in messages), messages[:5]


def test_many_processes_creating_the_schema_at_once(url):
    code = (
        f"import sys; sys.path.insert(0, {ROOT!r}); import asyncio, anarchon_lite as al; "
        f"asyncio.run(al.Scheduler({url!r}).status())"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE) for _ in range(6)]
    try:
        errors = [p.communicate(timeout=60)[1].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * 6, errors
    assert sql(url, "SELECT version FROM meta") == [(al.SCHEMA_VERSION,)]


def test_a_newer_schema_is_refused_untouched(url):
    run(Scheduler(url).status())
    sql(url, "UPDATE meta SET version = 99")
    with pytest.raises(StoreError, match="newer anarchon_lite .version 99"):
        run(Scheduler(url).status())
    assert sql(url, "SELECT version FROM meta") == [(99,)]


def test_a_schema_of_version_3_is_migrated_in_place_and_its_jobs_kept(url):
    """Version 4 gave job rows change numbers; a schema of version 3 gets them when a process of
    this version first opens it, and its jobs and watermarks stay as they were."""

    async def declare():
        s = Scheduler(url)
        s.every("kept", "24h", lambda ctx: None, offset=QUIET)
        async with s:
            pass
        return await s.status()

    before = run(declare())
    sql(url, "INSERT INTO history (job, slot, attempt, status, started_at) VALUES ('kept', 1000, 1, 'failed', 2000)")
    sql(url, "DROP TRIGGER run_taken ON runs")  # (what versions 4 to 8 added, undone)
    sql(url, "DROP FUNCTION record_taken")
    sql(url, "DROP TRIGGER history_ended ON history")
    sql(url, "DROP FUNCTION let_go_ended")
    sql(url, "DROP TRIGGER history_newest ON history")
    sql(url, "DROP FUNCTION keep_newest")
    sql(url, "ALTER TABLE jobs DROP COLUMN last_status")
    sql(url, "ALTER TABLE jobs DROP COLUMN last_at")
    sql(url, "DROP INDEX jobs_by_change")
    sql(url, "ALTER TABLE jobs DROP COLUMN changed")
    sql(url, "DROP TABLE totals")
    sql(url, "DROP TABLE declarations")
    sql(url, "ALTER TABLE instances DROP COLUMN declares")
    sql(url, "UPDATE meta SET version = 3")
    after = run(declare())
    assert sql(url, "SELECT version FROM meta") == [(al.SCHEMA_VERSION,)]
    assert sql(url, "SELECT name, changed, last_status, last_at FROM jobs") == [("kept", 1, "failed", 2000)]
    assert [(j.name, j.next_at) for j in after] == [(j.name, j.next_at) for j in before]


def test_the_url_password_never_shows_and_a_bad_schema_name_is_refused(pg_server):
    target = al._PGTarget.parse("postgresql://me:secret@db.example/app?schema=jobs&sslmode=require")
    assert "secret" not in target.shown and target.schema == "jobs" and "schema" not in target.conninfo
    assert "sslmode=require" in target.conninfo
    with pytest.raises(al.ConfigError, match="schema"):
        Scheduler("postgresql://db.example/app?schema=Robert'); DROP")
    hidden = al._PGTarget.parse("postgresql://db.example/app?password=hunter2&sslpassword=key2&sslmode=require")
    assert "hunter2" not in hidden.shown and "key2" not in hidden.shown and "sslmode=require" in hidden.shown


def test_a_schema_name_too_long_for_the_names_made_of_it_is_refused(pg_server):
    """The NOTIFY channel is ``anarchon_`` and the schema: PostgreSQL's names hold 63 bytes."""
    longest = "s" * 54
    Scheduler(pg_server.url(schema=longest))  # (nothing is written until it is used)
    with pytest.raises(al.ConfigError, match="at most 54 characters"):
        Scheduler(pg_server.url(schema=longest + "s"))

    async def use():
        s = Scheduler(pg_server.url(schema=longest))
        s.every("job", "24h", lambda ctx: None, offset=QUIET)
        await s.trigger("job")
        return [job.name for job in await s.status()]

    assert run(use()) == ["job"]


def test_a_password_in_the_query_never_shows_in_an_error():
    done = subprocess.run(
        [sys.executable, "-m", "anarchon_lite", "--db", "postgresql://me@127.0.0.1:1/app?password=hunter2", "status"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 2 and "127.0.0.1" in done.stderr and "password=***" in done.stderr
    assert "hunter2" not in done.stderr + done.stdout


def test_without_psycopg_the_module_imports_and_a_url_says_what_to_install():
    code = (
        f"import sys; sys.path.insert(0, {ROOT!r}); sys.modules['psycopg'] = None; import anarchon_lite as al\n"
        "try:\n    al.Scheduler('postgresql://localhost/app')\nexcept al.ConfigError as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pip install 'anarchon_lite[postgres]'" in done.stdout


def test_the_command_line_works_on_a_url(url):
    async def declare():
        s = Scheduler(url)
        s.every("job", "24h", lambda ctx: None, offset=QUIET)
        await s.status()

    run(declare())
    env = {**os.environ, "ANARCHON_DB": url}
    command = [sys.executable, "-m", "anarchon_lite"]
    done = subprocess.run([*command, "trigger", "job"], check=False, capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    status = subprocess.run(
        [*command, "--db", url, "status", "--json"], check=False, capture_output=True, text=True, cwd=ROOT
    )
    assert status.returncode == 0, status.stderr
    assert '"name": "job"' in status.stdout


def via_proxy(url, proxy):
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}@127.0.0.1:{proxy.port}"))


def test_a_partitioned_owner_loses_its_run_after_the_lease_and_its_writes_are_refused(url, pg_server):
    """The owner's connections freeze (no FIN, no reset): its lock stays held, so its lease decides.
    It aborts its attempt by its own clock; the other process takes the run over once the lease has
    run out on the server's clock; the writes the owner sent into the partition are refused."""
    import urllib.parse

    from tcpproxy import Proxy

    server = urllib.parse.urlsplit(url)
    proxy = Proxy((server.hostname, server.port))
    events = []

    async def main():
        a = Scheduler(via_proxy(url, proxy), instance="a", poll=0.05)
        b = Scheduler(url, instance="b", poll=0.05)
        for s in (a, b):

            @s.every("work", "24h", offset=QUIET, lease="2s")
            async def work(ctx):
                events.append((ctx.instance, ctx.attempt, "start"))
                n = 0
                while ctx.instance == "a" or n < 3:
                    n += 1
                    await ctx.checkpoint.set({"by": ctx.instance, "n": n})
                    await asyncio.sleep(0.05)

        loop = asyncio.get_running_loop()
        async with a:
            await a.trigger("work")
            await wait_for(lambda: ("a", 1, "start") in events, message="attempt 1 on a")
            async with b:
                await wait_for(lambda: b._loop.ready is not None and b._loop.ready.is_set(), message="b ready")
                proxy.freeze()
                frozen = loop.time()
                await wait_for(lambda: ("b", 2, "start") in events, timeout=15, message="b to take over")
                taken = loop.time() - frozen
                await wait_for(lambda: _has(b, "work", (2, "succeeded")), message="attempt 2 recorded")
                aborted = a._loop.runner.running and next(iter(a._loop.runner.running.values())).token.reason
                proxy.thaw()
                await wait_for(lambda: not a._loop.runner.running, timeout=30, message="a's attempt to end")
        assert isinstance(aborted, LeaseLost), aborted  # by a's own clock, inside the partition
        assert 1.0 < taken < 2.0 + 1.5, f"taken over {taken:.2f} s after the partition (lease 2 s)"
        [(value, by)] = sql(url, "SELECT value, attempt FROM checkpoints")
        assert (json.loads(value), by) == ({"by": "b", "n": 3}, 2)  # none of a's later writes landed
        assert (await statuses(b, "work"))[:2] == [(1, "interrupted"), (2, "succeeded")]

    try:
        run(main(), timeout=90)
    finally:
        proxy.close()


@needs_faketime
def test_hosts_whose_clocks_are_an_hour_apart_agree_on_leases(url, tmp_path):
    """Two of three workers run with their clocks an hour ahead (faketime), each in a pid namespace
    of its own. The owner is one of them; while it renews, nobody takes its run over, though one
    watcher's clock is an hour behind it; frozen (SIGSTOP) past its 1 s lease, it is taken over at once
    by the server's clock. Leases stamped on the owner's clock would take an hour."""
    from test_multiprocess import Processes

    ahead = wall_clock_ahead("+1h")
    procs = Processes(url, str(tmp_path / "events.jsonl"), isolated=True)
    try:
        owner = procs.start("export", 1.0, prefix=ahead)
        procs.wait(lambda e: e["event"] == "ready" and e["pid"] == owner.pid, what="the owner ready")
        trigger = run(Scheduler(url).trigger("export"))
        procs.wait(lambda e: e["event"] == "start" and e["attempt"] == 1, what="attempt 1")
        watchers = [procs.start("export", 1.0), procs.start("export", 1.0, prefix=ahead)]
        for w in watchers:
            procs.wait(lambda e, w=w: e["event"] == "ready" and e["pid"] == w.pid, what="a watcher ready")
        held = procs.wait(lambda e: e["event"] == "saved" and e["after"] >= 25, what="3 leases' progress")
        early = [e for e in procs.read() if e["event"] == "start" and e["attempt"] > 1]
        assert early == [], [(r.attempt, r.status, r.error) for r in run(Scheduler(url).history("export"))]
        owner.send_signal(signal.SIGSTOP)
        stopped = time.time()
        second = procs.wait(lambda e: e["event"] == "start" and e["attempt"] == 2, what="takeover")
        taken = time.time() - stopped  # (on this clock: the event's own time may be an hour ahead)
        owner.send_signal(signal.SIGCONT)
        assert second["pid"] != owner.pid and held["pid"] == owner.pid and second["slot"] == trigger
        assert taken < 1.0 + 1.5, f"taken over {taken:.2f} s after the freeze"
        procs.wait(lambda e: e["event"] == "done", timeout=30, what="done")
    finally:
        procs.close()


def test_a_handler_does_not_fail_when_its_store_connection_is_lost(url):
    """The server ends the sessions a process uses for its store and its renewals (not the one that
    holds its lock): the handler's checkpoint calls go on, on new connections; the attempt succeeds."""
    saved = []

    async def main():
        s = Scheduler(url, instance="a", poll=0.05)

        @s.every("work", "24h", offset=QUIET, lease="5s")
        async def work(ctx):
            for n in range(60):
                await ctx.checkpoint.set(n)
                saved.append(await ctx.checkpoint.get())
                await asyncio.sleep(0.02)

        async with s:
            await s.trigger("work")
            loop = asyncio.get_running_loop()
            for round_ in range(3):
                await wait_for(lambda round_=round_: len(saved) > 10 + 15 * round_, message="progress")
                ended = await loop.run_in_executor(None, terminate_all_but_the_lock, url)
                assert ended, "no session was ended"
            await wait_for(lambda: _has(s, "work", (1, "succeeded")) or _has(s, "work", (1, "failed")), timeout=30)
            assert await statuses(s, "work") == [(1, "succeeded")]
        assert saved == list(range(60))

    run(main(), timeout=90)


def terminate_all_but_the_lock(url):
    """End every session of the schedulers (application_name anarchon_lite) but those holding an
    advisory lock."""
    return sql(
        url,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'anarchon_lite' "
        "AND pid NOT IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory')",
    )


def test_the_stores_prepared_statements_survive_a_deallocate_all(url):
    """psycopg's cache of a connection sends ``DEALLOCATE ALL`` after every rolled-back transaction
    (a serialization retry): the store's own prepared statements
    on that connection go with them, and its next renewal, progress or process group must prepare
    again rather than fail (a crontab on PostgreSQL failed most of its runs so)."""

    async def declare():
        s = Scheduler(url)
        s.every("job", "24h", lambda ctx: None, offset=QUIET)
        await s.status()
        return s

    s = run(declare())
    store = s._link.backend.control_store()
    claim = al._Claim("job", 1, 1, 0)
    try:
        for reset in ("DEALLOCATE ALL", "DEALLOCATE ALL", None):
            assert store.set_process_group(claim, "nobody", "group") is False  # (no such run: prepared, run)
            if reset is not None:
                store._connect().execute(reset)
        assert store.set_process_group(claim, "nobody", "group") is False
    finally:
        store.close()


def test_a_lock_session_ended_where_its_owner_cannot_see_it_never_gives_two_handlers_at_once(url):
    """The owner's network path freezes, then the server ends its lock session
    (pg_terminate_backend, as a pooler or a server-side keepalive would): the lock is free while the
    owner lives and cannot hear of it. The owner stops its handler when its session has not answered
    for ``_PG_VOUCH``; the other process takes the run over only after seeing the lock free for
    longer than that, not after the 30 s lease: the two handlers never work at the same time."""
    import urllib.parse

    from tcpproxy import Proxy

    server = urllib.parse.urlsplit(url)
    proxy = Proxy((server.hostname, server.port))
    working = {"a": [], "b": []}  # when each handler last did a piece of work (monotonic)

    async def main():
        a = Scheduler(via_proxy(url, proxy), instance="a", poll=0.05)
        b = Scheduler(url, instance="b", poll=0.05)
        for s in (a, b):

            @s.every("work", "24h", offset=QUIET, lease="30s")
            async def work(ctx):
                while ctx.instance == "a" or len(working["b"]) < 20:
                    ctx.signal.throw_if_aborted()
                    working[ctx.instance].append(time.monotonic())
                    await asyncio.sleep(0.005)

        async with a:
            await a.trigger("work")
            await wait_for(lambda: len(working["a"]) > 10, message="attempt 1 at work on a")
            async with b:
                await wait_for(lambda: b._loop.ready is not None and b._loop.ready.is_set(), message="b ready")
                proxy.freeze()
                assert terminate_session_of(url, "a") == [(True,)]
                ended = time.monotonic()
                await wait_for(lambda: working["b"], timeout=15, message="b to take over")
                await wait_for(lambda: _has(b, "work", (2, "succeeded")), message="attempt 2 recorded")
                proxy.thaw()
                await wait_for(lambda: not a._loop.runner.running, timeout=30, message="a's attempt to end")
        overlap = working["a"][-1] - working["b"][0]
        assert overlap < 0, f"both handlers worked for {overlap:.3f} s"
        assert working["b"][0] - ended < 5.0, "taken over by the lease, not by the free lock"

    try:
        run(main(), timeout=90)
    finally:
        proxy.close()


@pytest.fixture
def bouncer(request, pg_server):
    """A real PgBouncer in front of the test server, in the pooling mode the test is parametrised by."""
    import pgserver

    reason = pgserver.Bouncer.missing()
    if reason is not None:
        if os.environ.get(pgserver.REQUIRED):
            pytest.fail(f"PgBouncer is required (${pgserver.REQUIRED}) but cannot be had: {reason}")
        pytest.skip(reason)
    bouncer = pgserver.Bouncer(pg_server, request.param)
    yield bouncer
    bouncer.stop()


@pytest.mark.parametrize("bouncer", ["transaction", "statement"], indirect=True)
def test_a_pooler_that_shares_sessions_is_refused_at_start_in_one_line(bouncer, tmp_path):
    url = bouncer.url(schema=f"b{os.getpid()}_{next(_names)}")
    with pytest.raises(StoreError, match="pool_mode = session"):
        run(Scheduler(url).trigger("nothing"))
    crontab = tmp_path / "jobs.cron"
    crontab.write_text("@every 1s true\n")
    done = subprocess.run(
        [sys.executable, "-m", "anarchon_lite", "--db", url, "crontab", str(crontab)],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    [line] = [line for line in done.stderr.splitlines() if "pool_mode = session" in line]
    assert line.startswith("anarchon-lite: postgresql://postgres@127.0.0.1:"), line


@pytest.mark.parametrize("bouncer", ["session"], indirect=True)
def test_through_pgbouncer_in_session_mode_every_occurrence_runs_once_and_an_ended_session_is_taken_over(bouncer):
    """Session pooling gives each client a server session of its own for as long as it is connected:
    it works (each process holds four connections: docs/postgresql.md)."""
    url = bouncer.url(schema=f"b{os.getpid()}_{next(_names)}")
    events = []

    async def main():
        a, b = Scheduler(url, instance="a", poll=0.05), Scheduler(url, instance="b", poll=0.05)
        for s in (a, b):

            @s.every("work", "24h", offset=QUIET, overlap="allow")
            async def work(ctx):
                events.append(("work", ctx.slot, ctx.instance, ctx.attempt))

            @s.every("hold", "24h", offset=QUIET)
            async def hold(ctx):
                events.append(("hold", ctx.slot, ctx.instance, ctx.attempt))
                if ctx.instance == "a":
                    await ctx.signal.sleep(60)

        async with a:
            slot = await a.trigger("hold")
            await wait_for(lambda: ("hold", slot, "a", 1) in events, message="a to run hold")
            async with b:
                await wait_for(lambda: b._loop.ready is not None and b._loop.ready.is_set(), message="b ready")
                slots = [await b.trigger("work") for _ in range(5)]
                await wait_for(lambda: sum(e[0] == "work" for e in events) >= 5, message="five runs")
                assert sorted(e[1] for e in events if e[0] == "work") == slots  # each once
                assert terminate_session_of(url, "a") == [(True,)]  # (as a pooler recycling it would)
                await wait_for(lambda: ("hold", slot, "b", 2) in events, timeout=20, message="b to take over")

    run(main(), timeout=90)


def test_idle_session_timeouts_of_a_managed_server_are_survived(pg_server, caplog):
    """Managed services end idle sessions (``idle_session_timeout``, here 2 s on the role): the lock
    session is kept busy within it, every other connection is opened again when it is next used. A
    7-second run and a run after 5 idle seconds each succeed as attempt 1, nothing is aborted."""
    role = f"idle{os.getpid()}_{next(_names)}"
    admin = pg_server.url()
    sql(admin, f"CREATE ROLE {role} LOGIN")
    sql(admin, f"ALTER ROLE {role} SET idle_session_timeout = '2s'")
    sql(admin, f"ALTER ROLE {role} SET idle_in_transaction_session_timeout = '1s'")
    sql(admin, f"GRANT CREATE ON DATABASE postgres TO {role}")
    url = pg_server.url(schema=role).replace("postgres@", f"{role}@", 1)
    caplog.set_level(logging.WARNING, logger="anarchon_lite")

    async def main():
        s = Scheduler(url, poll=0.05)

        @s.every("long", "24h", offset=QUIET)
        async def long(ctx):
            for step in range(70):
                ctx.progress(step, 70)
                await ctx.signal.sleep(0.1)

        async with s:
            await s.trigger("long")
            await wait_for(lambda: _has(s, "long", (1, "succeeded")), timeout=30, message="the long run")
            idle_since = time.monotonic()
            await wait_for(lambda: time.monotonic() - idle_since > 5, timeout=10, message="5 idle seconds")
            await s.trigger("long")
            await wait_for(lambda: _count(s, "long", "succeeded", 2), timeout=30, message="the second run")
            return await statuses(s, "long")

    assert run(main(), timeout=90) == [(1, "succeeded"), (1, "succeeded")]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def _count(s, job, status, count):
    return sum(r.status == status for r in await s.history(job, limit=100)) >= count


def test_a_read_only_server_is_waited_out_like_a_lost_connection(url, pg_server):
    """A failover to a standby not yet promoted (here the whole server made read-only for a
    second): the handler's checkpoint write waits and lands when the server takes writes again;
    the run is neither failed nor taken over."""
    admin = pg_server.url()
    writes, done = [], None  # (an asyncio.Event, made on the test's loop: Python 3.9 binds one where it is made)

    async def main():
        nonlocal done
        done = asyncio.Event()
        s = Scheduler(url, poll=0.05)

        @s.every("write", "24h", offset=QUIET)
        async def write(ctx):
            while not done.is_set():
                began = time.monotonic()
                await ctx.checkpoint.set(len(writes))
                writes.append(time.monotonic() - began)
                await asyncio.sleep(0.01)

        async with s:
            await s.trigger("write")
            await wait_for(lambda: len(writes) > 5, message="the handler at work")
            try:
                sql(admin, "ALTER SYSTEM SET default_transaction_read_only = on")
                sql(admin, "SELECT pg_reload_conf()")
                read_only = time.monotonic()
                await wait_for(lambda: time.monotonic() - read_only > 1.0, message="a second read-only")
            finally:
                sql(admin, "ALTER SYSTEM RESET default_transaction_read_only")
                sql(admin, "SELECT pg_reload_conf()")
            written = len(writes)
            await wait_for(lambda: len(writes) > written + 5, timeout=30, message="writes again")
            done.set()
            await wait_for(lambda: _has(s, "write", (1, "succeeded")), timeout=30, message="the run to end")
            return await statuses(s, "write")

    assert run(main(), timeout=90) == [(1, "succeeded")]
    assert max(writes) > 0.5, "no write met the read-only server"


def administrator_runs_the_script(pg_server, url):
    """What ``anarchon-lite --db URL schema`` prints for the role of ``url``, run once by the
    server's superuser with psql."""
    command = [sys.executable, "-m", "anarchon_lite", "--db", url, "schema"]
    script = subprocess.run(command, check=True, capture_output=True, text=True, timeout=60).stdout
    admin = urllib.parse.urlsplit(pg_server.url())
    psql = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", admin.hostname, "-p", str(admin.port), "-U", "postgres"]
    return subprocess.run(psql, check=False, input=script, capture_output=True, text=True, timeout=60)


def the_role_runs_a_job(url):
    """The attempts of a job triggered by a scheduler of ``url``'s role, once it has succeeded."""
    ran = []

    async def main():
        s = Scheduler(url, poll=0.05)
        s.every("job", "24h", lambda ctx: ran.append(ctx.attempt), offset=QUIET)
        async with s:
            await s.trigger("job")
            await wait_for(lambda: _has(s, "job", (1, "succeeded")), message="the run")

    run(main())
    return ran


def test_a_role_without_create_gets_one_line_and_the_script_an_administrator_runs_once(pg_server, tmp_path):
    """The role may not create the schema: one line naming the privilege and the command that
    prints the SQL; an administrator runs that once (psql), and the role then runs its jobs."""
    role = f"app{os.getpid()}_{next(_names)}"
    sql(pg_server.url(), f"CREATE ROLE {role} LOGIN")
    url = pg_server.url(schema=f"s_{role}").replace("postgres@", f"{role}@", 1)
    with pytest.raises(StoreError, match=r"may not create schema .*anarchon-lite --db URL schema") as info:
        run(Scheduler(url).trigger("nothing"))
    assert len(str(info.value).splitlines()) == 1
    command = [sys.executable, "-m", "anarchon_lite", "--db", url]
    crontab = tmp_path / "jobs.cron"
    crontab.write_text("@every 1s true\n")
    done = subprocess.run([*command, "crontab", str(crontab)], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "CREATE" in done.stderr, done.stderr

    done = administrator_runs_the_script(pg_server, url)
    assert done.returncode == 0, done.stderr
    assert the_role_runs_a_job(url) == [1]


def test_the_script_an_administrator_runs_migrates_a_schema_of_the_version_before(pg_server):
    """A role that may not create made its schema with the script of the release before; the next
    release must migrate it, which the role may not either: its one line names the command again,
    and what that prints migrates the schema (it created one only, and failed on one that
    existed), then leaves it as it is when run again."""
    role = f"app{os.getpid()}_{next(_names)}"
    sql(pg_server.url(), f"CREATE ROLE {role} LOGIN")
    admin_url = pg_server.url(schema=f"s_{role}")
    url = admin_url.replace("postgres@", f"{role}@", 1)
    assert administrator_runs_the_script(pg_server, url).returncode == 0
    for statement in (  # (what version 8 added, undone: a schema of version 7)
        "DROP TRIGGER run_taken ON runs",
        "DROP FUNCTION record_taken",
        "DROP TRIGGER history_ended ON history",
        "DROP FUNCTION let_go_ended",
        "UPDATE meta SET version = 7",
    ):
        sql(admin_url, statement)
    with pytest.raises(StoreError, match=r"may not migrate .from version 7 to .* schema") as info:
        run(Scheduler(url).trigger("nothing"))
    assert "anarchon-lite --db URL schema" in str(info.value)
    migrated = administrator_runs_the_script(pg_server, url)
    assert migrated.returncode == 0, migrated.stderr
    assert sql(admin_url, "SELECT version FROM meta") == [(al.SCHEMA_VERSION,)]
    assert the_role_runs_a_job(url) == [1] and sql(admin_url, "SELECT count(*) FROM runs") == [(0,)]
    again = administrator_runs_the_script(pg_server, url)
    assert again.returncode == 0, again.stderr
    assert sql(admin_url, "SELECT version FROM meta") == [(al.SCHEMA_VERSION,)]


def test_an_idle_process_watching_anothers_run_reads_only_the_runs(url):
    """While another process's run is running, an idle process reads the runs every 0.5 s to watch
    its owner's lock: one statement each time (it read the jobs and the newest slot too, three)."""
    calls = {"runs": 0, "jobs": 0, "newest_slot": 0}
    started = None  # (an asyncio.Event, made on the test's loop: Python 3.9 binds one where it is made)

    def counted(name):
        def call(original, *args):
            calls[name] += 1
            return original(*args)

        return call

    async def main():
        nonlocal started
        started = asyncio.Event()
        a = Scheduler(url, instance="a", poll=0.05)
        b = Scheduler(url, instance="b", store=faulty(**{name: counted(name) for name in calls}))
        for s in (a, b):

            @s.every("long", "24h", offset=QUIET)
            async def long(ctx):
                started.set()
                await ctx.signal.sleep(60)

        async with a:
            await a.trigger("long")
            await started.wait()
            async with b:
                await wait_for(lambda: calls["runs"] >= 2, message="b to watch")
                # A change read less than 2 s after b's first read leaves who runs unread: b reads it
                # once the 2 s passed, and that alone (it read the jobs and the newest slot too). (A
                # job declared: a write that asks nothing of the others; one that did, a pause, would
                # have b read who runs with it.)
                read = calls["jobs"]
                a.every("more", "24h", lambda ctx: None, offset=QUIET)  # (one write, one change told)
                await wait_for(lambda: calls["newest_slot"] > read, message="b to read the change")
                before = dict(calls)
                await wait_for(lambda: calls["runs"] >= before["runs"] + 6, timeout=20, message="six more looks")
                after = dict(calls)
        # (no whole read began after ``before``, which may have been taken in the middle of one: a
        # whole read counts ``jobs``, then ``runs``, then ``newest_slot``)
        assert after["jobs"] == before["jobs"] and after["newest_slot"] == after["jobs"], (before, after)

    run(main(), timeout=60)


def test_the_lock_session_is_made_again_when_the_loop_resets_at_once(url):
    """The loop's ``reset`` may come while the listening thread is still telling of the loss (the
    thread aborts the attempts, which hands the GIL to the loop): it connects again all the same."""

    async def main():
        backend = al._Postgres(url, False, 30.0, 1000)
        run_store = backend.control_store()
        run_store.register([])  # (the schema)
        changes = backend.changes(asyncio.get_running_loop(), lambda: None, "me")
        changes.vouch_for(lambda: False, lambda why: changes.reset())  # the reset, at the worst moment
        try:
            identity = backend._identity
            await wait_for(lambda: identity.held.is_set(), message="the first session")
            first = identity.key
            assert sql(
                url,
                "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                "AND objid = %s AND objsubid = 2",
                (first,),
            ) == [(True,)]
            await wait_for(lambda: identity.held.is_set() and identity.key != first, message="a new session")
        finally:
            changes.close()
            run_store.close()

    run(main(), timeout=60)


@pytest.mark.parametrize("late", ["before it tells it has ended", "after it told"])
def test_a_stopped_scheduler_has_ended_its_lock_sessions_thread(url, monkeypatch, late):
    """The thread that holds the lock session is a part of the scheduler: once ``stop`` (or the
    end of ``async with``) returns, it has closed its session and ended, however late it runs
    (held up here, as on a loaded machine, between the session's end and its telling so, or
    between its telling and its return: both seen in CI)."""
    import threading

    if late == "after it told":
        serve = al._PGChanges._serve

        def held_up_after(self):
            serve(self)
            time.sleep(0.3)

        monkeypatch.setattr(al._PGChanges, "_serve", held_up_after)
    else:
        watch = al._PGChanges._watch

        def held_up(self, raw):
            why = watch(self, raw)
            time.sleep(0.3)
            return why

        monkeypatch.setattr(al._PGChanges, "_watch", held_up)
    s = Scheduler(url)
    s.every("job", "24h", lambda ctx: None, offset=QUIET)

    async def main():
        async with s:  # (returns once it has looked: its session is held)
            assert [j.name for j in await s.status()] == ["job"]

    try:
        run(main(), timeout=60)
        assert [t.name for t in threading.enumerate() if t.name == "anarchon-listen"] == []
    finally:
        s.close()


def test_a_long_c_call_holding_the_gil_aborts_nothing(url):
    """A plain-function handler in one long C call holds the GIL past ``_PG_VOUCH``: the thread that
    proves the lock session is held up with everything else, and finds the session answering when
    it runs again. Nothing is aborted (on SQLite the same stall is bounded by the lease alone)."""
    took = []
    for _ in range(3):  # the fastest of three: a calibration slowed by a busy machine makes the call too short
        began = time.perf_counter()
        sum(range(2_000_000))
        took.append(time.perf_counter() - began)
    size = int(2_000_000 * 0.8 / max(min(took), 1e-6))  # about 0.8 s in one call
    done = []

    async def main():
        s = Scheduler(url, poll=0.05)

        @s.every("hog", "24h", offset=QUIET)
        def hog(ctx):
            began = time.perf_counter()
            sum(range(size))
            done.append(time.perf_counter() - began)

        @s.every("beside", "24h", offset=QUIET)
        async def beside(ctx):
            await ctx.signal.sleep(2.0)

        async with s:
            await s.trigger("beside")
            await s.trigger("hog")
            await wait_for(lambda: _count(s, "beside", "succeeded", 1), timeout=30, message="beside")
            await wait_for(lambda: _count(s, "hog", "succeeded", 1), timeout=30, message="hog")
            return await statuses(s, "beside") + await statuses(s, "hog")

    assert run(main(), timeout=90) == [(1, "succeeded"), (1, "succeeded")]
    assert done and done[0] > al._PG_VOUCH, f"the GIL was held {done[0]:.2f} s only"


# -- writers take turns (PostgreSQL only: transactions and row locks of the server) -------------


class _Holder:
    """A connection of its own that holds rows locked, as a writer in the middle of its
    transaction does, until ``commit``."""

    def __init__(self, url, statement, args=()):
        import psycopg

        target = al._PGTarget.parse(url)
        self.raw = target.connect(psycopg)
        self.raw.execute("BEGIN")
        self.raw.execute(statement, args)

    def commit(self):
        self.raw.execute("COMMIT")
        self.raw.close()


def waiting_on_a_lock(url):
    """How many of the store's sessions wait on a lock now."""
    found = sql(
        url,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'anarchon_lite' "
        "AND wait_event_type = 'Lock' AND datname = current_database()",
    )
    return found[0][0]


def serialization_failures(pg_server):
    """The server log's serialization failures so far (the tests' own server; None for a given one)."""
    if pg_server.folder is None:
        return None
    with open(f"{pg_server.folder}/log", errors="replace") as log:
        return log.read().count("could not serialize access")


def in_thread(call):
    """``call()`` in a thread; a function that waits for it and gives its result."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(call)
    pool.shutdown(wait=False)
    return lambda: future.result(timeout=60)


def test_a_claim_behind_another_writer_waits_its_turn_and_is_not_failed_and_run_again(url, pg_server):
    """Four processes claim the same due jobs: a claim that meets a job row another transaction
    is writing waits for it and then sees its commit. As SERIALIZABLE transactions, a third of the
    claims failed (could not serialize) and ran again."""
    from test_store import claim_due, declared

    process = Process(url)
    try:
        store = declared(process.open())
        before = serialization_failures(pg_server)
        holder = _Holder(url, "UPDATE jobs SET changed = changed WHERE name = 'job'")
        try:
            result = in_thread(lambda: claim_due(store, "b"))
            run(wait_for(lambda: waiting_on_a_lock(url) == 1, message="the claim waits for the job's row"))
        finally:
            holder.commit()
        claim = result()
        assert isinstance(claim, al._Claim) and claim.attempt == 1
        if before is not None:
            assert serialization_failures(pg_server) == before
    finally:
        process.close()


def test_a_renewal_committed_while_a_takeover_reads_the_run_is_never_overridden(url):
    """The owner's renewal is in flight (its row locked) when another process claims the run as
    expired: the claim waits for it, sees the new lease, and takes nothing; the owner keeps its run."""
    from test_store import claim_due, declared

    process = Process(url)
    try:
        store, other = declared(process.open()), process.open()
        claim = claim_due(store, "a")
        seen = store.runs()[0]
        holder = _Holder(
            url, "UPDATE runs SET lease_until = lease_until + 60 WHERE job = %s AND slot = %s", (claim.job, claim.slot)
        )
        try:
            result = in_thread(lambda: other.claim(seen, "b", 30, 2000, 10, 1, "lease expired"))
            run(wait_for(lambda: waiting_on_a_lock(url) == 1, message="the takeover waits for the run's row"))
        finally:
            holder.commit()
        assert result() is None
        assert store.renew_all("a", [claim]) == []
        assert [(r.owner, r.attempt) for r in store.runs()] == [("a", 1)]
    finally:
        process.close()


def test_a_checkpoint_write_never_waits_for_the_writers_turn(url):
    """A checkpoint is written in one statement, fenced in its WHERE, outside the writers' turn: a
    writer holding the turn (as one cut off in the middle of its transaction does, for up to
    ``_PG_OPEN_WRITE``) does not hold it up. In a transaction of its own, behind the turn, it waited."""
    from test_store import claim_due, declared

    process = Process(url)
    try:
        store = declared(process.open())
        claim = claim_due(store, "a")
        holder = _Holder(url, al._PGTarget.parse(url).format(al._PG_TURN))
        try:
            written = in_thread(lambda: store.checkpoint_write("job", claim.slot, '"mine"', 0, (claim.attempt, "a")))
            assert written() is True
            assert store.checkpoint_write("job", claim.slot, None, 0, (claim.attempt, "a")) is True
            assert store.checkpoint_write("job", claim.slot, None, 0, (claim.attempt, "a")) is True  # (nothing left)
        finally:
            holder.commit()
    finally:
        process.close()


def test_a_checkpoint_write_meeting_a_takeover_in_flight_waits_for_it_and_is_refused(url):
    """The run is being taken over (its row locked by the claim, not yet committed) when the old
    attempt writes its checkpoint: the write waits for the takeover, reads the run again once it is
    committed, and writes nothing. Read as it was when the statement began, the run was still held."""
    from test_store import claim_due, declared

    process = Process(url)
    try:
        store = declared(process.open())
        claim = claim_due(store, "a")
        store.checkpoint_write("job", claim.slot, '"before"', 0, (claim.attempt, "a"))
        holder = _Holder(
            url,
            "UPDATE runs SET attempt = attempt + 1, owner = 'b' WHERE job = %s AND slot = %s",
            (claim.job, claim.slot),
        )
        try:
            written = in_thread(lambda: store.checkpoint_write("job", claim.slot, '"late"', 0, (claim.attempt, "a")))
            run(wait_for(lambda: waiting_on_a_lock(url) == 1, message="the write waits for the run's row"))
        finally:
            holder.commit()
        assert written() is False
        assert store.checkpoint_get("job", claim.slot) == (True, '"before"')
        deleted = store.checkpoint_write("job", claim.slot, None, 0, (claim.attempt, "a"))
        assert deleted is False and store.checkpoint_get("job", claim.slot) == (True, '"before"')
    finally:
        process.close()


@pytest.mark.parametrize("value", ['"late"', None], ids=["set", "delete"])
def test_a_checkpoint_write_the_server_refuses_fails_at_once_and_is_not_made_again(url, value, monkeypatch):
    """A checkpoint write that the server refuses on a live connection (a full disk, 53100, raised
    here by a trigger) fails at once with the server's word: only a lost connection has it made
    again, on a new one. (A review found it made again for 5 s, the store's thread held meanwhile.)"""
    from test_store import claim_due, declared

    process = Process(url)
    try:
        store = declared(process.open())
        claim = claim_due(store, "a")
        sql(
            url,
            "CREATE FUNCTION full_disk() RETURNS trigger LANGUAGE plpgsql AS "
            "$$BEGIN RAISE EXCEPTION 'could not extend file' USING ERRCODE = '53100'; END$$",
        )
        sql(
            url,
            "CREATE TRIGGER disk_full BEFORE INSERT OR UPDATE OR DELETE ON checkpoints FOR EACH ROW EXECUTE FUNCTION full_disk()",
        )
        if value is None:  # (a checkpoint to delete, written around the trigger)
            sql(url, "ALTER TABLE checkpoints DISABLE TRIGGER disk_full")
            store.checkpoint_write("job", claim.slot, '"before"', 0, (claim.attempt, "a"))
            sql(url, "ALTER TABLE checkpoints ENABLE TRIGGER disk_full")
        sent = []
        autocommit = store._autocommit
        monkeypatch.setattr(store, "_autocommit", lambda *args: sent.append(args) or autocommit(*args))
        with pytest.raises(StoreError, match="could not extend file"):
            store.checkpoint_write("job", claim.slot, value, 0, (claim.attempt, "a"))
        assert len(sent) == 1
    finally:
        process.close()


def test_a_claim_that_finds_every_job_moved_tells_no_one(url):
    """Of the processes that claim a due job at once, all but one find its watermark moved: they
    wrote nothing and wake no other process. (Notifications arrive in commit order: the first one
    heard after the claim is the pause's, made on a connection of its own.)"""
    import psycopg
    from test_store import claim_due, declared

    process = Process(url)
    target = al._PGTarget.parse(url)
    listener = target.connect(psycopg)
    try:
        store, other = declared(process.open()), process.open()
        assert isinstance(claim_due(store, "a"), al._Claim)
        listener.execute(f'LISTEN "{al._pg_channel(target)}"')
        assert claim_due(store, "b") is al._NotClaimed.MOVED
        assert other.set_paused("job", True, 5000)
        pause = other._connect().info.backend_pid
        told = next(listener.notifies(timeout=10))
        assert told.pid == pause, "the claim that found the job moved told the others"
    finally:
        listener.close()
        process.close()


def test_a_writer_partitioned_in_the_middle_of_its_transaction_holds_the_others_up_for_seconds(url):
    """A process whose network path freezes (a paused VM) in the middle of a write transaction,
    with the job's row written: the server ends its session after a few seconds of waiting for it
    (``idle_in_transaction_session_timeout`` of the store's connections), and the other processes'
    writes go on. Before, they waited for as long as the partition lasted."""
    import urllib.parse

    from tcpproxy import Proxy
    from test_store import declared

    server = urllib.parse.urlsplit(url)
    proxy = Proxy((server.hostname, server.port))
    frozen, stuck = Process(via_proxy(url, proxy)), Process(url)
    try:
        a, b = declared(frozen.open()), stuck.open()

        def work(conn):
            conn.execute("UPDATE jobs SET paused = 1 WHERE name = 'job'")
            proxy.freeze()
            return conn.execute("SELECT 1").fetchall()

        in_thread(lambda: a._write(work, again=False))  # (it learns of its end once the path thaws)
        run(wait_for(lambda: waiting_on_a_lock(url) == 0 and proxy.frozen, message="the partition"))
        paused = in_thread(lambda: b.set_paused("job", False, 5000))
        assert paused() is True
    finally:
        proxy.thaw()
        frozen.close()
        stuck.close()
        proxy.close()
