"""The HTTP API in front of the core, over the in-memory FakeBackend."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from dsec.errors import BackendError
from dsec.protocol.sandbox import Limits, State
from dsec.store.records import SandboxRecord

from ..conftest import AUTH, IMAGE, TOKEN, Api, ManagerSwitch, new_manager


def error_of(reply: Any) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"}
    err: dict[str, Any] = body["error"]
    assert isinstance(err["code"], str)
    assert isinstance(err["message"], str) and err["message"]
    return err


def events_of(reply: Any) -> list[dict[str, Any]]:
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("application/x-ndjson")
    assert reply.text.endswith("\n")
    return [json.loads(line) for line in reply.text.splitlines()]


# ---- auth -------------------------------------------------------------------------------------------


def test_health_needs_no_token(api: Api) -> None:
    reply = api.client.get("/v1/health")
    assert reply.status_code == 200
    body = reply.json()
    assert body["ok"] is True
    assert body["kinds"] == ["container"]
    assert body["version"]


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("DELETE", "/v1/sandboxes", "GET, HEAD, POST"),  # two routes: the router alone named one
        ("OPTIONS", "/v1/image", "DELETE, GET, HEAD"),
        ("TRACE", "/v1/sandboxes/sb-1/exec", "POST"),
        ("PUT", "/v1/sandboxes/batch", "POST"),  # the literal path, not /v1/sandboxes/{sandbox_id}
    ],
)
def test_a_method_a_path_does_not_have_is_405_with_every_method_it_has(
    api: Api, method: str, path: str, allow: str
) -> None:
    reply = api.client.request(method, path, headers=AUTH)
    assert reply.status_code == 405 and reply.headers["allow"] == allow
    assert error_of(reply)["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": "Bearer "},
        {"authorization": f"Basic {TOKEN}"},
        {"authorization": TOKEN},
        {"authorization": f"Bearer {TOKEN}x"},
    ],
)
def test_unauthorized(api: Api, headers: dict[str, str]) -> None:
    for method, url in [
        ("GET", "/v1/sandboxes"),
        ("POST", "/v1/sandboxes"),
        ("GET", "/v1/sandboxes/sb-x"),
        ("GET", "/v1/images"),
    ]:
        reply = api.client.request(method, url, headers=headers)
        assert reply.status_code == 401, (method, url)
        assert error_of(reply)["code"] == "unauthorized"
    assert api.manager.store.all() == []


def test_bearer_scheme_is_case_insensitive(api: Api) -> None:
    assert api.client.get("/v1/sandboxes", headers={"authorization": f"bearer {TOKEN}"}).status_code == 200


def test_non_ascii_token_is_unauthorized_not_internal(api: Api) -> None:
    client = TestClient(api.client.app, raise_server_exceptions=False)
    reply = client.get("/v1/sandboxes", headers={"authorization": b"Bearer \xe9t\xe9"})
    assert reply.status_code == 401


# ---- create, get, list --------------------------------------------------------------------------------


def test_create(api: Api) -> None:
    reply = api.client.post(
        "/v1/sandboxes",
        json={"image": IMAGE, "limits": {"memory": "256Mi", "cpu": 0.5}, "labels": {"a": "1"}},
        headers=AUTH,
    )
    assert reply.status_code == 201, reply.text
    body = reply.json()
    assert body["state"] == "running"
    assert body["id"].startswith("sb-")
    assert body["image"] == IMAGE
    assert body["kind"] == "container"
    assert body["limits"]["memory"] == 256 << 20
    assert body["labels"] == {"a": "1"}
    assert api.backend.created == [body["id"]]


def test_get(api: Api) -> None:
    created = api.create()
    reply = api.client.get(f"/v1/sandboxes/{created['id']}", headers=AUTH)
    assert reply.status_code == 200
    assert reply.json() == created


def test_get_unknown_is_404(api: Api) -> None:
    reply = api.client.get("/v1/sandboxes/sb-doesnotexist", headers=AUTH)
    assert reply.status_code == 404
    err = error_of(reply)
    assert err["code"] == "sandbox_not_found"
    assert "sb-doesnotexist" in err["message"]


def test_kill_unknown_is_404(api: Api) -> None:
    reply = api.client.delete("/v1/sandboxes/sb-doesnotexist", headers=AUTH)
    assert reply.status_code == 404
    assert error_of(reply)["code"] == "sandbox_not_found"


def test_list_with_label_filters(api: Api) -> None:
    a = api.create(labels={"team": "a", "run": "1"})["id"]
    b = api.create(labels={"team": "b", "run": "1"})["id"]
    c = api.create(labels={"team": "a", "run": "2", "eq": "x=y"})["id"]

    def ids(*labels: str, **params: str) -> list[str]:
        query: list[tuple[str, str]] = [("label", lab) for lab in labels] + list(params.items())
        reply = api.client.get("/v1/sandboxes", params=query, headers=AUTH)
        assert reply.status_code == 200, reply.text
        return sorted(s["id"] for s in reply.json()["sandboxes"])

    assert ids() == sorted([a, b, c])
    assert ids("team=a") == sorted([a, c])
    assert ids("run=1") == sorted([a, b])
    assert ids("team=a", "run=1") == [a]
    assert ids("team=z") == []
    assert ids("eq=x=y") == [c]
    api.client.delete(f"/v1/sandboxes/{a}", headers=AUTH)
    assert ids("team=a") == [c]
    assert ids("team=a", all="true") == sorted([a, c])


@pytest.mark.parametrize("label", ["noequals", "=value"])
def test_list_with_a_bad_label_filter(api: Api, label: str) -> None:
    reply = api.client.get("/v1/sandboxes", params={"label": label}, headers=AUTH)
    assert reply.status_code == 400
    assert "key=value" in error_of(reply)["message"]


# ---- validation ------------------------------------------------------------------------------------------


def post_raw(api: Api, content: bytes) -> Any:
    return api.client.post("/v1/sandboxes", content=content, headers={**AUTH, "content-type": "application/json"})


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        (b"{not json", ["JSON"]),
        (b"[1, 2]", ["dictionary"]),
        (json.dumps({"image": IMAGE, "bogus": 1}).encode(), ["bogus", "Extra inputs"]),
        (json.dumps({"image": IMAGE, "timeout": -1}).encode(), ["timeout", "greater than 0"]),
        (json.dumps({"image": IMAGE, "timeout": 1e12}).encode(), ["timeout", "less than or equal"]),
        (json.dumps({"image": IMAGE, "limits": {"memory": "1Mi"}}).encode(), ["limits.memory", "8Mi"]),
        (json.dumps({"image": IMAGE, "env": {"A=B": "1"}}).encode(), ["env", "A=B"]),
        (json.dumps({"image": IMAGE, "kind": "banana"}).encode(), ["kind"]),
    ],
)
def test_create_rejects_bad_bodies(api: Api, body: bytes, needles: list[str]) -> None:
    reply = post_raw(api, body)
    assert reply.status_code == 400, reply.text
    err = error_of(reply)
    assert err["code"] == "invalid_request"
    assert "\n" not in err["message"]
    for needle in needles:
        assert needle in err["message"]
    assert api.manager.store.all() == []


def test_create_of_a_kind_this_daemon_does_not_run_is_400(api: Api) -> None:
    # the API fixture's daemon runs the fake container kind only
    reply = api.client.post("/v1/sandboxes", json={"image": IMAGE, "kind": "function"}, headers=AUTH)
    assert reply.status_code == 400
    err = error_of(reply)
    assert err["code"] == "invalid_request"
    assert "'function'" in err["message"]
    assert "not enabled" in err["message"]


def test_create_unknown_image_is_404(api: Api) -> None:
    reply = api.client.post("/v1/sandboxes", json={"image": "nobody/nothing:1"}, headers=AUTH)
    assert reply.status_code == 404
    assert error_of(reply)["code"] == "image_not_found"


def test_create_bad_image_name_is_400(api: Api) -> None:
    reply = api.client.post("/v1/sandboxes", json={"image": "Not A Name"}, headers=AUTH)
    assert reply.status_code == 400
    assert "invalid image name" in error_of(reply)["message"]


def test_create_backend_failure(api: Api) -> None:
    api.backend.create_error = RuntimeError("crun: no such file")
    reply = api.client.post("/v1/sandboxes", json={"image": IMAGE, "labels": {"t": "1"}}, headers=AUTH)
    assert reply.status_code == 500
    err = error_of(reply)
    assert err["code"] == "backend_error"
    assert "crun: no such file" in err["message"]
    (rec,) = api.manager.store.all()
    assert rec.state == State.failed
    assert rec.reason is not None and "crun: no such file" in rec.reason
    listed = api.client.get("/v1/sandboxes", params={"all": "true"}, headers=AUTH).json()["sandboxes"]
    assert [(s["state"], s["reason"]) for s in listed] == [("failed", rec.reason)]


def test_create_backend_error_keeps_its_message(api: Api) -> None:
    api.backend.create_error = BackendError("cgroup v2 is not mounted")
    reply = api.client.post("/v1/sandboxes", json={"image": IMAGE}, headers=AUTH)
    assert reply.status_code == 500
    assert error_of(reply) == {
        "code": "backend_error",
        "message": "cgroup v2 is not mounted",
        "detail": {},
    }


def test_unknown_route_is_404_in_the_error_format(api: Api) -> None:
    reply = api.client.get("/v1/nothing-here", headers=AUTH)
    assert reply.status_code == 404
    assert error_of(reply)["code"] == "not_found"


def test_wrong_method_is_405_in_the_error_format(api: Api) -> None:
    reply = api.client.put("/v1/health")
    assert reply.status_code == 405
    assert error_of(reply)["code"] == "method_not_allowed"


# ---- exec --------------------------------------------------------------------------------------------


def test_exec(api: Api) -> None:
    sid = api.create(env={"A": "1"})["id"]
    reply = api.client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "hi"], "env": {"B": "2"}}, headers=AUTH)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["exit_code"] == 0
    assert body["stdout"] == "echo hi\n"
    assert api.backend.execs[-1].env == {"A": "1", "B": "2"}


def test_exec_exit_code(api: Api) -> None:
    sid = api.create()["id"]
    api.backend.exit_code = 42
    body = api.client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "exit 42"}, headers=AUTH).json()
    assert body["exit_code"] == 42
    assert body["stdout"] == "/bin/sh -c exit 42\n"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"cmd": ""}, "cmd"),
        ({"cmd": "true", "timeout": -1}, "timeout"),
        ({"cmd": "true", "cwd": "tmp"}, "cwd"),
        ({"cmd": "true", "unknown": 1}, "unknown"),
        ({}, "cmd"),
    ],
)
def test_exec_rejects_bad_bodies(api: Api, body: dict[str, Any], needle: str) -> None:
    sid = api.create()["id"]
    reply = api.client.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=AUTH)
    assert reply.status_code == 400
    err = error_of(reply)
    assert err["code"] == "invalid_request"
    assert needle in err["message"]
    assert api.backend.execs == []


def test_exec_unknown_sandbox(api: Api) -> None:
    reply = api.client.post("/v1/sandboxes/sb-nope/exec", json={"cmd": "true"}, headers=AUTH)
    assert reply.status_code == 404
    assert error_of(reply)["code"] == "sandbox_not_found"


def test_kill_twice_then_exec_is_gone(api: Api) -> None:
    sid = api.create()["id"]
    first = api.client.delete(f"/v1/sandboxes/{sid}", headers=AUTH)
    second = api.client.delete(f"/v1/sandboxes/{sid}", headers=AUTH)
    assert first.status_code == second.status_code == 200
    assert first.json()["state"] == second.json()["state"] == "stopped"
    assert api.backend.destroyed == [sid]
    reply = api.client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}, headers=AUTH)
    assert reply.status_code == 410
    err = error_of(reply)
    assert err["code"] == "sandbox_gone"
    assert "killed by request" in err["message"]
    assert err["detail"] == {"state": "stopped"}
    files = api.client.get(f"/v1/sandboxes/{sid}/files", params={"path": "/x"}, headers=AUTH)
    assert files.status_code == 410


def test_ttl_reaping(api: Api) -> None:
    sid = api.create(timeout=600)["id"]
    other = api.create(timeout=600)["id"]
    rec = api.manager.record(sid)
    rec.expires_at = time.time() - 1
    api.manager.store.put(rec)
    assert api.client.portal is not None
    api.client.portal.call(api.manager.reap_once)
    body = api.client.get(f"/v1/sandboxes/{sid}", headers=AUTH).json()
    assert body["state"] == "stopped"
    assert "time to live" in body["reason"]
    assert api.client.get(f"/v1/sandboxes/{other}", headers=AUTH).json()["state"] == "running"
    reply = api.client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}, headers=AUTH)
    assert reply.status_code == 410
    assert "time to live" in error_of(reply)["message"]


def test_tiny_ttl_is_reaped(api: Api) -> None:
    sid = api.create(timeout=0.05)["id"]
    time.sleep(0.1)
    reply = api.client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}, headers=AUTH)
    assert reply.status_code == 410
    assert api.client.portal is not None
    api.client.portal.call(api.manager.reap_once)
    body = api.client.get(f"/v1/sandboxes/{sid}", headers=AUTH).json()
    assert (body["state"], body["reason"]) == ("stopped", "time to live expired")


# ---- streaming exec --------------------------------------------------------------------------------------


def test_exec_stream(api: Api) -> None:
    sid = api.create()["id"]
    reply = api.client.post(f"/v1/sandboxes/{sid}/exec/stream", json={"cmd": ["echo", "hi"]}, headers=AUTH)
    events = events_of(reply)
    assert events[0] == {"type": "stdout", "data": "echo hi\n"}
    assert events[-1]["type"] == "result"
    assert events[-1]["result"]["exit_code"] == 0
    assert events[-1]["result"]["stdout"] == "echo hi\n"
    assert [e["type"] for e in events].count("result") == 1


def test_exec_stream_multibyte_split_and_both_streams(api: Api) -> None:
    sid = api.create()["id"]
    api.backend.chunks = [("stdout", b"caf\xc3"), ("stderr", b"warn\n"), ("stdout", b"\xa9!\n")]
    api.backend.exit_code = 1
    events = events_of(api.client.post(f"/v1/sandboxes/{sid}/exec/stream", json={"cmd": "x"}, headers=AUTH))
    assert events[:-1] == [
        {"type": "stdout", "data": "caf"},
        {"type": "stderr", "data": "warn\n"},
        {"type": "stdout", "data": "é!\n"},
    ]
    assert events[-1]["type"] == "result"
    assert events[-1]["result"]["exit_code"] == 1
    assert events[-1]["result"]["stdout"] == "café!\n"


def test_exec_stream_respects_the_output_budget(api: Api) -> None:
    sid = api.create()["id"]
    api.backend.chunks = [("stdout", b"a" * 1000), ("stdout", b"b" * 1000), ("stdout", b"c" * 1000)]
    events = events_of(
        api.client.post(f"/v1/sandboxes/{sid}/exec/stream", json={"cmd": "x", "output_limit": 1024}, headers=AUTH)
    )
    streamed = "".join(e["data"] for e in events if e["type"] == "stdout")
    assert streamed == "a" * 1000 + "b" * 24
    assert events[-1]["type"] == "result"


def test_exec_stream_unknown_sandbox_is_404_before_streaming(api: Api) -> None:
    reply = api.client.post("/v1/sandboxes/sb-nope/exec/stream", json={"cmd": "true"}, headers=AUTH)
    assert reply.status_code == 404
    assert error_of(reply)["code"] == "sandbox_not_found"


def test_exec_stream_on_a_killed_sandbox_ends_in_an_error_event(api: Api) -> None:
    sid = api.create()["id"]
    api.client.delete(f"/v1/sandboxes/{sid}", headers=AUTH)
    events = events_of(api.client.post(f"/v1/sandboxes/{sid}/exec/stream", json={"cmd": "x"}, headers=AUTH))
    assert len(events) == 1
    assert events[0]["type"] == "error"
    assert events[0]["error"]["code"] == "sandbox_gone"


def test_exec_stream_internal_failure_still_ends_with_an_event(api: Api) -> None:
    sid = api.create()["id"]
    api.backend.exec_error = RuntimeError("backend bug")
    reply = api.client.post(f"/v1/sandboxes/{sid}/exec/stream", json={"cmd": "x"}, headers=AUTH)
    lines = reply.text.splitlines()
    assert lines, "the stream was empty"
    assert json.loads(lines[-1])["type"] in ("result", "error")


# ---- files ---------------------------------------------------------------------------------------------


def test_files_round_trip(api: Api) -> None:
    sid = api.create()["id"]
    url = f"/v1/sandboxes/{sid}/files"
    data = bytes(range(256)) * 4
    reply = api.client.put(url, params={"path": "/w/data.bin"}, content=data, headers=AUTH)
    assert reply.status_code == 204, reply.text
    reply = api.client.get(url, params={"path": "/w/data.bin"}, headers=AUTH)
    assert reply.status_code == 200
    assert reply.content == data
    assert reply.headers["content-type"] == "application/octet-stream"
    assert api.client.post(url + "/mkdir", params={"path": "/w/sub"}, headers=AUTH).status_code == 204
    listing = api.client.get(url + "/list", params={"path": "/w"}, headers=AUTH).json()["entries"]
    assert [(e["name"], e["type"]) for e in listing] == [("data.bin", "file"), ("sub", "dir")]
    reply = api.client.delete(url, params={"path": "/w"}, headers=AUTH)
    assert reply.status_code == 400
    reply = api.client.delete(url, params={"path": "/w", "recursive": "true"}, headers=AUTH)
    assert reply.status_code == 204
    reply = api.client.get(url, params={"path": "/w/data.bin"}, headers=AUTH)
    assert reply.status_code == 404
    assert error_of(reply)["code"] == "file_not_found"


def test_files_need_a_path(api: Api) -> None:
    sid = api.create()["id"]
    reply = api.client.get(f"/v1/sandboxes/{sid}/files", headers=AUTH)
    assert reply.status_code == 400
    assert error_of(reply)["code"] == "invalid_request"


def test_write_file_bad_mode(api: Api) -> None:
    sid = api.create()["id"]
    reply = api.client.put(
        f"/v1/sandboxes/{sid}/files", params={"path": "/x", "mode": 0o10000}, content=b"", headers=AUTH
    )
    assert reply.status_code == 400


def test_write_file_unknown_sandbox(api: Api) -> None:
    reply = api.client.put("/v1/sandboxes/sb-nope/files", params={"path": "/x"}, content=b"x", headers=AUTH)
    assert reply.status_code == 404


# ---- images ------------------------------------------------------------------------------------------------


def test_images(api: Api) -> None:
    reply = api.client.get("/v1/images", headers=AUTH)
    assert reply.status_code == 200
    images = {i["name"]: i for i in reply.json()["images"]}
    assert images[IMAGE]["ready"] is True
    assert images["dsec/debian:12"]["ready"] is False


def test_build_unknown_image(api: Api) -> None:
    reply = api.client.post("/v1/images/build", params={"name": "nobody/nothing"}, headers=AUTH)
    assert reply.status_code == 404
    assert error_of(reply)["code"] == "image_not_found"


# ---- readopt through the daemon's start ----------------------------------------------------------------


def test_readopt_on_start(workdir: Path, shared_app: tuple[FastAPI, ManagerSwitch]) -> None:
    app, switch = shared_app
    mgr, backend = new_manager(workdir)
    now = time.time()
    for sid in ("sb-alive", "sb-dead"):
        mgr.store.put(
            SandboxRecord(
                id=sid,
                kind="container",
                image=IMAGE,
                state=State.running,
                created_at=now,
                expires_at=now + 600,
                limits=Limits(),
            )
        )
    backend.dead.add("sb-dead")
    switch.target = mgr
    with TestClient(app) as client:
        alive = client.get("/v1/sandboxes/sb-alive", headers=AUTH).json()
        dead = client.get("/v1/sandboxes/sb-dead", headers=AUTH).json()
        assert alive["state"] == "running"
        assert alive["reason"] is None
        assert dead["state"] == "lost"
        assert "not running" in dead["reason"]
        live = client.get("/v1/sandboxes", headers=AUTH).json()["sandboxes"]
        assert [s["id"] for s in live] == ["sb-alive"]
        reply = client.post("/v1/sandboxes/sb-dead/exec", json={"cmd": "true"}, headers=AUTH)
        assert reply.status_code == 410
