"""OpenEnv (openenv-core, PyPI, unmodified) on dsec through ``dsec.integrations.openenv.DsecProvider``:
an environment server written with OpenEnv's own server API (``Environment``, ``create_app``), in an
image built here from a Dockerfile laid out as OpenEnv's template lays one out, is started in a sandbox
by OpenEnv's ``EnvClient.from_docker_image``; reset, step and state go over the WebSocket through the
daemon's port proxy, and ``close()`` leaves no sandbox. Then the failures: a server that exits, one that
never answers, an image with no server to find, a daemon on a unix socket."""

from __future__ import annotations

import gc
import secrets
import shutil
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest

import dsec

from .conftest import Daemon, free_port, scratch_dir, shut_down, start_daemon

pytest.importorskip("openenv")
from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.generic_client import GenericEnvClient

from dsec.integrations.openenv import LOG_PATH, DsecProvider, EnvServerError

ROOT = Path(__file__).resolve().parents[2]
OPENENV = version("openenv-core")
pytestmark = pytest.mark.timeout(300)

# A counter: reset(seed) starts it at seed, step(amount) adds, done at 10 or more. Each answer also says
# what only the sandbox has: a file this test writes into it, and a variable handed to the provider.
MODELS = """\
from openenv.core.env_server.types import Action, Observation


class CountAction(Action):
    amount: int


class CountObservation(Observation):
    total: int = 0
    greeting: str = ""
    marker: str = ""
"""

ENVIRONMENT = """\
import os
import uuid
from pathlib import Path

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from models import CountAction, CountObservation


class CounterEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self._total = 0

    def _observe(self, reward, done):
        marker = Path("/tmp/marker")
        return CountObservation(
            total=self._total,
            greeting=os.environ.get("COUNTER_GREETING", ""),
            marker=marker.read_text() if marker.exists() else "",
            reward=reward,
            done=done,
        )

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        self._total = seed or 0
        return self._observe(None, False)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        self._total += action.amount
        return self._observe(float(action.amount), self._total >= 10)

    @property
    def state(self):
        return self._state
"""

APP = """\
from openenv.core.env_server.http_server import create_app

from models import CountAction, CountObservation
from server.counter_environment import CounterEnvironment

app = create_app(CounterEnvironment, CountAction, CountObservation, env_name="counter", max_concurrent_envs=4)
"""

OPENENV_YAML = """\
spec_version: 1
name: counter
type: space
runtime: fastapi
app: server.app:app
port: 8000
"""

# OpenEnv's template layout (the environment in /app/env, a virtualenv in /app/.venv on PATH); its CMD is
# there as OpenEnv's images have one, and dsec does not run it. The server's Python packages are the
# versions this repository pins (constraints.txt), so the server is the openenv-core the client is.
DOCKERFILE = f"""\
FROM dsec/debian:12
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \\
    python3-venv && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /app/.venv
COPY constraints.txt /app/constraints.txt
RUN /app/.venv/bin/pip install -q --no-cache-dir -c /app/constraints.txt openenv-core=={OPENENV}
COPY env/ /app/env/
ENV PATH=/app/.venv/bin:$PATH PYTHONPATH=/app/env
WORKDIR /app/env
CMD ["sh", "-c", "cd /app/env && uvicorn server.app:app --host 0.0.0.0 --port 8000"]
"""


class CounterClient(EnvClient[dict[str, int], dict[str, Any], dict[str, Any]]):
    """A typed client as an environment's package writes one."""

    def _step_payload(self, action: dict[str, int]) -> dict[str, Any]:
        return {"amount": action["amount"]}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[dict[str, Any]]:
        return StepResult(observation=payload["observation"], reward=payload.get("reward"), done=payload["done"])

    def _parse_state(self, payload: dict[str, Any]) -> dict[str, Any]:
        return payload


@pytest.fixture(autouse=True)
def _env() -> None:
    """Replaces the suite's fixture of this name: an exposed port needs the daemon on TCP, so this module
    runs one of its own (with the suite's layer repository, whose build cache keeps rebuilds short)."""


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with scratch_dir("dsec-openenv-") as workdir:
        d = start_daemon(workdir / "state", listen=f"http://127.0.0.1:{free_port()}")
        try:
            yield d
        finally:
            shut_down(d)


@pytest.fixture(scope="module")
def image(daemon: Daemon) -> Iterator[str]:
    """The environment's image, built by the daemon from a Dockerfile (a name of this run's own: names
    are written once, and the layers come from the build cache after the first run)."""
    name = f"openenv-test/counter:{secrets.token_hex(4)}"
    client = daemon.client()
    with scratch_dir("dsec-openenv-ctx-") as ctx:
        (ctx / "Dockerfile").write_text(DOCKERFILE)
        shutil.copy(ROOT / "constraints.txt", ctx / "constraints.txt")
        (ctx / "env" / "server").mkdir(parents=True)
        (ctx / "env" / "openenv.yaml").write_text(OPENENV_YAML)
        (ctx / "env" / "models.py").write_text(MODELS)
        (ctx / "env" / "server" / "__init__.py").write_text("")
        (ctx / "env" / "server" / "counter_environment.py").write_text(ENVIRONMENT)
        (ctx / "env" / "server" / "app.py").write_text(APP)
        client.build_dockerfile(name, ctx)
    try:
        yield name
    finally:
        client.remove_image(name)


def provider(daemon: Daemon, label: str, **kw: Any) -> DsecProvider:
    return DsecProvider(url=daemon.url, token=daemon.token, labels={"test": label}, sandbox_timeout=600, **kw)


def live(daemon: Daemon, label: str) -> list[dsec.SandboxInfo]:
    return daemon.client().list(labels={"test": label})


@pytest.mark.timeout(1500)  # the first run builds the image: apt, then openenv-core and its dependencies
async def test_from_docker_image_runs_the_server_in_a_sandbox_and_close_removes_it(daemon: Daemon, image: str) -> None:
    p = provider(daemon, "lifecycle", memory="1Gi")
    env = await CounterClient.from_docker_image(image, provider=p, env_vars={"COUNTER_GREETING": "hello"})
    try:
        sb = p.sandbox
        assert sb is not None and p.base_url is not None
        # the URL is the exposed port's, path and all; OpenEnv built its /ws from it
        assert p.base_url.startswith(f"{daemon.url}/ports/{sb.id}/8000/") and not p.base_url.endswith("/")
        assert env._ws_url == "ws" + p.base_url.removeprefix("http") + "/ws"
        async with httpx.AsyncClient() as http:
            assert (await http.get(p.base_url + "/health")).json() == {"status": "healthy"}
        sb.files.write("/tmp/marker", "only in " + sb.id)

        first = await env.reset(seed=3, episode_id="ep-1")
        assert first.observation == {"total": 3, "greeting": "hello", "marker": f"only in {sb.id}"}
        assert (first.reward, first.done) == (None, False)
        second = await env.step({"amount": 4})
        assert (second.observation["total"], second.reward, second.done) == (7, 4.0, False)
        third = await env.step({"amount": 5})
        assert (third.observation["total"], third.reward, third.done) == (12, 5.0, True)
        assert await env.state() == {"episode_id": "ep-1", "step_count": 2}
        assert [s.id for s in live(daemon, "lifecycle")] == [sb.id]
        p_url = p.base_url
    finally:
        await env.close()
    assert p.sandbox is None and live(daemon, "lifecycle") == []
    assert dsec.Sandbox.connect(sb.id, client=daemon.client()).info().state.value == "stopped"
    async with httpx.AsyncClient() as http:  # the URL is gone with the sandbox
        assert (await http.get(f"{p_url}/health")).status_code == 404
    p.stop_container()  # again: nothing to do


async def test_an_explicit_command_and_port_and_the_generic_client(daemon: Daemon, image: str) -> None:
    cmd = "cd /app/env && exec uvicorn server.app:app --host 127.0.0.1 --port $PORT"
    p = provider(daemon, "explicit", cmd=cmd)
    env = await GenericEnvClient.from_docker_image(image, provider=p, port=9001)
    try:
        assert p.base_url is not None and "/9001/" in p.base_url
        with pytest.raises(RuntimeError, match="already runs sandbox"):
            p.start_container(image)
        # two sessions of the same server, each with its own environment
        other = GenericEnvClient(base_url=p.base_url)
        try:
            await env.reset(seed=1)
            await other.reset(seed=5)
            mine, theirs = await env.step({"amount": 1}), await other.step({"amount": 1})
            assert (mine.observation["total"], theirs.observation["total"]) == (2, 6)
        finally:
            await other.disconnect()
        listing = p.sandbox.exec(["cat", LOG_PATH]).stdout if p.sandbox else ""
        assert "Uvicorn running on http://127.0.0.1:9001" in listing
    finally:
        await env.close()
    assert live(daemon, "explicit") == []


async def test_a_server_that_exits_fails_with_its_output_and_leaves_no_sandbox(daemon: Daemon, image: str) -> None:
    p = provider(daemon, "exits", cmd="echo about to fail >&2; exit 7")
    with pytest.raises(EnvServerError, match=r"(?s)exited 7 before it answered /health.*about to fail"):
        await CounterClient.from_docker_image(image, provider=p)
    assert p.sandbox is None and live(daemon, "exits") == []


async def test_a_server_that_never_answers_times_out_and_leaves_no_sandbox(daemon: Daemon, image: str) -> None:
    p = provider(daemon, "silent", cmd="echo listening elsewhere; exec sleep 600", ready_timeout=3)
    with pytest.raises(TimeoutError, match=r"(?s)within 3 s \(last answer: 502;.*port 8000.*listening elsewhere"):
        await CounterClient.from_docker_image(image, provider=p)
    assert p.sandbox is None and live(daemon, "silent") == []


async def test_an_image_without_openenv_yaml_needs_a_command(daemon: Daemon) -> None:
    p = provider(daemon, "no-yaml")
    with pytest.raises(EnvServerError, match=r"no openenv\.yaml.*pass cmd="):
        await CounterClient.from_docker_image("dsec/debian:12", provider=p)
    assert live(daemon, "no-yaml") == []
    # and a missing image is the daemon's own error, with nothing left behind either
    with pytest.raises(dsec.ImageNotFound):
        p.start_container("dsec/openenv-absent:1")
    assert live(daemon, "no-yaml") == []


def test_a_provider_nobody_stopped_kills_its_sandbox_when_collected(daemon: Daemon, image: str) -> None:
    p = provider(daemon, "collected")
    p.start_container(image)
    assert p.sandbox is not None
    sandbox_id = p.sandbox.id
    assert [s.id for s in live(daemon, "collected")] == [sandbox_id]
    del p
    gc.collect()
    assert live(daemon, "collected") == []
    assert dsec.Sandbox.connect(sandbox_id, client=daemon.client()).info().state.value == "stopped"
