"""The SDK's unix-socket transport against small scripted HTTP servers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from dsec.sdk.transport import make_http
from dsec.sdk.uds import TcpTransport, UnixTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + (await reader.readexactly(length) if length else b"")


async def serve(tmp_path: Path, handler: Handler) -> tuple[asyncio.AbstractServer, str, list[int]]:
    path = str(tmp_path / "s.sock")
    connections = [0]

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(on_conn, path)
    return server, path, connections


async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        req = await read_request(reader)
        body = b"echo:" + req.split(b"\r\n\r\n", 1)[1]
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()


async def test_round_trips_reuse_one_connection(tmp_path: Path) -> None:
    server, path, conns = await serve(tmp_path, keep_alive)
    async with httpx.AsyncClient(transport=UnixTransport(path), base_url="http://x") as client:
        for i in range(5):
            reply = await client.post("/p", content=f"m{i}".encode())
            assert reply.status_code == 200 and reply.content == f"echo:m{i}".encode()
    assert conns[0] == 1
    server.close()


async def test_a_connection_closed_by_the_server_is_not_reused(tmp_path: Path) -> None:
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    server, path, conns = await serve(tmp_path, one_then_close)
    async with httpx.AsyncClient(transport=UnixTransport(path), base_url="http://x") as client:
        for _ in range(3):
            assert (await client.get("/")).content == b"ok"
        # immediately after a response the close may not have reached us: the request still succeeds
        assert (await client.post("/", content=b"again")).content == b"ok"
    assert conns[0] == 4
    server.close()


async def test_chunked_and_streamed_bodies(tmp_path: Path) -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (b"first\n", b"second\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    server, path, _ = await serve(tmp_path, chunked)
    async with httpx.AsyncClient(transport=UnixTransport(path), base_url="http://x") as client:
        async with client.stream("GET", "/") as reply:
            lines = [line async for line in reply.aiter_lines()]
        assert lines == ["first", "second"]
    server.close()


async def test_truncated_response_is_an_error_not_a_short_body(tmp_path: Path) -> None:
    async def truncated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly-part")
        await writer.drain()

    server, path, _ = await serve(tmp_path, truncated)
    async with httpx.AsyncClient(transport=UnixTransport(path), base_url="http://x") as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get("/")
    server.close()


async def test_missing_socket_is_a_connect_error(tmp_path: Path) -> None:
    async with httpx.AsyncClient(transport=UnixTransport(str(tmp_path / "none")), base_url="http://x") as client:
        with pytest.raises(httpx.ConnectError):
            await client.get("/")


async def test_read_timeout(tmp_path: Path) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    server, path, _ = await serve(tmp_path, silent)
    async with httpx.AsyncClient(transport=UnixTransport(path), base_url="http://x") as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.get("/", timeout=0.2)
    server.close()


async def test_the_same_transport_over_tcp_keeps_its_connection_and_sends_the_host() -> None:
    seen: list[bytes] = []
    conns = [0]

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns[0] += 1
        try:
            while True:
                req = await read_request(reader)
                seen.append(req)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with httpx.AsyncClient(transport=TcpTransport("127.0.0.1", port), base_url=f"http://127.0.0.1:{port}") as c:
        for _ in range(3):
            assert (await c.get("/v1/health")).content == b"ok"
    assert conns[0] == 1 and len(seen) == 3
    assert f"host: 127.0.0.1:{port}".encode() in seen[0].lower()
    server.close()


def test_plain_http_urls_get_the_fast_transport_and_https_keeps_httpx() -> None:
    assert isinstance(make_http("http://10.0.0.1:7070", "t")._transport, TcpTransport)
    assert isinstance(make_http("unix:///run/dsec.sock", "t")._transport, UnixTransport)
    assert not isinstance(make_http("https://gw.example:443", "t")._transport, UnixTransport)
    assert not isinstance(make_http("http://gw.example/prefix", "t")._transport, UnixTransport)
