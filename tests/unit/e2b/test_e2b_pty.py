"""E2B's ``sbx.pty`` and a stream whose sandbox is killed, with the real ``e2b`` SDK against the E2B app
over the fake backend (no root). The fake's live commands behave like ``cat`` (what is typed comes back
as output) and record the resizes of their terminal; the terminals themselves are tested per kind in
tests/integration/test_e2b_pty.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from dsec.core.manager import SandboxManager
from dsec.protocol.terminal import PtySize as DsecPtySize
from dsec.tenancy import OPERATOR

from ...fakes.backend import FakeBackend
from ..conftest import IMAGE
from .test_e2b_api import _opts

e2b = pytest.importorskip("e2b")
from e2b import AsyncSandbox  # noqa: E402
from e2b.exceptions import InvalidArgumentException, SandboxException, TimeoutException  # noqa: E402
from e2b.sandbox.commands.command_handle import CommandExitException, PtySize  # noqa: E402

Served = tuple[str, SandboxManager, FakeBackend]


def _ignore(_: bytes) -> None:
    pass


async def test_a_terminal_is_typed_on_resized_and_killed(served: Served) -> None:
    base, mgr, backend = served
    box = await AsyncSandbox.create(IMAGE, **_opts(base))
    seen: list[bytes] = []
    term = await box.pty.create(PtySize(rows=24, cols=80), on_data=seen.append, envs={"A": "1"}, cwd="/tmp")
    req = backend.execs[-1]
    assert req.argv() == ["/bin/bash", "-i", "-l"] and req.cwd == "/tmp"
    assert req.env["TERM"] == "xterm-256color" and req.env["A"] == "1"  # the SDK's, passed on as they are
    await box.pty.send_stdin(term.pid, b"typed\n")
    await box.commands.send_stdin(term.pid, "stdin too\n")  # a terminal takes plain stdin as typed input
    for _ in range(100):
        if b"".join(seen) == b"typed\nstdin too\n":
            break
        await asyncio.sleep(0.02)
    assert b"".join(seen) == b"typed\nstdin too\n"  # pty events: one stream
    await box.pty.resize(term.pid, PtySize(rows=40, cols=132))
    assert backend.resizes == [(term.pid, DsecPtySize(rows=40, cols=132))]
    process = mgr.processes.find(box.sandbox_id, caller=OPERATOR, pid=term.pid)
    assert process.terminal and process.io.pty == DsecPtySize(rows=40, cols=132)
    assert await box.pty.kill(term.pid) is True
    with pytest.raises(CommandExitException):
        await term.wait()
    assert await box.pty.kill(term.pid) is False  # gone: not found, as E2B answers
    await box.kill()


async def test_sizes_and_inputs_a_process_cannot_take_are_refused(served: Served) -> None:
    base, _, backend = served
    box = await AsyncSandbox.create(IMAGE, **_opts(base))
    for rows, cols in ((0, 80), (24, 0), (70000, 80)):
        with pytest.raises(InvalidArgumentException, match=r"pty\.size"):
            await box.pty.create(PtySize(rows=rows, cols=cols), on_data=_ignore)
    term = await box.pty.create(PtySize(rows=24, cols=80), on_data=_ignore)
    with pytest.raises(InvalidArgumentException, match=r"pty\.size"):
        await box.pty.resize(term.pid, PtySize(rows=24, cols=0))
    plain = await box.commands.run("cat", background=True, stdin=True)
    with pytest.raises(SandboxException, match="does not run on a terminal"):
        await box.pty.send_stdin(plain.pid, b"x")
    with pytest.raises(SandboxException, match="does not run on a terminal"):
        await box.pty.resize(plain.pid, PtySize(rows=24, cols=80))
    assert backend.resizes == []
    await box.kill()


async def test_a_trajectory_bound_sandbox_refuses_a_terminal(served: Served) -> None:
    base, _, backend = served
    box = await AsyncSandbox.create(IMAGE, metadata={"dsec.trajectory": "t/pty"}, **_opts(base))
    runs = len(backend.execs)
    with pytest.raises(SandboxException, match="trajectory: a terminal cannot be recorded"):
        await box.pty.create(PtySize(rows=24, cols=80), on_data=_ignore)
    assert len(backend.execs) == runs
    await box.kill()


async def test_a_stream_whose_sandbox_is_killed_is_cut_and_the_sdk_says_killed(served: Served) -> None:
    base, _, _ = served
    box = await AsyncSandbox.create(IMAGE, **_opts(base))
    cmd = await box.commands.run("sleep", background=True, stdin=True)
    term = await box.pty.create(PtySize(rows=24, cols=80), on_data=_ignore)
    await box.kill()
    for handle in (cmd, term):
        with pytest.raises(TimeoutException, match="killed or reached its end of life") as raised:
            await handle.wait()
        # a connection reset, as when E2B's sandbox dies: not an error answer, not a clean end
        assert "reset" in str(raised.value).lower()


async def test_a_cut_is_a_reset_connection_on_the_wire(served: Served) -> None:
    base, mgr, _ = served
    box = await AsyncSandbox.create(IMAGE, **_opts(base))
    cmd = await box.commands.run("sleep", background=True, stdin=True)
    headers = {
        "Content-Type": "application/connect+json",
        "E2b-Sandbox-Id": box.sandbox_id,
        "X-Access-Token": box._envd_access_token or "",
    }
    body = b'{"process":{"pid":%d}}' % cmd.pid
    async with httpx.AsyncClient(base_url=base) as http:
        async with http.stream(
            "POST", "/process.Process/Connect", headers=headers, content=b"\0" + len(body).to_bytes(4, "big") + body
        ) as resp:
            assert resp.status_code == 200
            chunks = resp.aiter_raw()
            assert await anext(chunks)  # the start event
            await mgr.kill(box.sandbox_id)
            with pytest.raises(httpx.ReadError):  # not RemoteProtocolError: the connection was reset
                async for _ in chunks:
                    pass
