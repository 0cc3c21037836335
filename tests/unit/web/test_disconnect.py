"""A caller that leaves cancels its creation: out of the admission queue, nothing made for it later.
``unless_gone`` on its own, then dsec's and E2B's create routes on a real uvicorn server (loopback, the
fake backend) whose client gives up while its creation waits on a full node."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from dsec.core.admission import AdmissionOptions
from dsec.core.manager import SandboxManager
from dsec.e2b.app import create_e2b_app
from dsec.e2b.service import E2BOptions
from dsec.errors import NotFound
from dsec.protocol.sandbox import CreateSandbox
from dsec.server.app import create_app
from dsec.web.disconnect import GONE, unless_gone

from ...fakes.backend import FakeBackend
from ..conftest import IMAGE, TOKEN, new_manager

# four default sandboxes (0.25 cpu) fill the node; a creation waits up to a minute for room
FULL_AT_FOUR = AdmissionOptions(cpu_capacity=1, memory_capacity=64 << 30, cpu_ratio=1, queue_timeout=60)


def receiving(leave_after: float | None) -> Any:
    """An ASGI receive whose body was read already: the disconnect after ``leave_after`` s (None: never)."""

    async def receive() -> dict[str, str]:
        if leave_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(leave_after or 0)
        return {"type": "http.disconnect"}

    return receive


async def test_the_work_answers_when_it_ends_first() -> None:
    async def work() -> str:
        await asyncio.sleep(0.01)
        return "made"

    assert await unless_gone(receiving(None), work(), "test") == "made"

    async def failing() -> None:
        raise NotFound("no such thing")

    with pytest.raises(NotFound, match="no such thing"):
        await unless_gone(receiving(None), failing(), "test")


async def test_a_caller_that_leaves_cancels_the_work() -> None:
    cleaned = asyncio.Event()

    async def slow() -> str:
        try:
            await asyncio.sleep(30)
            return "too late"
        finally:
            cleaned.set()

    started = asyncio.get_running_loop().time()
    assert await unless_gone(receiving(0.05), slow(), "test") is GONE
    assert cleaned.is_set() and asyncio.get_running_loop().time() - started < 5


async def test_a_cancelled_handler_cancels_its_work() -> None:
    cleaned = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.set()

    handler = asyncio.create_task(unless_gone(receiving(None), slow(), "test"))
    await asyncio.sleep(0.05)
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    await asyncio.sleep(0)
    assert cleaned.is_set()


@pytest.fixture
async def full_node(workdir: Path) -> AsyncIterator[tuple[SandboxManager, FakeBackend, list[str]]]:
    mgr, backend = new_manager(workdir, FULL_AT_FOUR)
    await mgr.start()
    mgr.tenants.set_operator_token(TOKEN)
    try:
        held = [(await mgr.create(CreateSandbox(image=IMAGE))).id for _ in range(4)]
        yield mgr, backend, held
    finally:
        await mgr.close()


async def serve(app: FastAPI) -> tuple[str, uvicorn.Server, asyncio.Task[None]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=1))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 (uvicorn sets a flag, no event)
        await asyncio.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, serving


async def leave_while_queued(mgr: SandboxManager, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    async with httpx.AsyncClient(timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up; its connection closes
            await http.post(url, json=body, headers=headers)
    for _ in range(100):
        if mgr.admission.queued == 0:
            break
        await asyncio.sleep(0.05)
    assert mgr.admission.queued == 0  # out of the queue well before its 60 s


@pytest.mark.parametrize("api", ["dsec", "e2b"])
async def test_a_creation_whose_caller_left_is_never_made(
    api: str, full_node: tuple[SandboxManager, FakeBackend, list[str]], workdir: Path
) -> None:
    mgr, backend, held = full_node
    if api == "dsec":
        app = create_app(mgr, TOKEN)
        path, body = "/v1/sandboxes", {"image": IMAGE}
    else:
        app = create_e2b_app(mgr, E2BOptions(listen="http://127.0.0.1:1", network=None), workdir, TOKEN)
        path, body = "/v2/sandboxes", {"templateID": IMAGE, "timeout": 60}
    base, server, serving = await serve(app)
    try:
        await leave_while_queued(mgr, base + path, body, {"authorization": f"Bearer {TOKEN}"})
        await mgr.kill(held[0])  # room again: a creation still queued would now be made
        await asyncio.sleep(0.3)
        assert len(backend.created) == 4 and len(mgr.list({})) == 3
        assert mgr.admission.admitted == 3
        audited = [r for r in await mgr.audit.query(limit=100) if r.method == "POST"]
        assert [r.status for r in audited] == [499]  # what the audit log keeps of it
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 5)
