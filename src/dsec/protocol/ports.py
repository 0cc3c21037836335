"""Ports of a sandbox reachable from outside it: what a caller asks for and what it gets back.

A server listening on a port of the sandbox's loopback (a Jupyter kernel gateway, an OpenEnv environment,
a web app under test) is reached through the daemon, at ``/ports/{sandbox}/{port}/{secret}/...`` on the
daemon's own listener. The secret is made per sandbox and port when the port is exposed and is the only
credential that path takes: the URL can be handed to a program that knows nothing of dsec (a browser, a
harness's HTTP client) without handing it the caller's token. HTTP and WebSocket pass through.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PORTS_PREFIX = "/ports/"
MAX_PORTS = 16  # exposed at once per sandbox
MAX_CONNECTIONS = 256  # open through the proxy at once per sandbox (on its node, and through a gateway)


class ExposeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    port: int = Field(ge=1, le=65535, description="A TCP port on the sandbox's loopback (127.0.0.1).")
    protocol: Literal["http"] = Field("http", description="HTTP/1.1, WebSocket upgrades included.")


class ExposedPort(BaseModel):
    port: int = Field(ge=1, le=65535)
    protocol: Literal["http"] = "http"
    path: str = Field(description="The port's address on this daemon's listener: /ports/{sandbox}/{port}/{secret}/")
    created_at: datetime


class ExposedPorts(BaseModel):
    ports: list[ExposedPort] = Field(default_factory=list)


def port_path(sandbox_id: str, port: int, secret: str) -> str:
    return f"{PORTS_PREFIX}{sandbox_id}/{port}/{secret}/"
