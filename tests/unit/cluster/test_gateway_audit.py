"""GET /v1/audit through the gateway: every node's records merged by time, paged back with ``until``.

The fake nodes (tests/fakes/cluster.py) answer the audit route here from a real AuditLog each, through the
daemon's own record conversion, so the gateway merges what nodes really send."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Request

from dsec.protocol.sandbox import AuditList
from dsec.server.tenant_routes import _record
from dsec.store.audit import AuditLog, Entry

from ...fakes.cluster import TOKEN, Harness, start

AUTH = {"authorization": f"Bearer {TOKEN}"}
BASE = 1_733_241_600.0


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[Harness, dict[str, AuditLog]]]:
    h = await start({"a": 8.0, "b": 8.0, "c": 8.0})
    logs: dict[str, AuditLog] = {}
    for fake in h.fakes:
        logs[fake.name] = AuditLog(tmp_path / f"{fake.name}.db")
        fake.app.add_api_route("/v1/audit", _route(logs[fake.name]), methods=["GET"])
    try:
        yield h, logs
    finally:
        for log in logs.values():
            await log.close()
        await h.close()


def _route(log: AuditLog) -> Callable[[Request], Awaitable[dict[str, Any]]]:
    async def audit(request: Request) -> dict[str, Any]:
        q = request.query_params
        until = datetime.fromisoformat(q["until"]).timestamp() if "until" in q else None
        entries = await log.query(until=until, limit=int(q.get("limit", "100")))
        return AuditList(records=[_record(e) for e in entries]).model_dump(mode="json")

    return audit


async def test_the_gateway_merges_by_time_and_pages_back_with_until(
    cluster: tuple[Harness, dict[str, AuditLog]],
) -> None:
    h, logs = cluster
    times: dict[str, list[float]] = {"a": [], "b": [], "c": []}
    for i in range(30):
        times["abc"[i % 3]].append(BASE + i * 0.01)
    times["a"].append(BASE + 1)  # a whole second: its time has no fraction on the wire ("…:01Z")
    times["b"].append(BASE + 0.9999995)  # just before it
    for name in ("a", "b", "c"):  # three calls on three nodes in one microsecond
        times[name].append(BASE + 0.5000001)
    for name, ts in times.items():
        for t in ts:
            logs[name].record(Entry(t, "alice", "GET", f"/v1/{name}/{t:.7f}", None, 200, 0.1))
    want = sorted(r for ts in times.values() for r in ts)

    async with httpx.AsyncClient(base_url=h.url, headers=AUTH, timeout=30) as http:
        reply = await http.get("/v1/audit", params={"limit": 1000})
        assert reply.status_code == 200, reply.text
        everything = reply.json()["records"]
        assert [r["time"] for r in everything] == [_wire(t) for t in want]  # one order, by time
        assert everything[-2]["time"].endswith(":00.999999Z") and everything[-1]["time"].endswith(":01Z")
        for limit in (1, 2, 5, 7):
            pages: list[list[dict[str, Any]]] = []
            params: dict[str, Any] = {"limit": limit}
            while page := (await http.get("/v1/audit", params=params)).json()["records"]:
                pages.insert(0, page)
                params["until"] = page[0]["time"]  # the oldest received
            assert [r for p in pages for r in p] == everything, limit
        # a page of one holds the three calls of that microsecond, from the three nodes
        reply = await http.get("/v1/audit", params={"limit": 1, "until": _wire(BASE + 0.51)})
        assert sorted(r["route"].split("/")[2] for r in reply.json()["records"]) == ["a", "b", "c"]


def _wire(t: float) -> str:
    """The time as a node writes it."""
    wire: str = _record(Entry(t, None, "GET", "/", None, 200, 0.0)).model_dump(mode="json")["time"]
    return wire
