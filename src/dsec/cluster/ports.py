"""Sandboxes' ports through the cluster gateway: ``/ports/{sandbox}/...`` on the gateway's listener, and
E2B's ``PORT-ID.DOMAIN`` hosts on its E2B listener, each relayed to the node that holds the sandbox.

The gateway holds no port's secret and checks none: it finds the sandbox's node (its directory) and
passes the request on as it came; the node's proxy checks the port's secret (the node's E2B API, the
traffic token) as it does for a client of its own, and its refusal comes back as it gave it. The
operator's token, which the gateway adds to every other call to a node, is never added here: the node
does not need it, and the sandbox's server would see it.

HTTP bodies are streamed both ways, each chunk passed on once the other side has taken the one before,
so a slow side slows the other and nothing is held whole. A WebSocket is relayed message by message
(web/ws_relay.py) over a connection to the node of its own. Like the node, the gateway bounds the
connections open to one sandbox's ports, and it sits outside its API's middleware (this traffic is
the sandbox's: no idempotency keys are remembered for it).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Callable

from ..e2b.errors import GONE_TEMPLATE
from ..e2b.hosts import PORT_HEADER, SANDBOX_HEADER, sandbox_port
from ..errors import DaemonUnreachable, DsecError, LimitExceeded, NotFound, PortUnreachable
from ..protocol.ports import MAX_CONNECTIONS, PORTS_PREFIX
from ..web.disconnect import unless_gone
from ..web.port_relay import dsec_error, forwarded, refuse
from ..web.ws_relay import Refused, Relay, Unsendable, client_headers, deny
from .e2b import E2BGateway
from .gateway import Gateway
from .nodes import Node
from .proxy import Receive, Scope, Send, request_headers, target
from .wire import RESPONSE_DROP, Broken, NodeClient, Response

log = logging.getLogger("dsec.cluster.ports")

Shape = Callable[[DsecError], tuple[int, bytes]]  # an error as (status, body) of the API serving it
SANDBOX_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
NO_PORT = "no such exposed port (the sandbox ended, the port was unexposed, or the URL is wrong)"  # the node's


class _ClientGone(Exception):
    """The client went away in the middle of its request's body: the node must not see it as complete."""


def e2b_shape(e: DsecError) -> tuple[int, bytes]:
    status = 502 if isinstance(e, DaemonUnreachable) else e.http_status
    return status, json.dumps({"code": status, "message": e.message}).encode()


async def _body(receive: Receive) -> bytes | AsyncIterator[bytes]:
    """The request's body: its bytes when they came in one message, else a stream that fails, rather
    than ends, when the client goes away before the end."""
    first = await receive()
    if first["type"] == "http.disconnect":
        raise _ClientGone
    if not first.get("more_body"):
        return bytes(first.get("body", b""))

    async def rest() -> AsyncIterator[bytes]:
        yield first.get("body", b"")
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _ClientGone
            yield msg.get("body", b"")
            if not msg.get("more_body"):
                return

    return rest()


async def _answer(resp: Response, send: Send) -> None:
    out = [(k, v) for k, v in resp.headers if k not in RESPONSE_DROP]
    await send({"type": "http.response.start", "status": resp.status, "headers": out})
    async for chunk in resp.chunks():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class PortTraffic:
    """Requests and WebSockets for sandboxes' ports, passed to their nodes; bounded per sandbox."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._open: dict[str, int] = {}

    async def through(
        self,
        node: Node,
        client: NodeClient,
        scope: Scope,
        receive: Receive,
        send: Send,
        sandbox_id: str,
        headers: list[tuple[bytes, bytes]],
        shape: Shape,
    ) -> None:
        """Pass the request to ``client`` (a listener of ``node``) with ``headers`` for the client's."""
        if self._open.get(sandbox_id, 0) >= MAX_CONNECTIONS:
            err = LimitExceeded(f"sandbox {sandbox_id} has {MAX_CONNECTIONS} connections open through its ports")
            await refuse(scope, send, *shape(err))
            return
        self._open[sandbox_id] = self._open.get(sandbox_id, 0) + 1
        try:
            if scope["type"] == "websocket":
                await self._websocket(node, client, scope, receive, send, headers, shape)
            else:
                await self._http(node, client, scope, receive, send, headers, shape)
        finally:
            left = self._open.pop(sandbox_id) - 1
            if left > 0:
                self._open[sandbox_id] = left

    def _unreachable(self, node: Node, e: Exception) -> DsecError:
        self.gw.nudge(node)
        return DaemonUnreachable(f"node {node.name} ({node.url}) does not answer: {e}")

    async def _http(
        self,
        node: Node,
        client: NodeClient,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        shape: Shape,
    ) -> None:
        try:
            content = await _body(receive)
            length = None
            if not isinstance(content, bytes):
                declared = next((v for k, v in headers if k == b"content-length"), b"")
                length = int(declared) if declared.isdigit() else None
            resp = await client.send(scope["method"], target(scope), headers, content, length=length, authorize=False)
        except _ClientGone:
            return
        except Broken as e:
            await refuse(scope, send, *shape(self._unreachable(node, e)))
            return
        try:
            # a client that leaves ends the answer, and the node's connection with it (so the node lets
            # go of the sandbox's server): an endless event stream is not read on for nobody
            await unless_gone(receive, _answer(resp, send), f"a port's answer from node {node.name}")
        except Broken as e:  # the answer is under way: all that can be done is to cut it short
            log.info("a port's answer from node %s cut short: %s", node.name, e)
        finally:
            await resp.close()

    async def _websocket(
        self,
        node: Node,
        client: NodeClient,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        shape: Shape,
    ) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        try:
            async with client.stream() as conn:
                relay = Relay(conn.reader, conn.writer)
                subprotocols = list(scope.get("subprotocols") or [])
                try:
                    accepted = await relay.handshake(client.authority, target(scope), subprotocols, headers)
                except Refused as e:  # the node's own answer (a wrong secret: its 404), passed on
                    await deny(scope, send, e.status, e.body, [(k, v) for k, v in e.headers if k not in RESPONSE_DROP])
                    return
                except Unsendable as e:
                    await deny(scope, send, *shape(PortUnreachable(f"the WebSocket cannot be passed on: {e}")))
                    return
                except (OSError, TimeoutError) as e:
                    await deny(scope, send, *shape(self._unreachable(node, e)))
                    return
                await send({"type": "websocket.accept", "subprotocol": accepted.subprotocol})
                await relay.run(receive, send)
        except Broken as e:  # the connection to the node could not be made
            await deny(scope, send, *shape(self._unreachable(node, e)))


class GatewayPorts:
    """Outermost on the gateway's listener: ``/ports/{sandbox}/...`` to the sandbox's node, the rest to
    the gateway's API."""

    def __init__(self, app: Callable[[Scope, Receive, Send], object], gateway: Gateway, traffic: PortTraffic) -> None:
        self.app = app
        self.gw = gateway
        self.traffic = traffic

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        path = target(scope) if kind in ("http", "websocket") else ""
        if not path.startswith(PORTS_PREFIX):
            if kind == "websocket":  # the API has none
                await refuse(scope, send, *dsec_error(NotFound(f"no WebSocket at {scope['path'][:200]}")))
            else:
                await self.app(scope, receive, send)  # type: ignore[misc]
            return
        sandbox_id = path[len(PORTS_PREFIX) :].split("/", 1)[0]
        node = await self.gw.directory.locate(sandbox_id) if SANDBOX_ID.fullmatch(sandbox_id) else None
        if node is None or node.lost:  # as the node answers a URL that opens nothing
            await refuse(scope, send, *dsec_error(NotFound(NO_PORT)))
            return
        headers = _client_headers(scope) + forwarded(scope, "")
        await self.traffic.through(node, node.http, scope, receive, send, sandbox_id, headers, dsec_error)


class E2BGatewayPorts:
    """Outermost on the gateway's E2B listener: requests for ``PORT-ID.DOMAIN`` (or with E2B's routing
    headers) to the E2B listener of the sandbox's node, named there by the routing headers (the node's
    own domain is not the gateway's); the rest to the gateway's E2B API."""

    def __init__(
        self, app: Callable[[Scope, Receive, Send], object], e2b: E2BGateway, traffic: PortTraffic, domain: str
    ) -> None:
        self.app = app
        self.e2b = e2b
        self.traffic = traffic
        self.domain = domain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # type: ignore[misc]
            return
        try:
            where = sandbox_port(scope["headers"], self.domain)
        except DsecError as e:
            await refuse(scope, send, *e2b_shape(e))
            return
        if where is None:
            if scope["type"] == "websocket":
                await refuse(scope, send, *e2b_shape(NotFound(f"no WebSocket at {scope['path'][:200]}")))
            else:
                await self.app(scope, receive, send)  # type: ignore[misc]
            return
        sandbox_id, port = where
        found = await self.e2b.holder(sandbox_id) if SANDBOX_ID.fullmatch(sandbox_id) else None
        if found is None:
            message = GONE_TEMPLATE.format(id=sandbox_id[:64])  # as the node answers one it does not hold
            await refuse(scope, send, 502, json.dumps({"code": 502, "message": message}).encode())
            return
        node, client = found
        headers = [(k, v) for k, v in _client_headers(scope) if k not in (SANDBOX_HEADER, PORT_HEADER)]
        headers += [(SANDBOX_HEADER, sandbox_id.encode()), (PORT_HEADER, str(port).encode()), *forwarded(scope, "")]
        await self.traffic.through(node, client, scope, receive, send, sandbox_id, headers, e2b_shape)


def _client_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The client's headers that go on to the node: an HTTP request's as for any call passed through
    but ``Expect`` (the gateway answered it; the node's 100 would be read as its answer), a WebSocket
    handshake's but those the hop to the node makes afresh."""
    if scope["type"] == "websocket":
        return client_headers(scope)
    return [(k, v) for k, v in request_headers(scope) if k != b"expect"]
