"""How often the daemon answered a recorded call again from the log (``RecordedCall.replays``), through the
real recorder, group-commit writers, store and routes of tests/unit/core/test_trajectory_log.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import dsec
from dsec.core.trajectory.recorder import TrajectoryOptions
from dsec.core.trajectory.writer import InlineWriter, LogWriter
from dsec.protocol.trajectory import REPLAYED_HEADER, RecordedCalls
from dsec.store.trajectories import CallRow, TrajectoryRow, TrajectoryStore

from ..conftest import IMAGE
from .test_trajectory_log import Daemon, daemon, recorded_four, wait_until

__all__ = ["daemon"]  # the fixture, imported to be used here


def replays(d: Daemon, tid: str) -> list[int]:
    return [c.replays for c in d.calls(tid)]


@pytest.mark.parametrize("durable", [False, True], ids=["inline-writer", "thread-writer"])
async def test_a_call_answered_twice_from_the_log_counts_two_replays(daemon: Daemon, durable: bool) -> None:
    d, tid = daemon, "t/replays"
    if durable:  # SQLite with a sync per commit: the writer thread commits, as for PostgreSQL
        await d.restart(options=TrajectoryOptions(durable=True))
    assert isinstance(d.mgr.trajectories.writer, LogWriter if durable else InlineWriter)
    sb = await recorded_four(d, tid)
    assert replays(d, tid) == [0, 0, 0, 0, 0]  # every call ran live
    url = f"/v1/sandboxes/{sb.id}"
    before = time.time()
    for _ in range(2):  # the same call at its recorded position, as a resumed client sends it
        reply = await d.raw("POST", f"{url}/exec", seq=3, json={"cmd": ["echo", "3"]})
        assert reply.status_code == 200 and reply.headers[REPLAYED_HEADER] == "1"
    reply = await d.raw("PUT", f"{url}/files", seq=2, params={"path": "/f"}, content=b"one")
    assert reply.status_code == 204 and reply.headers[REPLAYED_HEADER] == "1"
    await wait_until(lambda: replays(d, tid) == [0, 0, 1, 2, 0], "the replays' counts committed")
    third = d.call(tid, 3)
    assert third.replayed_at is not None and before <= third.replayed_at <= time.time()
    assert d.call(tid, 4).replayed_at is None
    # a call that diverges from the log is refused, and counted nowhere
    reply = await d.raw("POST", f"{url}/exec", seq=4, json={"cmd": ["echo", "other"]})
    assert reply.status_code == 409
    # the next live call is live, and so recorded
    reply = await d.raw("POST", f"{url}/exec", seq=5, json={"cmd": ["echo", "5"]})
    assert reply.status_code == 200 and REPLAYED_HEADER not in reply.headers
    assert replays(d, tid) == [0, 0, 1, 2, 0, 0]

    # as the API shows them
    reply = await d.raw("GET", "/v1/trajectories/calls", params={"id": tid})
    calls = RecordedCalls.model_validate_json(reply.content).calls
    assert [(c.seq, c.replays) for c in calls] == [(0, 0), (1, 0), (2, 1), (3, 2), (4, 0), (5, 0)]
    assert calls[3].replayed_at is not None and calls[3].replayed_at.timestamp() == pytest.approx(third.replayed_at)
    assert [c.replayed_at is None for c in calls] == [True, True, False, False, True, True]


async def test_a_recorded_error_answered_again_counts_as_a_replay(daemon: Daemon) -> None:
    d, tid = daemon, "t/replayed-error"
    sb = await (await d.client()).create(image=IMAGE, trajectory=tid)
    reply = await d.raw("GET", f"/v1/sandboxes/{sb.id}/files", seq=1, params={"path": "/missing"})
    assert reply.status_code == 404
    assert d.call(tid, 1).status == "error" and d.call(tid, 1).replays == 0
    again = await d.raw("GET", f"/v1/sandboxes/{sb.id}/files", seq=1, params={"path": "/missing"})
    assert again.status_code == 404 and again.json() == reply.json()
    await wait_until(lambda: d.call(tid, 1).replays == 1, "the replay's count committed")


async def test_each_resume_counts_as_a_replay_of_the_create(daemon: Daemon) -> None:
    """The create that resumes a trajectory is answered from its call 0 (the SDK then fast-forwards
    through the calls it fetched without sending them: only the calls that reach the daemon count)."""
    d, tid = daemon, "t/resumed"
    await recorded_four(d, tid)
    assert d.call(tid, 0).replays == 0
    for n in (1, 2):
        again = await (await d.client()).create(image=IMAGE, trajectory=tid)
        assert (await again.exec(["echo", "1"])).replayed
        await wait_until(lambda n=n: d.call(tid, 0).replays == n, f"resume {n} counted")
    assert d.call(tid, 0).replayed_at is not None


@pytest.mark.parametrize("writer_class", [InlineWriter, LogWriter])
async def test_a_posted_write_is_committed_by_close(
    tmp_path: Path, writer_class: type[InlineWriter | LogWriter]
) -> None:
    """Nobody waits for a posted count: the writer's close (the daemon's shutdown) still commits it."""
    store = TrajectoryStore(f"sqlite:///{tmp_path / 'log.db'}")
    try:
        row = TrajectoryRow("o", "t", "sb-1", "container", IMAGE, 1.0, 1.0, 1)
        store.write([TrajectoryStore.begin(row, CallRow("o", "t", 0, "create", "d", "{}", "done", 1.0))])
        writer = writer_class(store)
        writer.post(TrajectoryStore.replayed("o", "t", 0, 2.5))
        writer.post(TrajectoryStore.replayed("o", "t", 0, 3.5))
        writer.close()  # before the loop ran again
        await asyncio.sleep(0)  # an inline writer's scheduled flush then finds nothing left to do
        got = store.call("o", "t", 0)
        assert got is not None and (got.replays, got.replayed_at) == (2, 3.5)
        assert writer.writes == 2
    finally:
        store.close()


async def test_calls_the_sdk_answers_itself_are_counted_once_its_replay_ends(daemon: Daemon) -> None:
    """A resumed trainer's SDK fast-forwards locally; when its replay ends (a live call, or the end of
    the log) it tells the daemon in one request, so the log shows those calls replayed too."""
    d, tid = daemon, "t/sdk-replays"
    await recorded_four(d, tid)  # calls 0-4
    # a resume that replays two calls and then goes live
    again = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await again.exec(["echo", "1"])
    await again.files.write("/f", b"one")
    assert replays(d, tid) == [1, 0, 0, 0, 0]  # told nothing yet: the replay goes on
    diverged = again.exec(["echo", "not-3"])
    with pytest.raises(dsec.TrajectoryDiverged):
        await diverged
    await wait_until(lambda: replays(d, tid) == [1, 1, 1, 0, 0], "the SDK's report of calls 1-2")
    # a resume that replays to the end of the log, then one live call
    third = await (await d.client()).create(image=IMAGE, trajectory=tid)
    await third.exec(["echo", "1"])
    await third.files.write("/f", b"one")
    await third.exec(["echo", "3"])
    await third.exec(["echo", "4"])
    await wait_until(lambda: replays(d, tid) == [2, 2, 2, 1, 1], "the report at the end of the log")
    await third.exec(["echo", "5"])  # live: nothing more to report
    assert replays(d, tid)[:5] == [2, 2, 2, 1, 1] and replays(d, tid)[5] == 0


async def test_a_report_of_calls_the_log_does_not_hold_is_refused(daemon: Daemon) -> None:
    d, tid = daemon, "t/bad-report"
    await recorded_four(d, tid)
    for body, status in (({"start": 1, "end": 9}, 400), ({"start": 0, "end": 2}, 400), ({"start": 3, "end": 3}, 400)):
        reply = await d.raw("POST", "/v1/trajectories/replayed", params={"id": tid}, json=body)
        assert reply.status_code == status, (body, reply.text)
    reply = await d.raw("POST", "/v1/trajectories/replayed", params={"id": "t/none"}, json={"start": 1, "end": 2})
    assert reply.status_code == 404
    assert replays(d, tid) == [0, 0, 0, 0, 0]
