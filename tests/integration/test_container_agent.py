"""dsec-agent (the container sandbox's init) driven directly over its channel, on the host: what the
daemon relies on when it reports a command as started."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from dsec.isolation import cgroups
from dsec.kinds.container import agent
from dsec.kinds.container.agent import AgentChannel
from dsec.proc import spawn


def _cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"pid {pid} has no cgroup v2 line")


@pytest.mark.timeout(120)
def test_a_started_command_is_already_in_its_exec_cgroup(tmp_path: Path) -> None:
    """The agent reports 'started' only once the child has joined the exec's cgroup: a signal sent to
    the group as soon as the pid is known (the process API's kill right after a start) must reach the
    command. Before, the reply went out at fork and a kill under load missed the command, which then
    ran on (a killed background command's wait() never ended)."""
    binary = agent.build(tmp_path)
    layout = cgroups.detect()
    base = layout.unified / f"dsec-agent-test-{os.getpid()}"
    base.mkdir()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    pid = spawn([str(binary)], {0: null, 1: null, 2: null, 3: theirs.fileno()})  # fd 3: its control channel
    os.close(null)
    theirs.close()

    async def drive() -> None:
        chan = AgentChannel(ours)
        await chan.wait_ready(10)
        for i in range(40):
            group = cgroups.make_exec_group(layout, base.name, f"e{i}")
            procs = os.open(group / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
            null = os.open(os.devnull, os.O_RDWR)
            try:
                cmd, exited = await chan.spawn(["sleep", "30"], ["PATH=/usr/bin:/bin"], "/", [null, null, null, procs])
            finally:
                os.close(procs)
                os.close(null)
            # on the host the agent's pid namespace is ours: the pid is the host pid
            assert _cgroup_of(cmd) == f"/{base.name}/e{i}", f"exec {i} not yet in its group when reported"
            cgroups.kill_group(group)
            status = await asyncio.wait_for(exited, 10)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9
            group.rmdir()
        await chan.aclose()

    try:
        asyncio.run(drive())
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        cgroups.remove_group(base)
