"""The Connect protocol (https://connectrpc.com/docs/protocol), server side, JSON codec only, for Starlette.

A unary RPC is plain HTTP: an ``application/json`` request, an ``application/json`` response, and an error is an
HTTP status with a ``{"code", "message"}`` body. A streaming RPC (``application/connect+json``) wraps each
message in an envelope (1 byte of flags, a 4-byte big-endian length, the payload) and ends its response with an
end-of-stream envelope carrying the outcome, so a streaming response is HTTP 200 even when the RPC fails.

Compression is never negotiated: the e2b SDKs disable it, and the messages are small JSON.

How a route uses this, for a unary RPC::

    try:
        codec_check(request, streaming=False)
        req = await unary_message(request, ListRequest, MAX)
        return unary_response(ListResponse(...))
    except HttpError as e:
        return e.response()
    except RpcError as e:
        return error_response(e)

and for a server-streaming one, ``stream_request_message`` for the request, ``stream_response`` for the events,
and ``stream_error_response`` for an error met before the stream exists.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import re
import socket
import struct
from collections.abc import AsyncIterator, Mapping
from types import MappingProxyType
from typing import Any, Final, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("dsec.e2b")

M = TypeVar("M", bound=BaseModel)

HTTP_STATUS: Final[Mapping[str, int]] = MappingProxyType(
    {
        "canceled": 499,
        "unknown": 500,
        "invalid_argument": 400,
        "deadline_exceeded": 504,
        "not_found": 404,
        "already_exists": 409,
        "permission_denied": 403,
        "resource_exhausted": 429,
        "failed_precondition": 400,
        "aborted": 409,
        "out_of_range": 400,
        "unimplemented": 501,
        "internal": 500,
        "unavailable": 503,
        "data_loss": 500,
        "unauthenticated": 401,
    }
)
"""The Connect error codes and the HTTP status each is sent with in a unary response."""

UNARY_CONTENT_TYPE: Final = "application/json"
STREAM_CONTENT_TYPE: Final = "application/connect+json"
FLAG_COMPRESSED: Final = 0x01
FLAG_END_STREAM: Final = 0x02

_PREFIX = struct.Struct(">BI")
_TIMEOUT = re.compile(r"[0-9]{1,10}")


class RpcError(Exception):
    """An RPC's failure, as a Connect code and a message for the client."""

    def __init__(self, code: str, message: str) -> None:
        if code not in HTTP_STATUS:
            raise ValueError(f"not a Connect error code: {code!r}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class StreamCut(BaseException):
    """Raised by a stream's producer to end the response the way a lost connection ends it: without an
    end-of-stream message, the connection closed. It is how E2B's clients learn that the sandbox behind a
    stream died (they then ask the sandbox's health, and report it killed). A BaseException, so that the
    app's handlers of ordinary errors let it through to the server, which closes the connection."""


RESET_KEY = "dsec.e2b.reset"  # in a request's state: makes its TCP connection close with a reset


class ResettableConnections:
    """Gives each request a way to make its TCP connection close with a reset rather than an orderly
    end (``scope["state"][RESET_KEY]()``): a client reads a reset as the connection lost, an early end as a
    malformed response. ASGI offers no way to either; uvicorn's receive callable is a method of the
    connection's protocol object, which holds the asyncio transport. Without one, cuts end orderly."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            transport = getattr(getattr(receive, "__self__", None), "transport", None)
            if callable(getattr(transport, "get_extra_info", None)):  # asyncio's or uvloop's
                # in the request's state: middlewares may pass a copy of the scope on, never of its state
                scope.setdefault("state", {})[RESET_KEY] = functools.partial(_linger_zero, transport)
        await self.app(scope, receive, send)


def _linger_zero(transport: Any) -> None:  # asyncio.BaseTransport, or uvloop's (not a subclass of it)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class _QuietCuts(logging.Filter):
    """The server logs what an app raises; a cut is deliberate, not a failure worth a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], StreamCut))


_QUIET_CUTS = _QuietCuts()


class HttpError(Exception):
    """A request refused at the HTTP level, before the Connect protocol starts (a wrong method, an unsupported
    codec). Connect clients expect these as bare HTTP statuses, not as Connect errors."""

    def __init__(self, status: int, reason: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status}: {reason}")
        self.status = status
        self.reason = reason
        self.headers = dict(headers or {})

    def response(self) -> Response:
        return Response(self.reason, status_code=self.status, headers=self.headers, media_type="text/plain")


# -- envelopes ---------------------------------------------------------------------------------------------------


def envelope(payload: bytes, *, end: bool = False) -> bytes:
    """One streaming message: flags, big-endian length, payload."""
    return _PREFIX.pack(FLAG_END_STREAM if end else 0, len(payload)) + payload


def end_of_stream(error: RpcError | None = None) -> bytes:
    """The envelope that ends a streaming response: ``{}`` for success, else ``{"error": {...}}``."""
    body: dict[str, Any] = {} if error is None else {"error": error.to_json()}
    return envelope(json.dumps(body, separators=(",", ":")).encode(), end=True)


async def read_messages(chunks: AsyncIterator[bytes], max_message: int) -> AsyncIterator[bytes]:
    """The payloads of the enveloped messages in a request body, as the body arrives."""
    buffer = bytearray()
    async for chunk in chunks:
        if not chunk:
            continue
        buffer += chunk
        start = 0
        while len(buffer) - start >= _PREFIX.size:
            flags, length = _PREFIX.unpack_from(buffer, start)
            # checked as soon as the prefix is in, so that an oversize message is refused before it is buffered
            _check_prefix(flags, length, max_message)
            end = start + _PREFIX.size + length
            if len(buffer) < end:
                break
            with memoryview(buffer) as view:
                payload = bytes(view[start + _PREFIX.size : end])
            start = end
            yield payload
        # one compaction per chunk, not per message: many small messages in a chunk stay linear
        if start:
            del buffer[:start]
    if buffer:
        have = len(buffer) - _PREFIX.size
        what = f"{have} of {_PREFIX.unpack_from(buffer)[1]} bytes" if have >= 0 else "in the envelope prefix"
        raise RpcError("invalid_argument", f"request body ended in the middle of a message ({what})")


def _check_prefix(flags: int, length: int, max_message: int) -> None:
    if flags & FLAG_COMPRESSED:
        # internal, as connect-go and connect-python answer it: the client compressed although no compression was
        # negotiated (codec_check refuses a connect-content-encoding other than identity), a protocol violation by
        # the client library rather than a bad argument from the caller
        raise RpcError("internal", "compressed messages are not supported")
    if flags & FLAG_END_STREAM:
        raise RpcError("invalid_argument", "end-of-stream flag in a request message")
    if flags:
        raise RpcError("invalid_argument", f"unknown envelope flags 0x{flags:02x}")
    if length > max_message:
        raise RpcError("resource_exhausted", f"request message of {length} bytes is larger than {max_message}")


# -- requests ----------------------------------------------------------------------------------------------------


def method_check(request: Request) -> None:
    """Connect RPCs are POSTs (the SDKs never use Connect's GET for side-effect-free methods)."""
    if request.method != "POST":
        raise HttpError(405, "Method Not Allowed", {"Allow": "POST"})


def codec_check(request: Request, *, streaming: bool) -> None:
    """The request's content type, encoding and protocol version are what this server speaks.

    An unsupported content type (binary protobuf, or a streaming type on a unary method) raises HttpError 415 with
    ``Accept-Post`` naming the one accepted, as the Connect spec asks; the rest raise RpcError.
    """
    expected = STREAM_CONTENT_TYPE if streaming else UNARY_CONTENT_TYPE
    content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if content_type != expected:
        raise HttpError(415, "Unsupported Media Type", {"Accept-Post": expected})
    version = request.headers.get("connect-protocol-version")
    if version is not None and version != "1":
        raise RpcError("invalid_argument", f"connect-protocol-version must be 1, got {version[:20]!r}")
    # the SDK's connectrpc sends "identity" when compression is disabled
    encoding_header = "connect-content-encoding" if streaming else "content-encoding"
    encoding = request.headers.get(encoding_header, "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise RpcError("unimplemented", f"{encoding_header} {encoding[:20]!r} is not supported; accepted: identity")


def timeout_ms(request: Request) -> int | None:
    """The client's deadline from ``connect-timeout-ms``, in milliseconds, or None without one."""
    value = request.headers.get("connect-timeout-ms")
    if value is None:
        return None
    # a regex, not int(): int() also takes "+5", " 5" and "5_000"
    if not _TIMEOUT.fullmatch(value):
        raise RpcError("invalid_argument", f"connect-timeout-ms must be 1 to 10 digits, got {value[:20]!r}")
    return int(value)


def parse_message(model: type[M], data: bytes) -> M:
    """One JSON message (empty means ``{}``); anything the model refuses is invalid_argument."""
    try:
        return model.model_validate_json(data or b"{}")
    except ValidationError as e:
        raise RpcError("invalid_argument", _describe(model, e)) from None


def _describe(model: type[BaseModel], error: ValidationError) -> str:
    problems = error.errors(include_url=False, include_input=False)
    first = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    if first["type"] == "json_invalid":
        return f"malformed JSON for {model.__name__}: {first.get('ctx', {}).get('error', first['msg'])}"
    message = first["msg"].removeprefix("Value error, ")
    where = ".".join(str(part) for part in first["loc"])
    return f"invalid {model.__name__}: {where + ': ' if where else ''}{message}{more}"


async def unary_message(request: Request, model: type[M], max_bytes: int) -> M:
    """The request message of a unary RPC, its body read up to ``max_bytes``."""
    declared = request.headers.get("content-length", "")
    # isascii: str.isdigit() also takes digits like "²", which int() refuses
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise RpcError("resource_exhausted", f"request message of {declared} bytes is larger than {max_bytes}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise RpcError("resource_exhausted", f"request message is larger than {max_bytes} bytes")
    return parse_message(model, bytes(body))


async def stream_messages(request: Request, model: type[M], max_message: int) -> AsyncIterator[M]:
    """The request messages of a client-streaming RPC, parsed as they arrive."""
    async for payload in read_messages(request.stream(), max_message):
        yield parse_message(model, payload)


async def stream_request_message(request: Request, model: type[M], max_message: int) -> M:
    """The single request message of a server-streaming RPC (enveloped, as the body of any streaming RPC is)."""
    found: M | None = None
    async for message in stream_messages(request, model, max_message):
        if found is not None:
            raise RpcError("invalid_argument", "a server-streaming request has exactly one message, got several")
        found = message
    if found is None:
        raise RpcError("invalid_argument", "a server-streaming request has exactly one message, got none")
    return found


# -- responses ---------------------------------------------------------------------------------------------------


def _wire(message: BaseModel) -> bytes:
    return message.model_dump_json(by_alias=True, exclude_none=True).encode()


def unary_response(message: BaseModel) -> Response:
    return Response(_wire(message), media_type=UNARY_CONTENT_TYPE)


def error_response(err: RpcError) -> Response:
    """A unary RPC's error: the code's HTTP status and ``{"code", "message"}``."""
    return Response(json.dumps(err.to_json()).encode(), status_code=err.http_status, media_type=UNARY_CONTENT_TYPE)


def stream_error_response(err: RpcError) -> Response:
    """A streaming RPC that failed before its first message: HTTP 200 and only the end-of-stream error, which is
    where Connect clients look for a streaming RPC's outcome."""
    return Response(end_of_stream(err), media_type=STREAM_CONTENT_TYPE)


def client_stream_response(message: BaseModel) -> Response:
    """The answer of a client-streaming RPC: its one message and the end of the stream."""
    return Response(envelope(_wire(message)) + end_of_stream(), media_type=STREAM_CONTENT_TYPE)


class ConnectStreamingResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client's disconnect (Starlette stops doing so for ASGI
    2.4 servers, leaving an idle stream to notice only at its next write) and always closes its body iterator,
    whichever way the response ends, so the producer behind it is closed at once rather than by the garbage
    collector."""

    body_iterator: AsyncIterator[bytes]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cut: StreamCut | None = None
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        except* OSError:
            pass  # ASGI 2.4 servers raise it from send() once the client is gone: there is no one left to tell
        except* StreamCut as group_of_cuts:
            first = group_of_cuts.exceptions[0]
            cut = first if isinstance(first, StreamCut) else StreamCut()
        finally:
            with anyio.CancelScope(shield=True):
                await _aclose(self.body_iterator)
        if cut is not None:
            # the server (uvicorn) closes the connection of an app that raises after its response began
            logging.getLogger("uvicorn.error").addFilter(_QUIET_CUTS)
            reset = scope.get("state", {}).get(RESET_KEY)
            if reset is not None:
                reset()
            raise cut
        if self.background is not None:
            await self.background()


async def _aclose(iterator: AsyncIterator[Any]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


def stream_response(
    events: AsyncIterator[BaseModel],
    *,
    headers: dict[str, str] | None = None,
    timeout_ms: int | None = None,
) -> StreamingResponse:
    """A server-streaming RPC's response: each event in its envelope, sent as soon as it is produced, then the
    end of the stream: ``{}`` when ``events`` is exhausted, the error when it raises RpcError, ``internal`` when it
    raises anything else (logged; the client learns only the exception's type); no end at all, the
    connection closed, when it raises StreamCut. ``timeout_ms`` (the client's
    ``connect-timeout-ms``) ends the stream with ``deadline_exceeded`` when it runs out.

    ``events`` is closed (``aclose``) however the response ends, a client's disconnect included. A disconnect
    reaches the producer as a cancellation: awaits in its cleanup that must complete need a shielded scope.
    """
    return ConnectStreamingResponse(_frames(events, timeout_ms), headers=headers, media_type=STREAM_CONTENT_TYPE)


async def _frames(events: AsyncIterator[BaseModel], timeout_ms: int | None) -> AsyncIterator[bytes]:
    deadline = None if timeout_ms is None else anyio.current_time() + timeout_ms / 1000
    try:
        while True:
            # the deadline scope covers only the wait for the next event, never the yield: a cancel scope must not
            # stay open across a generator's suspension
            remaining = math.inf if deadline is None else deadline - anyio.current_time()
            with anyio.move_on_after(remaining) as scope:
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    break
            if scope.cancelled_caught:
                raise RpcError("deadline_exceeded", f"the stream exceeded its {timeout_ms} ms timeout")
            yield envelope(_wire(event))
    except RpcError as err:
        yield end_of_stream(err)
    except Exception as exc:
        log.exception("e2b stream failed")
        yield end_of_stream(RpcError("internal", f"the stream failed ({type(exc).__name__})"))
    else:
        yield end_of_stream()
    finally:
        with anyio.CancelScope(shield=True):
            await _aclose(events)
