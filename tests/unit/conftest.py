"""Fixtures: a SandboxManager over the in-memory FakeBackend, and the HTTP API in front of it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import warnings

import pytest

with warnings.catch_warnings():
    # starlette nags about httpx vs httpx2 on import; the test client works with either
    warnings.filterwarnings("ignore", message=".*httpx2", category=UserWarning)
    from starlette.testclient import TestClient

from dsec.core.manager import SandboxManager
from dsec.server.app import create_app

from .fakes import FakeBackend, make_image

IMAGE = "test/img:1"
TOKEN = "t"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def new_manager(tmp_path: Path) -> tuple[SandboxManager, FakeBackend]:
    images = tmp_path / "images"
    make_image(images, IMAGE, env={"PATH": "/usr/bin:/bin", "FROM_IMAGE": "1"})
    mgr = SandboxManager(state_dir=tmp_path / "state", images_dir=images)
    backend = FakeBackend(mgr.ctx)
    mgr.backends["container"] = backend
    return mgr, backend


@pytest.fixture
def fresh(tmp_path: Path) -> tuple[SandboxManager, FakeBackend]:
    """A manager with the fake backend injected but not started."""
    return new_manager(tmp_path)


@pytest.fixture
async def core(fresh: tuple[SandboxManager, FakeBackend]) -> AsyncIterator[tuple[SandboxManager, FakeBackend]]:
    mgr, backend = fresh
    await mgr.start()
    try:
        yield mgr, backend
    finally:
        await mgr.close()


@dataclass
class Api:
    client: TestClient
    manager: SandboxManager
    backend: FakeBackend

    def create(self, **body: object) -> dict[str, object]:
        reply = self.client.post("/v1/sandboxes", json={"image": IMAGE, **body}, headers=AUTH)
        assert reply.status_code == 201, reply.text
        data: dict[str, object] = reply.json()
        return data


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    mgr, backend = new_manager(tmp_path)
    app = create_app(mgr, token=TOKEN)
    with TestClient(app) as client:
        yield Api(client, mgr, backend)
