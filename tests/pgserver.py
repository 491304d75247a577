"""A throwaway PostgreSQL server for the tests, the chaos run and the benchmarks.

``Server.start()`` runs ``initdb`` into a temporary folder (as the ``postgres`` user when this
process is root: the server refuses to run as root) and starts ``postgres`` on a free TCP port of
127.0.0.1 and a unix socket in that folder, trusting local connections. ``$ANARCHON_TEST_POSTGRES``
(a URL) is used instead when set. ``reason_missing()`` says why no server can be had, or None.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse

GIVEN = "ANARCHON_TEST_POSTGRES"  # a URL: use that server instead of starting one
REQUIRED = "ANARCHON_REQUIRE_POSTGRES"  # set (CI): a missing server fails the tests instead of skipping them


def _binaries() -> str | None:
    initdb = shutil.which("initdb")
    if initdb:
        return os.path.dirname(initdb)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[-3]))
    return os.path.dirname(found[-1]) if found else None


def reason_missing() -> str | None:
    """Why the PostgreSQL tests cannot run here, or None."""
    if os.environ.get(GIVEN):
        return None
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install '.[postgres]')"
    if _binaries() is None:
        return "no PostgreSQL binaries (initdb) on PATH or under /usr/lib/postgresql/*/bin"
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no postgres user to run the server as"
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """One PostgreSQL server: ``url(database)`` to reach it; ``restart()``, ``stop()``."""

    def __init__(self, given: str | None = None):
        self.given = given
        self.folder: str | None = None
        self.port = 0
        self._bin = _binaries()
        self._as: list[str] = []

    @classmethod
    def start(cls) -> Server:
        given = os.environ.get(GIVEN)
        server = cls(given)
        if not given:
            server._init()
            for tries in range(3):  # another session may take the free port first
                try:
                    server._run()
                    break
                except (subprocess.CalledProcessError, RuntimeError):
                    if tries == 2:
                        raise
                    server.port = _free_port()
        return server

    def url(self, database: str = "postgres", **query: str) -> str:
        if self.given:
            parts = urllib.parse.urlsplit(self.given)
            params = dict(urllib.parse.parse_qsl(parts.query), **query)
            return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(params)))
        tail = "?" + urllib.parse.urlencode(query) if query else ""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}{tail}"

    def _command(self, *args: str) -> list[str]:
        assert self._bin is not None
        return [*self._as, os.path.join(self._bin, args[0]), *args[1:]]

    def _init(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="anarchon-pg-")
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
            self._as = ["runuser", "-u", "postgres", "--"]
        os.chmod(self.folder, 0o700)
        subprocess.run(
            self._command("initdb", "-D", f"{self.folder}/data", "-U", "postgres", "--auth=trust", "-E", "UTF8"),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.port = _free_port()

    def _run(self) -> None:
        assert self.folder is not None
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.folder} -c fsync=off "
            "-c max_connections=300 -c shared_preload_libraries=pg_stat_statements"
        )
        subprocess.run(
            self._command(
                "pg_ctl", "-D", f"{self.folder}/data", "-o", options, "-l", f"{self.folder}/log", "-w", "start"
            ),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"the PostgreSQL server on port {self.port} did not start")

    def restart(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: every session is ended) and start it again on the same port."""
        assert self.folder is not None, "cannot restart a server that was given"
        subprocess.run(
            self._command("pg_ctl", "-D", f"{self.folder}/data", "-m", mode, "-w", "stop"),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        self._run()

    def stop(self) -> None:
        if self.folder is None:
            return
        subprocess.run(
            self._command("pg_ctl", "-D", f"{self.folder}/data", "-m", "immediate", "-w", "stop"),
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None


def query(url: str, sql: str, args=()) -> list:
    """The rows of one statement (``%s`` placeholders) in the schema that ``url`` names (``?schema=``),
    on a connection of its own; [] for a statement that returns none."""
    import psycopg

    import anarchon_lite as al

    target = al._PGTarget.parse(url)
    with psycopg.connect(target.conninfo, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'SET search_path TO "{target.schema}"')
        cursor = conn.execute(sql, args)
        return cursor.fetchall() if cursor.description else []


class Bouncer:
    """A PgBouncer in front of ``server``, in ``mode`` (session, transaction or statement pooling),
    on a free port of 127.0.0.1, as the ``postgres`` user when this process is root (PgBouncer
    refuses to run as root). ``Bouncer.missing()`` says why none can be had, or None."""

    def __init__(self, server: Server, mode: str, pool_size: int = 20):
        self.folder = tempfile.mkdtemp(prefix="anarchon-pgbouncer-")
        self.port = _free_port()
        runas = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        target = urllib.parse.urlsplit(server.url())
        with open(f"{self.folder}/users.txt", "w") as handle:
            handle.write('"postgres" ""\n')
        with open(f"{self.folder}/pgbouncer.ini", "w") as handle:
            handle.write(
                "[databases]\n"
                f"* = host={target.hostname} port={target.port}\n"
                "[pgbouncer]\n"
                f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
                f"auth_type = trust\nauth_file = {self.folder}/users.txt\n"
                f"pool_mode = {mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 500\n"
                f"logfile = {self.folder}/pgbouncer.log\npidfile = {self.folder}/pgbouncer.pid\n"
            )
        if runas:
            shutil.chown(self.folder, "postgres", "postgres")
            for name in os.listdir(self.folder):
                shutil.chown(f"{self.folder}/{name}", "postgres", "postgres")
        self._proc = subprocess.Popen(
            [*runas, "pgbouncer", f"{self.folder}/pgbouncer.ini"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not start: {self._proc.stderr.read().decode()}") from None
                time.sleep(0.05)

    @staticmethod
    def missing() -> str | None:
        return None if shutil.which("pgbouncer") else "no pgbouncer (apt install pgbouncer)"

    def url(self, **query: str) -> str:
        tail = "?" + urllib.parse.urlencode(query) if query else ""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres{tail}"

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
