"""Killing a container sandbox leaves nothing: no process, cgroup, runtime record or bundle, paused or not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import dsec

from .conftest import Daemon
from .sandbox_mounts import init_pid


def traces(daemon: Daemon, sb: dsec.Sandbox) -> list[Path]:
    groups = [h / "dsec" / sb.id for h in Path("/sys/fs/cgroup").iterdir() if h.is_dir()]
    groups.append(Path("/sys/fs/cgroup/dsec") / sb.id)
    crun = [daemon.state_dir / "run" / name / sb.id for name in ("crun", "runc")]
    return [p for p in [*groups, *crun, daemon.state_dir / "sandboxes" / sb.id] if p.exists()]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("paused", [False, True])
def test_kill_leaves_nothing(daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox], paused: bool) -> None:
    sb = make_sandbox()
    sb.exec("sleep 600 >/dev/null 2>&1 &")
    pid = init_pid(daemon, sb)
    assert traces(daemon, sb), "the sandbox should have cgroups and a bundle while it runs"
    if paused:
        sb.pause()
    sb.kill()
    assert not alive(pid)
    assert traces(daemon, sb) == []  # the cgroups could go only once every process of the sandbox had
