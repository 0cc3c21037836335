"""The calls an agent loop makes most, answered without FastAPI's routing, dependency solving and body
machinery: ``POST /v1/sandboxes/{id}/exec`` (every step; that machinery cost ~0.3 ms of an exec's ~2 ms
round trip on a slow 2-core host) and ``POST /v1/sandboxes/{id}/rollback`` (every episode's reset; ~1 ms
of a ~4 ms rollback there). docs/performance.md has the figures.

Only the common case takes this way: an authenticated caller, a JSON body that parses and validates as
the call's request model, and at most one well-formed trajectory position. Everything else (no or a bad
token, another content type, a body or a position FastAPI would refuse) goes on to the FastAPI route
with the body read so far handed back unchanged, so every refusal is FastAPI's own, word for word. The
work itself is the route's (``routes.run_exec``, ``checkpoint_routes.run_rollback``), and a DsecError
gets the answer the app's handler gives; any other exception goes up to the app's last-resort handler,
as it does from the route. It sits inside the API's own middleware (audit, idempotency, body limit),
which see it exactly as they see the route.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core.manager import SandboxManager
from ..errors import DsecError
from ..protocol.checkpoints import RollbackRequest
from ..protocol.sandbox import ExecRequest
from ..protocol.trajectory import SEQ_HEADER
from ..tenancy import Caller
from ..web.auth import resolve
from ..web.errors import dsec_error_response
from . import checkpoint_routes, routes

_SEQ = SEQ_HEADER.lower().encode()
_POSITION = re.compile(rb"[1-9][0-9]{0,17}")  # as routes.Seq reads it: 1 .. MAX_SEQ, written one way only


Run = Callable[[SandboxManager, MutableMapping[str, Any], str, Any, "int | None", Caller], Awaitable[Response]]


@dataclass(frozen=True)
class FastCall:
    """One call this path serves. ``path``: its route's template, which is what the audit middleware
    reads of the route that answered; ``run``: the route's own work once its request is parsed (looked
    up when called, so that it is always the route's)."""

    path: str
    model: type[BaseModel]
    run: Callable[[], Run]


CALLS = {
    "exec": FastCall("/v1/sandboxes/{sandbox_id}/exec", ExecRequest, lambda: routes.run_exec),
    "rollback": FastCall(
        "/v1/sandboxes/{sandbox_id}/rollback", RollbackRequest, lambda: checkpoint_routes.run_rollback
    ),
}


def fast_target(scope: Scope) -> tuple[str, FastCall] | None:
    """The sandbox id and call of ``POST /v1/sandboxes/{id}/<call>``, matched as the router matches it;
    else None."""
    if scope["type"] != "http" or scope.get("method") != "POST":
        return None
    path: str = scope.get("path", "")
    parts = path.split("/")
    if len(parts) != 5 or parts[1] != "v1" or parts[2] != "sandboxes" or not parts[3] or parts[4] not in CALLS:
        return None
    return parts[3], CALLS[parts[4]]


def _headers(scope: Scope) -> tuple[bool, int | None]:
    """(whether the request is one this path takes, its trajectory position)."""
    json_body = False
    seq: int | None = None
    seen = 0
    for name, value in scope.get("headers", []):
        if name == b"content-type":
            json_body = value == b"application/json"
        elif name == _SEQ:
            seen += 1
            if _POSITION.fullmatch(value) is None:
                return False, None
            seq = int(value)
    return json_body and seen <= 1, seq


def _parse(model: type[BaseModel], body: bytes) -> BaseModel | None:
    # as FastAPI reads a JSON body: json.loads, then the model validated in Python mode
    try:
        return model.model_validate(json.loads(body))
    except (ValueError, ValidationError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None


class FastCalls:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = fast_target(scope)
        if target is None:
            await self.app(scope, receive, send)
            return
        sandbox_id, call = target
        takes, seq = _headers(scope)
        caller = resolve(scope) if takes else None
        if caller is None:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        body = b""
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        req = _parse(call.model, body) if messages[-1]["type"] == "http.request" else None
        if req is None:
            await self.app(scope, _replay(messages, receive), send)
            return
        scope["route"] = call
        scope["path_params"] = {"sandbox_id": sandbox_id}
        try:
            mgr: SandboxManager = scope["app"].state.manager  # as routes.manager finds it
            response = await call.run()(mgr, scope, sandbox_id, req, seq, caller)
        except DsecError as e:
            response = dsec_error_response(e)
        await response(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that first gives back the messages already read."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
