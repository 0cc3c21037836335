"""The trajectory log's store, the same tests on SQLite and on a real PostgreSQL server (tests/pg.py)."""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa

from dsec.store.trajectories import (
    CALLS,
    META,
    TRAJECTORIES,
    CallRow,
    SequenceConflict,
    TrajectoryRow,
    TrajectoryStore,
    Write,
    add_missing_columns,
    engine_url,
)

from ...pg import PgServer, pg_unavailable, start_postgres

T0 = 1_733_241_600.123456  # a realistic time.time(): floats must round-trip exactly
OWNER = "alice"


# -- backends -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pg_server() -> Iterator[PgServer]:
    """One real server for the module; each test gets a fresh schema of its own on it (see ``url``)."""
    reason = pg_unavailable()
    if reason:
        pytest.skip(reason)
    server = start_postgres()  # any failure here is an error, not a skip
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def sqlite_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsec-traj-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "sqlite":
        d = Path(tempfile.mkdtemp(prefix="dsec-traj-", dir="/tmp"))
        try:
            yield f"sqlite:///{d}/trajectories.db"
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return
    server: PgServer = request.getfixturevalue("pg_server")
    schema = f"t_{uuid.uuid4().hex[:16]}"  # a fresh, empty schema per test: ~20 ms, a database costs ~120 ms
    schema_url = server.create_schema(schema)
    try:
        yield schema_url
    finally:
        server.drop_schema(schema)


@pytest.fixture
def store(url: str) -> Iterator[TrajectoryStore]:
    s = TrajectoryStore(url)
    try:
        yield s
    finally:
        s.close()


# -- helpers --------------------------------------------------------------------------------------------


def traj(tid: str, owner: str = OWNER, t: float = T0, sandbox: str = "sb-1") -> TrajectoryRow:
    return TrajectoryRow(
        owner=owner,
        id=tid,
        sandbox_id=sandbox,
        kind="container",
        image="test/img:1",
        created_at=t,
        updated_at=t,
        length=1,
    )


def call(
    tid: str, seq: int, owner: str = OWNER, t: float = T0, status: str = "running", payload: bytes | None = None
) -> CallRow:
    return CallRow(
        owner=owner,
        trajectory=tid,
        seq=seq,
        op="create" if seq == 0 else "exec",
        digest=f"{seq:064x}",
        request=json.dumps({"trajectory": tid, "seq": seq, "owner": owner}),
        status=status,
        started_at=t,
        payload=payload,
    )


def begin(store: TrajectoryStore, tid: str, owner: str = OWNER, t: float = T0) -> tuple[TrajectoryRow, CallRow]:
    row, create = traj(tid, owner, t), call(tid, 0, owner, t)
    assert store.write([TrajectoryStore.begin(row, create)]) == [None]
    return row, create


def finish(tid: str, seq: int, owner: str = OWNER, status: str = "done", closes: bool = False) -> Write:
    return TrajectoryStore.finish(
        owner,
        tid,
        seq,
        status=status,
        result=json.dumps({"of": f"{owner}/{tid}#{seq}"}),
        result_blob=None,
        duration_ms=1.5,
        closes=closes,
    )


def call_count(store: TrajectoryStore, owner: str, tid: str) -> int:
    """Counted in SQL, not through the store's reads."""
    with store.engine.connect() as conn:
        q = sa.select(sa.func.count()).select_from(CALLS).where(CALLS.c.owner == owner, CALLS.c.trajectory == tid)
        return int(conn.execute(q).scalar_one())


# -- begin, get, calls, owners --------------------------------------------------------------------------


def test_begin_then_get_and_calls(store: TrajectoryStore) -> None:
    payload = b"\x00tar\xff\x00" * 100
    row = traj("run-1")
    create = call("run-1", 0, payload=payload)
    assert store.write([TrajectoryStore.begin(row, create)]) == [None]

    assert store.get(OWNER, "run-1") == row
    got = store.calls(OWNER, "run-1")
    assert got == [create]
    assert type(got[0].payload) is bytes and got[0].payload == payload
    assert store.call(OWNER, "run-1", 0) == create
    assert store.call(OWNER, "run-1", 1) is None
    assert store.get(OWNER, "run-2") is None
    assert store.calls(OWNER, "run-2") == []


def test_begin_twice_fails_and_keeps_the_first(store: TrajectoryStore) -> None:
    row, create = begin(store, "run-1")
    again = TrajectoryStore.begin(traj("run-1", sandbox="sb-other", t=T0 + 5), call("run-1", 0, t=T0 + 5))
    with pytest.raises(sa.exc.IntegrityError):
        store.write([again])
    assert store.get(OWNER, "run-1") == row
    assert store.calls(OWNER, "run-1") == [create]


def test_owners_are_separate(store: TrajectoryStore) -> None:
    a_row, a_create = begin(store, "run-1", owner="alice")
    begin(store, "run-1", owner="bob", t=T0 + 1)
    begin(store, "run-2", owner="bob", t=T0 + 2)
    store.write([TrajectoryStore.start(call("run-1", 1, owner="bob", t=T0 + 3))])

    assert store.find("alice") == [a_row]
    assert [r.id for r in store.find("bob")] == ["run-1", "run-2"]  # run-1 was written last
    assert all(r.owner == "bob" for r in store.find("bob"))
    assert store.find("carol") == []
    assert len(store.find()) == 3
    assert store.calls("alice", "run-1") == [a_create]
    assert [c.seq for c in store.calls("bob", "run-1")] == [0, 1]
    assert store.get("alice", "run-1") == a_row  # bob's start did not touch alice's length
    got_b = store.get("bob", "run-1")
    assert got_b is not None and got_b.length == 2

    assert store.delete("alice", "run-1")
    assert store.get("alice", "run-1") is None
    assert store.calls("alice", "run-1") == []
    assert [c.seq for c in store.calls("bob", "run-1")] == [0, 1]


# -- start ----------------------------------------------------------------------------------------------


def test_start_at_the_next_seq_grows_the_trajectory(store: TrajectoryStore) -> None:
    begin(store, "run-1")
    c1 = call("run-1", 1, t=T0 + 10, payload=b"\x00\xff")
    assert store.write([TrajectoryStore.start(c1)]) == [None]
    got = store.get(OWNER, "run-1")
    assert got is not None and got.length == 2 and got.updated_at == T0 + 10 and got.created_at == T0
    assert store.call(OWNER, "run-1", 1) == c1

    store.write([TrajectoryStore.start(call("run-1", 2, t=T0 + 20))])
    got = store.get(OWNER, "run-1")
    assert got is not None and got.length == 3 and got.updated_at == T0 + 20
    assert [c.seq for c in store.calls(OWNER, "run-1")] == [0, 1, 2]


@pytest.mark.parametrize("seq", [0, 2, 7, -1])
def test_start_at_a_wrong_seq_writes_nothing(store: TrajectoryStore, seq: int) -> None:
    row, create = begin(store, "run-1")
    with pytest.raises(SequenceConflict):
        store.write([TrajectoryStore.start(call("run-1", seq, t=T0 + 10))])
    assert store.get(OWNER, "run-1") == row  # length and updated_at unchanged
    assert store.calls(OWNER, "run-1") == [create]
    assert call_count(store, OWNER, "run-1") == 1


def test_start_of_a_missing_trajectory_writes_nothing(store: TrajectoryStore) -> None:
    with pytest.raises(SequenceConflict):
        store.write([TrajectoryStore.start(call("ghost", 0))])
    with pytest.raises(SequenceConflict):
        store.write([TrajectoryStore.start(call("ghost", 1))])
    assert store.get(OWNER, "ghost") is None
    assert call_count(store, OWNER, "ghost") == 0


def test_a_conflict_in_a_batch_fails_alone(store: TrajectoryStore) -> None:
    for tid in ("a", "b", "c"):
        begin(store, tid)
    b_before = store.get(OWNER, "b")
    batch = [
        TrajectoryStore.start(call("a", 1, t=T0 + 1)),
        TrajectoryStore.start(call("b", 5, t=T0 + 1)),  # b's next call is 1
        finish("a", 1),
        TrajectoryStore.start(call("c", 1, t=T0 + 1)),
        TrajectoryStore.start(call("c", 2, t=T0 + 2)),
    ]
    out = store.write(batch)
    assert len(out) == 5
    assert isinstance(out[1], SequenceConflict)
    assert [out[i] for i in (0, 2, 3, 4)] == [None, None, None, None]

    a = store.get(OWNER, "a")
    c = store.get(OWNER, "c")
    assert a is not None and a.length == 2
    assert c is not None and c.length == 3 and c.updated_at == T0 + 2
    a1 = store.call(OWNER, "a", 1)
    assert a1 is not None and a1.status == "done" and a1.result == json.dumps({"of": f"{OWNER}/a#1"})
    assert store.get(OWNER, "b") == b_before
    assert call_count(store, OWNER, "b") == 1
    assert store.call(OWNER, "b", 5) is None


# -- finish ---------------------------------------------------------------------------------------------


def test_finish_records_the_result(store: TrajectoryStore) -> None:
    begin(store, "run-1")
    store.write([TrajectoryStore.start(call("run-1", 1))])
    blob = bytes(range(256)) * 4 + b"\x00\x00\xff\xff"
    store.write(
        [
            TrajectoryStore.finish(
                OWNER,
                "run-1",
                1,
                status="done",
                result='{"exit_code": 0, "text": "é\\u0000"}',
                result_blob=blob,
                duration_ms=12.25,
                note="re-run differed",
            )
        ]
    )
    got = store.call(OWNER, "run-1", 1)
    assert got is not None
    assert got.status == "done"
    assert got.result == '{"exit_code": 0, "text": "é\\u0000"}'
    assert type(got.result_blob) is bytes and got.result_blob == blob
    assert got.duration_ms == 12.25
    assert got.note == "re-run differed"
    row = store.get(OWNER, "run-1")
    assert row is not None and row.closed is False and row.length == 2


def test_finish_with_a_large_blob(store: TrajectoryStore) -> None:
    begin(store, "run-1")
    store.write([TrajectoryStore.start(call("run-1", 1))])
    blob = b"\x00\xff" + os.urandom(5 * 1024 * 1024) + b"\xff\x00"
    store.write(
        [TrajectoryStore.finish(OWNER, "run-1", 1, status="done", result=None, result_blob=blob, duration_ms=1.0)]
    )
    got = store.call(OWNER, "run-1", 1)
    assert got is not None and got.result_blob == blob


def test_finish_that_closes_and_errors(store: TrajectoryStore) -> None:
    begin(store, "run-1")
    store.write([TrajectoryStore.start(call("run-1", 1))])
    store.write([finish("run-1", 1, status="error", closes=True)])
    row = store.get(OWNER, "run-1")
    assert row is not None and row.closed is True
    got = store.call(OWNER, "run-1", 1)
    assert got is not None and got.status == "error"
    assert store.call(OWNER, "run-1", 0) == call("run-1", 0)  # the other call is untouched


def test_finish_with_an_unknown_status_is_refused(store: TrajectoryStore) -> None:
    begin(store, "run-1")
    store.write([TrajectoryStore.start(call("run-1", 1))])
    with pytest.raises(ValueError, match="unknown call status"):
        finish("run-1", 1, status="finished")
    got = store.call(OWNER, "run-1", 1)
    assert got is not None and got.status == "running"


def test_annotate(store: TrajectoryStore) -> None:
    begin(store, "run-1")
    store.write([TrajectoryStore.annotate(OWNER, "run-1", 0, "rebuilt: stdout differed")])
    got = store.call(OWNER, "run-1", 0)
    assert got is not None and got.note == "rebuilt: stdout differed" and got.status == "running"


def test_replayed_counts_and_keeps_the_last_time(store: TrajectoryStore) -> None:
    begin(store, "run-1")
    store.write([TrajectoryStore.start(call("run-1", 1)), finish("run-1", 1)])
    fresh = store.call(OWNER, "run-1", 1)
    assert fresh is not None and (fresh.replays, fresh.replayed_at) == (0, None)
    store.write([TrajectoryStore.replayed(OWNER, "run-1", 1, T0 + 5)])
    store.write([TrajectoryStore.replayed(OWNER, "run-1", 1, T0 + 9), TrajectoryStore.replayed(OWNER, "run-1", 0, T0)])
    got = store.calls(OWNER, "run-1")
    assert [(c.seq, c.replays, c.replayed_at) for c in got] == [(0, 1, T0), (1, 2, T0 + 9)]
    assert got[1].status == "done" and got[1].result == json.dumps({"of": f"{OWNER}/run-1#1"})  # nothing else moved
    store.write([TrajectoryStore.replayed(OWNER, "run-1", 7, T0)])  # no such call: a no-op, not an error
    assert call_count(store, OWNER, "run-1") == 2


# -- maintenance ----------------------------------------------------------------------------------------


def test_interrupt_running(store: TrajectoryStore) -> None:
    for tid in ("a", "b"):
        begin(store, tid)
        store.write([finish(tid, 0)])
        store.write([TrajectoryStore.start(call(tid, 1)), TrajectoryStore.start(call(tid, 2))])
    store.write([finish("a", 1, status="error"), finish("b", 1)])  # a: 0 done, 1 error, 2 running; b: 2 running
    begin(store, "c", owner="bob")  # its create is still running

    assert store.interrupt_running() == 3
    status = {(c.trajectory, c.seq): c.status for t in ("a", "b") for c in store.calls(OWNER, t)}
    assert status == {
        ("a", 0): "done",
        ("a", 1): "error",
        ("a", 2): "interrupted",
        ("b", 0): "done",
        ("b", 1): "done",
        ("b", 2): "interrupted",
    }
    c0 = store.call("bob", "c", 0)
    assert c0 is not None and c0.status == "interrupted" and c0.result is None
    b1 = store.call(OWNER, "b", 1)
    assert b1 is not None and b1.result == json.dumps({"of": f"{OWNER}/b#1"})  # results of done calls are kept
    assert store.interrupt_running() == 0


def test_bind(store: TrajectoryStore) -> None:
    begin(store, "run-1")
    store.write([TrajectoryStore.bind(OWNER, "run-1", "sb-2", rebuilt=True, now=T0 + 5)])
    row = store.get(OWNER, "run-1")
    assert row is not None
    assert (row.sandbox_id, row.rebuilds, row.updated_at, row.length) == ("sb-2", 1, T0 + 5, 1)
    store.write([TrajectoryStore.bind(OWNER, "run-1", "sb-3", rebuilt=True, now=T0 + 6)])
    store.write([TrajectoryStore.bind(OWNER, "run-1", "sb-4", rebuilt=False, now=T0 + 7)])
    row = store.get(OWNER, "run-1")
    assert row is not None
    assert (row.sandbox_id, row.rebuilds, row.updated_at) == ("sb-4", 2, T0 + 7)


def test_find_orders_by_last_write_and_limits(store: TrajectoryStore) -> None:
    for i, tid in enumerate(["r0", "r1", "r2", "r3", "r4"]):
        begin(store, tid, t=T0 + i)
    store.write([TrajectoryStore.start(call("r1", 1, t=T0 + 100))])
    store.write([TrajectoryStore.bind(OWNER, "r3", "sb-9", rebuilt=False, now=T0 + 50)])

    assert [r.id for r in store.find(OWNER)] == ["r1", "r3", "r4", "r2", "r0"]
    assert [r.id for r in store.find(OWNER, limit=2)] == ["r1", "r3"]
    assert [r.id for r in store.find(limit=1)] == ["r1"]


def test_find_by_prefix_is_literal(store: TrajectoryStore) -> None:
    ids = ["a%b-1", "axb-1", "a_c-1", "abc-1", "a/b-1", "a\\b-1", "b-1"]
    for i, tid in enumerate(ids):
        begin(store, tid, t=T0 + i)

    def ids_for(prefix: str) -> set[str]:
        return {r.id for r in store.find(OWNER, prefix=prefix)}

    assert ids_for("a%") == {"a%b-1"}
    assert ids_for("a_") == {"a_c-1"}
    assert ids_for("a/") == {"a/b-1"}
    assert ids_for("a\\") == {"a\\b-1"}
    assert ids_for("a") == set(ids) - {"b-1"}
    assert ids_for("") == set(ids)
    assert ids_for("%") == set()
    assert ids_for("abc-1") == {"abc-1"}
    assert [r.id for r in store.find(OWNER, prefix="a", limit=2)] == ["a\\b-1", "a/b-1"]


def test_find_by_prefix_is_case_sensitive(store: TrajectoryStore) -> None:
    """Trajectory ids are case-sensitive keys (run-1 and Run-1 are two trajectories on both backends)."""
    begin(store, "Run-1")
    begin(store, "run-2", t=T0 + 1)
    assert {r.id for r in store.find(OWNER, prefix="run")} == {"run-2"}
    assert {r.id for r in store.find(OWNER, prefix="Run")} == {"Run-1"}


def test_calls_pages(store: TrajectoryStore) -> None:
    begin(store, "run-1")
    store.write([TrajectoryStore.start(call("run-1", seq, t=T0 + seq)) for seq in range(1, 25)])
    assert [c.seq for c in store.calls(OWNER, "run-1", 0, 10)] == list(range(10))
    assert [c.seq for c in store.calls(OWNER, "run-1", 10, 10)] == list(range(10, 20))
    assert [c.seq for c in store.calls(OWNER, "run-1", 20, 10)] == list(range(20, 25))
    assert store.calls(OWNER, "run-1", 25, 10) == []
    assert [c.seq for c in store.calls(OWNER, "run-1", 3, 1)] == [3]
    assert len(store.calls(OWNER, "run-1")) == 25
    c24 = store.call(OWNER, "run-1", 24)
    assert c24 is not None and c24.started_at == T0 + 24
    assert store.call(OWNER, "run-1", 25) is None


def test_prune(store: TrajectoryStore) -> None:
    for tid in ("old-1", "old-2", "old-live"):
        begin(store, tid, t=T0)
        store.write([TrajectoryStore.start(call(tid, 1, t=T0 + 1))])
    begin(store, "old-bob", owner="bob", t=T0)
    begin(store, "edge", t=T0 + 200)  # updated exactly at the cut: kept (strictly before is old)
    begin(store, "new", t=T0 + 300)

    gone = store.prune(T0 + 200, keep={(OWNER, "old-live"), ("bob", "new")})
    assert gone == 3
    assert {r.id for r in store.find()} == {"old-live", "edge", "new"}
    for owner, tid in ((OWNER, "old-1"), (OWNER, "old-2"), ("bob", "old-bob")):
        assert store.get(owner, tid) is None
        assert call_count(store, owner, tid) == 0
    assert [c.seq for c in store.calls(OWNER, "old-live")] == [0, 1]
    assert store.prune(T0 + 200, keep={(OWNER, "old-live")}) == 0
    assert store.prune(T0 + 1000) == 3
    assert store.find() == []
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(CALLS)).scalar_one() == 0


def test_delete(store: TrajectoryStore) -> None:
    begin(store, "run-1")
    begin(store, "run-2")
    store.write([TrajectoryStore.start(call("run-1", 1))])
    assert store.delete(OWNER, "run-1") is True
    assert store.get(OWNER, "run-1") is None
    assert call_count(store, OWNER, "run-1") == 0
    assert store.delete(OWNER, "run-1") is False
    assert store.delete(OWNER, "never") is False
    assert store.delete("bob", "run-2") is False
    assert store.get(OWNER, "run-2") is not None


def test_reopen_keeps_everything(url: str) -> None:
    first = TrajectoryStore(url)
    try:
        begin(first, "run-1")
        first.write([TrajectoryStore.start(call("run-1", 1)), finish("run-1", 1)])
    finally:
        first.close()
    second = TrajectoryStore(url)  # creating the tables again is a no-op
    try:
        got = second.get(OWNER, "run-1")
        assert got is not None and got.length == 2
        assert [c.status for c in second.calls(OWNER, "run-1")] == ["running", "done"]
    finally:
        second.close()


def test_stores_opened_at_once_on_a_fresh_database(url: str) -> None:
    """Several daemons (nodes sharing one PostgreSQL database) starting together: each creates the tables
    if they are missing, and none fails because another one created them first."""
    for _ in range(5):
        gate = threading.Barrier(8)

        def open_one(gate: threading.Barrier = gate) -> None:
            gate.wait()
            TrajectoryStore(url).close()

        with ThreadPoolExecutor(8) as pool:
            for f in [pool.submit(open_one) for _ in range(8)]:
                f.result()
        engine = sa.create_engine(engine_url(url))
        try:
            assert {TRAJECTORIES.name, CALLS.name} <= set(sa.inspect(engine).get_table_names())
            META.drop_all(engine)  # fresh again for the next round
        finally:
            engine.dispose()


# -- concurrency ----------------------------------------------------------------------------------------

THREADS = 16
PER_THREAD = 63  # 1008 trajectories
CALLS_EACH = 5  # after the create: every trajectory ends with length 6


def _expected(owner: str, tid: str, seq: int) -> tuple[str, bytes]:
    text = f"{owner}/{tid}#{seq}"
    return json.dumps({"of": text}), text.encode() + b"\x00\xff"


def _writes_of(owner: str, tid: str, t: float) -> list[Write]:
    """A trajectory's writes, in the order they must run: begin, then start + finish per call."""
    row, create = traj(tid, owner, t), call(tid, 0, owner, t, status="done")
    result0, _ = _expected(owner, tid, 0)
    create = CallRow(**{**create.__dict__, "result": result0})
    out: list[Write] = [TrajectoryStore.begin(row, create)]
    for seq in range(1, CALLS_EACH + 1):
        result, blob = _expected(owner, tid, seq)
        out.append(TrajectoryStore.start(call(tid, seq, owner, t + seq, payload=f"{tid}:{seq}".encode())))
        out.append(
            TrajectoryStore.finish(
                owner, tid, seq, status="done", result=result, result_blob=blob, duration_ms=float(seq)
            )
        )
    return out


def test_concurrent_writers_lose_and_mix_nothing(store: TrajectoryStore) -> None:
    def worker(n: int) -> int:
        rng = random.Random(n)
        owner = f"owner-{n % 4}"  # four threads per owner
        queues = [_writes_of(owner, f"t{n:02d}-{i:03d}", T0 + i) for i in range(PER_THREAD)]
        for q in queues:
            q.reverse()
        batches = 0
        while queues:
            # batches of 1..12 writes, drawn from random trajectories, each trajectory's writes in order
            batch: list[Write] = []
            for _ in range(rng.randint(1, 12)):
                if not queues:
                    break
                i = rng.randrange(len(queues))
                batch.append(queues[i].pop())
                if not queues[i]:
                    queues.pop(i)
            out = store.write(batch)
            failed = [r for r in out if isinstance(r, BaseException)]
            assert not failed, failed
            assert out == [None] * len(batch)
            batches += 1
        return batches

    started = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        batches = sum(pool.map(worker, range(THREADS)))  # re-raises a worker's failure
    elapsed = time.perf_counter() - started
    assert batches > THREADS * PER_THREAD * (1 + 2 * CALLS_EACH) / 12

    rows = store.find(limit=10_000)
    assert len(rows) == THREADS * PER_THREAD
    for r in rows:
        assert r.length == CALLS_EACH + 1, r
        assert r.owner == f"owner-{int(r.id[1:3]) % 4}", r
        assert not r.closed and r.rebuilds == 0

    with store.engine.connect() as conn:
        all_calls = [CallRow(**m) for m in conn.execute(sa.select(CALLS)).mappings()]
    assert len(all_calls) == THREADS * PER_THREAD * (CALLS_EACH + 1)
    seen: dict[tuple[str, str], list[int]] = {}
    for c in all_calls:
        result, blob = _expected(c.owner, c.trajectory, c.seq)
        assert c.status == "done", c
        assert c.result == result, c
        assert json.loads(c.request) == {"trajectory": c.trajectory, "seq": c.seq, "owner": c.owner}
        if c.seq:
            assert c.result_blob == blob and c.payload == f"{c.trajectory}:{c.seq}".encode()
        seen.setdefault((c.owner, c.trajectory), []).append(c.seq)
    assert {k: sorted(v) for k, v in seen.items()} == {(r.owner, r.id): list(range(CALLS_EACH + 1)) for r in rows}
    print(f"{len(all_calls)} calls in {batches} batches by {THREADS} threads: {elapsed:.2f} s")


def test_racing_starts_admit_exactly_one(store: TrajectoryStore) -> None:
    begin(store, "run-1")
    rounds, racers = 6, 12
    for r in range(rounds):
        seq = r + 1
        gate = threading.Barrier(racers)

        def racer(n: int, seq: int = seq, gate: threading.Barrier = gate) -> str:
            c = call("run-1", seq, t=T0 + seq)
            c = CallRow(**{**c.__dict__, "digest": f"racer-{n}"})
            gate.wait()
            try:
                store.write([TrajectoryStore.start(c)])
            except SequenceConflict:
                return "lost"
            return f"racer-{n}"

        with ThreadPoolExecutor(racers) as pool:
            outcomes = list(pool.map(racer, range(racers)))
        winners = [o for o in outcomes if o != "lost"]
        assert len(winners) == 1, outcomes
        got = store.call(OWNER, "run-1", seq)
        assert got is not None and got.digest == winners[0]
    row = store.get(OWNER, "run-1")
    assert row is not None and row.length == rounds + 1
    assert call_count(store, OWNER, "run-1") == rounds + 1


# -- SQLite only ----------------------------------------------------------------------------------------


def _pragma(store: TrajectoryStore, name: str) -> object:
    with store.engine.connect() as conn:
        return conn.exec_driver_sql(f"PRAGMA {name}").scalar()


def test_sqlite_file_is_private(sqlite_dir: Path) -> None:
    path = sqlite_dir / "t.db"
    old = os.umask(0o022)
    try:
        store = TrajectoryStore(f"sqlite:///{path}")
    finally:
        os.umask(old)
    try:
        assert store.path == path
        begin(store, "run-1")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        for side in ("-wal", "-shm"):  # SQLite gives these the database file's mode
            extra = Path(f"{path}{side}")
            assert extra.exists() and stat.S_IMODE(extra.stat().st_mode) == 0o600, side
    finally:
        store.close()


def test_sqlite_existing_file_is_made_private(sqlite_dir: Path) -> None:
    path = sqlite_dir / "t.db"
    path.touch(mode=0o644)
    path.chmod(0o644)
    store = TrajectoryStore(f"sqlite:///{path}")
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        store.close()


def test_sqlite_pragmas(sqlite_dir: Path) -> None:
    default = TrajectoryStore(f"sqlite:///{sqlite_dir / 'default.db'}")
    durable = TrajectoryStore(f"sqlite:///{sqlite_dir / 'durable.db'}", durable=True)
    try:
        assert _pragma(default, "synchronous") == 1  # NORMAL
        assert _pragma(durable, "synchronous") == 2  # FULL
        assert _pragma(default, "journal_mode") == "wal"
        assert _pragma(durable, "journal_mode") == "wal"
        # on every pooled connection, not only the first
        with default.engine.connect() as c1, default.engine.connect() as c2:
            assert c1.exec_driver_sql("PRAGMA synchronous").scalar() == 1
            assert c2.exec_driver_sql("PRAGMA synchronous").scalar() == 1
        with durable.engine.connect() as c1, durable.engine.connect() as c2:
            assert c1.exec_driver_sql("PRAGMA synchronous").scalar() == 2
            assert c2.exec_driver_sql("PRAGMA synchronous").scalar() == 2
    finally:
        default.close()
        durable.close()


@pytest.mark.parametrize("bad", ["mysql://x", "sqlite:///:memory:", "sqlite://", "mongodb://h/db"])
def test_bad_urls_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        TrajectoryStore(bad)


def test_engine_url() -> None:
    assert engine_url("postgresql://u@/db?host=/tmp/x") == "postgresql+psycopg://u@/db?host=/tmp/x"
    assert engine_url("postgres://u:p@h:5433/db") == "postgresql+psycopg://u:p@h:5433/db"
    assert engine_url("sqlite:////var/lib/dsec/t.db") == "sqlite:////var/lib/dsec/t.db"


# -- PostgreSQL only ------------------------------------------------------------------------------------


def test_postgres_alias_url(pg_server: PgServer) -> None:
    name = f"t_{uuid.uuid4().hex[:16]}"
    pg_url = pg_server.create_database(name)
    try:
        store = TrajectoryStore(pg_url.replace("postgresql://", "postgres://", 1))
        try:
            assert store.path is None
            row, _ = begin(store, "run-1")
            assert store.get(OWNER, "run-1") == row
            with store.engine.connect() as conn:
                assert conn.dialect.name == "postgresql" and conn.dialect.driver == "psycopg"
                tables = set(sa.inspect(conn).get_table_names())
            assert {TRAJECTORIES.name, CALLS.name} <= tables
        finally:
            store.close()
    finally:
        pg_server.drop_database(name)


def test_postgres_schemas_keep_tests_apart(pg_server: PgServer) -> None:
    """The per-test isolation the ``url`` fixture relies on: each URL's tables live in its own schema."""
    names = [f"t_{uuid.uuid4().hex[:16]}" for _ in range(2)]
    stores = [TrajectoryStore(pg_server.create_schema(n)) for n in names]
    try:
        begin(stores[0], "run-1")
        assert stores[1].get(OWNER, "run-1") is None
        assert stores[1].find() == []
        for store, name in zip(stores, names, strict=True):
            with store.engine.connect() as conn:
                assert conn.execute(sa.text("SELECT current_schema()")).scalar_one() == name
                assert {TRAJECTORIES.name, CALLS.name} <= set(sa.inspect(conn).get_table_names(schema=name))
    finally:
        for store, name in zip(stores, names, strict=True):
            store.close()
            pg_server.drop_schema(name)


# -- a log made by an older dsec: its tables gain the columns added since ------------------------------


def _old_schema(dialect: str) -> list[str]:
    """The tables as dsec created them before calls counted their replays, written out by hand."""
    blob, rowid = ("BYTEA", "") if dialect == "postgresql" else ("BLOB", " WITHOUT ROWID")
    return [
        "CREATE TABLE trajectories (owner VARCHAR(64) NOT NULL, id VARCHAR(200) NOT NULL, "
        "sandbox_id VARCHAR(64) NOT NULL, kind VARCHAR(32) NOT NULL, image VARCHAR(300) NOT NULL, "
        "created_at FLOAT NOT NULL, updated_at FLOAT NOT NULL, closed BOOLEAN NOT NULL, rebuilds INTEGER NOT NULL, "
        "image_version VARCHAR(80) NOT NULL, PRIMARY KEY (owner, id))",
        "CREATE INDEX trajectories_updated ON trajectories (updated_at)",
        "CREATE TABLE trajectory_calls (owner VARCHAR(64) NOT NULL, trajectory VARCHAR(200) NOT NULL, "
        "seq INTEGER NOT NULL, op VARCHAR(32) NOT NULL, digest VARCHAR(64) NOT NULL, request TEXT NOT NULL, "
        f"payload {blob}, status VARCHAR(16) NOT NULL, result TEXT, result_blob {blob}, started_at FLOAT NOT NULL, "
        f"duration_ms FLOAT, note TEXT, PRIMARY KEY (owner, trajectory, seq)){rowid}",
        "INSERT INTO trajectories VALUES ('alice', 'old-1', 'sb-old', 'container', 'test/img:1', 100.5, 200.25, "
        "false, 1, 'sha256:feed')",
        "INSERT INTO trajectory_calls VALUES ('alice', 'old-1', 0, 'create', 'd0', '{}', NULL, 'done', '{\"id\":1}', "
        "NULL, 100.5, 0.0, NULL)",
        "INSERT INTO trajectory_calls VALUES ('alice', 'old-1', 1, 'exec', 'd1', '{\"cmd\":\"ls\"}', NULL, 'done', "
        "'{\"exit_code\":0}', NULL, 101.0, 2.5, 'rebuild 1: differed')",
    ]


def _make_old(url: str) -> None:
    engine = sa.create_engine(engine_url(url))
    try:
        with engine.begin() as conn:
            for stmt in _old_schema(engine.dialect.name):
                conn.exec_driver_sql(stmt)
    finally:
        engine.dispose()


def _columns(url: str, table: str) -> dict[str, dict[str, object]]:
    engine = sa.create_engine(engine_url(url))
    try:
        return {c["name"]: dict(c) for c in sa.inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def test_an_old_log_gains_the_new_columns_and_keeps_its_rows(url: str) -> None:
    _make_old(url)
    assert "replays" not in _columns(url, CALLS.name)
    store = TrajectoryStore(url)
    try:
        columns = _columns(url, CALLS.name)
        assert set(columns) == {c.name for c in CALLS.columns}
        assert columns["replays"]["nullable"] is False and columns["replayed_at"]["nullable"] is True
        got = store.get(OWNER, "old-1")
        assert got is not None and (got.length, got.rebuilds, got.image_version) == (2, 1, "sha256:feed")
        old = store.calls(OWNER, "old-1")
        assert [(c.seq, c.op, c.status, c.note, c.replays, c.replayed_at) for c in old] == [
            (0, "create", "done", None, 0, None),
            (1, "exec", "done", "rebuild 1: differed", 0, None),
        ]
        # the old rows take the new writes, and the log grows as before
        store.write([TrajectoryStore.replayed(OWNER, "old-1", 1, T0)])
        store.write([TrajectoryStore.start(call("old-1", 2)), finish("old-1", 2)])
        assert [(c.seq, c.replays, c.replayed_at) for c in store.calls(OWNER, "old-1")] == [
            (0, 0, None),
            (1, 1, T0),
            (2, 0, None),
        ]
    finally:
        store.close()
    again = TrajectoryStore(url)  # a second start finds nothing to add
    try:
        assert add_missing_columns(again.engine, META) == []
        assert again.call(OWNER, "old-1", 1) is not None
    finally:
        again.close()


def test_stores_opened_at_once_on_an_old_log(url: str) -> None:
    """Nodes sharing one PostgreSQL database, upgraded together: each sees the columns missing, one adds
    them, and none fails because another added them first."""
    _make_old(url)
    gate = threading.Barrier(6)

    def open_one() -> None:
        gate.wait()
        TrajectoryStore(url).close()

    with ThreadPoolExecutor(6) as pool:
        for f in [pool.submit(open_one) for _ in range(6)]:
            f.result()
    assert {"replays", "replayed_at"} <= set(_columns(url, CALLS.name))


def test_a_not_null_column_without_a_server_default_is_refused(url: str) -> None:
    """A column that old rows could not fill is a programming error, said at start, not a half-migrated log."""
    meta = sa.MetaData()
    sa.Table("extra", meta, sa.Column("k", sa.Integer, primary_key=True))
    engine = sa.create_engine(engine_url(url))
    try:
        meta.create_all(engine)
        refused, nullable = sa.MetaData(), sa.MetaData()
        sa.Table(
            "extra", refused, sa.Column("k", sa.Integer, primary_key=True), sa.Column("n", sa.Integer, nullable=False)
        )
        sa.Table("extra", nullable, sa.Column("k", sa.Integer, primary_key=True), sa.Column("m", sa.Text))
        with pytest.raises(ValueError, match=r"extra\.n"):
            add_missing_columns(engine, refused)
        assert add_missing_columns(engine, nullable) == ["extra.m"]
        assert set(_columns(url, "extra")) == {"k", "m"}
    finally:
        engine.dispose()
