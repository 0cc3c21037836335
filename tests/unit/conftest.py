"""Fixtures: a SandboxManager over the in-memory FakeBackend, and the HTTP API in front of it."""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

with warnings.catch_warnings():
    # starlette nags about httpx vs httpx2 on import; the test client works with either
    warnings.filterwarnings("ignore", message=".*httpx2", category=UserWarning)
    from starlette.testclient import TestClient

from dsec.core.admission import AdmissionOptions
from dsec.core.manager import SandboxManager
from dsec.images.store import ImageStore
from dsec.server.app import create_app

from ..fakes.backend import FakeBackend, make_image

IMAGE = "test/img:1"
TOKEN = "t"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A scratch directory for a manager's state: tmpfs when there is one (SQLite's fsyncs on a real disk
    cost ~10 ms per new database), else pytest's tmp_path."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        with tempfile.TemporaryDirectory(dir=shm, prefix="dsec-unit-") as d:
            yield Path(d)
    else:
        yield tmp_path


# the fake backend's sandboxes cost nothing: a node this size never queues them (admission's own
# tests set their capacity)
ROOMY = AdmissionOptions(cpu_capacity=4096, memory_capacity=1 << 44)


def new_manager(root: Path, admission: AdmissionOptions = ROOMY) -> tuple[SandboxManager, FakeBackend]:
    images = root / "images"
    make_image(images, IMAGE, env={"PATH": "/usr/bin:/bin", "FROM_IMAGE": "1"})
    mgr = SandboxManager(
        state_dir=root / "state",
        images=ImageStore(images, lazy=False, mount=False),
        kinds=["container"],
        admission=admission,
    )
    backend = FakeBackend(mgr.ctx)
    mgr.backends["container"] = backend
    return mgr, backend


@pytest.fixture
def fresh(workdir: Path) -> tuple[SandboxManager, FakeBackend]:
    """A manager with the fake backend injected but not started."""
    return new_manager(workdir)


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


class ManagerSwitch:
    """Stands in for the manager in one shared app and forwards everything to the current test's manager.

    FastAPI builds each app's route state lazily on its first request (~100 ms here); one app for the
    whole session, with a fresh manager per test behind this switch, keeps the API tests fast while the
    lifespan still starts and closes each test's manager.
    """

    def __init__(self) -> None:
        self.target: SandboxManager | None = None

    def __getattr__(self, name: str) -> Any:
        if self.target is None:
            raise RuntimeError("no manager selected for this test")
        return getattr(self.target, name)


@pytest.fixture(scope="session")
def shared_app() -> tuple[FastAPI, ManagerSwitch]:
    switch = ManagerSwitch()
    return create_app(switch, token=TOKEN), switch  # type: ignore[arg-type]


@pytest.fixture
def api(workdir: Path, shared_app: tuple[FastAPI, ManagerSwitch]) -> Iterator[Api]:
    app, switch = shared_app
    mgr, backend = new_manager(workdir)
    switch.target = mgr
    try:
        with TestClient(app) as client:
            yield Api(client, mgr, backend)
    finally:
        switch.target = None
