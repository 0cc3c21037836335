"""The E2B app served on a loopback port over the fake backend, for the real ``e2b`` SDK to call."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.core.manager import SandboxManager
from dsec.e2b.app import create_e2b_app
from dsec.e2b.service import E2BOptions

from ...fakes.backend import FakeBackend
from ..conftest import TOKEN

Core = tuple[SandboxManager, FakeBackend]


@pytest.fixture
async def served(core: Core, workdir: Path) -> AsyncIterator[tuple[str, SandboxManager, FakeBackend]]:
    import uvicorn

    mgr, backend = core
    app = create_e2b_app(mgr, E2BOptions(listen="http://127.0.0.1:1", network=None), workdir, TOKEN)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=1))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 (uvicorn sets a flag, no event)
        await asyncio.sleep(0.01)
    try:
        yield base, mgr, backend
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 5)
