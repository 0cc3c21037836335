"""Two ASGI apps behind one server, told apart by the port a request came in on."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class ByListener:
    """One server, two listeners: what arrives on the E2B port (HTTP, and WebSockets to a sandbox's
    ports) goes to the E2B app, the rest (and the lifespan, which starts and stops the core both share)
    to dsec's own."""

    def __init__(self, main: ASGIApp, e2b: ASGIApp, e2b_port: int) -> None:
        self.main = main
        self.e2b = e2b
        self.e2b_port = e2b_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server") or (None, None)
        if scope["type"] in ("http", "websocket") and server[1] == self.e2b_port:
            await self.e2b(scope, receive, send)
        else:
            await self.main(scope, receive, send)
