"""Named volumes over the HTTP API (FakeBackend, a host that pretends to mount): the routes, their
errors and statuses, tenants' ownership, and a sandbox's volumes in its info."""

from __future__ import annotations

from ...fakes.volumes import FakeHost
from ..conftest import AUTH, IMAGE, Api
from .test_tenants import add_tenant


def test_volume_routes(api: Api) -> None:
    api.manager.volumes.host = FakeHost()
    c = api.client
    made = c.post("/v1/volumes", json={"name": "data", "size": "32Mi"}, headers=AUTH)
    assert made.status_code == 201, made.text
    assert made.json()["size"] == 32 << 20 and made.json()["owner"] is None
    again = c.post("/v1/volumes", json={"name": "data"}, headers=AUTH)
    assert (again.status_code, again.json()["error"]["code"]) == (409, "volume_exists")
    assert c.post("/v1/volumes", json={"name": "Data"}, headers=AUTH).status_code == 400
    assert c.post("/v1/volumes", json={"name": "d", "size": 1024}, headers=AUTH).status_code == 400
    assert [v["name"] for v in c.get("/v1/volumes", headers=AUTH).json()["volumes"]] == ["data"]

    both = {"/a": "data", "/b": ["data", "ro"]}
    twice = c.post("/v1/sandboxes", json={"image": IMAGE, "volumes": both}, headers=AUTH)
    assert twice.status_code == 400 and "mounted twice" in twice.json()["error"]["message"]
    missing = c.post("/v1/sandboxes", json={"image": IMAGE, "volumes": {"/a": "nope"}}, headers=AUTH)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "volume_not_found")

    sb = api.create(volumes={"/data": "data"})
    assert sb["volumes"] == [{"path": "/data", "name": "data", "mode": "rw"}]
    assert c.get(f"/v1/sandboxes/{sb['id']}", headers=AUTH).json()["volumes"] == sb["volumes"]
    second = c.post("/v1/sandboxes", json={"image": IMAGE, "volumes": {"/data": "data"}}, headers=AUTH)
    assert (second.status_code, second.json()["error"]["code"]) == (409, "volume_in_use")
    assert c.get("/v1/volumes/data", headers=AUTH).json()["users"] == [{"sandbox": sb["id"], "mode": "rw"}]
    busy = c.delete("/v1/volumes/data", headers=AUTH)
    assert (busy.status_code, busy.json()["error"]["code"]) == (409, "volume_in_use")
    assert c.delete(f"/v1/sandboxes/{sb['id']}", headers=AUTH).status_code == 200
    assert c.delete("/v1/volumes/data", headers=AUTH).status_code == 204
    gone = c.get("/v1/volumes/data", headers=AUTH)
    assert (gone.status_code, gone.json()["error"]["code"]) == (404, "volume_not_found")
    assert c.get("/v1/volumes/Bad%20Name", headers=AUTH).status_code == 400


def test_tenants_own_their_volumes(api: Api) -> None:
    api.manager.volumes.host = FakeHost()
    c = api.client
    alice, bob = add_tenant(api, "alice"), add_tenant(api, "bob")
    assert c.post("/v1/volumes", json={"name": "mine", "size": "16Mi"}, headers=alice).json()["owner"] == "alice"
    assert c.post("/v1/volumes", json={"name": "shared", "size": "16Mi"}, headers=AUTH).status_code == 201
    assert [v["name"] for v in c.get("/v1/volumes", headers=bob).json()["volumes"]] == ["shared"]
    assert c.get("/v1/volumes/mine", headers=bob).status_code == 404
    assert c.delete("/v1/volumes/mine", headers=bob).status_code == 404
    assert c.delete("/v1/volumes/shared", headers=bob).status_code == 403
    ro = c.post("/v1/sandboxes", json={"image": IMAGE, "volumes": {"/s": ["shared", "ro"]}}, headers=bob)
    assert ro.status_code == 201, ro.text
    rw = c.post("/v1/sandboxes", json={"image": IMAGE, "volumes": {"/s": "shared"}}, headers=bob)
    assert rw.status_code == 403
    theirs = c.post("/v1/sandboxes", json={"image": IMAGE, "volumes": {"/m": "mine"}}, headers=bob)
    assert theirs.status_code == 404
    assert c.delete("/v1/volumes/mine", headers=alice).status_code == 204
