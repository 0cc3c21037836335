"""Port 49999 of an E2B sandbox: where the ``e2b-code-interpreter`` package finds its Jupyter server.

E2B's code-interpreter template runs a server of E2B's own on that port; a dsec sandbox runs none. The
package reaches it as any sandbox port (``E2b-Sandbox-Port: 49999`` with ``E2B_SANDBOX_URL``, or the host
``49999-ID.DOMAIN``), with the sandbox's traffic access token. This middleware, outside the port relay
(ports.py), takes those requests and hands them to the E2B app's own routes under ``PREFIX``
(code_interpreter.py), which answer from dsec's code contexts (core/code/). So the calls are audited and
bounded as the API's are, and nothing is served from inside the sandbox.

The sandbox the request is for travels in the ASGI scope (``MARK``), never in a header: a client that
calls ``PREFIX`` directly names no sandbox and gets a 404.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import DsecError
from ..web.port_relay import raw_path, refuse
from .auth import EnvdTokens
from .hosts import ROUTING, TRAFFIC_HEADER, sandbox_port

JUPYTER_PORT = 49999  # e2b_code_interpreter.constants.JUPYTER_PORT
PREFIX = "/code-interpreter"
MARK = "dsec.e2b.code_interpreter"  # scope key: the sandbox id a request under PREFIX is for


class CodeInterpreterPort:
    def __init__(self, app: ASGIApp, tokens: EnvdTokens, domain: str | None) -> None:
        self.app = app
        self.tokens = tokens
        self.domain = domain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        try:
            where = sandbox_port(headers, self.domain)
        except DsecError:  # a malformed port: the port relay answers it
            where = None
        if where is None or where[1] != JUPYTER_PORT:
            await self.app(scope, receive, send)
            return
        sandbox_id = where[0]
        token = next((v for k, v in headers if k == TRAFFIC_HEADER), b"").decode("latin-1").strip()
        if not self.tokens.check_traffic(sandbox_id, token):
            message = "a sandbox's ports need its traffic access token (trafficAccessToken) in e2b-traffic-access-token"
            await refuse(scope, send, 403, json.dumps({"code": 403, "message": message}).encode())
            return
        inner = dict(scope)
        inner["path"] = PREFIX + str(scope.get("path", ""))
        inner["raw_path"] = (PREFIX + raw_path(scope).partition("?")[0]).encode("latin-1")
        # without the routing headers and the PORT-ID host, the port relay lets it through to the routes
        inner["headers"] = [(k, v) for k, v in headers if k not in ROUTING and k != b"host"]
        inner[MARK] = sandbox_id
        await self.app(inner, receive, send)
