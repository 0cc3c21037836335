"""Idle-output timeouts and per-exec resource limits at the guest agent's channel (agent run with ``--fd``),
and the deadline bookkeeping both kinds share (core/output.py)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from dsec.kinds.microvm.channel import GuestChannel
from dsec.kinds.output import Deadlines

from .test_guest_agent import ENV, agent_bin, start_agent

__all__ = ["agent_bin"]  # the fixture, imported for this module's tests


def test_deadlines_idle_and_wall_clock() -> None:
    start = time.monotonic()
    clock = Deadlines(start, timeout=10.0, idle_timeout=None)
    assert clock.expired() is None and 9.0 < clock.wait() <= 10.0
    old = Deadlines(start - 11, timeout=10.0, idle_timeout=None)
    assert old.expired() == "timeout" and old.wait() == 0.001
    idle = Deadlines(start - 5, timeout=10.0, idle_timeout=2.0)
    assert idle.expired() == "idle"
    idle.touch()  # output just came: the idle deadline moves, the wall clock does not
    assert idle.expired() is None and 1.5 < idle.wait() <= 2.0
    wall_first = Deadlines(start - 9.5, timeout=10.0, idle_timeout=2.0)
    wall_first.touch()
    assert wall_first.wait() <= 0.5


def _chan(agent: object) -> GuestChannel:
    chan = getattr(agent, "chan", None)
    assert isinstance(chan, GuestChannel)
    return chan


async def test_idle_timeout_kills_a_silent_command_and_says_so(agent_bin: Path) -> None:
    async with start_agent(agent_bin) as agent:
        chan = _chan(agent)
        started = time.monotonic()
        res = await chan.run(["sh", "-c", "echo hi; sleep 30"], ENV, "/", None, 20.0, 4096, idle_timeout=0.5)
        assert res.timed_out and res.idle_timed_out
        assert res.stdout == "hi\n" and res.signal == 9
        assert time.monotonic() - started < 5
        # a command that keeps talking is not idle, however long it runs
        talk = "for i in 1 2 3 4 5 6; do echo $i; sleep 0.2; done"
        res = await chan.run(["sh", "-c", talk], ENV, "/", None, 20.0, 4096, idle_timeout=0.6)
        assert res.exit_code == 0 and not res.timed_out and not res.idle_timed_out
        # the wall clock still applies beside it, and is reported as a plain timeout
        res = await chan.run(
            ["sh", "-c", "while :; do echo x; sleep 0.1; done"], ENV, "/", None, 1.0, 4096, idle_timeout=0.5
        )
        assert res.timed_out and not res.idle_timed_out


async def test_idle_timeout_counts_stderr_too(agent_bin: Path) -> None:
    async with start_agent(agent_bin) as agent:
        chan = _chan(agent)
        script = "for i in 1 2 3 4 5; do echo e >&2; sleep 0.2; done"
        res = await chan.run(["sh", "-c", script], ENV, "/", None, 20.0, 4096, idle_timeout=0.6)
        assert res.exit_code == 0 and not res.idle_timed_out and res.stderr.count("e") == 5


@pytest.mark.skipif(os.geteuid() != 0, reason="raising RLIMIT_NOFILE's hard limit needs root")
async def test_the_agent_sets_nofile_and_fsize_before_exec(agent_bin: Path, tmp_path: Path) -> None:
    async with start_agent(agent_bin) as agent:
        chan = _chan(agent)
        res = await chan.run(
            ["sh", "-c", "ulimit -Sn; ulimit -Hn; ulimit -f"], ENV, "/", None, 10.0, 4096, rlimits=(200, 64 << 10)
        )
        assert res.exit_code == 0, res.stderr
        soft, hard, blocks = res.stdout.split()
        assert (soft, hard) == ("200", "200")
        assert int(blocks) * 512 == 64 << 10 or int(blocks) * 1024 == 64 << 10
        # past RLIMIT_FSIZE the writer is killed by SIGXFSZ; ignoring it gives EFBIG
        target = tmp_path / "big"
        res = await chan.run(
            ["sh", "-c", f"exec head -c 1000000 /dev/zero > {target}"],
            ENV,
            "/",
            None,
            10.0,
            4096,
            rlimits=(200, 64 << 10),
        )
        assert res.signal == 25  # SIGXFSZ
        assert target.stat().st_size == 64 << 10
        script = f"trap '' XFSZ; head -c 1000000 /dev/zero > {target}; echo status=$?"
        res = await chan.run(["sh", "-c", script], ENV, "/", None, 10.0, 4096, rlimits=(200, 64 << 10))
        assert "status=1" in res.stdout and "too large" in res.stderr.lower()
        # opening more files than RLIMIT_NOFILE fails inside the command, not in the agent
        res = await chan.run(
            ["python3", "-c", "import os\nfds=[]\ntry:\n  while True: fds.append(os.open('/dev/null', 0))\n"
             "except OSError as e: print(len(fds) + 3, e.errno)"],
            ENV, "/", None, 10.0, 4096, rlimits=(200, 64 << 10),
        )  # fmt: skip
        assert res.stdout.split() == ["200", "24"]  # EMFILE
        # without limits in the frame, the command gets the agent's own (the old protocol still works)
        res = await chan.run(["sh", "-c", "ulimit -Sn"], ENV, "/", None, 10.0, 4096)
        assert res.stdout.strip() != "200"
        assert (await chan.ping(5)) < 5


async def test_a_truncated_limits_frame_is_refused(agent_bin: Path) -> None:
    import struct

    from dsec.kinds.microvm import channel as ch

    async with start_agent(agent_bin) as agent:
        chan = _chan(agent)
        # flags say limits follow, but the frame ends after the header: a failure, and the agent lives on
        payload = struct.pack("<IIIII", 1, 0, ch.FLAG_RLIMITS, 0, 0)
        await chan._send(ch._frame(b"E", 999, payload))
        await asyncio.sleep(0.2)
        assert (await chan.ping(5)) < 5
        res = await chan.run(["true"], ENV, "/", None, 10.0, 4096)
        assert res.exit_code == 0
