"""ASGI plumbing of the gateway: reading requests, answering, and passing a call through to a node.

The pass-through is the hot path (every exec goes through it): the request's bytes go to the node as
they are, the node's answer comes back chunk by chunk as it arrives (streamed execs stream), and
nothing is parsed on the way.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from ..errors import DsecError
from ..protocol.sandbox import ErrorBody, ErrorResponse
from .wire import RESPONSE_DROP, Broken, NodeClient

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# not forwarded: they describe one connection, not the call (RFC 9110 7.6.1); the client sets host,
# framing and connection headers of its own
REQUEST_DROP = frozenset({b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade"})
JSON = [(b"content-type", b"application/json")]
NDJSON_TYPE = b"application/x-ndjson"


class Failure(Exception):
    """A call the gateway answers with an error of its own: one of dsec's errors, with the status and code
    the node API gives it (``status`` only where the API served differs, as the E2B API's does); or
    ``relay`` for a node's own error answer passed on."""

    def __init__(
        self,
        kind: type[DsecError],
        message: str,
        detail: dict[str, object] | None = None,
        *,
        status: int | None = None,
        allow: str = "",
    ) -> None:
        super().__init__(message)
        self.status = kind.http_status if status is None else status
        self.code, self.message, self.detail = kind.code, message, detail or {}
        self.allow = allow  # a 405's Allow header: the methods the path has

    @classmethod
    def relay(cls, status: int, code: str, message: str, detail: dict[str, object] | None = None) -> Failure:
        failure = cls(DsecError, message, detail, status=status)
        failure.code = code
        return failure

    def body(self) -> bytes:
        return (
            ErrorResponse(error=ErrorBody(code=self.code, message=self.message, detail=self.detail))
            .model_dump_json(exclude_none=False)
            .encode()
        )


def bearer(scope: Scope) -> bytes:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""


def query(scope: Scope) -> str:
    raw = scope.get("query_string", b"")
    return raw.decode("latin-1") if isinstance(raw, bytes) else str(raw)


def target(scope: Scope) -> str:
    """The path and query as the client sent them (still percent-encoded)."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    qs: bytes = scope.get("query_string", b"")
    return (raw + b"?" + qs if qs else raw).decode("latin-1")


def request_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in scope["headers"] if k not in REQUEST_DROP]


def control_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The caller's headers for a call the gateway makes with a body of its own making."""
    return [(k, v) for k, v in request_headers(scope) if k != b"content-length"]


async def read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    return b"".join(parts)


async def _rest(first: bytes, receive: Receive) -> AsyncIterator[bytes]:
    yield first
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        yield msg.get("body", b"")
        if not msg.get("more_body"):
            return


async def body_of(receive: Receive) -> bytes | AsyncIterator[bytes]:
    """The request body: the bytes when they came in one message (small bodies: execs), else a stream."""
    msg = await receive()
    first = msg.get("body", b"") if msg["type"] == "http.request" else b""
    return _rest(first, receive) if msg.get("more_body") else first


async def answer(send: Send, status: int, body: bytes = b"", headers: list[tuple[bytes, bytes]] | None = None) -> None:
    hdrs = list(headers if headers is not None else JSON)
    if not any(k == b"content-length" for k, _ in hdrs):
        hdrs.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def answer_json(send: Send, status: int, obj: Any) -> None:
    body = obj.model_dump_json().encode() if hasattr(obj, "model_dump_json") else json.dumps(obj).encode()
    await answer(send, status, body)


async def fail(send: Send, f: Failure) -> None:
    headers = list(JSON)
    retry_after = f.detail.get("retry_after")
    if isinstance(retry_after, int | float):
        headers.append((b"retry-after", str(max(1, math.ceil(retry_after))).encode()))
    if f.allow:
        headers.append((b"allow", f.allow.encode()))
    await answer(send, f.status, f.body(), headers)


async def forward(
    node: NodeClient,
    scope: Scope,
    send: Send,
    content: bytes | AsyncIterator[bytes],
    on_broken: Callable[[bool], Failure],
) -> None:
    """Pass a call through to a node and its answer back, streaming both ways.

    ``on_broken(sent)``: the error to answer when the node cannot be reached (``sent`` False: nothing
    reached it) or the connection breaks before the answer starts. Once the answer has started, a
    break ends a streamed exec with an ``error`` event (its protocol always ends with a result or an
    error) and anything else by dropping the connection, which the client sees as a broken read."""
    headers = request_headers(scope)
    length = None
    if not isinstance(content, bytes):
        declared = next((v for k, v in headers if k == b"content-length"), None)
        length = int(declared) if declared is not None and declared.isdigit() else None
    try:
        resp = await node.send(scope["method"], target(scope), headers, content, length=length)
    except Broken as e:
        await fail(send, on_broken(e.sent))
        return
    started = ndjson = False
    last = b""
    try:
        out = [(k, v) for k, v in resp.headers if k not in RESPONSE_DROP]
        ndjson = any(k == b"content-type" and v.startswith(NDJSON_TYPE) for k, v in out)
        remaining = next((int(v) for k, v in out if k == b"content-length" and v.isdigit()), None)
        await send({"type": "http.response.start", "status": resp.status, "headers": out})
        started = True
        more = True
        async for chunk in resp.chunks():  # each chunk on as it comes: streamed execs stream
            if remaining is not None:
                remaining -= len(chunk)
                more = remaining > 0  # a whole small answer goes in one message
            await send({"type": "http.response.body", "body": chunk, "more_body": more})
            last = chunk or last
        if more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except Broken:
        f = on_broken(True)
        if not started:
            await fail(send, f)
        elif ndjson:
            event = {"type": "error", "error": {"code": f.code, "message": f.message, "detail": f.detail}}
            sep = b"" if not last or last.endswith(b"\n") else b"\n"
            await send({"type": "http.response.body", "body": sep + json.dumps(event).encode() + b"\n"})
        else:
            raise
    finally:
        await resp.close()
