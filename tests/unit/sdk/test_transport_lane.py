"""The SDK's calls with a JSON or no body go to its own transport as bytes (Transport._raw_request):
what reaches the server is what httpx would have sent, and the answer is read the same way."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httptools
import pytest

from dsec.errors import InvalidState, SandboxTimeout
from dsec.sdk.transport import Transport

ANSWER = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'


class Seen:
    """A request as the server parsed it."""

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.done = False
        self.parser = httptools.HttpRequestParser(self)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert name.lower() not in self.headers, f"header {name!r} sent twice"
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.method = self.parser.get_method()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = True


class Server:
    """A unix-socket server answering ``answers`` in turn (default ANSWER), recording each request and
    how many writes of the client it took; ``close_after``: requests after which it hangs up."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[Seen] = []
        self.reads: list[int] = []
        self.answers: list[bytes] = []
        self.close_after = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen, reads = Seen(), 0
            while not seen.done:
                data = await reader.read(1 << 16)
                if not data:
                    writer.close()
                    return
                reads += 1
                seen.parser.feed_data(data)
            self.seen.append(seen)
            self.reads.append(reads)
            writer.write(self.answers.pop(0) if self.answers else ANSWER)
            await writer.drain()
            if self.close_after and len(self.seen) % self.close_after == 0:
                writer.close()
                return


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    s = Server(tmp_path / "d.sock")
    srv = await asyncio.start_unix_server(s.handle, path=str(s.path))
    async with srv:
        yield s


def _comparable(seen: Seen) -> tuple[bytes, bytes, dict[bytes, bytes], object]:
    headers = dict(seen.headers)
    headers.pop(b"idempotency-key", None)  # a fresh one per call
    return seen.method, seen.url, headers, json.loads(seen.body) if seen.body else None


async def test_a_json_call_sends_what_httpx_sends_in_one_write(server: Server) -> None:
    t = Transport(url=f"unix://{server.path}", token="tok")
    body = {"cmd": ["echo", "é"], "timeout": 1.5, "env": {}}
    reply = await t.request("POST", "/v1/sandboxes/sb-1/exec", json=body, headers={"Dsec-Seq": "3"})
    assert reply.status_code == 200 and reply.json() == {"ok": True}
    # the same call through httpx (a query string keeps it off the lane)
    await t.request("POST", "/v1/sandboxes/sb-1/exec?x=1", json=body, headers={"Dsec-Seq": "3"})
    lane, via_httpx = server.seen
    assert lane.url == b"/v1/sandboxes/sb-1/exec" and via_httpx.url == b"/v1/sandboxes/sb-1/exec?x=1"
    assert lane.body == via_httpx.body  # byte for byte: a retry's idempotency digest depends on it
    assert _comparable(lane)[0::2] == _comparable(via_httpx)[0::2]
    assert lane.headers[b"authorization"] == b"Bearer tok" and lane.headers[b"idempotency-key"]
    assert server.reads[0] == 1  # head and body in one write
    await t.aclose()


async def test_a_call_without_a_body_and_one_with_a_callers_header(server: Server) -> None:
    t = Transport(url=f"unix://{server.path}", token="tok")
    await t.request("DELETE", "/v1/sandboxes/sb-1", headers={"Authorization": "Bearer other"})
    await t.request("GET", "/v1/sandboxes/sb-1")
    delete, get = server.seen
    assert delete.method == b"DELETE" and delete.headers[b"content-length"] == b"0"
    assert delete.headers[b"authorization"] == b"Bearer other"  # the call's own header wins, once
    assert get.method == b"GET" and b"content-length" not in get.headers and b"idempotency-key" not in get.headers
    await t.aclose()


async def test_a_connection_the_server_closed_is_replaced_and_errors_are_raised(server: Server) -> None:
    t = Transport(url=f"unix://{server.path}", token="tok")
    server.close_after = 1  # every pooled connection is dead when reused
    for _ in range(3):
        reply = await t.request("POST", "/v1/sandboxes/sb-1/exec", json={"cmd": "true"})
        assert reply.json() == {"ok": True}
    assert len(server.seen) == 3
    error = b'{"error":{"code":"invalid_state","message":"not now","detail":{}}}'
    server.answers = [b"HTTP/1.1 409 Conflict\r\ncontent-length: %d\r\n\r\n%s" % (len(error), error)]
    with pytest.raises(InvalidState, match="not now"):
        await t.request("POST", "/v1/sandboxes/sb-1/exec", json={"cmd": "true"})
    await t.aclose()


async def test_swapped_clients_and_event_hooks_keep_httpx(server: Server) -> None:
    t = Transport(url=f"unix://{server.path}", token="tok")
    seen: list[str] = []

    async def hook(request: object) -> None:
        seen.append(str(getattr(request, "url", "")))

    t.http.event_hooks["request"].append(hook)
    await t.request("GET", "/v1/health")
    assert seen == ["http://dsec/v1/health"]
    assert t._raw_request("GET", "/v1/health", {"headers": {}}) is None
    t.http.event_hooks["request"].clear()
    assert t._raw_request("GET", "/v1/health", {"headers": {}}) is not None
    assert t._raw_request("GET", "/v1/files", {"headers": {}, "params": {"path": "/x"}}) is None
    assert t._raw_request("GET", "/v1/a b", {"headers": {}}) is None
    assert t._raw_request("GET", "/v1/x", {"headers": {"X-Bad": "a\r\nb"}}) is None
    await t.aclose()


async def test_an_answer_that_does_not_come_is_a_timeout(tmp_path: Path) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await asyncio.sleep(5)
        writer.close()

    path = tmp_path / "silent.sock"
    async with await asyncio.start_unix_server(silent, path=str(path)):
        t = Transport(url=f"unix://{path}", token="tok")
        with pytest.raises(SandboxTimeout):
            await t.request("POST", "/v1/sandboxes/sb-1/exec", json={"cmd": "true"}, timeout=0.2)
        with pytest.raises(SandboxTimeout):  # and through httpx (a query string keeps it off the lane)
            await t.request("GET", "/v1/sandboxes?x=1", timeout=0.2)
        await t.aclose()
