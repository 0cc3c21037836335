"""Who is calling: a request's bearer token resolved to a ``Caller`` once per request (by the audit
middleware, so refused calls are recorded too) and kept in the request's scope. An API with tokens of
its own (the E2B API's keys) names the caller itself with ``name_caller``."""

from __future__ import annotations

import secrets
from collections.abc import MutableMapping
from typing import Any

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
    return identify_token(app, bearer(headers))


def identify_token(app: Any, token: bytes) -> Caller | None:
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


def name_caller(scope: MutableMapping[str, Any], caller: Caller | None) -> None:
    scope.setdefault("state", {})[CALLER] = caller
