"""Fake node daemons for the gateway's tests: the node API's shape (status, create, batch, list, info,
kill, exec, streamed exec, trajectory info, metrics, a port's traffic) over real HTTP on loopback, no
sandboxes behind.

Each fake is a real uvicorn server, so the gateway's own connections, pooling and streaming are the
ones exercised, and stopping a fake is what losing a node looks like from the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from dsec.cluster.gateway import Gateway
from dsec.cluster.nodes import NodeSet
from dsec.cluster.runner import node_api, server
from dsec.protocol.node import BatchCreate, BatchEvent, NodeStatus, Ratios, Resources
from dsec.protocol.sandbox import CreateSandbox, ExecRequest, Limits, SandboxInfo, State

TOKEN = "cluster-token"
_ids = itertools.count(1)


def status(name: str, free_cpu: float, alloc_cpu: float = 8.0, queued: int = 0) -> NodeStatus:
    gib = 1 << 30
    alloc = Resources(cpu=alloc_cpu, memory=64 * gib)
    return NodeStatus(
        node=name,
        version="test",
        kinds=["container"],
        capacity=Resources(cpu=alloc_cpu / 8, memory=64 * gib),
        ratios=Ratios(cpu=8.0, memory=1.0),
        allocatable=alloc,
        requested=Resources(cpu=alloc_cpu - free_cpu, memory=0),
        free=Resources(cpu=free_cpu, memory=64 * gib),
        used=Resources(cpu=0.0, memory=0),
        sandboxes={},
        queued=queued,
        starting={},
        start_slots={"container": 8},
        memory_pressure=0.1,
        evictions=0,
    )


def all_of(want: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in want.items())


def overloaded(name: str) -> JSONResponse:
    body = {"error": {"code": "overloaded", "message": f"{name} is full", "detail": {"retry_after": 2.0}}}
    return JSONResponse(body, status_code=429, headers={"Retry-After": "2"})


class FakeNode:
    def __init__(self, name: str, free_cpu: float = 8.0) -> None:
        self.name = name
        self.free_cpu = free_cpu
        self.full = False  # answer every creation 429
        self.overload_after: int | None = None  # in a batch, answer items past this many 'overloaded'
        self.sandboxes: dict[str, SandboxInfo] = {}
        self.trajectories: dict[str, str] = {}  # id -> sandbox id (a shared log would hold it)
        self.creates = 0
        self.stall = False  # hold every creation until its caller (the gateway) goes away
        self.status_delay = 0.0  # seconds before answering GET /v1/node (a node slow to answer)
        self.left = 0  # creations whose caller went away while held
        self.files: dict[tuple[str, str], bytes] = {}
        self.release = asyncio.Event()  # a streamed exec waits for it after its first line
        self.app = self._app()
        self.srv: Any = None
        self.task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def make(self, req: CreateSandbox) -> SandboxInfo:
        now = datetime.now(UTC)
        info = SandboxInfo(
            id=f"sb-{self.name}-{next(_ids)}",
            kind=req.kind,
            image=req.image,
            state=State.running,
            created_at=now,
            expires_at=now + timedelta(seconds=req.timeout),
            limits=req.limits,
            labels=req.labels,
            node=self.name,
            trajectory=req.trajectory,
        )
        self.sandboxes[info.id] = info
        self.free_cpu -= req.limits.cpu
        if req.trajectory:
            self.trajectories[req.trajectory] = info.id
        return info

    def _app(self) -> FastAPI:
        app = FastAPI()
        node = self

        @app.middleware("http")
        async def auth(request: Request, call_next: Any) -> Response:
            open_paths = request.url.path == "/v1/health" or request.url.path.startswith("/ports/")
            if not open_paths and request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse({"error": {"code": "unauthorized", "message": "no", "detail": {}}}, 401)
            response: Response = await call_next(request)
            return response

        @app.get("/v1/node")
        async def node_status() -> Response:
            await asyncio.sleep(node.status_delay)
            return Response(status(node.name, node.free_cpu).model_dump_json(), media_type="application/json")

        @app.post("/v1/sandboxes", status_code=201)
        async def create(body: CreateSandbox, request: Request) -> Response:
            node.creates += 1
            if node.stall:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                node.left += 1
                return Response(status_code=499)
            if node.full:
                return overloaded(node.name)
            info = node.make(body)
            return Response(info.model_dump_json(), status_code=201, media_type="application/json")

        @app.post("/v1/sandboxes/batch")
        async def batch(body: BatchCreate) -> StreamingResponse:
            async def lines() -> AsyncIterator[str]:
                made = 0
                for i in range(body.count):
                    await asyncio.sleep(0)
                    if node.full or (node.overload_after is not None and made >= node.overload_after):
                        err = {"code": "overloaded", "message": f"{node.name} is full", "detail": {"retry_after": 1}}
                        yield json.dumps({"index": i, "error": err}) + "\n"
                        continue
                    trajectory = body.trajectories[i] if body.trajectories else None
                    spec = CreateSandbox.model_validate({**body.sandbox.model_dump(), "trajectory": trajectory})
                    made += 1
                    event = BatchEvent(index=i, sandbox=node.make(spec))
                    yield event.model_dump_json(exclude_defaults=True) + "\n"
                yield json.dumps({"done": True, "created": made, "failed": body.count - made}) + "\n"

            return StreamingResponse(lines(), media_type="application/x-ndjson")

        @app.get("/v1/sandboxes")
        async def listing(request: Request, all: bool = False) -> dict[str, Any]:
            want = dict(item.partition("=")[::2] for item in request.query_params.getlist("label"))
            infos = [i for i in node.sandboxes.values() if (all or i.state == State.running) and all_of(want, i.labels)]
            return {"sandboxes": [i.model_dump(mode="json") for i in infos]}

        @app.get("/v1/sandboxes/{sid}")
        async def info(sid: str) -> Response:
            if sid not in node.sandboxes:
                body = {"error": {"code": "sandbox_not_found", "message": f"no sandbox {sid}", "detail": {}}}
                return JSONResponse(body, 404)
            return Response(node.sandboxes[sid].model_dump_json(), media_type="application/json")

        @app.delete("/v1/sandboxes/{sid}")
        async def kill(sid: str) -> Response:
            info = node.sandboxes[sid] = node.sandboxes[sid].model_copy(update={"state": State.stopped})
            return Response(info.model_dump_json(), media_type="application/json")

        @app.post("/v1/sandboxes/{sid}/exec")
        async def run(sid: str, body: ExecRequest, request: Request) -> dict[str, Any]:
            seq = request.headers.get("dsec-seq")
            return {"exit_code": 0, "stdout": f"{node.name}:{sid}:{body.cmd}:{seq}\n"}

        @app.post("/v1/sandboxes/{sid}/exec/stream")
        async def stream(sid: str, body: ExecRequest) -> StreamingResponse:
            async def events() -> AsyncIterator[bytes]:
                yield json.dumps({"type": "stdout", "data": "first\n"}).encode() + b"\n"
                await node.release.wait()
                yield json.dumps({"type": "stdout", "data": "second\n"}).encode() + b"\n"
                yield json.dumps({"type": "result", "result": {"exit_code": 0}}).encode() + b"\n"

            return StreamingResponse(events(), media_type="application/x-ndjson")

        @app.put("/v1/sandboxes/{sid}/files", status_code=204)
        async def write(sid: str, path: str, request: Request) -> Response:
            node.files[(sid, path)] = await request.body()
            return Response(status_code=204)

        @app.get("/v1/sandboxes/{sid}/files")
        async def read(sid: str, path: str) -> Response:
            return Response(node.files[(sid, path)], media_type="application/octet-stream")

        @app.get("/v1/trajectories/info")
        async def trajectory(id: str) -> Response:
            if id not in node.trajectories:
                body = {"error": {"code": "not_found", "message": f"no trajectory {id}", "detail": {}}}
                return JSONResponse(body, 404)
            now = datetime.now(UTC).isoformat()
            info = {
                "id": id,
                "sandbox_id": node.trajectories[id],
                "kind": "container",
                "image": "x",
                "created_at": now,
                "updated_at": now,
                "length": 3,
                "closed": False,
                "rebuilds": 0,
            }
            return JSONResponse(info)

        @app.api_route("/ports/{rest:path}", methods=["GET", "POST", "PUT"])
        async def port(rest: str, request: Request) -> Response:
            """A sandbox's port, as the node's proxy takes it (no token): what reached the node, said
            back; the secret ``wrong`` is refused as the node refuses any wrong address."""
            if rest.split("/")[2:3] == ["wrong"]:
                return JSONResponse({"error": {"code": "not_found", "message": "no such port", "detail": {}}}, 404)
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
            said = {"node": node.name, "method": request.method, "target": request.scope["raw_path"].decode()}
            said |= {"query": request.url.query, "size": size, "headers": [list(h) for h in request.headers.items()]}
            return JSONResponse(said)

        @app.get("/metrics")
        async def metrics() -> Response:
            text = "# HELP dsec_sandboxes Live.\n# TYPE dsec_sandboxes gauge\n"
            text += f'dsec_sandboxes{{kind="container"}} {len(node.sandboxes)}\n'
            return Response(text, media_type="text/plain")

        return app

    async def start(self) -> None:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.srv = uvicorn.Server(config)
        self.task = asyncio.create_task(self.srv.serve())
        while not self.srv.started:  # noqa: ASYNC110 (uvicorn sets a flag, no event)
            await asyncio.sleep(0.01)
        self.port = self.srv.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Like a node going away: the listener closes, open connections are dropped."""
        self.release.set()
        if self.srv is not None and self.task is not None:
            self.srv.should_exit = True
            self.srv.force_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.task, 10)


class Harness:
    def __init__(self, fakes: list[FakeNode], gateway: Gateway, srv: Any, task: asyncio.Task[None]) -> None:
        self.fakes = fakes
        self.gateway = gateway
        self.srv = srv
        self.task = task

    @property
    def url(self) -> str:
        port = self.srv.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def fake(self, name: str) -> FakeNode:
        return next(f for f in self.fakes if f.name == name)

    async def close(self) -> None:
        self.srv.should_exit = True
        await asyncio.gather(asyncio.wait_for(self.task, 10), *(f.stop() for f in self.fakes))


async def start(
    free: dict[str, float], *, interval: float = 0.05, misses: int = 2, status_delay: float = 0.0, heard: bool = True
) -> Harness:
    """``heard`` False: the gateway has not had the nodes' first answers when this returns (a gateway
    just started), and its own polls are what bring them."""
    fakes = [FakeNode(name, cpu) for name, cpu in free.items()]
    for f in fakes:
        f.status_delay = status_delay
        await f.start()
    nodes = NodeSet(TOKEN, interval=interval, misses=misses)
    for f in fakes:
        nodes.add(f.url)
    gateway = Gateway(nodes, TOKEN)
    srv = server(node_api(gateway), "127.0.0.1", 0)
    task = asyncio.create_task(srv.serve())
    while not srv.started:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    if heard:
        await nodes.check_all()  # the first statuses, without waiting for a poll
    else:
        nodes.start()
    return Harness(fakes, gateway, srv, task)


def default_limits() -> Limits:
    return Limits()
