"""A real, throwaway PostgreSQL server for tests: its own data directory and unix socket under /tmp,
no TCP listener, trust authentication, gone (process and files) when stopped.

Plain functions so that any test module can use it::

    reason = pg_unavailable()
    if reason:
        pytest.skip(reason)
    server = start_postgres()
    try:
        url = server.create_database("t1")  # postgresql://postgres@/t1?host=/tmp/dsec-pg-...
    finally:
        server.stop()

PostgreSQL refuses to run as root; as root, initdb and the server run as the ``postgres`` OS user
(through ``setpriv``), otherwise as the current user. As root the server also gets a parent-death signal:
if the test process is killed before stop(), the server shuts down too (only its directory stays behind).
That signal follows the *thread* that started the server, so start it from a thread that outlives it
(pytest's fixtures run in the main thread).
"""

from __future__ import annotations

import atexit
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import psycopg
import sqlalchemy as sa
from psycopg import sql

from dsec.store.trajectories import engine_url

PG_USER = "postgres"  # the OS user the server runs as when the tests run as root, and the database superuser
DATABASE = "dsec"
PORT = 5432  # only names the socket file (.s.PGSQL.5432): every server has a socket directory of its own
_TOOLS = ("initdb", "postgres", "pg_ctl")


def _version_key(path: Path) -> tuple[int, ...]:
    # /usr/lib/postgresql/<version>/bin: 15 > 9.6
    return tuple(int(n) for n in re.findall(r"\d+", path.parent.name)) or (-1,)


def pg_bindir() -> Path | None:
    """The directory of initdb, postgres and pg_ctl: the highest /usr/lib/postgresql/*/bin, else PATH's."""
    candidates = [p for p in Path("/usr/lib/postgresql").glob("*/bin") if all((p / t).is_file() for t in _TOOLS)]
    if candidates:
        return max(candidates, key=_version_key)
    found = shutil.which("pg_ctl")
    if found:
        bindir = Path(found).resolve().parent
        if all((bindir / t).is_file() for t in _TOOLS):
            return bindir
    return None


def _run_as() -> list[str]:
    """The argv prefix that runs a command as the server's user (nothing when not root)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    assert setpriv, "pg_unavailable() should have caught this"
    return [setpriv, f"--reuid={PG_USER}", f"--regid={PG_USER}", "--init-groups"]


def pg_unavailable() -> str | None:
    """Why a server cannot be provided here (a reason to skip), or None when start_postgres() should work."""
    if pg_bindir() is None:
        return "PostgreSQL is not installed (no initdb/postgres/pg_ctl under /usr/lib/postgresql/*/bin or on PATH)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(PG_USER)
        except KeyError:
            return f"running as root and there is no {PG_USER!r} OS user to run PostgreSQL as"
        if shutil.which("setpriv") is None:
            return "running as root and setpriv (util-linux) is missing to run PostgreSQL as another user"
    return None


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}  # no stray PGHOST, PGDATA, ...
    env["LC_ALL"] = "C"
    return env


@dataclass
class PgServer:
    root: Path  # owned by the server's user: data/, the socket, server.log
    bindir: Path
    proc: subprocess.Popen[bytes]
    url: str = ""  # of the database DATABASE, set once it exists
    stopped: bool = False

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(no server log: {e})"

    def database_url(self, name: str = DATABASE, schema: str | None = None) -> str:
        """A URL for dsec.store.trajectories (which maps it to the psycopg 3 driver); with ``schema``, its
        connections use that schema (search_path), so unqualified tables are created and found there
        (give it a lowercase name: search_path folds case)."""
        url = f"postgresql://{PG_USER}@/{name}?host={quote(str(self.root))}"
        if schema:
            url += "&options=" + quote(f"-csearch_path={schema}")
        return url

    def _admin(self, dbname: str = "postgres") -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(host=str(self.root), port=PORT, user=PG_USER, dbname=dbname, autocommit=True)

    def create_database(self, name: str) -> str:
        """A new, empty database; returns its URL."""
        with self._admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.database_url(name)

    def drop_database(self, name: str) -> None:
        """Drop it even if connections are still open (they are terminated)."""
        with self._admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def create_schema(self, schema: str, database: str = DATABASE) -> str:
        """A new, empty schema (cheaper than a database); returns a URL whose connections work in it."""
        with self._admin(database) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        return self.database_url(database, schema)

    def drop_schema(self, schema: str, database: str = DATABASE) -> None:
        """Drop it and its tables. Fails (rather than hangs) if a connection left open still holds a lock."""
        with self._admin(database) as conn:
            conn.execute("SET lock_timeout = '10s'")
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))

    def stop(self) -> None:
        """Stop the server (immediate: nothing here needs to survive) and remove its directory. Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        atexit.unregister(self.stop)
        try:
            if self.proc.poll() is None:
                try:
                    subprocess.run(
                        [*_run_as(), str(self.bindir / "pg_ctl"), "stop", "-D", str(self.data), "-m", "immediate"],
                        cwd=self.root,
                        env=_env(),
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        timeout=30,
                        check=False,
                    )
                except (OSError, subprocess.TimeoutExpired):
                    pass  # killed below
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()  # the postmaster; its backends exit when they notice it is gone
                    self.proc.wait(timeout=15)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def start_postgres(timeout: float = 30.0) -> PgServer:
    """Initialise a cluster in a fresh /tmp/dsec-pg-* directory, start it on a unix socket there, create the
    database DATABASE and check that SQLAlchemy reaches it. Raises RuntimeError (with the server log's tail)
    if it does not come up; call pg_unavailable() first to know whether to skip."""
    reason = pg_unavailable()
    if reason:
        raise RuntimeError(reason)
    bindir = pg_bindir()
    assert bindir is not None
    run_as = _run_as()
    root = Path(tempfile.mkdtemp(prefix="dsec-pg-", dir="/tmp"))
    data = root / "data"
    try:
        log = open(root / "server.log", "wb")
        with log:
            if os.geteuid() == 0:
                user = pwd.getpwnam(PG_USER)
                for path in (root, root / "server.log"):
                    os.chown(path, user.pw_uid, user.pw_gid)
            init = subprocess.run(
                [
                    *run_as,
                    str(bindir / "initdb"),
                    "-D",
                    str(data),
                    "-U",
                    PG_USER,
                    "--auth=trust",  # the local socket only, in a 0700 directory: fine for tests
                    "--encoding=UTF8",
                    "--no-locale",
                    "--no-sync",  # test speed: a throwaway cluster need not survive a power loss
                ],
                cwd=root,
                env=_env(),
                capture_output=True,
                timeout=120,
                check=False,
            )
            if init.returncode != 0:
                output = (init.stdout + init.stderr).decode(errors="replace")[-3000:]
                raise RuntimeError(f"initdb failed ({_describe(init.returncode)}):\n{output}")
            argv = [
                *run_as,
                # should this (test) process die without stopping the server, the server goes with it
                *(["--pdeathsig=SIGQUIT"] if run_as else []),
                str(bindir / "postgres"),
                "-D",
                str(data),
                "-p",
                str(PORT),
                "-c",
                "listen_addresses=",  # no TCP: the unix socket only
                "-c",
                f"unix_socket_directories={root}",
                "-c",
                "fsync=off",  # test speed: a throwaway cluster need not survive a crash
                "-c",
                "synchronous_commit=off",  # test speed, as above
                "-c",
                "full_page_writes=off",  # test speed, as above
            ]
            # the server writes its log to its copy of the descriptor
            proc = subprocess.Popen(argv, cwd=root, env=_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise

    server = PgServer(root=root, bindir=bindir, proc=proc)
    atexit.register(server.stop)  # a last resort; stop() unregisters it
    try:
        _wait_ready(server, timeout)
        with server._admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
        server.url = server.database_url(DATABASE)
        engine = sa.create_engine(engine_url(server.url), poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                name = conn.execute(sa.text("SELECT current_database()")).scalar_one()
        finally:
            engine.dispose()
        if name != DATABASE:
            raise RuntimeError(f"connected to database {name!r} through {server.url}, not {DATABASE!r}")
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: PgServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        code = server.proc.poll()
        if code is not None:
            raise RuntimeError(f"the PostgreSQL server exited ({_describe(code)}) while starting:\n{server.log_tail()}")
        try:
            with server._admin() as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.OperationalError as e:  # no socket yet, or "the database system is starting up"
            last = e
        time.sleep(0.05)
    raise RuntimeError(
        f"the PostgreSQL server in {server.root} was not ready after {timeout:g} s ({last}):\n{server.log_tail()}"
    )


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"status {code}"


@contextmanager
def postgres() -> Iterator[PgServer]:
    """A server for the ``with`` block (the body of a pytest fixture: skip first if pg_unavailable())."""
    server = start_postgres()
    try:
        yield server
    finally:
        server.stop()
