"""The in-sandbox (envd) API's plumbing: every call is routed to its sandbox by the ``E2b-Sandbox-Id``
header and opened by that sandbox's access token, so one dsec endpoint (``E2B_SANDBOX_URL``) serves
every sandbox. The work itself is the core's, done from the host side: nothing answers from inside
the sandbox.

A call that names no sandbox, an unknown one, another tenant's, or one with the wrong token gets the
same answer as E2B's proxy gives for a sandbox that is gone (502, "was not found"), so sandbox ids
cannot be probed.
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import APIRouter, Request, Response

from ..errors import DsecError, SandboxNotFound
from ..protocol.sandbox import TERMINAL_STATES, State
from ..store.records import SandboxRecord
from ..tenancy import Caller
from ..web.audit import note
from ..web.auth import name_caller
from . import connect
from .auth import header, owner_caller
from .connect import HttpError, RpcError
from .envd_models import WireModel
from .errors import gone, plain_error, rpc_error
from .hosts import envd_sandbox
from .service import E2BService

log = logging.getLogger("dsec.e2b")

Req = TypeVar("Req", bound=WireModel)
MAX_MESSAGE = 4 << 20  # one request message (stdin chunks, paths, configs)
SANDBOX_HEADER = b"e2b-sandbox-id"
TOKEN_HEADER = b"x-access-token"
KEEPALIVE_HEADER = "keepalive-ping-interval"
DEFAULT_KEEPALIVE = 50.0  # seconds, the SDK's own
router = APIRouter()


@dataclass
class Call:
    """One envd call, routed and authenticated."""

    svc: E2BService
    rec: SandboxRecord
    caller: Caller
    request: Request

    @property
    def sandbox_id(self) -> str:
        return self.rec.id

    def timeout_ms(self) -> int | None:
        return connect.timeout_ms(self.request)

    def keepalive(self) -> float:
        raw = self.request.headers.get(KEEPALIVE_HEADER, "")
        return float(raw) if raw.isdigit() and 0 < int(raw) <= 3600 else DEFAULT_KEEPALIVE

    def basic_user(self) -> str | None:
        """The account of ``Authorization: Basic base64(user:)`` (envd's way), None for the default."""
        scheme, _, value = self.request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "basic" or not value:
            return None
        try:
            user = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
        except (binascii.Error, UnicodeDecodeError):
            raise RpcError("unauthenticated", "malformed Basic authorization header") from None
        return user or None


class Refused(Exception):
    """The call is answered at the HTTP level, before any protocol (routing, authentication)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _service(request: Request) -> E2BService:
    svc: E2BService = request.app.state.e2b
    return svc


def route(request: Request, *, signature: Callable[[str], bool] | None = None, sandbox_id: str | None = None) -> Call:
    """The sandbox of an envd call, and the caller it acts as (the sandbox's owner).

    ``signature``: for /files, a check of a signed URL that stands in for the access token;
    ``sandbox_id``: the sandbox such a URL was found to be for, when it names none."""
    svc = _service(request)
    headers = request.scope.get("headers", [])
    sandbox_id = (
        sandbox_id
        or header(headers, SANDBOX_HEADER).decode(errors="replace").strip()
        or envd_sandbox(headers, svc.options.domain)
    )
    if not sandbox_id:
        raise Refused(
            plain_error(
                400,
                "no E2b-Sandbox-Id header: point E2B_SANDBOX_URL at this endpoint (the e2b SDKs then send it "
                "with every call)",
            )
        )
    token = header(headers, TOKEN_HEADER).decode(errors="replace").strip()
    opened = svc.tokens.check(sandbox_id, token) if token else signature is not None and signature(sandbox_id)
    if not opened:
        raise Refused(gone(sandbox_id))
    try:
        rec = svc.mgr.record(sandbox_id)
    except SandboxNotFound:
        raise Refused(gone(sandbox_id)) from None
    if rec.state in TERMINAL_STATES:
        svc.forget(rec.id)
        raise Refused(gone(sandbox_id))
    if rec.state == State.stopping or (rec.state == State.running and rec.expires_at <= time.time()):
        raise Refused(gone(sandbox_id))  # past its timeout: gone now, not at the reaper's next pass
    caller = owner_caller(rec.owner)
    name_caller(request.scope, caller)
    note(request.scope, sandbox=rec.id)
    return Call(svc, rec, caller, request)


def _refusal(request: Request, streaming: bool) -> Call | Response:
    try:
        connect.method_check(request)
        connect.codec_check(request, streaming=streaming)
        return route(request)
    except Refused as e:
        return e.response
    except HttpError as e:
        return e.response()
    except RpcError as e:
        return connect.stream_error_response(e) if streaming else connect.error_response(e)


def unary(path: str, model: type[Req]) -> Callable[[Callable[[Call, Req], Awaitable[WireModel]]], None]:
    """Register a unary Connect RPC at ``path``."""

    def register(handler: Callable[[Call, Req], Awaitable[WireModel]]) -> None:
        async def endpoint(request: Request) -> Response:
            call = _refusal(request, streaming=False)
            if isinstance(call, Response):
                return call
            try:
                req = await connect.unary_message(request, model, MAX_MESSAGE)
                return connect.unary_response(await handler(call, req))
            except RpcError as e:
                return connect.error_response(e)
            except DsecError as e:
                return connect.error_response(rpc_error(e))

        router.add_api_route(path, endpoint, methods=["POST", "GET", "PUT", "DELETE"], include_in_schema=False)

    return register


def server_stream(path: str, model: type[Req]) -> Callable[[Callable[[Call, Req], AsyncIterator[WireModel]]], None]:
    """Register a server-streaming Connect RPC. The handler is an async generator; an error it raises
    before its first message still reaches the client as the stream's end (Connect's way)."""

    def register(handler: Callable[[Call, Req], AsyncIterator[WireModel]]) -> None:
        async def endpoint(request: Request) -> Response:
            call = _refusal(request, streaming=True)
            if isinstance(call, Response):
                return call
            try:
                deadline = call.timeout_ms()  # the whole stream's (a command's timeout, a watch's)
                req = await connect.stream_request_message(request, model, MAX_MESSAGE)
                events = _translated(handler(call, req))
                first = await anext(events)  # failures to start are answered before the stream begins
            except StopAsyncIteration:
                return connect.stream_error_response(RpcError("internal", "the stream ended before it began"))
            except RpcError as e:
                return connect.stream_error_response(e)
            except Exception as e:
                log.exception("e2b stream %s failed to start", path)
                return connect.stream_error_response(RpcError("internal", f"the stream failed ({type(e).__name__})"))
            return connect.stream_response(_prepend(first, events), timeout_ms=deadline)

        router.add_api_route(path, endpoint, methods=["POST", "GET", "PUT", "DELETE"], include_in_schema=False)

    return register


ClientStreamHandler = Callable[[Call, AsyncIterator[Req]], Awaitable[WireModel]]


def client_stream(path: str, model: type[Req]) -> Callable[[ClientStreamHandler[Req]], None]:
    """Register a client-streaming Connect RPC: the handler consumes the request messages."""

    def register(handler: ClientStreamHandler[Req]) -> None:
        async def endpoint(request: Request) -> Response:
            call = _refusal(request, streaming=True)
            if isinstance(call, Response):
                return call
            try:
                return connect.client_stream_response(
                    await handler(call, connect.stream_messages(request, model, MAX_MESSAGE))
                )
            except RpcError as e:
                return connect.stream_error_response(e)
            except DsecError as e:
                return connect.stream_error_response(rpc_error(e))

        router.add_api_route(path, endpoint, methods=["POST", "GET", "PUT", "DELETE"], include_in_schema=False)

    return register


async def _translated(events: AsyncIterator[WireModel]) -> AsyncIterator[WireModel]:
    """The core's errors as Connect errors, and the producer closed with the stream."""
    try:
        async for event in events:
            yield event
    except DsecError as e:
        raise rpc_error(e) from None
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


async def _prepend(first: WireModel, rest: AsyncIterator[WireModel]) -> AsyncIterator[WireModel]:
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()


@router.get("/health")
async def health(request: Request) -> Response:
    """envd's liveness answer: 204 for a running sandbox (the SDK's ``is_running``), E2B's proxy answer
    for one that is gone; without a sandbox header, the endpoint's own."""
    if not header(request.scope.get("headers", []), SANDBOX_HEADER):
        return Response(status_code=204)
    try:
        call = route(request)
    except Refused as e:
        return e.response
    if call.rec.state.value == "paused":
        return gone(call.sandbox_id)  # a paused E2B sandbox does not answer either
    return Response(status_code=204)
