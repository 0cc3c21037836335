"""The trajectory log with real sandboxes: a trainer killed at random points and rerun ends exactly like
an uninterrupted one; a daemon killed mid-call reports the call as interrupted; a lost sandbox is
rebuilt from the log. The log's own logic is unit-tested in tests/unit/core/test_trajectory_log.py."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import dsec

from .conftest import Daemon, require_kind, shut_down, start_daemon

TRAINER = Path(__file__).with_name("trainer.py")
SEED = int(os.environ.get("DSEC_TEST_SEED", str(random.randrange(1 << 30))))


def run_trainer(
    d: Daemon, trajectory: str, kind: str, out: Path, *, kill_after_lines: int | None = None, profile: str = "full"
) -> int:
    """Run the trainer; with ``kill_after_lines``, SIGKILL it once OUT has that many lines (plus a random
    few ms, so that it also dies in the middle of a call). Returns its exit status."""
    env = {**os.environ, "DSEC_URL": d.url, "DSEC_TOKEN": d.token}
    proc = subprocess.Popen(
        [sys.executable, str(TRAINER), trajectory, kind, str(out), profile],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=str(Path(__file__).parents[2]),
    )
    if kill_after_lines is not None:
        rng = random.Random(SEED + kill_after_lines)
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            if out.exists() and len(out.read_text().splitlines()) >= kill_after_lines:
                time.sleep(rng.uniform(0, 0.03))
                proc.kill()
                break
            time.sleep(0.002)
    try:
        _, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if kill_after_lines is None and proc.returncode != 0:
        raise AssertionError(f"trainer failed: {err.decode(errors='replace')[-3000:]}")
    return proc.returncode


def lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.read_text().splitlines()]


def seen(records: list[dict[str, Any]]) -> list[Any]:
    """What the trainer observed, without whether it came from the log."""
    return [{k: v for k, v in r.items() if k != "replayed"} for r in records]


def interrupted_run(d: Daemon, kind: str, tmp: Path, kills: list[int], profile: str = "full") -> list[dict[str, Any]]:
    for n, at in enumerate(kills):
        run_trainer(d, f"it/{kind}/resumed", kind, tmp / f"killed-{n}.jsonl", kill_after_lines=at, profile=profile)
    final = tmp / "final.jsonl"
    run_trainer(d, f"it/{kind}/resumed", kind, final, profile=profile)
    return lines(final)


@pytest.fixture
def tmp() -> Path:
    d = Path(tempfile.mkdtemp(prefix="dsec-traj-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_trainer_killed_at_random_points_ends_like_an_uninterrupted_one(daemon: Daemon, tmp: Path) -> None:
    rng = random.Random(SEED)
    kills = sorted(rng.sample(range(1, 11), 3))
    print(f"seed {SEED}: trainer killed after {kills} lines")
    run_trainer(daemon, "it/container/straight", "container", tmp / "straight.jsonl")
    straight = lines(tmp / "straight.jsonl")
    resumed = interrupted_run(daemon, "container", tmp, kills)
    assert seen(resumed) == seen(straight)
    assert straight[-1]["reward"] == 1.0
    # non-idempotent steps ran exactly once: three appends, two commits (checked in the sandbox itself)
    assert resumed[-2]["seen"]["stdout"].splitlines()[-1] == "3"
    assert len(resumed[-2]["seen"]["stdout"].splitlines()) == 3  # two commits and the line count
    # the resumed run replayed what its killed runs had done, then went live
    replayed = [r["replayed"] for r in resumed[:-1]]
    assert replayed[0] is True
    assert replayed == sorted(replayed, reverse=True)  # a prefix of replays, then live calls
    client = daemon.client()
    info = client.trajectory("it/container/resumed")
    assert info.length == len(straight) + 1  # create + every step + the reward's exec, each logged once
    assert info.rebuilds == 0
    calls = list(client.trajectory_calls("it/container/resumed"))
    assert [c.seq for c in calls] == list(range(info.length))
    assert all(c.status == "done" for c in calls), [(c.seq, c.status) for c in calls]
    sb = dsec.Sandbox.connect(info.sandbox_id, client=client)
    assert sb.files.read("/work/f") == b"x\nx\nx\n"
    assert len(sb.files.read("/work/.git/logs/HEAD").splitlines()) == 2  # two commits, no more
    with pytest.raises(dsec.InvalidState, match="must carry its position"):  # outside the trajectory
        sb.exec("echo x >> /work/f")
    for t in ("it/container/straight", "it/container/resumed"):
        dsec.Sandbox.connect(client.trajectory(t).sandbox_id, client=client).kill()


def test_a_microvm_trainer_resumes_the_same_way(daemon: Daemon, tmp: Path) -> None:
    """Under TCG a VM costs seconds a step for git and python: the microvm runs the light profile's shell
    steps (appends, a move, file writes and reads). The uninterrupted run is checked against the same
    steps in a container too: what the trainer sees does not depend on the kind."""
    require_kind(daemon.client(), "microvm")
    run_trainer(daemon, "it/microvm/straight", "microvm", tmp / "straight.jsonl", profile="light")
    run_trainer(daemon, "it/microvm/reference", "container", tmp / "reference.jsonl", profile="light")
    straight, reference = lines(tmp / "straight.jsonl"), lines(tmp / "reference.jsonl")
    assert seen(straight) == seen(reference)
    resumed = interrupted_run(daemon, "microvm", tmp, [4], profile="light")
    assert seen(resumed) == seen(straight)
    assert straight[-1]["reward"] == 1.0
    assert resumed[-2]["seen"]["stdout"].startswith("3\n")  # two appends before the move, one after: once each
    client = daemon.client()
    info = client.trajectory("it/microvm/resumed")
    assert info.kind == "microvm" and info.length == len(straight) + 1 and info.rebuilds == 0
    assert dsec.Sandbox.connect(info.sandbox_id, client=client).files.read("/work/g") == b"x\nx\nx\n"
    for t in ("it/microvm/straight", "it/microvm/reference", "it/microvm/resumed"):
        dsec.Sandbox.connect(client.trajectory(t).sandbox_id, client=client).kill()


def test_a_lost_sandbox_is_rebuilt_from_the_log(daemon: Daemon) -> None:
    client = daemon.client()
    sb = dsec.Sandbox.create("dsec/debian:12", trajectory="it/rebuild", client=client)
    sb.exec("mkdir /w && echo one >> /w/log")
    sb.files.write("/w/data", b"\x00\x01binary\xff")
    sb.exec("echo two >> /w/log; nohup sleep 1000 >/dev/null 2>&1 &")
    assert sb.files.read("/w/log") == b"one\ntwo\n"
    sb.exec("date +%s%N")  # its output cannot come out the same twice
    # lost: killed from outside the trajectory (an operator's `dsec rm`)
    dsec.Sandbox.connect(sb.id, client=client).kill()
    resumed = dsec.Sandbox.create("dsec/debian:12", trajectory="it/rebuild", client=daemon.client())
    assert resumed.id != sb.id and resumed.info().state == dsec.State.running
    # the trainer, resuming, sees the recorded results
    assert resumed.exec("mkdir /w && echo one >> /w/log").replayed
    resumed.files.write("/w/data", b"\x00\x01binary\xff")
    resumed.exec("echo two >> /w/log; nohup sleep 1000 >/dev/null 2>&1 &")
    assert resumed.files.read("/w/log") == b"one\ntwo\n"
    stamp = resumed.exec("date +%s%N")
    assert stamp.replayed and resumed.trajectory.replayed == 5
    # and the rebuilt sandbox holds the state the calls made, each applied once
    assert resumed.exec("cat /w/log").stdout == "one\ntwo\n"
    assert resumed.files.read("/w/data") == b"\x00\x01binary\xff"
    assert "sleep" in resumed.exec("cat /proc/[0-9]*/comm").stdout.split()  # the background process too
    info = client.trajectory("it/rebuild")
    assert info.rebuilds == 1 and info.sandbox_id == resumed.id
    notes = {c.seq: c.note for c in client.trajectory_calls("it/rebuild")}
    assert notes[5] and "differs" in notes[5]  # the date's re-run answered differently
    assert not notes[1] and not notes[3]
    resumed.kill()


def test_a_sandbox_past_its_time_to_live_is_rebuilt(daemon: Daemon) -> None:
    client = daemon.client()
    sb = dsec.Sandbox.create("dsec/busybox", trajectory="it/ttl", timeout=2, client=client)
    sb.exec("echo kept > /tmp/f")
    time.sleep(2.5)
    resumed = dsec.Sandbox.create("dsec/busybox", trajectory="it/ttl", timeout=2, client=daemon.client())
    assert resumed.id != sb.id
    assert resumed.exec("echo kept > /tmp/f").replayed
    assert resumed.files.read("/tmp/f") == b"kept\n"
    resumed.kill()


def test_a_daemon_killed_mid_call_reports_it_interrupted() -> None:
    state = Path(tempfile.mkdtemp(prefix="dsec-traj-kill-"))
    d = start_daemon(state)
    try:
        sb = dsec.Sandbox.create("dsec/busybox", trajectory="it/daemon-kill", client=d.client())
        assert sb.exec("echo before").stdout == "before\n"
        outcome: dict[str, BaseException | dsec.ExecResult] = {}

        def long_call() -> None:
            try:
                outcome["result"] = sb.exec("sleep 3; echo ran >> /tmp/side-effect", timeout=60)
            except BaseException as e:
                outcome["result"] = e

        t = threading.Thread(target=long_call)
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the call is logged as running: kill the daemon under it
            calls = list(d.client().trajectory_calls("it/daemon-kill"))
            if len(calls) == 3 and calls[2].status == "running":
                break
            time.sleep(0.05)
        else:
            pytest.fail("the call was never logged as running")
        d.stop(signal.SIGKILL)
        d = start_daemon(state)  # the SDK's retry of the same call reaches the new daemon
        t.join(timeout=180)
        assert isinstance(outcome.get("result"), dsec.CallInterrupted), outcome
        calls = list(d.client().trajectory_calls("it/daemon-kill"))
        assert [c.status for c in calls] == ["done", "done", "interrupted"]
        assert calls[2].result is None and calls[2].duration_ms is None  # no half-written record
        # a resumed trainer gets the same verdict for that call, then goes on live
        again = dsec.Sandbox.create("dsec/busybox", trajectory="it/daemon-kill", client=d.client())
        assert again.id == sb.id  # the container outlived the daemon
        assert again.exec("echo before").replayed
        with pytest.raises(dsec.CallInterrupted):
            again.exec("sleep 3; echo ran >> /tmp/side-effect", timeout=60)
        after = again.exec("echo after")
        assert after.stdout == "after\n" and not after.replayed
        assert [c.status for c in d.client().trajectory_calls("it/daemon-kill")][-1] == "done"
    finally:
        shut_down(d)
        shutil.rmtree(state, ignore_errors=True)
