"""The audit middleware: every call to the authenticated API, allowed or refused, becomes one record.

It wraps the whole app (outside the body limit, inside the last-resort error handler) so it sees the
final status of every answer, including refusals that happen before a route runs. It resolves the
caller itself, so a call with a bad token is recorded as one (tenant unknown) even when the request
fails earlier for another reason. Never recorded: request bodies (file contents), tokens, query
strings. Routes add what only they know through ``note``: an exec's command, a new sandbox's id.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping, Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..store.audit import Entry, command_head
from .auth import resolve

COMMAND = "dsec.audit.command"
SANDBOX = "dsec.audit.sandbox"
UNAUDITED = ("/v1/health",)  # needs no token: nobody to attribute it to
MAX_ROUTE = 200
PREFIX = "/v1"


def note(
    scope: MutableMapping[str, Any], *, command: str | Sequence[str] | None = None, sandbox: str | None = None
) -> None:
    state = scope.setdefault("state", {})
    if command is not None:
        state[COMMAND] = command_head(command)
    if sandbox is not None:
        state[SANDBOX] = sandbox


def _template(route: object, path: str, prefix: str) -> str:
    """The route template, not the path: ids and names in paths stay out of the route column. FastAPI
    gives a route in an included router its path relative to the router's prefix (every API route here
    is under /v1)."""
    template = getattr(route, "path", None)
    if not isinstance(template, str):
        return path[:MAX_ROUTE]  # no route matched (a 404 or 405 from the router itself)
    return template if template.startswith(prefix) else prefix + template


class AuditMiddleware:
    """``prefix``: the paths audited (the dsec API's /v1; "" for every path of the E2B API);
    ``unaudited``: paths that need no token; ``label``: put before the route in the record."""

    def __init__(
        self, app: ASGIApp, prefix: str = PREFIX, unaudited: tuple[str, ...] = UNAUDITED, label: str = ""
    ) -> None:
        self.app = app
        self.prefix = prefix
        self.unaudited = unaudited
        self.label = label

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(self.prefix + "/") or path in self.unaudited:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the last-resort handler answers if the app raises

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            # after the app: a route may have named the caller (the E2B API's keys and sandbox tokens)
            caller = resolve(scope)
            template = self.label + _template(scope.get("route"), path, self.prefix)
            state = scope["state"]
            sandbox = state.get(SANDBOX) or scope.get("path_params", {}).get("sandbox_id")
            entry = Entry(
                time=time.time(),
                tenant=None if caller is None else caller.tenant,
                method=str(scope.get("method", "")),
                route=template,
                sandbox=sandbox if isinstance(sandbox, str) else None,
                status=status,
                duration_ms=(time.perf_counter() - started) * 1000,
                command=state.get(COMMAND),
            )
            scope["app"].state.manager.audit.record(entry)
