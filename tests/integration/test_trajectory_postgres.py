"""Two nodes sharing one trajectory log on a real PostgreSQL server: a trajectory started on one node
resumes on the other after the first is lost, its sandbox rebuilt there from the log."""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import dsec
from dsec.store.trajectories import CALLS, engine_url

from ..pg import PgServer, pg_unavailable, start_postgres
from .conftest import Daemon, release_node, shut_down, start_daemon


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    reason = pg_unavailable()
    if reason:
        pytest.skip(reason)
    server = start_postgres()
    try:
        yield server
    finally:
        server.stop()


def test_a_trajectory_moves_to_another_node_through_the_shared_log(pg: PgServer) -> None:
    url = pg.create_database("nodes")
    states = [Path(tempfile.mkdtemp(prefix=f"dsec-pg-node{i}-")) for i in (1, 2)]
    node1 = start_daemon(states[0], "--trajectory-db", url)
    node2: Daemon | None = None
    try:
        sb = dsec.Sandbox.create("dsec/busybox", trajectory="pg/rollout-1", client=node1.client())
        assert sb.exec("echo one >> /tmp/log; wc -l < /tmp/log").stdout.strip() == "1"
        sb.files.write("/tmp/data", b"\x00payload\xff")
        assert sb.exec("echo two >> /tmp/log; wc -l < /tmp/log").stdout.strip() == "2"
        # the records are in PostgreSQL, not in the node's state directory
        engine = sa.create_engine(engine_url(url))
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(CALLS.c.seq, CALLS.c.op, CALLS.c.status).where(CALLS.c.trajectory == "pg/rollout-1")
            ).all()
        engine.dispose()
        assert sorted(rows) == [(0, "create", "done"), (1, "exec", "done"), (2, "write", "done"), (3, "exec", "done")]
        assert not (states[0] / "trajectories.db").exists()
        # node 1 is lost (killed, its sandboxes with it); the trainer resumes on node 2
        node1.client()  # still reachable until now
        dsec.Sandbox.connect(sb.id, client=node1.client()).kill()
        node1.stop(signal.SIGKILL)
        node2 = start_daemon(states[1], "--trajectory-db", url)
        resumed = dsec.Sandbox.create("dsec/busybox", trajectory="pg/rollout-1", client=node2.client())
        assert resumed.id != sb.id
        assert resumed.exec("echo one >> /tmp/log; wc -l < /tmp/log").replayed
        resumed.files.write("/tmp/data", b"\x00payload\xff")
        again = resumed.exec("echo two >> /tmp/log; wc -l < /tmp/log")
        assert again.replayed and again.stdout.strip() == "2"
        live = resumed.exec("echo three >> /tmp/log; wc -l < /tmp/log")  # the rebuilt state, each call once
        assert not live.replayed and live.stdout.strip() == "3"
        assert resumed.files.read("/tmp/data") == b"\x00payload\xff"
        info = node2.client().trajectory("pg/rollout-1")
        assert info.rebuilds == 1 and info.sandbox_id == resumed.id and info.length == 6  # the read is logged too
    finally:
        if node2 is not None:
            shut_down(node2)
        release_node(states[0])
        for state in states:
            shutil.rmtree(state, ignore_errors=True)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://nowhere/db", "--trajectory-db: use sqlite:///PATH or postgresql://"),
        (
            "postgresql://postgres:secret@/nodb?host=/nonexistent",
            "cannot open the trajectory log at postgresql://postgres:***@",
        ),
    ],
)
def test_a_bad_or_unreachable_log_is_a_clear_error_at_start(url: str, says: str) -> None:
    state = Path(tempfile.mkdtemp(prefix="dsec-pg-bad-"))
    try:
        with pytest.raises(RuntimeError) as failed:
            start_daemon(state, "--trajectory-db", url)
        assert says in " ".join(str(failed.value).split())  # the error, as rich wrapped it
        assert "secret" not in str(failed.value)
    finally:
        release_node(state)
        shutil.rmtree(state, ignore_errors=True)
