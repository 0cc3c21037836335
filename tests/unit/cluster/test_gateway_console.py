"""The gateway serves the console too: a login with the cluster's token gives a session whose calls
reach the merged API; and a list's page is cut from all nodes together."""

from __future__ import annotations

import httpx
import pytest

import dsec

from ...fakes.cluster import TOKEN, Harness

pytestmark = pytest.mark.timeout(30)


async def test_a_page_of_the_merged_list_is_newest_first_with_the_total(cluster: Harness) -> None:
    c = dsec.AsyncClient(url=cluster.url, token=TOKEN)
    made = [await dsec.AsyncSandbox.create(image="x", client=c) for _ in range(5)]
    async with httpx.AsyncClient(base_url=cluster.url, headers={"authorization": f"Bearer {TOKEN}"}) as h:
        r = await h.get("/v1/sandboxes", params={"limit": 2, "offset": 1})
        assert r.status_code == 200, r.text
        assert r.json()["total"] == 5
        assert [s["id"] for s in r.json()["sandboxes"]] == [made[3].id, made[2].id]
        r = await h.get("/v1/sandboxes", params={"limit": 0})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    await c.aclose()


async def test_the_console_logs_in_with_the_clusters_token(cluster: Harness) -> None:
    async with httpx.AsyncClient(base_url=cluster.url) as h:
        assert (await h.post("/ui/login", json={"token": "not-it"})).status_code == 401
        r = await h.post("/ui/login", json={"token": TOKEN})
        assert r.status_code == 200 and r.json()["caller"] == {"name": "operator", "operator": True}
        assert r.json()["cluster"] is True  # the page shows the nodes
        csrf = r.json()["csrf"]
        assert (await h.get("/v1/sandboxes")).status_code == 200  # the cookie stands for the token
        r = await h.post("/v1/sandboxes", json={"image": "x"})
        assert r.status_code == 403  # no CSRF header
        r = await h.post("/v1/sandboxes", json={"image": "x"}, headers={"x-csrf-token": csrf})
        assert r.status_code == 201, r.text
        assert (await h.get("/v1/cluster")).json()["nodes"]
        r = await h.get("/ui/")
        assert r.status_code in (200, 503) and "script-src 'self'" in r.headers["content-security-policy"]
