"""OpenEnv on dsec: an environment server in a dsec sandbox, driven by OpenEnv's own client.

    pip install 'dsec[openenv]'
    dsec serve --listen http://127.0.0.1:7000 &          # exposed ports need the daemon on TCP
    DSEC_URL=http://127.0.0.1:7000 DSEC_TOKEN=... python examples/openenv_dsec.py [IMAGE]

With no IMAGE, a small echo environment written with OpenEnv's server API is built first (a Dockerfile
laid out as OpenEnv's template lays one out: the environment in /app/env with its openenv.yaml). An
OpenEnv image from a registry (one built by ``openenv build``) runs the same way: its openenv.yaml names
the server, since dsec does not run an image's CMD; or pass ``cmd=`` to ``DsecProvider``.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from openenv.core.generic_client import GenericEnvClient

import dsec
from dsec.integrations.openenv import DsecProvider

IMAGE = "examples/openenv-echo:1"
OPENENV = "0.3.0"

ECHO = """\
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed: str = ""


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(echoed="ready")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        return EchoObservation(echoed=action.message, reward=len(action.message), done=action.message == "bye")

    @property
    def state(self):
        return self._state


app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo")
"""

DOCKERFILE = f"""\
FROM dsec/debian:12
RUN apt-get update -q && apt-get install -y -q --no-install-recommends python3-venv && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /app/.venv && /app/.venv/bin/pip install -q --no-cache-dir openenv-core=={OPENENV}
COPY env/ /app/env/
ENV PATH=/app/.venv/bin:$PATH
WORKDIR /app/env
CMD ["sh", "-c", "cd /app/env && uvicorn server:app --host 0.0.0.0 --port 8000"]
"""


def build_echo_image(client: dsec.Client) -> str:
    if any(i.name == IMAGE for i in client.images()):
        return IMAGE
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Path(tmp)
        (ctx / "Dockerfile").write_text(DOCKERFILE)
        (ctx / "env").mkdir()
        (ctx / "env" / "server.py").write_text(ECHO)
        (ctx / "env" / "openenv.yaml").write_text("spec_version: 1\nname: echo\napp: server:app\nport: 8000\n")
        print(f"building {IMAGE} (apt and pip: a minute or two the first time)")
        client.build_dockerfile(IMAGE, ctx)
    return IMAGE


async def main(image: str | None) -> None:
    if image is None:
        with dsec.Client() as client:
            image = build_echo_image(client)
    provider = DsecProvider(memory="2Gi", labels={"example": "openenv"})
    env = await GenericEnvClient.from_docker_image(image, provider=provider)
    try:
        assert provider.sandbox is not None
        print("server in sandbox", provider.sandbox.id, "at", provider.base_url)
        print("reset ->", await env.reset(episode_id="demo"))
        for message in ["hello", "from a dsec sandbox", "bye"]:
            result = await env.step({"message": message})
            print(f"step {message!r} -> {result.observation} reward={result.reward} done={result.done}")
        print("state ->", await env.state())
    finally:
        await env.close()  # stops the provider: the sandbox is killed


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else None))
