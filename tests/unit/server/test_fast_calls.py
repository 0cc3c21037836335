"""The fast path of exec and rollback (server/fast_calls.py) answers every request exactly as the FastAPI
routes do: the same app is asked each request twice, once as served and once with the fast path taken out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from dsec.errors import BackendError, CheckpointNotFound, SandboxGone
from dsec.server import checkpoint_routes, routes
from dsec.server.app import create_app
from dsec.server.fast_calls import CALLS, FastCalls, fast_target

from ..conftest import AUTH, IMAGE, TOKEN, ManagerSwitch, new_manager

JSON = {**AUTH, "content-type": "application/json"}


class Pair:
    def __init__(self, fast: TestClient, plain: TestClient, mgr: Any, backend: Any) -> None:
        self.fast, self.plain, self.mgr, self.backend = fast, plain, mgr, backend
        self.routes: list[object] = []  # scope["route"] of each exec or rollback that reached the route's work

    def both(self, path: str, content: bytes, headers: dict[str, str]) -> tuple[Any, Any]:
        return (
            self.fast.post(path, content=content, headers=headers),
            self.plain.post(path, content=content, headers=headers),
        )


def _app(switch: ManagerSwitch, fast: bool) -> FastAPI:
    app = create_app(switch, token=TOKEN)  # type: ignore[arg-type]
    if not fast:  # the middleware stack is built on the first request, from this list
        app.user_middleware = [m for m in app.user_middleware if m.cls is not FastCalls]
    return app


@pytest.fixture
def pair(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    switch = ManagerSwitch()
    mgr, backend = new_manager(workdir)
    switch.target = mgr
    with TestClient(_app(switch, True)) as fast:
        p = Pair(fast, TestClient(_app(switch, False)), mgr, backend)
        for module, name in ((routes, "run_exec"), (checkpoint_routes, "run_rollback")):
            monkeypatch.setattr(module, name, _spy(p, getattr(module, name)))
        yield p


def _spy(p: Pair, real: Any) -> Any:
    async def spy(mgr: Any, scope: Any, *args: Any) -> Any:
        p.routes.append(scope.get("route"))
        return await real(mgr, scope, *args)

    return spy


def _sandbox(p: Pair) -> str:
    reply = p.fast.post("/v1/sandboxes", json={"image": IMAGE}, headers=AUTH)
    assert reply.status_code == 201, reply.text
    sid: str = reply.json()["id"]
    return sid


def _same(fast: Any, plain: Any) -> None:
    assert fast.status_code == plain.status_code, (fast.text, plain.text)
    assert fast.headers.get("content-type") == plain.headers.get("content-type")
    assert fast.json() == plain.json()


def test_a_plain_exec_takes_the_fast_path_and_answers_as_the_route(pair: Pair) -> None:
    sid = _sandbox(pair)
    body = json.dumps({"cmd": ["echo", "hi"], "env": {"B": "2"}}).encode()
    fast, plain = pair.both(f"/v1/sandboxes/{sid}/exec", body, JSON)
    assert fast.status_code == 200
    _same(fast, plain)
    assert pair.routes[0] is CALLS["exec"]  # served without FastAPI's router
    assert pair.routes[1] is not CALLS["exec"] and getattr(pair.routes[1], "path", "").endswith("/exec")
    assert [r.env for r in pair.backend.execs] == [{"B": "2"}] * 2
    # the audit log cannot tell them apart either
    entries = pair.fast.get("/v1/audit", params={"sandbox": sid}, headers=AUTH).json()["records"]
    assert [(e["method"], e["route"], e["command"], e["status"]) for e in entries[-2:]] == [
        ("POST", "/v1/sandboxes/{sandbox_id}/exec", "echo hi", 200)
    ] * 2


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (b'{"cmd": []}', JSON),  # the model refuses it
        (b'{"cmd": "true", "timeout": -1}', JSON),
        (b'{"cmd": "true", "surprise": 1}', JSON),
        (b"{not json", JSON),
        (b"", JSON),
        (b'{"cmd": "true"}', AUTH),  # no content type: FastAPI reads JSON all the same
        (b'{"cmd": "true"}', {**AUTH, "content-type": "text/plain"}),
        (b'{"cmd": "true"}', {**AUTH, "content-type": "application/json; charset=utf-8"}),
        (b'{"cmd": "true"}', {"content-type": "application/json"}),  # no token
        (b'{"cmd": "true"}', {"authorization": "Bearer wrong", "content-type": "application/json"}),
        (b"{not json", {"content-type": "application/json"}),
        (b'{"cmd": "true"}', {**JSON, "Dsec-Seq": "01"}),
        (b'{"cmd": "true"}', {**JSON, "Dsec-Seq": "0"}),
        (b'{"cmd": "true"}', {**JSON, "Dsec-Seq": "1"}),  # sound, but the sandbox has no trajectory
    ],
)
def test_every_other_request_gets_the_routes_own_answer(pair: Pair, content: bytes, headers: dict[str, str]) -> None:
    sid = _sandbox(pair)
    _same(*pair.both(f"/v1/sandboxes/{sid}/exec", content, headers))


def test_unknown_sandboxes_and_failures_are_answered_alike(pair: Pair) -> None:
    body = b'{"cmd": "true"}'
    _same(*pair.both("/v1/sandboxes/sb-nope/exec", body, JSON))
    sid = _sandbox(pair)
    pair.backend.exec_error = BackendError("the runtime broke")
    fast, plain = pair.both(f"/v1/sandboxes/{sid}/exec", body, JSON)
    assert fast.status_code == 500
    _same(fast, plain)
    # a sandbox found dead under its exec is failed from then on: one sandbox for each way
    a, b = _sandbox(pair), _sandbox(pair)
    pair.backend.exec_error = SandboxGone("gone")
    fast = pair.fast.post(f"/v1/sandboxes/{a}/exec", content=body, headers=JSON)
    plain = pair.plain.post(f"/v1/sandboxes/{b}/exec", content=body, headers=JSON)
    assert fast.status_code == plain.status_code == 410
    assert fast.json() == json.loads(plain.text.replace(b, a))


def test_a_repeated_idempotency_key_is_answered_from_memory(pair: Pair) -> None:
    sid = _sandbox(pair)
    headers = {**JSON, "Idempotency-Key": "k-1"}
    first = pair.fast.post(f"/v1/sandboxes/{sid}/exec", content=b'{"cmd": "true"}', headers=headers)
    again = pair.fast.post(f"/v1/sandboxes/{sid}/exec", content=b'{"cmd": "true"}', headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.headers.get("idempotent-replayed") == "true" and again.json() == first.json()
    assert len(pair.backend.execs) == 1


def test_a_rollback_takes_the_fast_path_and_answers_as_the_route(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    sid = _sandbox(pair)
    asked: list[str] = []

    async def rollback(sandbox_id: str, req: Any, *, caller: Any) -> Any:
        # the core's own rollback is tested on real sandboxes (tests/integration/test_checkpoints.py)
        asked.append(req.checkpoint)
        if req.checkpoint == "nope":
            raise CheckpointNotFound(f"sandbox {sandbox_id} has no checkpoint {req.checkpoint!r}")
        return pair.mgr.info(sandbox_id, caller=caller)

    monkeypatch.setattr(pair.mgr.checkpoints, "rollback", rollback)
    fast, plain = pair.both(f"/v1/sandboxes/{sid}/rollback", b'{"checkpoint": "c1"}', JSON)
    assert fast.status_code == 200 and fast.json()["id"] == sid
    _same(fast, plain)
    assert pair.routes[0] is CALLS["rollback"]
    assert pair.routes[1] is not CALLS["rollback"] and getattr(pair.routes[1], "path", "").endswith("/rollback")
    for content, headers in [
        (b'{"checkpoint": "nope"}', JSON),  # the core's refusal
        (b'{"checkpoint": "no spaces here"}', JSON),  # the model's
        (b'{"checkpoint": "c1", "surprise": 1}', JSON),
        (b"{}", JSON),
        (b"{not json", JSON),
        (b'{"checkpoint": "c1"}', {"content-type": "application/json"}),  # no token
        (b'{"checkpoint": "c1"}', {**JSON, "Dsec-Seq": "01"}),
        (b'{"checkpoint": "c1"}', {**JSON, "Dsec-Seq": "1"}),  # the sandbox has no trajectory
    ]:
        _same(*pair.both(f"/v1/sandboxes/{sid}/rollback", content, headers))
    _same(*pair.both("/v1/sandboxes/sb-nope/rollback", b'{"checkpoint": "c1"}', JSON))
    assert asked == ["c1", "c1", "nope", "nope"]  # what failed before the core never reached it
    entries = pair.fast.get("/v1/audit", params={"sandbox": sid}, headers=AUTH).json()["records"]
    assert {e["route"] for e in entries if e["method"] == "POST" and "rollback" in e["route"]} == {
        "/v1/sandboxes/{sandbox_id}/rollback"
    }


@pytest.mark.parametrize(
    ("method", "path", "target"),
    [
        ("POST", "/v1/sandboxes/sb-1/exec", ("sb-1", "exec")),
        ("POST", "/v1/sandboxes/sb-1/rollback", ("sb-1", "rollback")),
        ("GET", "/v1/sandboxes/sb-1/exec", None),
        ("POST", "/v1/sandboxes/sb-1/exec/", None),
        ("POST", "/v1/sandboxes/sb-1/exec/stream", None),
        ("POST", "/v1/sandboxes/sb-1/checkpoints", None),
        ("POST", "/v1/sandboxes//exec", None),
        ("POST", "/v1/sandboxes//rollback", None),
        ("POST", "/v2/sandboxes/sb-1/exec", None),
        ("POST", "/v1/sandbox/sb-1/rollback", None),
    ],
)
def test_only_the_fast_routes_are_matched(method: str, path: str, target: tuple[str, str] | None) -> None:
    found = fast_target({"type": "http", "method": method, "path": path})
    assert (found and (found[0], found[1].path.rsplit("/", 1)[1])) == (target or None)
