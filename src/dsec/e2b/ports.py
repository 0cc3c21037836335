"""A sandbox's ports through the E2B API: what E2B's ``sandbox.get_host(port)`` names, served on the E2B
listener by dsec's port relay (web/port_relay.py) with E2B's credential.

A request for ``{port}-{id}.{domain}`` (or with E2B's routing headers, hosts.py) must carry the sandbox's
traffic access token in ``e2b-traffic-access-token``, as E2B asks of sandboxes made with
``allow_public_traffic=False``, which is the only way dsec makes them: a port is reached by whoever
holds that sandbox's token, never by whoever knows its id. Any port of the sandbox's loopback may be
reached, as on E2B, with no exposing first; the sandbox's bound on open connections is the node
proxy's. The token and the routing headers end here, never reaching the server.

Like the node's port proxy, this sits outside the E2B API's middleware: the traffic is the sandbox's, not
calls to audit, bound as JSON bodies or replay by idempotency keys.
"""

from __future__ import annotations

import contextlib
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from ..core.manager import SandboxManager
from ..errors import DsecError, InvalidState, NotFound
from ..web.port_relay import Hop, raw_path, refuse, relay, request_target
from .auth import EnvdTokens
from .control_lifecycle import auto_resumes
from .control_models import DEFAULT_TIMEOUT
from .errors import GONE_TEMPLATE
from .hosts import (
    ACCESS_HEADER,
    META_PUBLIC_TRAFFIC,
    ROUTING,
    SANDBOX_HEADER,
    TRAFFIC_HEADER,
    masked_host,
    sandbox_port,
)


def e2b_error(e: DsecError) -> tuple[int, bytes]:
    """An error of the proxy's in the E2B API's shape."""
    return _body(e.http_status, e.message)


def _body(status: int, message: str) -> tuple[int, bytes]:
    return status, json.dumps({"code": status, "message": message}).encode()


class E2BPorts:
    def __init__(self, app: ASGIApp, manager: SandboxManager, tokens: EnvdTokens, domain: str | None) -> None:
        self.app = app
        self.manager = manager
        self.tokens = tokens
        self.domain = domain

    async def _wake(self, sandbox_id: str) -> None:
        await self.manager.resume(sandbox_id)
        self.manager.set_timeout(sandbox_id, float(DEFAULT_TIMEOUT))

    async def _wake_for_envd(self, headers: list[tuple[bytes, bytes]]) -> None:
        """An envd call (the SDK's) for a paused sandbox made with autoResume, with its access token:
        the sandbox is resumed first, as E2B resumes it on any traffic. Failing, the call goes on and
        gets its own answer."""
        sandbox_id = next((v for k, v in headers if k == SANDBOX_HEADER), b"").decode("latin-1").strip()
        rec = self.manager.sandboxes.find_live(sandbox_id) if sandbox_id else None
        if rec is None or not auto_resumes(rec):
            return
        token = next((v for k, v in headers if k == ACCESS_HEADER), b"").decode("latin-1").strip()
        if token and self.tokens.check(sandbox_id, token):
            with contextlib.suppress(DsecError):
                await self._wake(sandbox_id)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        try:
            where = sandbox_port(headers, self.domain)
            if where is None:
                await self._wake_for_envd(headers)
                await self.app(scope, receive, send)
                return
            sandbox_id, port = where
            target = request_target(scope, raw_path(scope))
        except DsecError as e:
            await refuse(scope, send, *e2b_error(e))
            return
        rec = self.manager.sandboxes.find_live(sandbox_id)
        token = next((v for k, v in headers if k == TRAFFIC_HEADER), b"").decode("latin-1").strip()
        public = rec is not None and rec.labels.get(META_PUBLIC_TRAFFIC) == "true"
        if not public and not self.tokens.check_traffic(sandbox_id, token):
            message = "a sandbox's ports need its traffic access token (trafficAccessToken) in e2b-traffic-access-token"
            await refuse(scope, send, *_body(403, message))
            return
        hop = Hop(port, target, drop=ROUTING, host=masked_host(rec.labels if rec else {}, port))
        try:
            if rec is not None and auto_resumes(rec):  # traffic wakes it, as E2B's autoResume does
                await self._wake(sandbox_id)
            sock = await self.manager.ports.reach(sandbox_id, port)
        except (NotFound, InvalidState):  # as E2B's proxy answers for a sandbox it cannot reach
            await refuse(scope, send, *_body(502, GONE_TEMPLATE.format(id=sandbox_id[:64])))
            return
        except DsecError as e:
            await refuse(scope, send, *e2b_error(e))
            return
        try:
            await relay(scope, receive, send, sock, hop, e2b_error)
        finally:
            self.manager.ports.closed(sandbox_id)
