"""The console's session layer in front of an API: logging in turns a token into an HttpOnly,
SameSite=Strict cookie; a call with the cookie reaches the API as the token's caller; a call that
changes anything needs the session's CSRF token; /ui answers carry the CSP."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from dsec.console import Console
from dsec.console.assets import CSP
from dsec.console.sessions import Sessions
from dsec.tenancy import OPERATOR, Caller

pytestmark = pytest.mark.timeout(30)
TOKENS = {"op-token": OPERATOR, "alice-token": Caller("alice")}


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """The API behind the console: answers with the headers it was given."""
    headers = {k.decode(): v.decode() for k, v in scope["headers"]}
    body = json.dumps({"method": scope["method"], "path": scope["path"], "headers": headers}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def client(tmp_path: Path, revoked: set[str] | None = None, sessions: Sessions | None = None) -> httpx.AsyncClient:
    (tmp_path / "index.html").write_text("<!doctype html><script type=module src=/ui/assets/app.js></script>")
    (tmp_path / "app.js").write_text("console.log(1)")
    gone = revoked if revoked is not None else set()

    def verify(token: str) -> Caller | None:
        return None if token in gone else TOKENS.get(token)

    app = Console(echo, verify=verify, sessions=sessions, assets=tmp_path)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node")


async def login(c: httpx.AsyncClient, token: str) -> str:
    r = await c.post("/ui/login", json={"token": token})
    assert r.status_code == 200, r.text
    return str(r.json()["csrf"])


async def test_login_sets_a_strict_http_only_cookie_and_names_the_caller(tmp_path: Path) -> None:
    async with client(tmp_path) as c:
        r = await c.post("/ui/login", json={"token": "alice-token"})
        assert r.status_code == 200
        assert r.json()["caller"] == {"name": "alice", "operator": False} and r.json()["cluster"] is False
        cookie = r.headers["set-cookie"]
        assert cookie.startswith("dsec_session=") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert "alice-token" not in cookie  # the token stays on the server
        assert (await c.get("/ui/session")).json()["caller"]["name"] == "alice"


async def test_a_wrong_token_or_a_bad_body_is_refused_with_the_apis_error(tmp_path: Path) -> None:
    async with client(tmp_path) as c:
        r = await c.post("/ui/login", json={"token": "nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert "set-cookie" not in r.headers
        r = await c.post(
            "/ui/login", content=b"token=op-token", headers={"content-type": "application/x-www-form-urlencoded"}
        )
        assert r.status_code == 400  # a cross-site form could send this; only JSON is taken
        r = await c.post("/ui/login", json={"token": ""})
        assert r.status_code == 400
        r = await c.post("/ui/login", content=b"x" * 10_000, headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert (await c.get("/ui/session")).status_code == 401


async def test_a_call_with_the_cookie_reaches_the_api_as_the_sessions_token(tmp_path: Path) -> None:
    async with client(tmp_path) as c:
        csrf = await login(c, "alice-token")
        r = await c.get("/v1/sandboxes")
        seen = r.json()["headers"]
        assert seen["authorization"] == "Bearer alice-token"
        # an API answer opened by a browser (a file a sandbox wrote, as HTML) runs no script and is not sniffed
        assert r.headers["x-content-type-options"] == "nosniff" and "sandbox" in r.headers["content-security-policy"]
        assert "cookie" not in seen  # the session id goes no further than the console
        r = await c.delete("/v1/sandboxes/sb-1", headers={"x-csrf-token": csrf})
        assert r.status_code == 200 and r.json()["headers"]["authorization"] == "Bearer alice-token"
        assert "x-csrf-token" not in r.json()["headers"]


async def test_a_change_without_the_csrf_token_or_from_another_site_is_refused(tmp_path: Path) -> None:
    async with client(tmp_path) as c:
        csrf = await login(c, "op-token")
        for headers in ({}, {"x-csrf-token": "forged"}):
            r = await c.post("/v1/sandboxes", json={}, headers=headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        r = await c.get("/v1/sandboxes", headers={"sec-fetch-site": "cross-site"})
        assert r.status_code == 403
        r = await c.post("/v1/sandboxes", json={}, headers={"x-csrf-token": csrf})
        assert r.status_code == 200
        assert (await c.post("/ui/logout")).status_code == 403  # logging out is a change too


async def test_a_bearer_token_is_passed_through_untouched(tmp_path: Path) -> None:
    async with client(tmp_path) as c:
        await login(c, "alice-token")
        r = await c.post("/v1/sandboxes", headers={"authorization": "Bearer op-token"})
        assert r.json()["headers"]["authorization"] == "Bearer op-token"  # no CSRF check: not a cookie call


async def test_logout_and_revocation_end_the_session(tmp_path: Path) -> None:
    revoked: set[str] = set()
    async with client(tmp_path, revoked) as c:
        csrf = await login(c, "alice-token")
        r = await c.post("/ui/logout", headers={"x-csrf-token": csrf})
        assert r.status_code == 204 and "Max-Age=0" in r.headers["set-cookie"]
        assert "authorization" not in (await c.get("/v1/sandboxes")).json()["headers"]
        await login(c, "alice-token")
        revoked.add("alice-token")
        assert (await c.get("/ui/session")).status_code == 401


async def test_ui_answers_carry_the_csp_and_serve_only_built_files(tmp_path: Path) -> None:
    async with client(tmp_path) as c:
        r = await c.get("/ui")
        assert r.status_code == 307 and r.headers["location"] == "/ui/"
        r = await c.get("/ui/")
        assert r.status_code == 200 and r.headers["content-security-policy"] == CSP
        assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["cache-control"] == "no-store"
        r = await c.get("/ui/assets/app.js")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
        for bad in (
            "/ui/assets/sub/app.js",
            "/ui/assets/index.htm",
            "/ui/assets/%2e%2e%2fsecret",
            "/ui/assets/.hidden.js",
            "/ui/nope",
        ):
            r = await c.get(bad)
            assert r.status_code == 404, bad
            assert r.headers["content-security-policy"] == CSP


async def test_an_unbuilt_console_says_how_to_build_it(tmp_path: Path) -> None:
    app = Console(echo, verify=lambda t: None, assets=tmp_path / "missing")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as c:
        r = await c.get("/ui/")
        assert r.status_code == 503 and "make console" in r.text


def test_sessions_expire_when_idle_and_are_bounded() -> None:
    s = Sessions(idle_s=60.0, max_sessions=3)
    ids = [s.open(f"t{i}")[0] for i in range(5)]
    assert len(s) == 3 and s.get(ids[0]) is None and s.get(ids[4]) is not None
    s.idle_s = -1.0
    assert s.get(ids[4]) is None
