"""The console in front of an API (the node's FastAPI app or the gateway): /ui is answered here; any
other request that carries a console session and no bearer token is passed on as if it carried the
session's token, so every route, tenant check and audit record works unchanged for the browser."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path

from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import DsecError, Forbidden, InvalidRequest, LimitExceeded, NotFound, Unauthorized
from ..tenancy import Caller
from ..web.errors import dsec_error_response
from .assets import ASSETS, HEADERS, page
from .sessions import Session, Sessions, clear_cookie, cookie_value, set_cookie

Verify = Callable[[str], Caller | None]  # a token -> who it is, or None
SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
CSRF_HEADER = b"x-csrf-token"
API_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'; sandbox"),
]
MAX_LOGIN_BODY = 4096


class Console:
    def __init__(
        self,
        app: ASGIApp,
        verify: Verify,
        sessions: Sessions | None = None,
        assets: Path = ASSETS,
        cluster: bool = False,
    ) -> None:
        self.app = app
        self.cluster = cluster  # in front of a gateway: the page shows the nodes (GET /v1/cluster)
        self.verify = verify
        self.sessions = sessions or Sessions()
        self.assets = assets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path == "/ui" or path.startswith("/ui/"):
            try:
                response = await self._ui(scope, receive, path)
            except DsecError as e:
                response = dsec_error_response(e)
                response.headers.update(HEADERS)
            await response(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        if any(name == b"authorization" for name, _ in headers):
            await self.app(scope, receive, send)  # a client with a token: the console is not involved
            return
        sid = cookie_value(headers)
        session = self.sessions.get(sid) if sid else None
        if session is None:
            await self.app(scope, receive, send)  # answered 401 by the API, as any call without a token
            return
        if refusal := _csrf_refusal(scope, session):
            await dsec_error_response(refusal)(scope, receive, send)
            return
        passed = [(k, v) for k, v in headers if k not in (b"cookie", CSRF_HEADER)]
        passed.append((b"authorization", b"Bearer " + session.token.encode()))

        async def guarded(message: Message) -> None:
            # a browser sent here by a link renders nothing a sandbox wrote (a file read as HTML): it
            # gets the bytes with no type sniffing and no script allowed
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *API_HEADERS]}
            await send(message)

        await self.app({**scope, "headers": passed}, receive, guarded)

    async def _ui(self, scope: Scope, receive: Receive, path: str) -> Response:
        method: str = scope["method"]
        if path in ("/ui", "/ui/index.html"):
            return RedirectResponse("/ui/", status_code=307, headers=HEADERS)
        if path == "/ui/" and method in ("GET", "HEAD"):
            return page("index.html", self.assets)
        if path.startswith("/ui/assets/") and method in ("GET", "HEAD"):
            return page(path.removeprefix("/ui/assets/"), self.assets)
        if path == "/ui/login" and method == "POST":
            return await self._login(scope, receive)
        if path == "/ui/session" and method == "GET":
            return self._session(scope)
        if path == "/ui/logout" and method == "POST":
            return self._logout(scope)
        raise NotFound(f"no console route {method} {path}")

    async def _login(self, scope: Scope, receive: Receive) -> Response:
        # JSON only: a cross-site form cannot send it without a preflight the browser would refuse
        if _header(scope, b"content-type").split(";")[0].strip() != "application/json":
            raise InvalidRequest('log in with a JSON body: {"token": "..."}')
        body = await _read(receive, MAX_LOGIN_BODY)
        try:
            token = json.loads(body)["token"]
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidRequest('log in with a JSON body: {"token": "..."}') from e
        if not isinstance(token, str) or not token.strip() or len(token) > 1024:
            raise InvalidRequest("the token must be a non-empty string")
        caller = self.verify(token.strip())
        if caller is None:
            raise Unauthorized("wrong or revoked token")
        sid, session = self.sessions.open(token.strip())
        response = _who(caller, session, self.cluster)
        response.headers["Set-Cookie"] = set_cookie(sid, secure=scope.get("scheme") == "https")
        return response

    def _session(self, scope: Scope) -> Response:
        sid = cookie_value(scope.get("headers", []))
        session = self.sessions.get(sid) if sid else None
        caller = self.verify(session.token) if session is not None else None
        if session is None or caller is None:
            if sid and session is not None:
                self.sessions.close(sid)  # its token was revoked
            raise Unauthorized("not logged in to the console")
        return _who(caller, session, self.cluster)

    def _logout(self, scope: Scope) -> Response:
        sid = cookie_value(scope.get("headers", []))
        session = self.sessions.get(sid) if sid else None
        if sid and session is not None:
            if refusal := _csrf_refusal(scope, session):
                raise refusal
            self.sessions.close(sid)
        response = Response(status_code=204, headers=HEADERS)
        response.headers["Set-Cookie"] = clear_cookie(secure=scope.get("scheme") == "https")
        return response


def _who(caller: Caller, session: Session, cluster: bool) -> JSONResponse:
    name = "operator" if caller.operator else caller.tenant
    body = {"caller": {"name": name, "operator": caller.operator}, "csrf": session.csrf, "cluster": cluster}
    return JSONResponse(body, headers={**HEADERS, "Cache-Control": "no-store"})


def _csrf_refusal(scope: Scope, session: Session) -> DsecError | None:
    """A call the session's page did not make: another site's (the browser says so), or an unsafe
    method without the session's CSRF token."""
    if _header(scope, b"sec-fetch-site") == "cross-site":
        return Forbidden("a console session cannot be used from another site")
    if scope["method"] in SAFE:
        return None
    sent = _header(scope, CSRF_HEADER)
    if not sent or not secrets.compare_digest(sent.encode(), session.csrf.encode()):
        return Forbidden("a console call that changes anything needs the session's X-CSRF-Token header")
    return None


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key == name:
            return str(value.decode("latin-1"))
    return ""


async def _read(receive: Receive, limit: int) -> bytes:
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return body
        body += bytes(message.get("body", b""))
        if len(body) > limit:
            raise LimitExceeded(f"a login body is at most {limit} bytes")
        if not message.get("more_body", False):
            return body
