"""The trajectory log's tables, on SQLite (the default) or PostgreSQL (several nodes), through
SQLAlchemy Core so that both run the same statements and the same tests.

Synchronous by design: the core drives it from one writer thread (batched commits) and runs reads
in worker threads, never on the event loop.

Durability: a call is written before it runs (status ``running``) and again when it has a result,
each in a committed transaction, before the reply leaves the daemon. On SQLite in WAL mode with
``synchronous=NORMAL`` (the default) a commit survives the daemon's crash or SIGKILL; after a power
loss or a kernel crash the last commits may be missing. ``durable=True`` (``synchronous=FULL``)
syncs every batched commit to disk. PostgreSQL commits are durable by its own settings.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

META = sa.MetaData()

TRAJECTORIES = sa.Table(
    "trajectories",
    META,
    sa.Column("owner", sa.String(64), primary_key=True),
    sa.Column("id", sa.String(200), primary_key=True),
    sa.Column("sandbox_id", sa.String(64), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("image", sa.String(300), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("closed", sa.Boolean, nullable=False, default=False),  # its sandbox was killed by a call
    sa.Column("rebuilds", sa.Integer, nullable=False, default=0),
    sa.Column("image_version", sa.String(80), nullable=False, default=""),  # what the first sandbox ran on
    sa.Index("trajectories_updated", "updated_at"),
)

# A call is one row, clustered by its key (no rowid table beside the key's index on SQLite): logging a
# call writes one page, not four. A trajectory's length is its last call's seq + 1, not a counter that
# every call would have to update too.
CALLS = sa.Table(
    "trajectory_calls",
    META,
    sa.Column("owner", sa.String(64), primary_key=True),
    sa.Column("trajectory", sa.String(200), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("op", sa.String(32), nullable=False),
    sa.Column("digest", sa.String(64), nullable=False),
    sa.Column("request", sa.Text, nullable=False),  # canonical JSON of the call's parameters
    sa.Column("payload", sa.LargeBinary, nullable=True),  # the bytes it sent (file contents, archives)
    sa.Column("status", sa.String(16), nullable=False),  # running | done | error | interrupted
    sa.Column("result", sa.Text, nullable=True),  # JSON: the result model, or the error
    sa.Column("result_blob", sa.LargeBinary, nullable=True),  # bytes it returned (reads, archives)
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("duration_ms", sa.Float, nullable=True),
    sa.Column("note", sa.Text, nullable=True),  # e.g. what a rebuild's re-run produced differently
    # how often a client's call at this position was answered from the log (a resume), and the last time
    sa.Column("replays", sa.Integer, nullable=False, default=0, server_default=sa.text("0")),
    sa.Column("replayed_at", sa.Float, nullable=True),
    sqlite_with_rowid=False,
)

STATUSES = ("running", "done", "error", "interrupted")

# The statements of the hot path (two transactions per logged call), defined once in SQLAlchemy Core
# and compiled once per database dialect, then run on the connection's DB-API cursor: SQLAlchemy's own
# execution machinery costs ~60 µs a statement here, more than SQLite's work for it (see ``_Sql``).
_TRAJ_KEY = (TRAJECTORIES.c.owner == sa.bindparam("k_owner"), TRAJECTORIES.c.id == sa.bindparam("k_id"))
_CALL_KEY = (
    CALLS.c.owner == sa.bindparam("k_owner"),
    CALLS.c.trajectory == sa.bindparam("k_id"),
    CALLS.c.seq == sa.bindparam("k_seq"),
)


class _Sql:
    def __init__(self, stmt: sa.Insert | sa.Update) -> None:
        self.stmt = stmt
        # per dialect: SQL text, parameter order (positional styles), values fixed in the statement
        self._compiled: dict[str, tuple[str, tuple[str, ...] | None, dict[str, Any]]] = {}

    def run(self, tx: Tx, params: dict[str, Any]) -> int:
        """Execute with ``params`` (by name) in the writer's transaction; returns the rows it touched."""
        dialect = tx.dialect
        compiled = self._compiled.get(dialect.name)
        if compiled is None:
            c = self.stmt.compile(dialect=dialect)
            order = tuple(c.positiontup) if c.positiontup else None
            fixed = {name: b.effective_value for name, b in c.binds.items() if not b.required}
            compiled = self._compiled[dialect.name] = (str(c), order, fixed)
        sql, order, fixed = compiled
        if fixed:
            params = {**fixed, **params}
        cursor = tx.dbapi.cursor()
        args = tuple(params[k] for k in order) if order is not None else params
        dbapi = dialect.loaded_dbapi
        try:
            cursor.execute(sql, args)
            return int(cursor.rowcount)
        except dbapi.Error as e:  # raised as SQLAlchemy raises it (IntegrityError, OperationalError, ...)
            raise sa.exc.DBAPIError.instance(sql, args, e, dbapi.Error, dialect=dialect) from e
        finally:
            cursor.close()


INSERT_TRAJECTORY = _Sql(sa.insert(TRAJECTORIES))
INSERT_CALL = _Sql(sa.insert(CALLS))
# a call is inserted only right after its predecessor (and the key refuses a second one at its seq)
_PREDECESSOR = sa.exists().where(
    CALLS.c.owner == sa.bindparam("owner"),
    CALLS.c.trajectory == sa.bindparam("trajectory"),
    CALLS.c.seq == sa.bindparam("seq") - 1,
)
INSERT_NEXT = _Sql(
    sa.insert(CALLS).from_select(
        [c.name for c in CALLS.columns],
        sa.select(*[sa.bindparam(c.name, type_=c.type) for c in CALLS.columns]).where(_PREDECESSOR),
    )
)
TOUCH = _Sql(sa.update(TRAJECTORIES).where(*_TRAJ_KEY).values(updated_at=sa.bindparam("now")))
CLOSE = _Sql(
    sa.update(TRAJECTORIES).where(*_TRAJ_KEY).values(updated_at=sa.bindparam("now"), closed=sa.bindparam("closed"))
)
FINISH = _Sql(
    sa.update(CALLS)
    .where(*_CALL_KEY)
    .values(
        status=sa.bindparam("status"),
        result=sa.bindparam("result"),
        result_blob=sa.bindparam("result_blob"),
        duration_ms=sa.bindparam("duration_ms"),
        note=sa.bindparam("note"),
    )
)
BIND = _Sql(
    sa.update(TRAJECTORIES)
    .where(*_TRAJ_KEY)
    .values(
        sandbox_id=sa.bindparam("sandbox_id"),
        updated_at=sa.bindparam("now"),
        rebuilds=TRAJECTORIES.c.rebuilds + sa.bindparam("more"),
    )
)
ANNOTATE = _Sql(sa.update(CALLS).where(*_CALL_KEY).values(note=sa.bindparam("note")))
REPLAYED = _Sql(  # the calls at k_seq .. k_end - 1 (one, for a replay the daemon answered itself)
    sa.update(CALLS)
    .where(
        CALLS.c.owner == sa.bindparam("k_owner"),
        CALLS.c.trajectory == sa.bindparam("k_id"),
        CALLS.c.seq >= sa.bindparam("k_seq"),
        CALLS.c.seq < sa.bindparam("k_end"),
    )
    .values(replays=CALLS.c.replays + 1, replayed_at=sa.bindparam("now"))
)


@dataclass(frozen=True)
class TrajectoryRow:
    owner: str
    id: str
    sandbox_id: str
    kind: str
    image: str
    created_at: float
    updated_at: float
    length: int  # calls recorded, the create (seq 0) included; read, not stored
    closed: bool = False
    rebuilds: int = 0
    image_version: str = ""


@dataclass(frozen=True)
class CallRow:
    owner: str
    trajectory: str
    seq: int
    op: str
    digest: str
    request: str
    status: str
    started_at: float
    payload: bytes | None = None
    result: str | None = None
    result_blob: bytes | None = None
    duration_ms: float | None = None
    note: str | None = None
    replays: int = 0  # times a client's call at this position was answered from the log
    replayed_at: float | None = None  # the last of them


@dataclass(frozen=True)
class Tx:
    """The writer's transaction: a DB-API connection (SQLAlchemy's transaction machinery costs ~40 µs a
    commit here; the driver's own commit is what the log needs) and its dialect, to compile for."""

    dbapi: Any
    dialect: sa.Dialect


Write = Callable[[Tx], object]


def engine_url(url: str) -> str:
    """``sqlite:///PATH`` or ``postgresql://...`` (psycopg 3 is the driver)."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


class TrajectoryStore:
    def __init__(self, url: str, *, durable: bool = False) -> None:
        self.url = url
        self.durable = durable
        self.engine = self._engine(engine_url(url))
        # one connection for every write, kept: no pool checkout (nor PostgreSQL ping) per batch. Writes
        # take turns on it; the daemon has one writing thread anyway (the group commit's).
        self._conn: Any = None  # a pooled DB-API connection
        self._write_lock = threading.Lock()
        for attempt in range(6):
            try:
                META.create_all(self.engine)  # checks, then creates: nodes starting at once may race
                add_missing_columns(self.engine, META)
                break
            except sa.exc.DBAPIError:
                if attempt == 5:
                    raise
                time.sleep(0.05 * (attempt + 1))

    def _engine(self, url: str) -> Engine:
        if not url.startswith("sqlite"):
            if not url.startswith("postgresql"):
                raise ValueError(f"trajectory store URL {self.url!r}: use sqlite:///PATH or postgresql://...")
            return sa.create_engine(url, pool_size=8, max_overflow=8, pool_pre_ping=True)
        path = sa.engine.make_url(url).database
        if not path or path == ":memory:":
            raise ValueError("the trajectory store needs a file, not an in-memory SQLite database")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)  # private before SQLite writes
        os.close(fd)
        os.chmod(path, 0o600)
        engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        sync = "FULL" if self.durable else "NORMAL"

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={sync}")
            cur.close()

        return engine

    @property
    def path(self) -> Path | None:
        database = sa.engine.make_url(engine_url(self.url)).database
        return Path(database) if self.url.startswith("sqlite") and database else None

    def close(self) -> None:
        with self._write_lock:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()  # back to the pool
                self._conn = None
        self.engine.dispose()

    # -- writes: closures run by ``write`` inside one transaction ---------------------------------------

    def write(self, batch: Sequence[Write]) -> list[object]:
        """Run writes in one transaction. If that transaction fails, each write is retried in its own,
        so that one bad write fails alone; its slot then holds the exception."""
        try:
            return self._transaction(batch)
        except Exception:
            if len(batch) == 1:
                raise
        out: list[object] = []
        for w in batch:
            try:
                out += self._transaction([w])
            except Exception as e:
                out.append(e)
        return out

    def _transaction(self, batch: Sequence[Write]) -> list[object]:
        with self._write_lock:
            if self._conn is None:
                self._conn = self.engine.raw_connection()
            conn = self._conn
            tx = Tx(conn.driver_connection, self.engine.dialect)
            try:
                out = [w(tx) for w in batch]
                conn.commit()
                return out
            except BaseException as e:
                try:
                    conn.rollback()
                except Exception:  # the connection itself is broken: a new one next time
                    with contextlib.suppress(Exception):
                        conn.invalidate()
                    self._conn = None
                if isinstance(e, sa.exc.DBAPIError) and e.connection_invalidated:
                    self._conn = None
                raise

    @staticmethod
    def begin(row: TrajectoryRow, create: CallRow) -> Write:
        """A new trajectory and its call 0 (the create). Fails if the trajectory exists."""

        fields = _fields(row)
        del fields["length"]

        def w(tx: Tx) -> None:
            INSERT_TRAJECTORY.run(tx, fields)
            INSERT_CALL.run(tx, _fields(create))

        return w

    @staticmethod
    def bind(owner: str, tid: str, sandbox_id: str, *, rebuilt: bool, now: float) -> Write:
        values = {"k_owner": owner, "k_id": tid, "sandbox_id": sandbox_id, "now": now, "more": int(rebuilt)}

        def w(tx: Tx) -> None:
            BIND.run(tx, values)

        return w

    @staticmethod
    def start(call: CallRow, *, touch: bool = True) -> Write:
        """Record a call about to run, as the trajectory's next (its seq must be the length). ``touch``:
        also count the trajectory as written now (retention); the recorder does it now and then."""
        fields = _fields(call)
        key = {"k_owner": call.owner, "k_id": call.trajectory, "now": call.started_at}

        def w(tx: Tx) -> None:
            try:
                inserted = INSERT_NEXT.run(tx, fields)
            except sa.exc.IntegrityError:  # the seq is taken
                inserted = 0
            if inserted != 1:
                raise SequenceConflict(f"{call.trajectory}: call {call.seq} is not the next one")
            if touch:
                TOUCH.run(tx, key)

        return w

    @staticmethod
    def finish(
        owner: str,
        tid: str,
        seq: int,
        *,
        status: str,
        result: str | None,
        result_blob: bytes | None,
        duration_ms: float,
        note: str | None = None,
        closes: bool = False,
        now: float | None = None,
    ) -> Write:
        """A call's outcome (``closes``: its sandbox is gone for good, no rebuild)."""
        if status not in STATUSES:
            raise ValueError(f"unknown call status {status!r}")
        values = {
            "k_owner": owner,
            "k_id": tid,
            "k_seq": seq,
            "status": status,
            "result": result,
            "result_blob": result_blob,
            "duration_ms": duration_ms,
            "note": note,
            "now": time.time() if now is None else now,
            "closed": True,
        }

        def w(tx: Tx) -> None:
            FINISH.run(tx, values)
            if closes:
                CLOSE.run(tx, values)

        return w

    @staticmethod
    def annotate(owner: str, tid: str, seq: int, note: str) -> Write:
        def w(tx: Tx) -> None:
            ANNOTATE.run(tx, {"k_owner": owner, "k_id": tid, "k_seq": seq, "note": note})

        return w

    @staticmethod
    def replayed(owner: str, tid: str, seq: int, now: float, *, end: int | None = None) -> Write:
        """One more answer from the log for the call at ``seq`` (with ``end``: each call up to it)."""
        values = {"k_owner": owner, "k_id": tid, "k_seq": seq, "k_end": seq + 1 if end is None else end, "now": now}

        def w(tx: Tx) -> None:
            REPLAYED.run(tx, values)

        return w

    # -- maintenance ------------------------------------------------------------------------------------

    def interrupt_running(self, sandbox_ids: set[str] | None = None) -> int:
        """At daemon start: calls that were running when the daemon died are interrupted, never done.
        ``sandbox_ids``: only in trajectories bound to these (a node's own, when nodes share the log)."""
        q = sa.update(CALLS).where(CALLS.c.status == "running")
        if sandbox_ids is None:
            with self.engine.begin() as conn:
                return int(conn.execute(q.values(status="interrupted", result=None)).rowcount or 0)
        ids = sorted(sandbox_ids)
        n = 0
        with self.engine.begin() as conn:
            for i in range(0, len(ids), 500):
                bound = sa.select(TRAJECTORIES.c.owner, TRAJECTORIES.c.id).where(
                    TRAJECTORIES.c.sandbox_id.in_(ids[i : i + 500])
                )
                mine = sa.tuple_(CALLS.c.owner, CALLS.c.trajectory).in_(bound)
                n += int(conn.execute(q.where(mine).values(status="interrupted", result=None)).rowcount or 0)
        return n

    def delete(self, owner: str, tid: str) -> bool:
        with self.engine.begin() as conn:
            conn.execute(sa.delete(CALLS).where(CALLS.c.owner == owner, CALLS.c.trajectory == tid))
            res = conn.execute(sa.delete(TRAJECTORIES).where(*_key(owner, tid)))
        return bool(res.rowcount)

    def prune(self, updated_before: float, keep: set[tuple[str, str]] | None = None) -> int:
        """Delete trajectories last written before ``updated_before`` (except ``keep``: live ones)."""
        with self.engine.connect() as conn:
            old = conn.execute(
                sa.select(TRAJECTORIES.c.owner, TRAJECTORIES.c.id).where(TRAJECTORIES.c.updated_at < updated_before)
            ).all()
        gone = 0
        for owner, tid in old:
            if keep and (owner, tid) in keep:
                continue
            gone += self.delete(owner, tid)
        return gone

    # -- reads ------------------------------------------------------------------------------------------

    def get(self, owner: str, tid: str) -> TrajectoryRow | None:
        with self.engine.connect() as conn:
            row = conn.execute(_WITH_LENGTH.where(*_key(owner, tid))).mappings().first()
        return TrajectoryRow(**row) if row else None

    def find(self, owner: str | None = None, *, limit: int = 1000, prefix: str = "") -> list[TrajectoryRow]:
        q = _WITH_LENGTH.order_by(TRAJECTORIES.c.updated_at.desc()).limit(limit)
        if owner is not None:
            q = q.where(TRAJECTORIES.c.owner == owner)
        if prefix:  # literal and case-sensitive on every database (SQLite's LIKE ignores case)
            q = q.where(sa.func.substr(TRAJECTORIES.c.id, 1, len(prefix)) == prefix)
        with self.engine.connect() as conn:
            return [TrajectoryRow(**r) for r in conn.execute(q).mappings()]

    def calls(self, owner: str, tid: str, start: int = 0, limit: int = 1000) -> list[CallRow]:
        q = (
            sa.select(CALLS)
            .where(CALLS.c.owner == owner, CALLS.c.trajectory == tid, CALLS.c.seq >= start)
            .order_by(CALLS.c.seq)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [CallRow(**r) for r in conn.execute(q).mappings()]

    def call(self, owner: str, tid: str, seq: int) -> CallRow | None:
        found = self.calls(owner, tid, seq, 1)
        return found[0] if found and found[0].seq == seq else None


# a trajectory with its length: its last call's seq + 1 (the key's index answers it)
_WITH_LENGTH = sa.select(
    TRAJECTORIES,
    (
        sa.select(sa.func.coalesce(sa.func.max(CALLS.c.seq), -1) + 1)
        .where(CALLS.c.owner == TRAJECTORIES.c.owner, CALLS.c.trajectory == TRAJECTORIES.c.id)
        .scalar_subquery()
        .label("length")
    ),
)


def add_missing_columns(engine: Engine, meta: sa.MetaData) -> list[str]:
    """Add the columns of ``meta``'s tables that the database lacks (a log made by an older dsec:
    ``create_all`` only creates missing tables), each with its default. Returns ``table.column`` of each
    added. Nodes sharing one PostgreSQL may run this at once: there ``IF NOT EXISTS`` makes the later
    ones no-ops; elsewhere a refused duplicate is accepted once the column is seen to exist."""
    missing: list[tuple[sa.Table, sa.Column[Any]]] = []
    with engine.connect() as conn:
        inspector = sa.inspect(conn)
        for table in meta.sorted_tables:
            have = {c["name"] for c in inspector.get_columns(table.name)}
            missing += [(table, column) for column in table.columns if column.name not in have]
    added: list[str] = []
    dialect = engine.dialect
    for table, column in missing:
        if not column.nullable and column.server_default is None:
            raise ValueError(
                f"column {table.name}.{column.name} cannot be added to old rows: it needs a server_default"
            )
        guard = " IF NOT EXISTS" if dialect.name == "postgresql" else ""
        ddl = sa.schema.CreateColumn(column).compile(dialect=dialect)
        sql = f"ALTER TABLE {dialect.identifier_preparer.format_table(table)} ADD COLUMN{guard} {ddl}"
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql(sql)
        except sa.exc.DBAPIError:
            with engine.connect() as conn:
                if column.name not in {c["name"] for c in sa.inspect(conn).get_columns(table.name)}:
                    raise
            continue  # another store added it meanwhile
        added.append(f"{table.name}.{column.name}")
    return added


class SequenceConflict(Exception):
    """A call was recorded at a position that is not the trajectory's next one."""


def _key(owner: str, tid: str) -> tuple[Any, ...]:
    return (TRAJECTORIES.c.owner == owner, TRAJECTORIES.c.id == tid)


def _fields(obj: TrajectoryRow | CallRow) -> dict[str, Any]:
    return dict(obj.__dict__)
