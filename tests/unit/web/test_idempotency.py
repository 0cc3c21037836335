"""The Idempotency-Key middleware over a small ASGI app that counts the requests it runs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from dsec.web.errors import error_response
from dsec.web.idempotency import MAX_REPLAY_BODY, PACKED_COST, Entry, Idempotency, Memory, pack, unpack

from ..conftest import AUTH, Api

Message = dict[str, Any]


class Counter:
    """POST /run?status=N answers N with a body counting its runs; /stream answers in two chunks and
    can stop before its end (a stream whose client went away); /slow waits for ``release``."""

    def __init__(self) -> None:
        self.runs = 0
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.runs += 1
        run = self.runs
        path = scope["path"]
        if path == "/slow":
            await self.release.wait()
        status = int(dict(p.split("=") for p in scope["query_string"].decode().split("&") if p).get("status", 200))
        await send({"type": "http.response.start", "status": status, "headers": [(b"x-run", str(run).encode())]})
        if path == "/stream":
            await send({"type": "http.response.body", "body": b"first,", "more_body": True})
            if b"cut" in body:
                raise asyncio.CancelledError  # the client went away mid-stream: the app is cancelled
            await send({"type": "http.response.body", "body": b"second"})
            return
        if path == "/big":
            await send({"type": "http.response.body", "body": b"x" * (MAX_REPLAY_BODY + 1)})
            return
        await send({"type": "http.response.body", "body": json.dumps({"run": run, "body": body.decode()}).encode()})


async def call(
    app: Any,
    path: str,
    *,
    key: str | None = "k1",
    body: bytes = b"{}",
    method: str = "POST",
    token: str = "t",
    query: str = "",
) -> tuple[int, dict[str, str], bytes]:
    headers = [(b"authorization", f"Bearer {token}".encode())]
    if key is not None:
        headers.append((b"idempotency-key", key.encode()))
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": headers,
    }
    sent = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        if sent:
            return sent.pop()
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    out: list[Message] = []

    async def send(message: Message) -> None:
        out.append(message)

    try:
        await app(scope, receive, send)
    except asyncio.CancelledError:
        pass
    start = next(m for m in out if m["type"] == "http.response.start")
    got = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    return start["status"], got, b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body")


@pytest.fixture
def app() -> tuple[Counter, Idempotency]:
    inner = Counter()
    return inner, Idempotency(inner, error=error_response)


async def test_a_repeat_is_answered_from_memory_and_runs_once(app: tuple[Counter, Idempotency]) -> None:
    inner, mw = app
    first = await call(mw, "/run")
    again = await call(mw, "/run")
    assert inner.runs == 1
    assert again[0] == first[0] == 200 and again[2] == first[2]
    assert again[1]["idempotent-replayed"] == "true" and "idempotent-replayed" not in first[1]
    assert again[1]["x-run"] == "1"


async def test_without_a_key_or_for_a_read_every_request_runs(app: tuple[Counter, Idempotency]) -> None:
    inner, mw = app
    await call(mw, "/run", key=None)
    await call(mw, "/run", key=None)
    await call(mw, "/run", method="GET")
    await call(mw, "/run", method="GET")
    assert inner.runs == 4


async def test_a_repeat_while_the_first_runs_waits_for_its_answer(app: tuple[Counter, Idempotency]) -> None:
    inner, mw = app
    inner.release.clear()
    first = asyncio.create_task(call(mw, "/slow"))
    second = asyncio.create_task(call(mw, "/slow"))
    await asyncio.sleep(0.05)
    assert inner.runs == 1 and not second.done()
    inner.release.set()
    a, b = await asyncio.gather(first, second)
    assert inner.runs == 1 and a[2] == b[2]


@pytest.mark.parametrize("status", [429, 499, 503])
async def test_an_answer_that_means_nothing_happened_is_not_kept(app: tuple[Counter, Idempotency], status: int) -> None:
    inner, mw = app
    assert (await call(mw, "/run", query=f"status={status}"))[0] == status
    assert (await call(mw, "/run"))[0] == 200
    assert inner.runs == 2


async def test_errors_are_kept_like_any_answer(app: tuple[Counter, Idempotency]) -> None:
    inner, mw = app
    await call(mw, "/run", query="status=409")
    assert (await call(mw, "/run", query="status=409"))[0] == 409
    assert inner.runs == 1


async def test_a_key_names_one_request(app: tuple[Counter, Idempotency]) -> None:
    inner, mw = app
    await call(mw, "/run", body=b'{"cmd": "a"}')
    for other in (
        {"body": b'{"cmd": "b"}'},
        {"path": "/other"},
        {"query": "x=1"},
        {"method": "DELETE"},
    ):
        kwargs: dict[str, Any] = {"path": "/run", **other}
        status, _, body = await call(mw, **kwargs)
        assert status == 409 and json.loads(body)["error"]["code"] == "idempotency_conflict"
    assert inner.runs == 1


async def test_keys_are_scoped_to_the_caller(app: tuple[Counter, Idempotency]) -> None:
    inner, mw = app
    await call(mw, "/run", token="alice")
    bob = await call(mw, "/run", token="bob")
    assert inner.runs == 2 and "idempotent-replayed" not in bob[1]


async def test_a_stream_cut_off_is_not_run_again(app: tuple[Counter, Idempotency]) -> None:
    inner, mw = app
    await call(mw, "/stream", body=b"cut")
    status, _, body = await call(mw, "/stream", body=b"cut")
    assert status == 409 and b"cut off" in body and inner.runs == 1
    whole = await call(mw, "/stream", key="k2")
    assert (await call(mw, "/stream", key="k2"))[2] == whole[2] == b"first,second"
    assert inner.runs == 2


async def test_an_answer_too_large_to_keep_is_not_run_again(app: tuple[Counter, Idempotency]) -> None:
    inner, mw = app
    await call(mw, "/big")
    status, _, body = await call(mw, "/big")
    assert status == 409 and b"too large" in body and inner.runs == 1


async def test_a_malformed_key_is_refused(app: tuple[Counter, Idempotency]) -> None:
    inner, mw = app
    for key in ("", "x" * 256, "has space"):
        status, _, body = await call(mw, "/run", key=key)
        assert status == 400 and json.loads(body)["error"]["code"] == "invalid_request"
    assert inner.runs == 0


async def test_memory_is_bounded_by_count_and_by_age() -> None:
    inner = Counter()
    memory = Memory(window=0.05, max_entries=3)
    mw = Idempotency(inner, error=error_response, memory=memory)
    for i in range(10):
        await call(mw, "/run", key=f"k{i}")
    assert len(memory) == 3
    await call(mw, "/run", key="k9")  # still remembered
    assert inner.runs == 10
    await asyncio.sleep(0.1)
    await call(mw, "/run", key="k9")  # forgotten after the window: runs again
    assert inner.runs == 11 and len(memory) == 1


async def test_the_memory_counts_at_least_what_its_answers_really_cost() -> None:
    """``Memory.bytes`` is what /metrics reports and what bounds the memory: measured with tracemalloc
    over a thousand kept answers shaped like the API's (a JSON body of about a kilobyte, four headers),
    it must not understate what they hold, nor overstate it wildly."""
    import tracemalloc

    body = json.dumps({"id": "sb-0123456789ab", "labels": {"task": "x" * 40}, "pad": "y" * 900}).encode()
    headers = [
        (b"content-length", str(len(body)).encode()),
        (b"content-type", b"application/json"),
        (b"x-request-id", b"0123456789abcdef0123456789abcdef"),
        (b"date", b"Sat, 05 Dec 2026 13:00:00 GMT"),
    ]

    async def api(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": list(headers)})
        await send({"type": "http.response.body", "body": body})

    memory = Memory()
    mw = Idempotency(api, error=error_response, memory=memory)
    await call(mw, "/warm", key="warm")  # first-call allocations (caches, interned names) are not the entries'
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        counted = memory.held
        for i in range(1000):
            await call(mw, f"/sandboxes/sb-{i:012d}/exec", key=f"key-{i:032d}")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = memory.held - counted
    assert len(memory) == 1001
    assert held <= counted <= 2 * held, (held, counted)


async def test_a_kept_answer_is_one_packed_object_and_its_bytes_go_when_forgotten() -> None:
    inner = Counter()
    memory = Memory(window=0.05)
    mw = Idempotency(inner, error=error_response, memory=memory)
    inner.release.clear()
    first = asyncio.create_task(call(mw, "/slow"))
    await asyncio.sleep(0.01)
    repeat = asyncio.create_task(call(mw, "/slow"))  # waits for the first: the only entry given an event
    await asyncio.sleep(0.01)
    assert len(memory) == 1 and not isinstance(next(iter(memory._entries.values())), bytes)  # still runs
    inner.release.set()
    (s1, h1, b1), (s2, h2, b2) = await asyncio.gather(first, repeat)
    assert (s1, b1) == (s2, b2) and h2.get("idempotent-replayed") == "true" and inner.runs == 1
    assert h2["x-run"] == h1["x-run"]  # the headers come back as they were
    for i in range(5):
        await call(mw, "/run", key=f"n{i}")
    kept = list(memory._entries.values())
    assert len(kept) == 6 and all(isinstance(v, bytes) for v in kept)
    assert memory.held == sum(PACKED_COST + len(v) for v in kept)
    await asyncio.sleep(0.1)
    await call(mw, "/run", key="last")  # the window passed: the others are forgotten
    assert len(memory) == 1 and memory.held == PACKED_COST + len(next(iter(memory._entries.values())))


def test_packing_keeps_every_field() -> None:
    entry = Entry(b"POST /v1/x?a=1", 123.5, body_digest=b"d" * 32, status=201, complete=True)
    entry.headers = ((b"content-type", b"application/json"), (b"x-empty", b""))
    entry.body = bytearray(b'{"ok": true}')
    entry.settle()
    back = unpack(pack(entry))
    assert (back.request, back.expires, back.body_digest, back.status, back.headers, back.body, back.complete) == (
        entry.request, entry.expires, entry.body_digest, 201, entry.headers, b'{"ok": true}', True
    )  # fmt: skip
    cut = Entry(b"POST /s?", 1.0, status=200)  # cut off: no body, no digest
    cut.body = bytearray(b"partial")
    cut.settle()
    back = unpack(pack(cut))
    assert (back.body, back.body_digest, back.complete, back.settled) == (None, None, False, True)


def _gauge(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f'{name}{{api="node"}}')))


def test_metrics_show_what_the_node_api_remembers(api: Api) -> None:
    """The operator can see the memory grow with each kept answer (the soak counts it as memory the daemon
    legitimately holds)."""
    text = api.client.get("/metrics", headers=AUTH).text
    keys, held = _gauge(text, "dsec_idempotency_keys"), _gauge(text, "dsec_idempotency_bytes")
    for i in range(3):
        reply = api.client.post(
            "/v1/sandboxes", json={"image": "dsec/none:1"}, headers=AUTH | {"idempotency-key": f"m{i}"}
        )
        assert reply.status_code == 404, reply.text  # an answer all the same: kept for a repeat
    text = api.client.get("/metrics", headers=AUTH).text
    assert _gauge(text, "dsec_idempotency_keys") == keys + 3
    assert _gauge(text, "dsec_idempotency_bytes") >= held + 3 * 400
    assert _gauge(text, "dsec_idempotency_bytes_limit") == 64 << 20
