"""A daemon killed with SIGKILL and restarted: running sandboxes are re-adopted, the rest are marked lost."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import dsec

from .conftest import release_node, start_daemon


def cpu_ticks(pid: int) -> int:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_sigkill_and_restart() -> None:
    state = Path(tempfile.mkdtemp(prefix="dsec-restart-"))
    d = start_daemon(state)
    try:
        client = d.client()
        keep = dsec.Sandbox.create(image="dsec/busybox", client=client, labels={"t": "restart"})
        gone = dsec.Sandbox.create(image="dsec/busybox", client=client, labels={"t": "restart"})
        keep.files.write("/state.txt", b"before")
        keep.exec("sleep 600 >/dev/null 2>&1 &")
        d.stop(signal.SIGKILL)
        # while the daemon is down, one sandbox dies from outside
        runtime_root = state / "run" / "crun"
        if not runtime_root.exists():
            runtime_root = state / "run" / "runc"
        runtime = "crun" if runtime_root.name == "crun" else "runc"
        subprocess.run([runtime, "--root", str(runtime_root), "kill", gone.id, "KILL"], check=True)
        # the orphaned agent waits quietly for the next daemon: no busy loop
        crun_state = json.loads(
            subprocess.run(
                [runtime, "--root", str(runtime_root), "state", keep.id], capture_output=True, text=True, check=True
            ).stdout
        )
        before = cpu_ticks(crun_state["pid"])
        time.sleep(1.0)
        assert cpu_ticks(crun_state["pid"]) - before < 10, "the agent spins while no daemon is attached"
        with dsec.Client(url=d.url, token=d.token) as c2:
            try:
                c2.health()
                raise AssertionError("daemon still answering after SIGKILL")
            except dsec.DaemonUnreachable:
                pass

        d = start_daemon(state)
        client = d.client()
        again = dsec.Sandbox.connect(keep.id, client=client)
        assert again.info().state == dsec.State.running
        assert again.files.read("/state.txt") == b"before"
        assert "sleep 600" in again.exec("ps -o args").stdout
        assert "cannot re-attach" not in d.log.read_text(), "the agent channel was not re-attached"
        lost = dsec.Sandbox.connect(gone.id, client=client).info()
        assert lost.state == dsec.State.lost
        assert lost.reason and "not running" in lost.reason
        everything = {i.id: i for i in client.list(include_finished=True)}
        assert set(everything) >= {keep.id, gone.id}  # nothing silently disappears
        # a second restart: the agent parks and is re-attached again
        d.stop(signal.SIGKILL)
        d = start_daemon(state)
        third = dsec.Sandbox.connect(keep.id, client=d.client())
        assert third.exec("cat /state.txt").stdout == "before"
        assert "cannot re-attach" not in d.log.read_text()
        again = third
        again.kill()
        listing = subprocess.run(
            [runtime, "--root", str(runtime_root), "list", "--format", "json"], capture_output=True, text=True
        ).stdout
        assert json.loads(listing or "[]") == []  # the lost one was cleaned up too
    finally:
        if d.proc.poll() is None:  # leave nothing running, whatever failed above
            client = d.client()
            for info in client.list():
                dsec.Sandbox.connect(info.id, client=client).kill()
        d.stop()
        release_node(state)
    shutil.rmtree(state, ignore_errors=True)  # only reached when the test passed: failures keep the log


def test_unreachable_daemon_is_a_clear_error(tmp_path: Path) -> None:
    with dsec.Client(url=f"unix://{tmp_path}/none.sock", token="x") as c:
        try:
            c.health()
            raise AssertionError("expected DaemonUnreachable")
        except dsec.DaemonUnreachable as e:
            assert "dsec serve" in str(e)
            assert isinstance(e, ConnectionError)
