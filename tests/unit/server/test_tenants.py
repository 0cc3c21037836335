"""Tenants over the HTTP API (FakeBackend): tokens, isolation of sandboxes and images, the audit log."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from dsec.core.manager import SandboxManager
from dsec.images.store import ImageStore
from dsec.store.records import SandboxRecord
from dsec.store.tenants import TOKEN_PREFIX, TenantStore
from dsec.tenancy import OPERATOR, Caller

from ...fakes.backend import FakeBackend
from ..conftest import AUTH, IMAGE, Api, new_manager

MISSING = "sb-000000000000"  # the shape of a real id, never issued


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def add_tenant(api: Api, name: str) -> dict[str, str]:
    reply = api.client.post("/v1/tenants", json={"name": name}, headers=AUTH)
    assert reply.status_code == 201, reply.text
    body = reply.json()
    assert body["name"] == name and body["token"].startswith(TOKEN_PREFIX)
    return bearer(body["token"])


def create(api: Api, who: dict[str, str], **extra: object) -> str:
    reply = api.client.post("/v1/sandboxes", json={"image": IMAGE, **extra}, headers=who)
    assert reply.status_code == 201, reply.text
    sid: str = reply.json()["id"]
    return sid


@pytest.fixture
def two(api: Api) -> tuple[dict[str, str], dict[str, str]]:
    return add_tenant(api, "alice"), add_tenant(api, "bob")


# ---- tenant administration ----------------------------------------------------------------------------


def test_tenant_token_is_shown_once_and_stored_only_as_a_hash(api: Api, workdir: Path) -> None:
    reply = api.client.post("/v1/tenants", json={"name": "alice"}, headers=AUTH)
    token = reply.json()["token"]
    assert len(token) >= len(TOKEN_PREFIX) + 43  # 256 random bits
    listed = api.client.get("/v1/tenants", headers=AUTH).json()["tenants"]
    assert [(t["name"], t["operator"]) for t in listed] == [("admin", True), ("alice", False)]
    assert token not in json.dumps(listed)
    for f in (workdir / "state").iterdir():
        assert token.encode() not in f.read_bytes(), f
    assert api.client.get("/v1/sandboxes", headers=bearer(token)).status_code == 200


@pytest.mark.parametrize(
    "name", ["", "A", "Alice", "-a", "a_b", "a/b", "a b", "a.b", "é", "a" * 64, 5, None, ["a"], "a\n"]
)
def test_bad_tenant_names_are_400(api: Api, name: object) -> None:
    reply = api.client.post("/v1/tenants", json={"name": name}, headers=AUTH)
    assert reply.status_code == 400, (name, reply.text)
    assert reply.json()["error"]["code"] == "invalid_request"
    assert [t["name"] for t in api.client.get("/v1/tenants", headers=AUTH).json()["tenants"]] == ["admin"]


def test_longest_tenant_name_is_fine(api: Api) -> None:
    add_tenant(api, "a" * 63)
    add_tenant(api, "0-9")


@pytest.mark.parametrize("name", ["alice", "admin"])
def test_duplicate_tenant_is_409(api: Api, name: str) -> None:
    add_tenant(api, "alice")
    reply = api.client.post("/v1/tenants", json={"name": name}, headers=AUTH)
    assert reply.status_code == 409
    assert reply.json()["error"]["code"] == "tenant_exists"


def test_only_the_operator_manages_tenants(api: Api, two: tuple[dict[str, str], dict[str, str]]) -> None:
    alice, _ = two
    for method, url, body in [
        ("POST", "/v1/tenants", {"name": "eve"}),
        ("GET", "/v1/tenants", None),
        ("DELETE", "/v1/tenants/bob", None),
        ("DELETE", "/v1/tenants/alice", None),
        ("POST", "/v1/images/gc", None),
        ("POST", "/v1/images/import", {"name": "x/y:1", "path": "/etc"}),
    ]:
        reply = api.client.request(method, url, json=body, headers=alice)
        assert reply.status_code == 403, (method, url, reply.text)
        assert reply.json()["error"]["code"] == "forbidden"
    names = [t["name"] for t in api.client.get("/v1/tenants", headers=AUTH).json()["tenants"]]
    assert names == ["admin", "alice", "bob"]


def test_removing_a_tenant_revokes_its_token_and_kills_its_sandboxes(
    api: Api, two: tuple[dict[str, str], dict[str, str]]
) -> None:
    alice, bob = two
    mine = [create(api, alice), create(api, alice)]
    theirs = create(api, bob)
    reply = api.client.delete("/v1/tenants/alice", headers=AUTH)
    assert reply.status_code == 200, reply.text
    assert sorted(reply.json()["killed"]) == sorted(mine)
    assert api.client.get("/v1/sandboxes", headers=alice).status_code == 401
    assert api.client.get("/v1/sandboxes", headers=alice).json()["error"]["code"] == "unauthorized"
    for sid in mine:
        assert api.client.get(f"/v1/sandboxes/{sid}", headers=AUTH).json()["state"] == "stopped"
    assert api.client.get(f"/v1/sandboxes/{theirs}", headers=bob).json()["state"] == "running"
    listed = {t["name"]: t for t in api.client.get("/v1/tenants", headers=AUTH).json()["tenants"]}
    assert listed["alice"]["revoked_at"] is not None and listed["bob"]["revoked_at"] is None
    # the name is not given to anyone else: images and audit records still name it
    again = api.client.post("/v1/tenants", json={"name": "alice"}, headers=AUTH)
    assert again.status_code == 409
    assert api.client.delete("/v1/tenants/nobody", headers=AUTH).status_code == 404
    assert api.client.delete("/v1/tenants/admin", headers=AUTH).status_code == 403


# ---- sandboxes ----------------------------------------------------------------------------------------

# A valid request for every route that names a sandbox, so that bob's request reaches the ownership
# check instead of failing validation. A new route must be added here (the test fails until it is).
REQUESTS: dict[tuple[str, str], dict[str, Any]] = {
    ("GET", ""): {},
    ("DELETE", ""): {},
    ("POST", "/exec"): {"json": {"cmd": "true"}},
    ("POST", "/exec/stream"): {"json": {"cmd": "true"}},
    ("GET", "/files"): {"params": {"path": "/secret"}},
    ("PUT", "/files"): {"params": {"path": "/planted"}, "content": b"x"},
    ("DELETE", "/files"): {"params": {"path": "/secret"}},
    ("GET", "/files/list"): {"params": {"path": "/"}},
    ("POST", "/files/mkdir"): {"params": {"path": "/newdir"}},
    ("PUT", "/archive"): {"params": {"path": "/"}, "content": b"\0" * 1024},
    ("GET", "/archive"): {"params": {"path": "/"}},
    ("POST", "/snapshot"): {"json": {"name": "bob/stolen:1"}},
    ("POST", "/pause"): {},
    ("POST", "/resume"): {},
    ("POST", "/fork"): {"json": {"n": 1}},
    ("GET", "/network"): {},
    ("GET", "/usage"): {},
    ("GET", "/execs/live"): {},
    ("PUT", "/network"): {"json": "full"},
    ("GET", "/ports"): {},
    ("POST", "/ports"): {"json": {"port": 8000}},
    ("DELETE", "/ports/{port}"): {},
    ("POST", "/code"): {"json": {"code": "1"}},
    ("GET", "/code/contexts"): {},
    ("DELETE", "/code/contexts/{context}"): {},
    ("POST", "/grade"): {"json": {"cmd": "true", "paths": ["/work"], "tests": {"t.sh": "exit 0"}}},
    ("GET", "/checkpoints"): {},
    ("POST", "/checkpoints"): {"json": {"name": "stolen"}},
    ("DELETE", "/checkpoints/{checkpoint}"): {},
    ("POST", "/rollback"): {"json": {"checkpoint": "c1"}},
}


def sandbox_routes(api: Api) -> list[tuple[str, str]]:
    found = []
    for path, methods in api.client.app.openapi()["paths"].items():  # type: ignore[attr-defined]
        if "{sandbox_id}" in path:
            suffix = path.split("{sandbox_id}", 1)[1]
            found += [(m.upper(), suffix) for m in sorted(methods)]
    return found


def test_every_sandbox_route_answers_another_tenants_sandbox_like_a_missing_one(
    api: Api, two: tuple[dict[str, str], dict[str, str]]
) -> None:
    alice, bob = two
    routes = sandbox_routes(api)
    assert len(routes) >= 16
    unknown = [r for r in routes if r not in REQUESTS]
    assert not unknown, f"add a request for these routes to REQUESTS: {unknown}"
    sid = create(api, alice)
    api.client.put(f"/v1/sandboxes/{sid}/files", params={"path": "/secret"}, content=b"alice's", headers=alice)
    for method, suffix in routes:
        kwargs = REQUESTS[(method, suffix)]
        path = suffix.replace("{port}", "8000").replace("{context}", "default").replace("{checkpoint}", "c1")
        theirs = api.client.request(method, f"/v1/sandboxes/{sid}{path}", headers=bob, **kwargs)
        missing = api.client.request(method, f"/v1/sandboxes/{MISSING}{path}", headers=bob, **kwargs)
        assert theirs.status_code == 404, (method, suffix, theirs.text)
        assert theirs.text.replace(sid, MISSING) == missing.text, (method, suffix)
        assert theirs.headers.get("content-type") == missing.headers.get("content-type")
    # nothing happened to it
    info = api.client.get(f"/v1/sandboxes/{sid}", headers=alice).json()
    assert info["state"] == "running" and info["owner"] == "alice"
    assert api.backend.files[sid] == {"/secret": b"alice's"}
    assert api.backend.execs == []
    assert [r.id for r in api.manager.store.all()] == [sid]  # no fork copies, no snapshot


def test_the_owner_and_the_operator_can_act_on_it(api: Api, two: tuple[dict[str, str], dict[str, str]]) -> None:
    alice, _ = two
    sid = create(api, alice)
    for who in (alice, AUTH):
        reply = api.client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "hi"]}, headers=who)
        assert reply.status_code == 200 and reply.json()["stdout"] == "echo hi\n"
        assert api.client.get(f"/v1/sandboxes/{sid}/network", headers=who).status_code == 200
    assert api.client.delete(f"/v1/sandboxes/{sid}", headers=AUTH).json()["state"] == "stopped"


def test_lists_show_only_the_callers_own_and_the_operator_everything(
    api: Api, two: tuple[dict[str, str], dict[str, str]]
) -> None:
    alice, bob = two
    a = create(api, alice, labels={"job": "1"})
    b = create(api, bob, labels={"job": "1"})
    o = create(api, AUTH)

    def ids(who: dict[str, str], **params: Any) -> list[str]:
        reply = api.client.get("/v1/sandboxes", params={"label": "job=1", **params}, headers=who)
        return [s["id"] for s in reply.json()["sandboxes"]]

    assert ids(alice) == [a] and ids(bob) == [b]
    everything = api.client.get("/v1/sandboxes", headers=AUTH).json()["sandboxes"]
    assert {(s["id"], s["owner"]) for s in everything} == {(a, "alice"), (b, "bob"), (o, "admin")}
    api.client.delete(f"/v1/sandboxes/{a}", headers=alice)
    assert ids(alice, all="true") == [a] and ids(bob, all="true") == [b]


@contextlib.asynccontextmanager
async def _checkpoint(rec: SandboxRecord) -> AsyncIterator[str]:
    yield f"memory of {rec.id}"


def test_fork_copies_belong_to_the_parents_tenant(api: Api, two: tuple[dict[str, str], dict[str, str]]) -> None:
    alice, bob = two
    backend = api.backend

    async def restore(rec: SandboxRecord, parent: SandboxRecord, checkpoint: str) -> None:
        await backend.create(rec, backend.images[parent.id])

    backend.checkpoint = _checkpoint  # type: ignore[method-assign,assignment]
    backend.restore = restore  # type: ignore[method-assign]
    sid = create(api, alice)
    for who in (alice, AUTH):  # the operator forking alice's sandbox makes alice's copies too
        reply = api.client.post(f"/v1/sandboxes/{sid}/fork", json={"n": 2}, headers=who)
        assert reply.status_code == 201, reply.text
        copies = [s["id"] for s in reply.json()["sandboxes"]]
        assert [s["owner"] for s in reply.json()["sandboxes"]] == ["alice", "alice"]
        for copy in copies:
            assert api.client.get(f"/v1/sandboxes/{copy}", headers=alice).status_code == 200
            assert api.client.get(f"/v1/sandboxes/{copy}", headers=bob).status_code == 404
    assert api.client.post(f"/v1/sandboxes/{sid}/fork", json={"n": 1}, headers=bob).status_code == 404
    assert len(api.client.get("/v1/sandboxes", headers=alice).json()["sandboxes"]) == 5


# ---- images -------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _upper(tmp: Path) -> AsyncIterator[Path]:
    await asyncio.to_thread(tmp.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread((tmp / "answer.txt").write_text, "42\n")
    yield tmp


@pytest.fixture
def snapshots(api: Api, workdir: Path) -> Iterator[None]:
    api.backend.frozen_upper = lambda rec: _upper(workdir / "uppers" / rec.id)  # type: ignore[method-assign]
    yield


def snapshot(api: Api, who: dict[str, str], sid: str, name: str) -> Any:
    return api.client.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": name}, headers=who)


def test_a_tenants_image_is_invisible_and_unusable_to_others(
    api: Api, two: tuple[dict[str, str], dict[str, str]], snapshots: None
) -> None:
    alice, bob = two
    sid = create(api, alice)
    made = snapshot(api, alice, sid, "alice/env:1")
    assert made.status_code == 201, made.text
    assert made.json()["owner"] == "alice"

    def names(who: dict[str, str]) -> set[str]:
        return {i["name"] for i in api.client.get("/v1/images", headers=who).json()["images"]}

    assert "alice/env:1" in names(alice) and "alice/env:1" in names(AUTH)
    assert "alice/env:1" not in names(bob) and IMAGE in names(bob)
    for method, url, kwargs in [
        ("GET", "/v1/image", {"params": {"name": "{}"}}),
        ("GET", "/v1/image/history", {"params": {"name": "{}"}}),
        ("GET", "/v1/image/stats", {"params": {"name": "{}"}}),
        ("DELETE", "/v1/image", {"params": {"name": "{}"}}),
        ("POST", "/v1/images/build", {"params": {"name": "{}"}}),
        ("POST", "/v1/sandboxes", {"json": {"image": "{}"}}),
        ("POST", "/v1/images/builds", {"json": {"spec": {"name": "bob/b:1", "from": "{}", "steps": []}}}),
    ]:

        def fill(value: Any, name: str) -> Any:
            return json.loads(json.dumps(value).replace("{}", name))

        theirs = api.client.request(method, url, headers=bob, **fill(kwargs, "alice/env:1"))
        missing = api.client.request(method, url, headers=bob, **fill(kwargs, "alice/nope:1"))
        assert theirs.status_code == 404, (method, url, theirs.text)
        assert theirs.text.replace("alice/env:1", "alice/nope:1") == missing.text, (method, url)
    # the name is taken: bob is told so, not by whom
    bobs = create(api, bob)
    taken = snapshot(api, bob, bobs, "alice/env:1")
    assert taken.status_code == 409 and "alice" not in taken.json()["error"]["message"].replace("alice/env:1", "")
    # alice and the operator use it
    assert create(api, alice, image="alice/env:1") and create(api, AUTH, image="alice/env:1")
    info = api.client.get("/v1/image", params={"name": "alice/env:1"}, headers=AUTH).json()
    assert info["owner"] == "alice"


def test_public_images_are_read_only_for_tenants(
    api: Api, two: tuple[dict[str, str], dict[str, str]], snapshots: None
) -> None:
    alice, bob = two
    assert api.client.get("/v1/image", params={"name": IMAGE}, headers=bob).json()["owner"] is None
    reply = api.client.delete("/v1/image", params={"name": IMAGE}, headers=bob)
    assert reply.status_code == 403 and reply.json()["error"]["code"] == "forbidden"
    # the operator's snapshots are public; a tenant may not plant an image under dsec/
    sid = create(api, AUTH)
    assert snapshot(api, AUTH, sid, "shared/env:1").json()["owner"] is None
    assert create(api, bob, image="shared/env:1")
    bobs = create(api, bob)
    planted = snapshot(api, bob, bobs, "dsec/debian:12")
    assert planted.status_code == 403, planted.text
    # the owner removes its own; the operator removes anyone's
    snapshot(api, alice, create(api, alice), "alice/a:1")
    snapshot(api, alice, create(api, alice), "alice/b:1")
    assert api.client.delete("/v1/image", params={"name": "alice/a:1"}, headers=bob).status_code == 404
    assert api.client.delete("/v1/image", params={"name": "alice/a:1"}, headers=alice).status_code == 204
    assert api.client.delete("/v1/image", params={"name": "alice/b:1"}, headers=AUTH).status_code == 204
    assert api.client.delete("/v1/image", params={"name": "shared/env:1"}, headers=AUTH).status_code == 409  # in use


def test_builds_belong_to_the_tenant_and_its_cache_is_its_own(
    api: Api, two: tuple[dict[str, str], dict[str, str]], snapshots: None
) -> None:
    alice, bob = two
    api.backend.check_network = lambda policy: None  # type: ignore[method-assign]  # builders run with "full"
    layers = api.manager.images.layers

    async def unmounted(digest: str) -> Path:  # the fake backend needs no mounted layers
        return layers.blobs / digest

    layers.mount = unmounted  # type: ignore[method-assign]

    def build(who: dict[str, str], name: str) -> Any:
        spec = {"name": name, "from": IMAGE, "steps": [{"run": "echo built > /answer"}]}
        reply = api.client.post("/v1/images/builds", json={"spec": spec}, headers=who)
        assert reply.status_code == 201, reply.text
        return reply.json()

    first = build(alice, "alice/built:1")
    assert first["image"]["owner"] == "alice" and [s["cached"] for s in first["steps"]] == [False]
    assert build(alice, "alice/built:2")["steps"][0]["cached"] is True
    assert build(bob, "bob/built:1")["steps"][0]["cached"] is False  # not alice's layer
    assert build(AUTH, "shared/built:1")["steps"][0]["cached"] is False
    assert build(AUTH, "shared/built:2")["steps"][0]["cached"] is True
    hidden = api.client.get("/v1/image", params={"name": "alice/built:1"}, headers=bob)
    assert hidden.status_code == 404
    spec = {"name": "dsec/busybox:2", "from": IMAGE, "steps": []}
    planted = api.client.post("/v1/images/builds", json={"spec": spec}, headers=bob)
    assert planted.status_code == 403


# ---- the audit log ------------------------------------------------------------------------------------


def audit(api: Api, who: dict[str, str], **params: Any) -> list[dict[str, Any]]:
    reply = api.client.get("/v1/audit", params=params, headers=who)
    assert reply.status_code == 200, reply.text
    records: list[dict[str, Any]] = reply.json()["records"]
    return records


def test_every_call_is_audited_with_tenant_route_sandbox_and_status(
    api: Api, two: tuple[dict[str, str], dict[str, str]]
) -> None:
    alice, bob = two
    sid = create(api, alice)
    long_cmd = "echo " + "é" * 300
    api.client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": long_cmd}, headers=alice)
    api.client.post(f"/v1/sandboxes/{sid}/exec/stream", json={"cmd": ["ls", "/"]}, headers=alice)
    api.client.put(f"/v1/sandboxes/{sid}/files", params={"path": "/f"}, content=b"FILE-BODY-SECRET", headers=alice)
    api.client.get(f"/v1/sandboxes/{sid}", headers=bob)  # denied: 404
    api.client.get("/v1/sandboxes", headers=bearer("wrong-token"))  # refused: 401
    api.client.post("/v1/sandboxes", content=b"{not json", headers=bearer("wrong-token"))  # refused, not parsed
    api.client.get("/v1/health")  # no token needed: not audited
    mine = audit(api, alice)
    got = [(r["method"], r["route"], r["sandbox"], r["status"]) for r in mine]
    assert got == [
        ("POST", "/v1/sandboxes", sid, 201),
        ("POST", "/v1/sandboxes/{sandbox_id}/exec", sid, 200),
        ("POST", "/v1/sandboxes/{sandbox_id}/exec/stream", sid, 200),
        ("PUT", "/v1/sandboxes/{sandbox_id}/files", sid, 204),
    ]
    assert all(r["tenant"] == "alice" and r["duration_ms"] >= 0 for r in mine)
    assert mine[1]["command"] == long_cmd.encode()[:256].decode(errors="ignore")
    assert len(mine[1]["command"].encode()) <= 256 and mine[2]["command"] == "ls /"
    assert mine[0]["command"] is None and mine[3]["command"] is None
    # bob's denied attempt is his; the refused ones belong to nobody and only the operator sees them
    assert [(r["route"], r["status"], r["sandbox"]) for r in audit(api, bob)] == [
        ("/v1/sandboxes/{sandbox_id}", 404, sid),
    ]
    everything = audit(api, AUTH)
    refused = [(r["route"], r["status"]) for r in everything if r["tenant"] is None]
    assert refused == [("/v1/sandboxes", 401), ("/v1/sandboxes", 401)]
    assert {r["tenant"] for r in everything} == {"admin", "alice", "bob", None}
    text = (api.manager.state_dir / "audit.db").read_bytes()
    assert b"FILE-BODY-SECRET" not in text and b"wrong-token" not in text
    for f in api.manager.state_dir.iterdir():
        assert not re.search(rb"dsect_[A-Za-z0-9_-]{20}", f.read_bytes()), f


def test_audit_filters(api: Api, two: tuple[dict[str, str], dict[str, str]]) -> None:
    alice, bob = two
    a, b = create(api, alice), create(api, bob)
    for _ in range(3):
        api.client.post(f"/v1/sandboxes/{a}/exec", json={"cmd": "true"}, headers=alice)
    api.client.post(f"/v1/sandboxes/{b}/exec", json={"cmd": "true"}, headers=bob)
    assert [r["sandbox"] for r in audit(api, AUTH, sandbox=a)] == [a] * 4
    assert audit(api, bob, sandbox=a) == []  # alice's sandbox: none of bob's calls touched it
    assert [r["route"] for r in audit(api, alice, limit=2)] == ["/v1/sandboxes/{sandbox_id}/exec"] * 2
    assert {r["tenant"] for r in audit(api, AUTH, tenant="bob")} == {"bob"}
    assert {r["tenant"] for r in audit(api, alice, tenant="bob")} == {"alice"}  # a tenant sees only its own
    later = audit(api, AUTH, since="2999-01-01T00:00:00Z")
    assert later == []
    for bad in ({"limit": 0}, {"limit": 10_001}, {"since": "yesterday"}, {"sandbox": "x" * 65}):
        assert api.client.get("/v1/audit", params=bad, headers=AUTH).status_code == 400, bad


def test_audit_pages_back_with_until(api: Api, two: tuple[dict[str, str], dict[str, str]]) -> None:
    alice, _ = two
    sid = create(api, alice)
    for i in range(9):
        api.client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": f"echo {i}"}, headers=alice)
    # read by the operator, whose own reads of the audit log are not alice's records
    everything = audit(api, AUTH, tenant="alice", limit=10_000)
    assert len(everything) == 10
    got: list[dict[str, Any]] = []
    until: str | None = None
    while page := audit(api, AUTH, tenant="alice", limit=3, **({"until": until} if until else {})):
        assert (
            len(page) <= 3 or len({r["time"] for r in page[: len(page) - 2]}) == 1
        )  # beyond the limit: its oldest µs only
        got = page + got
        until = page[0]["time"]  # the oldest received, sent back as received
    assert got == everything
    assert [r["command"] for r in got[1:]] == [f"echo {i}" for i in range(9)]
    # as epoch seconds too; strictly before: the record at that time is not repeated
    oldest = datetime.fromisoformat(everything[5]["time"].replace("Z", "+00:00"))
    assert audit(api, AUTH, tenant="alice", until=str(oldest.timestamp())) == everything[:5]
    assert audit(api, AUTH, tenant="alice", until=everything[5]["time"], limit=2) == everything[3:5]
    assert audit(api, AUTH, tenant="alice", until="1970-01-02T00:00:00Z") == []
    # a tenant's until applies to its own records only
    assert {r["tenant"] for r in audit(api, alice, tenant="bob", until="2999-01-01T00:00:00Z")} == {"alice"}
    assert api.client.get("/v1/audit", params={"until": "tomorrow"}, headers=AUTH).status_code == 400


# ---- persistence --------------------------------------------------------------------------------------


async def test_tenants_ownership_and_audit_survive_a_restart(workdir: Path) -> None:
    mgr, _ = new_manager(workdir)
    await mgr.start()
    mgr.tenants.set_operator_token("op")
    _, token = mgr.tenants.add("alice")
    alice = mgr.tenants.identify(token)
    assert alice == Caller("alice")
    from dsec.protocol.sandbox import CreateSandbox
    from dsec.store.audit import Entry

    info = await mgr.create(CreateSandbox(image=IMAGE), caller=alice)
    mgr.audit.record(Entry(time.time(), "alice", "POST", "/v1/sandboxes", info.id, 201, 1.5))
    await mgr.close()

    again = SandboxManager(
        state_dir=workdir / "state", images=ImageStore(workdir / "images", lazy=False, mount=False), kinds=["container"]
    )
    again.backends["container"] = FakeBackend(again.ctx)
    await again.start()
    try:
        assert again.tenants.identify(token) == alice
        assert again.tenants.identify("op") == OPERATOR
        assert again.info(info.id, caller=alice).owner == "alice"
        with pytest.raises(LookupError):
            again.info(info.id, caller=Caller("bob"))
        assert [s.id for s in again.list(caller=alice)] == [info.id]
        assert again.list(caller=Caller("bob")) == []
        records = await again.audit.query()
        assert [(r.tenant, r.sandbox, r.status) for r in records] == [("alice", info.id, 201)]
    finally:
        await again.close()


def test_tenant_store_state_is_its_own_table(workdir: Path) -> None:
    path = workdir / "t.db"
    store = TenantStore(path)
    store.set_operator_token("op-1")
    _, tok = store.add("x")
    store.set_operator_token("op-2")  # the token file was replaced: the old one stops working
    assert store.identify("op-1") is None and store.identify("op-2") == OPERATOR
    assert store.identify(tok) == Caller("x") and store.identify("") is None and store.identify(b"\xff") is None
    store.close()
    store = TenantStore(path)
    assert store.identify("op-2") == OPERATOR and store.identify(tok) == Caller("x")
    store.revoke("x")
    assert store.identify(tok) is None
    store.close()
    fresh = TenantStore(workdir / "fresh.db")  # no operator row yet: "admin" is still not a tenant's name
    with pytest.raises(FileExistsError):
        fresh.add("admin")
    fresh.close()
    assert TenantStore(path).identify(tok) is None
