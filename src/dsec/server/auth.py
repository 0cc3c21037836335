"""Bearer tokens → callers. The token is resolved once per request (by the audit middleware, so refused
calls are recorded too) and kept in the request's scope; routes receive it as a ``Caller``."""

from __future__ import annotations

import secrets
from collections.abc import MutableMapping
from typing import Annotated, Any

from fastapi import Depends, Request

from ..errors import Forbidden, Unauthorized
from ..tenancy import OPERATOR, Caller

CALLER = "dsec.caller"  # keys in the ASGI scope's per-request "state"
UNRESOLVED = object()


def bearer(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The token of an ``Authorization: Bearer …`` header, or b"" (scheme case-insensitive, as RFC 7235 says)."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""


def identify(app: Any, headers: list[tuple[bytes, bytes]]) -> Caller | None:
    token = bearer(headers)
    if not token:
        return None
    # the operator's token is the one the app was made with (STATE_DIR/token), whatever the table says
    if secrets.compare_digest(token, str(app.state.token).encode()):
        return OPERATOR
    caller: Caller | None = app.state.manager.tenants.identify(token)
    return caller


def resolve(scope: MutableMapping[str, Any]) -> Caller | None:
    state = scope.setdefault("state", {})
    caller = state.get(CALLER, UNRESOLVED)
    if caller is UNRESOLVED:
        caller = state[CALLER] = identify(scope["app"], scope.get("headers", []))
    assert caller is None or isinstance(caller, Caller)
    return caller


async def authorize(request: Request) -> Caller:
    caller = resolve(request.scope)
    if caller is None:
        raise Unauthorized("missing, wrong or revoked bearer token (see DSEC_TOKEN and the daemon's STATE_DIR/token)")
    return caller


async def operator(request: Request) -> Caller:
    caller = await authorize(request)
    if not caller.operator:
        raise Forbidden("only the operator (the daemon's STATE_DIR/token) may do this")
    return caller


CallerDep = Annotated[Caller, Depends(authorize)]
OperatorDep = Annotated[Caller, Depends(operator)]
