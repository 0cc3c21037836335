"""The microvm guest agent, run as a plain process on one end of a socketpair (``--fd``), driven by GuestChannel."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec.errors import SandboxGone
from dsec.kinds.base import OutputCallback
from dsec.kinds.microvm import agent_build
from dsec.kinds.microvm.channel import GuestChannel
from dsec.protocol.sandbox import ExecResult

ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
UNIFIED = Path("/sys/fs/cgroup/unified")


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler (gcc) to build the guest agent")
    return agent_build.build(tmp_path_factory.mktemp("guest-agent"))


@dataclass
class Agent:
    proc: asyncio.subprocess.Process
    sock: socket.socket  # the host's end
    chan: GuestChannel | None


@asynccontextmanager
async def start_agent(agent_bin: Path, *extra: str, channel: bool = True) -> AsyncIterator[Agent]:
    host, guest = socket.socketpair()
    proc = await asyncio.create_subprocess_exec(
        str(agent_bin), "--fd", str(guest.fileno()), *extra, pass_fds=(guest.fileno(),)
    )
    guest.close()
    agent = Agent(proc, host, None)
    try:
        if channel:
            reader, writer = await asyncio.open_connection(sock=host)
            agent.chan = GuestChannel(reader, writer)
            await agent.chan.wait_ready(5)
        yield agent
    finally:
        if agent.chan is not None:
            await agent.chan.aclose()
        host.close()  # EOF: the agent kills what is left and exits 0
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@pytest.fixture
async def agent(agent_bin: Path) -> AsyncIterator[Agent]:
    async with start_agent(agent_bin) as a:
        yield a


def chan_of(agent: Agent) -> GuestChannel:
    assert agent.chan is not None
    return agent.chan


async def sh(
    agent: Agent,
    script: str,
    *,
    env: dict[str, str] = ENV,
    cwd: str = "/",
    stdin: bytes | None = None,
    timeout: float = 5.0,
    output_limit: int = 1 << 20,
    on_output: OutputCallback | None = None,
) -> ExecResult:
    return await chan_of(agent).run(["sh", "-c", script], env, cwd, stdin, timeout, output_limit, on_output)


def gone(pid: int) -> bool:
    """The process no longer exists (or is a zombie nobody will see run again)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def wait_gone(pid: int, within: float = 2.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        await asyncio.sleep(0.02)
    return gone(pid)


def raw_frame(kind: bytes, ident: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IcI", 5 + len(payload), kind, ident) + payload


async def read_raw(sock: socket.socket) -> tuple[bytes, int, bytes]:
    loop = asyncio.get_running_loop()

    async def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = await loop.sock_recv(sock, n - len(data))
            assert chunk, "the agent closed the connection"
            data += chunk
        return data

    size, kind, ident = struct.unpack("<IcI", await exactly(9))
    return kind, ident, await exactly(size - 5)


# ---- building ----------------------------------------------------------------------------------------


def test_the_agent_refuses_unknown_arguments(agent_bin: Path) -> None:
    res = subprocess.run([agent_bin, "--bogus"], capture_output=True, text=True, timeout=5)
    assert res.returncode == 2 and "--image-init" in res.stderr


def test_pack_upper_is_built_only_where_its_source_is(
    agent_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    monkeypatch.setattr(agent_build, "PACK_UPPER_SOURCE", tmp_path / "missing.c")
    assert agent_build.build_pack_upper(out) is None
    source = tmp_path / "tool.c"
    source.write_text("int main(void) { return 7; }\n")
    monkeypatch.setattr(agent_build, "PACK_UPPER_SOURCE", source)
    built = agent_build.build_pack_upper(out)
    assert built is not None and subprocess.run([built], timeout=5).returncode == 7
    mtime = built.stat().st_mtime_ns
    assert agent_build.build_pack_upper(out) == built and built.stat().st_mtime_ns == mtime  # not rebuilt


# ---- basics -------------------------------------------------------------------------------------------


async def test_ready_and_ping(agent: Agent) -> None:
    chan = chan_of(agent)
    assert chan.version is not None and chan.version.startswith("dsec-guest-agent/")
    rtt = await chan.ping(2)
    assert 0 < rtt < 1


async def test_exit_codes_and_signals(agent: Agent) -> None:
    ok = await sh(agent, "echo hi")
    assert (ok.exit_code, ok.signal, ok.stdout, ok.timed_out) == (0, None, "hi\n", False)
    three = await sh(agent, "exit 3")
    assert three.exit_code == 3
    killed = await sh(agent, "kill -9 $$")
    assert (killed.exit_code, killed.signal) == (137, 9)


async def test_stdout_and_stderr_are_separate(agent: Agent) -> None:
    res = await sh(agent, "echo out; echo err >&2; echo out2")
    assert res.stdout == "out\nout2\n"
    assert res.stderr == "err\n"


async def test_large_output_is_complete_or_head_and_tail(agent: Agent) -> None:
    size = 5 << 20
    script = f"head -c {size} /dev/zero | tr '\\0' a; echo -n END"
    full = await sh(agent, script, output_limit=6 << 20)
    assert full.stdout == "a" * size + "END" and not full.truncated
    seen: list[int] = []
    capped = await sh(agent, script, output_limit=1000, on_output=lambda _s, data: seen.append(len(data)))
    assert capped.truncated and capped.stdout_bytes == size + 3
    assert capped.stdout.startswith("a" * 500) and capped.stdout.endswith("a" * 497 + "END")
    assert "bytes truncated by dsec" in capped.stdout
    assert sum(seen) == size + 3 and max(seen) <= 65536


async def test_stdin(agent: Agent) -> None:
    data = os.urandom(3 << 20).hex().encode()[: 3 << 20]
    res = await sh(agent, "cat; echo; echo done >&2", stdin=data, output_limit=4 << 20)
    assert res.stdout == data.decode() + "\n" and res.stderr == "done\n"
    no_stdin = await sh(agent, "cat; echo rc=$?")
    assert no_stdin.stdout == "rc=0\n"  # /dev/null: EOF at once
    empty = await sh(agent, "wc -c", stdin=b"")
    assert empty.stdout.strip() == "0"


async def test_stdin_unread_does_not_block(agent: Agent) -> None:
    res = await sh(agent, "exit 4", stdin=b"x" * (2 << 20))
    assert res.exit_code == 4
    assert (await sh(agent, "echo still")).stdout == "still\n"


async def test_cwd_and_env(agent: Agent, tmp_path: Path) -> None:
    res = await sh(agent, 'pwd; echo "$FOO"', cwd=str(tmp_path), env={**ENV, "FOO": "bar baz"})
    assert res.stdout == f"{tmp_path}\nbar baz\n"
    bad = await sh(agent, "true", cwd=str(tmp_path / "missing"))
    assert bad.exit_code == 126 and "cannot change directory" in bad.stderr


async def test_missing_binary_is_127(agent: Agent) -> None:
    res = await chan_of(agent).run(["/no/such/binary"], ENV, "/", None, 5, 1000)
    assert res.exit_code == 127 and "/no/such/binary" in res.stderr
    res = await chan_of(agent).run(["no-such-command-dsec"], ENV, "/", None, 5, 1000)
    assert res.exit_code == 127


async def test_run_bytes_keeps_binary_stdout_whole(agent: Agent) -> None:
    data = bytes(range(256)) * 8192  # 2 MiB with every byte value, NULs included
    code, out, err = await chan_of(agent).run_bytes(["cat"], data, 5)
    assert (code, out, err) == (0, data, "")
    code, out, err = await chan_of(agent).run_bytes(["sh", "-c", "echo nope >&2; exit 2"], None, 5)
    assert (code, out, err) == (2, b"", "nope\n")


# ---- timeouts, background processes, trees --------------------------------------------------------------


async def test_timeout_kills_the_process_group(agent: Agent) -> None:
    started = time.monotonic()
    res = await sh(agent, "sleep 30 & echo $!; wait", timeout=0.3)
    assert res.timed_out and res.signal == 9 and res.exit_code == 137
    assert time.monotonic() - started < 2
    assert await wait_gone(int(res.stdout.split()[0]))


async def test_background_process_holding_the_pipes_does_not_delay_exit(agent: Agent) -> None:
    res = await sh(agent, "sleep 5 & echo $!; echo started")
    assert res.exit_code == 0 and res.stdout.endswith("started\n")
    assert res.duration < 1.0
    pid = int(res.stdout.split()[0])
    assert not gone(pid)  # left running, as promised
    os.kill(pid, signal.SIGKILL)
    assert await wait_gone(pid)  # and reaped by the agent (a subreaper with --fd) once it dies


async def test_orphans_are_reaped(agent: Agent) -> None:
    res = await sh(agent, "(sleep 0.1 &) ; echo $$")
    assert res.exit_code == 0
    await asyncio.sleep(0.3)
    assert [pid for pid in children(agent.proc.pid) if gone(pid)] == []


async def test_many_concurrent_execs(agent: Agent) -> None:
    async def one(i: int) -> None:
        res = await sh(
            agent,
            'for n in 1 2 3; do echo "$ID-$n"; echo "err$ID" >&2; sleep 0.01; done; exit $((ID % 7))',
            env={**ENV, "ID": str(i)},
        )
        assert res.stdout == "".join(f"{i}-{n}\n" for n in (1, 2, 3))
        assert res.stderr == f"err{i}\n" * 3
        assert res.exit_code == i % 7

    await asyncio.gather(*(one(i) for i in range(20)))


async def test_agent_death_mid_exec_is_sandbox_gone(agent: Agent) -> None:
    task = asyncio.create_task(sh(agent, "sleep 10"))
    await asyncio.sleep(0.2)
    orphans = children(agent.proc.pid)
    agent.proc.send_signal(signal.SIGKILL)
    try:
        with pytest.raises(SandboxGone):
            await asyncio.wait_for(task, 5)
    finally:
        for pid in orphans:  # nobody is left to kill them: each leads its own process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
async def test_user_switch(agent: Agent) -> None:
    res = await chan_of(agent).run(["sh", "-c", "id -u; id -g; id -G"], ENV, "/", None, 5, 1000, user=(1000, 1000))
    assert res.stdout.split() == ["1000", "1000", "1000"]


# ---- cgroups ------------------------------------------------------------------------------------------


def _cgroup_root_or_skip() -> Path:
    if os.geteuid() != 0:
        pytest.skip("exec cgroups need root")
    root = UNIFIED / f"dsec-guest-agent-test-{os.getpid()}"
    try:
        root.mkdir(exist_ok=True)
    except OSError as e:
        pytest.skip(f"no writable cgroup2 hierarchy at {UNIFIED}: {e}")
    if not (root / "cgroup.kill").exists():  # the root cgroup has none; a child group does on Linux >= 5.14
        root.rmdir()
        pytest.skip("the kernel has no cgroup.kill")
    return root


async def test_cgroup_kill_reaches_escaped_processes(agent_bin: Path) -> None:
    root = _cgroup_root_or_skip()
    try:
        async with start_agent(agent_bin, "--cgroup-root", str(root)) as a:
            # the sleep leaves the command's process group (setsid): only the cgroup still holds it
            script = "cat /proc/self/cgroup; setsid sh -c 'echo $$; exec sleep 30' & wait"
            res = await sh(a, script, timeout=0.5)
            assert res.timed_out and res.signal == 9
            assert "/exec-1\n" in res.stdout
            assert await wait_gone(int(res.stdout.split()[-1]))
        assert not list(root.glob("exec-*"))  # removed once empty
    finally:
        for group in root.glob("exec-*"):
            group.rmdir()
        if root.exists():
            root.rmdir()


# ---- protocol errors ------------------------------------------------------------------------------------


async def test_bad_exec_request_is_a_start_failure(agent_bin: Path) -> None:
    async with start_agent(agent_bin, channel=False) as a:
        loop = asyncio.get_running_loop()
        assert (await read_raw(a.sock))[0] == b"R"
        zero_argc = struct.pack("<IIIII", 0, 0, 0, 0, 0) + b"/\0"
        await loop.sock_sendall(a.sock, raw_frame(b"E", 7, zero_argc) + raw_frame(b"Z", 1) + raw_frame(b"P", 8, b"x"))
        kind, ident, payload = await read_raw(a.sock)
        assert (kind, ident, struct.unpack_from("<I", payload)[0]) == (b"F", 7, 22)  # EINVAL
        assert await read_raw(a.sock) == (b"p", 8, b"x")  # the unknown 'Z' was skipped


@pytest.mark.parametrize("length", [2, 0xFFFFFFFF, (8 << 20) + 1])
async def test_malformed_frame_drops_the_connection(agent_bin: Path, length: int) -> None:
    async with start_agent(agent_bin, channel=False) as a:
        loop = asyncio.get_running_loop()
        assert (await read_raw(a.sock))[0] == b"R"
        await loop.sock_sendall(a.sock, struct.pack("<I", length) + b"P\0\0\0\0junk")
        code = await asyncio.wait_for(a.proc.wait(), 5)
        assert code > 0  # exited on purpose: not a crash (a signal would make it negative)
