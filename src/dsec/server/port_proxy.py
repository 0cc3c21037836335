"""The reverse proxy to sandboxes' exposed ports, in front of the node API on the daemon's listener.

``/ports/{sandbox}/{port}/{secret}/{rest}`` is answered here, outside the API's middleware (its traffic is
the sandbox's, not calls to be audited, limited as JSON or replayed by idempotency keys); everything else
goes on to the API. The sandbox, port and secret are checked by core/ports.py, which opens a fresh
connection to the port on the sandbox's loopback (made by the kind) for each request; web/port_relay.py
carries the request over it. The server sees ``rest`` as its path, and the URL's path up to the port's
root in ``X-Forwarded-Prefix``.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from ..core.manager import SandboxManager
from ..core.ports import PortActions
from ..errors import DsecError, InvalidRequest
from ..protocol.ports import PORTS_PREFIX
from ..web.port_relay import Hop, dsec_error, raw_path, refuse, relay, request_target


def split_path(path: str) -> tuple[str, int, str, str]:
    """``/ports/{sandbox}/{port}/{secret}/{rest}`` → (sandbox, port, secret, "/" + rest)."""
    parts = path[len(PORTS_PREFIX) :].split("/", 3)
    if (
        not path.startswith(PORTS_PREFIX)
        or len(parts) < 3
        or not parts[0]
        or not parts[2]
        or not (parts[1].isascii() and parts[1].isdigit() and len(parts[1]) <= 5)
        or not 1 <= int(parts[1]) <= 65535
    ):
        raise InvalidRequest("a port's address is /ports/{sandbox}/{port}/{secret}/... with a port of 1-65535")
    return parts[0], int(parts[1]), parts[2], "/" + (parts[3] if len(parts) == 4 else "")


class PortProxy:
    def __init__(self, app: ASGIApp, manager: SandboxManager) -> None:
        self.app = app
        self.manager = manager  # looked up per request: tests swap the manager behind one app

    @property
    def ports(self) -> PortActions:
        return self.manager.ports

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = raw_path(scope) if scope["type"] in ("http", "websocket") else ""
        if not path.startswith(PORTS_PREFIX):
            await self.app(scope, receive, send)
            return
        try:
            sandbox_id, port, secret, rest = split_path(path)
            hop = Hop(port, request_target(scope, rest), path[: len(path) - len(rest) + 1])
            sock = await self.ports.connect(sandbox_id, port, secret)
        except DsecError as e:
            await refuse(scope, send, *dsec_error(e))
            return
        try:
            await relay(scope, receive, send, sock, hop)
        finally:
            self.ports.closed(sandbox_id)
